"""Context parallelism: which rank owns which KV page (docs/parallelism.md §1).

All CP ranks share one logical page-id space. With ``N`` shard ranks and page size ``p``, the
logical token slot ``x`` lives on rank ``r = q mod N`` (``q = x // p`` is the logical page id) at
row ``l = (q // N) * p + x mod p`` of that rank's local pool — pure arithmetic, no table
(:class:`CPShape`).

A *rotation* is the owner sequence of consecutive pages: a segment whose first page is owned by
``s`` has page ``k`` owned by ``(s + k) mod N``. :class:`OwnerAllocator` hands out logical page
ids with the owners a rotation asks for: it keeps one free stack per owner and returns logical
ids, so the cache facade, the tree and the transfer queues never see a local row.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from engine.cache.allocator import PageAllocator
from engine.core.errors import OutOfCapacity


@dataclasses.dataclass(frozen=True)
class CPShape:
    """``size`` shard ranks (``N``) and ``page_size`` tokens per page (``p``)."""

    size: int
    page_size: int

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"CP size must be >= 1, got {self.size}")
        if self.page_size < 1:
            raise ValueError(f"page size must be >= 1, got {self.page_size}")

    # -- pages -------------------------------------------------------------------------------
    def owner(self, q):
        """Owner rank of logical page(s) ``q``."""
        return np.asarray(q, dtype=np.int64) % self.size if not isinstance(q, int) \
            else q % self.size

    def local_page(self, q):
        """Page index of logical page(s) ``q`` in the owner's local pool."""
        return np.asarray(q, dtype=np.int64) // self.size if not isinstance(q, int) \
            else q // self.size

    def logical_page(self, rank: int, local):
        """Inverse of (:meth:`owner`, :meth:`local_page`)."""
        return local * self.size + rank

    # -- token slots ---------------------------------------------------------------------------
    def locate(self, x):
        """Logical token slot(s) ``x`` → ``(q, r, l)``: page id, owner rank, owner-local row."""
        p, n = self.page_size, self.size
        x = np.asarray(x, dtype=np.int64) if not isinstance(x, int) else x
        q = x // p
        return q, q % n, (q // n) * p + x % p

    def logical_slot(self, rank: int, row):
        """Inverse of :meth:`locate`: the logical slot held at ``row`` of ``rank``'s pool."""
        p, n = self.page_size, self.size
        return ((row // p) * n + rank) * p + row % p

    # -- rotations -----------------------------------------------------------------------------
    def rotation(self, first_owner: int, n_pages: int, skip: int = 0) -> np.ndarray:
        """Owners of pages ``skip … skip+n_pages-1`` of a segment starting at ``first_owner``."""
        return (first_owner + skip + np.arange(n_pages, dtype=np.int64)) % self.size

    def next_owner(self, first_owner: int, n_pages: int) -> int:
        """Owner of the page after a segment of ``n_pages`` starting at ``first_owner``."""
        return (first_owner + n_pages) % self.size

    def counts(self, owners: np.ndarray) -> np.ndarray:
        """Pages per rank of an owner sequence."""
        return np.bincount(np.asarray(owners, dtype=np.int64), minlength=self.size)


class OwnerAllocator:
    """Logical page ids with chosen owners, over ``N`` per-rank free stacks.

    The same interface as :class:`engine.cache.allocator.PageAllocator` — so the facade can use
    it as its L1 or L2 allocator — plus owner control. ``alloc(n, like=pages)`` returns pages
    owned by the same ranks as ``pages`` (a restore or backup keeps ownership);
    ``alloc_rotation(n, first_owner)`` returns a rotation. ``alloc(n)`` without a hint starts a
    rotation at the rank with the most free pages (lowest rank on ties): deterministic, so every
    CP rank makes the same choice.
    """

    def __init__(self, shape: CPShape, pages_per_rank: int, name: str = "pool",
                 strict: bool = True):
        self.shape = shape
        self.name = name
        self.page_size = shape.page_size
        self.pages_per_rank = pages_per_rank
        self.num_pages = shape.size * pages_per_rank
        self.ranks = [PageAllocator(pages_per_rank, shape.page_size, f"{name}[rank {r}]",
                                    strict=strict) for r in range(shape.size)]

    # -- accounting ----------------------------------------------------------------------------
    @property
    def free_pages(self) -> int:
        return sum(a.free_pages for a in self.ranks)

    @property
    def used_pages(self) -> int:
        return self.num_pages - self.free_pages

    def free_per_rank(self) -> np.ndarray:
        return np.array([a.free_pages for a in self.ranks], dtype=np.int64)

    def used_per_rank(self) -> np.ndarray:
        return np.array([a.used_pages for a in self.ranks], dtype=np.int64)

    def fresh_owner(self) -> int:
        """Where a segment with no prefix starts: the rank with the most free pages."""
        return int(np.argmax(self.free_per_rank()))

    def owners_for(self, n: int, like=None, first_owner: int | None = None) -> np.ndarray:
        if like is not None:
            owners = self.shape.owner(np.asarray(like, dtype=np.int64))
            assert len(owners) == n, f"{self.name}: {n} pages asked, {len(owners)} given as model"
            return owners
        if first_owner is None:
            first_owner = self.fresh_owner()
        return self.shape.rotation(first_owner, n)

    def shortfall(self, n: int, like=None, first_owner: int | None = None) -> int:
        """Pages some rank lacks for this request (0: it fits now)."""
        if n <= 0:
            return 0
        need = self.shape.counts(self.owners_for(n, like, first_owner))
        return int(max(0, (need - self.free_per_rank()).max()))

    # -- alloc / free --------------------------------------------------------------------------
    def alloc(self, n: int, like=None) -> np.ndarray:
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        return self._take(self.owners_for(n, like))

    def alloc_rotation(self, n: int, first_owner: int) -> np.ndarray:
        return self._take(self.shape.rotation(first_owner, n))

    def _take(self, owners: np.ndarray) -> np.ndarray:
        need = self.shape.counts(owners)
        free = self.free_per_rank()
        if (need > free).any():
            r = int(np.argmax(need - free))
            raise OutOfCapacity(f"{self.name}: rank {r} asked for {int(need[r])} pages, "
                                f"{int(free[r])} free")
        out = np.empty(len(owners), dtype=np.int64)
        for r, k in enumerate(need.tolist()):
            if k:
                out[owners == r] = self.ranks[r].alloc(k) * self.shape.size + r
        return out

    def free(self, pages) -> None:
        pages = np.asarray(pages, dtype=np.int64)
        if pages.size == 0:
            return
        owners = pages % self.shape.size
        for r in np.unique(owners).tolist():
            self.ranks[r].free(pages[owners == r] // self.shape.size)

    def is_allocated(self, pages) -> np.ndarray:
        pages = np.asarray(pages, dtype=np.int64)
        out = np.zeros(pages.shape, dtype=bool)
        owners = pages % self.shape.size
        for r in np.unique(owners).tolist():
            sel = owners == r
            out[sel] = self.ranks[r].is_allocated(pages[sel] // self.shape.size)
        return out

    def allocated_pages(self) -> np.ndarray:
        parts = [a.allocated_pages() * self.shape.size + r for r, a in enumerate(self.ranks)]
        return np.sort(np.concatenate(parts)) if parts else np.empty(0, dtype=np.int64)

    def slots(self, pages) -> np.ndarray:
        """Logical token slots of ``pages`` (``q * p + offset``)."""
        pages = np.asarray(pages, dtype=np.int64)
        p = self.page_size
        return (pages[:, None] * p + np.arange(p)).reshape(-1)

    def local_rows(self, pages, rank: int) -> np.ndarray:
        """Rows in ``rank``'s local pool of the pages of ``pages`` that ``rank`` owns."""
        pages = np.asarray(pages, dtype=np.int64)
        mine = pages[pages % self.shape.size == rank]
        p = self.page_size
        return ((mine // self.shape.size)[:, None] * p + np.arange(p)).reshape(-1)
