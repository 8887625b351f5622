"""The process grid of ``bench serve --pp K`` with ``--tp N`` and/or ``--cp M``: K pipeline
stages, each a rank group of ``M · N`` processes laid out as ``--tp N --cp M`` is on its own
(docs/parallelism.md, "--pp with --tp / --cp").

Global rank ``g = stage · (M·N) + r``, ``r = cp_rank · N + tp_rank``: a stage's ranks are
consecutive. Rank 0 (stage 0, group rank 0) serves HTTP and leads. What travels where:

* the step's intake: rank 0 broadcasts it to the whole world (every rank applies it);
* inside a stage: the TP all-reduces (after the output and down projections) over the stage's
  TP groups, CP's per-layer KV gathers over its CP groups, and the cache agreements (transfer
  commits outside pp_sync, L3 existence, prefetch and backup results) over the stage's group;
* between stages, per *column* (group rank r of every stage): the hidden states (after the
  all-reduce, and with the gathered KV, every rank of a stage holds the whole hidden state, so
  rank r of stage s sends it to rank r of stage s + 1 — no relay through a stage's rank 0) and
  the pp_sync ACK counts: stage 0's ranks agree on the minimum over their stage group, so every
  column carries the same counts down;
* the decisions (tokens, logprobs): the last stage's group rank 0 broadcasts them to the world
  (its peers computed the same logits).

Every rank creates every group in the same order (``new_group`` is collective).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from engine.parallel.pp_sync import adjacent_groups

log = logging.getLogger("hicache.pipeline")


@dataclasses.dataclass(frozen=True)
class GridGroups:
    """One rank's groups: ``stage_group`` (gloo, all ranks of its stage: agreements),
    ``reduce_group`` (its TP group, the activations' all-reduce; NCCL on GPUs; ``None`` without
    TP), ``cp_group`` (its CP group, the KV gather; ``None`` without CP), ``ack``/``act``
    (two-member groups between adjacent stages of its column, for pp_sync's threads and the
    hidden states)."""

    stage: int
    index: int          # rank within the stage: cp_rank · tp + tp_rank
    pp: int
    tp: int
    cp: int
    stage_group: Any
    reduce_group: Any
    cp_group: Any
    ack: list
    act: list

    @property
    def ranks(self) -> int:
        return self.tp * self.cp

    @property
    def tp_rank(self) -> int:
        return self.index % self.tp

    @property
    def cp_rank(self) -> int:
        return self.index // self.tp

    @property
    def column(self) -> list[int]:
        """The global ranks of this rank's place in stages 0…pp-1."""
        return [s * self.ranks + self.index for s in range(self.pp)]

    @property
    def decider_rank(self) -> int:
        """The global rank that samples and broadcasts the decisions: the last stage's group
        rank 0."""
        return (self.pp - 1) * self.ranks


def grid_groups(pp: int, tp: int, cp: int, rank: int, backend: str = "gloo") -> GridGroups:
    """Create every group of the grid (all ranks, same order); return ``rank``'s."""
    import torch.distributed as dist

    n = tp * cp
    stage, index = divmod(rank, n)
    tp_rank, cp_rank = index % tp, index // tp
    stages = [dist.new_group([s * n + i for i in range(n)], backend="gloo") for s in range(pp)]
    reduce = cp_group = None
    if tp > 1:
        groups = [[dist.new_group([s * n + c * tp + t for t in range(tp)], backend=backend)
                   for c in range(cp)] for s in range(pp)]
        reduce = groups[stage][cp_rank]
    if cp > 1:
        groups = [[dist.new_group([s * n + c * tp + t for c in range(cp)], backend="gloo")
                   for t in range(tp)] for s in range(pp)]
        cp_group = groups[stage][tp_rank]
    ack = [adjacent_groups(pp, [s * n + i for s in range(pp)]) for i in range(n)]
    act = [adjacent_groups(pp, [s * n + i for s in range(pp)]) for i in range(n)]
    return GridGroups(stage=stage, index=index, pp=pp, tp=tp, cp=cp, stage_group=stages[stage],
                      reduce_group=reduce, cp_group=cp_group, ack=ack[index], act=act[index])


def grid_model(model: Any, cfg: Any, rank: int, backend: str | None) -> tuple[Any, GridGroups]:
    """Global rank ``rank``'s groups and its model: its TP shard (all layers; the engine then
    keeps its stage's) with the all-reduce over its TP group, or the whole model without TP."""
    grid = grid_groups(cfg.pp, cfg.tp, cfg.cp, rank, backend or "gloo")
    if cfg.tp == 1:
        return model, grid
    from engine.runtime.model.tp import tp_model
    from engine.runtime.tp_serve import make_reduce

    return tp_model(model, grid.tp_rank, cfg.tp, make_reduce(backend, grid.reduce_group)), grid


def rank_name(rank: int, tp: int = 1, cp: int = 1) -> str:
    """A pipeline rank in messages: ``stage 1``; with TP/CP ``stage 1 TP rank 0 (rank 2)``,
    ``stage 1 CP rank 1 (rank 3)`` or ``stage 1 TP rank 1 CP rank 0 (rank 5)``."""
    if tp * cp == 1:
        return f"stage {rank}"
    stage, index = divmod(rank, tp * cp)
    parts = ([f"TP rank {index % tp}"] if tp > 1 else []) + \
        ([f"CP rank {index // tp}"] if cp > 1 else [])
    return f"stage {stage} {' '.join(parts)} (rank {rank})"


def start_ranks(cfg: Any) -> tuple[list[int], Any, tuple | None]:
    """Rank 0 of a pipeline: start this node's other ranks (all of them on one host; with
    ``--nnodes`` the other nodes start theirs) as processes and join the group. Returns their
    global ranks, their :class:`~engine.parallel.launch.RankProcesses` and, when some run on
    other nodes, ``(ExitBoard, those ranks)`` (they post their exits there)."""
    from engine.parallel.launch import ExitBoard, RankProcesses, node_ranks
    from engine.parallel.rendezvous import Rendezvous, launch_secret
    from engine.runtime.pipeline import stage_worker

    rdv = Rendezvous.host(cfg.dist_init_addr, launch_secret(cfg.nnodes))
    world = cfg.pp * cfg.ranks
    local = [r for r in node_ranks(world, cfg.nnodes, 0) if r != 0]
    group = RankProcesses(stage_worker, local, (world, rdv, cfg, cfg.collective_timeout_s),
                          name="stage", heartbeat_timeout_s=cfg.rank_heartbeat_timeout_s,
                          label=lambda r: f"pipeline {rank_name(r, cfg.tp, cfg.cp)}")
    for r, pid in group.pids().items():
        log.info("pipeline %s: pid %d", rank_name(r, cfg.tp, cfg.cp), pid)
    remote = [r for r in range(1, world) if r not in local]
    board = (ExitBoard(rdv), remote) if remote else None
    rdv.join(0, world, cfg.collective_timeout_s)
    return local, group, board


def ranks_health(cfg: Any, ids: list[int], procs: list, board: tuple | None,
                 silent: list[str] = ()) -> str | None:
    """Why the pipeline is unhealthy (a rank process gone), or None. A rank the watchdog
    killed (``silent``: it stopped answering), then one killed from outside, come before the
    ranks that exited (code 1) because they lost it."""
    if silent:
        return silent[0]
    gone = sorted((p.exitcode == 1, r, p.exitcode) for r, p in zip(ids, procs)
                  if not p.is_alive())
    if gone:
        _, r, code = gone[0]
        if code == 1:                   # it gave up on the group: the cause is elsewhere
            return (f"pipeline {rank_name(r, cfg.tp, cfg.cp)} exited (code 1) after losing "
                    f"its group: another rank died or hung")
        return f"pipeline {rank_name(r, cfg.tp, cfg.cp)} exited (code {code})"
    if board is not None:
        posted = board[0].exits(board[1], what="stage" if cfg.ranks == 1 else "rank")
        if posted:
            return f"pipeline {posted[0]}"
    return None
