"""Comparing rank logs (v1, ``docs/rank-log-format.md``): which fields of an event must agree
across ranks (:func:`compared_fields`), which differ (:func:`differing_fields`), and the category
a difference between ranks' events at the same place falls in (:func:`classify`). Shared by the
offline checker (``checkers.consensus``) and the online mode (``engine.parallel.consensus_online``).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from formats.ranklog import is_local
from formats.ranklog_events import (  # noqa: F401 (the categories are re-exported)
    CATEGORIES,
    EVENT,
    EVICTION,
    HIT_LENGTH,
    KINDS,
    LOCK_ORDER,
    MISSING,
    PP_ACK_CATEGORY,
    RESTORE_COMPLETION,
    family,
)

PP_ACK = PP_ACK_CATEGORY

# kind -> (category, the fields whose difference puts two same-kind events in that category),
# read off the kinds table (formats.ranklog_events)
KIND_RULES: dict[str, tuple[str, tuple[str, ...]]] = {
    k.name: (k.category, k.deciding) for k in KINDS.values() if k.category is not None}
# Ranks recorded events of different kinds at the same place: the first family involved wins.
MIXED_KIND_ORDER: tuple[tuple[str, frozenset[str]], ...] = tuple(
    (c, family(c)) for c in (RESTORE_COMPLETION, PP_ACK_CATEGORY, LOCK_ORDER, EVICTION))


def compared_fields(event: Mapping[str, Any]) -> dict[str, Any]:
    """The event without ``seq`` and ``local_*`` fields: what must agree across ranks."""
    return {k: v for k, v in event.items() if k != "seq" and not is_local(k)}


_ABSENT = object()


def differing_fields(events: Sequence[Mapping[str, Any] | None]) -> list[str]:
    """Fields (in first-seen order) whose value is not the same in every present event."""
    present = [e for e in events if e is not None]
    keys: dict[str, None] = {}
    for e in present:
        keys.update(dict.fromkeys(e))
    out = []
    for k in keys:
        vals = [e.get(k, _ABSENT) for e in present]
        if any(v is _ABSENT for v in vals) or any(v != vals[0] for v in vals[1:]):
            out.append(k)
    return out


def classify(events: Sequence[Mapping[str, Any] | None]) -> str:
    """Category of a difference between ranks' events at the same place (v1 rules).

    ``events`` holds one compared event per rank (no ``seq``, no ``local_*``), ``None`` for a rank
    that has no event there (its log ended or skips it). See docs/rank-log-format.md.
    """
    present = [e for e in events if e is not None]
    if len(present) < len(events):
        return MISSING
    kinds = {e.get("kind") for e in present}
    if len(kinds) > 1:
        for category, family in MIXED_KIND_ORDER:
            if kinds & family:
                return category
        return EVENT
    rule = KIND_RULES.get(next(iter(kinds)))  # type: ignore[arg-type]
    if rule is not None and set(differing_fields(present)) & set(rule[1]):
        return rule[0]
    return EVENT
