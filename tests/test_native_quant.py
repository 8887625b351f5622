"""Exact products from a GGUF file's own blocks (engine/runtime/model/native_quant.py and
rowdot.c's ``hicache_rowdot_quant``) give the bits of the float32 panels: every row count up
to the limit, thread counts, ragged column counts, each block type; a weight whose blocks do
not give its values keeps float32; and on the real model a decode step takes the blocks and
decodes the same logits as without them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.runtime.model import Chunk, load_model, native_gemm, native_quant
from engine.runtime.model.gguf_loader import _unpermute

gguf = pytest.importorskip("gguf")          # the smollm extra (make test installs it)
pytestmark = pytest.mark.skipif(not native_gemm.available() or native_quant.kernel() is None,
                                reason=f"native kernels: {native_gemm.describe()}")

_TYPES = {"Q4_1": gguf.GGMLQuantizationType.Q4_1, "Q4_0": gguf.GGMLQuantizationType.Q4_0,
          "Q8_0": gguf.GGMLQuantizationType.Q8_0}


def blocks(kind: str, N: int, K: int, seed: int = 0, scale: float = 1.0
           ) -> tuple[np.ndarray, torch.Tensor]:
    """Random rows of ``kind`` blocks as a GGUF file holds them, and their float32 values as
    the loader makes them (gguf's own dequantisation)."""
    rng = np.random.default_rng(seed)
    nb = K // 32
    d = (scale * rng.uniform(0.002, 0.05, (N, nb, 1))).astype(np.float16).view(np.uint8)
    if kind == "Q8_0":
        q = rng.integers(-128, 128, (N, nb, 32)).astype(np.int8).view(np.uint8)
        raw = np.concatenate([d, q], axis=2)
    else:
        q = rng.integers(0, 16, (N, nb, 32)).astype(np.uint8)
        qs = q[:, :, :16] | (q[:, :, 16:] << 4)
        m = (scale * rng.uniform(-0.4, 0.0, (N, nb, 1))).astype(np.float16).view(np.uint8)
        parts = [d, m, qs] \
            if kind == "Q4_1" else [d, qs]
        raw = np.concatenate(parts, axis=2)
    raw = np.ascontiguousarray(raw.reshape(N, -1))
    vals = gguf.quants.dequantize(raw, _TYPES[kind]).astype(np.float32).reshape(N, K)
    return raw, torch.from_numpy(vals.copy())


def float32_product(x: torch.Tensor, w: torch.Tensor, threads: int) -> torch.Tensor:
    M, K = x.shape
    N = w.shape[0]
    out = torch.empty((M, N))
    p = native_gemm.pack(w)
    native_gemm._fn()(x.data_ptr(), K, p.data_ptr(), out.data_ptr(), N, M, N, K, threads)
    return out


@pytest.mark.parametrize("kind", ["Q4_1", "Q4_0", "Q8_0"])
@pytest.mark.parametrize("N,K", [(45, 64), (96, 32), (200, 160)])
def test_block_products_have_the_float32_bits(kind, N, K):
    raw, w = blocks(kind, N, K, seed=N + K)
    native_quant.tag(w, kind, raw)
    got = native_quant.panels(w)
    assert got is not None and got[1].numel() < 2 * w.numel()    # under half float32 bytes
    x = torch.randn(native_quant.ROWS, K, generator=torch.Generator().manual_seed(1))
    before = native_quant.products()
    for M in range(1, native_quant.ROWS + 1):
        for threads in (1, 2, 3):
            xs = x[:M].contiguous()
            out = torch.full((M, N), float("nan"))
            assert native_quant.product(xs, w, out, threads)
            want = float32_product(xs, w, threads)
            assert torch.equal(out, want), (M, threads)
            assert torch.equal(out[-1:], float32_product(xs[-1:], w, 1))   # a row alone
    assert native_quant.products() - before == 3 * native_quant.ROWS
    # the public entry: few rows from the blocks, more from float32, the same bits either way
    assert torch.equal(native_gemm.linear(x[:2], w), float32_product(x[:2].contiguous(), w, 1))
    many = torch.randn(native_quant.ROWS + 3, K)
    before = native_quant.products()
    assert torch.equal(native_gemm.linear(many, w), float32_product(many, w, 1))
    assert native_quant.products() == before


def test_blocks_that_do_not_give_the_weight_are_not_used():
    raw, w = blocks("Q4_1", 64, 64, seed=3)
    w[5, 7] += 1e-3                                  # one value off its block
    native_quant.tag(w, "Q4_1", raw)
    assert native_quant.panels(w) is None
    x = torch.randn(1, 64)
    assert not native_quant.product(x, w, torch.empty(1, 64), 1)
    assert torch.equal(native_gemm.linear(x, w), float32_product(x, w, 1))
    raw, w = blocks("Q8_0", 32, 64, seed=4)          # a NaN scale: NaN values, never equal
    raw[0, 0:2] = np.array([np.float16("nan")]).view(np.uint8)
    w = torch.from_numpy(gguf.quants.dequantize(raw, _TYPES["Q8_0"]).astype(np.float32)
                         .reshape(32, 64).copy())
    native_quant.tag(w, "Q8_0", raw)
    assert native_quant.panels(w) is None


def test_tags_only_what_the_kernel_takes():
    raw, w = blocks("Q4_1", 32, 64)
    assert native_quant.blocks_of(native_quant.tag(w.clone(), "Q5_1", raw)) is None
    assert native_quant.blocks_of(native_quant.tag(w.clone(), "Q4_1", raw[:16])) is None
    assert native_quant.blocks_of(native_quant.tag(w[:, :48].clone(), "Q4_1", raw)) is None
    assert native_quant.blocks_of(native_quant.tag(w.clone(), "Q4_1", raw)) is not None


def test_rows_and_blocks_stay_together_through_the_loaders_reorders():
    """Q/K rows unpermuted and products fused (concatenated) as gguf_weights does: the blocks
    follow their rows, so the regrouped panels still give the weight exactly."""
    raw_q, q = blocks("Q4_1", 128, 64, seed=5)
    raw_k, k = blocks("Q4_1", 64, 64, seed=6)
    native_quant.tag(q, "Q4_1", raw_q)
    native_quant.tag(k, "Q4_1", raw_k)
    fused = native_quant.concat([_unpermute(q, 4), _unpermute(k, 2)],
                                torch.cat([_unpermute(q, 4), _unpermute(k, 2)]))
    assert native_quant.panels(fused) is not None
    mixed = native_quant.concat([q, blocks("Q8_0", 32, 64)[1]], torch.cat([q, k[:32]]))
    assert native_quant.blocks_of(mixed) is None


def _quantised_tiny():
    """The tiny model with every layer product and the head made of Q4_1/Q8_0 blocks."""
    model = load_model("tiny", seed=3)
    for i, lw in enumerate(model.w.layers):
        for j, name in enumerate(("wqkv", "wo", "w_gate_up", "w_down")):
            w, kind = getattr(lw, name), "Q4_1" if j % 2 else "Q8_0"
            raw, vals = blocks(kind, *w.shape, seed=10 * i + j,
                               scale=0.1 if kind == "Q4_1" else 0.01)   # a sane stream
            w.copy_(vals)
            native_quant.tag(w, kind, raw)
    return model


def test_the_layers_call_and_the_loop_decode_the_same_bits_from_blocks(monkeypatch):
    """Decode steps (one and two rows), a prefill chunk (float32), through the one native call
    and the Python loop, blocks on and off: the same logits and KV, and the blocks served."""
    model = _quantised_tiny()
    lay = model.kv_layout(4)

    def run(quant: bool, loop: bool):
        if not quant:
            monkeypatch.setenv("HICACHE_EXACT_QUANT", "0")
        if loop:
            from engine.runtime.model import native_layers
            monkeypatch.setattr(native_layers, "usable", lambda *a, **k: False)
        kv = torch.zeros((lay.num_layers, lay.kv_kinds, 32 * 4, lay.kv_heads, lay.head_dim))
        pa, pb = np.arange(0, 12), np.arange(12, 24)
        ta = np.random.default_rng(2).integers(0, 256, 30)
        before = native_quant.products()
        out = [model.forward([Chunk(ta[:20], 0, pa)], kv, 4),
               model.forward([Chunk(ta[:9], 0, pb)], kv, 4)]
        for i in range(3):
            out.append(model.forward([Chunk(ta[20 + i:21 + i], 20 + i, pa)], kv, 4))
            out.append(model.forward([Chunk(ta[20 + i:21 + i], 20 + i, pa),
                                      Chunk(ta[9 + i:10 + i], 9 + i, pb)], kv, 4))
        served = native_quant.products() - before
        monkeypatch.undo()
        return torch.cat(out), kv, served

    base, kv0, n0 = run(quant=False, loop=False)
    assert n0 == 0
    for loop in (False, True):
        got, kv1, n1 = run(quant=True, loop=loop)
        assert torch.equal(got, base) and torch.equal(kv1, kv0)
        # 6 decode forwards x 4 layer products (the head is not tagged here)
        assert n1 == 6 * 4 * model.cfg.num_layers


def test_the_real_model_reads_its_blocks_and_decodes_the_same_logits(monkeypatch):
    """smollm2-135m: every layer product (Q4_1, Q/K rows unpermuted, fused) and the tied head
    (Q8_0) take the blocks; greedy decode steps give the same logits with and without."""
    try:
        model = load_model("smollm2-135m", seed=None)
    except Exception as exc:                      # weights not installed: said so
        pytest.skip(f"smollm2-135m: {exc}")
    for lw in model.w.layers:
        for w in (lw.wqkv, lw.wo, lw.w_gate_up, lw.w_down):
            assert native_quant.panels(w) is not None
    assert native_quant.panels(model.w.lm_head)[0] == 2

    def run(quant: bool):
        if not quant:
            monkeypatch.setenv("HICACHE_EXACT_QUANT", "0")
        lay = model.kv_layout(16)
        kv = torch.zeros((lay.num_layers, lay.kv_kinds, 8 * 16, lay.kv_heads, lay.head_dim))
        pages = np.array([5, 1, 7, 0, 3, 6])
        toks = np.random.default_rng(1).integers(0, 40000, 70)
        before = native_quant.products()
        out = [model.forward([Chunk(toks, 0, pages)], kv, 16)]
        for i in range(3):
            nxt = int(out[-1][-1].argmax())
            out.append(model.forward([Chunk([nxt], 70 + i, pages)], kv, 16))
        served = native_quant.products() - before
        monkeypatch.undo()
        return torch.cat(out), kv, served

    a, ka, na = run(True)
    b, kb, nb = run(False)
    assert torch.equal(a, b) and torch.equal(ka, kb)
    # the 3 steps' layer products, and the head of all 4 forwards (a prefill's last row too)
    assert nb == 0 and na == 3 * 4 * model.cfg.num_layers + 4
