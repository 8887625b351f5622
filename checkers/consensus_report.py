"""What ``consensus-check`` reports: divergences, per-group results, the whole report (JSON-ready).

The checking itself is :mod:`checkers.consensus`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any


@dataclasses.dataclass
class Divergence:
    """The first difference at one place in one group's streams."""

    category: str
    group: int | None              # dp_rank (None: a rank with no log at all)
    step: int | None
    seq: int | None                # where the event should be (the majority's seq)
    ranks: list[int]               # the minority: ranks that differ from the majority
    majority: list[int]
    fields: dict[int, dict[str, Any]]   # per rank: the fields that differ, as recorded
    context: dict[int, dict[str, Any]]  # per rank: {"before": [...], "at": ev|None, "after": [...]}
    message: str
    # checkers.consensus_chain: the request that triggered it ({rid, arrival_step, arrival_seq,
    # arrival_kind} or None) and the chain of later categories that differ (the first: this one)
    trigger_request: dict[str, Any] | None = None
    chain: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    # per rank: the byte offset of its event at the divergence (not reported)
    where: dict[int, int] = dataclasses.field(default_factory=dict, repr=False)

    def to_json(self) -> dict[str, Any]:
        return {
            "category": self.category, "group": self.group, "step": self.step, "seq": self.seq,
            "ranks": self.ranks, "majority": self.majority,
            "fields": {str(r): _jsonable(v) for r, v in self.fields.items()},
            "context": {str(r): _jsonable(v) for r, v in self.context.items()},
            "message": self.message,
            "trigger_request": _jsonable(self.trigger_request),
            "chain": _jsonable(self.chain),
        }


def _jsonable(v: Any) -> Any:
    """Recorded values as JSON can hold them (bytes as hex, anything exotic as its repr)."""
    if isinstance(v, float) and not math.isfinite(v):
        return repr(v)             # NaN / inf from a msgpack log: JSON has no such numbers
    if v is None or isinstance(v, (str, int, float, bool)):
        return v
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, (bytes, bytearray)):
        return bytes(v).hex()
    return repr(v)


@dataclasses.dataclass
class GroupResult:
    dp_rank: int
    ranks: list[int]
    events: int = 0
    divergences: int = 0
    complete: bool = True          # False: stopped at --max-divergences before the end

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class ConsensusReport:
    groups: list[GroupResult]
    ranks: int
    events: int
    divergences: list[Divergence]
    files: list[str]
    notes: list[str]

    @property
    def consistent(self) -> bool:
        return not self.divergences

    @property
    def complete(self) -> bool:
        return all(g.complete for g in self.groups)

    def to_json(self) -> dict[str, Any]:
        return {
            "consistent": self.consistent, "groups": [g.to_json() for g in self.groups],
            "ranks": self.ranks, "events": self.events,
            "divergences": [d.to_json() for d in self.divergences],
            "complete": self.complete, "files": self.files, "notes": self.notes,
        }


