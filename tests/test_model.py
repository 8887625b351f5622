"""The model: batch-invariant forward over the paged pool, MLA, checkpoints, tokenizer."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from engine.cache.pool import DevicePool
from engine.core.errors import InputError
from engine.runtime.model import Chunk, load_model, preset, random_weights, save_hf
from engine.runtime.model.config import from_hf_config
from engine.runtime.tokenizer import ByteTokenizer

PS = 16


def _bf16_or_skip():
    from engine.runtime.model import native_gemm

    if not native_gemm.bf16_available():   # (the refusal itself: test_gemm_dtype_refusals)
        pytest.skip(f"bf16 products: {native_gemm._state.get('bf16_what')}")


@pytest.fixture(scope="module", params=["tiny", "tiny-mla", "tiny+bf16"])
def model(request):
    # the exact (batch-invariant) kernels these tests check bit for bit are the CPU path;
    # CUDA's fused attention agrees at the token level (tests/test_model_gpu.py). tiny+bf16:
    # the same path with its weight products in bfloat16 (--gemm-dtype bfloat16)
    if request.param.endswith("+bf16"):
        _bf16_or_skip()
        return load_model(request.param[:-5], "cpu", gemm_dtype="bfloat16")
    return load_model(request.param, "cpu")


@pytest.fixture(params=["default", 1, 2, 3, 4, 8, 16, 32])
def threads(request):
    """The bitwise checks run with torch's own thread count and with 1 to 32 threads: CPU GEMM
    libraries split a product between threads by its shape, the split changes the summation
    order (on a Xeon with AVX-512 and AMX, 16 threads split small products along the reduction
    dimension), so a row's bits may follow the batch or the thread count unless the code fixes
    the order (engine.runtime.model.exact)."""
    before = torch.get_num_threads()
    if request.param != "default":
        torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def _pool(model, pages=160):
    return DevicePool(model.kv_layout(PS), pages)


def _prompt(n, seed=0):
    return np.random.default_rng(seed).integers(0, 256, n)


def _run_chunks(model, pool, toks, sizes):
    pages = pool.allocator.alloc(-(-len(toks) // PS))
    s, logits = 0, None
    for n in sizes:
        logits = model.forward([Chunk(toks[s:s + n], s, pages)], pool.buf, PS)
        s += n
    assert s == len(toks)
    return pages, logits


def test_kv_layout_gqa_and_mla():
    gqa = preset("tiny").kv_layout(PS)
    assert (gqa.kv_kinds, gqa.kv_heads, gqa.head_dim, gqa.num_layers) == (2, 2, 64, 4)
    mla = preset("tiny-mla").kv_layout(PS)
    # one latent vector per token: 128 latent + 32 rope dims, one "head", one kind
    assert (mla.kv_kinds, mla.kv_heads, mla.head_dim) == (1, 1, 160)
    assert mla.token_bytes_per_layer < gqa.token_bytes_per_layer


def test_chunking_does_not_change_a_bit(model, threads):
    """KV and logits are bitwise identical however the prompt is split into chunks."""
    toks = _prompt(500)
    pool = _pool(model)
    pa, la = _run_chunks(model, pool, toks, [500])
    pb, lb = _run_chunks(model, pool, toks, [37, 200, 1, 3, 259])
    pc, lc = _run_chunks(model, pool, toks, [1] * 10 + [490])
    assert torch.equal(la, lb) and torch.equal(la, lc)
    for layer in range(model.cfg.num_layers):
        ka = pool.get_layer(layer, pa)[:, :500]
        assert torch.equal(ka, pool.get_layer(layer, pb)[:, :500])
        assert torch.equal(ka, pool.get_layer(layer, pc)[:, :500])


def test_batch_mates_do_not_change_a_bit(model, threads):
    """A request's logits do not depend on what else is in the batch (continuous batching)."""
    pool = _pool(model)
    toks, other = _prompt(300, 1), _prompt(120, 2)
    _, alone = _run_chunks(model, pool, toks, [300])
    pt = pool.allocator.alloc(-(-300 // PS))
    po = pool.allocator.alloc(-(-121 // PS))
    model.forward([Chunk(other[:119], 0, po)], pool.buf, PS)
    s = 0
    for n in (200, 100):
        out = model.forward([Chunk(other[119:120], 119, po), Chunk(toks[s:s + n], s, pt)],
                            pool.buf, PS)
        s += n
    assert out.shape == (2, model.cfg.vocab_size)
    assert torch.equal(out[1], alone[0])


@pytest.mark.parametrize("rows", [1, 5, 16, 17, 19, 25, 27, 40, 101])
def test_bf16_products_give_each_row_the_same_bits_at_any_row_count(threads, rows):
    from engine.runtime.model import native_gemm

    _bf16_or_skip()
    g = torch.Generator().manual_seed(rows)
    w, x = torch.randn(515, 257, generator=g), torch.randn(128, 257, generator=g)
    whole = native_gemm.linear_bf16(x, w)
    assert torch.equal(native_gemm.linear_bf16(x[:rows], w), whole[:rows])
    assert torch.equal(native_gemm.linear_bf16(x[rows:], w, threads=1), whole[rows:])
    ref = x.bfloat16().double() @ w.bfloat16().double().t()     # the rounded operands' product
    assert torch.allclose(whole.double(), ref, rtol=1e-4, atol=1e-3)
    # against float32: within bf16's rounding of the operands (~2^-8 relative each)
    full = x.double() @ w.double().t()
    assert (whole.double() - full).abs().max() < 0.02 * full.abs().max()


def test_gemm_dtype_model_is_its_own_and_close_to_float32():
    """A bf16-product model: its own tensors (a float32 model of the same weights keeps
    float32 products), logits close to float32's, the same greedy token, another store tag."""
    import dataclasses

    from engine.runtime.model import Model
    from engine.runtime.model.fingerprint import arch_identity

    _bf16_or_skip()
    f32 = load_model("tiny", "cpu")
    bf = Model(dataclasses.replace(f32.cfg, gemm_dtype="bfloat16"), f32.w)
    assert not hasattr(f32.w.layers[0].wo, "_hicache_gemm")
    assert bf.w.layers[0].wo.data_ptr() == f32.w.layers[0].wo.data_ptr()   # no copy
    toks = _prompt(200, 3)
    _, a = _run_chunks(f32, _pool(f32), toks, [200])
    _, b = _run_chunks(bf, _pool(bf), toks, [200])
    _, a2 = _run_chunks(f32, _pool(f32), toks, [200])
    assert torch.equal(a, a2) and not torch.equal(a, b)
    assert (a - b).abs().max() < 0.05 * a.abs().max()
    assert int(a.argmax()) == int(b.argmax())
    assert arch_identity(bf.cfg) != arch_identity(f32.cfg)
    assert "gemm_dtype" not in arch_identity(f32.cfg)       # float32 tags as before


def test_gemm_dtype_refusals(monkeypatch):
    from engine.runtime.launch import ServerConfig
    from engine.runtime.model import native_gemm

    with pytest.raises(ValueError, match="gemm dtype must be one of"):
        load_model("tiny", "cpu", gemm_dtype="float16")
    with pytest.raises(ValueError, match="needs the exact CPU path"):
        load_model("tiny", "cpu", exact=False, gemm_dtype="bfloat16")
    with pytest.raises(ValueError, match="--gemm-dtype"):
        ServerConfig(gemm_dtype="int8")
    monkeypatch.setitem(native_gemm._state, "bf16", False)
    monkeypatch.setitem(native_gemm._state, "bf16_what", "unavailable: this CPU has no "
                                                         "AVX512_BF16")
    with pytest.raises(ValueError, match="AVX512_BF16; use float32"):
        load_model("tiny", "cpu", gemm_dtype="bfloat16")


@pytest.mark.parametrize("rows", [1, 5, 16, 17, 19, 25, 27, 40, 101])
def test_products_give_each_row_the_same_bits_at_any_row_count(threads, rows):
    from engine.runtime.model import ops

    g = torch.Generator().manual_seed(rows)
    w, x = torch.randn(512, 256, generator=g), torch.randn(128, 256, generator=g)
    assert torch.equal(ops.linear(x[:rows], w), ops.linear(x, w)[:rows])
    a, b = torch.randn(2, 128, 64, generator=g), torch.randn(2, 64, 96, generator=g)
    assert torch.equal(ops.bmm(a[:, :rows], b), ops.bmm(a, b)[:, :rows])
    for width in (768, 100):        # elementwise: split between threads by element count
        h = torch.randn(1100, width, generator=g)
        assert torch.equal(ops.silu(h[:rows * 11]), ops.silu(h)[:rows * 11])


def test_attention_reads_the_pool(model):
    """Corrupting the cached KV of a prefix changes the next-token logits."""
    pool = _pool(model)
    toks = _prompt(96, 3)
    pages = pool.allocator.alloc(6)
    model.forward([Chunk(toks[:64], 0, pages)], pool.buf, PS)
    base = model.forward([Chunk(toks[64:], 64, pages)], pool.buf, PS)
    pool.buf[:, :, pages[0] * PS:(pages[0] + 1) * PS] += 1.0
    changed = model.forward([Chunk(toks[64:], 64, pages)], pool.buf, PS)
    assert not torch.equal(base, changed)


def test_layer_hooks_run_in_layer_order_before_attention(model):
    pool = _pool(model)
    toks = _prompt(40, 4)
    pages = pool.allocator.alloc(3)
    seen = []
    model.forward([Chunk(toks, 0, pages)], pool.buf, PS, layer_hooks=[seen.append])
    assert seen == list(range(model.cfg.num_layers))


def test_forward_checks_page_table_and_context(model):
    pool = _pool(model)
    with pytest.raises(ValueError, match="page table"):
        model.forward([Chunk(_prompt(40), 0, pool.allocator.alloc(2))], pool.buf, PS)
    with pytest.raises(ValueError, match="max context"):
        model.forward([Chunk([1], model.cfg.max_context, np.arange(1))], pool.buf, PS)


def test_weights_are_seeded():
    cfg = preset("tiny")
    a, b, c = random_weights(cfg), random_weights(cfg), random_weights(cfg, seed=1)
    assert torch.equal(a.layers[3].wqkv, b.layers[3].wqkv)
    assert not torch.equal(a.layers[3].wqkv, c.layers[3].wqkv)


def test_hf_checkpoint_round_trip(tmp_path):
    """A Llama checkpoint directory written from the tiny model loads back to the same model."""
    ref = load_model("tiny", seed=7)
    save_hf(str(tmp_path), ref.cfg, random_weights(ref.cfg, seed=7))
    conf = json.loads((tmp_path / "config.json").read_text())
    assert conf["model_type"] == "llama" and conf["num_key_value_heads"] == 2
    loaded = load_model(str(tmp_path))
    assert loaded.cfg.num_layers == 4 and loaded.cfg.eos_ids == (257,)
    toks = _prompt(50, 5)
    outs = []
    for m in (ref, loaded):
        pool = _pool(m, 8)
        outs.append(m.forward([Chunk(toks, 0, pool.allocator.alloc(4))], pool.buf, PS))
    assert torch.equal(outs[0], outs[1])


def test_hf_config_errors(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(InputError, match="not a JSON config"):
        from_hf_config(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    with pytest.raises(InputError, match="missing field"):
        from_hf_config(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(InputError, match="not supported"):
        from_hf_config(str(tmp_path))
    with pytest.raises(ValueError, match="unknown model preset"):
        load_model("no-such-preset")


def test_byte_tokenizer_round_trip_and_stream():
    tok = ByteTokenizer()
    text = "héllo 世界 🙂"
    ids = tok.encode(text)
    assert ids[0] == tok.bos_id and len(ids) == 1 + len(text.encode("utf-8"))
    assert tok.decode(ids + [tok.eos_id]) == text
    st = tok.stream()
    pieces = [st.push(i) for i in ids[1:]] + [st.flush()]
    assert "".join(pieces) == text
    # a multi-byte character is emitted whole, once its last byte arrived
    assert pieces[:2] == ["h", ""] and pieces[2] == "é"
    assert tok.decode([0xFF, 65]) == "\ufffdA"


@pytest.mark.parametrize("name", ["tiny", "tiny-mla"])
def test_fused_attention_path_agrees_with_the_exact_path(name):
    """The SDPA path (default on CUDA) computes the same function, up to float rounding."""
    exact, fused = load_model(name), load_model(name, exact=False)
    assert exact.exact and not fused.exact
    toks = _prompt(300, 6)
    outs = []
    for m in (exact, fused):
        pool = _pool(m, 32)
        pages, _ = _run_chunks(m, pool, toks[:200], [120, 80])
        pages = np.concatenate([pages, pool.allocator.alloc(8)])
        outs.append(m.forward([Chunk(toks[200:], 200, pages)], pool.buf, PS))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-4, atol=1e-4)
    assert torch.equal(outs[0].argmax(-1), outs[1].argmax(-1))
