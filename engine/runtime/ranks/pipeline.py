"""Pipeline parallelism in the server: K stage processes, each with its share of the layers, its
own KV and a scheduler that makes the same cache decisions (docs/parallelism.md §2).

* Stage 0 runs the HTTP front end. At every step it sends the step's intake (new requests,
  aborts, early stops, flushes) to every stage (``broadcast``), so every stage's scheduler sees
  the same events in the same order and admits, evicts and locks the same way.
* Completed transfers are consumed through :class:`engine.parallel.pp_sync.PPSync`: stage 0
  decides the ACK counts, later stages consume exactly those (their own copies may finish at
  other times, ``--debug-transfer-delay`` makes sure they do).
* The forward runs stage by stage: hidden states go from stage ``s`` to ``s + 1`` (point to
  point); the last stage samples and sends its decisions (tokens, logprobs) to every stage, which
  all apply them. KV never leaves its stage.

Each stage's KV layout carries its place in the whole model (``layer_start``), so L3 objects of
different stages never collide and a store written by one shape serves another.

With ``--tp``/``--cp`` every stage is a rank group (engine.runtime.topology lays out the ranks,
engine.runtime.ranks.groups says what travels over which group). The intake, the halt and the
naming of a lost rank are the lockstep's (engine.runtime.ranks.lockstep); this module adds what
only a pipeline has.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from typing import Any, Callable

import msgpack
import torch

from engine.cache.l3 import PrefetchPolicy
from engine.parallel.pp_sync import PPSync, links_for
from engine.runtime.model import Chunk, Model
from engine.runtime.model.weights import ModelWeights
from engine.runtime.ranks.lockstep import LockstepScheduler, broadcast_bytes
from engine.runtime.scheduler.request import _match_len, _Req
from engine.runtime.topology import Topology

log = logging.getLogger("hicache.pipeline")


def stage_layers(num_layers: int, num_stages: int, stage: int) -> tuple[int, int]:
    """Layers ``[lo, hi)`` of a stage: an even split, the first stages taking the remainder."""
    if not 1 <= num_stages <= num_layers:
        raise ValueError(f"--pp {num_stages}: the model has {num_layers} layers (1..{num_layers} "
                         f"stages)")
    base, extra = divmod(num_layers, num_stages)
    lo = stage * base + min(stage, extra)
    return lo, lo + base + (1 if stage < extra else 0)


def stage_model(model: Model, stage: int, num_stages: int) -> Model:
    """The part of ``model`` one stage runs (shares the weights' tensors)."""
    lo, hi = stage_layers(model.cfg.num_layers, num_stages, stage)
    w = ModelWeights(embed=model.w.embed, layers=model.w.layers[lo:hi],
                     final_norm=model.w.final_norm, lm_head=model.w.lm_head)
    m = Model(dataclasses.replace(model.cfg, num_layers=hi - lo), w, device=str(model.device),
              exact=model.exact)
    m.stage = (lo, model.cfg.num_layers)
    m.tp, m.reduce = model.tp, model.reduce      # a TP rank's shard stays one (--pp × --tp)
    return m


# A forward has a fixed cost (per layer, per chunk) that a few tokens do not outweigh: a step
# is cut only into micro-batches of at least this many tokens (a decode step of a few requests
# stays whole; measured in benchmarks/bench_pp.py).
MIN_MICRO_BATCH_TOKENS = 32


def micro_batches(chunks: list[Chunk], n: int,
                  min_tokens: int = MIN_MICRO_BATCH_TOKENS) -> list[list[Chunk]]:
    """Cut a step's chunks into at most ``n`` micro-batches of about equal token counts (each
    at least ``min_tokens``), in order. A prefill chunk may be cut in two (or more): its
    earlier pieces ask for no logits (``all_logits`` pieces keep theirs, so the rows still come
    out in chunk order); a piece's attention sees the KV its predecessors wrote, as chunked
    prefill does, so the result is the uncut chunk's. Decode chunks (one token) are never cut."""
    total = sum(len(c) for c in chunks)
    n = max(1, min(n, total // max(1, min_tokens)))
    if n == 1:
        return [list(chunks)]
    out: list[list[Chunk]] = [[]]
    placed = 0
    for c in chunks:
        off = 0
        while off < len(c):
            room = (len(out) * total) // n - placed
            if room <= 0:
                out.append([])
                continue
            take = min(room, len(c) - off)
            piece = c if take == len(c) else Chunk(
                c.tokens[off:off + take], c.start + off, c.pages,
                logits=c.logits and off + take == len(c), all_logits=c.all_logits)
            out[-1].append(piece)
            placed += take
            off += take
    return [mb for mb in out if mb]


class PipelineScheduler(LockstepScheduler):
    """A lockstep scheduler whose ranks are pipeline stages (each maybe a TP/CP group)."""

    def __init__(self, model: Model, cache: Any, config: Any, *, topology: Topology,
                 groups: Any, pp_sync: bool = True, timeout_s: float = 60.0,
                 num_micro_batches: int = 0, health: Callable[[], list[str]] = lambda: [],
                 kv_source: Any = None, consensus: Any = None):
        """``groups``: this rank's :class:`~engine.runtime.ranks.groups.RankGroups`."""
        super().__init__(model, cache, config, topology=topology, health=health,
                         kv_source=kv_source, consensus=consensus)
        t = topology
        self.stage, self.num_stages = t.stage, t.pp
        self.num_micro_batches = num_micro_batches or t.pp
        self.mb_stats = {"steps": 0, "micro_batches": 0, "split_steps": 0}
        self.first, self.last = t.first_stage, t.last_stage
        self.column, self.act_groups = t.column, groups.act
        self.decider, self.decider_rank = t.decider, t.decider_rank
        peers = groups.stage if self.first and t.group_size > 1 else None   # stage 0 agrees
        self.sync = PPSync(links_for(t.stage, t.pp, groups.ack, self.column, peers),
                           enabled=pp_sync, timeout_s=timeout_s)
        self._l3_held: dict[str, tuple[Any, float]] = {}   # rid -> (its L3 fetch, started)
        self._l3_probed: set[str] = set()

    # -- intake: what a pipeline adds to the lockstep's ---------------------------------------
    def _intake_extra(self) -> list:
        return self._l3_overdue()

    def _apply_extra(self, kind: str, item: Any) -> None:
        if kind == "l3_release":
            self._l3_held.pop(item, None)
        else:
            super()._apply_extra(kind, item)

    def _after_intake(self) -> None:
        self._hold_for_l3()

    def _on_halt(self) -> None:
        self.sync.close()         # a clean stop: let the next stage's link end too

    def _consume_completions(self) -> None:
        self.sync.step(self.cache)

    # -- L3 prefetch policy ``timeout``: a request waits for its fetch ---------------------------
    # A pipeline commits L3 fetches only at the step pp_sync names (``L3Tier.ordered``), never at
    # admission. So under ``timeout`` a request whose prefix L3 holds starts its fetch when it
    # arrives and stays waiting (behind the others) until the fetch is committed — the same
    # step on every stage — or until stage 0 sees the prefetch timeout pass and releases it in
    # its intake; admitted, it finds the fetched pages in L2.
    def _l3_timeout(self) -> Any:
        l3 = getattr(self.cache, "l3", None)
        if l3 is None or not l3.ordered or l3.policy is not PrefetchPolicy.TIMEOUT or \
                self.config.disable_radix_cache:
            return None
        return l3

    def _held(self, r: _Req) -> bool:
        entry = self._l3_held.get(r.rid)
        return entry is not None and entry[0] in self.cache.l3.inflight

    def _hold_for_l3(self) -> None:
        """Every stage, after the intake: start the fetch of each new waiting request; held
        requests go to the back of the queue (the same order on every stage)."""
        l3 = self._l3_timeout()
        if l3 is None:
            return
        waiting = {r.rid for r in self._waiting}
        self._l3_probed &= waiting
        for rid in [k for k in self._l3_held if k not in waiting]:
            del self._l3_held[rid]
        for r in self._waiting:
            if r.rid in self._l3_probed:
                continue
            self._l3_probed.add(r.rid)
            before = len(l3.inflight)
            self.cache.match(r.ids[:_match_len(r)], r.namespace, rid=r.rid, priority=r.priority)
            if len(l3.inflight) > before and l3.inflight[-1].kind == "get":
                self._l3_held[r.rid] = (l3.inflight[-1], time.monotonic())
        if any(self._held(r) for r in self._waiting):
            self._waiting = collections.deque(
                [r for r in self._waiting if not self._held(r)] +
                [r for r in self._waiting if self._held(r)])

    def _l3_overdue(self) -> list:
        """Stage 0: releases for held requests whose fetch outlived the prefetch timeout."""
        l3 = self._l3_timeout()
        if l3 is None:
            return []
        now = time.monotonic()
        return [("l3_release", rid) for rid, (job, t0) in self._l3_held.items()
                if now - t0 >= l3.timeout]

    def _admit(self, r: _Req) -> bool:
        if r.rid in self._l3_held and self._held(r):
            return False
        if not super()._admit(r):
            return False
        entry = self._l3_held.pop(r.rid, None)
        if entry is not None:           # what its own fetch brought counts as an L3 hit
            moved = min(int(entry[0].result or 0) * self.page_size, r.cached_host)
            r.cached_host -= moved
            r.cached_storage += moved
        return True

    # -- the forward, stage by stage, micro-batch by micro-batch --------------------------------
    def _forward(self, chunks: list, reqs: list) -> torch.Tensor | None:
        """Run the step's batch as micro-batches: this stage sends micro-batch ``m``'s hidden
        states on (without waiting for them to be taken) and starts ``m + 1`` while the next
        stage works on ``m``. Every stage cuts the batch the same way (:func:`micro_batches`),
        so the sizes it receives are the sizes it expects. The last stage returns the logits
        of the whole batch, in chunk order."""
        import torch.distributed as dist

        # Every micro-batch waits on every load of the step, layer by layer (a request's
        # pieces may sit in two micro-batches; the waits return at once once a layer is in).
        hooks = [r.load.wait_layer for r in reqs if r.load is not None]
        mbs = micro_batches(chunks, self.num_micro_batches)
        self.mb_stats["steps"] += 1
        self.mb_stats["micro_batches"] += len(mbs)
        self.mb_stats["split_steps"] += len(mbs) > 1
        t0 = time.perf_counter()
        outs, sending = [], []
        try:
            for mb in mbs:
                hidden = None
                if not self.first:
                    n = sum(len(c) for c in mb)
                    hidden = torch.empty((n, self.model.cfg.hidden), dtype=self.model.dtype)
                    dist.recv(hidden, src=self.column[self.stage - 1],
                              group=self.act_groups[self.stage - 1])
                kv = self.cache.l1.buf if self.kv_source is None else self.kv_source(mb, hooks)
                try:                      # a CP rank reads KV through its per-layer gathers
                    out = self.model.forward(mb, kv, self.page_size, hooks, hidden_in=hidden,
                                             hidden_out=not self.last)
                finally:
                    if kv is not self.cache.l1.buf:
                        kv.close()
                if self.last:
                    outs.append(out)
                else:                     # keep the tensor alive until its send completes
                    t = out.to("cpu").contiguous()
                    sending.append((dist.isend(t, dst=self.column[self.stage + 1],
                                               group=self.act_groups[self.stage]), t))
        finally:
            for work, _ in sending:
                if work is not None:
                    work.wait()
        self.metrics.forward_seconds += time.perf_counter() - t0
        return torch.cat(outs) if self.last else None

    def _decide(self, chunks: list, reqs: list, logits: torch.Tensor | None) -> list:
        """The decider samples; every rank gets its decisions (msgpack bytes: plain values,
        nothing unpickled on the rank link)."""
        data = None
        if self.decider:
            data = msgpack.packb(super()._decide(chunks, reqs, logits), use_bin_type=True)
        got = msgpack.unpackb(broadcast_bytes(data, src=self.decider_rank), raw=False)
        if not isinstance(got, list) or len(got) != len(chunks):
            raise ValueError("malformed decisions on the rank link")
        return got
