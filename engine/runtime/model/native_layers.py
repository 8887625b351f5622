"""A forward's stack of decoder layers in one native call: ``hicache_layers`` of
``native/attend.c`` (the attention library), the products by ``native/rowdot.c``'s kernel
(handed over as a function pointer).

It makes, layer by layer, the calls the Python forward (:mod:`engine.runtime.model.transformer`)
makes — RMS norm, the QKV product, RoPE and the KV write, attention per chunk through its page
table, the output product and its residual add, RMS norm, the gate/up product, ``silu(g) * u``,
the down product and its residual add — with the same operands and thread counts, so every
value, the KV written to the pool included, has the same bits (tests/test_native_layers.py
compares logits and pool bytes with the Python loop). What goes is the Python between the
calls: about 150 us a layer, a fifth of a decode step of smollm2-135m on 2 cores.

It serves the plain case only, which :func:`usable` decides per forward: the exact CPU path in
float32 with the native kernels on (the forward's ``native_rows``: not the library mode; the
safe mode runs it on one thread), grouped-query attention over the L1 pool read in place, RoPE over the
whole head, no layer hooks (a prefix loading back), no tensor-parallel reduce, float32
products. Anything else takes the Python loop, as before.
"""

from __future__ import annotations

import ctypes
from typing import Any, Sequence

import torch

from engine.runtime.model import exact as _exact
from engine.runtime.model import native_attn, native_gemm, native_quant

_P = ctypes.c_void_p
_I = ctypes.c_int64


class _Layer(ctypes.Structure):
    _fields_ = [("attn_norm", _P), ("mlp_norm", _P), ("wqkv", _P), ("wo", _P), ("wgu", _P),
                ("wdown", _P), ("qqkv", _P), ("qo", _P), ("qgu", _P), ("qdown", _P),
                ("kqkv", ctypes.c_int32), ("ko", ctypes.c_int32), ("kgu", ctypes.c_int32),
                ("kdown", ctypes.c_int32)]


class _Fwd(ctypes.Structure):
    _fields_ = [("M", _I), ("hidden", _I), ("Hq", _I), ("Hkv", _I), ("D", _I), ("inter", _I),
                ("nslots", _I), ("eps", ctypes.c_float), ("scale", ctypes.c_float),
                ("kv", _P), ("kv_layer", _I), ("kv_kind", _I),
                ("x", _P), ("h", _P), ("qkv", _P), ("q", _P), ("att", _P), ("gu", _P),
                ("act", _P), ("y", _P), ("cos", _P), ("sin", _P), ("write_slots", _P),
                ("pos", _P), ("nchunk", _I), ("bounds", _P), ("key_slots", _P),
                ("key_count", _P), ("threads", ctypes.c_int32), ("attn_threads", ctypes.c_int32),
                ("rowdot", _P), ("rowdot_quant", _P), ("quant_rows", _I)]


def _fn() -> Any:
    """``hicache_layers`` and the products' kernel address, or None where either is off."""
    if not native_attn.available() or not native_gemm.available():
        return None
    st = native_attn._state
    got = st.get("layers")
    if got is None:
        lib = st.get("lib")
        fn = getattr(lib, "hicache_layers", None) if lib is not None else None
        rowdot = native_gemm._state.get("fn")
        if fn is None or not rowdot:
            got = False
        else:
            fn.restype = ctypes.c_int
            fn.argtypes = [_P, _I, _P]
            got = (fn, ctypes.cast(rowdot, _P).value)
        st["layers"] = got
    return got or None


def usable(model: Any, native_rows: bool, hooks: Sequence, paged: bool, kv: Any) -> bool:
    """Whether this forward's layers can take the one call (see the module docstring)."""
    cfg = model.cfg
    return (native_rows and paged and not hooks and model.reduce is None and not cfg.is_mla
            and model.__dict__.get("_rope_ok") is not False
            and cfg.gemm_dtype == "float32" and cfg.rope_dim == cfg.head_dim
            and cfg.head_dim % 2 == 0 and isinstance(kv, torch.Tensor) and kv.dtype == torch.float32
            and kv.is_contiguous() and _fn() is not None)


def _layers_of(model: Any) -> tuple[Any, list]:
    """The layers' weight table (made once per model: the weights are read-only once loaded),
    and the tensors it points into (kept alive with it)."""
    got = model.__dict__.get("_native_layer_table")
    if got is not None:
        return got
    keep: list = []
    table = (_Layer * len(model.w.layers))()
    for i, lw in enumerate(model.w.layers):
        parts = [lw.attn_norm.contiguous(), lw.mlp_norm.contiguous(), native_gemm.pack(lw.wqkv),
                 native_gemm.pack(lw.wo), native_gemm.pack(lw.w_gate_up),
                 native_gemm.pack(lw.w_down)]
        # the GGUF's blocks of each product where they give its exact values (else 0)
        quant = [native_quant.panels(w) for w in (lw.wqkv, lw.wo, lw.w_gate_up, lw.w_down)]
        keep += parts + [q[1] for q in quant if q is not None]
        table[i] = _Layer(*[t.data_ptr() for t in parts],
                          *[0 if q is None else q[1].data_ptr() for q in quant],
                          *[0 if q is None else q[0] for q in quant])
    model._native_layer_table = (table, keep)
    return model._native_layer_table


def run(model: Any, x: torch.Tensor, kv: torch.Tensor, write_slots: torch.Tensor,
        key_slots: list[torch.Tensor], bounds: list[tuple[int, int]], pos: torch.Tensor,
        cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Every layer of ``model`` over the hidden states ``x [M, hidden]`` (not modified); the
    new tokens' K/V are written to ``kv`` (``[layers, 2, slots, Hkv, D]``) at
    ``write_slots``; chunk ``c`` is rows ``bounds[c]`` and reads its keys at ``key_slots[c]``.
    Returns the hidden states after the last layer."""
    fn, rowdot = _fn()
    cfg = model.cfg
    table, _ = _layers_of(model)
    M = x.shape[0]
    d, Hq, Hkv, D, inter = cfg.hidden, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, \
        cfg.intermediate
    W = (Hq + 2 * Hkv) * D
    out = x.to(torch.float32).contiguous().clone()
    widths = (d, W, Hq * D, Hq * D, 2 * inter, inter, d)      # h, qkv, q, att, gu, act, y
    scratch = torch.empty(M * sum(widths), dtype=torch.float32)
    ptrs, off = [], 0
    for w in widths:
        ptrs.append(scratch.data_ptr() + 4 * off)
        off += M * w
    sl = [s if s.dtype == torch.int64 and s.is_contiguous() else s.to(torch.int64).contiguous()
          for s in key_slots]
    key_ptrs = (_P * len(sl))(*[s.data_ptr() for s in sl])
    key_count = (_I * len(sl))(*[len(s) for s in sl])
    bnd = (_I * (len(bounds) + 1))(*([b[0] for b in bounds] + [bounds[-1][1]]))
    ws = write_slots.to(torch.int64).contiguous()
    ps = pos.to(torch.int64).contiguous()
    cs, sn = cos.contiguous(), sin.contiguous()
    fq = native_quant.kernel()
    quant = ctypes.cast(fq, _P).value if fq is not None else 0
    safe = _exact.mode() == "safe"
    threads = 1 if safe else torch.get_num_threads()
    f = _Fwd(M, d, Hq, Hkv, D, inter, kv.shape[2], cfg.rms_eps, model.scale,
             kv.data_ptr(), kv.stride(0), kv.stride(1),
             out.data_ptr(), *ptrs, cs.data_ptr(), sn.data_ptr(), ws.data_ptr(), ps.data_ptr(),
             len(sl), ctypes.addressof(bnd), ctypes.addressof(key_ptrs),
             ctypes.addressof(key_count), threads, threads, rowdot, quant, native_quant.ROWS)
    rc = fn(ctypes.addressof(table), len(model.w.layers), ctypes.byref(f))
    if rc == -3:
        raise ValueError("native layers: a query would read past its page table")
    if rc == -5:
        raise IndexError("native layers: a new token's slot is outside the pool")
    if rc != 0:
        raise MemoryError("native layers: no memory for attention's score buffers")
    return out
