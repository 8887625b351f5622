"""Client cache hints: soft retention hints that order eviction (docs/eviction.md, "Hints").

A client knows what no history-only policy can: that a session is over, or that its next turn
comes in about ``T`` seconds. A :class:`CacheHint` carries that with a request; the cache turns
it into a *predicted next use* of the blocks the request's session owns alone, and compares it
with what recency predicts for every unhinted block:

* an unhinted candidate last used ``a`` seconds ago is expected back in about ``a`` seconds (the
  age estimate, so among unhinted blocks the chosen policy's order stands);
* a block whose session declared its next turn within ``T`` is expected at ``t + T`` — and kept
  while that is sooner than the oldest unhinted block's estimate; past ``t + grace·T`` the
  declaration has expired and the block is an ordinary one again;
* a closed session's private blocks are never expected again: they go first.

The eviction then takes whichever candidate is predicted to be needed last (Belady's rule on
the predictions). A hint is soft: it orders eviction in every tier and never holds KV beyond
capacity (when only hinted blocks remain they go, latest predicted first).

Hints are per namespace and per session: a block two sessions touched is *shared* and never
hinted, so a session's hints only move its own private KV; a namespace's hints only ever touch
its own tree (namespaces never share a node). Hints are also *checked*: each declaration is
compared with what the session did next (its next request within ``[T/band, T·band]``; no request
after a close), and a namespace's hints are applied only while enough of them proved right
(:class:`HintBook`): wrong, stale or adversarial hints fall back to the plain policy instead of
evicting what the clients will reuse.

Everything here is deterministic in the operations and the hint clock (``set_clock``), which
every rank of a group receives alike, so ranks take the same hint decisions.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import heapq
import math
from typing import Any, Callable

INF = math.inf
SHARED = -1                        # ``Node.session`` of a block two sessions touched
MAX_TTL_S = 30 * 86400.0           # the longest retention a client may declare
MAX_SESSION_KEY_CHARS = 256
MAX_BRANCHES = 8                   # branch ends a session's close finds
DEFAULT_GAP_S = 60.0               # a session's turn gap, until some were seen
TRUST_MODES = ("earned", "always", "off")
"""When a namespace's hints are applied (``HintBook(trust_mode=)``, ``--hint-trust``)."""


@dataclasses.dataclass(frozen=True)
class CacheHint:
    """What a client says of one request: its session (a key within the request's namespace),
    the expected seconds until the session's next request (``ttl_s``), or that this request is
    the session's last (``close``)."""

    session: str | int | None = None
    ttl_s: float | None = None
    close: bool = False

    def __post_init__(self) -> None:
        s = self.session
        if s is not None and not (
                (isinstance(s, str) and 0 < len(s) <= MAX_SESSION_KEY_CHARS)
                or (type(s) is int and 0 <= s < 1 << 63)):
            raise ValueError(f"a session key must be a string of 1..{MAX_SESSION_KEY_CHARS} "
                             f"characters or an integer in [0, 2**63), got {s!r:.80}")
        t = self.ttl_s
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float))
                              or not 0 <= t <= MAX_TTL_S):
            raise ValueError(f"a retention hint must be a number of seconds in "
                             f"[0, {MAX_TTL_S:g}], got {t!r:.40}")
        if not isinstance(self.close, bool):
            raise ValueError("close must be true or false")

    @property
    def empty(self) -> bool:
        return self.session is None and self.ttl_s is None and not self.close

    def to_wire(self) -> list:
        return [self.session, None if self.ttl_s is None else float(self.ttl_s), self.close]

    @classmethod
    def from_wire(cls, w: Any) -> "CacheHint | None":
        """The hint a rank link carried (``None`` stays ``None``); ``ValueError`` when malformed."""
        if w is None:
            return None
        if not isinstance(w, list) or len(w) != 3:
            raise ValueError(f"malformed cache hint on the rank link: {str(w)[:80]}")
        return cls(w[0], w[1], w[2])


class _Session:
    __slots__ = ("sid", "namespace", "key", "leaves", "claim_at", "claim_ttl", "closed",
                 "declares", "seen")

    def __init__(self, sid: int, namespace: Any, key: Any):
        self.sid, self.namespace, self.key = sid, namespace, key
        self.leaves: list = []             # where its latest requests ended (its branches)
        self.claim_at = -1.0               # when the pending ttl claim was made (-1: none)
        self.claim_ttl = 0.0
        self.closed: bool | int = False    # it said it was over (2: and stayed away so far)
        self.declares = False              # it sent a retention (ttl) before
        self.seen = -1.0                   # when its latest request came


class _Trust:
    """What a namespace's hints proved: declarations that came true and that did not."""

    __slots__ = ("good", "bad", "on")

    def __init__(self) -> None:
        self.good = self.bad = 0.0
        self.on = False


class HintBook:
    """The hint state of one cache: its clock, its sessions (bounded), the namespaces' trust and
    the expiry order of hinted blocks.

    ``grace``: a ttl declaration holds until ``t + grace·ttl``; ``band``: a declaration came
    true when the session's next request arrived within ``[ttl/band, ttl·band]``;
    a namespace's hints are applied while the share of its declarations that came true is, one
    standard error below its estimate, at least ``trust`` (the Wilson score interval's lower
    end at ``z`` = 1 of right / judged: nine right of nine; counts halve past ``window``), so
    a few lucky guesses do not switch them on, nor do hints right eight times in ten. Closes
    and retentions earn trust apart (one kind can be right while the other is not).
    ``min_evidence=0`` trusts a namespace before anything was judged (tests).

    ``trust_mode``: ``earned`` (the rule above), ``always`` (every namespace's hints are applied
    from the first request and stay applied, however they turn out: for clients the operator
    runs), ``off`` (hints are recorded and judged, never applied). See :data:`TRUST_MODES`.
    """

    def __init__(self, *, max_sessions: int = 65536, grace: float = 2.0, band: float = 4.0,
                 min_evidence: int = 8, trust: float = 0.9, window: int = 512,
                 trust_mode: str = "earned"):
        if max_sessions < 1 or grace < 1 or band < 1 or not 0 <= trust <= 1:
            raise ValueError("hint book: max_sessions >= 1, grace >= 1, band >= 1 and "
                             "0 <= trust <= 1")
        if trust_mode not in TRUST_MODES:
            raise ValueError(f"hint trust must be one of {', '.join(TRUST_MODES)}, got "
                             f"{trust_mode!r:.40}")
        self.trust_mode = trust_mode
        self.max_sessions, self.grace, self.band = max_sessions, grace, band
        self.min_evidence, self.trust_level, self.window = min_evidence, trust, window
        self.now = 0.0
        self._ticks: list[int] = []        # tree clock at each set_clock ...
        self._times: list[float] = []      # ... and the time set then
        self._sessions: collections.OrderedDict[tuple, _Session] = collections.OrderedDict()
        self._by_sid: dict[int, _Session] = {}
        self._next_sid = 0
        self._trust: dict[Any, _Trust] = {}
        self._expiry: list = []            # (expiry time, seq, node ids): ttl declarations
        self._live: dict[int, Any] = {}    # node id -> node, of nodes a declaration holds
        self._claims: list = []            # (deadline, seq, sid, claim_at or -1-closed_at)
        self._gap_log = 0.0
        self._gap_n = 0.0
        self._seq = 0
        self.counters: collections.Counter = collections.Counter()
        # called with a namespace whose hints stop being trusted (the cache clears its marks)
        self.on_distrust: Callable[[Any, str], None] = lambda namespace, kind: None

    # -- the clock ------------------------------------------------------------------------
    def set_clock(self, t: float, tick: int) -> None:
        """The hint clock is ``t`` seconds after the tree's logical clock ``tick`` (never goes
        back). Samples are kept (thinned when many) to date a node's last touch."""
        if not math.isfinite(t):
            raise ValueError(f"the hint clock must be finite, got {t!r}")
        t = max(t, self.now)
        self.now = t
        tick += 1                          # the touches from now on: ticks after ``tick``
        if self._ticks and self._ticks[-1] == tick:
            self._times[-1] = t
        else:
            self._ticks.append(tick)
            self._times.append(t)
            if len(self._ticks) > 8192:     # thin the older half: ages stay roughly right
                half = len(self._ticks) // 2
                self._ticks[:half] = self._ticks[:half:2]
                self._times[:half] = self._times[:half:2]

    def time_of(self, tick: int) -> float:
        """When the tree's logical clock read ``tick`` (the latest sample at or before it)."""
        i = bisect.bisect_right(self._ticks, tick) - 1
        return self._times[i] if i >= 0 else (self._times[0] if self._times else 0.0)

    # -- sessions ---------------------------------------------------------------------------
    def session(self, namespace: Any, key: Any) -> _Session:
        k = (namespace, key)
        s = self._sessions.get(k)
        if s is not None:
            return s
        s = _Session(self._next_sid, namespace, key)
        self._next_sid += 1
        self._sessions[k] = s
        self._by_sid[s.sid] = s
        while len(self._sessions) > self.max_sessions:   # the oldest session's state goes
            _, old = self._sessions.popitem(last=False)
            del self._by_sid[old.sid]
            self.counters["sessions_dropped"] += 1
        return s

    def find(self, namespace: Any, key: Any) -> _Session | None:
        return self._sessions.get((namespace, key))

    def key_of(self, sid: int) -> Any:
        """The client's key of session number ``sid`` (``Node.session``); None when the
        bounded book has dropped that session (or never had it)."""
        s = self._by_sid.get(sid)
        return None if s is None else s.key

    def on_remove(self, node: Any) -> None:
        """A node left the tree: a session branch that ended there now ends at its parent
        (so a later close still finds the session's remaining blocks)."""
        self._live.pop(node.id, None)
        s = self._by_sid.get(node.session)
        if s is not None and node in s.leaves:
            s.leaves.remove(node)
            parent = node.parent
            if parent is not None and parent.parent is not None and \
                    parent.session == s.sid and parent not in s.leaves:
                s.leaves.append(parent)           # (a shared parent is nobody's branch end)

    def add_leaf(self, s: _Session, node: Any) -> None:
        """``s``'s latest request ended at ``node``: a branch end (its ancestors that were
        branch ends are not any more)."""
        leaves = s.leaves
        if leaves and leaves[-1] is node:
            return
        up = node.parent
        while up is not None and up.parent is not None and up.session == s.sid:
            if up in leaves:
                leaves.remove(up)
            up = up.parent
        if node not in leaves:
            leaves.append(node)
            if len(leaves) > MAX_BRANCHES:
                del leaves[0]

    # -- trust ----------------------------------------------------------------------------
    def _judge(self, namespace: Any, kind: str, good: float, bad: float) -> None:
        """Record one judged declaration of ``kind`` (``close`` or ``ttl``): each kind earns
        its trust on its own, so right closes are used even when the retentions are off."""
        tr = self._trust.get((namespace, kind))
        if tr is None:
            tr = self._trust[(namespace, kind)] = _Trust()
        tr.good = max(tr.good + good, 0.0)
        tr.bad += bad
        if tr.good + tr.bad > self.window:
            tr.good /= 2
            tr.bad /= 2
        self.counters["hints_right"] += good > 0
        self.counters["hints_wrong"] += bad > 0
        was = tr.on
        n = tr.good + tr.bad
        if self.trust_mode != "earned":
            tr.on = self.trust_mode == "always"
        else:
            tr.on = n >= self.min_evidence and (
                n > 0 and _wilson_low(tr.good, n) >= self.trust_level
                or self.min_evidence == 0 and tr.bad == 0)
        if was and not tr.on:
            self.counters["distrusted"] += 1
            self.on_distrust(namespace, kind)

    def trusted(self, namespace: Any, kind: str) -> bool:
        tr = self._trust.get((namespace, kind))
        if tr is not None:
            return tr.on
        return self.trust_mode == "always" or self.trust_mode == "earned" and self.min_evidence == 0

    def observe(self, s: _Session) -> None:
        """A request of session ``s`` arrived now: judge what the session declared before."""
        now = self.now
        if s.seen >= 0:                    # the sessions' turn gaps (their geometric mean)
            self._gap_log += math.log(max(now - s.seen, 1e-3))
            self._gap_n += 1
            if self._gap_n > 4096:
                self._gap_log /= 2
                self._gap_n /= 2
        s.seen = now
        if s.closed:                       # it said it was over: wrong (and not right after all)
            self._judge(s.namespace, "close", -1.0 if s.closed == 2 else 0.0, 1.0)
            s.closed = False
        if s.claim_at >= 0:
            gap, ttl = self.now - s.claim_at, s.claim_ttl
            ok = ttl / self.band <= gap <= ttl * self.band
            self._judge(s.namespace, "ttl", float(ok), float(not ok))
            s.claim_at = -1.0

    def claim(self, s: _Session, ttl: float | None, close: bool) -> None:
        """Record what ``s`` declares now, to be judged by what it does next."""
        self._seq += 1
        if close:                          # right if it stays away band x a turn gap
            s.closed = True
            s.claim_at = -1.0
            gap = math.exp(self._gap_log / self._gap_n) if self._gap_n else DEFAULT_GAP_S
            heapq.heappush(self._claims, (self.now + gap * self.grace, self._seq, s.sid,
                                          -1.0 - s.seen))
        elif ttl is not None:
            s.claim_at, s.claim_ttl = self.now, float(ttl)
            heapq.heappush(self._claims, (self.now + ttl * self.band, self._seq, s.sid,
                                          self.now))

    def judge_due(self) -> None:
        """Declarations whose window passed with no request from their session: a retention
        was wrong (nobody came), a close was right (nobody came back)."""
        claims, now = self._claims, self.now
        while claims and claims[0][0] < now:
            _, _, sid, at = heapq.heappop(claims)
            s = self._by_sid.get(sid)
            if s is None:
                continue
            if at < 0:
                if s.closed and s.seen == -1.0 - at:
                    self._judge(s.namespace, "close", 1.0, 0.0)
                    s.closed = 2                   # judged right (taken back if it returns)
            elif s.claim_at == at:
                s.claim_at = -1.0
                self._judge(s.namespace, "ttl", 0.0, 1.0)

    # -- hinted nodes ------------------------------------------------------------------------
    def mark(self, nodes: list, until: float, expiry: float) -> None:
        """Give ``nodes`` one declaration (until ``until``, expiring at ``expiry``)."""
        for node in nodes:
            node.hint_until, node.hint_expiry = until, expiry
        if expiry < INF:
            self.expire_at(nodes, expiry)

    def expire_at(self, nodes: list, expiry: float) -> None:
        """The declaration ``nodes`` got expires at ``expiry`` (kept by node id: a node that
        leaves the tree meanwhile is not held alive)."""
        live = self._live
        for node in nodes:
            live[node.id] = node
        self._seq += 1
        heapq.heappush(self._expiry, (expiry, self._seq, [n.id for n in nodes]))

    def expire_due(self, push: Callable[[Any], None]) -> None:
        """Declarations that expired: the nodes they marked (unless a later declaration
        re-marked them) become ordinary candidates again."""
        exp, now = self._expiry, self.now
        while exp and exp[0][0] <= now:
            t, _, ids = heapq.heappop(exp)
            live = self._live
            for i in ids:
                node = live.get(i)
                if node is None:
                    continue
                if node.hint_expiry != t:      # re-marked since: still live through that
                    continue
                del live[i]
                if node.hint_until is not None:
                    node.hint_until = None
                    node.hint_expiry = INF
                    self.counters["hints_expired"] += 1
                    if node.parent is not None:
                        push(node)

    def stats(self) -> dict[str, Any]:
        c = self.counters
        return {"sessions": len(self._sessions), "trust_mode": self.trust_mode,
                "trusted_namespaces": len({ns for (ns, _), t in self._trust.items() if t.on}),
                "trusted_closes": sum(t.on for (_, k), t in self._trust.items() if k == "close"),
                "trusted_ttls": sum(t.on for (_, k), t in self._trust.items() if k == "ttl"),
                "namespaces_judged": len({ns for ns, _ in self._trust}),
                "hint_evictions": c["hint_evictions"], "closed_evictions": c["closed_evictions"],
                "kept_by_hint": c["kept_by_hint"], "hints_applied": c["hints_applied"],
                "hints_ignored": c["hints_ignored"], "hints_right": c["hints_right"],
                "hints_wrong": c["hints_wrong"], "hints_expired": c["hints_expired"],
                "sessions_closed": c["sessions_closed"], "sessions_dropped": c["sessions_dropped"],
                "l3_writebacks_skipped": c["l3_writebacks_skipped"],
                "l3_pages_demoted": c["l3_pages_demoted"]}


def _wilson_low(right: float, n: float, z: float = 1.0) -> float:
    """The Wilson score interval's lower end for ``right`` successes in ``n`` trials."""
    p = right / n
    z2 = z * z
    centre = p + z2 / (2 * n)
    spread = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    return (centre - spread) / (1 + z2 / n)


def hint_key(node: Any) -> tuple:
    """A hinted candidate's heap key: the latest predicted next use first."""
    return (-node.hint_until, node.last_access)


def apply_hint(book: HintBook, last: Any, namespace: Any, hint: CacheHint | None,
               push: Callable[[Any], None],
               on_close: Callable[[list], None] | None = None) -> tuple[int, bool]:
    """After a request of ``hint.session`` that ended at node ``last``: the nodes of its path
    become the session's (or shared, when another session holds them), its declaration is
    judged and recorded, and — when the namespace's hints are trusted — its private nodes get
    the predicted next use. ``on_close(nodes)``: called with the nodes a trusted close marked
    (the cache demotes their L3 copies). Returns the nodes hinted and whether the hint was
    applied."""
    if hint is None or hint.session is None:
        node = last                        # a request of no session: its path is shared
        while node is not None and node.parent is not None and node.session != SHARED:
            node.session = SHARED
            if node.hint_until is not None:
                node.hint_until, node.hint_expiry = None, INF
                push(node)
            node = node.parent
        return 0, False
    s = book.session(namespace, hint.session)
    book.observe(s)
    ttl = hint.ttl_s
    close = hint.close or (s.declares and ttl is None)   # no retention asked any more: over
    s.declares = ttl is not None
    book.claim(s, ttl, close)
    on = book.trusted(namespace, "close" if close else "ttl")
    counters = book.counters
    if close:
        until, expiry = INF, INF
        counters["sessions_closed"] += 1
    elif ttl is not None:
        until, expiry = book.now + ttl, book.now + book.grace * ttl
    else:
        until, expiry = None, INF
    sid = s.sid
    hinting = on and until is not None
    counters["hints_applied" if hinting else "hints_ignored"] += 1
    marked: list = []
    node = last
    while node is not None and node.parent is not None:
        owner = node.session
        if owner == SHARED:
            break                          # its ancestors are shared too
        if owner != sid:
            if owner is None:
                node.session = sid
            else:
                node.session = SHARED
                if node.hint_until is not None:
                    node.hint_until, node.hint_expiry = None, INF
                    push(node)
                node = node.parent
                continue
        if hinting:
            node.hint_until, node.hint_expiry = until, expiry
            marked.append(node)
            push(node)
        elif node.hint_until is not None:  # a declaration without a retention: unhinted
            node.hint_until, node.hint_expiry = None, INF
            push(node)
        node = node.parent
    if marked and expiry < INF:
        book.expire_at(marked, expiry)
    if last is not None and last.parent is not None and last.session == sid:
        book.add_leaf(s, last)             # (a shared end is nobody's branch)
    if close and on:                       # the session's other branches go first too
        marked += _mark_closed(book, s, push)
        if on_close is not None:
            on_close(marked)
    elif len(s.leaves) > 1:                # branches this request left: their declaration
        for leaf in s.leaves[:-1]:          # was about this request, which did not use them
            node = leaf
            while node is not None and node.parent is not None and node.session == sid:
                if node.hint_until is not None and node.hint_until != INF \
                        and node.hint_expiry != expiry:
                    node.hint_until, node.hint_expiry = None, INF
                    push(node)
                node = node.parent
    return len(marked), on


def _mark_closed(book: HintBook, s: _Session, push: Callable[[Any], None]) -> list:
    """Mark every private node of closed ``s`` (on each branch end's path) first to go."""
    marked: list = []
    for leaf in list(s.leaves):
        node = leaf
        while node is not None and node.parent is not None and node.session == s.sid \
                and node.hint_until != INF:
            marked.append(node)
            node = node.parent
    book.mark(marked, INF, INF)
    for node in marked:
        push(node)
    return marked


def close_session(book: HintBook, namespace: Any, key: Any,
                  push: Callable[[Any], None],
                  on_close: Callable[[list], None] | None = None) -> int:
    """A session is over (without a request): its private nodes go first (``on_close`` is
    called with them, as in :func:`apply_hint`). Returns the nodes marked (0 for an unknown
    session, or one whose namespace's hints are not trusted)."""
    s = book.find(namespace, key)
    if s is None:
        return 0
    book.claim(s, None, True)
    book.counters["sessions_closed"] += 1
    if not book.trusted(namespace, "close"):
        return 0
    marked = _mark_closed(book, s, push)
    if on_close is not None:
        on_close(marked)
    return len(marked)
