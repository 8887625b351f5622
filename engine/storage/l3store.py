"""Pages of a host pool ↔ self-describing objects in a backend: what the cache facade calls.

One object per page holds all layers and kv-heads of the writer's layout; its key is the page's
chained hash plus the layout coordinate (:mod:`engine.storage.keys`), so the unified-layout work
can later split a page into layer × head ranges without changing anything here but the layout.

* ``exists_prefix(hashes)``: how many *leading* pages are stored.
* ``put_pages(hashes, pool, pages)``: back pages up, skipping those already stored.
* ``get_pages(hashes, pool, pages)``: load leading pages; stops at the first miss, corrupt object
  or layout mismatch. Every object's header (magic, version, layout, page hash, sizes) and
  payload checksum are verified before a page is reported loaded.

Zero copy: with a ``page_first`` host pool a page is one contiguous slice of the pool, so the
payload goes straight from / into pool memory (registered with the backend once) and only the
small header goes through an arena. A ``layer_first`` pool goes through a staging arena: the page
is checked there and then copied into the pool with :meth:`HostPool.set_page`. In the zero-copy
path the bytes of a page that fails its checks have already landed in the destination page (and,
with a pipelined batched get, those of the batch after it): ``get_pages`` only vouches for
``host_pages[:n_ok]``; the caller frees the rest unused.

Batches are about ``batch_bytes`` (8 MiB), so a batch is still in the last-level cache when it
is moved after its checksum. A put asks the backend which pages exist once per call (not once per
batch: for a network store each query is a round trip) and hands it whole batches. With more than
two CPUs puts are pipelined (a helper thread encodes the next batch while the backend moves this
one with the GIL released); gets from a batched store are always pipelined (the next batch is
fetched while this one is verified — verification reads bytes the transfer just left in cache,
so it does not compete for memory bandwidth). Local backends (file, memory) are read one object
at a time, each checksummed right after it is read.

Corrupt or truncated objects are misses, counted and quarantined (taken out of the store). A
layout mismatch is a miss with a warning; its bytes are never interpreted.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
from typing import Any, Sequence

import numpy as np
import torch

from engine.cache.pool import HostLayout, HostPool
from engine.core.hashing import PageHash
from engine.core.layout import KVLayout
from engine.storage.backend import Counters, GetStatus, StorageBackend, make_backend
from engine.storage.config import StorageConfig
from engine.storage.keys import coordinate, object_key
from formats.kvobject import CorruptKVObject, KVLayoutMismatch, KVObjectCodec

log = logging.getLogger("hicache.storage")

EXISTS_BATCH = 256
_WARN_KEEP = 1024


def _u8(t: torch.Tensor) -> np.ndarray:
    """Flat uint8 numpy view of a contiguous CPU tensor (any dtype, bfloat16 included)."""
    return t.reshape(-1).view(torch.uint8).numpy()


class L3Store:
    def __init__(self, backend: StorageBackend, layout: KVLayout, *, model_tag: str = "",
                 batch_pages: int = 32, batch_bytes: int = 8 << 20, zero_copy: bool = True,
                 pipeline: bool | None = None, get_pipeline: bool | None = None):
        self.backend = backend
        self.layout = layout
        self.codec = KVObjectCodec(layout.to_dict())
        self.coord = coordinate(layout, model_tag)
        self.payload_len = layout.page_bytes
        self.object_size = self.codec.object_size(self.payload_len)
        # Pages per backend batch: at most batch_pages and about batch_bytes (a batch that stays
        # in the last-level cache between its checksum and its transfer); also the staging size.
        self.batch = max(1, min(batch_pages, batch_bytes // self.payload_len))
        self.zero_copy = zero_copy
        # Objects per backend call: a whole batch for a network store; one at a time for local
        # backends, so each object is checksummed while it is still in cache.
        self.io_batch = self.batch if getattr(backend, "prefers_batches", True) else 1
        # Puts go in whole batches to every backend: the checksums of a batch (~8 MiB) are
        # still in the last-level cache when it is written, and the file store publishes a
        # batch under one lock instead of one lock per object.
        self.put_batch = self.batch
        # Header arena: rows [0, batch) for the chunk being moved, [batch, 2*batch) for the
        # chunk being encoded meanwhile (puts are pipelined, see put_pages).
        self._headers = np.zeros((2 * self.batch, self.codec.header_len), dtype=np.uint8)
        self.backend.register_memory(self._headers)
        # Encoding the next batch in a helper thread pays off only with cores to spare; on a
        # 2-core machine the thread competes with the transfer (measured: slower).
        self.pipeline = (os.cpu_count() or 1) > 2 if pipeline is None else pipeline
        # Gets from a batched (network) store are pipelined whatever the CPU count: verifying a
        # batch reads bytes the transfer just left in cache, so it does not compete with the next
        # transfer for memory bandwidth (measured on 2 CPUs: 0.70 -> 0.85-0.98 of raw).
        self.get_pipeline = True if get_pipeline is None else get_pipeline
        self._encoder: concurrent.futures.ThreadPoolExecutor | None = None
        self._staging: np.ndarray | None = None
        self._pool: HostPool | None = None
        self._pool_u8: np.ndarray | None = None
        self._lock = threading.Lock()
        self._warned: set[str] = set()
        self.counters = Counters("hits", "misses", "corrupt", "layout_mismatch", "errors",
                                 "bytes_read", "bytes_written", "puts", "put_skipped",
                                 "put_failed")

    @classmethod
    def open(cls, config: StorageConfig, layout: KVLayout, **kw: Any) -> "L3Store":
        """Backend from config + store; raises StorageError when the backend cannot start."""
        return cls(make_backend(config), layout, **kw)

    def keys(self, hashes: Sequence[PageHash]) -> list[str]:
        c = self.coord
        return [object_key(h, c) for h in hashes]

    # -- pool binding ------------------------------------------------------------------------
    def _bind(self, pool: HostPool) -> None:
        if pool is self._pool:
            return
        if pool.layout != self.layout:
            raise ValueError(f"host pool layout {pool.layout} is not the store's {self.layout}")
        if self._pool_u8 is not None:
            self.backend.unregister_memory(self._pool_u8)
            self._pool_u8 = None
        self._pool = pool
        if (self.zero_copy and pool.host_layout is HostLayout.PAGE_FIRST
                and pool.buf.is_contiguous()):
            self._pool_u8 = _u8(pool.buf)
            self.backend.register_memory(self._pool_u8)

    def _staging_rows(self) -> np.ndarray:
        if self._staging is None:
            self._staging = np.empty((self.batch, self.payload_len), dtype=np.uint8)
            self.backend.register_memory(self._staging)
        return self._staging

    def _page_view(self, page: int) -> np.ndarray:
        n = self.payload_len
        return self._pool_u8[int(page) * n:(int(page) + 1) * n]

    # -- queries -----------------------------------------------------------------------------
    def exists_prefix(self, hashes: Sequence[PageHash]) -> int:
        n = 0
        for s in range(0, len(hashes), EXISTS_BATCH):
            found = self.backend.exists(self.keys(hashes[s:s + EXISTS_BATCH]))
            for f in found:
                if not f:
                    return n
                n += 1
        return n

    def put_pages(self, hashes: Sequence[PageHash], host_pool: HostPool,
                  host_pages: Sequence[int]) -> int:
        """Store pages; returns how many of them are in the store afterwards (written now or
        already there — those are skipped, not rewritten).

        Pipelined: while the backend moves one chunk (native code, GIL released), a helper
        thread checksums and encodes the headers of the next one."""
        if len(hashes) != len(host_pages):
            raise ValueError(f"{len(hashes)} hashes but {len(host_pages)} pages")
        stored = 0
        with self._lock:
            self._bind(host_pool)
            # One existence query per EXISTS_BATCH pages (not one per transfer batch: for a
            # network store each is a round trip), then the missing pages in transfer batches.
            todo_k: list[str] = []
            todo_h: list = []
            todo_p: list[int] = []
            for s in range(0, len(hashes), EXISTS_BATCH):
                hs = hashes[s:s + EXISTS_BATCH]
                keys = self.keys(hs)
                for i, there in enumerate(self.backend.exists(keys)):
                    if not there:
                        todo_k.append(keys[i])
                        todo_h.append(hs[i])
                        todo_p.append(int(host_pages[s + i]))
            stored = len(hashes) - len(todo_k)
            self.counters.add("put_skipped", stored)
            step = self.put_batch
            chunks = [(todo_k[t:t + step], todo_h[t:t + step], todo_p[t:t + step])
                      for t in range(0, len(todo_k), step)]
            if not chunks:
                return stored
            pool = host_pool
            if self.pipeline and len(chunks) > 1:
                if self._encoder is None:
                    self._encoder = concurrent.futures.ThreadPoolExecutor(
                        1, thread_name_prefix="l3-encode")
                nxt = self._encoder.submit(self._encode, chunks[0], 0, pool)
            for c, (keys, _, _) in enumerate(chunks):
                if self.pipeline and len(chunks) > 1:
                    parts = nxt.result()
                    if c + 1 < len(chunks):
                        nxt = self._encoder.submit(self._encode, chunks[c + 1], (c + 1) % 2,
                                                   pool)
                else:
                    parts = self._encode(chunks[c], 0, pool)
                n_ok = sum(self.backend.put(keys, parts))
                stored += n_ok
                self.counters.add("puts", n_ok)
                self.counters.add("put_failed", len(keys) - n_ok)
                self.counters.add("bytes_written", n_ok * self.object_size)
        return stored

    def _encode(self, chunk: tuple[list[str], list, list], half: int,
                pool: HostPool) -> list[list[np.ndarray]]:
        """Headers of one chunk into arena half ``half``; returns the parts to put."""
        _, hs, ps = chunk
        base = half * self.batch
        parts = []
        for slot, (h, p) in enumerate(zip(hs, ps)):
            if self._pool_u8 is not None:
                payload = self._page_view(p)
            else:
                payload = _u8(pool.get_page(p).contiguous())
            row = self._headers[base + slot]
            self.codec.encode_header_into(row, h, payload)
            parts.append([row, payload])
        return parts

    def get_pages(self, hashes: Sequence[PageHash], host_pool: HostPool,
                  host_pages: Sequence[int]) -> int:
        """Load leading pages into ``host_pages``; returns how many were loaded and verified
        (stops at the first miss / corrupt object / mismatch)."""
        if len(hashes) != len(host_pages):
            raise ValueError(f"{len(hashes)} hashes but {len(host_pages)} pages")
        n_ok = 0
        with self._lock:
            self._bind(host_pool)
            zc = self._pool_u8 is not None
            io = self.io_batch
            # Pipelined (zero copy, batches): the next batch is fetched in a helper thread (native
            # code, GIL released) while this one is verified.
            ahead = self.get_pipeline and zc and io > 1 and len(hashes) > io
            nxt = None
            try:
                for c, s in enumerate(range(0, len(hashes), io)):
                    hs, ps = hashes[s:s + io], host_pages[s:s + io]
                    if nxt is not None:
                        keys, payloads, headers, results = nxt.result()
                        nxt = None
                    else:
                        keys, payloads, headers, results = self._fetch(hs, ps, c % 2)
                    if ahead and s + io < len(hashes):
                        nxt = self._helper().submit(
                            self._fetch, hashes[s + io:s + 2 * io],
                            host_pages[s + io:s + 2 * io], (c + 1) % 2)
                    for i, r in enumerate(results):
                        verdict = self._accept(keys[i], hs[i], r, headers[i], payloads[i])
                        if verdict is not True:
                            if nxt is not None:     # the store does one thing at a time
                                nxt.result()
                                nxt = None
                            if verdict == "corrupt":
                                self.backend.quarantine(keys[i])
                            return n_ok
                        if not zc:
                            host_pool.set_page(int(ps[i]), torch.from_numpy(payloads[i])
                                               .view(self.layout.torch_dtype))
                        n_ok += 1
            finally:
                if nxt is not None:     # a fetch still writing into the arena: let it finish
                    nxt.result()
                if n_ok:    # counted once per call, not per page
                    self.counters.add("hits", n_ok)
                    self.counters.add("bytes_read", n_ok * self.object_size)
        return n_ok

    def _fetch(self, hs: Sequence[PageHash], ps: Sequence[int], half: int):
        """One backend get of a batch into its pages (or the staging rows), headers into arena
        half ``half``; returns (keys, payloads, headers, results)."""
        keys = self.keys(hs)
        payloads = ([self._page_view(p) for p in ps] if self._pool_u8 is not None
                    else list(self._staging_rows()[:len(ps)]))
        headers = self._headers[half * self.batch:half * self.batch + len(ps)]
        results = self.backend.get(keys, [[headers[i], pl] for i, pl in enumerate(payloads)])
        return keys, payloads, headers, results

    def _helper(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._encoder is None:
            self._encoder = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="l3-io")
        return self._encoder

    def _accept(self, key: str, page_hash: bytes, r: int, header: np.ndarray,
                payload: np.ndarray) -> bool | str:
        """True for a sound page of ours; False for a miss / error / foreign layout;
        ``"corrupt"`` for an object the caller must quarantine (counted and logged here)."""
        if r == GetStatus.MISS:
            self.counters.add("misses")
            return False
        if r == GetStatus.ERROR:
            self.counters.add("errors")
            return False
        try:
            if r == GetStatus.SIZE_MISMATCH:
                raise CorruptKVObject(f"stored object is not {self.object_size} bytes "
                                      "(truncated, or of another layout)")
            self.codec.verify(header, payload, page_hash)
        except KVLayoutMismatch as e:
            self.counters.add("layout_mismatch")
            self._warn_once(key, f"L3 object {key}: layout mismatch, treated as a miss: {e}")
            return False
        except CorruptKVObject as e:
            self.counters.add("corrupt")
            log.warning("L3 object %s is corrupt (%s): a miss; quarantining it", key, e)
            return "corrupt"
        return True

    def _warn_once(self, key: str, msg: str) -> None:
        if key in self._warned:
            return
        if len(self._warned) >= _WARN_KEEP:
            self._warned.clear()
        self._warned.add(key)
        log.warning("%s", msg)

    # -- lifecycle ---------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        return {**self.counters.as_dict(), "backend": self.backend.health()}

    def close(self, close_backend: bool = True) -> None:
        """Unregister the memory this store registered; close the backend unless told not to
        (a backend shared by several stores)."""
        with self._lock:
            for buf in (self._pool_u8, self._staging, self._headers):
                if buf is not None:
                    self.backend.unregister_memory(buf)
            self._pool_u8 = self._staging = None
            self._pool = None
            if self._encoder is not None:
                self._encoder.shutdown(wait=True)
                self._encoder = None
            if close_backend:
                self.backend.close()
