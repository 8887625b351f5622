"""Serving on a CP group: one process per rank behind the single HTTP front end.

Rank 0 is the server process: it runs the HTTP front end and the *leader* scheduler. Ranks
1…N-1 are spawned *followers*, each with the same model, a :class:`CPCache` whose pools hold its
own pages, and a scheduler that never sees HTTP. Every step, the leader broadcasts what it took
from its inbox (new requests, aborts, stops); every rank applies the same items and then runs the
same step — admission, the agreed transfer commits (``CPCache.poll``), the forward with
:class:`ShardedKV` (per-layer gathers) and greedy or seeded sampling — so all ranks make the
same decisions, produce the same tokens and record the same events. On stop the leader
broadcasts a halt; every rank aborts what is left and writes its rank log.

A rank that dies makes the next collective fail on the others (gloo notices a closed peer; a
hung one hits the collective timeout). The leader's scheduler then stops with an error naming
the dead rank, ``/health`` answers 503 with it, and the server shuts down.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from typing import Any, Callable

import numpy as np

from engine.parallel.launch import ExitBoard, RankFailed, RankProcesses, node_ranks
from engine.parallel.rendezvous import Rendezvous, launch_secret
from engine.runtime.cp_kv import ShardedKV
from engine.runtime.scheduler.core import Scheduler
from engine.runtime.scheduler.params import FinishReason
from engine.runtime.scheduler.request import _Req

log = logging.getLogger("hicache.cp")


def _wire(kind: str, item: Any) -> tuple:
    if kind == "req":
        r: _Req = item
        return ("req", (r.rid, r.ids, r.sampling, r.namespace, r.priority, r.aborted))
    return (kind, item)


class RankScheduler(Scheduler):
    """A :class:`Scheduler` that steps in lockstep with the other ranks of its group.

    ``sync(items)`` is a broadcast from rank 0: the leader passes its drained inbox (``None`` to
    halt the followers), every rank gets the leader's list back. ``dead_ranks()`` names ranks
    whose process has exited (the leader's view), to turn a failed collective into a message.
    """

    def __init__(self, *args, sync: Callable[[Any], Any], leader: bool,
                 dead_ranks: Callable[[], list[str]] = lambda: [], **kw):
        super().__init__(*args, **kw)
        self.sync = sync
        self.leader = leader
        self.dead_ranks = dead_ranks
        self.halted = False
        self.group_name = "CP"      # in messages: the kind of group (CP or TP)
        self._broken = False
        self._stepping = False
        self._pending: list = []

    def _collective(self, items):
        try:
            return self.sync(items)
        except Exception as exc:
            raise self._failure(exc) from exc

    def _failure(self, exc: BaseException) -> RankFailed:
        """A failed collective as a :class:`RankFailed` naming the rank that died, if one did
        (it may still be exiting, or its node still posting it: wait for it a moment, and
        prefer it to a peer that only lost the group)."""
        self._broken = True
        dead = []
        for _ in range(30):      # a killed rank, not a peer that exited (code 1) after it
            dead = self.dead_ranks()
            if any("(code 1)" not in d for d in dead):
                break
            threading.Event().wait(0.1)
        first = str(exc).splitlines()[0] if str(exc) else ""
        failed = RankFailed(f"{dead[0]}; the {self.group_name} group cannot continue" if dead
                            else f"a {self.group_name} collective failed ({type(exc).__name__}: "
                                 f"{first}); a rank died or hung")
        self.last_error = str(failed)     # before any request hears of it (their 503s)
        return failed

    def step(self, block: bool = False) -> bool:
        if self.leader:
            if self._stop.is_set() or self._broken:
                return False       # no more collectives: the followers wait for the halt
            self._stepping = True
            try:
                try:
                    return super().step(block)
                except RuntimeError as exc:   # a collective of the step (the transfer or
                    raise self._failure(exc) from exc   # L3 agreement, a gather) lost a peer
            except RankFailed as exc:      # a known failure: one clear line, no traceback
                log.error("%s", exc)
                self.last_error = str(exc)
                self._fail_all(self.last_error)
                self._stop.set()
                return False
            finally:
                self._stepping = False
        if not self.leader:
            got = self._collective([])
            if got is None:
                self.halted = True
                for r in list(self._running) + list(self._waiting):
                    self._finish(r, FinishReason.ABORT)
                return False
            self._pending = got
        return super().step(block)

    def _drain_inbox(self, block: bool = False) -> None:
        if not self.leader:
            for kind, item in self._pending:
                if kind == "req":
                    rid, ids, sampling, ns, prio, aborted = item
                    r = _Req(rid, np.asarray(ids), sampling, ns, prio, None)
                    r.aborted = aborted
                    with self._lock:
                        self._by_rid[rid] = r
                    item = r
                self._handle(kind, item)
            self._pending = []
            return
        items = self._pull_inbox(block)
        if self._broken:           # the loop's exit path after a lost rank: fail, not queue
            for kind, item in items:
                if kind == "req":
                    self._finish(item, FinishReason.ERROR, error=self.last_error)
                else:
                    self._handle(kind, item)
            return
        if self._stepping:         # not when the loop's exit path drains what is left
            try:
                self._collective([_wire(k, i) for k, i in items if k != "call"])
            except RankFailed as exc:   # what it took from the inbox fails with the group
                for kind, item in items:
                    if kind == "req":
                        self._finish(item, FinishReason.ERROR, error=str(exc))
                    elif kind == "call":
                        self._handle(kind, item)
                raise
        for kind, item in items:
            self._handle(kind, item)

    def request_flush(self, scope: str = "cache") -> None:
        """Flush every rank's cache at the same step (``/flush_cache``; ``scope``: a
        :class:`~engine.cache.types.FlushScope` value)."""
        self._inbox.put(("flush", str(scope)))

    def _handle(self, kind: str, item: Any) -> None:
        if kind == "flush":
            self.cache.flush(item or "cache")
        else:
            super()._handle(kind, item)

    def halt_followers(self) -> None:
        if self.leader and not self._broken:
            try:
                self.sync(None)
            except Exception as exc:  # noqa: BLE001 - the group is already gone
                log.warning("could not halt the followers: %s", exc)


def broadcast_sync(group=None) -> Callable[[Any], Any]:
    import torch.distributed as dist

    def sync(items):
        box = [items]
        dist.broadcast_object_list(box, src=0, group=group)
        return box[0]
    return sync


def sharded_source(cache, rank: int, group=None) -> Callable:
    """``Scheduler.kv_source`` for a CP rank: the forward reads KV through ``ShardedKV``
    (``group``: the CP group of the gather, when it is not the whole world — TP x CP)."""
    def source(chunks, hooks):
        def ready(layer: int) -> None:
            for h in hooks:
                h(layer)
        return ShardedKV(chunks, cache.l1.buf, cache.shape, rank, ready=ready, group=group)
    return source


def init_group(rank: int, world: int, rdv: Rendezvous, timeout_s: float) -> None:
    """Join the group at ``rdv`` (rank 0 hosts it on the socket it bound)."""
    rdv.join(rank, world, timeout_s)


class Followers:
    """The leader's handle on the other ranks of its node (all ranks 1…N-1 on one host; with
    ``--nnodes K`` node 0's share — the other nodes start theirs, :func:`serve_node`): spawns
    them, watches them, names the dead."""

    def __init__(self, cfg, world: int, timeout_s: float = 60.0, label: str = "CP"):
        self.rendezvous = Rendezvous.host(cfg.dist_init_addr, launch_secret(cfg.nnodes))
        self.addr = self.rendezvous.addr
        ranks = [r for r in node_ranks(world, cfg.nnodes, 0) if r != 0]
        self.procs = RankProcesses(follower_main, ranks, (world, self.rendezvous, cfg,
                                                          timeout_s),
                                   name=f"{label.lower()}-rank",
                                   heartbeat_timeout_s=cfg.rank_heartbeat_timeout_s)
        for r, pid in self.procs.pids().items():
            log.info("%s rank %d: pid %d", label, r, pid)
        self._watch: threading.Thread | None = None
        local = set(node_ranks(world, cfg.nnodes, 0))
        self.remote = [r for r in range(world) if r not in local]   # on the other nodes
        self.board = ExitBoard(self.rendezvous) if self.remote else None

    def dead(self) -> list[str]:
        """The ranks that exited: this node's, then those the other nodes posted."""
        gone = self.procs.dead() + (self.board.exits(self.remote) if self.board else [])
        return sorted(gone, key=lambda d: "(code 1)" in d)   # a killed rank before its peers

    def watch(self, scheduler: Scheduler, on_failure: Callable[[str], None]) -> None:
        """Background: once the scheduler stops on a rank failure, report it and stop."""
        self._watch = watch_scheduler(scheduler, on_failure)

    def join(self, timeout: float = 10.0) -> None:
        self.procs.join(timeout)


def watch_scheduler(scheduler: Scheduler, on_failure: Callable[[str], None]) -> threading.Thread:
    """A background thread: once ``scheduler`` stops on an error (a rank or stage lost), call
    ``on_failure(scheduler.last_error)``; a normal stop ends it quietly."""
    def run():
        while scheduler.alive or scheduler.last_error is None:
            if scheduler._thread is None and scheduler.last_error is None:
                return                        # stopped normally
            threading.Event().wait(0.2)
        on_failure(scheduler.last_error)
    t = threading.Thread(target=run, name="hicache-rank-watch", daemon=True)
    t.start()
    return t


def stop_server(message: str) -> None:
    """Report a rank failure and stop this server (SIGTERM: the graceful shutdown path)."""
    log.error("stopping the server: %s", message)
    print(f"hicache: stopping: {message}", flush=True, file=__import__("sys").stderr)
    os.kill(os.getpid(), signal.SIGTERM)


def follower_main(rank: int, world: int, addr: Rendezvous, cfg, timeout_s: float) -> None:
    """A follower rank: the same engine without HTTP, stepping when the leader steps. Halted by
    the leader, it writes its rank log (``cfg.rank_log_dir``) and tree snapshot
    (``cfg.snapshot_dir``) and exits 0; a lost group exits 1."""
    from engine.runtime.serving.runtime import Engine

    signal.signal(signal.SIGINT, signal.SIG_IGN)     # Ctrl-C goes to the leader, which halts us
    logging.basicConfig(level=logging.WARNING)
    engine = Engine(cfg, cp_rank=rank, cp_addr=addr)
    sched: RankScheduler = engine.scheduler
    failed = False
    try:
        while not sched.halted:
            sched.step(block=False)
        if cfg.snapshot_dir is not None:
            write_rank_snapshot(engine, cfg.snapshot_dir)
    except (RankFailed, RuntimeError) as exc:     # the group is lost (a peer died or hung)
        first = str(exc).splitlines()[0] if str(exc) else ""
        log.error("rank %d: lost the group: %s: %s", rank, type(exc).__name__, first)
        failed = True
    finally:
        engine.stop()
    if failed:
        raise SystemExit(1)


def write_rank_snapshot(engine, directory: str) -> str:
    """This rank's tree as ``DIR/tree-rank{r}.snapshot`` (between steps: the tree is still)."""
    from engine.snapshot.take import snapshot_filename, write_snapshot

    path = os.path.join(directory, snapshot_filename(engine.cache.events.rank.rank))
    write_snapshot(path, engine.cache, engine.snapshot_meta())
    return path
