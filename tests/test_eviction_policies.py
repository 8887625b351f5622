"""One contract for every eviction policy in the registry, plus what ``bip`` adds.

Every policy: locked KV is never evicted, eviction is leaf-first (the tree stays healthy under
random traffic with an L2), hit rates never beat the offline bound. ``bip``: it is LRU until it
has measured reuse distances, and on a loop larger than the cache (where LRU hits nothing) it
lowers its admission rate and hits.
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


def test_bip_is_lru_before_it_has_measured_anything():
    def order(policy):
        c = make_cache(page_size=2, l1_pages=6, eviction_policy=policy, real=False)
        for t in (seq(0, 2), seq(10, 2), seq(20, 2), seq(0, 2), seq(30, 6)):
            serve(c, t)
        return evicted(c)

    assert order("bip") == order("lru")


def test_bip_hits_a_loop_larger_than_the_cache_where_lru_hits_nothing():
    lru, _ = _loop("lru")
    bip, cache = _loop("bip")
    assert lru == 0
    assert cache.policy.rate < 1.0
    assert bip > 0
    assert_healthy(cache, idle=True)
