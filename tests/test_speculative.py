"""Speculative decoding with the draft's KV in the cache stack (docs/speculative.md).

Greedy outputs with speculation equal outputs without it, in both draft layouts, for fresh
prompts, prefixes still in L1, restored from L2 and fetched from L3; acceptance after a restore
stays within 5% of acceptance with the prefix in L1 — and a planted bug that restores only the
target's KV is caught by exactly that check.
"""

from __future__ import annotations

import numpy as np
import pytest
import requests

from checkers.invariants import check_cache
from engine.cache.facade import HiCache
from engine.cache.types import CacheConfig
from engine.runtime.launch import ServerConfig, start_server
from engine.runtime.model import load_model
from engine.runtime.model.draft import make_draft
from engine.runtime.scheduler import SamplingParams, Scheduler
from engine.runtime.scheduler.spec import SpecConfig, cache_layout, sidecar_layout

P = 16
GREEDY = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def models():
    target = load_model("tiny")
    return target, make_draft(target)


def prompts(n: int, length: int = 120, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, length).tolist() for _ in range(n)]


def scheduler(models, layout: str | None, *, skip_restore: bool = False,
              l1_tokens: int = 4096) -> Scheduler:
    target, draft = models
    if layout is None:
        cache = HiCache(CacheConfig(page_size=P, l1_tokens=l1_tokens, l2_tokens=8192,
                                    layout=target.kv_layout(P)))
        return Scheduler(target, cache)
    spec = SpecConfig(num_draft_tokens=4, draft_layout=layout, debug_skip_draft_restore=skip_restore)
    side = sidecar_layout(target, P, draft) if layout == "sidecar" else None
    cache = HiCache(CacheConfig(page_size=P, l1_tokens=l1_tokens, l2_tokens=8192,
                                layout=cache_layout(target, P, draft, spec), sidecar=side))
    return Scheduler(target, cache, draft=draft, spec=spec)


def to_l2(s: Scheduler) -> None:
    """Evict every unlocked L1 page (backed up by write-through): prefixes are L2-only now."""
    s.cache.wait_all()
    s.cache.poll()
    s.cache.evict_l1(s.cache.config.l1_pages)


@pytest.fixture(scope="module")
def reference(models):
    s = scheduler(models, None)
    s.start()
    try:
        return [s.generate(p, GREEDY)[0] for p in prompts(2)]
    finally:
        s.stop()


@pytest.mark.parametrize("layout", ["packed", "sidecar"])
def test_outputs_equal_without_speculation_fresh_l1_and_l2(models, reference, layout):
    s = scheduler(models, layout)
    s.start()
    try:
        for tier in ("fresh", "l1", "l2"):
            if tier == "l2":
                s.call(lambda: to_l2(s)).result(30)
            outs = [s.generate(p, GREEDY) for p in prompts(2)]
            assert [o[0] for o in outs] == reference, tier
            details = outs[0][1]["cached_tokens_details"]
            if tier == "l1":
                assert details["device"] > 0
            if tier == "l2":
                assert details["host"] > 0 and details["device"] == 0
            assert outs[0][1]["spec_verify_steps"] > 0
        assert s.spec.stats()["accept_rate"] >= 0.5
        assert not check_cache(s.cache)
    finally:
        s.stop()


def acceptance_l1_vs_restored(models, layout: str, skip_restore: bool) -> tuple[float, float]:
    s = scheduler(models, layout, skip_restore=skip_restore)
    s.start()
    try:
        ps = prompts(3, length=160, seed=5)
        for p in ps:
            s.generate(p, GREEDY)                   # computed: the prefix is cached
        in_l1 = [s.generate(p, GREEDY)[1]["spec_accept_rate"] for p in ps]
        s.call(lambda: to_l2(s)).result(30)
        restored = [s.generate(p, GREEDY)[1] for p in ps]
        assert all(m["cached_tokens_details"]["host"] > 0 for m in restored)
        return float(np.mean(in_l1)), float(np.mean([m["spec_accept_rate"] for m in restored]))
    finally:
        s.stop()


@pytest.mark.parametrize("layout", ["packed", "sidecar"])
def test_acceptance_after_a_restore_matches_l1(models, layout):
    in_l1, restored = acceptance_l1_vs_restored(models, layout, skip_restore=False)
    assert in_l1 >= 0.5
    assert restored >= in_l1 - 0.05, (in_l1, restored)


def test_a_restore_without_the_draft_state_is_caught(models):
    in_l1, restored = acceptance_l1_vs_restored(models, "packed", skip_restore=True)
    assert restored < in_l1 - 0.05, (in_l1, restored)   # the check above would fail


def test_sidecar_restore_maps_the_same_slots_for_target_and_draft(models):
    s = scheduler(models, "sidecar")
    c = s.cache
    target, draft = models
    toks = np.asarray(prompts(1, length=3 * P)[0], dtype=np.uint32)
    a = c.admit(toks, rid="w", extra_pages=0)
    for layer in range(c.num_layers):              # distinct bytes per layer and page
        pool, li = c.l1._pool(layer)
        slots = c.l1.slots(a.pages)
        pool.buf[li, :, slots] = layer + 1.0
    c.insert(toks, a.pages, after=a.receipt)
    c.unlock(a.receipt)
    to_l2(s)
    b = c.admit(toks, rid="r")
    assert b.host_len == 3 * P and b.load is not None
    b.load.wait()
    slots = c.l1.slots(b.pages)
    for layer in range(c.num_layers):
        pool, li = c.l1._pool(layer)
        assert bool((pool.buf[li, :, slots] == layer + 1.0).all()), layer
    c.unlock(b.receipt)
    c.close()


def test_a_failed_restore_rolls_back_target_and_draft_together(models):
    s = scheduler(models, "sidecar")
    c = s.cache
    toks = np.asarray(prompts(1, length=2 * P)[0], dtype=np.uint32)
    a = c.admit(toks, rid="w")
    c.insert(toks, a.pages, after=a.receipt)
    c.unlock(a.receipt)
    to_l2(s)

    def broken(layer, pages, data):
        raise OSError("device copy failed")
    c.l1.sidecar.set_layer = broken                 # the draft's half of the copy fails
    b = c.admit(toks, rid="r")
    with pytest.raises(RuntimeError, match="failed"):
        b.load.wait()
    c.unlock(b.receipt)
    c.poll()
    m = c.match(toks)
    assert m.l1_len == 0 and m.l2_len == 2 * P   # neither half counts as restored
    assert not check_cache(c)
    c.close()


@pytest.mark.parametrize("layout", ["packed", "sidecar"])
def test_server_reports_speculation_and_l3_restores_the_draft(tmp_path, layout):
    body = {"input_ids": prompts(1, length=100)[0],
            "sampling_params": {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}}
    common = dict(port=0, l1_tokens=1024, l2_tokens=2048, hicache_storage_backend="file",
                  hicache_storage_dir=str(tmp_path / "l3"), hicache_storage_prefetch_policy=
                  "wait_complete")
    plain = start_server(ServerConfig(**common | {"hicache_storage_dir": str(tmp_path / "p")}))
    try:
        want = requests.post(plain.url + "/generate", json=body, timeout=60).json()["output_ids"]
    finally:
        plain.stop()
    metas = []
    for _ in range(2):           # the second server starts cold: the prefix comes from L3
        h = start_server(ServerConfig(**common, speculative_num_draft_tokens=4,
                                      hicache_draft_layout=layout))
        try:
            out = requests.post(h.url + "/generate", json=body, timeout=60).json()
            assert out["output_ids"] == want
            metas.append(out["meta_info"])
            text = requests.get(h.url + "/metrics", timeout=10).text
            assert "hicache_spec_accepted_tokens_total" in text
            info = requests.get(h.url + "/server_info", timeout=10).json()
            assert info["speculative"]["kv_bytes_per_token"]["draft"] > 0
        finally:
            h.stop()
    names = [p.name for p in (tmp_path / "l3").rglob("*") if p.is_file()]
    assert any(".l4-8." in n for n in names) and any(".l0-4." in n for n in names), names[:4]
    assert metas[1]["cached_tokens_details"]["storage"] > 0
    assert metas[1]["spec_accept_rate"] >= metas[0]["spec_accept_rate"] - 0.05


def test_bad_speculative_options_are_usage_errors():
    with pytest.raises(ValueError, match="draft preset"):
        ServerConfig(speculative_num_draft_tokens=2, speculative_draft_preset="nope")
    with pytest.raises(ValueError, match="cannot be combined"):
        ServerConfig(speculative_num_draft_tokens=2, hicache_draft_layout="sidecar",
                     hicache_storage_backend="file", hicache_storage_grid="layers=2")
    with pytest.raises(ValueError, match="0..16"):
        ServerConfig(speculative_num_draft_tokens=99)


def test_bench_run_reports_tokens_per_target_step():
    from engine.loadgen import LoadConfig, multiturn, run_load, summarize_result

    h = start_server(ServerConfig(port=0, l1_tokens=2048, l2_tokens=4096,
                                  speculative_num_draft_tokens=4))
    try:
        wl = multiturn(num_clients=2, num_rounds=2, request_length=48, output_length=12,
                       vocab_size=256, seed=0)
        rep = summarize_result(run_load(wl, LoadConfig(url=h.url, concurrency=2)))
    finally:
        h.stop()
    assert rep["requests"]["ok"] == 4
    assert rep["tokens_per_target_step"] > 1.5         # the draft's tokens were accepted
