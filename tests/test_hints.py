"""Client cache hints in the cache (engine.cache.hints): what each hint does to the eviction
order of every tier, its bounds, expiry, trust and namespaces."""

import math

import numpy as np
import pytest

from checkers.invariants import assert_healthy
from engine.cache.hints import MAX_TTL_S, SHARED, CacheHint
from tests.factories import make_cache

P = 4


def toks(base, n_pages):
    return np.arange(base, base + n_pages * P, dtype=np.uint32)


def req(cache, tokens, hint=None, t=None, ns=None):
    """One request as the scheduler runs it, with its hint; returns the cached prefix length."""
    if t is not None:
        cache.set_clock(t)
    m = cache.match(tokens, namespace=ns)
    receipt = cache.lock(m)
    cache.load_back(m)
    n_full = len(tokens) // P
    have = len(m.l1_pages)
    pages = np.concatenate([m.l1_pages, cache.alloc(n_full - have)])
    cache.release(tokens, pages, insert=True, namespace=ns, receipt=receipt, hint=hint)
    cache.poll()
    return m.l1_len + m.l2_len


def cached(cache, tokens, ns=None):
    """Tokens of ``tokens`` the cache holds (any tier), without touching anything."""
    from engine.core.namespace import as_namespace

    _, n = cache.tree.walk(np.asarray(tokens, dtype=np.uint32), as_namespace(ns), split=False)
    return n


def trusting(**kw):
    return make_cache(page_size=P, real=False, hint_kwargs={"min_evidence": 0}, **kw)


def test_a_hint_validates_its_fields():
    for bad in ({"session": ""}, {"session": "x" * 257}, {"session": -1}, {"session": 1.5},
                {"ttl_s": -1}, {"ttl_s": MAX_TTL_S * 2}, {"ttl_s": True}, {"ttl_s": math.nan},
                {"close": 1}):
        with pytest.raises(ValueError):
            CacheHint(**bad)
    h = CacheHint("s1", 30.0, False)
    assert CacheHint.from_wire(h.to_wire()) == h
    assert CacheHint.from_wire(None) is None
    with pytest.raises(ValueError):
        CacheHint.from_wire(["s", -3, False])
    with pytest.raises(ValueError):
        CacheHint.from_wire({"session": "s"})


@pytest.mark.parametrize("l2", [0, 12])
def test_a_closed_session_goes_first_and_a_declared_one_stays(l2):
    """Three sessions of three pages each, oldest first: ``a`` (declares its next turn in 5 s),
    ``b`` (closed), ``c`` (no retention). A new request needs room for one: LRU would evict
    ``a``; the hints evict ``b`` (closed: never needed again) — and with L2 the same holds for
    the L2 copies when that fills up too."""
    c = trusting(l1_pages=9, l2_pages=l2)
    a, b, cc = toks(0, 3), toks(1000, 3), toks(2000, 3)
    req(c, a, CacheHint("a", 5.0), t=0.0)
    req(c, b, CacheHint("b", close=True), t=1.0)
    req(c, cc, CacheHint("c"), t=2.0)
    ids = {k: c.tree.walk(v, None, split=False)[0][-1] for k, v in
           (("a", a), ("b", b), ("c", cc))}
    assert ids["a"].hint_until == 5.0 and ids["b"].hint_until == math.inf
    assert ids["c"].hint_until is None
    req(c, toks(3000, 3), None, t=3.0)
    if l2 == 0:
        assert cached(c, b) == 0 and cached(c, a) == 12 and cached(c, cc) == 12
    else:                                   # L1 copies went (b's first), all are in L2
        assert cached(c, a) == cached(c, b) == cached(c, cc) == 12
        assert ids["b"].l1 is None and ids["a"].l1 is not None
        req(c, toks(4000, 6), None, t=4.0)   # L2 must drop something too: b's copy first
        assert cached(c, b) == 0 and cached(c, a) == 12
    assert req(c, a, CacheHint("a", 5.0), t=5.0) == 12     # the declared turn is a hit
    assert c.hint_stats()["closed_evictions"] >= 1
    assert_healthy(c, idle=True)


def test_a_declared_next_use_is_weighed_against_the_age_of_unhinted_blocks():
    """A declaration that the next turn comes in an hour does not keep a block over one used a
    second ago (recency predicts that one back sooner): the merge compares predictions."""
    c = trusting(l1_pages=6)
    far, recent = toks(0, 3), toks(1000, 3)
    req(c, far, CacheHint("far", 3600.0), t=0.0)
    req(c, recent, CacheHint("r"), t=9.0)
    req(c, toks(2000, 3), None, t=10.0)
    assert cached(c, far) == 0 and cached(c, recent) == 12
    # a near declaration does keep its block over the older unhinted one
    c = trusting(l1_pages=6)
    old, near = toks(0, 3), toks(1000, 3)
    req(c, old, CacheHint("o"), t=0.0)
    req(c, near, CacheHint("n", 20.0), t=1.0)
    req(c, toks(2000, 3), None, t=10.0)   # old: back in ~10 s by its age; near: at 21 s
    assert cached(c, near) == 0            # 21 > 20: near is predicted later, it goes
    c = trusting(l1_pages=6)
    req(c, old, CacheHint("o"), t=0.0)
    req(c, near, CacheHint("n", 5.0), t=1.0)
    req(c, toks(2000, 3), None, t=10.0)    # near at 6 s (past due, not expired): stays
    assert cached(c, near) == 12 and cached(c, old) == 0


def test_hints_never_hold_kv_beyond_capacity():
    c = trusting(l1_pages=6)
    req(c, toks(0, 3), CacheHint("a", 1.0), t=0.0)
    req(c, toks(100, 3), CacheHint("b", 1.0), t=0.0)
    req(c, toks(200, 6), None, t=0.5)      # everything hinted and due: it still fits the new
    assert cached(c, toks(200, 6)) == 24
    assert_healthy(c, idle=True)


def test_a_declaration_expires():
    c = trusting(l1_pages=6)
    a = toks(0, 3)
    req(c, a, CacheHint("a", 5.0), t=0.0)
    node = c.tree.walk(a, None, split=False)[0][-1]
    c.set_clock(9.9)
    assert node.hint_until == 5.0          # until grace x ttl = 10 s
    c.set_clock(10.0)
    assert node.hint_until is None and c.hint_stats()["hints_expired"] == 1


def test_shared_blocks_take_no_hint():
    """A prefix two sessions use is nobody's to close: only the closing session's own blocks
    go first."""
    c = trusting(l1_pages=12)
    system = toks(0, 2)
    a = np.concatenate([system, toks(500, 2)])
    b = np.concatenate([system, toks(900, 2)])
    req(c, a, CacheHint("a"), t=0.0)
    req(c, b, CacheHint("b"), t=1.0)
    assert c.close_session(None, "a") == 1
    path = c.tree.walk(a, None, split=False)[0]
    assert [n.session for n in path][0] == SHARED and path[0].hint_until is None
    assert path[-1].hint_until == math.inf
    # a request of no session shares the path it touches, too
    req(c, b, None, t=2.0)
    assert c.close_session(None, "b") == 0


def test_hints_stay_in_their_namespace():
    c = trusting(l1_pages=12)
    x = toks(0, 3)
    req(c, x, CacheHint("s"), t=0.0, ns="tenant-x")
    req(c, x, CacheHint("s"), t=0.0, ns="tenant-y")
    assert c.close_session("tenant-z", "s") == 0
    assert c.close_session("tenant-y", "s") == 1
    nx = c.tree.walk(x, c.tree.roots and next(k for k in c.tree.roots if k is not None
                                               and k.namespace == "tenant-x"), split=False)[0]
    assert nx and all(n.hint_until is None for n in nx)


def test_a_split_hinted_edge_keeps_and_expires_its_declaration_on_both_halves():
    c = trusting(l1_pages=12)
    a = toks(0, 4)
    req(c, a, CacheHint("a", 5.0), t=0.0)
    req(c, np.concatenate([a[:2 * P], toks(700, 1)]), CacheHint("b"), t=1.0)   # splits a
    path = c.tree.walk(a, None, split=False)[0]
    assert len(path) == 2
    assert path[0].session == SHARED and path[0].hint_until is None
    assert path[1].hint_until == 5.0
    c.set_clock(10.0)
    assert all(n.hint_until is None for n in path)
    assert_healthy(c, idle=True)


def test_hints_are_events():
    c = trusting(l1_pages=6)
    req(c, toks(0, 3), CacheHint("a", 5.0), t=0.0)
    c.close_session(None, "a")
    kinds = [(e["kind"], e.get("session")) for e in c.events.events
             if e["kind"] in ("hint", "session_close")]
    assert kinds == [("hint", "a"), ("session_close", "a")]


def test_a_closed_sessions_kv_is_not_written_back_to_l3():
    from engine.cache.l3 import SimulatedTier

    c = trusting(l1_pages=3, l2_pages=3, write_policy="write_back")
    c.attach_l3(SimulatedTier(-1))
    req(c, toks(0, 3), CacheHint("a", close=True), t=0.0)
    req(c, toks(100, 3), CacheHint("b"), t=1.0)
    req(c, toks(200, 3), None, t=2.0)       # L2 evicts: b's pages are stored, a's are not
    c.wait_all()
    st = c.hint_stats()
    assert st["l3_writebacks_skipped"] >= 1
    assert c.l3.exists_prefix(c.l3.hashes(toks(0, 3), None)) == 0


def test_untrusted_hints_are_only_recorded():
    """By default a namespace's hints apply once enough of them came true: wrong declarations
    (a close followed by the session's return) keep them off."""
    c = make_cache(page_size=P, l1_pages=64, real=False)
    t = 0.0
    for _ in range(12):                   # a session that says it is over, and comes back
        req(c, toks(0, 2), CacheHint("liar", close=True), t=t)
        t += 1.0
    assert c.hint_stats()["trusted_namespaces"] == 0
    assert c.hint_stats()["hints_wrong"] >= 10
    c2 = make_cache(page_size=P, l1_pages=64, real=False)
    for i in range(12):                    # sessions that close and never return
        req(c2, toks(1000 * i, 2), CacheHint(f"s{i}", close=True), t=float(i))
    assert c2.hint_stats()["trusted_closes"] == 0     # not judged yet: nobody came back *yet*
    c2.set_clock(1000.0)                   # past grace x the turn gap (60 s before any seen)
    st = c2.hint_stats()
    assert st["trusted_closes"] == 1 and st["trusted_ttls"] == 0
    # a few right ones are not enough: the interval's lower end must reach 0.9 (9 of 9)
    c3 = make_cache(page_size=P, l1_pages=64, real=False)
    for i in range(6):
        req(c3, toks(1000 * i, 2), CacheHint(f"s{i}", close=True), t=float(i))
    c3.set_clock(1000.0)
    assert c3.hint_stats()["trusted_closes"] == 0


@pytest.mark.parametrize("mode", ["always", "off", "earned"])
def test_trust_modes_decide_whether_hints_are_applied(mode):
    """``always``: applied from the first request, and still after they proved wrong; ``off``:
    judged, never applied; ``earned`` (the default): not before enough came true."""
    c = make_cache(page_size=P, real=False, l1_pages=6, hint_kwargs={"trust_mode": mode})
    a, b = toks(0, 3), toks(1000, 3)
    req(c, a, CacheHint("a", 1.0), t=0.0)
    req(c, a[:8], CacheHint("a", 1.0), t=50.0)   # far later than declared: a wrong retention
    req(c, b, CacheHint("b", close=True), t=51.0)
    st = c.hint_stats()
    assert st["trust_mode"] == mode and st["hints_wrong"] == 1, st
    b_node = c.tree.walk(b, None, split=False)[0][-1]
    if mode == "always":
        assert st["hints_applied"] == 3 and b_node.hint_until == math.inf, st
        assert st["trusted_ttls"] == 1          # the wrong retention did not switch it off
        req(c, toks(3000, 3), None, t=52.0)
        assert cached(c, b) == 0 and cached(c, a) == 12   # the closed session went first
    else:
        assert st["hints_applied"] == 0 and b_node.hint_until is None, st
        req(c, toks(3000, 3), None, t=52.0)
        assert cached(c, b) == 12 and cached(c, a) < 12   # LRU: the oldest went
    with pytest.raises(ValueError, match="hint trust must be one of"):
        make_cache(page_size=P, real=False, hint_kwargs={"trust_mode": "sometimes"}).hint_stats()


@pytest.mark.parametrize("trust", ["always", "off"])
def test_a_closed_sessions_l3_pages_are_the_stores_first_to_evict(trust):
    """L3 holds six pages: ``b``'s three, then ``a``'s (newer). ``a`` closes; a third session's
    three pages then push three out of the store. LRU would drop ``b`` (older); with the close
    applied the store drops ``a``'s demoted pages instead (``off``: LRU's order)."""
    from engine.cache.l3 import SimulatedTier

    c = make_cache(page_size=P, real=False, l1_pages=3, l2_pages=6,
                   hint_kwargs={"trust_mode": trust})
    c.attach_l3(SimulatedTier(capacity_pages=6))
    a, b, d = toks(0, 3), toks(1000, 3), toks(2000, 3)
    req(c, b, CacheHint("b", 9.0), t=0.0)
    req(c, a, CacheHint("a", 9.0), t=1.0)
    c.wait_all()
    c.poll()

    def stored(t):                          # (without touching: exists_prefix is a use)
        return sum(h in c.l3.impl._keys for h in c.l3.hashes(t, None))

    assert stored(a) == stored(b) == 3
    c.close_session(None, "a")
    req(c, d, None, t=2.0)
    c.wait_all()
    c.poll()
    assert stored(d) == 3
    st = c.hint_stats()
    if trust == "always":
        assert stored(a) == 0 and stored(b) == 3, st
        assert st["l3_pages_demoted"] == 3 and c.l3.stats()["pages_demoted"] == 3
    else:
        assert stored(b) == 0 and stored(a) == 3, st
        assert st["l3_pages_demoted"] == 0
    assert_healthy(c)
