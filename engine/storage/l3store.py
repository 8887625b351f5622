"""Pages of a host pool ↔ self-describing objects in a backend: what the cache facade calls.

A page of the pool's shard is stored as the objects its :class:`Placement` names
(:mod:`engine.storage.placement`): in the unified layout one object per grid rectangle (layer
range × kv-head range) of the page, in the legacy layout one object per rank. Keys are the page's
chained hash plus the rectangle's coordinate (:mod:`engine.storage.keys`).

* ``exists_prefix(hashes)``: how many *leading* pages are stored (every object of the page).
* ``put_pages(hashes, pool, pages)``: back pages up, skipping objects already stored.
* ``get_pages(hashes, pool, pages)``: load leading pages; stops at the first page with a missing,
  corrupt or foreign object. Every object's header (magic, version, layout, page hash, sizes) and
  payload checksum are verified before a page is reported loaded. All objects of a page (of a
  batch of pages, for a network store) are fetched in one batched get.

A reader whose shard cuts through a rectangle (a TP8 reader of a store written on a grid of
2-head groups) reads the whole rectangle and keeps its part. A writer whose shard cuts a
rectangle is refused when the store is opened (``ValueError``): it does not hold all of the
rectangle's bytes. ``read_only=True`` opens such a shard for reading.

Zero copy: with a ``page_first`` host pool a rectangle spanning all of the shard's kv-heads is
one contiguous slice of the pool, so its payload goes straight from / into pool memory
(registered with the backend once) and only the small header goes through an arena. Other
rectangles (a subset of the heads) and ``layer_first`` pools go through a staging arena: the
object is checked there and then copied into the pool. In the zero-copy path the bytes of a page
that fails its checks have already landed in the destination page (and, with a pipelined batched
get, those of the batch after it): ``get_pages`` only vouches for ``host_pages[:n_ok]``; the
caller frees the rest unused.

Batches are about ``batch_bytes`` (8 MiB), so a batch is still in the last-level cache when it
is moved after its checksum. A put asks the backend which objects exist once per call (not once
per batch: for a network store each query is a round trip) and hands it whole batches. With more
than two CPUs puts are pipelined (a helper thread encodes the next batch while the backend moves
this one with the GIL released); gets from a batched store are pipelined when every object is
zero-copy (the next batch is fetched while this one is verified). Local backends (file, memory)
are read one page at a time, each object checksummed right after it is read.

Corrupt or truncated objects are misses, counted and quarantined (taken out of the store). A
layout mismatch is a miss with a warning; its bytes are never interpreted.

Deadlines (``deadline_s`` > 0, what :meth:`L3Store.open` sets from the config): every operation
runs through a :class:`engine.storage.guard.CallGuard`, so none blocks its caller past
``deadline_s`` (plus the time its bytes take at a slow ``MIN_RATE``). A call that overruns is
abandoned and the store is *degraded* (``stats()["degraded_reason"]``) until it returns;
meanwhile every operation fails fast (a miss, a failed put). A get that may be abandoned must not
land in pool pages the cache may reuse, so guarded gets read into the store's own staging rows
and copy verified pages into the pool (one more copy per page than the unguarded zero-copy get).
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import os
import threading
import weakref
from typing import Any, Sequence

import numpy as np
import torch

from engine.cache.pool import HostLayout, HostPool
from engine.core.errors import StorageError
from engine.core.hashing import PageHash
from engine.core.layout import KVLayout
from engine.storage.backend import Counters, GetStatus, StorageBackend, make_backend
from engine.storage.config import StorageConfig
from engine.storage.guard import CallGuard
from engine.storage.keys import object_key
from engine.storage.placement import KVOrder, Placement, Tile, span
from formats.kvobject import CorruptKVObject, KVLayoutMismatch, KVObjectCodec, checksum

log = logging.getLogger("hicache.storage")

EXISTS_BATCH = 256
_WARN_KEEP = 1024
MIN_RATE = 32 << 20     # bytes/s: a guarded call moving B bytes gets deadline_s + B / MIN_RATE
HEALTH_DEADLINE_S = 1.0


def _u8(t: torch.Tensor) -> np.ndarray:
    """Flat uint8 numpy view of a contiguous CPU tensor (any dtype, bfloat16 included)."""
    return t.reshape(-1).view(torch.uint8).numpy()


class _Part:
    """One object of every page: its tile, codec, and where its bytes sit in a shard's page."""

    def __init__(self, tile: Tile, shard: KVLayout):
        self.tile = tile
        self.codec = KVObjectCodec(tile.description)
        self.payload_len = tile.payload_len
        self.object_size = self.codec.object_size(self.payload_len)
        (sl0, sl1), (sh0, sh1) = span(shard)
        (tl0, tl1), (th0, th1) = tile.layers, tile.heads
        il0, il1, ih0, ih1 = max(tl0, sl0), min(tl1, sl1), max(th0, sh0), min(th1, sh1)
        lay = tile.layout
        # Bytes shape (the last axis is head_dim × itemsize): cuts are done with numpy on uint8
        # views, one thread, whatever the dtype.
        self.shape = (lay.num_layers, lay.kv_kinds, lay.page_size, lay.kv_heads,
                      lay.head_dim * lay.itemsize)
        # The overlap, in the tile's coordinates and in the shard page's.
        self.in_tile = (slice(il0 - tl0, il1 - tl0), slice(None), slice(None),
                        slice(ih0 - th0, ih1 - th0))
        self.in_page = (slice(il0 - sl0, il1 - sl0), slice(None), slice(None),
                        slice(ih0 - sh0, ih1 - sh0))
        # All of the shard's heads over whole layers: one contiguous run of a page_first page.
        self.contiguous = (th0, th1) == (sh0, sh1) and sl0 <= tl0 and tl1 <= sl1
        layer_bytes = shard.page_bytes // shard.num_layers
        self.offset = (tl0 - sl0) * layer_bytes


class L3Store:
    def __init__(self, backend: StorageBackend, layout: KVLayout, *, model_tag: str = "",
                 placement: Placement | None = None, read_only: bool = False,
                 batch_pages: int = 32, batch_bytes: int = 8 << 20, zero_copy: bool = True,
                 pipeline: bool | None = None, get_pipeline: bool | None = None,
                 deadline_s: float = 0.0):
        self.backend = backend
        kind = getattr(getattr(backend, "kind", None), "value", "backend")
        self.guard = CallGuard(f"L3 store ({kind})", deadline_s)
        self.exists_deadline_s = deadline_s     # the server lowers it to the prefetch timeout
        self.layout = layout
        self.placement = placement or Placement()
        if self.placement.kv_order is not KVOrder.LAYER_FIRST:
            raise ValueError("the L3 store reads and writes layer_first payloads; convert a "
                             "page_first store with `hicache convert-layout`")
        self.read_only = read_only
        # Raises ValueError up front for a writer whose shard cuts the grid.
        self.parts = [_Part(t, layout) for t in
                      self.placement.tiles(layout, model_tag, writing=not read_only)]
        self.suffixes = [p.tile.suffix for p in self.parts]
        self.n_parts = len(self.parts)
        self.page_object_bytes = sum(p.object_size for p in self.parts)
        read_bytes = sum(p.payload_len for p in self.parts)
        # Pages per backend batch: at most batch_pages and about batch_bytes (a batch that stays
        # in the last-level cache between its checksum and its transfer).
        self.batch = max(1, min(batch_pages, batch_bytes // read_bytes))
        self.zero_copy = zero_copy
        # Pages per backend get: a whole batch for a network store; one page at a time for
        # local backends, so each object is checksummed while it is still in cache.
        self.io_batch = self.batch if getattr(backend, "prefers_batches", True) else 1
        self.put_batch = self.batch
        rows = 2 * self.batch * self.n_parts     # two halves: one moving, one being prepared
        self._hlen = max(p.codec.header_len for p in self.parts)
        self._plen = max(p.payload_len for p in self.parts)
        self._headers = np.zeros((rows, self._hlen), dtype=np.uint8)
        self.backend.register_memory(self._headers)
        # Encoding the next batch in a helper thread pays off only with cores to spare; on a
        # 2-core machine the thread competes with the transfer (measured: slower).
        self.pipeline = (os.cpu_count() or 1) > 2 if pipeline is None else pipeline
        self.get_pipeline = True if get_pipeline is None else get_pipeline
        self._encoder: concurrent.futures.ThreadPoolExecutor | None = None
        self._staging: np.ndarray | None = None
        self._pool: HostPool | None = None
        self._pool_u8: np.ndarray | None = None
        self._pool_bytes: np.ndarray | None = None
        self._lock = threading.Lock()
        self._warned: set[str] = set()
        # host pool -> {page: (pool write generation, {part index: payload checksum})}
        self._sums: "weakref.WeakKeyDictionary[HostPool, dict]" = weakref.WeakKeyDictionary()
        self.counters = Counters("hits", "misses", "corrupt", "layout_mismatch", "errors",
                                 "bytes_read", "bytes_written", "puts", "put_skipped",
                                 "put_failed", "objects_written")

    @classmethod
    def open(cls, config: StorageConfig, layout: KVLayout, **kw: Any) -> "L3Store":
        """Backend from config + store; raises StorageError when the backend cannot start
        (also when it does not start within the deadline: a master that accepts connections
        but never answers), ValueError when this shard cannot write the placement's objects."""
        kw.setdefault("deadline_s", config.deadline_s)
        start = CallGuard("L3 store start", kw["deadline_s"] and
                          max(kw["deadline_s"], config.start_deadline_s))
        backend = start.run("starting the backend", make_backend, config, default=None)
        start.close()
        if backend is None:
            raise StorageError(f"{config.backend.value} store: {start.reason}; "
                               "L3 storage is off")
        try:
            return cls(backend, layout, **kw)
        except ValueError:
            backend.close()
            raise

    @property
    def object_size(self) -> int:
        """Bytes of one page's objects together (headers included)."""
        return self.page_object_bytes

    @property
    def codec(self) -> KVObjectCodec:
        """The codec of the first object of a page (the only one when a page is one object)."""
        return self.parts[0].codec

    def keys(self, hashes: Sequence[PageHash]) -> list[str]:
        """Every object key of ``hashes``, page by page (``n_parts`` per page)."""
        sfx = self.suffixes
        return [object_key(h, s) for h in hashes for s in sfx]

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
        # uint8 view of the whole pool, head_dim × itemsize bytes on the last axis
        self._pool_bytes = pool.buf.view(torch.uint8).numpy()
        if (self.zero_copy and pool.host_layout is HostLayout.PAGE_FIRST
                and pool.buf.is_contiguous() and any(p.contiguous for p in self.parts)):
            self._pool_u8 = _u8(pool.buf)
            self.backend.register_memory(self._pool_u8)
            if hasattr(pool, "add_write_listener") and pool not in self._sums:
                self._sums[pool] = {}
                pool.add_write_listener(functools.partial(self._on_pages_written, pool))

    def bind(self, pool: HostPool) -> None:
        """Bind the host pool this store will move pages of (the first put or get does it
        otherwise): from then on, pages written into it get their object checksums computed
        as they land (:meth:`_on_pages_written`), so a put does not read them twice."""
        self.guard.run("binding the host pool", self._bind_locked, pool, default=None)

    def _bind_locked(self, pool: HostPool) -> None:
        with self._lock:
            self._bind(pool)

    def _on_pages_written(self, pool: HostPool, pages) -> None:
        """Checksum the zero-copy objects of freshly written pages of ``pool``, for the
        generation the pool is at now (a later overwrite bumps it and makes them stale). Runs
        in the thread that wrote the pages, right after the copy, before the write completes."""
        sums = self._sums.get(pool)
        if sums is None:
            return
        u8 = _u8(pool.buf)
        parts = [(i, p) for i, p in enumerate(self.parts) if p.contiguous]
        pb = self.layout.page_bytes
        gens = pool.write_gen
        for page in np.asarray(pages, dtype=np.int64).tolist():
            at = page * pb
            sums[page] = (int(gens[page]), {
                i: checksum(u8[at + p.offset:at + p.offset + p.payload_len]) for i, p in parts})

    def _known_checksum(self, page: int, t: int) -> int | None:
        """The checksum of part ``t`` of page ``page`` of the bound pool, if it was computed
        for the page's current bytes."""
        pool = self._pool
        got = self._sums.get(pool, {}).get(page) if pool is not None else None
        if got is None or got[0] != int(pool.write_gen[page]):
            return None
        return got[1].get(t)

    def _staging_row(self, slot: int, part: _Part) -> np.ndarray:
        if self._staging is None:
            self._staging = np.empty((2 * self.batch * self.n_parts, self._plen),
                                     dtype=np.uint8)
            self.backend.register_memory(self._staging)
        return self._staging[slot, :part.payload_len]

    def _direct(self, part: _Part, reading: bool = False) -> bool:
        """Whether ``part`` moves straight from / into pool memory. Guarded gets never do: an
        abandoned get could land in pool pages after the cache reused them."""
        return (self._pool_u8 is not None and part.contiguous
                and not (reading and self.guard.enabled))

    def _pool_view(self, page: int, part: _Part) -> np.ndarray:
        at = int(page) * self.layout.page_bytes + part.offset
        return self._pool_u8[at:at + part.payload_len]

    def _page_tensor(self, pool: HostPool, page: int) -> np.ndarray:
        """``[layers, kv_kinds, page_size, kv_heads, head_dim bytes]`` uint8 view of one pool
        page (numpy: a strided copy in torch spins up its thread pool for every object)."""
        if pool.host_layout is HostLayout.PAGE_FIRST:
            return self._pool_bytes[int(page)]
        s = int(page) * self.layout.page_size
        return self._pool_bytes[:, :, s:s + self.layout.page_size]

    def _as_tile(self, row: np.ndarray, part: _Part) -> np.ndarray:
        return row.reshape(part.shape)

    # -- guarded entry points ----------------------------------------------------------------
    def _deadline(self, n_pages: int) -> float:
        return self.guard.deadline_s + n_pages * self.page_object_bytes / MIN_RATE

    @property
    def degraded(self) -> bool:
        return self.guard.degraded

    def exists_prefix(self, hashes: Sequence[PageHash]) -> int:
        """How many leading pages are stored (0 while degraded or past the deadline)."""
        return self.guard.run(f"exists of {len(hashes)} pages", self._exists_prefix, hashes,
                              default=0, lane="query", deadline_s=self.exists_deadline_s)

    def put_pages(self, hashes: Sequence[PageHash], host_pool: HostPool,
                  host_pages: Sequence[int]) -> int:
        """Store pages; returns how many of them are in the store afterwards (written now or
        already there — objects already stored are skipped, not rewritten). 0 while degraded
        or past the deadline."""
        if len(hashes) != len(host_pages):
            raise ValueError(f"{len(hashes)} hashes but {len(host_pages)} pages")
        if self.read_only:
            raise ValueError("this L3 store was opened read-only (its shard cuts the grid)")
        return self.guard.run(f"put of {len(hashes)} pages", self._put_pages, hashes,
                              host_pool, host_pages, default=0,
                              deadline_s=self._deadline(len(hashes)))

    def get_pages(self, hashes: Sequence[PageHash], host_pool: HostPool,
                  host_pages: Sequence[int]) -> int:
        """Load leading pages into ``host_pages``; returns how many were loaded and verified
        (stops at the first page with a miss / corrupt object / mismatch; 0 while degraded or
        past the deadline)."""
        if len(hashes) != len(host_pages):
            raise ValueError(f"{len(hashes)} hashes but {len(host_pages)} pages")
        return self.guard.run(f"get of {len(hashes)} pages", self._get_pages, hashes,
                              host_pool, host_pages, default=0,
                              deadline_s=self._deadline(len(hashes)))

    # -- queries -----------------------------------------------------------------------------
    def _exists_prefix(self, hashes: Sequence[PageHash]) -> int:
        n, T = 0, self.n_parts
        step = max(1, EXISTS_BATCH // T)
        for s in range(0, len(hashes), step):
            found = self.backend.exists(self.keys(hashes[s:s + step]))
            for j in range(0, len(found), T):
                if not all(found[j:j + T]):
                    return n
                n += 1
        return n

    def _put_pages(self, hashes: Sequence[PageHash], host_pool: HostPool,
                   host_pages: Sequence[int]) -> int:
        """Pipelined: while the backend moves one chunk (native code, GIL released), a helper
        thread checksums and encodes the headers of the next one."""
        T = self.n_parts
        with self._lock:
            self._bind(host_pool)
            # One existence query per EXISTS_BATCH objects (for a network store each is a round
            # trip), then the missing objects in transfer batches.
            todo: list[tuple[str, bytes, int, int, int]] = []   # key, hash, pool page, part, j
            step = max(1, EXISTS_BATCH // T)
            for s in range(0, len(hashes), step):
                keys = self.keys(hashes[s:s + step])
                for i, there in enumerate(self.backend.exists(keys)):
                    if not there:
                        j = s + i // T
                        todo.append((keys[i], hashes[j], int(host_pages[j]), i % T, j))
            missing = {t[4] for t in todo}
            self.counters.add("put_skipped", len(hashes) - len(missing))
            size = self.put_batch * T
            chunks = [todo[t:t + size] for t in range(0, len(todo), size)]
            failed: set[int] = set()
            piped = self.pipeline and len(chunks) > 1
            if piped:
                if self._encoder is None:
                    self._encoder = concurrent.futures.ThreadPoolExecutor(
                        1, thread_name_prefix="l3-encode")
                nxt = self._encoder.submit(self._encode, chunks[0], 0, host_pool)
            for c, chunk in enumerate(chunks):
                if piped:
                    parts = nxt.result()
                    if c + 1 < len(chunks):
                        nxt = self._encoder.submit(self._encode, chunks[c + 1], (c + 1) % 2,
                                                   host_pool)
                else:
                    parts = self._encode(chunk, 0, host_pool)
                oks = self.backend.put([t[0] for t in chunk], parts)
                for t, ok in zip(chunk, oks):
                    if ok:
                        self.counters.add("objects_written")
                        self.counters.add("bytes_written", self.parts[t[3]].object_size)
                    else:
                        failed.add(t[4])
            self.counters.add("puts", len(missing - failed))
            self.counters.add("put_failed", len(failed))
        return len(hashes) - len(failed)

    def _encode(self, chunk: list[tuple[str, bytes, int, int, int]], half: int,
                pool: HostPool) -> list[list[np.ndarray]]:
        """Headers (and staged payloads) of one chunk into arena half ``half``; returns the
        parts to put."""
        base = half * self.batch * self.n_parts
        out = []
        for slot, (_, h, p, t, _) in enumerate(chunk, start=base):
            part = self.parts[t]
            known = None
            if self._direct(part):
                payload = self._pool_view(p, part)
                known = self._known_checksum(p, t)
            else:
                payload = self._staging_row(slot, part)
                self._as_tile(payload, part)[...] = self._page_tensor(pool, p)[part.in_page]
            row = self._headers[slot, :part.codec.header_len]
            part.codec.encode_header_into(row, h, payload, payload_checksum=known)
            out.append([row, payload])
        return out

    def _get_pages(self, hashes: Sequence[PageHash], host_pool: HostPool,
                   host_pages: Sequence[int]) -> int:
        n_ok, T = 0, self.n_parts
        with self._lock:
            self._bind(host_pool)
            if hasattr(host_pool, "mark_written"):
                host_pool.mark_written(np.asarray(host_pages, dtype=np.int64))
            direct = [self._direct(p, reading=True) for p in self.parts]
            io = self.io_batch
            # Pipelined (all zero copy, batches): the next batch is fetched in a helper thread
            # (native code, GIL released) while this one is verified.
            ahead = self.get_pipeline and all(direct) and io > 1 and len(hashes) > io
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
                    for j in range(len(hs)):
                        for t in range(T):
                            i = j * T + t
                            verdict = self._accept(t, keys[i], hs[j], results[i], headers[i],
                                                   payloads[i])
                            if verdict is not True:
                                if nxt is not None:     # the store does one thing at a time
                                    nxt.result()
                                    nxt = None
                                if verdict == "corrupt":
                                    self.backend.quarantine(keys[i])
                                return n_ok
                        if not all(direct):
                            page = None
                            for t, part in enumerate(self.parts):
                                if direct[t]:
                                    continue
                                if self._direct(part):     # guarded: one memcpy into place
                                    np.copyto(self._pool_view(ps[j], part),
                                              payloads[j * T + t])
                                    continue
                                if page is None:
                                    page = self._page_tensor(host_pool, ps[j])
                                page[part.in_page] = \
                                    self._as_tile(payloads[j * T + t], part)[part.in_tile]
                        n_ok += 1
            finally:
                if nxt is not None:     # a fetch still writing into the arena: let it finish
                    nxt.result()
                if n_ok:    # counted once per call, not per page
                    self.counters.add("hits", n_ok)
                    self.counters.add("bytes_read", n_ok * self.page_object_bytes)
        return n_ok

    def _fetch(self, hs: Sequence[PageHash], ps: Sequence[int], half: int):
        """One backend get of every object of a batch of pages into the pool (or staging
        rows), headers into arena half ``half``; returns (keys, payloads, headers, results)."""
        keys = self.keys(hs)
        base = half * self.batch * self.n_parts
        payloads, headers = [], []
        for j, p in enumerate(ps):
            for t, part in enumerate(self.parts):
                slot = base + j * self.n_parts + t
                payloads.append(self._pool_view(p, part) if self._direct(part, reading=True)
                                else self._staging_row(slot, part))
                headers.append(self._headers[slot, :part.codec.header_len])
        results = self.backend.get(keys, [[h, pl] for h, pl in zip(headers, payloads)])
        return keys, payloads, headers, results

    def _helper(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._encoder is None:
            self._encoder = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="l3-io")
        return self._encoder

    def _accept(self, t: int, key: str, page_hash: bytes, r: int, header: np.ndarray,
                payload: np.ndarray) -> bool | str:
        """True for a sound object of ours; False for a miss / error / foreign layout;
        ``"corrupt"`` for an object the caller must quarantine (counted and logged here)."""
        if r == GetStatus.MISS:
            self.counters.add("misses")
            return False
        if r == GetStatus.ERROR:
            self.counters.add("errors")
            return False
        part = self.parts[t]
        try:
            if r == GetStatus.SIZE_MISMATCH:
                raise CorruptKVObject(f"stored object is not {part.object_size} bytes "
                                      "(truncated, or of another layout)")
            part.codec.verify(header, payload, page_hash)
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
        """Counters, the guard's state (``degraded``, ``degraded_reason``) and the backend's
        health (``{"healthy": False}`` while degraded: it is not asked then)."""
        kind = getattr(getattr(self.backend, "kind", None), "value", "backend")
        health = self.guard.run("health check", self.backend.health, lane="query",
                                default={"backend": kind, "healthy": False},
                                deadline_s=min(HEALTH_DEADLINE_S, self.guard.deadline_s))
        return {**self.counters.as_dict(), **self.guard.state(), "backend": health}

    def demote_pages(self, hashes: Sequence[PageHash]) -> int:
        """Ask the backend to evict these pages' objects first (a closed session's KV: soft,
        a read makes them recent again). The objects found; 0 when the backend has no
        eviction order to change (Mooncake's master evicts by its own policy), while degraded
        or past the deadline."""
        demote = getattr(self.backend, "demote", None)
        if demote is None or not hashes:
            return 0
        return self.guard.run(f"demote of {len(hashes)} pages", demote, self.keys(hashes),
                              default=0, lane="query")

    def clear(self) -> int:
        """Remove every object of the backend (an operator's "empty the store"); the number
        removed, or -1 when the backend did not answer in time (the store is then degraded)."""
        return self.guard.run("clear", self.backend.clear, default=-1)

    def close(self, close_backend: bool = True) -> None:
        """Unregister the memory this store registered; close the backend unless told not to
        (a backend shared by several stores). Bounded by the deadline: a store with a call
        still stuck is left as it is (its threads are daemons)."""
        if self.guard.degraded:
            log.warning("L3 store closed while degraded (%s): backend left unclosed",
                        self.guard.reason)
        else:
            self.guard.run("close", self._close, close_backend, default=None)
        self.guard.close()

    def _close(self, close_backend: bool = True) -> None:
        """Unregister the memory this store registered; close the backend unless told not to
        (a backend shared by several stores)."""
        with self._lock:
            for buf in (self._pool_u8, self._staging, self._headers):
                if buf is not None:
                    self.backend.unregister_memory(buf)
            self._pool_u8 = self._staging = self._pool_bytes = None
            self._pool = None
            self._sums.clear()         # listeners left on pools find nothing and return
            if self._encoder is not None:
                self._encoder.shutdown(wait=True)
                self._encoder = None
            if close_backend:
                self.backend.close()
