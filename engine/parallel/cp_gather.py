"""The per-layer KV gather of context parallelism (docs/parallelism.md §1).

A rank's pool holds only the pages it owns. Before a layer attends over a cached prefix, every
rank contributes its pages of that prefix to one all-gather; the result is a *scratch buffer
grouped by owner* — rank 0's pages, then rank 1's, … each block padded to the same number of
pages — identical on every rank. Attention then reads the prefix in logical order through a page
table (:class:`GatherPlan`); nothing is reordered physically.

:class:`LayerGather` runs the gathers of one forward pass on a background thread over **two
scratch buffers used alternately**: while layer ``l`` attends over buffer ``l % 2``, the gather
of layer ``l + 1`` fills the other one. Per layer the order is: the layer's restore completes
(``ready(l)``: the load-back's per-layer event) → the rank copies its pages out and the gather
runs → attention (``wait(l)``) → the buffer is released for layer ``l + 2``. The assembled KV
never exceeds two layers' worth (``peak_scratch_bytes``).
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Callable

import numpy as np
import torch

from engine.parallel.cp import CPShape


@dataclasses.dataclass(frozen=True)
class GatherPlan:
    """Where every page of a sequence sits in the owner-grouped scratch buffer.

    ``pages``: the sequence's logical page ids in order. ``rows[r]``: the local page indices
    rank ``r`` contributes, in sequence order. ``per_rank``: pages per owner block (the largest
    count; smaller blocks are padded). ``table[i]``: the scratch page holding logical page ``i``.
    """

    shape: CPShape
    pages: np.ndarray
    rows: tuple
    per_rank: int
    table: np.ndarray

    @classmethod
    def build(cls, shape: CPShape, pages) -> "GatherPlan":
        pages = np.asarray(pages, dtype=np.int64)
        owners = shape.owner(pages)
        per_rank = int(shape.counts(owners).max()) if len(pages) else 0
        table = np.empty(len(pages), dtype=np.int64)
        rows = []
        for r in range(shape.size):
            idx = np.flatnonzero(owners == r)
            rows.append(shape.local_page(pages[idx]))
            table[idx] = r * per_rank + np.arange(len(idx))
        return cls(shape, pages, tuple(rows), per_rank, table)

    def slots(self, n_tokens: int, first_page: int = 0) -> np.ndarray:
        """Scratch token slots of positions ``0 … n_tokens-1`` of the sequence whose pages start
        at ``pages[first_page]`` (several sequences can share one plan), in logical order."""
        p = self.shape.page_size
        x = np.arange(n_tokens, dtype=np.int64)
        return self.table[first_page + x // p] * p + x % p

    def local_slots(self, rank: int) -> np.ndarray:
        """Rows of ``rank``'s local pool that it contributes, page by page."""
        p = self.shape.page_size
        return (self.rows[rank][:, None] * p + np.arange(p)).reshape(-1)


class LayerGather:
    """The gathers of one forward pass, one layer after another, on a background thread.

    ``pool``: this rank's local KV, ``[layers, kv_kinds, rows, kv_heads, head_dim]``.
    ``reads``: scratch token slots (:meth:`GatherPlan.slots`) of each sequence to read back.
    ``ready(layer)``: blocks until this rank's pages of ``layer`` are in ``pool`` (a load-back's
    ``wait_layer``); ``None`` when nothing is being restored. ``group``: the CP process group.
    """

    def __init__(self, plan: GatherPlan, rank: int, pool: torch.Tensor,
                 reads: list[np.ndarray], ready: Callable[[int], None] | None = None, group=None,
                 layers: int | None = None):
        self.plan = plan
        self.rank = rank
        self.pool = pool
        self.ready = ready
        self.group = group
        self.layers = pool.shape[0] if layers is None else layers
        n, p = plan.shape.size, plan.shape.page_size
        kinds, _, heads, dim = pool.shape[1:]
        block = plan.per_rank * p
        self._scratch = [torch.zeros((n, kinds, block, heads, dim), dtype=pool.dtype,
                                     device=pool.device) for _ in range(2)]
        self.peak_scratch_bytes = sum(t.numel() * t.element_size() for t in self._scratch)
        self._send = torch.zeros((kinds, block, heads, dim), dtype=pool.dtype, device=pool.device)
        self._mine = torch.as_tensor(plan.local_slots(rank), device=pool.device)
        # token slots into one scratch buffer seen as [n * kinds * block, heads, dim]
        self._reads = []
        for slots in reads:
            owner, within = slots // block, slots % block
            self._reads.append([torch.as_tensor((owner * kinds + k) * block + within,
                                                device=pool.device) for k in range(kinds)])
        self._done = [threading.Event() for _ in range(self.layers)]
        self._free = [threading.Semaphore(1), threading.Semaphore(1)]
        self._error: BaseException | None = None
        self.gathered_at: list[float] = []   # time.monotonic() when each layer's gather finished
        self._stop = False
        self._thread = threading.Thread(target=self._run, name=f"cp-gather-r{rank}",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import time

        import torch.distributed as dist

        try:
            n_mine = len(self._mine)
            for layer in range(self.layers):
                self._free[layer % 2].acquire()       # attention of layer - 2 is done with it
                if self._stop:
                    return
                if self.ready is not None:
                    self.ready(layer)                 # this layer's restore is complete
                if n_mine:
                    self._send[:, :n_mine] = self.pool[layer].index_select(1, self._mine)
                buf = self._scratch[layer % 2]
                dist.all_gather(list(buf.unbind(0)), self._send, group=self.group)
                self.gathered_at.append(time.monotonic())
                self._done[layer].set()
        except BaseException as exc:  # handed to the forward thread by wait(), never swallowed
            self._error = exc
            for ev in self._done:
                ev.set()

    def wait(self, layer: int) -> list[tuple[torch.Tensor, ...]]:
        """``layer``'s KV of each read, in logical order: one ``[n_tokens, heads, dim]`` tensor
        per kind (K and V, or MLA's one latent). Call :meth:`release` when done with it."""
        self._done[layer].wait()
        if self._error is not None:
            raise self._error
        flat = self._scratch[layer % 2].view(-1, *self._scratch[0].shape[-2:])
        return [tuple(flat.index_select(0, idx) for idx in read) for read in self._reads]

    def release(self, layer: int) -> None:
        self._free[layer % 2].release()

    def close(self) -> None:
        """Stop (after the last layer, or early: layers not yet gathered are skipped)."""
        self._stop = True
        for s in self._free:
            s.release()
        self._thread.join()
        if self._error is not None:
            raise self._error
