"""Offline rank consensus checker: find and explain where ranks' cache decisions differ.

Ranks with the same ``dp_rank`` form a group and must record identical event streams (by
``seq``, ignoring ``local_*`` fields). For each group the checker walks all ranks' logs in
lock-step, stops at the first place where they differ, classifies it
(formats.ranklog_compare.classify), names the minority ranks, the differing fields and a few
events of context, then resynchronises every rank on the next ``step`` and keeps looking, up to
``max_divergences``. Each divergence then names the request that triggered it and the causal
chain to its first visible symptom (checkers.consensus_chain).

Speed (≥ 1M events/s/core on msgpack logs) comes from never decoding most of the data: one
rank of the group (the reference) is decoded a run of thousands of events at a time and
validated with C-level list passes (formats.ranklog.split_run); every other rank's bytes for the
same run are compared with the reference's raw bytes in one ``==``. Only when the bytes differ
(different ``local_*`` values, a real divergence, or ranks no longer aligned on ``seq``) does
the checker fall back to record-by-record comparison of decoded events. Python's cyclic GC is
paused while checking (the decoded events hold no cycles).
"""

from __future__ import annotations

import bisect
import gc
import os
from collections import deque
from typing import Any, Sequence

from checkers.consensus_chain import explain
from checkers.consensus_report import ConsensusReport, Divergence, GroupResult
from engine.core.errors import InputError
from formats.errors import FormatError
from formats.ranklog import SUFFIXES, Encoding, RankLogFile, Run, event_problem
from formats.ranklog_compare import MISSING, classify, compared_fields, differing_fields
from formats.ranklog_events import event_fields_problem

DEFAULT_CHUNK = 8192
DEFAULT_MAX_DIVERGENCES = 10
DEFAULT_CONTEXT = 3
MAX_LISTED_RANKS = 1024     # a finding lists at most this many ranks (the message has ranges)
MAX_SHOWN_RANGES = 16
MAX_VALUE_CHARS = 120       # a value quoted in a finding's message


# -- inputs --------------------------------------------------------------------------------------
def collect_logs(paths: Sequence[str | os.PathLike]) -> list[str]:
    """Files named directly plus every ``*.ranklog`` / ``*.jsonl`` directly inside directories."""
    out: dict[str, str] = {}
    for p in map(os.fspath, paths):
        if os.path.isdir(p):
            found = sorted(n for n in os.listdir(p) if n.endswith(SUFFIXES)
                           and os.path.isfile(os.path.join(p, n)))
            if not found:
                subs = sorted(n for n in os.listdir(p) if os.path.isdir(os.path.join(p, n)) and
                              any(f.endswith(SUFFIXES) for f in os.listdir(os.path.join(p, n))))
                hint = ""
                if subs:
                    shown = ", ".join(subs[:6]) + (", …" if len(subs) > 6 else "")
                    hint = (f"; its subdirectories hold rank logs (one replica each): give one, "
                            f"e.g. {os.path.join(p, subs[0])} ({shown})")
                raise InputError(f"{p}: no *.ranklog or *.jsonl files in this directory{hint}")
            for n in found:
                full = os.path.join(p, n)
                out.setdefault(os.path.realpath(full), full)
        elif os.path.exists(p):
            out.setdefault(os.path.realpath(p), p)
        else:
            raise FileNotFoundError(2, "No such file or directory", p)
    return list(out.values())


def open_logs(files: Sequence[str]) -> list[RankLogFile]:
    """Open every log and check the set belongs together (versions, ranks, world size)."""
    logs: list[RankLogFile] = []
    try:
        for path in files:
            logs.append(RankLogFile(path))
        versions = sorted({f.version for f in logs})
        if len(versions) > 1:
            by_v = "; ".join(f"v{v}: " + ", ".join(f.path for f in logs if f.version == v)
                             for v in versions)
            raise InputError(f"mixed rank log versions ({by_v}); collect logs of one run")
        for f in logs:
            f.require_supported()
        seen: dict[int, RankLogFile] = {}
        for f in logs:
            if f.rank in seen:
                raise InputError(f"duplicate rank {f.rank}: {seen[f.rank].path} and {f.path}")
            seen[f.rank] = f
        sizes = sorted({f.header["world_size"] for f in logs})
        if len(sizes) > 1:
            by_s = "; ".join(f"{s}: " + ", ".join(f.path for f in logs
                                                   if f.header["world_size"] == s) for s in sizes)
            raise InputError(f"logs disagree on world_size ({by_s}); collect logs of one run")
    except BaseException:
        for f in logs:
            f.close()
        raise
    return sorted(logs, key=lambda f: f.rank)


# -- one rank's position in its log --------------------------------------------------------------
class _Chunk:
    """A run of the reference rank's events, decoded and validated, not yet consumed."""

    __slots__ = ("stream", "start", "end", "run", "n", "_ends", "_starts")

    def __init__(self, stream: "_Stream", start: int, end: int, run: Run):
        self.stream, self.start, self.end, self.run, self.n = stream, start, end, run, len(run)
        self._ends: list[int] | None = None
        self._starts: list[int] | None = None

    def ends(self) -> list[int]:
        """Byte offset after each record (computed on first use: skipping is cheap)."""
        if self._ends is None:
            self._ends = self.stream.f.record_ends(self.start, self.n)
        return self._ends

    def starts(self) -> list[int]:
        if self._starts is None:
            self._starts = [self.start, *self.ends()[:-1]]
        return self._starts

    def end_of(self, i: int) -> int:
        return self.end if i == self.n - 1 else self.ends()[i]


class _Stream:
    """Reading position in one rank's log plus what the comparison needs to know about it."""

    def __init__(self, f: RankLogFile, keep: int):
        self.f = f
        self.rank = f.rank
        self.msgpack = f.encoding is Encoding.msgpack
        self.pos = f.body_offset
        self.expected = 0          # the seq the next event must have
        self.last_step = 0
        self.events = 0            # events consumed (compared or skipped)
        self._keep = keep          # events of history to keep reachable for context
        self._segments: deque[tuple[int, int]] = deque()  # (start offset, records) consumed
        self._held = 0
        self._plan: Any = None     # result of the last match(): how to consume

    # -- reading ahead -------------------------------------------------------------------------
    def peek(self) -> tuple[dict[str, Any], int] | None:
        """The next record as recorded (validated) and its end; ``None`` at the end."""
        r = self.f.decode_at(self.pos)
        if r is None:
            return None
        problem = event_problem(r[0])
        if problem is not None:
            raise self.f.error(self.pos, problem)
        if r[0]["seq"] < self.expected:
            raise self.f.error(self.pos, f"seq {r[0]['seq']} after seq {self.expected - 1}: "
                                         f"seq must grow by one per event")
        return r

    def chunk(self, k: int) -> _Chunk | None:
        """Up to ``k`` next events if they continue the expected seq run; else ``None``."""
        run, end = self.f.read_run(self.pos, k)
        n = len(run)
        if n == 0 or run.seqs[0] != self.expected:
            return None
        exp = self.expected
        if run.seqs != list(range(exp, exp + n)):
            g = next(i for i, s in enumerate(run.seqs) if s != exp + i)
            if run.seqs[g] < exp + g:
                off = self.f.record_ends(self.pos, g)[-1]
                raise self.f.error(off, f"seq {run.seqs[g]} after seq {exp + g - 1}: "
                                        f"seq must grow by one per event")
            run = run.cut(g)   # a gap: compare up to it, the slow path reports it
            n = g
            end = self.f.record_ends(self.pos, n)[-1]
        steps = run.steps
        if steps[0] < self.last_step or not all(map(int.__le__, steps, steps[1:])):
            prev = self.last_step
            for i, s in enumerate(steps):
                if s < prev:
                    off = self.pos if i == 0 else self.f.record_ends(self.pos, i)[-1]
                    raise self.f.error(off, f"step {s} after step {prev}: steps never decrease")
                prev = s
        return _Chunk(self, self.pos, end, run)

    def match(self, ref: _Chunk, limit: int) -> int:
        """How many of the next events equal ``ref``'s first ``limit`` (seq relative to each
        rank's own expected seq, ``local_*`` ignored).

        While this rank is aligned with the reference (same expected seq, both msgpack), runs of
        records are compared as raw bytes, galloping: the block grows while it matches and
        halves when it does not, so a lone difference costs a few comparisons. A record that
        differs in its bytes is decoded and compared without ``seq`` and ``local_*``.
        """
        f, rf = self.f, ref.stream.f
        aligned = self.msgpack and ref.stream.msgpack and self.expected == ref.run.seqs[0]
        events, exp = ref.run.events, self.expected
        o = self.pos
        shift = o - ref.start          # this rank's offset minus the reference's, per record
        marks: list[int] = [0]         # record index from which shifts[k] holds
        shifts: list[int] = [shift]
        i, w = 0, limit
        starts = ends = None
        while i < limit:
            if aligned:
                j = i + w if i + w < limit else limit
                if starts is None and not (i == 0 and j == ref.n):
                    starts, ends = ref.starts(), ref.ends()
                a = starts[i] if starts is not None else ref.start
                b = ends[j - 1] if ends is not None else ref.end
                if f.raw(o, o + b - a) == rf.raw(a, b):
                    o += b - a
                    i = j
                    w = w + w
                    continue
                if w > 1:
                    w >>= 1
                    continue
            r = f.decode_at(o)
            if r is None:
                break
            obj, e = r
            if type(obj) is not dict or obj.get("seq") != exp + i:
                break
            if compared_fields(obj) != events[i]:
                break
            if ends is None:
                starts, ends = ref.starts(), ref.ends()
            o = e
            shift = e - ends[i]
            if shift != shifts[-1]:
                marks.append(i)
                shifts.append(shift)
            i += 1
            w = 1
        self._plan = (ref, marks, shifts)
        return i
    # -- consuming -----------------------------------------------------------------------------
    def _consumed(self, start: int, n: int, end: int, last_step: int) -> None:
        self.pos = end
        self.expected += n
        self.last_step = last_step
        self.events += n
        if self._keep:
            self._segments.append((start, n))
            self._held += n
            while len(self._segments) > 1 and self._held - self._segments[0][1] >= self._keep:
                self._held -= self._segments.popleft()[1]

    def consume_chunk(self, chunk: _Chunk, n: int) -> None:
        """Consume ``n`` events of this rank's own chunk."""
        self._consumed(self.pos, n, chunk.end_of(n - 1), chunk.run.steps[n - 1])

    def consume_matched(self, ref: _Chunk, n: int) -> None:
        """Consume ``n`` events that :meth:`match` found equal to ``ref``'s."""
        plan_ref, marks, shifts = self._plan
        assert plan_ref is ref, (self.rank, "consume without match")
        k = bisect.bisect_right(marks, n - 1) - 1
        self._consumed(self.pos, n, ref.end_of(n - 1) + shifts[k], ref.run.steps[n - 1])

    def consume_one(self, event: dict[str, Any], end: int) -> None:
        self.expected = event["seq"]
        self._consumed(self.pos, 1, end, event["step"])

    def skip_through(self, step: int) -> None:
        """Resynchronise: consume every event up to and including ``step``; the next event (if
        any) becomes the new expected seq."""
        while True:
            r = self.peek()
            if r is None:
                return
            ev, end = r
            if ev["step"] < self.last_step:
                raise self.f.error(self.pos, f"step {ev['step']} after step {self.last_step}: "
                                             f"steps never decrease")
            if ev["step"] > step:
                self.expected = ev["seq"]
                return
            self.consume_one(ev, end)

    def at_end(self) -> bool:
        return self.pos >= self.f.size

    # -- context -------------------------------------------------------------------------------
    def before(self, n: int) -> list[dict[str, Any]]:
        """The last ``n`` consumed events, as recorded."""
        if n <= 0 or not self._segments:
            return []
        start, total = self._segments[0][0], self._held
        out = self._read(start, total)
        return out[-n:]

    def after(self, n: int) -> list[dict[str, Any]]:
        """Up to ``n`` events from the current position, as recorded."""
        return self._read(self.pos, n)

    def _read(self, offset: int, n: int) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for _ in range(n):
            try:
                r = self.f.decode_at(offset)
            except FormatError:
                break  # context is best effort; the comparison itself reports bad input
            if r is None:
                break
            out.append(r[0])
            offset = r[1]
        return out


# -- the comparison ------------------------------------------------------------------------------
def _ranks_text(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def missing_ranges(world: int, present: Sequence[int]) -> list[tuple[int, int]]:
    """Ranks of ``range(world)`` not in ``present``, as inclusive ``(first, last)`` ranges.
    Costs O(len(present)) whatever ``world`` says (a header is untrusted input)."""
    out: list[tuple[int, int]] = []
    nxt = 0
    for r in sorted(set(present)):
        if r > nxt:
            out.append((nxt, r - 1))
        nxt = max(nxt, r + 1)
    if nxt < world:
        out.append((nxt, world - 1))
    return out


def _ranges_text(ranges: Sequence[tuple[int, int]]) -> str:
    n = sum(b - a + 1 for a, b in ranges)
    parts = [str(a) if a == b else f"{a}-{b}" for a, b in ranges[:MAX_SHOWN_RANGES]]
    if len(ranges) > MAX_SHOWN_RANGES:
        parts.append(f"… {len(ranges) - MAX_SHOWN_RANGES:,} more ranges")
    return ("rank " if n == 1 else "ranks ") + ", ".join(parts) + \
        (f" ({n:,} ranks)" if n > 1 and len(ranges) < n else "")


def _missing_ranks(ranges: Sequence[tuple[int, int]]) -> list[int]:
    """The first :data:`MAX_LISTED_RANKS` missing ranks (never a list of a billion)."""
    out: list[int] = []
    for a, b in ranges:
        out.extend(range(a, min(b + 1, a + MAX_LISTED_RANKS - len(out))))
        if len(out) >= MAX_LISTED_RANKS:
            break
    return out


def _short_repr(v: Any, limit: int = MAX_VALUE_CHARS) -> str:
    """A recorded value for a message: at most ``limit`` characters (a field may hold MiBs)."""
    if isinstance(v, (str, bytes, list, dict)) and len(v) > limit:
        v = v[:limit] if not isinstance(v, dict) else dict(list(v.items())[:8])
        return repr(v)[:limit] + "…"
    s = repr(v)
    return s if len(s) <= limit else s[:limit] + "…"


def _values_text(ev: dict[str, Any] | None, fields: Sequence[str] | None) -> str:
    """``kind (field=value, ...)`` for ``fields`` (``None``: all but step)."""
    if ev is None:
        return "no event"
    keys = [k for k in ev if k != "step"] if fields is None else fields
    shown = [f"{k}={_short_repr(ev.get(k))}" for k in keys if k != "kind"]
    return f"{ev.get('kind')}" + (f" ({', '.join(shown)})" if shown else "")


class _GroupCheck:
    def __init__(self, dp_rank: int, streams: list[_Stream], chunk: int, context: int):
        self.dp_rank = dp_rank
        self.streams = streams
        self.chunk = chunk
        self.context = context

    def run(self, budget: int) -> tuple[list[Divergence], bool]:
        """Divergences found (at most ``budget``) and whether the group was checked to the end."""
        active = list(self.streams)
        firsts = [s.peek() for s in active]
        seqs = [r[0]["seq"] for r in firsts if r is not None]
        for s in active:
            s.expected = min(seqs) if seqs else 0
        divs: list[Divergence] = []
        while len(active) >= 2 and len(divs) < budget:
            ref = active[0]
            ch = ref.chunk(self.chunk)
            if ch is not None:
                n = ch.n
                for s in active[1:]:
                    n = s.match(ch, n)
                    if n == 0:
                        break
                if n:
                    ref.consume_chunk(ch, n)
                    for s in active[1:]:
                        s.consume_matched(ch, n)
                    if n == ch.n:
                        continue
            outcome = self._at_position(active)
            if outcome is None:
                break
            if isinstance(outcome, Divergence):
                divs.append(outcome)
                ended = {r for r, c in outcome.context.items() if c["at"] is None}
                active = [s for s in active if s.rank not in ended]
        complete = not (len(active) >= 2 and not all(s.at_end() for s in active))
        return divs, complete

    def _at_position(self, active: list[_Stream]) -> Divergence | bool | None:
        """Compare the next event of every rank. ``None``: all logs ended; ``True``: they agree
        (consumed, go on); else the divergence (ranks resynchronised past it)."""
        peeked = [s.peek() for s in active]
        if all(r is None for r in peeked):
            return None
        status: list[str] = []
        compared: list[dict[str, Any] | None] = []
        for s, r in zip(active, peeked):
            if r is None:
                status.append("end")
                compared.append(None)
            else:
                status.append("ok" if r[0]["seq"] == s.expected else "gap")
                compared.append(compared_fields(r[0]))
        if all(st == "ok" for st in status) and all(c == compared[0] for c in compared[1:]):
            for s, r in zip(active, peeked):
                s.consume_one(r[0], r[1])  # type: ignore[index]
            return True
        category = classify([c if st == "ok" else None for c, st in zip(compared, status)])
        # classes of identical outcomes; the largest is the majority
        classes: list[tuple[tuple[str, Any], list[int]]] = []
        for s, st, c in zip(active, status, compared):
            sig = (st, c)
            for key, members in classes:
                if key == sig:
                    members.append(s.rank)
                    break
            else:
                classes.append((sig, [s.rank]))
        # ties: ranks whose event is where it should be (ok) win, then the lowest rank
        majority = max(classes, key=lambda kv: (len(kv[1]), kv[0][0] == "ok"))[1]
        minority = sorted(r for r in (s.rank for s in active) if r not in majority)
        rep = next(i for i, s in enumerate(active) if s.rank == majority[0])
        present_steps = [r[0]["step"] for r in peeked if r is not None]
        step = min(present_steps)
        seq = active[rep].expected
        diff = differing_fields(compared)
        if category == MISSING:
            diff = ["seq", *[k for k in diff if k != "seq"]]
        fields: dict[int, dict[str, Any]] = {}
        context: dict[int, dict[str, Any]] = {}
        for s, r in zip(active, peeked):
            ev = r[0] if r is not None else None
            fields[s.rank] = ({k: ev[k] for k in diff if k in ev} if ev is not None
                              else {k: None for k in diff})   # no event at all: nulls
            context[s.rank] = {"before": s.before(self.context), "at": ev,
                               "after": s.after(self.context + 1)[1:] if ev is not None else []}
        message = self._message(category, active, status, peeked, compared, majority, minority,
                                diff, seq)
        # an event that does not fit its kind (formats.ranklog_events) is named: it is often
        # the cause (a writer that lost or renamed a field) rather than a different decision
        misfits = [f"rank {s.rank}: {p}" for s, r in zip(active, peeked)
                   if r is not None and (p := event_fields_problem(r[0])) is not None]
        if misfits:
            message += " (malformed: " + "; ".join(misfits) + ")"
        div = Divergence(category, self.dp_rank, step, seq, minority, sorted(majority), fields,
                         context, message, where={s.rank: s.pos for s in active})
        for s in active:
            s.skip_through(step)
        return div

    @staticmethod
    def _message(category: str, active: list[_Stream], status: list[str], peeked: list[Any],
                 compared: list[Any], majority: list[int], minority: list[int],
                 diff: list[str], seq: int) -> str:
        by_rank = {s.rank: (s, st, r, c) for s, st, r, c in zip(active, status, peeked, compared)}
        if category == MISSING:
            parts = []
            for r in minority + majority:
                s, st, rec, _ = by_rank[r]
                if st == "end":
                    parts.append(f"rank {r}'s log ends before seq {s.expected}")
                elif st == "gap":
                    lost = rec[0]["seq"] - s.expected
                    which = (f"event {s.expected}" if lost == 1
                             else f"events {s.expected}..{rec[0]['seq'] - 1}")
                    jump = (f"starts at seq {rec[0]['seq']}" if s.expected == 0 else
                            f"jumps from seq {s.expected - 1} to {rec[0]['seq']}")
                    parts.append(f"rank {r} {jump} ({which} missing)")
            others = [r for r in by_rank if by_rank[r][1] == "ok"]
            if others:
                verb = "continues" if len(others) == 1 else "continue"
                parts.append(f"{_ranks_text(others)} {verb} with seq "
                             f"{by_rank[others[0]][2][0]['seq']}")
            return "; ".join(parts)
        # different kinds: show what each rank recorded; same kind: the differing fields
        fields = None if "kind" in diff else diff
        maj = by_rank[majority[0]][3]
        minor_texts = []
        seen: list[Any] = []
        for r in minority:
            c = by_rank[r][3]
            if c in seen:
                continue
            seen.append(c)
            same = [x for x in minority if by_rank[x][3] == c]
            minor_texts.append(f"{_ranks_text(same)} recorded {_values_text(c, fields)}")
        return ("; ".join(minor_texts)
                + f" where {_ranks_text(majority)} recorded {_values_text(maj, fields)}")


def _validate_alone(s: _Stream, chunk: int) -> None:
    """A rank alone in its group: nothing to compare with, but read and validate the log."""
    while True:
        ch = s.chunk(chunk)
        if ch is not None:
            s.consume_chunk(ch, ch.n)
            continue
        r = s.peek()
        if r is None:
            return
        s.consume_one(r[0], r[1])   # a seq gap with nobody to compare: keep reading


class _GcPaused:
    def __enter__(self) -> None:
        self._was = gc.isenabled()
        gc.disable()

    def __exit__(self, *exc: Any) -> None:
        if self._was:
            gc.enable()


def check_logs(logs: Sequence[RankLogFile], *, max_divergences: int = DEFAULT_MAX_DIVERGENCES,
               context: int = DEFAULT_CONTEXT, chunk: int = DEFAULT_CHUNK) -> ConsensusReport:
    """Check opened logs (see :func:`open_logs`); the caller closes them."""
    if max_divergences < 1:
        raise ValueError(f"max_divergences must be >= 1, got {max_divergences}")
    if context < 0:
        raise ValueError(f"context must be >= 0, got {context}")
    notes: list[str] = []
    divergences: list[Divergence] = []
    world = logs[0].header["world_size"] if logs else 0
    gaps = missing_ranges(world, [f.rank for f in logs])
    if gaps:
        n_missing = sum(b - a + 1 for a, b in gaps)
        listed = _missing_ranks(gaps)
        more = f"; the first {len(listed):,} are listed" if len(listed) < n_missing else ""
        divergences.append(Divergence(
            MISSING, None, None, None, listed, sorted(f.rank for f in logs), {}, {},
            f"no log for {_ranges_text(gaps)} (world_size {world:,}{more})"))
    groups: dict[int, list[RankLogFile]] = {}
    for f in logs:
        groups.setdefault(f.header["dp_rank"], []).append(f)
    results: list[GroupResult] = []
    total = 0
    with _GcPaused():
        for dp in sorted(groups):
            members = groups[dp]
            g = GroupResult(dp, [f.rank for f in members])
            results.append(g)
            streams = [_Stream(f, context) for f in members]
            budget = max_divergences - len(divergences)
            if budget <= 0:
                g.complete = False
                continue
            if len(streams) == 1:
                notes.append(f"group dp_rank={dp} has one rank ({members[0].rank}): nothing to "
                             f"compare it with")
                _validate_alone(streams[0], chunk)
                found, g.complete = [], True
            else:
                found, g.complete = _GroupCheck(dp, streams, chunk, context).run(budget)
            explain(found, members)          # trigger request and causal chain
            g.divergences = len(found)
            g.events = sum(s.events for s in streams)
            total += g.events
            divergences.extend(found)
            for s in streams:
                if s.events == 0 and s.at_end():
                    notes.append(f"rank {s.rank} ({s.f.path}) has 0 events")
    return ConsensusReport(results, len(logs), total, divergences, [f.path for f in logs], notes)


def check_consensus(paths: Sequence[str | os.PathLike], **kwargs: Any) -> ConsensusReport:
    """Collect, open and check rank logs (files and/or directories)."""
    files = collect_logs(paths)
    logs = open_logs(files)
    try:
        return check_logs(logs, **kwargs)
    finally:
        for f in logs:
            f.close()
