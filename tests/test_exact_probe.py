"""The exact path's checks: a batched kernel that is not batch invariant is caught (the real
library call on this CPU, and one made to follow the batch), and the model's start-up probe
falls back to the single-thread kernel when rows differ between batch shapes."""

from __future__ import annotations

import logging

import pytest
import torch

from engine.runtime.model import exact, load_model, ops
from engine.runtime.model.probe import check_exact


@pytest.fixture(autouse=True)
def fresh():
    before = torch.get_num_threads()
    exact.reset()
    yield
    exact.reset()
    torch.set_num_threads(before)


def _xw(K=768, N=256, M=100, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(M, K, generator=g), torch.randn(N, K, generator=g)


def _library_differs(x, w, threads):
    pad = torch.cat([x, x.new_zeros(-len(x) % 16, x.shape[1])])
    torch.set_num_threads(1)
    one = torch.mm(pad, w.t())
    torch.set_num_threads(threads)
    return not torch.equal(torch.mm(pad, w.t()), one)


@pytest.fixture
def torch_items(monkeypatch):
    """The checks below are the torch items' (the float32 native kernel, where it is built, is
    invariant by construction and has no batched kernel to check): turn it off."""
    monkeypatch.setenv("HICACHE_EXACT_NATIVE", "0")


def test_the_check_catches_the_library_kernel_at_16_threads(monkeypatch, caplog, torch_items):
    x, w = _xw()
    if not _library_differs(x, w, 16):
        pytest.skip("the library's product is thread-invariant for this shape on this CPU")
    monkeypatch.setenv("HICACHE_EXACT_GEMM", "safe")
    want = ops.linear(x, w)
    monkeypatch.setenv("HICACHE_EXACT_GEMM", "library")
    with caplog.at_level(logging.WARNING, logger="hicache.model"):
        got = ops.linear(x, w)
        again = ops.linear(x, w)
    assert torch.equal(got, want) and torch.equal(again, want)    # never the library's bits
    assert any("linear-library" in line and "16" in line for line in exact.report())
    assert sum("not batch invariant" in r.message for r in caplog.records) == 1


def _drifting(a, b, out=None):
    """A batched kernel whose items' bits follow their tile's row count."""
    r = torch.bmm(a, b) * (1 + 2.0 ** -20 * a.shape[1])
    return r if out is None else out.copy_(r)


def test_the_check_catches_a_kernel_that_follows_the_batch(monkeypatch, caplog, torch_items):
    monkeypatch.setattr(exact, "_batched", _drifting)
    x, w = _xw(256, 512)
    with caplog.at_level(logging.WARNING, logger="hicache.model"):
        whole = ops.linear(x, w)
    assert torch.equal(ops.linear(x[:3], w), whole[:3])
    monkeypatch.setenv("HICACHE_EXACT_GEMM", "safe")
    assert torch.equal(ops.linear(x, w), whole)
    assert exact.report() and "not batch invariant" in caplog.text


def test_start_up_probe_passes_and_falls_back_when_rows_differ(monkeypatch, caplog,
                                                              torch_items):
    model = load_model("tiny", "cpu")
    torch.set_num_threads(4)
    with caplog.at_level(logging.WARNING, logger="hicache.model"):
        assert check_exact(model, tokens=100)
    assert exact.mode() == "" and not caplog.records
    # a batched kernel whose bits follow the batch, and checks that would miss it
    monkeypatch.setattr(exact, "_batched", _drifting)
    monkeypatch.setattr(exact, "checked",
                        lambda kind, key, fast, safe: safe() if exact.mode() == "safe" else fast())
    exact.reset()
    with caplog.at_level(logging.WARNING, logger="hicache.model"):
        assert check_exact(model, tokens=100)
    assert exact.mode() == "safe"
    assert sum("other bits" in r.message for r in caplog.records) == 1


def test_bfloat16_products_and_attention_are_invariant_at_1_to_32_threads():
    """bf16 (the ``medium`` preset) goes through another library path (oneDNN): here its
    one-thread rows follow the tile size and its batched kernel differs at 32 threads, so the
    checks pick fixed tiles and the safe kernel; the bits stay the same either way."""
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(1536, 768, generator=g).bfloat16(), torch.randn(300, 768, generator=g)
    q, k, v = (torch.randn(300, h, 64, generator=g).bfloat16() for h in (4, 2, 2))
    x, pos = x.bfloat16(), torch.arange(300)
    ref = None
    for t in (1, 2, 16, 32):
        torch.set_num_threads(t)
        got = (ops.linear(x, w), ops.linear(x[:7], w), ops.attention(q, k, v, pos, 0.125),
               ops.attention(q[290:], k, v, pos[290:], 0.125))
        ref = ref or got
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[0][:7])
        assert torch.equal(got[2], ref[2]) and torch.equal(got[3], ref[2][290:])


def test_native_products_give_a_row_the_same_bits_at_any_row_count_and_thread_count(monkeypatch):
    """The float32 native kernel (engine/runtime/model/native_gemm.py): a row's bits alone, in
    any row count, at 1 to 32 threads and in ``safe`` mode (one thread) are the same; and its
    values are a product's."""
    from engine.runtime.model import native_gemm

    if not native_gemm.available():
        pytest.skip(f"no native kernel here: {native_gemm.describe()}")
    x, w = _xw(K=576, N=960, M=300)
    torch.set_num_threads(1)
    ref = ops.linear(x, w)
    assert torch.allclose(ref.double(), x.double() @ w.double().t(), rtol=1e-4, atol=1e-3)
    for t in (2, 3, 16, 32):
        torch.set_num_threads(t)
        for rows in (1, 7, 8, 9, 255, 300):
            assert torch.equal(ops.linear(x[:rows], w), ref[:rows]), (t, rows)
        assert torch.equal(ops.linear(x[150:151], w), ref[150:151])
    monkeypatch.setenv("HICACHE_EXACT_GEMM", "safe")
    assert torch.equal(ops.linear(x[:9], w), ref[:9])
    monkeypatch.setenv("HICACHE_EXACT_GEMM", "")
    monkeypatch.setenv("HICACHE_EXACT_NATIVE", "0")           # off: the torch items again
    assert not native_gemm.available()
    assert torch.allclose(ops.linear(x[:9], w), ref[:9], rtol=1e-4, atol=1e-3)
