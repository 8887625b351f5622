"""TP on 2 real gloo ranks with the tiny model (GQA and MLA): each rank keeps its share of the
heads and of the MLP, its pool holds only its kv-heads, and an all-reduce after the output and
down projections gives every rank the same logits — equal to a single rank's to rounding, and
the same greedy tokens (fresh prompt, and a prompt whose prefix is read back from the pool)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.parallel.launch import run_ranks
from engine.runtime.model import load_model, preset
from engine.runtime.model.tp import check_tp, tp_model
from tests.test_cp_model import PS, _prompt, greedy


def _all_reduce(t: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist

    dist.all_reduce(t)
    return t


def _run(model, lay, prompts) -> list:
    n_pages = -(-(60) // PS)
    pool = torch.zeros((lay.num_layers, lay.kv_kinds, 2 * n_pages * PS, lay.kv_heads,
                        lay.head_dim), dtype=lay.torch_dtype)
    a, b = prompts
    first = greedy(model, lambda c, f: pool, a, 0, np.arange(n_pages))
    # b shares a's first two pages: they are read back from the pool, not computed
    shared = np.concatenate([np.arange(2), np.arange(n_pages + 2, 2 * n_pages)])
    hit = greedy(model, lambda c, f: pool, b, 32, shared)
    return [first, hit, pool]


def _rank(rank: int, world: int) -> dict:
    out = {}
    for spec in ("tiny", "tiny-mla"):
        full = load_model(spec)
        a = _prompt(45, 1)
        b = a[:32] + _prompt(13, 2)
        ref = _run(full, full.kv_layout(PS), (a, b))
        shard = tp_model(full, rank, world, _all_reduce)
        lay = shard.kv_layout(PS)
        got = _run(shard, lay, (a, b))
        h0 = lay.head_start
        ref_pool = ref[2][:, :, :, h0:h0 + lay.kv_heads]
        out[spec] = {"tokens": [got[0][0], got[1][0]], "ref_tokens": [ref[0][0], ref[1][0]],
                     "max_diff": max(float((g[1] - r[1]).abs().max())
                                     for g, r in zip(got[:2], ref[:2])),
                     "pool_diff": float((got[2] - ref_pool).abs().max()),
                     "heads": (lay.head_start, lay.kv_heads, lay.model_kv_heads),
                     "logits": got[0][1].numpy().tobytes()}
    return out


def test_two_tp_ranks_equal_one_rank():
    res = run_ranks(_rank, 2, timeout_s=240)
    for spec in ("tiny", "tiny-mla"):
        r0, r1 = res[0][spec], res[1][spec]
        for r in (r0, r1):
            assert r["tokens"] == r["ref_tokens"], spec            # greedy tokens equal
            assert r["max_diff"] < 1e-3, spec                      # logits equal to rounding
            assert r["pool_diff"] < 1e-4, spec                     # the rank's kv-heads' KV
        assert r0["logits"] == r1["logits"]                            # ranks agree bit for bit
    assert res[0]["tiny"]["heads"] == (0, 1, 2) and res[1]["tiny"]["heads"] == (1, 1, 2)
    assert res[0]["tiny-mla"]["heads"] == res[1]["tiny-mla"]["heads"] == (0, 1, 1)  # latent


def test_shapes_that_do_not_split_are_refused():
    check_tp(preset("tiny"), 2)
    check_tp(preset("tiny"), 4)                    # 4 q-heads; the 2 kv-heads shared by pairs
    with pytest.raises(ValueError, match="attention heads"):
        check_tp(preset("tiny"), 3)
    with pytest.raises(ValueError, match="must be >= 1"):
        check_tp(preset("tiny"), 0)
