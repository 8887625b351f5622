"""One contract for every eviction policy in the registry, plus what ``bip`` and ``density``
add.

Every policy: locked KV is never evicted, eviction is leaf-first (the tree stays healthy under
random traffic with an L2), hit rates never beat the offline bound. ``bip`` and ``density``: LRU
until they have measured reuse distances; on a loop larger than the cache (where LRU hits
nothing) they admit only part of it and hit. ``density`` also tells classes apart: one-shot
long prompts are not admitted while short conversations that come back are.
"""

import numpy as np
import pytest

from checkers.invariants import assert_healthy
from engine.cache.policy import make_policy, policy_names
from engine.core.errors import OutOfCapacity
from tests.factories import make_cache, serve

POLICIES = policy_names()


def seq(start, n):
    return list(range(start, start + n))


def evicted(cache):
    return [i for e in cache.events.events if e["kind"] == "evict" and e["tier"] == "l1"
            for i in e["evicted"]]


def test_registry_lists_bip_and_rejects_unknown_names():
    assert "bip" in POLICIES and "opt" not in POLICIES
    with pytest.raises(ValueError, match="choose one of"):
        make_policy("nope")


@pytest.mark.parametrize("policy", POLICIES)
def test_locked_kv_is_never_evicted(policy):
    c = make_cache(page_size=2, l1_pages=4, eviction_policy=policy, real=False)
    m = c.match(seq(0, 4))
    r = c.lock(m)
    c.insert(seq(0, 4), c.alloc(2), after=r)
    r2 = c.lock(c.match(seq(0, 4)))
    c.unlock(r)
    with pytest.raises(OutOfCapacity):
        c.alloc(3)
    assert c.match(seq(0, 4)).l1_len == 4
    c.unlock(r2)
    assert len(c.alloc(3)) == 3


@pytest.mark.parametrize("policy", POLICIES)
def test_leaf_first_under_random_traffic(policy):
    rng = np.random.default_rng(7)
    c = make_cache(page_size=2, l1_pages=12, l2_pages=16, eviction_policy=policy)
    prefixes = [seq(100 * i, 6) for i in range(4)]
    for step in range(120):
        toks = prefixes[rng.integers(4)] + [int(x) for x in rng.integers(0, 50, rng.integers(1, 8))]
        serve(c, toks, rid=step)
        assert_healthy(c)
        for node in c.tree.iter_nodes():   # an evicted parent would orphan an L1 child
            if node.l1 is not None and node.parent.parent is not None:
                assert node.parent.l1 is not None, f"{policy}: L1 child under a non-L1 parent"
    c.wait_all()
    assert_healthy(c, idle=True)


@pytest.mark.parametrize("policy", POLICIES)
def test_no_policy_beats_the_offline_bound(policy):
    from engine.loadgen.trace import read_trace
    from engine.sim.replay import ReplayConfig, replay
    from tests.test_replay import DATA

    records = read_trace(DATA)
    opt, _ = replay(records, ReplayConfig(l1_tokens=300_000, policy="opt", events=False))
    res, _ = replay(records, ReplayConfig(l1_tokens=300_000, policy=policy, events=False))
    assert 0 < res.token_hit_rate <= opt.token_hit_rate


def _loop(policy, rounds=12, prompts=12, pages=4, cache_pages=24):
    """``prompts`` distinct prompts of ``pages`` pages each, requested round-robin: a loop of
    twice the cache. Returns (hit tokens, cache)."""
    c = make_cache(page_size=2, l1_pages=cache_pages, eviction_policy=policy, real=False,
                   events=True)
    hits = 0
    for r in range(rounds):
        for i in range(prompts):
            hits += serve(c, seq(1000 * (i + 1), 2 * pages), rid=(r, i)).l1_len
    return hits, c


@pytest.mark.parametrize("policy", ["bip", "density"])
def test_adaptive_policies_are_lru_before_they_have_measured_anything(policy):
    def order(policy):
        c = make_cache(page_size=2, l1_pages=6, eviction_policy=policy, real=False)
        for t in (seq(0, 2), seq(10, 2), seq(20, 2), seq(0, 2), seq(30, 6)):
            serve(c, t)
        return evicted(c)

    assert order(policy) == order("lru")


def test_bip_hits_a_loop_larger_than_the_cache_where_lru_hits_nothing():
    lru, _ = _loop("lru")
    bip, cache = _loop("bip")
    assert lru == 0
    assert cache.policy.rate < 1.0
    assert bip > 0
    assert_healthy(cache, idle=True)


def test_density_hits_a_loop_larger_than_the_cache_where_lru_hits_nothing():
    lru, _ = _loop("lru")
    dens, cache = _loop("density", rounds=16)
    assert lru == 0
    assert cache.policy.shares and min(cache.policy.shares.values()) < 1.0
    assert dens > 0
    assert_healthy(cache, idle=True)


def _mixed(policy, sessions=160, cache_pages=64):
    """Two kinds of traffic through one cache: long one-shot prompts (16 pages, never seen
    again) and short conversations (2 pages) whose second turn comes back after about two
    caches of insertions. Returns (hit tokens of second turns, cache)."""
    c = make_cache(page_size=2, l1_pages=cache_pages, eviction_policy=policy, real=False)
    hits = 0
    pending = []
    for i in range(sessions):
        first = seq(1_000_000 + 1000 * i, 4)
        serve(c, first, rid=("t1", i))
        pending.append(first)
        for j in range(3):                       # one-shot long prompts in between
            serve(c, seq(10_000_000 + 100_000 * (3 * i + j), 32), rid=("x", i, j))
        if len(pending) > 2:                     # the turn two sessions ago continues
            prev = pending.pop(0)
            hits += serve(c, prev + seq(prev[-1] + 1, 2), rid=("t2", i)).l1_len
    return hits, c


def test_density_keeps_the_class_that_comes_back_and_drops_one_shot_prompts():
    lru, _ = _mixed("lru")
    dens, cache = _mixed("density")
    assert dens > 2 * max(lru, 1)
    long_fresh = {k: v for k, v in cache.policy.shares.items() if k[1] >= 2 and not k[2]}
    short_fresh = {k: v for k, v in cache.policy.shares.items() if k[1] == 0 and not k[2]}
    assert long_fresh and max(long_fresh.values()) < 0.5
    assert short_fresh and min(short_fresh.values()) == 1.0
    assert_healthy(cache, idle=True)


def test_density_counts_only_the_tokens_a_continuation_shares_with_its_ghost():
    from engine.cache.policy_density import DensityPolicy

    c = make_cache(page_size=2, l1_pages=8, eviction_policy="density", real=False)
    pol: DensityPolicy = c.policy
    serve(c, seq(0, 8), rid=0)                   # 4 pages, then pushed out
    serve(c, seq(100, 16), rid=1)
    assert c.match(seq(0, 8)).l1_len == 0
    before = sum(sum(k.hist) for k in pol.classes.values())
    serve(c, seq(0, 4) + seq(500, 6), rid=2)     # shares 2 of the evicted edge's 4 pages
    after = sum(sum(k.hist) for k in pol.classes.values())
    assert after - before == 4


def test_density_solver_admits_dense_classes_first():
    from engine.cache.policy_density import _NB, _bucket, _Class, solve_admission

    def cls(reused_at, share_reused, touched=1000.0):
        k = _Class()
        k.touched = touched
        if reused_at is not None:
            k.hist[_bucket(reused_at)] = touched * share_reused
        return k

    classes = {
        (1, 0, False): cls(300, 0.9),     # small, comes back at 3 caches: worth keeping
        (1, 3, False): cls(None, 0.0),    # one-shot: never comes back
        (2, 0, True): cls(50, 0.5),       # already reused: always admitted
    }
    shares = solve_admission(classes, span=3000.0, budget=100.0)
    assert shares[(1, 0, False)] > 0.0
    assert shares[(1, 3, False)] == 0.0
    assert (2, 0, True) not in shares
    assert len(classes[(1, 0, False)].hist) == _NB
    # a cache big enough for everything: LRU
    assert solve_admission(classes, span=3000.0, budget=1e9) == {}


def test_density_admitting_everything_is_exactly_lru(monkeypatch):
    """With no class filtered (the solver says LRU) the eviction order is LRU's, splits and
    partial hits included."""
    import engine.cache.policy_density as pd

    monkeypatch.setattr(pd, "solve_admission", lambda *a, **k: {})

    def run(policy):
        rng = np.random.default_rng(3)
        c = make_cache(page_size=2, l1_pages=10, eviction_policy=policy, real=False)
        prefixes = [seq(100 * i, 6) for i in range(5)]
        for step in range(200):
            toks = prefixes[rng.integers(5)][:2 * int(rng.integers(1, 4))] \
                + [int(x) for x in rng.integers(0, 40, rng.integers(0, 8))]
            serve(c, toks, rid=step)
        return evicted(c)

    order = run("lru")
    assert len(order) > 50
    assert run("density") == order
