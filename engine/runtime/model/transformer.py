"""The decoder: a Llama-style transformer whose attention reads KV from the paged L1 pool.

One forward pass runs a batch of *chunks* (continuous batching): each chunk is some new tokens of
one request at consecutive positions, plus that request's page table (L1 page ids covering every
position up to the chunk's end). Per layer, the forward

1. computes Q/K/V for all new tokens of all chunks at once (one batch-invariant GEMM),
2. writes the new K/V into the chunk's slots of ``pool.buf[layer]``
   (slot of position ``x`` = ``pages[x // page_size] * page_size + x % page_size``),
3. calls every layer hook with the layer index (the facade's ``LoadHandle.wait_layer``: a
   prefix being loaded back from L2 only has to be in L1 for the layer about to attend),
4. attends, per chunk, over the chunk's keys gathered from the pool through its page table.

The model never allocates pages or touches the tree: the scheduler owns that.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import torch

from engine.core.layout import KVLayout, torch_dtype
from engine.runtime.model import native_layers, ops
from engine.runtime.model.config import ModelConfig
from engine.runtime.model.weights import LayerWeights, ModelWeights

LayerHook = Callable[[int], None]


class PoolKV:
    """Where a forward pass keeps and finds KV: the paged L1 pool. New K/V goes to the chunks'
    slots; each chunk's keys are read through its page table. (Context parallelism swaps in a
    sharded implementation of the same three calls: ``engine.runtime.ranks.cp_kv.ShardedKV``.)"""

    def __init__(self, kv: torch.Tensor, write_slots: torch.Tensor,
                 key_slots: list[torch.Tensor]):
        self.kv, self.write_slots, self.key_slots = kv, write_slots, key_slots

    def write(self, layer: int, kinds: Sequence[torch.Tensor]) -> None:
        """Store the new tokens' K/V of ``layer`` (one ``[n_new, heads, dim]`` per kind)."""
        for kind, t in enumerate(kinds):
            self.kv[layer, kind].index_copy_(0, self.write_slots, t)

    def keys(self, layer: int, chunk: int) -> tuple[torch.Tensor, ...]:
        """Chunk ``chunk``'s K/V for positions ``0 … end-1`` in logical order, per kind."""
        slots = self.key_slots[chunk]
        return tuple(self.kv[layer, kind].index_select(0, slots)
                     for kind in range(self.kv.shape[1]))

    def done(self, layer: int) -> None:
        """``layer``'s attention no longer needs what :meth:`keys` read."""


@dataclasses.dataclass
class Chunk:
    """New tokens of one request for one forward pass.

    ``tokens`` sit at positions ``start .. start + len(tokens) - 1``; ``pages`` are the
    request's L1 page ids covering positions ``0 .. start + len(tokens) - 1`` (at least).
    ``logits``: whether the caller wants the next-token logits after the last token;
    ``all_logits``: after every token instead (``len(tokens)`` rows: prompt logprobs).
    """

    tokens: Sequence[int] | np.ndarray
    start: int
    pages: np.ndarray
    logits: bool = True
    all_logits: bool = False

    def __len__(self) -> int:
        return len(self.tokens)


class Model:
    """A decoder with fixed weights. Thread-compatible (one forward at a time)."""

    def __init__(self, cfg: ModelConfig, weights: ModelWeights, device: str = "cpu",
                 exact: bool | None = None):
        self.cfg = cfg
        self.stage: tuple[int, int] | None = None   # pipeline stage: (first layer, all layers)
        # tensor parallelism (engine.runtime.model.tp): (rank, size, first kv-head, all
        # kv-heads) and the all-reduce that completes the row-parallel projections
        self.tp: tuple[int, int, int, int] | None = None
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.device = torch.device(device)
        self.dtype = torch_dtype(cfg.dtype)
        self.w = weights.to(self.device, self.dtype)
        # Exact (batch-invariant) kernels by default on CPU, fused SDPA on CUDA.
        self.exact = (self.device.type == "cpu") if exact is None else exact
        if cfg.gemm_dtype != "float32":
            self._gemms_in(cfg.gemm_dtype)
        self.cos, self.sin = ops.rope_tables(cfg.rope_dim, cfg.max_context, cfg.rope_theta,
                                             self.device, self.dtype, cfg.rope_llama3,
                                             cfg.rope_linear_factor)
        if cfg.is_mla:
            self.scale = 1.0 / math.sqrt(cfg.qk_nope_dim + cfg.qk_rope_dim)
        else:
            self.scale = 1.0 / math.sqrt(cfg.head_dim)

    def _gemms_in(self, dtype: str) -> None:
        """The weight products in ``dtype`` (bfloat16): only the exact CPU path has such a
        kernel (native_gemm's, invariant by construction); the weights are packed now."""
        from engine.runtime.model import native_gemm

        if self.device.type != "cpu" or not self.exact or self.dtype != torch.float32:
            raise ValueError(f"--gemm-dtype {dtype} needs the exact CPU path with float32 "
                             f"weights (this model: {self.device.type}, exact "
                             f"{'on' if self.exact else 'off'}, {self.cfg.dtype})")
        if not native_gemm.bf16_available():
            raise ValueError(f"--gemm-dtype {dtype}: {native_gemm._state.get('bf16_what')}; "
                             f"use float32")
        def tagged(t: torch.Tensor) -> torch.Tensor:
            v = t.view(t.shape)            # a tensor object of this model's own (same bytes):
            v._hicache_gemm = dtype        # another model of the same weights keeps float32
            native_gemm.pack_bf16(v)
            return v

        def layer(lw: Any) -> Any:
            return dataclasses.replace(lw, **{f.name: tagged(getattr(lw, f.name))
                                              for f in dataclasses.fields(lw)
                                              if getattr(lw, f.name) is not None
                                              and getattr(lw, f.name).dim() == 2})

        self.w = dataclasses.replace(self.w, layers=[layer(lw) for lw in self.w.layers],
                                     lm_head=tagged(self.w.lm_head))

    @property
    def name(self) -> str:
        return self.cfg.name

    def kv_layout(self, page_size: int) -> KVLayout:
        """What one page of this model's KV holds; a pipeline stage's layers and a TP rank's
        kv-heads sit at their place in the whole model (``layer_start``/``total_layers``,
        ``head_start``/``total_kv_heads``), so their L3 keys are their own."""
        layout = self.cfg.kv_layout(page_size)
        if self.stage is not None:
            lo, total = self.stage
            layout = dataclasses.replace(layout, layer_start=lo, total_layers=total)
        if self.tp is not None:
            _, _, h0, heads = self.tp
            layout = dataclasses.replace(layout, head_start=h0, total_kv_heads=heads)
        return layout

    def _reduced(self, partial: torch.Tensor) -> torch.Tensor:
        """A row-parallel projection's output summed over the TP group (as is without TP)."""
        return partial if self.reduce is None else self.reduce(partial)

    # -- forward ---------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, chunks: Sequence[Chunk], kv: "torch.Tensor | PoolKV", page_size: int,
                layer_hooks: Iterable[LayerHook] = (), *, hidden_in: torch.Tensor | None = None,
                hidden_out: bool = False) -> torch.Tensor:
        """Run ``chunks``; returns float32 logits ``[n, vocab]``: one row per chunk with
        ``logits``, ``len(chunk)`` rows per chunk with ``all_logits``, in chunk order.

        ``kv`` is the L1 buffer ``[layers, kv_kinds, slots, kv_heads, head_dim]``
        (``cache.l1.buf``). New K/V is written into it. Or an object with
        :class:`PoolKV`'s ``write``/``keys``/``done`` (the chunks' page tables are then its
        business).
        """
        cfg = self.cfg
        hooks = list(layer_hooks)
        if not chunks:
            return torch.empty((0, cfg.vocab_size), dtype=torch.float32, device=self.device)
        lens = [len(c) for c in chunks]
        for c, n in zip(chunks, lens):
            if n < 1:
                raise ValueError("a chunk needs at least one token")
            if c.start + n > cfg.max_context:
                raise ValueError(f"position {c.start + n - 1} beyond max context "
                                 f"{cfg.max_context}")
        dev = self.device
        ids = torch.as_tensor(np.concatenate([np.asarray(c.tokens, dtype=np.int64)
                                              for c in chunks]), device=dev)
        pos_np = np.concatenate([np.arange(c.start, c.start + n, dtype=np.int64)
                                 for c, n in zip(chunks, lens)])
        pos = torch.as_tensor(pos_np, device=dev)
        new_slots, key_slots, bounds = [], [], []
        off = 0
        for c, n in zip(chunks, lens):
            pages = np.asarray(c.pages, dtype=np.int64)
            end = c.start + n
            if len(pages) * page_size < end:
                raise ValueError(f"page table covers {len(pages) * page_size} positions, "
                                 f"chunk ends at {end}")
            bounds.append((off, off + n))
            off += n
            if not isinstance(kv, torch.Tensor):
                continue
            all_pos = np.arange(end, dtype=np.int64)
            slots = pages[all_pos // page_size] * page_size + all_pos % page_size
            key_slots.append(torch.as_tensor(slots, device=dev))
            new_slots.append(key_slots[-1][c.start:end])
        io = PoolKV(kv, torch.cat(new_slots), key_slots) if isinstance(kv, torch.Tensor) else kv
        cos, sin = self.cos[pos], self.sin[pos]

        # A pipeline stage after the first continues from the previous stage's hidden states;
        # one before the last hands its hidden states on instead of computing logits.
        x = self.w.embed[ids] if hidden_in is None else hidden_in.to(dev, self.dtype)
        native = self._native_rows()          # once per forward: one sequence throughout
        # every layer in one native call where it serves: the same calls with the same
        # operands (the same bits), without the Python between them (native_layers.py)
        fused = native_layers.usable(self, native, hooks, type(io) is PoolKV, kv)
        if fused:
            assert isinstance(kv, torch.Tensor)
            x = native_layers.run(self, x, kv, io.write_slots, io.key_slots, bounds, pos,
                                  cos, sin)
        for li, lw in enumerate(() if fused else self.w.layers):
            h = ops.rms_norm(x, lw.attn_norm, cfg.rms_eps, native)
            if cfg.is_mla:
                attn = self._mla(lw, li, h, cos, sin, io, bounds, pos, hooks, native)
            else:
                attn = self._gqa(lw, li, h, cos, sin, io, bounds, pos, hooks, native)
            x = x + self._reduced(ops.linear(attn, lw.wo, self.exact))
            h = ops.rms_norm(x, lw.mlp_norm, cfg.rms_eps, native)
            gu = ops.linear(h, lw.w_gate_up, self.exact)
            x = x + self._reduced(ops.linear(ops.silu_mul(gu, cfg.intermediate, self.exact,
                                                          native), lw.w_down, self.exact))

        if hidden_out:
            return x
        want = [i for c, b in zip(chunks, bounds)
                for i in (range(b[0], b[1]) if c.all_logits else [b[1] - 1] if c.logits else [])]
        if not want:
            return torch.empty((0, cfg.vocab_size), dtype=torch.float32, device=dev)
        last = x[torch.as_tensor(want, device=dev)]
        last = ops.rms_norm(last, self.w.final_norm, cfg.rms_eps, native)
        return ops.linear(last, self.w.lm_head, self.exact).float()

    def _gqa(self, lw: LayerWeights, li: int, h: torch.Tensor, cos: torch.Tensor,
             sin: torch.Tensor, io: PoolKV, bounds: list[tuple[int, int]], pos: torch.Tensor,
             hooks: list[LayerHook], native: bool) -> torch.Tensor:
        cfg = self.cfg
        M = h.shape[0]
        Hq, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        qkv = ops.linear(h, lw.wqkv, self.exact)
        paged = type(io) is PoolKV             # read the pool through the page table
        if paged and native and self._native_rope(qkv, cos, io.kv):
            # RoPE and the pool write in one native call (the same bits as below)
            q = ops.rope_write(qkv, Hq, Hkv, D, cos, sin, io.kv[li, 0], io.kv[li, 1],
                               io.write_slots)
        else:
            q, k, v = qkv.split([Hq * D, Hkv * D, Hkv * D], dim=-1)
            q = ops.apply_rope(q.reshape(M, Hq, D), cos, sin)
            k = ops.apply_rope(k.reshape(M, Hkv, D), cos, sin)
            io.write(li, (k, v.reshape(M, Hkv, D)))
        for hook in hooks:
            hook(li)
        out = torch.empty_like(q)
        for i, (s, e) in enumerate(bounds):
            if paged:
                out[s:e] = ops.attention_paged(q[s:e], io.kv[li, 0], io.kv[li, 1],
                                               io.key_slots[i], pos[s:e], self.scale,
                                               self.exact)
                continue
            keys, values = io.keys(li, i)
            out[s:e] = ops.attention(q[s:e], keys, values, pos[s:e], self.scale, self.exact,
                                     tail=True)
        io.done(li)
        return out.reshape(M, Hq * D)

    def _native_rows(self) -> bool:
        """Whether this forward's row operations (RMS norm, the MLP's activation, RoPE and the
        KV write) take attend.c's kernels: the exact CPU path in float32 (fixed for the model)
        with the native kernels on now (ops.native_rows_available, read per forward)."""
        ok = self.__dict__.get("_rows_ok")
        if ok is None:
            ok = self._rows_ok = (self.exact and self.dtype == torch.float32
                                  and self.device.type == "cpu")
        return ok and ops.native_rows_available()

    def _native_rope(self, qkv: torch.Tensor, cos: torch.Tensor, kv: torch.Tensor) -> bool:
        """Whether this layer's RoPE and KV write can take the native call (this forward's
        row operations are native): full-width rotary, contiguous float32 operands."""
        ok = self.__dict__.get("_rope_ok")
        if ok is None:
            ok = self._rope_ok = self.cfg.rope_dim == self.cfg.head_dim \
                and self.cfg.head_dim % 2 == 0
        return ok and qkv.is_contiguous() and cos.is_contiguous() and kv.is_contiguous() \
            and kv.dtype == torch.float32

    def _mla(self, lw: LayerWeights, li: int, h: torch.Tensor, cos: torch.Tensor,
             sin: torch.Tensor, io: PoolKV, bounds: list[tuple[int, int]], pos: torch.Tensor,
             hooks: list[LayerHook], native: bool) -> torch.Tensor:
        """Absorbed MLA: attention runs in the latent space against one cached vector/token."""
        cfg = self.cfg
        M = h.shape[0]
        Hq, dn, dr, dc, dv = (cfg.num_heads, cfg.qk_nope_dim, cfg.qk_rope_dim,
                              cfg.kv_lora_rank, cfg.v_head_dim)
        q = ops.linear(h, lw.wq, self.exact).reshape(M, Hq, dn + dr)
        q_nope, q_rope = q.split([dn, dr], dim=-1)
        q_rope = ops.apply_rope(q_rope, cos, sin)
        # q_lat[h] = q_nope[h] @ W_uk[h]: [Hq, M, dn] @ [Hq, dn, dc]
        q_lat = ops.bmm(q_nope.transpose(0, 1), lw.w_uk, self.exact).transpose(0, 1)
        q_full = torch.cat([q_lat, q_rope], dim=-1)                  # [M, Hq, dc + dr]
        ckv = ops.linear(h, lw.wkv_a, self.exact)                    # [M, dc + dr]
        c, kr = ckv.split([dc, dr], dim=-1)
        c = ops.rms_norm(c, lw.kv_norm, cfg.rms_eps, native)
        kr = ops.apply_rope(kr.reshape(M, 1, dr), cos, sin).reshape(M, dr)
        io.write(li, (torch.cat([c, kr], dim=-1).reshape(M, 1, dc + dr),))
        for hook in hooks:
            hook(li)
        o_lat = torch.empty((M, Hq, dc + dr), dtype=h.dtype, device=h.device)
        paged = type(io) is PoolKV
        for i, (s, e) in enumerate(bounds):
            if paged:
                o_lat[s:e] = ops.attention_paged(q_full[s:e], io.kv[li, 0], io.kv[li, 0],
                                                 io.key_slots[i], pos[s:e], self.scale,
                                                 self.exact)
                continue
            keys, = io.keys(li, i)
            o_lat[s:e] = ops.attention(q_full[s:e], keys, keys, pos[s:e], self.scale,
                                       self.exact, tail=True)
        io.done(li)
        # o[h] = o_lat[h][:dc] @ W_uv[h]: [Hq, M, dc] @ [Hq, dc, dv]
        o = ops.bmm(o_lat[..., :dc].transpose(0, 1).contiguous(), lw.w_uv, self.exact)
        return o.transpose(0, 1).reshape(M, Hq * dv)
