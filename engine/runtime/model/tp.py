"""Tensor parallelism of the decoder: one rank's shard of the weights (docs/parallelism.md,
"bench serve --tp N").

Rank ``r`` of ``tp`` keeps

* attention: the query heads ``[r·Hq/tp, (r+1)·Hq/tp)`` and the kv-heads they read
  (:func:`engine.core.layout.tp_head_range`: ``Hkv/tp`` each, or one kv-head shared by
  ``tp/Hkv`` consecutive ranks when ``tp > Hkv``) — the rows of the fused QKV projection, and the
  matching columns of the output projection (row-parallel);
* MLA: its query heads (``wq`` rows, ``w_uk``/``w_uv`` per head, ``wo`` columns); the latent
  projection ``wkv_a`` is replicated, so every rank computes and caches the whole latent (MLA has
  one cached vector per token and no head axis to shard);
* the MLP: its ``intermediate/tp`` slice of the gate and up rows (column-parallel) and the same
  columns of the down projection (row-parallel).

Embedding, norms and the LM head are replicated. The output projection and the down projection
each give a partial sum; :attr:`Model.reduce` (an all-reduce SUM over the TP group) completes it
before the residual add, so every rank holds the same hidden states and the same logits. The sum
of per-rank partial products adds in a different order than one full product, so logits agree
with a single rank to rounding, not bit for bit; greedy tokens agree.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from engine.core.layout import tp_head_range
from engine.runtime.model.transformer import Model
from engine.runtime.model.weights import LayerWeights, ModelWeights


def check_tp(cfg, tp: int) -> None:
    """``ValueError`` when ``cfg`` cannot be split over ``tp`` ranks (names what does not divide)."""
    if tp < 1:
        raise ValueError(f"--tp must be >= 1, got {tp}")
    if tp == 1:
        return
    if cfg.num_heads % tp:
        raise ValueError(f"--tp {tp}: the model's {cfg.num_heads} attention heads do not split "
                         f"over {tp} ranks")
    if cfg.intermediate % tp:
        raise ValueError(f"--tp {tp}: the MLP width {cfg.intermediate} does not split over "
                         f"{tp} ranks")
    if not cfg.is_mla:
        tp_head_range(cfg.num_kv_heads, tp, 0)        # raises when kv-heads cannot be split


def _rows(w: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    return w[lo:hi].contiguous()


def _cols(w: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    return w[:, lo:hi].contiguous()


def _shard_layer(cfg, lw: LayerWeights, rank: int, tp: int) -> LayerWeights:
    I, n_i = cfg.intermediate, cfg.intermediate // tp
    q0, q1 = rank * cfg.num_heads // tp, (rank + 1) * cfg.num_heads // tp
    gate_up = torch.cat([_rows(lw.w_gate_up, rank * n_i, (rank + 1) * n_i),
                         _rows(lw.w_gate_up, I + rank * n_i, I + (rank + 1) * n_i)])
    common = dict(attn_norm=lw.attn_norm, mlp_norm=lw.mlp_norm, w_gate_up=gate_up,
                  w_down=_cols(lw.w_down, rank * n_i, (rank + 1) * n_i))
    if cfg.is_mla:
        qd, dv = cfg.qk_nope_dim + cfg.qk_rope_dim, cfg.v_head_dim
        return LayerWeights(**common, wq=_rows(lw.wq, q0 * qd, q1 * qd), wkv_a=lw.wkv_a,
                            kv_norm=lw.kv_norm, w_uk=lw.w_uk[q0:q1].contiguous(),
                            w_uv=lw.w_uv[q0:q1].contiguous(), wo=_cols(lw.wo, q0 * dv, q1 * dv))
    D, Hq, Hkv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    k0, k1 = tp_head_range(Hkv, tp, rank)
    group = Hq // Hkv
    assert (k0, k1) == (q0 // group, (q1 - 1) // group + 1), (
        f"TP rank {rank}: query heads {q0}..{q1} do not read kv-heads {k0}..{k1}")
    k_off, v_off = Hq * D, (Hq + Hkv) * D
    wqkv = torch.cat([_rows(lw.wqkv, q0 * D, q1 * D),
                      _rows(lw.wqkv, k_off + k0 * D, k_off + k1 * D),
                      _rows(lw.wqkv, v_off + k0 * D, v_off + k1 * D)])
    return LayerWeights(**common, wqkv=wqkv, wo=_cols(lw.wo, q0 * D, q1 * D))


def tp_model(model: Model, rank: int, tp: int,
             reduce: Callable[[torch.Tensor], torch.Tensor]) -> Model:
    """Rank ``rank``'s shard of ``model`` over ``tp`` ranks; ``reduce`` sums a partial output
    over the TP group (in place or not; its result is used)."""
    cfg = model.cfg
    check_tp(cfg, tp)
    if tp == 1:
        return model
    kv = (0, 1) if cfg.is_mla else tp_head_range(cfg.num_kv_heads, tp, rank)
    shard_cfg = dataclasses.replace(cfg, num_heads=cfg.num_heads // tp,
                                    num_kv_heads=cfg.num_kv_heads if cfg.is_mla
                                    else kv[1] - kv[0],
                                    intermediate=cfg.intermediate // tp)
    w = ModelWeights(embed=model.w.embed, layers=[_shard_layer(cfg, lw, rank, tp)
                                                  for lw in model.w.layers],
                     final_norm=model.w.final_norm, lm_head=model.w.lm_head)
    m = Model(shard_cfg, w, device=str(model.device), exact=model.exact)
    m.stage = model.stage
    m.tp = (rank, tp, kv[0], cfg.cache_heads)
    m.reduce = reduce
    return m
