"""The exact attention kernel: a query's result does not depend on its batch, to the bit."""

import pytest
import torch

from engine.runtime.model import ops


def _qkv(T, Hkv=2, G=2, D=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, Hkv * G, D, generator=g)
    k = torch.randn(T, Hkv, D, generator=g)
    v = torch.randn(T, Hkv, D, generator=g)
    return q, k, v


@pytest.mark.parametrize("T", [300, 2200])   # 2200: several key blocks and several passes
def test_exact_attention_is_batch_invariant(T):
    q, k, v = _qkv(T)
    pos = torch.arange(T)
    whole = ops.attention(q, k, v, pos, 0.125)
    # chunked prefill: chunk [s, e) sees keys 0 .. e-1 only
    for cuts in ([0, 1, 257, T - 40, T], [0, T - 3, T - 1, T]):
        parts = [ops.attention(q[s:e], k[:e], v[:e], pos[s:e], 0.125)
                 for s, e in zip(cuts, cuts[1:])]
        assert torch.equal(torch.cat(parts), whole)
    # one decode-like query over more keys than it may see (the tail is masked)
    one = ops.attention(q[T // 2:T // 2 + 1], k, v, pos[T // 2:T // 2 + 1], 0.125)
    assert torch.equal(one[0], whole[T // 2])


def test_exact_attention_matches_fused_attention():
    q, k, v = _qkv(700, seed=1)
    pos = torch.arange(400, 700)
    exact = ops.attention(q[400:], k, v, pos, 0.125)
    fused = ops.attention(q[400:], k, v, pos, 0.125, exact=False)
    torch.testing.assert_close(exact, fused, rtol=1e-4, atol=1e-5)
    # and a causal reference computed the plain way
    s = torch.einsum("mhd,thd->hmt", q[400:], k.repeat_interleave(2, dim=1)) * 0.125
    s = s.masked_fill(torch.arange(700).view(1, 1, -1) > pos.view(1, -1, 1), float("-inf"))
    ref = torch.einsum("hmt,thd->mhd", s.softmax(-1), v.repeat_interleave(2, dim=1))
    torch.testing.assert_close(exact, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("Hkv, G, D", [(2, 2, 64), (1, 4, 160), (4, 1, 32)])   # GQA, MLA-like, MHA
@pytest.mark.parametrize("M, T", [(64, 64), (100, 137), (300, 700)])
def test_fused_tail_chunks_match_the_masked_path(monkeypatch, Hkv, G, D, M, T):
    """A chunk whose queries are the last M of T positions takes one fused call with a
    lower-right causal bias; it computes what the masked passes compute."""
    q, k, v = _qkv(T, Hkv, G, D, seed=M + T)
    pos = torch.arange(T - M, T)
    calls = []
    real = ops._attention_sdpa_tail
    monkeypatch.setattr(ops, "_attention_sdpa_tail", lambda *a: calls.append(1) or real(*a))
    tail = ops.attention(q[T - M:], k, v, pos, 0.125, exact=False, tail=True)
    masked = ops.attention(q[T - M:], k, v, pos, 0.125, exact=False)
    assert calls == [1]
    torch.testing.assert_close(tail, masked, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(tail, ops.attention(q[T - M:], k, v, pos, 0.125),
                               rtol=1e-4, atol=1e-5)


def test_short_tail_chunks_and_refusals_take_the_masked_path(monkeypatch):
    q, k, v = _qkv(200)
    pos = torch.arange(190, 200)
    calls = []
    monkeypatch.setattr(ops, "_attention_sdpa_tail", lambda *a: calls.append(1))
    ops.attention(q[190:], k, v, pos, 0.125, exact=False, tail=True)      # 10 queries
    assert calls == []

    def refuse(*a):
        raise RuntimeError("no kernel for these shapes")

    monkeypatch.setattr(ops, "_attention_sdpa_tail", refuse)
    monkeypatch.setitem(ops._causal_tail_state, "usable", True)
    pos = torch.arange(100, 200)
    out = ops.attention(q[100:], k, v, pos, 0.125, exact=False, tail=True)
    torch.testing.assert_close(out, ops.attention(q[100:], k, v, pos, 0.125),
                               rtol=1e-4, atol=1e-5)
    assert ops._causal_tail_state["usable"] is False                   # and stays off
