"""The scheduler over the real cache and model: cached == fresh, batching, aborts, errors."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from checkers.invariants import assert_healthy
from engine.cache.facade import CacheConfig, HiCache
from engine.core.errors import InputError
from engine.runtime.model import Model, load_model
from engine.runtime.scheduler import FinishReason, SamplingParams, Scheduler, SchedulerConfig

PS = 16
GREEDY = SamplingParams(max_new_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny")


@pytest.fixture(scope="module")
def tiny_mla():
    return load_model("tiny-mla")


def make(model, l1=4096, l2=16384, host_layout="layer_first", **kw):
    cache = HiCache(CacheConfig(page_size=PS, l1_tokens=l1, l2_tokens=l2,
                                host_layout=host_layout, layout=model.kv_layout(PS)))
    return Scheduler(model, cache, SchedulerConfig(**kw))


def reference(model, prompt, sampling=GREEDY):
    """Greedy output computed from scratch, in one chunk, without any cache."""
    s = make(model, l2=0, disable_radix_cache=True, chunked_prefill_size=8192)
    return s.generate(prompt, sampling)[0]


def toks(n, seed):
    return np.random.default_rng(seed).integers(0, 256, n).tolist()


def evict_l1_to_l2(cache):
    cache.wait_all()                       # write-through backups committed
    cache.evict_l1(cache.l1_alloc.num_pages)
    assert cache.stats()["l1_used_tokens"] == 0


@pytest.mark.parametrize("which,host_layout", [("tiny", "layer_first"), ("tiny", "page_first"),
                                               ("tiny_mla", "page_first")])
def test_cached_prefix_gives_the_same_tokens(request, which, host_layout):
    """A multi-turn conversation: every turn reuses the previous turns' KV from L1 or, after
    a forced eviction, from L2 through a load-back — and decodes exactly what a fresh
    computation decodes."""
    model = request.getfixturevalue(which)
    s = make(model, host_layout=host_layout, chunked_prefill_size=96)
    prompt = toks(150, 1)
    tiers = []
    for turn in range(3):
        out, meta = s.generate(prompt, GREEDY)
        assert out == reference(model, prompt), f"turn {turn} diverged"
        d = meta["cached_tokens_details"]
        tiers.append((d["device"], d["host"]))
        assert meta["cached_tokens"] == d["device"] + d["host"]
        assert_healthy(s.cache, idle=True)
        if turn % 2 == 0:
            evict_l1_to_l2(s.cache)        # next turn: the history comes back from L2
        prompt = prompt + out + toks(40, 10 + turn)
    assert tiers[0] == (0, 0)
    assert tiers[1][0] == 0 and tiers[1][1] >= 160        # all from L2
    assert tiers[2][0] >= 192 and tiers[2][1] == 0        # all from L1
    kinds = set(s.cache.events.kinds())
    assert {"match", "lock", "restore", "restore_done", "insert", "unlock"} <= kinds


def test_prefix_from_l3_storage_gives_the_same_tokens(tiny):
    """A second server with cold L1/L2 and the same store: the prefix comes from L3 (prefetch
    into L2, load-back into L1) and the greedy tokens still match a fresh computation."""
    from engine.cache.l3 import StoreTier
    from engine.storage import L3Store, MemoryStoreConfig
    from engine.storage.backends.memory import MemoryBackend

    backend = MemoryBackend(MemoryStoreConfig())
    first, second = make(tiny, l2=8192), make(tiny, l2=8192)
    for s in (first, second):
        s.cache.attach_l3(StoreTier(L3Store(backend, s.cache.config.layout), s.cache.l2))
    prompt = toks(250, 14)
    out, _ = first.generate(prompt, GREEDY)
    first.cache.wait_all()
    follow = prompt + out + toks(30, 15)
    out2, meta = second.generate(follow, GREEDY)
    d = meta["cached_tokens_details"]
    assert d["storage"] >= 240 and d["device"] == 0 and d["host"] == 0
    assert out2 == reference(tiny, follow)
    second.cache.wait_all()                # L3 write-through jobs pin their nodes until done
    assert_healthy(second.cache, idle=True)


def test_partial_l1_partial_l2_hit(tiny):
    """A prompt whose prefix is half in L1 (shared system prompt) and half in L2."""
    s = make(tiny, l1=1024, l2=8192, chunked_prefill_size=64)
    system = toks(128, 2)
    a = system + toks(300, 3)
    s.generate(a, GREEDY)
    evict_l1_to_l2(s.cache)
    s.generate(system + toks(100, 4), GREEDY)     # system prompt back in L1 (load-back)
    out, meta = s.generate(a + toks(20, 5), GREEDY)
    d = meta["cached_tokens_details"]
    assert d["device"] >= 128 and d["host"] >= 160
    assert out == reference(tiny, a + toks(20, 5))


def test_request_waiting_for_room_loads_back_once(tiny):
    """While a big request holds most of L1, a request whose prefix is in L2 waits without
    starting a load-back; once admitted it loads its prefix from L2 exactly once."""
    s = make(tiny, l1=400, l2=4096)       # 25 pages: "big" takes 15, the load-back 9 of 10
    p = toks(150, 16)
    s.generate(p, SamplingParams(max_new_tokens=1))
    evict_l1_to_l2(s.cache)
    outs, metas = {}, {}

    def cb_for(k):
        def cb(o):
            outs.setdefault(k, []).extend(o.new_token_ids)
            if o.finished:
                metas[k] = o.meta
        return cb

    s.submit(toks(200, 17), SamplingParams(max_new_tokens=40, ignore_eos=True), cb_for("big"))
    s.submit(p + toks(20, 18), GREEDY, cb_for("b"))
    s.run_until_idle()
    assert metas["b"]["queue_time"] > metas["big"]["queue_time"]
    assert metas["b"]["cached_tokens_details"] == {"device": 0, "host": 144, "storage": 0}
    assert s.cache.stats()["loadback_ops"] == 1
    assert outs["b"] == reference(tiny, p + toks(20, 18))


def test_concurrent_requests_match_sequential(tiny):
    """Continuous batching (mixed prefill chunks and decodes) changes no token."""
    s = make(tiny, l1=2048, l2=8192, chunked_prefill_size=80, max_running_requests=5)
    shared = toks(96, 6)
    prompts = [shared + toks(20 + 13 * i, 20 + i) for i in range(8)] + [toks(70, 30)]
    results: dict[int, list[int]] = {}
    finished = []

    def cb_for(i):
        def cb(o):
            results.setdefault(i, []).extend(o.new_token_ids)
            if o.finished:
                finished.append((i, o.finish_reason, o.meta))
        return cb

    for i, p in enumerate(prompts):
        s.submit(p, GREEDY, cb_for(i))
    s.run_until_idle()
    assert len(finished) == len(prompts)
    assert all(r is FinishReason.LENGTH for _, r, _ in finished)
    for i, p in enumerate(prompts):
        assert results[i] == reference(tiny, p), f"request {i} diverged"
    assert max(m["queue_time"] for _, _, m in finished) > 0
    assert_healthy(s.cache, idle=True)


def test_load_back_gates_each_layer(tiny):
    """With the copy engine paused, a request whose prefix is in L2 waits inside the forward
    (layer 0's wait hook); it completes, correctly, once the copies run."""
    s = make(tiny, chunked_prefill_size=512)
    prompt = toks(200, 7)
    s.generate(prompt, GREEDY)
    evict_l1_to_l2(s.cache)
    s.cache.transfers.pause()
    s.start()
    got, done = [], threading.Event()

    def cb(o):
        got.extend(o.new_token_ids)
        if o.finished:
            done.set()

    try:
        s.submit(prompt + [1, 2, 3], GREEDY, cb)
        time.sleep(0.3)
        assert not got and s.num_running() == 1   # admitted, blocked on the load-back
    finally:
        s.cache.transfers.resume()
    assert done.wait(30)
    s.stop()
    assert got == reference(tiny, prompt + [1, 2, 3])
    assert s.cache.stats()["loadback_pages"] >= 12


def test_abort_releases_pages_and_locks(tiny):
    s = make(tiny, l1=2048, max_running_requests=1)
    s.start()
    events = {"a": [], "b": []}
    ready = threading.Event()
    done = {k: threading.Event() for k in events}

    def cb_for(k):
        def cb(o):
            events[k].append(o)
            if len(events[k]) == 2:
                ready.set()
            if o.finished:
                done[k].set()
        return cb

    before = s.cache.stats()
    s.submit(toks(300, 8), SamplingParams(max_new_tokens=500, ignore_eos=True), cb_for("a"),
             rid="a")
    s.submit(toks(50, 9), GREEDY, cb_for("b"), rid="b")      # waits: one running at a time
    assert ready.wait(30)
    s.abort("b")
    s.abort("a")
    assert done["a"].wait(30) and done["b"].wait(30)
    assert events["a"][-1].finish_reason is FinishReason.ABORT
    assert events["b"][-1].finish_reason is FinishReason.ABORT and len(events["b"]) == 1
    s.call(lambda: None).result(10)          # a step boundary after the aborts
    after = s.call(s.cache.stats).result(10)
    assert after["l1_used_tokens"] == before["l1_used_tokens"] == 0
    assert after["l1_locked_tokens"] == 0
    s.call(lambda: assert_healthy(s.cache, idle=True)).result(10)
    s.stop()


def test_zero_new_tokens_stop_ids_and_eos(tiny):
    s = make(tiny)
    p = toks(100, 11)
    out, meta = s.generate(p, SamplingParams(max_new_tokens=0))
    assert out == [] and meta["completion_tokens"] == 0 and meta["finish_reason"] == "length"
    _, meta = s.generate(p, SamplingParams(max_new_tokens=2))
    assert meta["cached_tokens"] == 96                     # the prompt was inserted
    first = reference(tiny, p)[0]
    out, meta = s.generate(p, SamplingParams(max_new_tokens=20, stop_token_ids=(first,)))
    assert out == [first] and meta["finish_reason"] == "stop"


def test_sampling_is_seeded(tiny):
    s = make(tiny)
    sp = SamplingParams(max_new_tokens=16, temperature=1.0, top_p=0.9, top_k=50, seed=3,
                        ignore_eos=True)
    a, _ = s.generate(toks(40, 12), sp)
    b, _ = s.generate(toks(40, 12), sp)
    c, _ = s.generate(toks(40, 12), SamplingParams(max_new_tokens=16, temperature=1.0, seed=4,
                                                   ignore_eos=True))
    assert a == b and a != c
    assert all(t < 256 or t == 257 for t in a + c)          # never BOS/PAD/SEP


@pytest.mark.parametrize("ids,sp,msg", [
    ([], GREEDY, "empty"),
    ([5, 260], GREEDY, "outside the vocabulary"),
    ([-1], GREEDY, "outside the vocabulary"),
    ([1] * 16380, SamplingParams(max_new_tokens=10), "context"),
    ([1] * 5000, GREEDY, "L1 holds"),
])
def test_validation(tiny, ids, sp, msg):
    s = make(tiny)
    with pytest.raises(InputError, match=msg):
        s.submit(ids, sp)
    with pytest.raises(InputError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=-1)


class _FailingOnce(Model):
    """Fault injection: the first forward raises (a kernel failure)."""

    def __init__(self, base: Model):
        self.__dict__.update(base.__dict__)
        self.failed = False

    def forward(self, *a, **kw):
        if not self.failed:
            self.failed = True
            raise RuntimeError("injected kernel failure")
        return super().forward(*a, **kw)


def test_forward_error_fails_the_batch_and_keeps_serving(tiny, caplog):
    s = make(_FailingOnce(tiny))
    s.start()
    try:
        with pytest.raises(RuntimeError, match="injected kernel failure"):
            s.generate(toks(60, 13), GREEDY)
        assert "forward failed" in caplog.text and "injected" in (s.last_error or "")
        out, _ = s.generate(toks(60, 13), GREEDY)            # the scheduler still serves
        assert out == reference(tiny, toks(60, 13))
        s.call(lambda: assert_healthy(s.cache, idle=True)).result(10)
    finally:
        s.stop()


def test_a_failing_sample_fails_only_its_own_request(tiny):
    """Fault injection at the sampler: the broken request ends with an error, its batch mates
    finish normally, and every page comes back."""
    s = make(tiny, l1=2048, l2=0)
    real = s._sample

    def sample(logits, r):
        if r.rid == "bad":
            raise RuntimeError("injected")
        return real(logits, r)

    s._sample = sample
    done = {}

    def cb_for(k):
        def cb(o):
            if o.finished:
                done[k] = o
        return cb

    good_prompt = toks(60, 40)
    s.submit(good_prompt, GREEDY, cb_for("good"), rid="good")
    s.submit(toks(60, 41), GREEDY, cb_for("bad"), rid="bad")
    s.run_until_idle()
    assert done["bad"].finish_reason is FinishReason.ERROR and "injected" in done["bad"].error
    assert done["good"].finish_reason is FinishReason.LENGTH
    s._sample = real
    assert s.generate(good_prompt, GREEDY)[0] == reference(tiny, good_prompt)
    s.cache.flush()
    assert s.cache.l1_alloc.used_pages == 0
    assert_healthy(s.cache, idle=True)
