"""The model, scheduler and server on CUDA (fused attention, copy stream, per-layer waits)."""

from __future__ import annotations

import numpy as np
import pytest
import requests
import torch

from checkers.invariants import assert_healthy
from engine.cache.facade import CacheConfig, HiCache
from engine.runtime.launch import ServerConfig, start_server
from engine.runtime.model import Chunk, load_model

pytestmark = pytest.mark.gpu
PS = 16


@pytest.mark.parametrize("name,host_layout", [("tiny", "page_first"), ("small", "layer_first"),
                                              ("small-mla", "page_first")])
def test_prefix_loaded_back_on_cuda_gives_the_same_logits(name, host_layout):
    model = load_model(name, "cuda")
    assert not model.exact                                   # fused SDPA on CUDA
    cache = HiCache(CacheConfig(page_size=PS, l1_tokens=4096, l2_tokens=8192,
                                host_layout=host_layout, device="cuda",
                                layout=model.kv_layout(PS)))
    toks = np.random.default_rng(0).integers(0, 256, 600)
    # fresh: the whole prompt in one chunk
    pages = cache.alloc(-(-600 // PS))
    fresh = model.forward([Chunk(toks, 0, pages)], cache.l1.buf, PS)
    cache.free(pages)
    # prefix computed, inserted, backed up, evicted from L1, loaded back with per-layer waits
    pages = cache.alloc(512 // PS)
    model.forward([Chunk(toks[:512], 0, pages, logits=False)], cache.l1.buf, PS)
    cache.insert(toks[:512], pages)
    cache.wait_all()
    cache.evict_l1(cache.l1_alloc.num_pages)
    m = cache.match(toks[:599])
    receipt = cache.lock(m)
    handle = cache.load_back(m)
    assert m.loaded_len == 512
    rest = cache.alloc(-(-600 // PS) - 512 // PS)
    table = np.concatenate([m.l1_pages, rest])
    cached = model.forward([Chunk(toks[512:], 512, table)], cache.l1.buf, PS,
                           layer_hooks=[handle.wait_layer])
    torch.testing.assert_close(cached, fresh, rtol=2e-2, atol=2e-2)
    cache.free(rest)
    cache.unlock(receipt)
    cache.wait_all()
    assert_healthy(cache, idle=True)


def test_server_on_cuda_reports_cached_tokens():
    with start_server(ServerConfig(port=0, device="cuda", model="small", l1_tokens=8192)) as h:
        body = {"input_ids": [256] + list(range(200)),
                "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}}
        a = requests.post(h.url + "/generate", json=body, timeout=120).json()
        b = requests.post(h.url + "/generate", json=body, timeout=120).json()
        assert a["meta_info"]["completion_tokens"] == 8
        assert b["meta_info"]["cached_tokens_details"]["device"] >= 192
        info = requests.get(h.url + "/get_server_info", timeout=30).json()
        assert info["device"].startswith("cuda") and not info["exact_kernels"]


def test_no_logits_wanted_still_answers_on_the_model_device():
    """A micro-batch with no logits wanted (a pipeline's last stage concatenates them with
    other micro-batches' logits) gets an empty tensor on the model's device, not the host."""
    model = load_model("tiny", "cuda")
    cache = HiCache(CacheConfig(page_size=PS, l1_tokens=1024, device="cuda",
                                layout=model.kv_layout(PS)))
    pages = cache.alloc(2)
    none = model.forward([Chunk(list(range(20)), 0, pages, logits=False)], cache.l1.buf, PS)
    empty = model.forward([], cache.l1.buf, PS)
    some = model.forward([Chunk([5], 20, pages)], cache.l1.buf, PS)
    assert none.shape == empty.shape == (0, model.cfg.vocab_size)
    assert none.is_cuda and empty.is_cuda
    assert torch.cat([none, some]).shape == (1, model.cfg.vocab_size)
