"""Capacity sweeps in the library: page-level replay, worker processes, the policy registry."""

import os

import pytest

from engine.cache.policy import policy_names
from engine.loadgen.trace import load_trace
from engine.sim.replay import ReplayConfig, ReplayInput, replay
from engine.sim.sweep import run_sweep, sweep_points

DATA = os.path.join(os.path.dirname(__file__), "data", "conversation_trace_head400.jsonl.gz")


@pytest.fixture(scope="module")
def inp():
    return ReplayInput(load_trace(DATA))


# Every registered policy: sweeps replay page-level, so a policy whose order depended on token
# counts rather than on pages would change the sweep's hit rates, and fail here.
@pytest.mark.parametrize("policy", policy_names(include_offline=True))
@pytest.mark.parametrize("page_size,cap", [(64, 100_000), (48, 300_000)])
def test_page_level_replay_is_the_token_level_replay(inp, policy, page_size, cap):
    cfg = ReplayConfig(page_size=page_size, l1_tokens=cap, policy=policy, events=False)
    tok, _ = replay(inp, cfg)
    page, _ = replay(inp, cfg, page_level=True)
    assert tok.stats["evicted_l1_pages"] > 0             # capacity pressure: evictions matter
    assert (page.hit_tokens, page.input_tokens) == (tok.hit_tokens, tok.input_tokens)
    assert page.stats == tok.stats


def test_page_level_refuses_events(inp):
    with pytest.raises(ValueError, match="no events"):
        replay(inp, ReplayConfig(events=True), page_level=True)


def test_sweep_in_processes_matches_one_process(inp):
    points = sweep_points(["lru", "opt"], [100_000, 400_000])
    seen = []
    many = run_sweep(inp, points, 64, jobs=2, on_point=seen.append)
    one = run_sweep(inp, points, 64, jobs=1)
    assert [(r.policy, r.l1_tokens) for r in many] == [(p.policy, p.l1_tokens) for p in points]
    assert [r.token_hit_rate for r in many] == [r.token_hit_rate for r in one]
    assert sorted(seen, key=lambda r: (r.policy, r.l1_tokens)) == sorted(
        many, key=lambda r: (r.policy, r.l1_tokens))
    direct, _ = replay(inp, ReplayConfig(page_size=64, l1_tokens=100_000, policy="opt"))
    assert many[2].token_hit_rate == pytest.approx(direct.token_hit_rate, abs=1e-6)


def test_every_registered_policy_sweeps(inp):
    names = policy_names(include_offline=True)
    rows = run_sweep(inp, sweep_points(names, [200_000]), 64, limit=100, jobs=1)
    assert [r.policy for r in rows] == names and all(0 <= r.token_hit_rate <= 1 for r in rows)
    with pytest.raises(ValueError, match="unknown eviction policy 'nope'"):
        sweep_points(["lru", "nope"], [200_000])


@pytest.fixture(scope="module")
def reuse_inp(inp):
    """The head-400 trace and then 400 of its requests again, each cut to a random whole
    number of blocks (a seeded draw): prefixes come back at every distance and length, so
    hits depend on the capacity and the policy (the head alone hits little beyond block 0)."""
    import dataclasses
    import random

    recs = inp.trace.records()
    rng = random.Random(31)
    again = []
    for r in rng.choices(recs, k=400):
        n = rng.randint(1, len(r.hash_ids))
        again.append(dataclasses.replace(r, hash_ids=r.hash_ids[:n],
                                         input_length=min(r.input_length, n * 512)))
    return ReplayInput(recs + again)


def _fixed(res) -> dict:
    out = res.to_dict()
    del out["cache_seconds"], out["requests_per_s"]
    return out


# The sweep's lean replay (engine/sim/lean.py) against the full facade on the same pages: every
# count, every stat and every learning policy's own account must be the facade's.
@pytest.mark.parametrize("policy", policy_names(include_offline=True))
@pytest.mark.parametrize("page_size,cap", [(64, 8_000), (64, 60_000), (64, 400_000),
                                           (48, 150_000)])
def test_lean_replay_is_the_facade_replay(reuse_inp, policy, page_size, cap):
    cfg = ReplayConfig(page_size=page_size, l1_tokens=cap, policy=policy, events=False)
    lean, _ = replay(reuse_inp, cfg, page_level=True)
    full, _ = replay(reuse_inp, cfg, page_level=True, facade=True)
    assert full.stats["evicted_l1_pages"] > 0
    assert _fixed(lean) == _fixed(full)


def test_a_lean_point_frees_its_cache_without_the_cycle_collector(reuse_inp):
    """A sweep point runs with the cycle collector off; the lean replay breaks its own cycles
    (node ↔ parent, tier ↔ cache) when done, so none of its nodes outlives the point."""
    import gc

    from engine.cache.radix_tree import Node

    cfg = ReplayConfig(page_size=64, l1_tokens=400_000, policy="density", events=False)
    gc.collect()
    # (nodes other tests' caches still hold, e.g. module fixtures, are not this point's)
    before = {id(o) for o in gc.get_objects() if type(o) is Node}
    was = gc.isenabled()
    gc.disable()
    try:
        res, _ = replay(reuse_inp, cfg, page_level=True)
        alive = sum(type(o) is Node and id(o) not in before for o in gc.get_objects())
    finally:
        if was:
            gc.enable()
    assert res.stats["nodes"] > 10 and alive == 0


def test_lean_request_without_hints_is_the_plain_path(reuse_inp):
    from engine.cache.policy import make_policy
    from engine.sim.lean import LeanReplay

    a, b = LeanReplay(900, make_policy("lfu")), LeanReplay(900, make_policy("lfu"))
    got = [(a.request(t), b.plain(t)) for t in reuse_inp.page_requests(64)]
    assert all(x == y for x, y in got) and sum(x for x, _ in got) > 0
    assert (a.evicted_pages, a.tree.num_nodes) == (b.evicted_pages, b.tree.num_nodes)
    assert a.evicted_pages > 0
