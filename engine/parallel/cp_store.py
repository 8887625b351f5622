"""One CP rank's view of an L3 store (docs/parallelism.md §1, "L3 with --cp").

Every rank of a CP group runs the same L3 steps (the same prefetches and backups of the same
logical pages); :class:`OwnedStore` makes each rank move only the pages it owns. A page's object
is the one a single rank would write — the same key (page hash × layer range × kv-head range of
the unified layout, or the legacy per-rank key of TP rank 0 / PP stage 0) and the same bytes — so
a store written at ``--cp 2`` serves ``--cp 1`` and the reverse, and two ranks never write the
same object: each page has one owner.

Results are reported for the whole list, as if one rank had moved every page: ``get_pages``
returns the index of the first page of this rank that failed (every page, when none did), and
the group takes the minimum (``CPCache.agree``), so all ranks commit the same leading pages.
Existence queries ask about every page (the store is shared: any rank may read any page's
object), their results agreed in the same way.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from engine.parallel.cp import CPShape


class OwnedStore:
    """``store`` (an :class:`~engine.storage.l3store.L3Store`) for rank ``rank`` of ``shape``:
    gets and puts take logical pages of the rank's :class:`~engine.parallel.cp_pool.OwnedPool`
    and move the owned ones through the rank's own host pool."""

    def __init__(self, store: Any, shape: CPShape, rank: int):
        self.store, self.shape, self.rank = store, shape, rank

    def __getattr__(self, name: str) -> Any:
        # exists_prefix, stats, close, guard, degraded, ...
        return getattr(self.store, name)

    @staticmethod
    def _local_pool(pool: Any) -> Any:
        return getattr(pool, "pool", pool)       # an OwnedPool's rows: the rank's HostPool

    def bind(self, pool: Any) -> None:
        self.store.bind(self._local_pool(pool))

    def _mine(self, pages: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """Indices (into the list) of this rank's pages, and their local page numbers."""
        pages = np.asarray(pages, dtype=np.int64)
        idx = np.flatnonzero(pages % self.shape.size == self.rank)
        return idx, pages[idx] // self.shape.size

    def get_pages(self, hashes: Sequence, pool: Any, pages: Sequence[int]) -> int:
        """Load this rank's pages; the leading pages of the whole list vouched for here."""
        idx, local = self._mine(pages)
        if not len(idx):
            return len(pages)
        n = self.store.get_pages([hashes[i] for i in idx], self._local_pool(pool), local)
        return len(pages) if n >= len(idx) else int(idx[n])

    def put_pages(self, hashes: Sequence, pool: Any, pages: Sequence[int]) -> int:
        """Store this rank's pages; ``len(pages)`` when all of them are stored."""
        idx, local = self._mine(pages)
        if not len(idx):
            return len(pages)
        n = self.store.put_pages([hashes[i] for i in idx], self._local_pool(pool), local)
        return len(pages) - (len(idx) - n)
