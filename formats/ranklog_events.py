"""Event kinds of the rank log (v1): every kind the engine records and its fields, defined once.

One :class:`EventKind` per kind names its fields (in the order the engine writes them), the
optional ones, and the divergence category a difference in its deciding fields falls in. The
emitters (``engine.cache``: ``EventLog.emit`` takes an :class:`EventKind`), the rank-log writer
and reader (:mod:`formats.ranklog`, :mod:`formats.ranklog_writer`), the comparison rules
(:mod:`formats.ranklog_compare`) and the checker (``checkers.consensus``) all read this table;
``docs/rank-log-format.md`` documents it.

An event on the wire is a map ``{"seq", "step", "kind", <fields>..., <local_* fields>...}``.
Fields named ``local_*`` are rank-local (physical slots, timings) and never compared; any event
may carry them. Kinds not in this table are allowed in a log and compared field by field.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, NewType

#: An operation id: one integer sequence per rank, shared by every transfer queue (load,
#: backup) and the L3 tier's jobs (``restore``/``backup`` with ``src``/``dst`` ``"l3"``).
OpId = NewType("OpId", int)

SEQ, STEP, KIND = "seq", "step", "kind"
LOCAL_PREFIX = "local_"

# -- divergence categories (v1) ------------------------------------------------------------------
HIT_LENGTH = "hit_length_mismatch"
RESTORE_COMPLETION = "restore_completion_mismatch"
LOCK_ORDER = "lock_order_mismatch"
EVICTION = "eviction_eligibility_divergence"
PP_ACK_CATEGORY = "pp_ack_consumption_mismatch"
MISSING = "missing_events"
EVENT = "event_mismatch"
CATEGORIES = (HIT_LENGTH, RESTORE_COMPLETION, LOCK_ORDER, EVICTION, PP_ACK_CATEGORY, MISSING,
              EVENT)


@dataclasses.dataclass(frozen=True)
class EventKind:
    """One kind of event: its fields, and how a difference between ranks is classified."""

    name: str
    fields: tuple[str, ...]                 # always present, in this order
    optional: tuple[str, ...] = ()          # present on some events of the kind
    category: str | None = None             # when one of ``deciding`` differs across ranks
    deciding: tuple[str, ...] = ()
    doc: str = ""

    def __str__(self) -> str:
        return self.name

    def problem(self, fields: Mapping[str, Any]) -> str | None:
        """Why ``fields`` (an event's fields, or the keyword arguments of an emit) do not fit
        this kind; ``None`` when they do. ``seq``/``step``/``kind`` and ``local_*`` are ignored."""
        missing = [f for f in self.fields if f not in fields]
        if missing:
            return f"{self.name} event lacks field(s) {', '.join(missing)}"
        extra = [k for k in fields if k not in self.fields and k not in self.optional
                 and k not in (SEQ, STEP, KIND) and not k.startswith(LOCAL_PREFIX)]
        if extra:
            return f"{self.name} event has unknown field(s) {', '.join(extra)}"
        return None


MATCH = EventKind("match", ("rid", "l1_len", "l2_len", "l3_len"),
                  category=HIT_LENGTH, deciding=("l1_len", "l2_len", "l3_len"),
                  doc="hit lengths (tokens) decided for a request")
PARTIAL = EventKind("partial", ("rid", "node", "tokens"),
                    category=HIT_LENGTH, deciding=("node", "tokens"),
                    doc="partial last-page reuse at admission: the first tokens slots of the "
                        "first page of node (logical id, an L1 child of the match) are copied "
                        "into the request's first own page")
LOCK = EventKind("lock", ("rid", "node"), category=LOCK_ORDER, deciding=("rid", "node"),
                 doc="a tree node (logical id; null: nothing matched) is locked for a request")
UNLOCK = EventKind("unlock", ("rid", "node"), category=LOCK_ORDER, deciding=("rid", "node"),
                   doc="the node a request locked is unlocked")
INSERT = EventKind("insert", ("rid", "node", "tokens", "new_tokens"),
                   doc="a request's tokens enter the tree (node: the deepest node, new_tokens: "
                       "tokens not cached before)")
RESTORE = EventKind("restore", ("op", "rid", "pages"), optional=("src",),
                    doc="a restore is issued: L2→L1 load-back, or L3→L2 with src \"l3\"")
RESTORE_DONE = EventKind("restore_done", ("op",), optional=("pages",),
                         category=RESTORE_COMPLETION, deciding=("op", "step"),
                         doc="a restore's completion is consumed (pages: L3 pages that arrived)")
BACKUP = EventKind("backup", ("op", "pages"), optional=("dst",),
                   doc="a backup is issued: L1→L2, or L2→L3 with dst \"l3\"")
BACKUP_DONE = EventKind("backup_done", ("op",), optional=("dst",),
                        category=RESTORE_COMPLETION, deciding=("op", "step"),
                        doc="a backup's completion is consumed")
EVICT = EventKind("evict", ("tier", "eligible", "evicted"),
                  category=EVICTION, deciding=("tier", "eligible", "evicted"),
                  doc="an eviction pass: tier \"l1\"/\"l2\", node ids eligible and evicted")
PP_ACK = EventKind("pp_ack", ("queue", "consumed", "acks"),
                   category=PP_ACK_CATEGORY, deciding=("queue", "consumed", "acks"),
                   doc="a pipeline stage consumes the agreed number of completed operations of "
                       "a queue (\"load\"/\"backup\"): acks are their op ids")
FLUSH = EventKind("flush", (), doc="every unlocked page of L1 and L2 was dropped (and L3's objects with scope all)")
CP_ALLOC = EventKind("cp_alloc", ("rid", "first_owner", "pages"),
                     doc="CP: pages extending a request's prefix are allocated, the first on "
                         "rank first_owner (then round the ranks)")
CP_CUT = EventKind("cp_cut", ("rid", "at_page", "pages"),
                   doc="CP: a request's pages from at_page on would break the owner rotation "
                       "of the path they join; they are not cached")
HINT = EventKind("hint", ("rid", "session", "ttl", "close", "applied", "nodes"),
                 category=EVENT, deciding=("session", "ttl", "close", "applied", "nodes"),
                 doc="a request's client hint (docs/eviction.md, \"Hints\"): its session, "
                     "ttl (s) and close flag; applied: the namespace's hints are trusted; "
                     "nodes: the private nodes it marked")
SESSION_CLOSE = EventKind("session_close", ("session", "nodes"), category=EVENT,
                          deciding=("session", "nodes"),
                          doc="a client closed a session: nodes of its private KV marked first "
                              "to go")

KINDS: dict[str, EventKind] = {k.name: k for k in (
    MATCH, PARTIAL, LOCK, UNLOCK, INSERT, RESTORE, RESTORE_DONE, BACKUP, BACKUP_DONE, EVICT, PP_ACK, FLUSH,
    CP_ALLOC, CP_CUT, HINT, SESSION_CLOSE)}


def kind_of(name: Any) -> EventKind | None:
    """The kind named ``name`` (``None`` for a kind outside the table)."""
    return KINDS.get(name) if type(name) is str else None


def event_fields_problem(event: Mapping[str, Any]) -> str | None:
    """Why a recorded event does not fit its kind's fields (``None``: it fits, or its kind is
    not in the table)."""
    kind = kind_of(event.get(KIND))
    return None if kind is None else kind.problem(event)


def family(category: str) -> frozenset[str]:
    """Names of the kinds whose differences fall in ``category``."""
    return frozenset(k.name for k in KINDS.values() if k.category == category)
