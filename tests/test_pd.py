"""P/D disaggregation over a real link (two processes, gloo): the decode worker reuses its own
L1 and L2, only the missing pages cross the link, and greedy output equals the plain engine's."""

from __future__ import annotations

import numpy as np
import pytest

from checkers.invariants import assert_healthy
from engine.runtime.model import load_model
from engine.runtime.pd.serve import PDEngine
from engine.runtime.scheduler import SamplingParams, Scheduler, SchedulerConfig
from engine.runtime.serving import ServerConfig

PS = 16
GREEDY = SamplingParams(max_new_tokens=8, ignore_eos=True)


def toks(n, seed):
    return np.random.default_rng(seed).integers(0, 256, n).tolist()


def reference(prompt, sampling=GREEDY):
    """The non-disaggregated output: one plain scheduler, no cache reuse, one chunk."""
    from engine.cache.facade import CacheConfig, HiCache

    model = load_model("tiny")
    cache = HiCache(CacheConfig(page_size=PS, l1_tokens=4096, l2_tokens=0,
                                layout=model.kv_layout(PS)))
    s = Scheduler(model, cache, SchedulerConfig(disable_radix_cache=True,
                                                chunked_prefill_size=8192))
    return s.generate(prompt, sampling)[0]


def pd_config(**kw):
    base = dict(model="tiny", port=0, page_size=PS, l1_tokens=4096, l2_tokens=8192,
                chunked_prefill_size=128, disaggregation="pd", pd_transfer_timeout=60.0)
    base.update(kw)
    return ServerConfig(**base)


@pytest.fixture(scope="module")
def pd():
    eng = PDEngine(pd_config())
    yield eng
    eng.stop()


def local(eng, prompt, n=1):
    """Run ``prompt`` on the decode worker alone (its scheduler without the link)."""
    remote, eng.scheduler.remote = eng.scheduler.remote, None
    try:
        return eng.scheduler.generate(prompt, SamplingParams(max_new_tokens=n, ignore_eos=True))
    finally:
        eng.scheduler.remote = remote


def test_only_the_missing_third_crosses_the_link(pd):
    """The design note's 12K example scaled down: A on the decode L1, B only in its L2, C
    nowhere: exactly C's pages are sent; the output equals the non-disaggregated one."""
    a, b, c = toks(256, 1), toks(256, 2), toks(256, 3)
    cache = pd.cache
    local(pd, a)                       # A: on L1 (and written through to L2)
    local(pd, a + b)                   # B: a child node of A
    cache.wait_all()
    cache.evict_l1(256 // PS)          # the leaf B leaves L1; it stays in L2
    m = cache.match(np.asarray(a + b, dtype=np.int64))
    assert (m.l1_len, m.l2_len) == (256, 256)
    out, meta = pd.scheduler.generate(a + b + c, GREEDY)
    t = meta["pd_transfer"]
    # The last prompt token is computed on the decode side (its logits give the first output).
    assert (t["decode_device"], t["decode_host"], t["decode_storage"]) == (256, 256, 0)
    assert t["transferred"] == 255
    assert t["bytes"] == (256 // PS) * cache.l1.layout.page_bytes
    assert t["redundant_bytes"] == 0
    assert out == reference(a + b + c)
    assert_healthy(cache, idle=True)


def test_second_turn_sends_only_the_new_pages(pd):
    first = toks(300, 7)
    out1, meta1 = pd.scheduler.generate(first, GREEDY)
    assert meta1["pd_transfer"]["transferred"] == 299
    second = first + out1 + toks(100, 8)
    out2, meta2 = pd.scheduler.generate(second, GREEDY)
    t = meta2["pd_transfer"]
    reused = t["decode_device"] + t["decode_host"] + t["decode_storage"]
    assert reused == (len(first) + len(out1) - 1) // PS * PS
    assert t["transferred"] == len(second) - 1 - reused
    assert t["bytes"] == -(-t["transferred"] // PS) * pd.cache.l1.layout.page_bytes
    assert out2 == reference(second)
    assert pd.pd.totals["redundant_bytes"] == 0
    assert_healthy(pd.cache, idle=True)


def test_prefill_reuses_a_partial_page_and_decode_asks_page_aligned(pd):
    """Partial last-page reuse: the prefill worker copies the start of a cached page of its own
    (5 tokens here) and sends that page whole; the decode worker never copies (it asks for the
    KV from its own page-aligned prefix on). The output equals the non-disaggregated one."""
    a, b, c = toks(32, 31), toks(40, 32), toks(30, 33)
    c[0] = (b[5] + 1) % 256                       # diverges from a + b right after b[:5]
    pd.scheduler.generate(a + b, GREEDY)           # the prefill worker caches a + b[:32]
    prompt = a + b[:5] + c
    out, meta = pd.scheduler.generate(prompt, GREEDY)
    t = meta["pd_transfer"]
    assert (t["decode_device"], t["decode_host"], t["decode_storage"]) == (32, 0, 0)
    assert t["prefill_cached"] == 37
    assert t["transferred"] == len(prompt) - 1 - 32
    assert meta["cached_tokens"] == 32
    assert out == reference(prompt)
    assert pd.cache.stats()["hit_l1_partial_tokens"] == 0
    assert_healthy(pd.cache, idle=True)


def test_decode_restores_from_its_own_storage_before_asking(tmp_path):
    """Decode's third tier: a prefix only in the decode worker's L3 store is fetched from there
    (``decode_storage``); only the new turn crosses the link."""
    eng = PDEngine(pd_config(hicache_storage_backend="file", hicache_storage_dir=str(tmp_path),
                             hicache_storage_prefetch_policy="wait_complete"))
    try:
        first = toks(320, 51)
        local(eng, first)
        eng.cache.flush()                  # L1 and L2 dropped; the pages stay in the store
        assert eng.cache.stats()["l2_used_tokens"] == 0
        prompt = first + toks(64, 52)
        out, meta = eng.scheduler.generate(prompt, GREEDY)
        t = meta["pd_transfer"]
        assert (t["decode_device"], t["decode_host"], t["decode_storage"]) == (0, 0, 320)
        assert t["transferred"] == len(prompt) - 1 - 320
        assert t["redundant_bytes"] == 0
        assert out == reference(prompt)
        eng.cache.wait_all()
        assert_healthy(eng.cache, idle=True)
    finally:
        eng.stop()
