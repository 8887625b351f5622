"""The event stream: every cache decision of one rank, in order.

Each decision the cache makes (match lengths, restores and backups issued and completed, locks,
evictions, PP ACK consumption) is an explicit step that emits one event. The consensus checker,
``inspect`` and the tests all read this same stream (docs/rank-log-format.md). Field names
starting with ``local_`` are rank-local (physical slots, timings) and are not compared across
ranks.

Every kind and its fields are defined once, in :mod:`formats.ranklog_events` (re-exported here as
``EV``: ``events.emit(EV.MATCH, rid=..., l1_len=..., ...)``). Recorded events are plain dicts
``{"seq", "step", "kind", ...}``; ``seq`` counts 0, 1, 2, … with no gaps.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Iterable

import formats.ranklog_events as EV  # noqa: N812 (the kinds' namespace: EV.MATCH, ...)
from formats.ranklog import FORMAT_NAME, VERSION
from formats.ranklog_events import EventKind

__all__ = ["EV", "EventKind", "EventLog", "RankInfo"]

Listener = Callable[[dict], None]


@dataclasses.dataclass(frozen=True)
class RankInfo:
    """Parallel coordinates of one rank (defaults: rank 0 of size 1 everywhere)."""

    rank: int = 0
    world_size: int = 1
    dp_rank: int = 0
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    cp_rank: int = 0
    cp_size: int = 1

    def header(self) -> dict[str, Any]:
        return {"format": FORMAT_NAME, "version": VERSION, **dataclasses.asdict(self)}


class EventLog:
    """Append-only, in-order record of one rank's cache decisions.

    ``enabled=False`` makes :meth:`emit` a cheap no-op (the default for the hot replay path is
    on; it is cheap enough to leave on). Listeners see each event right after it is recorded
    (the online consensus mode hashes them); a listener that raises propagates — background
    problems are never swallowed.

    ``strict=True`` checks every emit against its kind's fields (:meth:`EventKind.problem`) and
    raises ``ValueError`` for a missing or unknown field. The default is on when the environment
    sets ``HICACHE_STRICT_EVENTS=1`` (the test suite does, for every process it starts).
    """

    __slots__ = ("rank", "enabled", "keep", "strict", "step", "_seq", "_events", "_listeners",
                 "mutator")

    def __init__(self, rank: RankInfo | None = None, *, enabled: bool = True, keep: bool = True,
                 strict: bool | None = None):
        self.rank = rank or RankInfo()
        self.enabled = enabled
        self.keep = keep
        self.strict = (os.environ.get("HICACHE_STRICT_EVENTS") == "1" if strict is None
                       else strict)
        self.step = 0
        self._seq = 0
        self._events: list[dict] = []
        self._listeners: list[Listener] = []
        # Debug hook (divergence injection): may rewrite an event before it is recorded.
        self.mutator: Callable[[dict], dict] | None = None

    # -- recording -------------------------------------------------------------------------
    def emit(self, kind: EventKind, **fields: Any) -> None:
        if not self.enabled:
            return
        if self.strict:
            problem = kind.problem(fields)
            if problem is not None:
                raise ValueError(problem)
        ev = {"seq": self._seq, "step": self.step, "kind": kind.name, **fields}
        if self.mutator is not None:
            ev = self.mutator(ev)
        self._seq += 1
        if self.keep:
            self._events.append(ev)
        if self._listeners:
            for cb in self._listeners:
                cb(ev)

    def set_step(self, step: int) -> None:
        self.step = step

    def subscribe(self, listener: Listener) -> None:
        self._listeners.append(listener)

    # -- reading ---------------------------------------------------------------------------
    @property
    def events(self) -> list[dict]:
        return self._events

    def __len__(self) -> int:
        return self._seq

    def kinds(self) -> Iterable[str]:
        return (e["kind"] for e in self._events)

    def clear(self) -> None:
        """Drop kept events (``seq`` keeps counting, so later logs still have no reuse)."""
        self._events.clear()

    def write(self, path: str) -> None:
        """Write header + kept events as a rank log (``*.ranklog`` msgpack or ``*.jsonl``)."""
        from formats.ranklog_writer import write_ranklog  # formats is below engine

        write_ranklog(path, self.rank.header(), self._events, strict=self.strict)
