"""Debug switch: make one rank record a wrong decision, for tests and demonstrations.

A spec names what to break, on which rank, from which step::

    hit_length@rank=1,step=3            # rank 1's first match at step >= 3 reports a shorter L1 hit
    lock_order@rank=0,step=10,count=2   # two lock/unlock events flipped
    missing_events@rank=2,step=5;pp_ack@rank=3,step=7   # several, separated by ';'

Kinds (one per divergence category of the rank log format):

- ``hit_length``: ``match`` reports ``l1_len`` halved (1 when it was 0);
- ``restore_completion``: ``restore_done`` / ``backup_done`` reports the next op id as completed;
- ``lock_order``: ``lock`` is recorded as ``unlock`` and vice versa;
- ``eviction_eligibility``: ``evict`` leaves out the last eligible node (adds node -1 if none);
- ``pp_ack``: ``pp_ack`` consumes one ACK fewer (one more when it consumed none);
- ``missing_events``: from the trigger on, ``seq`` jumps by ``count`` (events lost from the log).

The category names (``hit_length_mismatch``, ...) are accepted as kinds too. ``count`` (default
1) is how many matching events are changed.

:func:`install` puts an :class:`Injector` on an :class:`engine.cache.events.EventLog` as its
``mutator`` (only on the rank the spec names); the event stream, the online consensus check and
the written rank log all see the wrong decision, exactly like a real bug would show.
"""

from __future__ import annotations

import dataclasses
import random
from collections import deque
from typing import Callable

from engine.cache.events import EV, EventLog

_COMPLETIONS = EV.family(EV.RESTORE_COMPLETION)
_LOCKS = EV.family(EV.LOCK_ORDER)


def _hit_length(ev: dict) -> bool:
    if ev["kind"] != EV.MATCH.name:
        return False
    l1 = ev.get("l1_len", 0)
    ev["l1_len"] = l1 // 2 if isinstance(l1, int) and l1 > 0 else 1
    return True


def _restore_completion(ev: dict) -> bool:
    if ev["kind"] not in _COMPLETIONS:
        return False
    ev["op"] = ev.get("op", -1) + 1        # op ids are integers (formats.ranklog_events.OpId)
    return True


def _lock_order(ev: dict) -> bool:
    if ev["kind"] not in _LOCKS:
        return False
    ev["kind"] = EV.UNLOCK.name if ev["kind"] == EV.LOCK.name else EV.LOCK.name
    return True


def _eviction_eligibility(ev: dict) -> bool:
    if ev["kind"] != EV.EVICT.name:
        return False
    eligible = list(ev.get("eligible") or [])
    if eligible:
        dropped = eligible.pop()
        ev["evicted"] = [n for n in (ev.get("evicted") or []) if n != dropped]
    else:
        eligible.append(-1)
    ev["eligible"] = eligible
    return True


def _pp_ack(ev: dict) -> bool:
    if ev["kind"] != EV.PP_ACK.name:
        return False
    consumed = ev.get("consumed", 0)
    acks = list(ev.get("acks") or [])
    if isinstance(consumed, int) and consumed > 0:
        ev["consumed"] = consumed - 1
        ev["acks"] = acks[:-1]
    else:
        ev["consumed"] = (consumed or 0) + 1
        ev["acks"] = acks + [-1]
    return True


def _missing_events(ev: dict) -> bool:
    return True  # every event qualifies; the Injector shifts seq from here on


MUTATIONS: dict[str, Callable[[dict], bool]] = {
    "hit_length": _hit_length,
    "restore_completion": _restore_completion,
    "lock_order": _lock_order,
    "eviction_eligibility": _eviction_eligibility,
    "pp_ack": _pp_ack,
    "missing_events": _missing_events,
}
# the divergence category each kind produces (formats.ranklog_events), also accepted in specs
CATEGORY_OF = {
    "hit_length": EV.HIT_LENGTH,
    "restore_completion": EV.RESTORE_COMPLETION,
    "lock_order": EV.LOCK_ORDER,
    "eviction_eligibility": EV.EVICTION,
    "pp_ack": EV.PP_ACK_CATEGORY,
    "missing_events": EV.MISSING,
}
_ALIASES = {v: k for k, v in CATEGORY_OF.items()}


@dataclasses.dataclass(frozen=True)
class Injection:
    kind: str
    rank: int
    step: int = 0
    count: int = 1

    def __str__(self) -> str:
        return f"{self.kind}@rank={self.rank},step={self.step},count={self.count}"


def parse_spec(spec: str) -> list[Injection]:
    """Parse ``KIND@rank=R[,step=S][,count=N][;...]``; ``ValueError`` names the valid choices."""
    out: list[Injection] = []
    for part in (p.strip() for p in spec.split(";")):
        if not part:
            continue
        kind, _, params = part.partition("@")
        kind = _ALIASES.get(kind.strip(), kind.strip())
        if kind not in MUTATIONS:
            raise ValueError(f"unknown divergence kind {kind!r}; choose one of "
                             f"{', '.join(MUTATIONS)}")
        values: dict[str, int] = {}
        for item in (i.strip() for i in params.split(",") if i.strip()):
            key, eq, val = item.partition("=")
            if key not in ("rank", "step", "count") or not eq:
                raise ValueError(f"bad divergence parameter {item!r} in {part!r}; use "
                                 f"rank=R, step=S, count=N")
            try:
                values[key] = int(val)
            except ValueError:
                raise ValueError(f"{key} must be an integer in {part!r}, got {val!r}") from None
        if "rank" not in values:
            raise ValueError(f"divergence spec {part!r} needs rank=R (the rank to break)")
        inj = Injection(kind, values["rank"], values.get("step", 0), values.get("count", 1))
        if inj.rank < 0 or inj.step < 0 or inj.count < 1:
            raise ValueError(f"divergence spec {part!r}: rank and step must be >= 0, count >= 1")
        out.append(inj)
    if not out:
        raise ValueError("empty divergence spec; example: hit_length@rank=1,step=3")
    return out


class Injector:
    """An ``EventLog.mutator`` applying injections (those of one rank) to matching events."""

    def __init__(self, injections: list[Injection], then: Callable[[dict], dict] | None = None):
        self.injections = list(injections)
        self._left = [inj.count for inj in self.injections]
        self._seq_shift = 0
        self._then = then
        self.applied: list[tuple[Injection, int, int]] = []   # (injection, seq, step) fired

    def __call__(self, ev: dict) -> dict:
        if self._then is not None:
            ev = self._then(ev)
        for i, inj in enumerate(self.injections):
            if self._left[i] and ev["step"] >= inj.step:
                if inj.kind == "missing_events":
                    self._seq_shift += inj.count
                    self._left[i] = 0
                    self.applied.append((inj, ev["seq"], ev["step"]))
                elif MUTATIONS[inj.kind](ev):
                    self._left[i] -= 1
                    self.applied.append((inj, ev["seq"], ev["step"]))
        if self._seq_shift:
            ev["seq"] += self._seq_shift
        return ev


def injector_for(spec: str | list[Injection], rank: int) -> Injector | None:
    """The injector for ``rank`` (``None`` when the spec breaks other ranks only)."""
    injections = parse_spec(spec) if isinstance(spec, str) else spec
    mine = [inj for inj in injections if inj.rank == rank]
    return Injector(mine) if mine else None


def install(log: EventLog, spec: str) -> Injector | None:
    """Install the spec's injections for ``log``'s rank as its mutator (chained after an
    existing one). Returns the injector, or ``None`` when this rank is not broken."""
    injections = parse_spec(spec)
    mine = [inj for inj in injections if inj.rank == log.rank.rank]
    if not mine:
        return None
    inj = Injector(mine, then=log.mutator)
    log.mutator = inj
    return inj


# -- a synthetic decision stream (tests, benchmarks, demonstrations) ---------------------------
def synthetic_decisions(n: int, seed: int = 0, page: int = 64) -> list[dict]:
    """``n`` cache decisions of one replica (``{"step", "kind", ...}``, no ``seq``), deterministic
    in ``seed``: a cache under continuous batching. Every step new requests ``match`` and
    ``lock``, some ``restore`` from L2/L3 (``restore_done`` a few steps later), finished requests
    ``unlock`` and are backed up (``backup`` / ``backup_done``), ACKs are consumed in ``pp_ack``
    batches and every fourth step ``evict`` runs. ``restore``/``backup`` carry ``local_slots``."""
    rng = random.Random(seed)
    evs: list[dict] = []
    add = evs.append
    step = op = rid_n = 0
    running: deque[tuple[str, int, int]] = deque()     # (rid, node, finish step)
    restores: deque[tuple[int, int]] = deque()         # (op, done step)
    backups: deque[tuple[int, int]] = deque()
    load_acks: list[int] = []
    backup_acks: list[int] = []
    next_node = 1
    while len(evs) < n:
        for _ in range(rng.randint(1, 4)):             # arrivals
            rid = f"req-{rid_n}"
            rid_n += 1
            l1 = rng.randrange(0, 64) * page
            l2 = rng.choice((0, 0, 0, rng.randrange(1, 16) * page))
            l3 = rng.choice((0, 0, 0, 0, rng.randrange(1, 8) * page))
            add({"step": step, "kind": EV.MATCH.name, "rid": rid, "l1_len": l1, "l2_len": l2,
                 "l3_len": l3})
            node = next_node
            next_node += 1
            add({"step": step, "kind": EV.LOCK.name, "rid": rid, "node": node})
            if l2 or l3:
                pages = (l2 + l3) // page
                base = rng.randrange(1 << 16)
                add({"step": step, "kind": EV.RESTORE.name, "op": op, "rid": rid, "pages": pages,
                     "local_slots": list(range(base, base + pages))})
                restores.append((op, step + rng.randint(1, 3)))
                op += 1
            running.append((rid, node, step + rng.randint(1, 20)))
        while restores and restores[0][1] <= step:     # completions, in order
            o, _ = restores.popleft()
            add({"step": step, "kind": EV.RESTORE_DONE.name, "op": o})
            load_acks.append(o)
        while backups and backups[0][1] <= step:
            o, _ = backups.popleft()
            add({"step": step, "kind": EV.BACKUP_DONE.name, "op": o})
            backup_acks.append(o)
        if load_acks and rng.random() < 0.7:
            k = rng.randint(1, len(load_acks))
            add({"step": step, "kind": EV.PP_ACK.name, "queue": "load", "consumed": k,
                 "acks": load_acks[:k]})
            del load_acks[:k]
        if backup_acks and rng.random() < 0.5:
            k = rng.randint(1, len(backup_acks))
            add({"step": step, "kind": EV.PP_ACK.name, "queue": "backup", "consumed": k,
                 "acks": backup_acks[:k]})
            del backup_acks[:k]
        for _ in range(len(running)):                  # finishes
            rid, node, fin = running[0]
            running.rotate(-1)
            if fin <= step:
                add({"step": step, "kind": EV.UNLOCK.name, "rid": rid, "node": node})
                pages = rng.randint(1, 8)
                base = rng.randrange(1 << 16)
                add({"step": step, "kind": EV.BACKUP.name, "op": op, "pages": pages,
                     "local_slots": list(range(base, base + pages))})
                backups.append((op, step + rng.randint(1, 4)))
                op += 1
        running = deque(r for r in running if r[2] > step)
        if step % 4 == 3:
            eligible = sorted(rng.sample(range(max(1, next_node - 500), next_node),
                                         min(8, next_node - 1)))
            add({"step": step, "kind": EV.EVICT.name, "tier": rng.choice(("l1", "l2")),
                 "eligible": eligible, "evicted": eligible[:rng.randint(0, len(eligible))]})
        step += 1
    del evs[n:]
    return evs


def record(log: EventLog, decisions: list[dict]) -> None:
    """Emit ``decisions`` (from :func:`synthetic_decisions`) into ``log``, step by step."""
    for d in decisions:
        if d["step"] != log.step:
            log.set_step(d["step"])
        log.emit(EV.KINDS[d["kind"]], **{k: v for k, v in d.items() if k not in ("step", "kind")})
