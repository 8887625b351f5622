"""The lockstep scheduler: every rank of a group makes the same decisions at the same step.

Rank 0 (the leader, which serves HTTP) drains its inbox at the start of each step and
broadcasts what it took — one message per step, in one wire format (:func:`encode_intake`):
new requests (:meth:`_Req.to_wire`), aborts, early stops, flushes, and finally the halt.
Every rank applies the same items in the same order and then runs the same step — admission,
the agreed transfer commits, the forward (with its TP all-reduces, CP gathers or pipeline
hand-offs) and sampling — so all ranks produce the same tokens and record the same events.
Read-only calls (``Scheduler.call``) run on rank 0 alone, in inbox order.

* **Halt.** Once rank 0's scheduler is asked to stop, its next intake carries ``halt``: every
  rank aborts what is left (the same requests, in the same order), the loop ends, and each rank
  writes its log and snapshot (engine.runtime.ranks.worker).
* **Flush.** ``request_flush(scope)`` is an intake item: every rank empties the same tiers at
  the same step.
* **Cache hints.** Rank 0's hint clock (``clock``: its ``time.monotonic()``, last item of every
  intake) and session closes (``close_session``: namespace, session) are intake items too, so
  every rank's cache takes the same TTL and close decisions at the same step.
* **A lost rank.** A collective that fails, or a forward that raises, ends the group: a rank's
  own error is fatal (its peers already ran that step). Rank 0 names the cause through
  ``health()`` (the launcher's view: a rank killed by the watchdog for silence first, then one
  killed or failed on its own, then those that only lost their peers), fails every request
  with that one line and stops stepping; a follower exits (engine.runtime.ranks.worker).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import Any, Callable

import msgpack
import torch

from engine.core.errors import HiCacheError
from engine.runtime.scheduler.core import Scheduler
from engine.runtime.scheduler.params import FinishReason
from engine.runtime.scheduler.request import _Phase, _Req
from engine.runtime.topology import Topology

log = logging.getLogger("hicache.ranks")

# What an intake message may carry besides requests: (kind, str | None) items.
INTAKE_KINDS = frozenset({"req", "abort", "stop", "flush", "halt", "l3_release", "clock",
                          "close_session"})
MAX_INTAKE_BYTES = 1 << 30


class GroupLost(HiCacheError):
    """The group cannot go on: a rank died, hung or failed (the message names it)."""


def is_link_error(exc: BaseException) -> bool:
    """Whether ``exc`` came from the ranks' links (a peer gone or silent) rather than from
    this rank's own work."""
    dist_error = getattr(torch.distributed, "DistError", None)
    if dist_error is not None and isinstance(exc, dist_error):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(
        w in text for w in ("gloo", "connection", "timed out", "peer", "socket", "nccl",
                            "broken pipe", "closed"))


def encode_intake(items: list) -> bytes:
    return msgpack.packb(items, use_bin_type=True)


def decode_intake(data: bytes) -> list:
    """The items of one intake message; ``ValueError`` for anything malformed."""
    items = msgpack.unpackb(data, raw=False, max_bin_len=MAX_INTAKE_BYTES,
                            max_str_len=MAX_INTAKE_BYTES, strict_map_key=True)
    if not isinstance(items, list) or not all(
            isinstance(i, list) and len(i) == 2 and i[0] in INTAKE_KINDS for i in items):
        raise ValueError(f"malformed intake message on the rank link: {str(items)[:80]}")
    return items


def broadcast_bytes(data: bytes | None, src: int = 0, group: Any = None) -> bytes:
    """``data`` from rank ``src`` to every rank of ``group``: its length, then its bytes (two
    tensor broadcasts; nothing is unpickled)."""
    import torch.distributed as dist

    n = torch.tensor([0 if data is None else len(data)], dtype=torch.int64)
    dist.broadcast(n, src=src, group=group)
    size = int(n.item())
    if not 0 <= size <= MAX_INTAKE_BYTES:
        raise ValueError(f"intake message of {size} bytes on the rank link")
    buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8) if data
           else torch.empty(size, dtype=torch.uint8))
    if size:
        dist.broadcast(buf, src=src, group=group)
    return buf.numpy().tobytes() if size else b""


class LockstepScheduler(Scheduler):
    """A :class:`Scheduler` that steps in lockstep with the other ranks of its topology."""

    def __init__(self, model: Any, cache: Any, config: Any = None, *, topology: Topology,
                 health: Callable[[], list[str]] = lambda: [], consensus: Any = None, **kw: Any):
        """``health()``: rank 0's view of the ranks that are gone (the launcher's), most
        likely cause first. ``consensus``: an
        :class:`~engine.parallel.consensus_online.OnlineConsensus` over this rank's events
        (``--consensus-check online``): compared after every step it names."""
        super().__init__(model, cache, config, **kw)
        self.consensus = consensus
        self.topology = topology
        self.leader = topology.leader
        self.health = health
        self.broken = False
        self._unsent: list[_Req] = []       # taken from the inbox by the step that failed
        self._loop_done = threading.Event()

    @property
    def group_word(self) -> str:
        """The group in messages: ``pipeline`` or ``TP group``, ``CP group``…"""
        return "pipeline" if self.topology.pp > 1 else f"{self.topology.kind} group"

    # -- intake: rank 0 decides, every rank applies ------------------------------------------
    def request_flush(self, scope: str = "cache") -> None:
        """Flush every rank's cache at the same step (``/flush_cache``; ``scope``: a
        :class:`~engine.cache.types.FlushScope` value)."""
        self._inbox.put(("flush", str(scope)))

    def _intake_extra(self) -> list:
        """Rank 0: items of its own to send with the step's intake (pipeline: L3 releases)."""
        return []

    def _apply_extra(self, kind: str, item: Any) -> None:
        raise ValueError(f"unexpected intake item {kind!r}")

    def _after_intake(self) -> None:
        """Every rank, after applying the step's intake."""

    def _drain_inbox(self, block: bool = False) -> None:
        if self.broken or self.halted:        # the loop's exit path: fail, never queue
            for kind, item in self._pull_inbox():
                if kind == "req":
                    self._finish(item, FinishReason.ERROR,
                                 error=self.last_error or f"the {self.group_word} has stopped")
                elif kind == "call":
                    self._handle(kind, item)
            return
        local: list = []
        data = None
        if self.leader:
            local = self._pull_inbox(block)
            wire = [[k, i.to_wire() if k == "req" else i] for k, i in local
                    if k not in ("call", "wake")]
            wire += [list(x) for x in self._intake_extra()]
            if self._stop.is_set():
                wire.append(["halt", None])
            else:
                wire.append(["clock", time.monotonic()])
            data = encode_intake(wire)
            self._unsent = [i for k, i in local if k == "req"]
        got = broadcast_bytes(data, src=0)
        self._unsent = []
        if self.leader:
            for kind, item in local:
                self._apply_item(kind, item)
            for kind, item in decode_intake(got):
                if kind not in ("req", "abort", "stop", "flush", "close_session"):
                    self._apply_item(kind, item)
        else:
            for kind, item in decode_intake(got):
                self._apply_item(kind, _Req.from_wire(item) if kind == "req" else item)
        if not self.halted:
            self._after_intake()

    def _apply_item(self, kind: str, item: Any) -> None:
        if kind == "req" and not self.leader:
            with self._lock:
                self._by_rid[item.rid] = item
        if kind == "flush":
            self.cache.flush(item or "cache")
        elif kind == "halt":
            for r in list(self._running) + list(self._waiting):
                self._finish(r, FinishReason.ABORT)
            self.halted = True
            self._on_halt()
        elif kind == "clock":
            if isinstance(item, bool) or not isinstance(item, (int, float)) or \
                    not math.isfinite(item):
                raise ValueError(f"malformed hint clock on the rank link: {item!r}")
            self.cache.set_clock(float(item))
        elif kind == "close_session":
            if not (isinstance(item, list) and len(item) == 2 and isinstance(item[1], str)):
                raise ValueError(f"malformed session close on the rank link: {item!r}")
            self._handle(kind, item)
        elif kind in ("req", "abort", "stop", "call"):
            self._handle(kind, item)
        elif kind == "wake":             # Scheduler.stop's nudge: nothing to apply
            pass
        else:
            self._apply_extra(kind, item)

    def _tick_clock(self) -> None:
        """The hint clock came with the intake (rank 0's): nothing to read here."""

    def _on_halt(self) -> None:
        """Every rank, once the halt is applied (pipeline: close pp_sync's links)."""

    def _decided(self) -> None:
        # Before the forward: a divergent admission or prefetch would make the ranks enter the
        # forward's collectives with different sizes (gloo aborts the process on that).
        if self.consensus is not None:
            self.consensus.step_done(self.step_no)   # a collective: every rank, same steps

    # -- a lost group ----------------------------------------------------------------------
    def _batch_failed(self, exc: Exception, reqs: list[_Req]) -> None:
        raise exc                  # the peers ran this step: the group cannot go on

    def _named_dead(self) -> list[str]:
        """The launcher's list of gone ranks; a rank that was killed may still be exiting (or
        its node still posting it): wait a moment for one that is not only a lost peer."""
        dead: list[str] = []
        for _ in range(30):
            dead = self.health()
            if any("(code 1)" not in d for d in dead):
                break
            threading.Event().wait(0.1)
        return dead

    def lost(self, exc: BaseException) -> str:
        """Rank 0: the one line that says why the group stopped; fail every request with it."""
        self.broken = True
        first = str(exc).splitlines()[0][:200] if str(exc) else ""
        from engine.parallel.consensus_online import RankConsensusError

        dead = [] if isinstance(exc, RankConsensusError) else self._named_dead()
        if isinstance(exc, RankConsensusError):  # every rank saw it at the same check
            msg = f"stopped before a hang: {exc}"
        elif dead:
            msg = f"{dead[0]}; the {self.group_word} cannot continue"
        elif is_link_error(exc):
            msg = (f"a {self.group_word} collective failed ({type(exc).__name__}: {first}); a "
                   f"rank died or hung")
        else:
            msg = (f"{self.topology.name()} failed: {type(exc).__name__}: {first}; the "
                   f"{self.group_word} cannot continue")
        self.last_error = msg
        log.error("%s", msg)
        self._fail_all(msg)
        for r in self._unsent:
            self._finish(r, FinishReason.ERROR, error=msg)
        self._unsent = []
        return msg

    # -- the loops -------------------------------------------------------------------------
    def _loop(self) -> None:
        """Rank 0's scheduler thread: step until halted (or the group is lost)."""
        try:
            while not self.halted:
                self.step(block=True)
        except Exception as exc:  # noqa: BLE001 - named, then every request is failed
            log.debug("the %s stopped", self.group_word, exc_info=True)
            self.lost(exc)
        finally:
            for r in list(self._running) + list(self._waiting):
                if r.phase is not _Phase.DONE:
                    self._finish(r, FinishReason.ABORT)
            self._drain_inbox()
            self._loop_done.set()

    def serve(self) -> None:
        """A follower's loop: step until rank 0's halt (exceptions: the group is lost)."""
        while not self.halted:
            self.step(block=False)

    def halt(self) -> None:
        """Rank 0, its loop not running (never started, or stopped): send the halt now."""
        if not self.leader or self.halted or self.broken or \
                (self._thread is not None and not self._loop_done.is_set()):
            return
        self._stop.set()
        try:
            self._drain_inbox()
        except Exception as exc:  # noqa: BLE001 - the group is already gone
            self.broken = True
            log.warning("could not halt the other ranks: %s", exc)

