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

With ``--tp``/``--cp`` every stage is a rank group; engine.runtime.pp_grid lays out the ranks
and their groups, and says what travels where.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import signal
import sys
import time
from typing import Any, Callable

import numpy as np
import torch

from engine.cache.l3 import PrefetchPolicy
from engine.parallel.pp_sync import PPSync, adjacent_groups, links_for
from engine.runtime.model import Chunk, Model
from engine.runtime.model.weights import ModelWeights
from engine.runtime.pp_grid import rank_name
from engine.runtime.scheduler.core import FinishReason, Scheduler
from engine.runtime.scheduler.params import SamplingParams
from engine.runtime.scheduler.request import _match_len, _Phase, _Req

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


def parse_delay(spec: str | None, num_stages: int, tp: int = 1) -> dict:
    """``--debug-transfer-delay STAGE[.TP]:MS[,...]`` → {stage: seconds} for a whole stage,
    {(stage, tp_rank): seconds} for one TP rank of a stage (``--pp K --tp N``)."""
    out: dict = {}
    for part in (spec or "").split(","):
        if not part.strip():
            continue
        try:
            s, ms = part.split(":")
            where, delay = s.split("."), float(ms)
            stage, rank = int(where[0]), (int(where[1]) if len(where) == 2 else None)
            if len(where) > 2:
                raise ValueError
        except ValueError:
            raise ValueError(f"--debug-transfer-delay {spec!r}: expected STAGE:MS or "
                             f"STAGE.TP:MS, e.g. 1:20") from None
        if not 0 <= stage < num_stages or not 0 <= delay <= 60_000 or \
                (rank is not None and not 0 <= rank < tp):
            raise ValueError(f"--debug-transfer-delay {spec!r}: stage must be 0..{num_stages - 1}"
                             f"{f', TP rank 0..{tp - 1}' if tp > 1 else ' (no TP rank without --tp)'}"
                             f" and MS 0..60000")
        out[stage if rank is None else (stage, rank)] = delay / 1000.0
    return out


def delay_for(spec: str | None, num_stages: int, tp: int, stage: int, tp_rank: int) -> float:
    """The debug delay of one rank: its own (``STAGE.TP``), else its stage's, else none."""
    d = parse_delay(spec, num_stages, tp)
    return d.get((stage, tp_rank), d.get(stage, 0.0))


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


class PipelineScheduler(Scheduler):
    """A scheduler that runs in lockstep with the other stages of a pipeline."""

    def __init__(self, model: Model, cache: Any, config: Any, *, stage: int, num_stages: int,
                 pp_sync: bool = True, timeout_s: float = 60.0, num_micro_batches: int = 0,
                 grid: Any = None):
        """``grid``: this rank's :class:`~engine.runtime.pp_grid.GridGroups` when every stage
        is a TP/CP group (``--pp K --tp N --cp M``); ``None``: one process per stage."""
        super().__init__(model, cache, config)
        self.stage, self.num_stages = stage, num_stages
        self.num_micro_batches = num_micro_batches or num_stages
        self.mb_stats = {"steps": 0, "micro_batches": 0, "split_steps": 0}
        self.first, self.last = stage == 0, stage == num_stages - 1
        if grid is None:
            self.column = list(range(num_stages))             # stage s is global rank s
            ack_groups = adjacent_groups(num_stages)          # pp_sync's links (own threads)
            self.act_groups = adjacent_groups(num_stages)     # hidden states (this thread)
            peers, self.leader, self.decider = None, stage == 0, self.last
            self.decider_rank = num_stages - 1
        else:                           # this rank's column: its place in every stage
            self.column, ack_groups, self.act_groups = grid.column, grid.ack, grid.act
            peers = grid.stage_group if self.first else None   # stage 0 agrees on the minimum
            self.leader = self.first and grid.index == 0        # takes HTTP requests
            self.decider = self.last and grid.index == 0        # samples for everyone
            self.decider_rank = grid.decider_rank
        self.sync = PPSync(links_for(stage, num_stages, ack_groups, self.column, peers),
                           enabled=pp_sync, timeout_s=timeout_s)
        self._flush_pending: str | None = None
        self._unsent: list = []
        self._stopping = False
        # stage 0: which stage is gone, if one is (the engine's view of the stage processes)
        self.dead_stage: Callable[[], str | None] = lambda: None
        self._l3_held: dict[str, tuple[Any, float]] = {}   # rid -> (its L3 fetch, started)
        self._l3_probed: set[str] = set()

    # -- intake: stage 0 decides, every stage applies ----------------------------------------
    def request_flush(self, scope: str = "cache") -> None:
        """Flush every stage's cache at the next step (call on stage 0's scheduler thread;
        ``scope``: a :class:`~engine.cache.types.FlushScope` value)."""
        self._flush_pending = str(scope)

    def _drain_inbox(self, block: bool = False) -> None:
        msg: list | None = None
        if self.leader:
            events = self._pull_inbox(block)
            msg = []
            for kind, item in events:
                if kind == "call":           # read-only helpers run on stage 0 alone
                    self._handle(kind, item)
                elif kind == "req":
                    msg.append(("req", (item.rid, item.ids.tolist(),
                                        dataclasses.asdict(item.sampling), item.namespace,
                                        item.priority)))
                else:
                    msg.append((kind, item))
            if self._flush_pending:
                msg.append(("flush", self._flush_pending))
                self._flush_pending = None
            if self._stop.is_set():
                msg.append(("shutdown", None))
            msg += self._l3_overdue()
            pending = {i.rid: i for k, i in events if k == "req"}
            self._unsent = list(pending.values())   # failed with the pipeline if it is lost
        box = [msg]
        torch.distributed.broadcast_object_list(box, src=0)
        self._unsent = []
        for kind, item in box[0]:
            if kind == "req":
                self._handle("req", pending[item[0]] if self.leader else self._rebuild(item))
            elif kind == "flush":
                self.cache.flush(item or "cache")
            elif kind == "shutdown":
                self._stopping = True
            elif kind == "l3_release":
                self._l3_held.pop(item, None)
            else:
                self._handle(kind, item)
        self._hold_for_l3()

    def _rebuild(self, item: tuple) -> _Req:
        rid, ids, sampling, namespace, priority = item
        sampling = {k: tuple(v) if isinstance(v, list) else v for k, v in sampling.items()}
        r = _Req(rid, np.asarray(ids, dtype=np.int64), SamplingParams(**sampling), namespace,
                 priority, None)
        with self._lock:
            self._by_rid[rid] = r
        return r

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
                work.wait()
        self.metrics.forward_seconds += time.perf_counter() - t0
        return torch.cat(outs) if self.last else None

    def _decide(self, chunks: list, reqs: list, logits: torch.Tensor | None) -> list:
        box = [super()._decide(chunks, reqs, logits) if self.decider else None]
        torch.distributed.broadcast_object_list(box, src=self.decider_rank)
        return box[0]

    # -- the loop ------------------------------------------------------------------------------
    def _loop(self) -> None:
        """Stage 0's scheduler thread: step until stopped, then take the other stages down."""
        try:
            while not self._stopping:
                self.step(block=True)
        except BaseException as exc:  # noqa: BLE001 - logged, then every request is failed
            first_line = str(exc).splitlines()[0][:200] if str(exc) else ""
            log.error("pipeline stage %d failed: %s: %s", self.stage, type(exc).__name__,
                      first_line)
            log.debug("pipeline stage %d failed", self.stage, exc_info=True)
            gone = None
            for _ in range(30):         # a stage that died may still be exiting (or posting)
                gone = self.dead_stage()
                if gone:
                    break
                time.sleep(0.1)
            self.last_error = (f"{gone}; the pipeline cannot continue" if gone else
                               f"pipeline stopped: stage {self.stage} lost its link to the other "
                               f"stages (one died or hung): {type(exc).__name__}: {first_line}")
            self._fail_all(self.last_error)
            for r in self._unsent:          # taken from the inbox by the step that failed
                self._finish(r, FinishReason.ERROR, error=self.last_error)
        finally:
            for r in list(self._running) + list(self._waiting):
                if r.phase is not _Phase.DONE:
                    self._finish(r, FinishReason.ABORT)
            for kind, item in self._pull_inbox():       # arrived after the last step
                if kind == "req":
                    self._finish(item, FinishReason.ERROR,
                                 error=self.last_error or "the pipeline has stopped")
                elif kind == "call":
                    self._handle(kind, item)
            if self._stopping:          # a clean stop: let the next stage's link end too
                self.sync.close()

    def serve_stage(self) -> None:
        """A later stage's main loop: step in lockstep until stage 0 says stop."""
        while not self._stopping:
            self.step(block=False)
        self.sync.close()


def stage_worker(rank: int, world: int, addr: Any, cfg: Any, timeout_s: float) -> None:
    """Main of a pipeline rank process (global ``rank >= 1`` of ``world = pp × tp × cp``): join
    the group at the rendezvous ``addr`` (a :class:`~engine.parallel.rendezvous.Rendezvous`),
    build its stage (stage ``rank // (tp·cp)``,
    group rank ``rank % (tp·cp)``), serve until rank 0 says stop. A lost group (a peer died or
    hung) is one line and exit code 1."""
    import torch.distributed as dist

    from engine.runtime.serving.runtime import Engine

    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    signal.signal(signal.SIGINT, signal.SIG_IGN)     # Ctrl-C goes to rank 0, which stops us
    stage, index = divmod(rank, cfg.ranks)
    addr.join(rank, world, timeout_s)
    eng = Engine(cfg, stage=stage, cp_rank=index)
    try:
        eng.scheduler.serve_stage()
        if cfg.snapshot_dir is not None:     # the tree is still: rank 0 said stop
            from engine.runtime.cp_serve import write_rank_snapshot

            write_rank_snapshot(eng, cfg.snapshot_dir)
    except Exception as exc:  # noqa: BLE001 - one line, then exit 1 (rank 0 names the rank)
        first = str(exc).splitlines()[0][:200] if str(exc) else ""
        log.error("pipeline %s lost its group (rank 0 or another rank stopped): %s: %s",
                  rank_name(rank, cfg.tp, cfg.cp), type(exc).__name__, first)
        # Exit now, code 1, without tearing down: taking apart groups whose collectives timed
        # out can end in std::terminate inside gloo (exit code -6, seen with --pp 2 --tp 2 and
        # a hung peer), and rank 0 would then name this rank as the one that died.
        logging.shutdown()
        sys.stderr.flush()
        os._exit(1)
    finally:
        eng.stop()
        if dist.is_initialized():       # the engine of a TP rank destroys it itself
            dist.destroy_process_group()
