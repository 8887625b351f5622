"""Comparing rank logs (v1, ``docs/rank-log-format.md``): which fields of an event must agree
across ranks (:func:`compared_fields`), which differ (:func:`differing_fields`), and the category
a difference between ranks' events at the same place falls in (:func:`classify`). Shared by the
offline checker (``checkers.consensus``) and the online mode (``engine.parallel.consensus_online``).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from formats.ranklog import is_local

# -- divergence categories (v1) ------------------------------------------------------------------
HIT_LENGTH = "hit_length_mismatch"
RESTORE_COMPLETION = "restore_completion_mismatch"
LOCK_ORDER = "lock_order_mismatch"
EVICTION = "eviction_eligibility_divergence"
PP_ACK = "pp_ack_consumption_mismatch"
MISSING = "missing_events"
EVENT = "event_mismatch"
CATEGORIES = (HIT_LENGTH, RESTORE_COMPLETION, LOCK_ORDER, EVICTION, PP_ACK, MISSING, EVENT)

# kind -> (category, the fields whose difference puts two same-kind events in that category)
KIND_RULES: dict[str, tuple[str, tuple[str, ...]]] = {
    "match": (HIT_LENGTH, ("l1_len", "l2_len", "l3_len")),
    "restore_done": (RESTORE_COMPLETION, ("op", "step")),
    "backup_done": (RESTORE_COMPLETION, ("op", "step")),
    "lock": (LOCK_ORDER, ("rid", "node")),
    "unlock": (LOCK_ORDER, ("rid", "node")),
    "evict": (EVICTION, ("tier", "eligible", "evicted")),
    "pp_ack": (PP_ACK, ("queue", "consumed", "acks")),
}
# Ranks recorded events of different kinds at the same place: the first family involved wins.
MIXED_KIND_ORDER: tuple[tuple[str, frozenset[str]], ...] = (
    (RESTORE_COMPLETION, frozenset({"restore_done", "backup_done"})),
    (PP_ACK, frozenset({"pp_ack"})),
    (LOCK_ORDER, frozenset({"lock", "unlock"})),
    (EVICTION, frozenset({"evict"})),
)


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
