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
