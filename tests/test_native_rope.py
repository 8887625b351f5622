"""RoPE and the KV write in one native call (native_attn.rope_write) give the torch path's bits.

The model takes the native call on the exact CPU path; the torch path (``ops.apply_rope`` and
``index_copy_``) is what it replaced. Both are run on the same chunks — a prefill in ragged
chunks, a decode step, scattered pages — and the logits and every byte of the KV pool compared.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from engine.runtime.model import Chunk, load_model, native_attn, native_layers, ops

pytestmark = pytest.mark.skipif(not native_attn.available(),
                                reason=f"native kernels: {native_attn.describe()}")


def _run(model, native: bool):
    model._rope_ok = native and ops.native_rope_available(
        model.exact, model.dtype, model.device, model.cfg.rope_dim, model.cfg.head_dim)
    PS = 4
    lay = model.kv_layout(PS)
    kv = torch.zeros((lay.num_layers, lay.kv_kinds, 40 * PS, lay.kv_heads, lay.head_dim))
    pages = np.array([7, 2, 30, 11, 5, 19, 0, 25, 3, 14, 9, 33])     # scattered
    toks = np.random.default_rng(5).integers(0, model.cfg.vocab_size, 41)
    outs = []
    for s, e in ((0, 13), (13, 14), (14, 40)):
        outs.append(model.forward([Chunk(toks[s:e], s, pages)], kv, PS))
    outs.append(model.forward([Chunk(toks[40:41], 40, pages)], kv, PS))   # a decode step
    return torch.cat(outs), kv


def _configs():
    from engine.runtime.model.config import preset

    tiny = preset("tiny")
    # 3 query heads a kv-head, a head dim of 40 (RoPE halves of 20)
    return {"tiny": tiny, "tiny-g3-d40": dataclasses.replace(
        tiny, name="tiny-g3-d40", hidden=240, num_heads=6, num_kv_heads=2, head_dim=40)}


@pytest.mark.parametrize("name", ["tiny", "tiny-g3-d40"])
def test_native_rope_write_has_the_torch_paths_bits(name, monkeypatch):
    model = load_model(_configs()[name], seed=3)
    # the layer loop in Python (the one-call stack makes the same native call from C:
    # tests/test_native_layers.py)
    monkeypatch.setattr(native_layers, "usable", lambda *a, **k: False)
    calls = []
    real = ops.rope_write
    monkeypatch.setattr(ops, "rope_write", lambda *a: calls.append(1) or real(*a))
    if not ops.native_rope_available(model.exact, model.dtype, model.device,
                                     model.cfg.rope_dim, model.cfg.head_dim):
        pytest.skip("this preset does not take the native call")
    got, kv_native = _run(model, True)
    taken = len(calls)
    want, kv_torch = _run(model, False)
    assert taken == 4 * model.cfg.num_layers and len(calls) == taken   # native, then torch
    assert torch.equal(got, want)
    assert torch.equal(kv_native, kv_torch) and kv_native.abs().sum() > 0


def test_rope_write_against_apply_rope_directly():
    g = torch.Generator().manual_seed(9)
    M, Hq, Hkv, D = 5, 6, 2, 10
    qkv = torch.randn(M, (Hq + 2 * Hkv) * D, generator=g) * 100     # large: rounding shows
    cos, sin = torch.randn(M, D, generator=g), torch.randn(M, D, generator=g)
    k_pool, v_pool = torch.zeros(12, Hkv, D), torch.zeros(12, Hkv, D)
    slots = torch.tensor([9, 0, 4, 11, 2])
    q = native_attn.rope_write(qkv, Hq, Hkv, D, cos, sin, k_pool, v_pool, slots)
    qt, kt, vt = qkv.split([Hq * D, Hkv * D, Hkv * D], dim=-1)
    assert torch.equal(q, ops.apply_rope(qt.reshape(M, Hq, D), cos, sin))
    assert torch.equal(k_pool[slots], ops.apply_rope(kt.reshape(M, Hkv, D), cos, sin))
    assert torch.equal(v_pool[slots], vt.reshape(M, Hkv, D))
    untouched = torch.ones(12, dtype=torch.bool)
    untouched[slots] = False
    assert not k_pool[untouched].any() and not v_pool[untouched].any()


def test_rope_write_refuses_a_slot_outside_the_pool():
    """index_copy_ raised on such a slot; the native call must not write past the pool."""
    qkv, cos, sin = torch.randn(2, 40), torch.randn(2, 8), torch.randn(2, 8)
    k_pool, v_pool = torch.zeros(4, 1, 8), torch.zeros(4, 1, 8)
    for bad in ([1, 4], [-1, 0]):
        with pytest.raises(IndexError, match="outside the pool"):
            native_attn.rope_write(qkv, 3, 1, 8, cos, sin, k_pool, v_pool, torch.tensor(bad))
        assert not k_pool.any() and not v_pool.any()            # nothing written


def test_the_switch_reaches_a_model_already_built(monkeypatch):
    """HICACHE_EXACT_NATIVE=0 set after the model was built (and had run natively) sends its
    next forward to the torch row operations, all of them: one forward never mixes the two."""
    model = load_model("tiny", seed=3)
    monkeypatch.setattr(native_layers, "usable", lambda *a, **k: False)   # count each call
    calls = {"rms": 0, "silu": 0, "rope": 0}
    for name, fn in (("rms", "rms_norm"), ("silu", "silu_mul"), ("rope", "rope_write")):
        real = getattr(native_attn, fn)
        monkeypatch.setattr(native_attn, fn,
                            lambda *a, _r=real, _n=name: calls.__setitem__(_n, calls[_n] + 1)
                            or _r(*a))
    PS = 4
    lay = model.kv_layout(PS)
    kv = torch.zeros((lay.num_layers, lay.kv_kinds, 8 * PS, lay.kv_heads, lay.head_dim))
    pages = np.arange(8)
    toks = np.arange(9) + 5
    model.forward([Chunk(toks, 0, pages)], kv, PS)
    L = model.cfg.num_layers
    assert calls == {"rms": 2 * L + 1, "silu": L, "rope": L}
    monkeypatch.setenv("HICACHE_EXACT_NATIVE", "0")
    model.forward([Chunk(toks, 0, pages)], kv, PS)
    assert calls == {"rms": 2 * L + 1, "silu": L, "rope": L}      # none more
    monkeypatch.delenv("HICACHE_EXACT_NATIVE")
    model.forward([Chunk(toks[:1], 9, pages)], kv, PS)
    assert calls == {"rms": 4 * L + 2, "silu": 2 * L, "rope": 2 * L}
