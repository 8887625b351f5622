"""L3 backend on a real Mooncake Store (``mooncake.store.MooncakeDistributedStore``).

* **Start.** The master and the HTTP metadata server are probed with a plain TCP connect first
  (``connect_timeout_s``): the native ``setup()`` retries an unreachable master for about 90 s,
  which is no way to find out that L3 is off. Unreachable or a failed ``setup()`` →
  :class:`engine.core.errors.StorageError`.
* **Zero copy.** Objects move with ``batch_put_from_multi_buffers`` /
  ``batch_get_into_multi_buffers`` straight from / into memory registered with
  :meth:`register_memory` (the L3 store registers the host pool and its header arena). Parts in
  unregistered memory go through a registered staging buffer; objects larger than it use the
  copying API.
* **Faults.** Every operation first asks ``health_check()`` (a cached flag of the client's
  master-ping thread; sub-microsecond). A failed check or an RPC failure counts an error and opens
  an exponential backoff (``backoff_initial_s`` doubling to ``backoff_max_s``): until it expires
  operations answer misses / failed puts at once instead of waiting on RPC timeouts. The native
  client reconnects to the master by itself; the first operation after the backoff that finds the
  client healthy closes the breaker.
"""

from __future__ import annotations

import ctypes
import logging
import socket
import threading
import urllib.parse
from typing import Any, Sequence

import numpy as np

from engine.core.errors import StorageError
from engine.storage.backend import Backoff, Buffer, Counters, GetStatus, byte_view, check_batch
from engine.storage.config import BackendKind, MooncakeStoreConfig, StorageConfig
from engine.storage.keys import check_key

log = logging.getLogger("hicache.storage")

# Mooncake ErrorCode values (mooncake-store/include/types.h) the backend tells apart.
_NO_AVAILABLE_HANDLE = -200     # store full: a failed put, not an outage
_INVALID_PARAMS = -600          # get: buffers smaller than the object
_REPLICA_IS_NOT_READY = -703
_OBJECT_NOT_FOUND = -704
_OBJECT_ALREADY_EXISTS = -705
_TRANSFER_FAIL = -800           # get: also answered when buffers exceed the object
_OUTAGE = {-900, -901, -1010, -1011}  # RPC_FAIL, RPC_TIMEOUT, UNAVAILABLE_IN_CURRENT_*


def _addr(view: memoryview) -> int:
    """Address of a buffer's first byte (the native API takes raw pointers)."""
    if not len(view):
        return 0
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(view))     # writable: fast
    except TypeError:
        return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)  # read-only


def probe_tcp(hostport: str, timeout_s: float, what: str) -> None:
    host, _, port = hostport.rpartition(":")
    host = host.strip("[]") or "127.0.0.1"
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except (OSError, ValueError) as e:
        raise StorageError(f"mooncake {what} {hostport} is unreachable "
                           f"({getattr(e, 'strerror', None) or e}); L3 storage is off") from None


class MooncakeBackend:
    kind = BackendKind.MOONCAKE
    prefers_batches = True

    def __init__(self, config: MooncakeStoreConfig | None = None):
        cfg = self.config = config or MooncakeStoreConfig()
        probe_tcp(cfg.master_server_address, cfg.connect_timeout_s, "master")
        meta = urllib.parse.urlparse(cfg.metadata_server)
        if meta.scheme in ("http", "https"):
            probe_tcp(f"{meta.hostname}:{meta.port or (443 if meta.scheme == 'https' else 80)}",
                      cfg.connect_timeout_s, "metadata server")
        try:
            from mooncake.store import MooncakeDistributedStore, ReplicateConfig
        except ImportError as e:
            raise StorageError(
                f"the Mooncake Store client cannot be loaded ({e}); install "
                "mooncake-transfer-engine-non-cuda (CPU) or mooncake-transfer-engine (CUDA), "
                "and the system libraries libibverbs1 and libnuma1") from None
        store = MooncakeDistributedStore()
        rc = store.setup(cfg.local_hostname, cfg.metadata_server, cfg.global_segment_size,
                         cfg.local_buffer_size, cfg.protocol, cfg.device_name,
                         cfg.master_server_address)
        if rc != 0:
            raise StorageError(f"mooncake setup against master {cfg.master_server_address} "
                               f"failed (code {rc}); L3 storage is off")
        self._store = store
        self._rconf = ReplicateConfig()
        self._rconf.replica_num = cfg.replica_num
        self._lock = threading.Lock()         # one batch at a time through the staging buffer
        self._regions: dict[int, int] = {}    # start address -> length, registered with the store
        self._staging = np.empty(cfg.staging_bytes, dtype=np.uint8)
        self._staging_addr = int(self._staging.ctypes.data)
        if cfg.staging_bytes and store.register_buffer(self._staging_addr, cfg.staging_bytes):
            store.close()
            raise StorageError("mooncake: cannot register the staging buffer")
        self._regions[self._staging_addr] = cfg.staging_bytes
        self._backoff = Backoff(cfg.backoff_initial_s, cfg.backoff_max_s)
        self._closed = False
        self.counters = Counters("puts", "put_failed", "gets", "hits", "misses", "errors",
                                 "unavailable", "reconnects", "staged_bytes", "quarantined")

    @classmethod
    def from_config(cls, config: StorageConfig) -> "MooncakeBackend":
        return cls(config.mooncake)

    @property
    def client(self):
        """The native ``MooncakeDistributedStore`` (benchmarks' raw baseline, diagnostics)."""
        return self._store

    # -- availability ------------------------------------------------------------------------
    def _available(self) -> bool:
        if self._closed:
            return False
        if not self._backoff.ready():
            self.counters.add("unavailable")
            return False
        if self._store.health_check() != 0:
            self._failed("health check: master unreachable")
            return False
        return True

    def _failed(self, why: str) -> None:
        self.counters.add("errors")
        first = not self._backoff.down
        delay = self._backoff.failure()
        if first:
            log.warning("mooncake store unavailable (%s); retrying with backoff", why)
        else:
            log.debug("mooncake still unavailable (%s); next try in %.2fs", why, delay)

    def _succeeded(self) -> None:
        if self._backoff.down:
            self._backoff.success()
            self.counters.add("reconnects")
            log.warning("mooncake store reachable again")

    def _outcome(self, codes: Sequence[int]) -> None:
        if any(c in _OUTAGE for c in codes):
            self._failed(f"error code {next(c for c in codes if c in _OUTAGE)}")
        else:
            self._succeeded()

    # -- memory ------------------------------------------------------------------------------
    def register_memory(self, buf: Buffer) -> bool:
        v = byte_view(buf)
        addr = _addr(v)
        if not len(v) or self._closed:
            return False
        with self._lock:
            if self._regions.get(addr, -1) >= len(v):
                return True
            if self._store.register_buffer(addr, len(v)) != 0:
                return False
            self._regions[addr] = len(v)
        return True

    def unregister_memory(self, buf: Buffer) -> None:
        addr = _addr(byte_view(buf))
        with self._lock:
            if addr in self._regions and addr != self._staging_addr and not self._closed:
                self._store.unregister_buffer(addr)
                del self._regions[addr]

    def _registered(self, addr: int, n: int) -> bool:
        for s, ln in self._regions.items():     # a handful of regions: a plain loop is fastest
            if s <= addr and addr + n <= s + ln:
                return True
        return False

    # -- protocol ----------------------------------------------------------------------------
    def exists(self, keys: Sequence[str]) -> list[bool]:
        for k in keys:
            check_key(k)
        if not keys or not self._available():
            return [False] * len(keys)
        codes = self._store.batch_is_exist(list(keys))
        self._outcome(codes)
        bad = sum(1 for c in codes if c < 0 and c not in _OUTAGE)
        if bad:
            self.counters.add("errors", bad)
        return [c == 1 for c in codes]

    def get(self, keys: Sequence[str], parts: Sequence[Sequence[Buffer]]) -> list[int]:
        check_batch(keys, parts)
        for k in keys:
            check_key(k)
        views = [[byte_view(p) for p in ps] for ps in parts]
        self.counters.add("gets", len(keys))
        if not keys or not self._available():
            return [GetStatus.ERROR] * len(keys)
        with self._lock:
            out = self._transfer(list(keys), views, reading=True)
        return out

    def put(self, keys: Sequence[str], parts: Sequence[Sequence[Buffer]]) -> list[bool]:
        check_batch(keys, parts)
        for k in keys:
            check_key(k)
        views = [[byte_view(p) for p in ps] for ps in parts]
        if not keys or not self._available():
            self.counters.add("put_failed", len(keys))
            return [False] * len(keys)
        with self._lock:
            codes = self._transfer(list(keys), views, reading=False)
        ok = [c == 0 or c == _OBJECT_ALREADY_EXISTS for c in codes]
        self.counters.add("puts", sum(ok))
        self.counters.add("put_failed", len(ok) - sum(ok))
        return ok

    def _transfer(self, keys: list[str], views: list[list[memoryview]], reading: bool) -> list:
        """Run a batch in chunks that fit the staging buffer; returns per-key results."""
        out: list = [None] * len(keys)
        cap = self.config.staging_bytes
        i = 0
        while i < len(keys):
            chunk: list[int] = []
            ptrs: list[list[int]] = []
            sizes: list[list[int]] = []
            copies: list[tuple[memoryview, int]] = []   # (caller view, staging offset)
            used = 0
            while i < len(keys):
                p, s = [], []
                nbytes = 0
                for v in views[i]:          # registered parts go as they are (the common case)
                    a, n = _addr(v), len(v)
                    if self._registered(a, n):
                        p.append(a)
                    else:
                        p.append(-1)
                        nbytes += n
                    s.append(n)
                if nbytes > cap:
                    if not chunk:        # too big to stage: the copying API, on its own
                        out[i] = self._copying(keys[i], views[i], reading)
                        i += 1
                    break
                if used + nbytes > cap:
                    break
                if nbytes:                   # the others are bounced through the staging buffer
                    for k, v in enumerate(views[i]):
                        if p[k] == -1:
                            if not reading:
                                self._staging[used:used + len(v)] = np.frombuffer(v, np.uint8)
                            copies.append((v, used))
                            p[k] = self._staging_addr + used
                            used += len(v)
                chunk.append(i)
                ptrs.append(p)
                sizes.append(s)
                i += 1
            if not chunk:
                continue
            ks = [keys[j] for j in chunk]
            if used:
                self.counters.add("staged_bytes", used)
            if reading:
                codes = self._store.batch_get_into_multi_buffers(ks, ptrs, sizes)
                self._outcome(codes)
                for j, c, s in zip(chunk, codes, sizes):
                    out[j] = self._get_result(keys[j], c, sum(s))
                for v, off in copies:   # bounce back (a failed key's parts hold garbage anyway)
                    np.frombuffer(v, np.uint8)[:] = self._staging[off:off + len(v)]
            else:
                codes = self._store.batch_put_from_multi_buffers(ks, ptrs, sizes, self._rconf)
                self._outcome(codes)
                for j, c in zip(chunk, codes):
                    out[j] = c
                    if c < 0 and c != _OBJECT_ALREADY_EXISTS and c not in _OUTAGE:
                        log.debug("mooncake put %s failed with code %d", keys[j], c)
        return out

    def _get_result(self, key: str, code: int, size: int) -> int:
        if code >= 0:
            if code != size:
                return GetStatus.SIZE_MISMATCH
            self.counters.add("hits")
            return code
        if code in (_OBJECT_NOT_FOUND, _REPLICA_IS_NOT_READY):
            self.counters.add("misses")
            return GetStatus.MISS
        if code == _INVALID_PARAMS:
            return GetStatus.SIZE_MISMATCH
        if code == _TRANSFER_FAIL:
            actual = self._store.get_size(key)
            if actual >= 0 and actual != size:
                return GetStatus.SIZE_MISMATCH
        self.counters.add("errors")
        return GetStatus.ERROR

    def _copying(self, key: str, views: list[memoryview], reading: bool):
        """Objects bigger than the staging buffer, through the copying API."""
        if not reading:
            rc = self._store.put_parts(key, *views, config=self._rconf)
            self._outcome([rc])
            return rc
        size = sum(len(v) for v in views)
        actual = self._store.get_size(key)
        self._outcome([actual])
        if actual < 0:
            return self._get_result(key, actual, size)
        if actual != size:
            return GetStatus.SIZE_MISMATCH
        handle = self._store.get_buffer(key)
        if handle is None:
            self.counters.add("misses")
            return GetStatus.MISS
        src = np.asarray(handle, dtype=np.uint8).reshape(-1)
        if len(src) != size:
            return GetStatus.SIZE_MISMATCH
        off = 0
        for v in views:
            np.frombuffer(v, np.uint8)[:] = src[off:off + len(v)]
            off += len(v)
        self.counters.add("hits")
        return size

    def delete(self, keys: Sequence[str]) -> int:
        for k in keys:
            check_key(k)
        if not keys or not self._available():
            return 0
        codes = self._store.batch_remove(list(keys), force=True)
        self._outcome(codes)
        return sum(1 for c in codes if c == 0)

    def clear(self) -> int:
        if not self._available():
            return 0
        n = self._store.remove_all()
        if n < 0:
            self._failed(f"remove_all returned {n}")
            return 0
        return n

    def quarantine(self, key: str) -> None:
        # The store has nowhere to keep it aside: removing it stops further hits.
        if self.delete([key]):
            self.counters.add("quarantined")
            log.warning("removed corrupt object %s from the mooncake store", key)

    def health(self) -> dict[str, Any]:
        code = self._store.health_check() if not self._closed else 1
        return {"backend": self.kind.value, "healthy": code == 0 and not self._backoff.down,
                "health_check": code, "master": self.config.master_server_address,
                "consecutive_failures": self._backoff.failures, **self.counters.as_dict()}

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self._lock:
            for addr in list(self._regions):
                self._store.unregister_buffer(addr)
            self._regions.clear()
            self._store.close()
