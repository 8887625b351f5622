"""KV of a forward pass on one CP rank: pages sharded by owner (docs/parallelism.md §1).

:class:`ShardedKV` implements the model's KV calls (``write``/``keys``/``done``, see
:class:`engine.runtime.model.transformer.PoolKV`) for a rank whose pool holds only the pages it
owns. Every CP rank runs the same forward over the same new tokens (the same logits come out on
every rank); what differs is where KV lives:

* ``write``: the rank stores the new tokens whose page it owns, at its local rows
  (``CPShape.locate``);
* ``keys``: the cached prefix of every chunk (positions before ``chunk.start``) comes from the
  per-layer owner-grouped gather (:class:`engine.parallel.cp_gather.LayerGather`, two alternating
  scratch buffers, each layer waiting for its restore), read in logical order through the page
  table, followed by the new tokens' own K/V — the same values, in the same order, as a single
  rank reads from its full pool, so the outputs are equal bit for bit.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np
import torch

from engine.parallel.cp import CPShape
from engine.parallel.cp_gather import GatherPlan, LayerGather


class ShardedKV:
    """One forward pass's KV access on rank ``rank`` of a CP group of ``shape.size``.

    ``chunks``: the forward's chunks (``start``, tokens, logical ``pages``); ``pool``: this rank's
    local KV ``[layers, kinds, rows, heads, dim]``; ``ready(layer)``: blocks until this rank's
    restored pages of ``layer`` are in ``pool`` (``None``: nothing being restored). Use as a
    context manager (or call :meth:`close`) so the gather thread ends with the pass.
    """

    def __init__(self, chunks: Sequence, pool: torch.Tensor, shape: CPShape, rank: int,
                 ready: Callable[[int], None] | None = None, group=None):
        p = shape.page_size
        self.pool = pool
        dev = pool.device
        prefix_pages: list[np.ndarray] = []
        reads: list[tuple[int, int]] = []
        self.starts: list[int] = []
        self.bounds: list[tuple[int, int]] = []
        rows, picks = [], []
        off = 0
        for c in chunks:
            pages = np.asarray(c.pages, dtype=np.int64)
            n_prefix_pages = -(-c.start // p)
            reads.append((c.start, sum(len(x) for x in prefix_pages)))
            prefix_pages.append(pages[:n_prefix_pages])
            x = np.arange(c.start, c.start + len(c), dtype=np.int64)
            q, owner, local = shape.locate(pages[x // p] * p + x % p)
            mine = owner == rank
            rows.append(local[mine])
            picks.append(np.flatnonzero(mine) + off)
            self.starts.append(c.start)
            self.bounds.append((off, off + len(c)))
            off += len(c)
        self._rows = torch.as_tensor(np.concatenate(rows), device=dev)
        self._pick = torch.as_tensor(np.concatenate(picks), device=dev)
        self._new: tuple[torch.Tensor, ...] = ()
        self._prefix: list = []
        self.gather = None
        if any(s > 0 for s in self.starts):
            plan = GatherPlan.build(shape, np.concatenate(prefix_pages))
            self.gather = LayerGather(plan, rank, pool, [plan.slots(n, first)
                                                         for n, first in reads],
                                      ready=ready, group=group)

    @property
    def peak_scratch_bytes(self) -> int:
        return self.gather.peak_scratch_bytes if self.gather is not None else 0

    def write(self, layer: int, kinds: Sequence[torch.Tensor]) -> None:
        self._new = tuple(kinds)
        for kind, t in enumerate(kinds):
            self.pool[layer, kind].index_copy_(0, self._rows, t.index_select(0, self._pick))

    def keys(self, layer: int, chunk: int) -> tuple[torch.Tensor, ...]:
        s, e = self.bounds[chunk]
        if self.starts[chunk] == 0:
            return tuple(t[s:e] for t in self._new)
        if not self._prefix:
            assert self.gather is not None, "a chunk with a prefix has a gather"
            self._prefix = self.gather.wait(layer)
        return tuple(torch.cat([old, t[s:e]]) for old, t in zip(self._prefix[chunk], self._new))

    def done(self, layer: int) -> None:
        if self.gather is not None:
            if not self._prefix:              # no chunk asked: still consume this layer
                self.gather.wait(layer)
            self._prefix = []
            self.gather.release(layer)

    def close(self) -> None:
        if self.gather is not None:
            self.gather.close()

    def __enter__(self) -> "ShardedKV":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def sharded_source(cache: Any, rank: int, group: Any = None) -> Any:
    """``Scheduler.kv_source`` for a CP rank: the forward reads KV through :class:`ShardedKV`
    (``group``: the CP group of the gather, when it is not the whole world — TP x CP)."""
    def source(chunks: Any, hooks: Any) -> ShardedKV:
        def ready(layer: int) -> None:
            for h in hooks:
                h(layer)
        return ShardedKV(chunks, cache.l1.buf, cache.shape, rank, ready=ready, group=group)
    return source
