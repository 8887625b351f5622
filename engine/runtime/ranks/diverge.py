"""Rank divergence on a live server: the classes one rank can be driven into (debug,
``--debug-diverge CLASS@RANK[:AFTER][,unguarded]``), the agreement that keeps every rank's
decisions equal anyway, and the online check that stops the group in one line when a
divergence slips through (``--consensus-check online``). docs/parallelism.md, "Rank divergence
classes", lists each class, where it comes from in real deployments and what prevents it.

* ``capacity`` — one rank's L1 is one page smaller (pools sized from the free memory each device
  reports). Prevented by a group-agreed capacity: every rank takes the smallest pool any rank
  can hold (an all-reduce MIN before the pools are built).
* ``prefetch-count`` — one TP rank's L3 store finds one page fewer of a prefix (it lost an
  object). Prevented by the agreed L3 hit length (the minimum over the TP group).
* ``ack-order`` — one rank's copies finish later, so at a given step it has fewer completed
  transfers to commit (its copies take longer, and each is seen finished only from its
  ``LAG_CHECKS``-th look on: a slow copy engine whatever the machine's load, so the step where
  it lags behind its peers comes for sure). Prevented by agreed commit counts (pp_sync's ACKs across stages, the TP
  group's minimum inside one).

* ``clock`` — one TP rank's clock runs ahead (it jumps at every reading), so under the
  ``timeout`` prefetch policy
  its L3 fetches time out where its peers' complete. Prevented by the agreed prefetch outcome
  (a fetch is committed only where every rank has it; the others treat it as a miss).
* ``host-alloc`` — one TP rank's L2 allocation for an L3 prefetch fails. Prevented by the
  agreed page count (the minimum; the surplus is freed on the ranks that got more).

* ``backup-alloc`` — one TP rank's L2 allocation for a backup (L1 → L2) fails (every second
  backup from its ``AFTER``-th on). Prevented by the agreed outcome (the minimum of "could
  allocate" over the TP group): a backup one rank cannot place is skipped on every rank.
* ``l3-exists`` — one pipeline stage's L3 store finds one page fewer of a prefix (its objects
  are its own: a lost object, a size limit evicting per stage). Prevented by one L3 decision
  for the pipeline: the existence count, the pages fetched and a backup's success are the
  minimum over every stage (an all-reduce over the replica, at admission and at the commits
  pp_sync names, the same points on every stage).
* ``evict-order`` — one rank breaks eviction ties the other way (its heap's rank-local
  tie-break, the push sequence, runs backwards from its ``AFTER``-th push). Prevented by an
  eviction order that is total on agreed data: the policy key on the logical clock, then the
  node id (the same on every rank), so the rank-local part never decides. Unguarded, every
  rank orders by a coarse recency (a wall-clock timestamp's resolution: ties) and the push
  sequence alone.

``unguarded`` turns the class's agreement off on every rank, so the divergence happens and the
online check (or ``hicache consensus-check`` on the logs) can be shown naming it.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.cache.transfer import TransferOp
from engine.runtime.config import Diverge, ServerConfig, parse_diverge
from engine.runtime.topology import Topology

DELAY_S = 0.05           # ack-order: the diverging rank's copies take this long each
LAG_CHECKS = 3           # ack-order: ... and a finished copy reads as not done this many times


def diverge_of(cfg: ServerConfig) -> Diverge | None:
    return None if cfg.debug_diverge is None else parse_diverge(cfg.debug_diverge)


def agreed_capacity(cfg: ServerConfig, topo: Topology, dv: Diverge | None) -> int:
    """This rank's L1 tokens: ``--l1-tokens``, one page less on a ``capacity`` rank, then the
    group's minimum (unless unguarded)."""
    l1 = cfg.l1_tokens
    if dv is not None and dv.cls == "capacity" and dv.rank == topo.rank:
        l1 -= cfg.page_size
    if topo.single or (dv is not None and dv.cls == "capacity" and dv.unguarded):
        return l1
    import torch.distributed as dist

    t = torch.tensor([l1], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


class LossyStore:
    """A store that, from its ``after``-th existence query on, finds one page fewer of every
    prefix it holds (an object lost on this rank's side)."""

    def __init__(self, store: Any, after: int):
        self.store, self.after, self.queries = store, after, 0

    def exists_prefix(self, hashes: Any) -> int:
        n = self.store.exists_prefix(hashes)
        self.queries += 1
        return n - 1 if n > 0 and self.queries > self.after else n

    def __getattr__(self, name: str) -> Any:      # a debug stand-in: everything else as is
        return getattr(self.store, name)


def wrap_store(store: Any, topo: Topology, dv: Diverge | None) -> Any:
    if dv is not None and dv.cls in ("prefetch-count", "l3-exists") and dv.rank == topo.rank:
        return LossyStore(store, dv.after)
    return store


class LaggingOp(TransferOp):
    """A copy that reads as not done for its first ``LAG_CHECKS`` looks after it finished
    (``wait`` is unchanged: a rank that must have it still gets it)."""

    __slots__ = ("looks",)

    def __init__(self, *args: Any, **kw: Any):
        super().__init__(*args, **kw)
        self.looks = 0

    def done(self) -> bool:
        if not super().done():
            return False
        self.looks += 1
        return self.looks > LAG_CHECKS


def apply_to_cache(cache: Any, topo: Topology, dv: Diverge | None) -> None:
    """After the cache is built: the ack-order delay on its rank; unguarded TP agreements off
    on every rank (``prefetch-count``, ``ack-order``)."""
    if dv is None:
        return
    if dv.cls == "ack-order" and dv.rank == topo.rank:
        engine = cache.transfers
        engine.debug_delay_s = max(engine.debug_delay_s, DELAY_S)
        make = engine.new_op

        def lagging(*args: Any, **kw: Any) -> Any:
            op = make(*args, **kw)
            return LaggingOp(op.op_id, op.kind, op.src, op.src_pages, op.dst, op.dst_pages,
                             op.num_layers, op.payload)
        engine.new_op = lagging
    base = _facade(cache)
    if dv.cls == "backup-alloc" and dv.rank == topo.rank:
        calls = [0]

        def fault() -> bool:
            calls[0] += 1
            return calls[0] > dv.after and calls[0] % 2 == 0     # the allocation fails
        base.backup_fault = fault
    if dv.cls == "evict-order":
        tiers = [t for t in (base._t1, base._t2) if t is not None]
        mine = dv.rank == topo.rank
        if dv.unguarded:        # ties on every rank, broken by what is local to each
            base.policy = CoarseRecency(base.policy)
            for t in tiers:
                t.tie = _reversed_after(dv.after) if mine else _push_order
        elif mine:              # the rank-local part reversed; the agreed part decides
            for t in tiers:
                t.tie = _id_then_reversed(dv.after)
    if dv.unguarded and dv.cls in ("prefetch-count", "ack-order", "clock", "host-alloc",
                                   "backup-alloc") and topo.tp > 1:
        cache.agreeing = False


def _facade(cache: Any) -> Any:
    """The :class:`HiCache` inside a TPCache / CPCache."""
    while "cache" in vars(cache):
        cache = cache.cache
    return cache


COARSE_TICKS = 1 << 40   # evict-order, unguarded: recency this coarse (every key ties)


class CoarseRecency:
    """A policy whose recency has a timestamp's resolution: the inner key with each integer
    (the logical clock, a hit count) cut to :data:`COARSE_TICKS`, so candidates tie."""

    def __init__(self, inner: Any):
        self.inner, self.name = inner, getattr(inner, "name", "coarse")

    def key(self, node: Any) -> tuple:
        return tuple(v // COARSE_TICKS if isinstance(v, int) else v
                     for v in self.inner.key(node))


def _push_order(node: Any, seq: int) -> tuple:
    return (seq,)


def _reversed_after(after: int) -> Any:
    return lambda node, seq: (seq if seq <= after else -seq,)


def _id_then_reversed(after: int) -> Any:
    return lambda node, seq: (node.id, seq if seq <= after else -seq)


FAST_CLOCK = 1000.0      # clock: seconds the diverging rank's clock jumps at every reading
CLOCK_FETCH_S = 0.05     # clock: every rank's L3 fetch takes this long (so a deadline matters)


def apply_to_l3(cache: Any, topo: Topology, dv: Diverge | None) -> None:
    """After the L3 tier is attached: the clock and allocation faults on their rank."""
    l3 = getattr(cache, "l3", None)
    if dv is None or l3 is None:
        return
    if dv.cls == "clock":            # every rank's fetch takes a moment: none is done at once
        l3.impl.debug_delay_s = max(l3.impl.debug_delay_s, CLOCK_FETCH_S)
    if dv.rank != topo.rank:
        return
    if dv.cls == "clock":
        import itertools
        import time

        ticks = itertools.count()            # each reading a FAST_CLOCK-second jump ahead
        l3.clock = lambda: time.monotonic() + next(ticks) * FAST_CLOCK
    elif dv.cls == "host-alloc":
        calls = [0]

        def cap(n: int) -> int:
            calls[0] += 1
            return 0 if calls[0] > dv.after else n      # the allocation fails
        l3.alloc_cap = cap


def stage_agreement(cfg: ServerConfig, dv: Diverge | None) -> Any:
    """The pipeline's one L3 decision: the minimum of a list of counts over every rank of the
    replica (all stages; None when an unguarded ``l3-exists`` divergence turns it off)."""
    if dv is not None and dv.cls == "l3-exists" and dv.unguarded:
        return None
    import torch.distributed as dist

    def agree(values: list[int]) -> list[int]:
        t = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return [int(v) for v in t.tolist()]
    return agree


def pp_sync_on(cfg: ServerConfig, dv: Diverge | None) -> bool:
    """pp_sync, unless an unguarded ack-order divergence turns it off."""
    return cfg.pp_sync and not (dv is not None and dv.cls == "ack-order" and dv.unguarded)
