"""Numerical building blocks whose per-token results do not depend on the batch.

The central correctness property of the project is that greedy decoding gives the same tokens
whether a prefix's KV came from L1, from L2 after a load-back, or was computed fresh. Cached and
fresh paths batch tokens differently (a prefix computed as part of a 100-token chunk is reused
by a request whose fresh run would compute it in a 300-token chunk, decode tokens are computed
one at a time and later re-read as part of a prompt), so on the exact path every operation is
*batch invariant*: the result for one token depends only on that token's inputs.

* Matrix products (:mod:`engine.runtime.model.exact`) are cut into items of one fixed shape
  (a tile of rows by a fixed column block, over the whole reduction), each item computed as
  the library computes that shape on one thread; threads share the items. Padding rows to the
  library's blocking (the earlier approach) matched one machine only: with 16 threads, a CPU
  with AVX-512 and AMX split small products along the reduction dimension at any row count.
* Attention reduces over keys in fixed blocks of :data:`KEY_BLOCK` keys aligned to absolute
  position 0: ``P @ V`` per block (fixed reduction length, items of :data:`ATTN_ROW_TILE`
  rows), then a sequential sum over blocks (scores reduce over the head dim only, one item per
  tile and key block, so they do not depend on the key count). Keys a
  query may not see contribute exact zeros, so a query's result does not depend on how many keys
  the rest of its chunk needs. The softmax runs along each row from key 0 (max, exp, sum), so
  masked keys add exact zeros to it.

The ``sdpa`` path (default on CUDA) uses PyTorch's fused attention instead; it is faster and
agrees at the token level, not bitwise. A chunk whose queries are the last positions of its
keys (every prefill and decode chunk the model runs) of 64 queries or more takes one fused call
with a lower-right causal bias; other shapes pass an explicit mask, in passes.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from engine.runtime.model import exact as _exact
from engine.runtime.model import native_attn as _native_attn

ATTN_ROW_TILE = 32         # (query, group member) rows per attention item
_VEC_ALIGN = 64            # elements: a multiple of any CPU vector loop's step (AVX-512 bf16: 64)
_ELEMWISE_BLOCK = 1 << 14  # elements per elementwise call: below torch's grain (32768)
KEY_BLOCK = 256
# Elements of the score tensor one attention pass may materialise (bounds peak memory).
_SCORE_BUDGET = 1 << 22


def linear(x: torch.Tensor, w: torch.Tensor, exact: bool = True) -> torch.Tensor:
    """``x @ w.T`` for ``x [M, K]``, ``w [N, K]``; batch invariant when ``exact``."""
    if not exact:
        return F.linear(x, w)
    return _exact.linear(x, w)


def bmm(a: torch.Tensor, b: torch.Tensor, exact: bool = True) -> torch.Tensor:
    """``a [B, M, K] @ b [B, K, N]``; batch invariant in ``M`` when ``exact``."""
    if not exact:
        return torch.bmm(a, b)
    return _exact.bmm(a, b)


def silu(x: torch.Tensor, exact: bool = True) -> torch.Tensor:
    """``x * sigmoid(x)``; the same bits for an element whatever the rest of ``x`` when
    ``exact``. torch's elementwise kernels split large tensors between threads at points that
    depend on the element count, and each piece's last few elements take a scalar ``exp`` that
    rounds differently from the vectorised one. Here rows are padded to a multiple of
    :data:`_VEC_ALIGN` elements and the flat tensor goes through in pieces of
    :data:`_ELEMWISE_BLOCK` (below torch's parallel grain, so one thread takes each piece whole):
    every element is on the vector path, at any row count and thread count."""
    if not exact:
        return F.silu(x)
    width = x.shape[-1]
    if width % _VEC_ALIGN == 0 and x.numel() <= _ELEMWISE_BLOCK and x.is_contiguous():
        return F.silu(x)          # one piece already (a decode step's): the loop's one call
    padded = -(-width // _VEC_ALIGN) * _VEC_ALIGN
    xp = (x if padded == width else F.pad(x, (0, padded - width))).contiguous()
    flat = xp.view(-1)
    out = torch.empty_like(flat)
    for s in range(0, flat.numel(), _ELEMWISE_BLOCK):
        out[s:s + _ELEMWISE_BLOCK] = F.silu(flat[s:s + _ELEMWISE_BLOCK])
    return out.view(xp.shape)[..., :width]


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, native: bool = False) -> torch.Tensor:
    """``x / sqrt(mean(x²) + eps) * w`` in float32. The same kernels in the same order whatever
    the dtype (in place where the value is this function's own: the same bits, fewer
    allocations; a decode step calls this twice a layer). ``native``: attend.c's fixed
    sequence per row instead (the caller has checked :func:`native_rows_available`; float32
    ``x [M, K]``), one call."""
    if native:
        xr = x if x.stride(-1) == 1 else x.contiguous()
        return _native_attn.rms_norm(xr, w if w.is_contiguous() else w.contiguous(), eps)
    xf = x if x.dtype == torch.float32 else x.float()
    ms = xf.pow(2).mean(-1, keepdim=True)
    ms.add_(eps).rsqrt_()
    y = xf * ms
    y.mul_(w if w.dtype == torch.float32 else w.float())
    return y if x.dtype == torch.float32 else y.to(x.dtype)


def silu_mul(gu: torch.Tensor, inter: int, exact: bool = True, native: bool = False
             ) -> torch.Tensor:
    """The gated MLP's ``silu(g) * u`` for ``gu = [g | u]`` (``[M, 2 * inter]``). ``native``:
    one pass of attend.c's fixed sequence per element (the caller has checked
    :func:`native_rows_available`); else :func:`silu` and a product."""
    if native:
        return _native_attn.silu_mul(gu if gu.stride(-1) == 1 else gu.contiguous(), inter)
    g, u = gu.split(inter, dim=-1)
    return silu(g, exact) * u


def native_rows_available() -> bool:
    """Whether the exact CPU path's row operations (:func:`rms_norm`, :func:`silu_mul`,
    :func:`rope_write`) take attend.c now: the native kernels on and not the library mode.
    Read per forward: ``HICACHE_EXACT_NATIVE`` and ``HICACHE_EXACT_GEMM`` may change at run
    time, and one forward must not mix the two sequences."""
    return _exact.mode() != "library" and _native_attn.available()


def rope_tables(dim: int, max_pos: int, theta: float, device: torch.device | str,
                dtype: torch.dtype, llama3: tuple[float, float, float, int] | None = None,
                linear_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin`` of shape ``[max_pos, dim]`` (Hugging Face "rotate half" convention)."""
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    if llama3 is not None:
        factor, lo, hi, orig = llama3
        wavelen = 2 * math.pi / inv
        lo_wl, hi_wl = orig / lo, orig / hi
        smooth = (orig / wavelen - lo) / (hi - lo)
        scaled = torch.where(wavelen > lo_wl, inv / factor, inv)
        mid = (wavelen <= lo_wl) & (wavelen >= hi_wl)
        inv = torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
    pos = torch.arange(max_pos, dtype=torch.float64) / linear_factor
    ang = torch.outer(pos, inv)
    emb = torch.cat([ang, ang], dim=-1)
    return emb.cos().to(device, dtype), emb.sin().to(device, dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x [M, H, D]`` rotated by per-token ``cos, sin [M, D]``."""
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rot * sin[:, None, :]


def native_rope_available(exact: bool, dtype: torch.dtype, device: torch.device,
                          rope_dim: int, head_dim: int) -> bool:
    """Whether :func:`rope_write` serves a model: the exact CPU path in float32 with the
    native kernels on, and RoPE over the whole head."""
    return (exact and dtype == torch.float32 and device.type == "cpu" and rope_dim == head_dim
            and head_dim % 2 == 0 and native_rows_available())


def rope_write(qkv: torch.Tensor, Hq: int, Hkv: int, D: int, cos: torch.Tensor,
               sin: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
               slots: torch.Tensor) -> torch.Tensor:
    """``qkv [M, (Hq + 2 Hkv) D]`` after the QKV product: the queries rotated (returned,
    ``[M, Hq, D]``), the keys rotated and the values stored in row ``slots[m]`` of the pool's
    ``[slots, Hkv, D]`` tensors; the bits of :func:`apply_rope` and ``index_copy_``."""
    return _native_attn.rope_write(qkv, Hq, Hkv, D, cos, sin, k_pool, v_pool, slots)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
              scale: float, exact: bool = True, tail: bool = False) -> torch.Tensor:
    """Causal attention of queries at absolute positions ``q_pos`` over keys ``0..T-1``.

    ``q [M, Hq, Dk]``, ``k [T, Hkv, Dk]``, ``v [T, Hkv, Dv]`` (Hq a multiple of Hkv);
    returns ``[M, Hq, Dv]``. Query ``m`` sees keys ``0..q_pos[m]``. ``tail``: the caller
    promises the queries are the last ``M`` positions, ``q_pos == T-M .. T-1`` (a prefill or
    decode chunk over its own prefix), which lets the fused path skip the explicit mask.
    """
    if exact:
        return _attention_exact(q, k, v, q_pos, scale)
    if tail and _CAUSAL_MIN_QUERIES <= q.shape[0] <= k.shape[0] and _causal_tail_state["usable"]:
        try:
            return _attention_sdpa_tail(q, k, v, scale)
        except (RuntimeError, ValueError) as exc:   # a kernel refusing these shapes: masked path
            _disable_causal_tail(exc)
    return _attention_sdpa(q, k, v, q_pos, scale)


def attention_paged(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                    slots: torch.Tensor, q_pos: torch.Tensor, scale: float,
                    exact: bool = True) -> torch.Tensor:
    """:func:`attention` (``tail``) over keys read through a page table: key ``t`` is row
    ``slots[t]`` of the pool tensors ``[slots, Hkv, D]``. On the exact path with the native
    kernel the rows are read in place (the same bits as over the gathered rows); otherwise they
    are gathered first."""
    if (exact and _exact.mode() != "library" and q.dtype == k_pool.dtype == v_pool.dtype
            == torch.float32 and q.device.type == "cpu" and k_pool.is_contiguous()
            and v_pool.is_contiguous() and _native_attn.available()):
        return _native_attn.attention(q, k_pool, v_pool, q_pos, scale, slots=slots,
                                      threads=1 if _exact.mode() == "safe" else None)
    return attention(q, k_pool.index_select(0, slots), v_pool.index_select(0, slots), q_pos,
                     scale, exact, tail=True)


# Queries from which a tail chunk takes the fused causal path (fewer: decode and short chunks,
# where the masked path's score tensor is small anyway).
_CAUSAL_MIN_QUERIES = 64
_causal_tail_state = {"usable": True}


def _disable_causal_tail(exc: BaseException) -> None:
    import logging

    _causal_tail_state["usable"] = False
    logging.getLogger("hicache.model").warning(
        "fused causal attention refused (%s); using masked attention from now on",
        str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__)


def _attention_sdpa_tail(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         scale: float) -> torch.Tensor:
    """Fused attention for queries that are the last ``M`` of ``T`` positions: one call with a
    lower-right causal bias (query ``m`` sees keys ``0..T-M+m``), no mask in memory and no
    passes — the masked path needs ``M·T·heads`` scores per pass and, on a 32k-token prompt,
    a thousand passes per layer. The kv heads are repeated to the query heads (the fused
    kernels that take a causal bias do not all take grouped heads)."""
    from torch.nn.attention.bias import causal_lower_right

    M, Hq, _ = q.shape
    T, Hkv, _ = k.shape
    G = Hq // Hkv
    kt, vt = k.transpose(0, 1), v.transpose(0, 1)                       # [Hkv, T, D]
    if G > 1:
        kt, vt = kt.repeat_interleave(G, dim=0), vt.repeat_interleave(G, dim=0)
    o = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), kt.unsqueeze(0),
                                       vt.unsqueeze(0), attn_mask=causal_lower_right(M, T),
                                       scale=scale)
    return o[0].transpose(0, 1)


def _attention_exact(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                     scale: float) -> torch.Tensor:
    mode = _exact.mode()
    if (mode != "library" and q.dtype == k.dtype == v.dtype == torch.float32
            and q.device.type == "cpu" and _native_attn.available()):
        # invariant by construction, reading K/V where they are (native_attn.py)
        return _native_attn.attention(q, k, v, q_pos, scale,
                                      threads=1 if mode == "safe" else None)
    M, Hq, Dk = q.shape
    Hkv, Dv = k.shape[1], v.shape[2]
    G = Hq // Hkv
    out = q.new_empty((M, Hq, Dv))
    # Rows are (group member, query) pairs of one kv-head; split queries into passes whose
    # score tensor stays within budget.
    T_all = int(q_pos.max()) + 1
    per_query = Hkv * G * max(KEY_BLOCK, T_all)
    step = max(1, _SCORE_BUDGET // per_query)
    qh = (q * scale).view(M, Hkv, G, Dk)
    for s in range(0, M, step):
        e = min(M, s + step)
        out[s:e] = _attention_exact_pass(qh[s:e], k, v, q_pos[s:e]).to(out.dtype)
    return out


def _attention_exact_pass(qh: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          q_pos: torch.Tensor) -> torch.Tensor:
    M, Hkv, G, Dk = qh.shape
    Dv = v.shape[2]
    T = int(q_pos.max()) + 1                     # keys this pass can see
    nb = -(-T // KEY_BLOCK)
    Tp, KB, RT = nb * KEY_BLOCK, KEY_BLOCK, ATTN_ROW_TILE
    pad = Tp - T
    # Rows are (group member, query) pairs of one kv-head, row = g * M + m, padded to whole
    # tiles of RT rows (padding rows see every key; their results are dropped).
    R = G * M
    if _attention_tiles_adapt(Dk, Dv, qh.dtype, v.dtype):
        # a row's item bits do not follow the tile size: one tile of R rows rounded up to 16
        # for a decode step or a short chunk, else whole tiles of MAX_TILE rows
        RT = -(-R // _exact.TILE_STEP) * _exact.TILE_STEP if R <= _exact.MAX_TILE \
            else _exact.MAX_TILE
    Rp = max(RT, -(-R // RT) * RT)
    nt = Rp // RT
    rows = F.pad(qh.permute(1, 2, 0, 3).reshape(Hkv, R, Dk), (0, 0, 0, Rp - R))
    scores = rows.new_empty((Hkv, Rp, Tp))
    if _exact.width_free("scores", Dk, qh.dtype):
        # Scores: items [RT, Dk] @ [Dk, Tp] (a tile of rows by every key), reduction over Dk
        # only; the kernel gives a key's column the same bits whatever the item's width.
        kt = F.pad(k[:T], (0, 0, 0, 0, 0, pad)).permute(1, 2, 0).contiguous()  # [Hkv, Dk, Tp]
        if nt == 1:                              # one tile: the kv-heads are the items
            _exact.items("scores", rows, kt, out=scores)
        else:
            for h in range(Hkv):                 # the tiles are the items
                _exact.items("scores", rows[h].view(nt, RT, Dk), kt[h].expand(nt, Dk, Tp),
                             out=scores[h].view(nt, RT, Tp))
    else:
        # Scores: items [RT, Dk] @ [Dk, KB] (a tile of rows by a key block).
        kb = F.pad(k[:T], (0, 0, 0, 0, 0, pad)).view(nb, KB, Hkv, Dk).permute(2, 0, 3, 1) \
            .contiguous()                                              # [Hkv, nb, Dk, KB]
        for h in range(Hkv):
            if nt == 1:                          # one tile: the key blocks are the items
                r = _exact.items("scores", rows[h].expand(nb, RT, Dk), kb[h])  # [nb, RT, KB]
                scores[h].view(RT, nb, KB).copy_(r.transpose(0, 1))
                continue
            sv = scores[h].view(nt, RT, nb, KB)
            for b in range(nb):                  # the tiles are the items
                sv[:, :, b] = _exact.items("scores", rows[h].view(nt, RT, Dk),
                                           kb[h, b].expand(nt, Dk, KB))
    scores = scores.float()
    # Keys up to the lowest query position are visible to every row: mask only the rest.
    lo = int(q_pos.min()) + 1
    if lo < Tp:
        row_pos = q_pos.new_full((Rp,), T - 1)
        row_pos[:R] = q_pos.repeat(G)
        hidden = torch.arange(lo, Tp, device=qh.device).view(1, Tp - lo) > row_pos.view(Rp, 1)
        scores[..., lo:].masked_fill_(hidden, float("-inf"))
    # Row-wise softmax: max, exp and sum run along the row from key 0 (masked keys add exact
    # zeros), so a row's probabilities do not depend on the other rows or on trailing blocks.
    p = torch.softmax(scores, dim=-1).to(v.dtype)
    # P @ V: items [RT, KB] @ [KB, Dv] per key block, the blocks summed in order (trailing
    # blocks a row may not see are exact zeros: no-ops).
    vb = F.pad(v[:T], (0, 0, 0, 0, 0, pad)).view(nb, KB, Hkv, Dv).permute(2, 0, 1, 3) \
        .contiguous()                                                  # [Hkv, nb, KB, Dv]
    out = torch.empty((Hkv, R, Dv), dtype=torch.float32, device=qh.device)
    for h in range(Hkv):
        if nt == 1:
            pv = _exact.items("pv", p[h].view(RT, nb, KB).transpose(0, 1), vb[h])
            acc = pv[0].float()
            for b in range(1, nb):
                acc.add_(pv[b])
        else:
            ph = p[h].view(nt, RT, Tp)
            acc = _exact.items("pv", ph[:, :, :KB], vb[h, 0].expand(nt, KB, Dv)).float()
            for b in range(1, nb):
                acc.add_(_exact.items("pv", ph[:, :, b * KB:(b + 1) * KB],
                                      vb[h, b].expand(nt, KB, Dv)))
            acc = acc.view(Rp, Dv)
        out[h] = acc[:R]
    return out.view(Hkv, G, M, Dv).permute(2, 0, 1, 3).reshape(M, Hkv * G, Dv)


def _attention_tiles_adapt(Dk: int, Dv: int, qdt: torch.dtype, vdt: torch.dtype) -> bool:
    """Whether the score and ``P @ V`` items give a row the same bits in any tile size."""
    def operands(K: int, N: int, dt: torch.dtype):
        def make(T: int) -> tuple[torch.Tensor, torch.Tensor]:
            g = torch.Generator().manual_seed(T + K + N)
            return (torch.randn(1, T, K, generator=g).to(dt),
                    torch.randn(1, K, N, generator=g).to(dt))
        return make
    return (_exact.tiles(1, ("scores", Dk, KEY_BLOCK, qdt), operands(Dk, KEY_BLOCK, qdt))
            == [_exact.TILE_STEP]
            and _exact.tiles(1, ("pv", KEY_BLOCK, Dv, vdt), operands(KEY_BLOCK, Dv, vdt))
            == [_exact.TILE_STEP])


def _attention_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                    scale: float) -> torch.Tensor:
    M, Hq, _ = q.shape
    T, Hkv, Dv = v.shape
    out = q.new_empty((M, Hq, Dv))
    kt = k.transpose(0, 1).unsqueeze(0)           # [1, Hkv, T, Dk]
    vt = v.transpose(0, 1).unsqueeze(0)
    kpos = torch.arange(T, device=q.device)
    step = max(1, (1 << 24) // max(1, Hq * T))
    for s in range(0, M, step):
        e = min(M, s + step)
        mask = kpos.view(1, T) <= q_pos[s:e].view(-1, 1)
        o = F.scaled_dot_product_attention(
            q[s:e].transpose(0, 1).unsqueeze(0), kt, vt, attn_mask=mask.view(1, 1, e - s, T),
            scale=scale, enable_gqa=Hq != Hkv)
        out[s:e] = o[0].transpose(0, 1)
    return out
