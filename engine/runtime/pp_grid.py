"""The process grid of ``bench serve --pp K --tp N``: K pipeline stages, each a TP group of N
processes (docs/parallelism.md, "--pp with --tp").

Global rank ``g = stage · N + t``: a stage's TP ranks are consecutive. Rank 0 (stage 0, TP rank 0)
serves HTTP and leads. What travels where:

* the step's intake: rank 0 broadcasts it to the whole world (every rank applies it);
* inside a stage: the TP all-reduces (after the output and down projections) over the stage's TP
  group, and the L3 agreements of the stage's :class:`~engine.parallel.tp_cache.TPCache`;
* between stages, per *column* (TP rank t of every stage): the hidden states (after the
  all-reduce every TP rank of a stage holds the whole hidden state, so TP rank t of stage s sends
  it to TP rank t of stage s + 1 — no relay through a stage's TP rank 0) and the pp_sync ACK
  counts: stage 0's TP ranks agree on the minimum over their TP group, so every column carries
  the same counts down;
* the decisions (tokens, logprobs): the last stage's TP rank 0 broadcasts them to the world (its
  TP peers computed the same logits).

Every rank creates every group in the same order (``new_group`` is collective).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from engine.parallel.pp_sync import adjacent_groups


def split(rank: int, tp: int) -> tuple[int, int]:
    """``(stage, tp_rank)`` of global rank ``rank``."""
    return divmod(rank, tp)


def column(tp: int, pp: int, tp_rank: int) -> list[int]:
    """The global ranks of TP rank ``tp_rank`` in stages 0…pp-1."""
    return [s * tp + tp_rank for s in range(pp)]


@dataclasses.dataclass(frozen=True)
class GridGroups:
    """One rank's groups: ``tp_group`` (gloo: agreements), ``reduce_group`` (the activations'
    all-reduce; NCCL on GPUs), ``ack``/``act`` (two-member groups between adjacent stages of its
    column, for pp_sync's threads and the hidden states)."""

    stage: int
    tp_rank: int
    tp: int
    pp: int
    tp_group: Any
    reduce_group: Any
    ack: list
    act: list

    @property
    def column(self) -> list[int]:
        return column(self.tp, self.pp, self.tp_rank)

    @property
    def decider_rank(self) -> int:
        """The global rank that samples and broadcasts the decisions: the last stage's TP
        rank 0."""
        return (self.pp - 1) * self.tp


def grid_groups(pp: int, tp: int, rank: int, backend: str = "gloo") -> GridGroups:
    """Create every group of the grid (all ranks, same order); return ``rank``'s."""
    import torch.distributed as dist

    stage, tp_rank = split(rank, tp)
    members = [[s * tp + t for t in range(tp)] for s in range(pp)]
    tp_groups = [dist.new_group(m, backend="gloo") for m in members]
    reduce_groups = ([dist.new_group(m, backend=backend) for m in members]
                     if backend != "gloo" else tp_groups)
    ack = [adjacent_groups(pp, column(tp, pp, t)) for t in range(tp)]
    act = [adjacent_groups(pp, column(tp, pp, t)) for t in range(tp)]
    return GridGroups(stage=stage, tp_rank=tp_rank, tp=tp, pp=pp, tp_group=tp_groups[stage],
                      reduce_group=reduce_groups[stage], ack=ack[tp_rank], act=act[tp_rank])


def grid_model(model: Any, cfg: Any, rank: int, backend: str) -> tuple[Any, GridGroups]:
    """Global rank ``rank``'s groups and its TP shard of ``model`` (all layers; the engine then
    keeps its stage's), the all-reduce over its stage's TP group."""
    from engine.runtime.model.tp import tp_model
    from engine.runtime.tp_serve import make_reduce

    grid = grid_groups(cfg.pp, cfg.tp, rank, backend)
    return tp_model(model, grid.tp_rank, cfg.tp, make_reduce(backend, grid.reduce_group)), grid
