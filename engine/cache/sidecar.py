"""A target pool and a draft *sidecar* pool addressed by the same page ids (docs/speculative.md).

Speculative decoding keeps the draft model's KV in the cache stack with the target's. In the
``sidecar`` draft layout the draft's KV lives in a pool of its own (its own tensor, its own
layout) that has no allocator: page ``p`` of the sidecar belongs to whoever owns page ``p`` of
the target pool. :class:`PairedPool` shows the two as one pool whose layers are the target's
followed by the draft's, so one transfer op moves both (host pages 7, 12, 19 -> device pages
42, 8, 27 for target and draft alike) and one receipt commits or rolls back both.

(The ``packed`` layout needs nothing here: the draft's layers are simply more layers of the same
pools.)
"""

from __future__ import annotations

import numpy as np


class PairedPool:
    """Target pool + sidecar pool, layers ``0 … L-1`` then ``L … L+D-1``, one set of page ids."""

    def __init__(self, target, sidecar):
        if sidecar.num_pages != target.num_pages:
            raise ValueError(f"sidecar pool has {sidecar.num_pages} pages, target "
                             f"{target.num_pages}: they must be addressed by the same page ids")
        if sidecar.layout.page_size != target.layout.page_size:
            raise ValueError("sidecar and target pools need the same page size")
        self.target, self.sidecar = target, sidecar
        self.split = target.layout.num_layers

    # What the cache and the model use of a pool: the target's allocator, layout and buffer.
    @property
    def layout(self):
        return self.target.layout

    @property
    def num_pages(self) -> int:
        return self.target.num_pages

    @property
    def allocator(self):
        return self.target.allocator

    @property
    def buf(self):
        return self.target.buf

    @property
    def device(self):
        return self.target.device

    @property
    def num_layers(self) -> int:
        return self.split + self.sidecar.layout.num_layers

    def slots(self, pages: np.ndarray) -> np.ndarray:
        return self.target.slots(pages)

    def copy_slots(self, src_page: int, dst_page: int, n: int) -> None:
        """:meth:`DevicePool.copy_slots` in both pools: the target's KV and the draft's of the
        first ``n`` slots of ``src_page`` go to the first ``n`` slots of ``dst_page`` (the same
        page ids address both), so a partially reused page carries the draft's state too."""
        self.target.copy_slots(src_page, dst_page, n)
        self.sidecar.copy_slots(src_page, dst_page, n)

    def _pool(self, layer: int):
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} outside 0..{self.num_layers - 1}")
        return (self.target, layer) if layer < self.split else (self.sidecar, layer - self.split)

    def get_layer(self, layer: int, pages: np.ndarray):
        pool, li = self._pool(layer)
        return pool.get_layer(li, pages)

    def set_layer(self, layer: int, pages: np.ndarray, data) -> None:
        pool, li = self._pool(layer)
        pool.set_layer(li, pages, data)

    @property
    def nbytes(self) -> int:
        return sum(p.buf.numel() * p.buf.element_size() for p in (self.target, self.sidecar))


class PairedStore:
    """Two L3 stores behind one: the target's objects and the draft's, one per pool of a
    :class:`PairedPool` host pool. A page counts as stored (and is fetched) only when both halves
    are, so a prefix never comes back from L3 without its draft state. The draft's store
    shares the target store's backend; its objects carry the draft's own layer range."""

    def __init__(self, target, draft):
        self.target, self.draft = target, draft
        self.guard = target.guard

    @property
    def exists_deadline_s(self) -> float:
        return self.target.exists_deadline_s

    @exists_deadline_s.setter
    def exists_deadline_s(self, v: float) -> None:
        self.target.exists_deadline_s = self.draft.exists_deadline_s = v

    @property
    def degraded(self) -> bool:
        return self.target.degraded or self.draft.degraded

    def exists_prefix(self, hashes) -> int:
        n = self.target.exists_prefix(hashes)
        return self.draft.exists_prefix(hashes[:n]) if n else 0

    def put_pages(self, hashes, pool: PairedPool, pages) -> int:
        n = self.target.put_pages(hashes, pool.target, pages)
        return min(n, self.draft.put_pages(hashes, pool.sidecar, pages))

    def get_pages(self, hashes, pool: PairedPool, pages) -> int:
        n = self.target.get_pages(hashes, pool.target, pages)
        return self.draft.get_pages(hashes[:n], pool.sidecar, pages[:n]) if n else 0

    def stats(self) -> dict:
        return {**self.target.stats(), "draft": self.draft.stats()}

    def close(self) -> None:
        self.draft.close(close_backend=False)
        self.target.close()
