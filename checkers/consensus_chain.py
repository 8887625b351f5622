"""What ``consensus-check`` adds to each divergence once found: the request that triggered it and
the causal chain from there to the first visible symptom.

* **Trigger request** — the request named by the divergent event itself (``rid`` of a ``match``,
  ``restore``, ``lock`` …) or else by the last event before it that names one (the events before
  the divergence agree on every rank, so any rank's log says which). Its *arrival* is the first
  event of the log naming it (``seq``, ``step``, ``kind``: usually its ``match`` at admission).
* **Chain** — the events of a diverging rank and of the majority after the first differing one,
  aligned (an extra or a missing event on one rank does not shift the rest), and, in order, the
  first differing place of each category not seen yet: e.g. ``event_mismatch`` (a backup on one
  rank only) → ``eviction_eligibility_divergence`` (other victims) → ``hit_length_mismatch``
  (another hit length). The chain starts at the divergence itself.

Cost: one decoding pass over a rank's log up to its last divergence, plus a window of
:data:`CHAIN_WINDOW` events per rank per divergence (only when there are divergences).
"""

from __future__ import annotations

import difflib
from typing import Any

from formats.errors import FormatError
from formats.ranklog import RankLogFile
from formats.ranklog_compare import MISSING, classify, compared_fields

CHAIN_WINDOW = 600          # events per rank aligned after a divergence
MAX_TRACKED_RIDS = 65536    # arrivals remembered while scanning (bounded on untrusted logs)
_NONE = {"kind": None}      # the other side of an extra event: a "different kind"


def _rid(ev: Any) -> Any:
    return ev.get("rid") if isinstance(ev, dict) else None


def _scan_arrivals(f: RankLogFile, stops: list[int]) -> dict[int, tuple[Any, dict | None]]:
    """For each byte offset in ``stops``: the last request id named before it, and the arrival
    (first event naming it) of every id, as ``{stop: (last_rid, arrivals)}``."""
    out: dict[int, tuple[Any, dict | None]] = {}
    first: dict[Any, dict] = {}
    last = None
    offset = f.body_offset
    todo = sorted(set(stops))
    k = 0
    while k < len(todo):
        while k < len(todo) and offset >= todo[k]:
            out[todo[k]] = (last, dict(first))
            k += 1
        if k == len(todo):
            break
        try:
            r = f.decode_at(offset)
        except FormatError:
            r = None
        if r is None:
            for s in todo[k:]:
                out[s] = (last, dict(first))
            break
        ev, offset = r
        rid = _rid(ev)
        if rid is not None and not isinstance(rid, (dict, list)):
            last = rid
            if rid not in first:
                if len(first) >= MAX_TRACKED_RIDS:
                    first.pop(next(iter(first)))
                first[rid] = {"seq": ev.get("seq"), "step": ev.get("step"),
                              "kind": ev.get("kind")}
    return out


def trigger_of(div: Any, arrivals: dict | None, last_rid: Any) -> dict[str, Any] | None:
    """The trigger request of one divergence (see the module docstring)."""
    rid = None
    for r in [*div.majority, *div.ranks]:        # the divergent event itself, if it names one
        ctx = div.context.get(r)
        if ctx is not None and _rid(ctx.get("at")) is not None:
            rid = _rid(ctx["at"])
            break
    if rid is None:
        rid = last_rid
    if rid is None:
        return None
    arrival = (arrivals or {}).get(rid)
    if arrival is None:                           # named first by the divergent event itself
        at = next((div.context[r]["at"] for r in [*div.majority, *div.ranks]
                   if r in div.context and _rid(div.context[r].get("at")) == rid), None)
        arrival = None if at is None else {"seq": at.get("seq"), "step": at.get("step"),
                                           "kind": at.get("kind")}
    return {"rid": rid, "arrival_step": None if arrival is None else arrival["step"],
            "arrival_seq": None if arrival is None else arrival["seq"],
            "arrival_kind": None if arrival is None else arrival["kind"]}


def _window(f: RankLogFile, offset: int | None) -> list[dict]:
    out: list[dict] = []
    while offset is not None and len(out) < CHAIN_WINDOW:
        try:
            r = f.decode_at(offset)
        except FormatError:
            break
        if r is None or not isinstance(r[0], dict):
            break
        out.append(r[0])
        offset = r[1]
    return out


def _key(ev: dict) -> str:
    return repr(compared_fields(ev))


def _link(category: str, a: dict | None, b: dict | None, ra: int, rb: int) -> dict[str, Any]:
    present = [e for e in (a, b) if e is not None]
    return {"category": category, "step": min(e.get("step", 0) for e in present),
            "events": {str(ra): a, str(rb): b}}


def _pairs(a: list[dict], b: list[dict], ops: list) -> list[tuple[int, int, int, int]]:
    """The differing places of two aligned windows, in order: ``(i, j, i_end, j_end)`` with
    ``i == i_end`` (or ``j``) where only the other rank has an event. Inside a replaced run the
    events are aligned again by kind (an extra ``backup`` on one rank, then ``evict`` against
    ``evict``), then paired in order."""
    out = []
    for tag, i1, i2, j1, j2 in ops:
        if tag == "equal":
            continue
        sub = difflib.SequenceMatcher(None, [e.get("kind") for e in a[i1:i2]],
                                      [e.get("kind") for e in b[j1:j2]],
                                      autojunk=False).get_opcodes()
        for _t, k1, k2, l1, l2 in sub:
            for t in range(max(k2 - k1, l2 - l1)):
                out.append((i1 + k1 + t, j1 + l1 + t, i1 + k2, j1 + l2))
    return out


def chain_of(div: Any, logs: dict[int, RankLogFile]) -> list[dict[str, Any]]:
    """The causal chain of one divergence between its first minority rank and the majority."""
    if not div.ranks or not div.majority or not div.where:
        return []
    ra, rb = div.majority[0], div.ranks[0]
    a = _window(logs[ra], div.where.get(ra))
    b = _window(logs[rb], div.where.get(rb))
    chain = [_link(div.category, div.context[ra]["at"], div.context[rb]["at"], ra, rb)]
    seen = {div.category}
    ops = difflib.SequenceMatcher(None, [_key(e) for e in a], [_key(e) for e in b],
                                  autojunk=False).get_opcodes()
    for i, j, i2, j2 in _pairs(a, b, ops):
        if i == 0 and j == 0:
            continue                          # the divergence itself: chain[0]
        ea = a[i] if i < i2 else None
        eb = b[j] if j < j2 else None
        if (ea is None and i >= len(a)) or (eb is None and j >= len(b)):
            category = MISSING                # that rank's log (or window) ends here
        else:
            category = classify([compared_fields(ea) if ea is not None else _NONE,
                                 compared_fields(eb) if eb is not None else _NONE])
        if category in seen:
            continue
        seen.add(category)
        chain.append(_link(category, ea, eb, ra, rb))
    return chain


def explain(found: list[Any], members: list[RankLogFile]) -> None:
    """Fill ``trigger_request`` and ``chain`` of one group's divergences (in place)."""
    if not found:
        return
    logs = {f.rank: f for f in members}
    scans: dict[int, dict] = {}
    for rank in {d.majority[0] for d in found if d.majority and d.where}:
        stops = [d.where[rank] for d in found if d.majority and d.majority[0] == rank and
                 d.where.get(rank) is not None]
        scans[rank] = _scan_arrivals(logs[rank], stops)
    for d in found:
        last, arrivals = None, None
        if d.majority and d.where and d.where.get(d.majority[0]) is not None:
            last, arrivals = scans[d.majority[0]][d.where[d.majority[0]]]
        d.trigger_request = trigger_of(d, arrivals, last)
        d.chain = chain_of(d, logs)
