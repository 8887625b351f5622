"""Trace replay: token mapping, known hit rates on a committed slice of a real trace.

tests/data/conversation_trace_head400.jsonl.gz = the first 400 lines of Mooncake's FAST'25
conversation_trace.jsonl (github.com/kvcache-ai/Mooncake, FAST25-release/traces, Apache-2.0).
"""

import os

import numpy as np
import pytest

from engine.loadgen.trace import read_trace
from engine.sim.replay import ReplayConfig, replay, trace_tokens

DATA = os.path.join(os.path.dirname(__file__), "data", "conversation_trace_head400.jsonl.gz")


@pytest.fixture(scope="module")
def records():
    return read_trace(DATA)


def test_token_mapping():
    t = trace_tokens([3, 7], 600)
    assert len(t) == 600 and t.dtype == np.uint32
    assert t[0] == 3 * 512 and t[511] == 3 * 512 + 511 and t[512] == 7 * 512
    assert t[-1] == 7 * 512 + 87


# SGLang 0.5.23's RadixCache on the same slice (the peer replay that
# benchmarks/bench_replay_vs_sglang.py runs) printed 0.0358 at 200K tokens and 0.0366 at 1M tokens (page 64, LRU).
@pytest.mark.parametrize("cap,want", [(200_000, 0.035774), (1_000_000, 0.036592)])
def test_known_hit_rates(records, cap, want):
    res, _ = replay(records, ReplayConfig(page_size=64, l1_tokens=cap))
    assert res.requests == 400
    assert res.to_dict()["token_hit_rate"] == pytest.approx(want, abs=1e-6)


def test_l2_and_l3_add_hits(records):
    base, _ = replay(records, ReplayConfig(l1_tokens=200_000))
    l2, _ = replay(records, ReplayConfig(l1_tokens=200_000, l2_tokens=1_000_000))
    l3, _ = replay(records, ReplayConfig(l1_tokens=200_000, l2_tokens=400_000, l3_tokens=-1))
    assert l2.l1_hit_tokens + l2.l2_hit_tokens > base.hit_tokens
    assert l2.l2_hit_tokens > 0
    assert l3.l3_hit_tokens > 0 and l3.token_hit_rate >= l2.token_hit_rate - 1e-9


def test_opt_bounds_lru_and_lfu(records):
    rates = {}
    for pol in ("lru", "lfu", "opt"):
        res, _ = replay(records, ReplayConfig(l1_tokens=300_000, policy=pol))
        rates[pol] = res.token_hit_rate
    assert rates["opt"] >= rates["lru"] and rates["opt"] >= rates["lfu"]


def test_limit_and_events(records):
    res, cache = replay(records, ReplayConfig(limit=50, l1_tokens=100_000), keep_cache=True)
    assert res.requests == 50
    assert res.events > 50
    from checkers.invariants import assert_healthy
    assert_healthy(cache, idle=True)
