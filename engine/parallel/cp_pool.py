"""One CP rank's view of a KV tier (docs/parallelism.md §1).

:class:`OwnedPool` wraps a device or host pool that holds only this rank's rows and speaks
*logical* page ids to everything above it: the facade's transfers call ``get_layer`` /
``set_layer`` with the logical pages of an operation, and the rank moves exactly the pages it
owns (the source and destination pages of an operation have the same owners, one by one, since
the owner-aware allocator hands out pages *like* their source), translated to its local rows.
"""

from __future__ import annotations

import numpy as np

from engine.parallel.cp import CPShape


class OwnedPool:
    """``pool`` (``DevicePool``/``HostPool`` of the per-rank page count) seen through logical
    page ids on ``rank`` of ``shape``."""

    def __init__(self, pool, shape: CPShape, rank: int):
        if not 0 <= rank < shape.size:
            raise ValueError(f"rank must be in [0, {shape.size}), got {rank}")
        self.pool = pool
        self.shape = shape
        self.rank = rank
        self.layout = pool.layout
        self.buf = pool.buf                       # this rank's rows only
        self.num_pages = pool.num_pages * shape.size

    def owned(self, pages) -> np.ndarray:
        """Local page indices of the pages of ``pages`` this rank owns, in order."""
        pages = np.asarray(pages, dtype=np.int64)
        return pages[pages % self.shape.size == self.rank] // self.shape.size

    def local_slots(self, pages) -> np.ndarray:
        """Local token rows of the owned pages of ``pages``."""
        p = self.shape.page_size
        return (self.owned(pages)[:, None] * p + np.arange(p)).reshape(-1)

    def get_layer(self, layer: int, pages):
        return self.pool.get_layer(layer, self.owned(pages))

    def set_layer(self, layer: int, pages, data) -> None:
        self.pool.set_layer(layer, self.owned(pages), data)

    def get_page(self, page: int):
        raise NotImplementedError("L3 with CP-sharded pools is not built")

    set_page = get_page
