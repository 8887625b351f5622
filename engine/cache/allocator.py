"""Page-granular slot allocators with exact accounting.

An allocator hands out *page ids*; token slot ``s`` of page ``p`` is ``p * page_size + s``.
It knows nothing of trees or tensors (docs/design.md, "Layers": allocator → pool → transfer → tree → facade).
"""

from __future__ import annotations

import numpy as np

from engine.core.errors import OutOfCapacity


class PageAllocator:
    """A stack of free page ids in a numpy array: O(n) numpy copies, no per-page Python work."""

    __slots__ = ("num_pages", "page_size", "_free", "_n_free", "_allocated", "name", "strict")

    def __init__(self, num_pages: int, page_size: int, name: str = "pool", strict: bool = True):
        if num_pages < 0:
            raise ValueError(f"num_pages must be >= 0, got {num_pages}")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.name = name
        # strict: reject double frees, foreign pages and duplicates inside one free() (checks
        # the metadata-only replay skips on its hot path; the invariant checker catches double
        # ownership anyway).
        self.strict = strict
        self.num_pages = num_pages
        self.page_size = page_size
        # Pop from the end: page 0 is handed out first.
        self._free = np.arange(num_pages - 1, -1, -1, dtype=np.int64)
        self._n_free = num_pages
        self._allocated = np.zeros(num_pages, dtype=bool)

    @property
    def free_pages(self) -> int:
        return self._n_free

    @property
    def used_pages(self) -> int:
        return self.num_pages - self._n_free

    def shortfall(self, n: int, like=None) -> int:
        """Pages missing for ``alloc(n, like)`` (0: it fits now)."""
        return max(0, n - self._n_free)

    def alloc(self, n: int, like=None) -> np.ndarray:
        """Take ``n`` free pages. Raises :class:`OutOfCapacity` (callers evict first).

        ``like``: pages of another tier the new ones stand for (a restore's source, a backup's
        source). A plain pool ignores it; an allocator with placement classes (CP owner ranks,
        ``engine.parallel.cp``) returns pages of the same classes."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > self._n_free:
            raise OutOfCapacity(f"{self.name}: asked for {n} pages, {self._n_free} free")
        start = self._n_free - n
        pages = self._free[start:self._n_free][::-1].copy()
        self._n_free = start
        self._allocated[pages] = True
        return pages

    def free(self, pages: np.ndarray) -> None:
        pages = np.asarray(pages, dtype=np.int64)
        if pages.size == 0:
            return
        if self.strict:
            assert self._allocated[pages].all(), (
                f"{self.name}: double free or foreign pages "
                f"{pages[~self._allocated[pages]][:8].tolist()}")
            if pages.size > 1:
                assert np.unique(pages).size == pages.size, \
                    f"{self.name}: duplicate pages in one free"
        self._allocated[pages] = False
        end = self._n_free + pages.size
        self._free[self._n_free:end] = pages[::-1]
        self._n_free = end

    def is_allocated(self, pages: np.ndarray) -> np.ndarray:
        return self._allocated[np.asarray(pages, dtype=np.int64)]

    def allocated_pages(self) -> np.ndarray:
        return np.flatnonzero(self._allocated)

    def slots(self, pages: np.ndarray) -> np.ndarray:
        """Token slots of ``pages`` in order (``page * page_size + offset``)."""
        pages = np.asarray(pages, dtype=np.int64)
        return (pages[:, None] * self.page_size + np.arange(self.page_size)).reshape(-1)
