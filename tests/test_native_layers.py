"""A forward's layers in one native call (engine/runtime/model/native_layers.py) give the bits of
the Python layer loop: logits and every byte of the KV pool, for prefill chunks, decode steps,
several chunks in one forward, scattered pages, a head dim off the vector widths and the
single-thread ("safe") mode; and the call is taken exactly where it serves."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from engine.runtime.model import Chunk, load_model, native_attn, native_layers
from engine.runtime.model.config import preset

pytestmark = pytest.mark.skipif(not native_attn.available(),
                                reason=f"native kernels: {native_attn.describe()}")

PS = 4


def _configs() -> dict:
    tiny = preset("tiny")
    return {"tiny": tiny,
            # 3 query heads a kv-head (a decode step's 3 rows: the fused scores), head dim 40
            "g3-d40": dataclasses.replace(tiny, name="g3-d40", hidden=240, num_heads=6,
                                          num_kv_heads=2, head_dim=40),
            # one query head a kv-head, head dim 36 (not a multiple of 8)
            "g1-d36": dataclasses.replace(tiny, name="g1-d36", hidden=144, num_heads=4,
                                          num_kv_heads=4, head_dim=36)}


def _steps(model, monkeypatch, fused: bool):
    """The same forwards, through the one call or the Python loop: a prefill in ragged chunks,
    two requests in one forward (a chunk each), decode steps of both in one forward."""
    taken = []
    real_run = native_layers.run
    monkeypatch.setattr(native_layers, "run", lambda *a: taken.append(1) or real_run(*a))
    if not fused:
        monkeypatch.setattr(native_layers, "usable", lambda *a, **k: False)
    lay = model.kv_layout(PS)
    kv = torch.zeros((lay.num_layers, lay.kv_kinds, 64 * PS, lay.kv_heads, lay.head_dim))
    pa = np.array([7, 2, 30, 11, 5, 19, 0, 25, 3, 14, 9, 33, 40])      # scattered
    pb = np.array([1, 60, 4, 50, 8, 12, 41, 20, 6, 13])
    rng = np.random.default_rng(5)
    ta, tb = rng.integers(0, model.cfg.vocab_size, 48), rng.integers(0, model.cfg.vocab_size, 37)
    outs = [model.forward([Chunk(ta[0:13], 0, pa)], kv, PS),
            model.forward([Chunk(ta[13:14], 13, pa), Chunk(tb[0:30], 0, pb, all_logits=True)],
                          kv, PS),
            model.forward([Chunk(ta[14:40], 14, pa), Chunk(tb[30:36], 30, pb)], kv, PS)]
    for i in range(3):                               # decode steps of both, batched
        outs.append(model.forward([Chunk(ta[40 + i:41 + i], 40 + i, pa),
                                   Chunk(tb[36:37] if i == 0 else ta[i:i + 1], 36 + i, pb)],
                                  kv, PS))
    monkeypatch.undo()
    return torch.cat(outs), kv, len(taken)


@pytest.mark.parametrize("name", ["tiny", "g3-d40", "g1-d36"])
@pytest.mark.parametrize("safe", [False, True])
def test_one_call_has_the_python_loops_bits(name, safe, monkeypatch):
    model = load_model(_configs()[name], seed=3)
    if safe:
        monkeypatch.setenv("HICACHE_EXACT_GEMM", "safe")      # every kernel on one thread
    got, kv_fused, n_fused = _steps(model, monkeypatch, fused=True)
    if safe:
        monkeypatch.setenv("HICACHE_EXACT_GEMM", "safe")
    want, kv_loop, n_loop = _steps(model, monkeypatch, fused=False)
    assert n_fused == 6 and n_loop == 0
    assert torch.equal(got, want)
    assert torch.equal(kv_fused, kv_loop) and kv_fused.abs().sum() > 0


def test_one_call_on_the_real_model_decodes_as_the_loop(monkeypatch):
    """smollm2-135m (real weights): a prompt, then greedy steps, the same logits bit for bit."""
    try:
        model = load_model("smollm2-135m", seed=None)
    except Exception as exc:                      # weights not installed: said so
        pytest.skip(f"smollm2-135m: {exc}")

    def run(fused: bool):
        if not fused:
            monkeypatch.setattr(native_layers, "usable", lambda *a, **k: False)
        lay = model.kv_layout(16)
        kv = torch.zeros((lay.num_layers, lay.kv_kinds, 8 * 16, lay.kv_heads, lay.head_dim))
        pages = np.array([5, 1, 7, 0, 3, 6])
        toks = np.random.default_rng(1).integers(0, 40000, 70)
        out = [model.forward([Chunk(toks, 0, pages)], kv, 16)]
        for i in range(3):
            nxt = int(out[-1][-1].argmax())
            out.append(model.forward([Chunk([nxt], 70 + i, pages)], kv, 16))
        monkeypatch.undo()
        return torch.cat(out), kv

    a, ka = run(True)
    b, kb = run(False)
    assert torch.equal(a, b) and torch.equal(ka, kb)


def test_the_loop_serves_what_the_call_does_not(monkeypatch):
    """Layer hooks (a prefix loading back), the native switch off, an MLA model, a TP reduce:
    the Python loop, as before (and the same logits where both apply)."""
    model = load_model("tiny", seed=3)
    taken = []
    real_run = native_layers.run
    monkeypatch.setattr(native_layers, "run", lambda *a: taken.append(1) or real_run(*a))
    lay = model.kv_layout(PS)
    kv = torch.zeros((lay.num_layers, lay.kv_kinds, 16 * PS, lay.kv_heads, lay.head_dim))
    pages, toks = np.arange(16), np.arange(20) + 3
    plain = model.forward([Chunk(toks, 0, pages)], kv, PS)
    assert len(taken) == 1
    seen = []
    hooked = model.forward([Chunk(toks, 0, pages)], kv, PS, [seen.append])
    assert len(taken) == 1 and seen == list(range(model.cfg.num_layers))
    assert torch.equal(hooked, plain)
    monkeypatch.setenv("HICACHE_EXACT_NATIVE", "0")
    model.forward([Chunk(toks, 0, pages)], kv, PS)
    assert len(taken) == 1
    monkeypatch.delenv("HICACHE_EXACT_NATIVE")
    model.reduce = lambda t: t                                  # a (one-rank) TP reduce
    assert torch.equal(model.forward([Chunk(toks, 0, pages)], kv, PS), plain)
    assert len(taken) == 1
    model.reduce = None
    mla = load_model("tiny-mla", seed=3)
    lay = mla.kv_layout(PS)
    kvm = torch.zeros((lay.num_layers, lay.kv_kinds, 16 * PS, lay.kv_heads, lay.head_dim))
    mla.forward([Chunk(toks, 0, pages)], kvm, PS)
    assert len(taken) == 1


def test_bad_page_tables_are_errors_before_any_write(monkeypatch):
    model = load_model("tiny", seed=3)
    lay = model.kv_layout(PS)
    kv = torch.zeros((lay.num_layers, lay.kv_kinds, 4 * PS, lay.kv_heads, lay.head_dim))
    with pytest.raises(IndexError, match="outside the pool"):     # page 9 of a 4-page pool
        model.forward([Chunk(np.arange(6), 0, np.array([0, 9]))], kv, PS)
    assert not kv.any()
