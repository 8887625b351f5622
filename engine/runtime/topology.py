"""The rank topology of a server: ``pp`` pipeline stages × ``tp`` tensor-parallel ranks ×
``cp`` context-parallel ranks, spread evenly over ``nnodes`` hosts — and one rank's place in it.

One value says which ranks exist, how they are grouped and what each is called; every group
(engine.runtime.ranks.groups) is cut from it and every message names a rank through
:meth:`Topology.name`. The layout:

* global rank ``g = stage · (tp·cp) + index``, ``index = cp_rank · tp + tp_rank``: a stage's ranks
  are consecutive, a TP group is a run of ``tp`` consecutive ranks;
* node ``R`` runs ranks ``R·k … R·k + k - 1`` (``k = world / nnodes``); rank 0 — on node 0 — serves
  HTTP, hosts the rendezvous and leads the lockstep;
* the *column* of a rank is its ``index`` in every stage (hidden states and ACK counts travel
  down a column); the last stage's index 0 samples for everyone (the *decider*).

A pure value: no process, no ``torch.distributed`` (docs/parallelism.md).
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class Topology:
    pp: int = 1
    tp: int = 1
    cp: int = 1
    nnodes: int = 1
    rank: int = 0                 # this process's global rank

    def __post_init__(self) -> None:
        for k in ("pp", "tp", "cp", "nnodes"):
            if getattr(self, k) < 1:
                raise ValueError(f"--{k} must be >= 1, got {getattr(self, k)}")
        if not 0 <= self.rank < self.world:
            raise ValueError(f"rank {self.rank} outside a world of {self.world}")

    @classmethod
    def of(cls, cfg: Any, rank: int = 0) -> "Topology":
        """The topology a :class:`~engine.runtime.config.ServerConfig` asks for, seen from
        ``rank``."""
        return cls(pp=cfg.pp, tp=cfg.tp, cp=cfg.cp, nnodes=cfg.nnodes, rank=rank)

    def at(self, rank: int) -> "Topology":
        """The same topology seen from another rank."""
        return dataclasses.replace(self, rank=rank)

    # -- sizes -------------------------------------------------------------------------------
    @property
    def world(self) -> int:
        return self.pp * self.tp * self.cp

    @property
    def group_size(self) -> int:
        """Ranks per pipeline stage (its TP × CP group)."""
        return self.tp * self.cp

    @property
    def single(self) -> bool:
        """One process: nothing runs in lockstep."""
        return self.world == 1

    @property
    def per_node(self) -> int:
        return self.world // self.nnodes

    # -- this rank's coordinates ---------------------------------------------------------------
    @property
    def stage(self) -> int:
        return self.rank // self.group_size

    @property
    def index(self) -> int:
        """Rank within its stage: ``cp_rank · tp + tp_rank``."""
        return self.rank % self.group_size

    @property
    def tp_rank(self) -> int:
        return self.index % self.tp

    @property
    def cp_rank(self) -> int:
        return self.index // self.tp

    @property
    def node(self) -> int:
        return self.rank // self.per_node

    @property
    def leader(self) -> bool:
        """Rank 0: serves HTTP, drains the intake, hosts the rendezvous."""
        return self.rank == 0

    @property
    def first_stage(self) -> bool:
        return self.stage == 0

    @property
    def last_stage(self) -> bool:
        return self.stage == self.pp - 1

    @property
    def column(self) -> list[int]:
        """The global ranks of this rank's place (``index``) in stages 0 … pp-1."""
        return [s * self.group_size + self.index for s in range(self.pp)]

    @property
    def decider_rank(self) -> int:
        """The rank that samples and broadcasts the decisions: the last stage's index 0."""
        return (self.pp - 1) * self.group_size

    @property
    def decider(self) -> bool:
        return self.rank == self.decider_rank

    # -- who runs where ------------------------------------------------------------------------
    def node_ranks(self, node: int) -> range:
        """The ranks host ``node`` runs."""
        k = self.per_node
        return range(node * k, (node + 1) * k)

    def followers(self, node: int = 0) -> list[int]:
        """The ranks host ``node`` starts as processes (node 0: all but rank 0)."""
        return [r for r in self.node_ranks(node) if r != 0]

    def remote(self, node: int = 0) -> list[int]:
        """The ranks that run on other hosts than ``node``."""
        mine = set(self.node_ranks(node))
        return [r for r in range(self.world) if r not in mine]

    # -- names ---------------------------------------------------------------------------------
    @property
    def kind(self) -> str:
        """What the group is called in messages: ``TP``, ``CP``, ``TPxCP``, ``pipeline``
        (with TP/CP: ``PPxTP``, ``PPxCP``, ``PPxTPxCP``)."""
        parts = [k.upper() for k in ("tp", "cp") if getattr(self, k) > 1]
        if self.pp > 1:
            return "x".join(["PP"] + parts) if parts else "pipeline"
        return "x".join(parts) or "single"

    def name(self, rank: int | None = None) -> str:
        """One rank in messages: ``TP rank 1``, ``CP rank 1``, ``TP rank 1 CP rank 0 (rank 1)``;
        in a pipeline ``pipeline stage 1`` or ``pipeline stage 1 TP rank 0 (rank 2)``."""
        t = self if rank is None else self.at(rank)
        parts = ([f"TP rank {t.tp_rank}"] if self.tp > 1 else []) + \
            ([f"CP rank {t.cp_rank}"] if self.cp > 1 else [])
        if self.pp > 1:
            if not parts:
                return f"pipeline stage {t.stage}"
            return f"pipeline stage {t.stage} {' '.join(parts)} (rank {t.rank})"
        if len(parts) == 1:
            return parts[0]
        return f"{' '.join(parts)} (rank {t.rank})" if parts else f"rank {t.rank}"

    def describe(self) -> str:
        """The shape as flags: ``--pp 2 --tp 2 (4)``."""
        parts = [f"--{k} {getattr(self, k)}" for k in ("tp", "cp", "pp") if getattr(self, k) > 1]
        return " ".join(parts) + (f" ({self.world})" if len(parts) > 1 else "")
