"""Every ``torch.distributed`` group a rank uses, cut from its :class:`Topology` in one place.

Every rank creates every group in the same order (``new_group`` is collective). What travels
over which group:

* ``world`` (gloo): rank 0's intake broadcast and the pipeline's decisions;
* ``stage`` (gloo, the ranks of one stage): the cache agreements (transfer commits, L3
  existence, prefetch and backup results) of a TP or CP group;
* ``reduce`` (this rank's TP group; NCCL when every rank has a GPU): the activations'
  all-reduce after the output and down projections;
* ``cp`` (this rank's CP group, gloo): the per-layer KV gathers;
* ``ack``/``act`` (two-member groups between adjacent stages of this rank's column): pp_sync's
  ACK counts (on their own threads) and the hidden states.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable

import torch

from engine.parallel.pp_sync import adjacent_groups
from engine.runtime.topology import Topology


@dataclasses.dataclass(frozen=True)
class RankGroups:
    topology: Topology
    backend: str                  # of the activations' all-reduce: gloo or nccl
    stage: Any                    # the stage's group (the world with one stage)
    reduce: Any                   # TP group (None: no TP, or the world under gloo with pp=cp=1)
    cp: Any                       # CP group (None without CP; the world with pp=tp=1)
    ack: list = dataclasses.field(default_factory=list)
    act: list = dataclasses.field(default_factory=list)

    def all_reduce(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """SUM over the TP group; a gloo reduce of a CUDA tensor goes through host memory."""
        import torch.distributed as dist

        backend, group = self.backend, self.reduce

        def reduce(t: torch.Tensor) -> torch.Tensor:
            if backend == "gloo" and t.device.type != "cpu":
                c = t.cpu()
                dist.all_reduce(c, group=group)
                return c.to(t.device)
            dist.all_reduce(t, group=group)
            return t
        return reduce


def cut_groups(topo: Topology, backend: str = "gloo") -> RankGroups:
    """Create every group of ``topo`` (call on every rank, after joining the world)."""
    import torch.distributed as dist

    pp, tp, cp, n = topo.pp, topo.tp, topo.cp, topo.group_size
    world = dist.group.WORLD
    stages = [dist.new_group([s * n + i for i in range(n)], backend="gloo") for s in range(pp)] \
        if pp > 1 else [world]
    reduce = cp_group = None
    if tp > 1:
        if pp == 1 and cp == 1 and backend == "gloo":
            reduce = None                       # the world is the TP group
        else:
            groups = [[dist.new_group([s * n + c * tp + t for t in range(tp)], backend=backend)
                       for c in range(cp)] for s in range(pp)]
            reduce = groups[topo.stage][topo.cp_rank]
    if cp > 1:
        if pp == 1 and tp == 1:
            cp_group = world
        else:
            groups = [[dist.new_group([s * n + c * tp + t for c in range(cp)], backend="gloo")
                       for t in range(tp)] for s in range(pp)]
            cp_group = groups[topo.stage][topo.tp_rank]
    ack: list = []
    act: list = []
    if pp > 1:
        acks = [adjacent_groups(pp, [s * n + i for s in range(pp)]) for i in range(n)]
        acts = [adjacent_groups(pp, [s * n + i for s in range(pp)]) for i in range(n)]
        ack, act = acks[topo.index], acts[topo.index]
    return RankGroups(topo, backend, stages[topo.stage], reduce, cp_group, ack, act)


def reduce_backend(device: str, world: int) -> str:
    """``nccl`` when the ranks run on CUDA with a GPU each and NCCL is built in, else ``gloo``."""
    import torch.distributed as dist

    if device.startswith("cuda") and torch.cuda.is_available() and \
            torch.cuda.device_count() >= world and dist.is_nccl_available():
        return "nccl"
    return "gloo"


def rank_device(device: str, rank: int, backend: str) -> str:
    """The device of rank ``rank``: its own GPU under NCCL, else the configured one."""
    return f"cuda:{rank}" if backend == "nccl" else device


def share_cores(device: str, ranks_here: int) -> Callable[[], None]:
    """On the CPU the ranks of a host share its cores: this process takes ``cores / ranks``
    compute threads (ranks that each run a thread per core wait on each other's oversubscribed
    threads at every all-reduce; measured in benchmarks/bench_tp.py). Returns what restores the
    process's thread count (a server started in a longer-lived process)."""
    before = torch.get_num_threads()
    if device == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // ranks_here))
    return lambda: torch.set_num_threads(before)
