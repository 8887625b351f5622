"""Online rank consensus (``--enable-rank-consensus``): stop as soon as ranks disagree.

Every rank hashes each event it records (``seq``, ``step``, ``kind`` and every field except
``local_*``); every ``every`` scheduler steps the ranks of one replica compare, in lock-step over a
dedicated gloo group, how many events they recorded since the last agreement and a hash of them.
When the hashes differ they exchange the per-event digests to find the first divergent event,
exchange that event, write their rank logs to a directory and raise
:class:`RankConsensusError` naming it — on every rank of the replica, with the same message. The
logs then go to ``hicache consensus-check`` for the full explanation.

Use::

    group = consensus_group(log.rank)          # collective: every rank of the world calls it
    online = OnlineConsensus(log, group, every=16, log_dir="rank-logs")
    for step in ...:
        log.set_step(step)
        ...                                    # the cache records its decisions
        online.step_done(step)                 # collective every ``every`` steps
    online.check()                             # a last comparison at shutdown

The check is a collective: every rank of the group must call :meth:`OnlineConsensus.step_done`
for the same steps (the scheduler loop already runs in lock-step).
"""

from __future__ import annotations

import datetime
import hashlib
import os
import time
from operator import itemgetter
from typing import Any

import msgpack
import torch
import torch.distributed as dist

from engine.cache.events import EventLog, RankInfo
from engine.core.errors import HiCacheError
from formats.ranklog import is_local
from formats.ranklog_compare import classify, compared_fields, differing_fields
from formats.ranklog_writer import event_packer, write_ranklog

_KEY = itemgetter(0)


class RankConsensusError(HiCacheError):
    """Ranks of one replica recorded different cache decisions (logs were written)."""

    def __init__(self, message: str, *, step: int | None, seq: int | None, kind: str | None,
                 category: str, ranks: list[int], log_dir: str):
        super().__init__(message)
        self.step, self.seq, self.kind, self.category = step, seq, kind, category
        self.ranks, self.log_dir = ranks, log_dir
        self.rid: Any = None          # the request being served when they diverged


def consensus_group(rank: RankInfo, *, timeout_s: float = 600.0) -> Any:
    """This rank's consensus group: a gloo group of the ranks sharing its ``dp_rank``.

    Collective over the default group (which may be NCCL): every rank of the world must call
    it, in the same order as its other ``new_group`` calls.
    """
    if not dist.is_initialized():
        raise ValueError("torch.distributed is not initialised; call init_process_group first")
    assert dist.get_rank() == rank.rank, (dist.get_rank(), rank)
    timeout = datetime.timedelta(seconds=timeout_s)
    world = dist.new_group(backend="gloo", timeout=timeout)
    mine = torch.tensor([rank.dp_rank], dtype=torch.int64)
    all_dp = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size())]
    dist.all_gather(all_dp, mine, group=world)
    dps = [int(t.item()) for t in all_dp]
    group = None
    for dp in sorted(set(dps)):
        members = [r for r, d in enumerate(dps) if d == dp]
        g = dist.new_group(ranks=members, backend="gloo", timeout=timeout)
        if dp == rank.dp_rank:
            group = g
    dist.destroy_process_group(world)
    return group


def event_digest(event: dict, pack: Any = None) -> int:
    """64-bit digest of an event's compared content (``seq`` included, ``local_*`` not)."""
    pack = pack or event_packer().pack
    items = sorted(((k, v) for k, v in event.items() if not is_local(k)), key=_KEY)
    return int.from_bytes(hashlib.blake2b(pack(items), digest_size=8).digest(), "little",
                          signed=True)


class OnlineConsensus:
    """Listener on an :class:`EventLog` that compares recent events across the group's ranks."""

    def __init__(self, log: EventLog, group: Any, *, every: int = 16, log_dir: str,
                 log_suffix: str = ".ranklog"):
        if every < 1:
            raise ValueError(f"every must be >= 1 step, got {every}")
        if log_suffix not in (".ranklog", ".jsonl"):
            raise ValueError(f"log_suffix must be .ranklog or .jsonl, got {log_suffix!r}")
        self.log, self.group, self.every = log, group, every
        self.log_dir, self.log_suffix = log_dir, log_suffix
        self.checks = 0
        self.seconds = 0.0      # spent recording digests and comparing (its cost, measured)
        self.written: str | None = None    # the log written at a divergence (kept as it is)
        self._agreed_rid: Any = None
        self._pack = event_packer().pack
        self._digests: list[int] = []      # one per event since the last agreement
        self._events: list[dict] = []      # those events (named on divergence, written if the
        self._hash = hashlib.blake2b(digest_size=8)   # log does not keep its own)
        self._members = dist.get_process_group_ranks(group)
        log.subscribe(self._on_event)

    # -- recording -------------------------------------------------------------------------
    def _on_event(self, ev: dict) -> None:
        t0 = time.perf_counter()
        d = event_digest(ev, self._pack)
        self._digests.append(d)
        self._events.append(ev)
        self._hash.update(d.to_bytes(8, "little", signed=True))
        self.seconds += time.perf_counter() - t0

    # -- comparing -------------------------------------------------------------------------
    def step_done(self, step: int) -> None:
        """Call after every scheduler step on every rank; compares every ``every`` steps."""
        if (step + 1) % self.every == 0:
            self.check()

    def check(self) -> None:
        """Compare now (collective). Raises :class:`RankConsensusError` on divergence."""
        t0 = time.perf_counter()
        try:
            self._check()
        finally:
            self.seconds += time.perf_counter() - t0

    def _check(self) -> None:
        self.checks += 1
        n = len(self._digests)
        h = int.from_bytes(self._hash.digest(), "little", signed=True)
        mine = torch.tensor([n, h], dtype=torch.int64)
        everyone = self._gather(mine)
        if all(torch.equal(t, everyone[0]) for t in everyone[1:]):
            self._agreed_rid = self._trigger(len(self._events) - 1)
            self._digests.clear()
            self._events.clear()
            self._hash = hashlib.blake2b(digest_size=8)
            return
        self._diverged([int(t[0]) for t in everyone])

    def _gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        out = [torch.empty_like(t) for _ in self._members]
        dist.all_gather(out, t, group=self.group)
        return out

    def _gather_bytes(self, data: bytes) -> list[bytes]:
        sizes = self._gather(torch.tensor([len(data)], dtype=torch.int64))
        width = max(int(s) for s in sizes)
        buf = torch.zeros(max(width, 1), dtype=torch.uint8)
        if data:
            buf[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        return [t[:int(s)].numpy().tobytes() for t, s in zip(self._gather(buf), sizes)]

    def _diverged(self, counts: list[int]) -> None:
        width = max(counts)
        mine = torch.zeros(max(width, 1), dtype=torch.int64)
        if self._digests:
            mine[:len(self._digests)] = torch.tensor(self._digests, dtype=torch.int64)
        rows = self._gather(mine)
        first = width  # first index where some rank has no event or digests differ
        for i in range(width):
            vals = {int(rows[r][i]) if i < counts[r] else None for r in range(len(rows))}
            if len(vals) > 1:
                first = i
                break
        mine_ev = self._events[first] if first < len(self._events) else None
        blobs = self._gather_bytes(b"" if mine_ev is None else self._pack(mine_ev))
        events = [msgpack.unpackb(b, raw=False) if b else None for b in blobs]
        path = self._write_log()
        # Nothing is recorded after the loss: the log this rank writes again on exit must be
        # the one compared here (a copy that completes during the shutdown drain would
        # otherwise add, late, the event whose absence was the divergence).
        self.log.enabled = False
        dist.barrier(group=self.group)   # every rank's log is on disk before anyone stops
        raise self._error(events, first, os.path.dirname(path) or ".")

    def _write_log(self) -> str:
        os.makedirs(self.log_dir, exist_ok=True)
        path = os.path.join(self.log_dir, f"rank{self.log.rank.rank}{self.log_suffix}")
        if self.log.keep:
            self.log.write(path)
        else:  # only the window since the last agreement is known
            write_ranklog(path, self.log.rank.header(), self._events)
        self.written = path
        return path

    def _error(self, events: list[dict | None], index: int, log_dir: str) -> RankConsensusError:
        ranks = self._members
        compared = [None if e is None else compared_fields(e) for e in events]
        seqs = {e["seq"] for e in events if e is not None}
        category = classify([None if len(seqs) > 1 else c for c in compared])
        # majority: the most common outcome (ties: an event at the expected seq, then the
        # lowest rank)
        first_seq = min(seqs) if seqs else None
        classes: list[tuple[Any, list[int]]] = []
        for r, e in zip(ranks, events):
            sig = None if e is None else (e["seq"], compared_fields(e))
            for key, members in classes:
                if key == sig:
                    members.append(r)
                    break
            else:
                classes.append((sig, [r]))
        majority = max(classes, key=lambda kv: (len(kv[1]), kv[0] is not None
                                                and kv[0][0] == first_seq))[1]
        minority = [r for r in ranks if r not in majority]
        ref = events[ranks.index(majority[0])] or next(e for e in events if e is not None)
        fields = differing_fields(compared) + (["seq"] if len(seqs) > 1 else [])

        def show(e: dict | None) -> str:
            if e is None:
                return "no event"
            vals = ", ".join(f"{k}={e.get(k)!r}" for k in fields if k != "kind")
            return f"{e.get('kind')}" + (f" ({vals})" if vals else "")

        parts = []
        for _key, members in classes:
            if members is majority:
                continue
            e = events[ranks.index(members[0])]
            parts.append(f"{'rank' if len(members) == 1 else 'ranks'} "
                         f"{', '.join(map(str, members))} recorded {show(e)}")
        rid = self._trigger(index)
        message = (f"rank consensus lost at step {ref.get('step')}, seq {ref.get('seq')} "
                   f"(event {index} since the last agreement): {category}: "
                   + "; ".join(parts)
                   + f" where {'rank' if len(majority) == 1 else 'ranks'} "
                     f"{', '.join(map(str, majority))} recorded {show(ref)}"
                   + (f", while serving request {rid}" if rid is not None else "")
                   + f". Rank logs written to {log_dir}; run `hicache consensus-check {log_dir}`")
        err = RankConsensusError(message, step=ref.get("step"), seq=ref.get("seq"),
                                 kind=ref.get("kind"), category=category, ranks=minority,
                                 log_dir=log_dir)
        err.rid = rid
        return err

    def _trigger(self, index: int) -> Any:
        """The request the ranks were serving when they diverged: the last request id among
        the events up to the first divergent one (those before it agree on every rank)."""
        for ev in reversed(self._events[:index + 1]):
            if ev.get("rid") is not None:
                return ev["rid"]
        return self._agreed_rid      # the last one of the windows that agreed
