"""The exact path's float32 attention in C: ``native/attend.c`` (built like
:mod:`engine.runtime.model.native_gemm`, the same switch ``HICACHE_EXACT_NATIVE``).

A query row's result is one fixed sequence over its own visible keys (each score an fma chain
over the head dim in order, the max, one vector exp, lane sums in key order, ``P @ V`` as fma
chains over the keys in order): batch invariant by construction, whatever the chunk, its other
rows or the thread count. It reads keys and values where they are (rows of
``[T, kv_heads, dim]``, or of the pool through a page table: no gather), transposes the keys
once per call into blocks of 16 that every block of rows reads, and keeps no score tensor of
the whole chunk; the torch path (:func:`engine.runtime.model.ops._attention_exact`) pads and
re-lays the prefix out per layer and chunk. Self-tested at load against a float64 reference,
for row invariance and for the page-table read.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from pathlib import Path

import torch

from engine.runtime.model import native_gemm

log = logging.getLogger("hicache.model")
_SOURCE = Path(__file__).with_name("native") / "attend.c"
_lock = threading.Lock()
_state: dict = {}


def available() -> bool:
    return native_gemm.enabled() and _fn() is not False


def describe() -> str:
    _fn()
    return _state.get("what", "")


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
              scale: float, threads: int | None = None,
              slots: torch.Tensor | None = None) -> torch.Tensor:
    """``q [M, Hq, D]``, ``k [T, Hkv, D]``, ``v [T, Hkv, Dv]`` float32 on CPU; query ``m``
    sees keys ``0 .. q_pos[m]``. Returns ``[M, Hq, Dv]``. ``slots``: key ``t`` is row
    ``slots[t]`` of ``k`` and ``v`` (a paged pool read in place, no gather; the same bits as
    attending over the gathered rows)."""
    fn = _fn()
    M, Hq, D = q.shape
    Hkv = k.shape[1]
    Dv = v.shape[2]
    qc = q.contiguous()
    kc = k if k.is_contiguous() else k.contiguous()
    vc = v if v.is_contiguous() else v.contiguous()
    pos = q_pos if q_pos.dtype == torch.int64 and q_pos.is_contiguous() else \
        q_pos.to(torch.int64).contiguous()
    sl = slots if slots is None or (slots.dtype == torch.int64 and slots.is_contiguous()) \
        else slots.to(torch.int64).contiguous()
    out = torch.empty((M, Hq, Dv), dtype=torch.float32)
    t = torch.get_num_threads() if threads is None else threads
    rc = fn(qc.data_ptr(), kc.data_ptr(), Hkv * D, vc.data_ptr(), Hkv * Dv,
            None if sl is None else sl.data_ptr(), 0 if sl is None else len(sl),
            pos.data_ptr(), out.data_ptr(), M, Hq, Hkv, D, Dv, float(scale), t)
    if rc == -3:                          # checked in C: the bounds of every query's read
        raise ValueError("native attention: a query would read past its page table "
                         "(fewer slots than visible keys, or a negative position)")
    if rc != 0:
        raise MemoryError("native attention: no memory for its score buffers")
    return out


def rope_write(qkv: torch.Tensor, Hq: int, Hkv: int, D: int, cos: torch.Tensor,
               sin: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
               slots: torch.Tensor) -> torch.Tensor:
    """The new tokens' queries rotated (returned ``[M, Hq, D]``), their keys rotated and their
    values written to row ``slots[m]`` of ``k_pool``/``v_pool`` (``[slots, Hkv, D]``): the
    bits of ``ops.apply_rope`` and ``index_copy_`` (elementwise products and sums, each rounded
    on its own), in one call. float32 on CPU, every operand contiguous."""
    _fn()
    M = qkv.shape[0]
    sl = slots if slots.dtype == torch.int64 and slots.is_contiguous() else \
        slots.to(torch.int64).contiguous()
    if len(sl) < M or cos.shape != (M, D) or sin.shape != (M, D) or \
            qkv.shape[1] != (Hq + 2 * Hkv) * D:
        raise ValueError("KV write: operands of other shapes than the new tokens")
    q = torch.empty((M, Hq, D), dtype=torch.float32)
    if _state["rope"](qkv.data_ptr(), M, Hq, Hkv, D, cos.data_ptr(), sin.data_ptr(),
                      q.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(), sl.data_ptr(),
                      min(k_pool.shape[0], v_pool.shape[0])) != 0:
        raise IndexError("KV write: a slot outside the pool")
    return q


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """``x [M, K]`` float32 on CPU (rows contiguous) normalised by its own root mean square
    and scaled by ``w [K]`` (attend.c's fixed sequence: the same bits for a row alone or among
    others, on every ISA body)."""
    _fn()
    M, K = x.shape
    if x.stride(1) != 1 or w.shape != (K,) or not w.is_contiguous() or w.dtype != torch.float32:
        raise ValueError("native rms_norm: operands of other shapes or layouts")
    out = torch.empty((M, K), dtype=torch.float32)
    _state["rms"](x.data_ptr(), x.stride(0), M, K, w.data_ptr(), float(eps), out.data_ptr())
    return out


def silu_mul(gu: torch.Tensor, inter: int) -> torch.Tensor:
    """``silu(g) * u`` for ``gu [M, 2 * inter]`` (``g`` then ``u``, rows contiguous), float32
    on CPU, in one pass (attend.c's fixed sequence per element)."""
    _fn()
    M = gu.shape[0]
    if gu.shape[1] != 2 * inter or gu.stride(1) != 1 or gu.dtype != torch.float32:
        raise ValueError("native silu_mul: operands of other shapes or layouts")
    out = torch.empty((M, inter), dtype=torch.float32)
    _state["silu"](gu.data_ptr(), gu.stride(0), M, inter, out.data_ptr())
    return out


def reset() -> None:
    with _lock:
        _state.clear()


def _fn():
    fn = _state.get("fn")
    if fn is None:
        with _lock:
            if _state.get("fn") is None:
                try:
                    lib, so = native_gemm.load_library(_SOURCE)
                    fn = lib.hicache_attend
                    fn.restype = ctypes.c_int
                    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                   ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                                   ctypes.c_int64,
                                   ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                   ctypes.c_int64,
                                   ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                   ctypes.c_float, ctypes.c_int32]
                    from engine.runtime.model import native_pool

                    native_pool.attach(lib)
                    rope = lib.hicache_rope_write
                    rope.restype = ctypes.c_int
                    rope.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                     ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                     ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                     ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
                    _state["rope"] = rope
                    rms = lib.hicache_rms_norm
                    rms.restype = None
                    rms.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                    ctypes.c_int64, ctypes.c_void_p, ctypes.c_float,
                                    ctypes.c_void_p]
                    _state["rms"] = rms
                    silu = lib.hicache_silu_mul
                    silu.restype = None
                    silu.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                     ctypes.c_int64, ctypes.c_void_p]
                    _state["silu"] = silu
                    _state["lib"] = lib          # (native_layers binds hicache_layers)
                    _state["fn"] = fn
                    _self_test()
                    _state["what"] = f"native ({so.name})"
                except Exception as exc:  # any failure falls back, reported once
                    _state["fn"] = False
                    _state["what"] = f"torch (native attention unavailable: {exc})"
                log.info("exact attention: %s", _state["what"])
            fn = _state["fn"]
    return fn


def _self_test() -> None:
    g = torch.Generator().manual_seed(3)
    M, Hq, Hkv, D, Dv, T = 25, 6, 2, 40, 72, 53     # 75 rows a kv-head: the long path
    q = torch.randn(M, Hq, D, generator=g)
    k, v = torch.randn(T, Hkv, D, generator=g), torch.randn(T, Hkv, Dv, generator=g)
    pos = torch.arange(T - M, T)
    whole = attention(q, k, v, pos, 0.3, threads=1)
    G = Hq // Hkv
    s = torch.einsum("mhd,thd->hmt", q.double() * 0.3, k.double().repeat_interleave(G, 1))
    s = s.masked_fill(torch.arange(T)[None, None, :] > pos[None, :, None], float("-inf"))
    ref = torch.einsum("hmt,thd->mhd", s.softmax(-1), v.double().repeat_interleave(G, 1))
    if not torch.allclose(whole.double(), ref, rtol=1e-4, atol=1e-5):
        raise RuntimeError("the built kernel failed its self-test (values)")
    perm = torch.randperm(T + 5, generator=g)[:T]            # keys scattered in a "pool"
    kp, vp = torch.zeros(T + 5, Hkv, D), torch.zeros(T + 5, Hkv, Dv)
    kp[perm], vp[perm] = k, v
    if not torch.equal(attention(q, kp, vp, pos, 0.3, threads=2, slots=perm), whole):
        raise RuntimeError("the built kernel failed its self-test (slots)")
    x, w = torch.randn(7, 300, generator=g) * 4, torch.randn(300, generator=g)
    want = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-5) * w.double()
    if not torch.allclose(rms_norm(x, w, 1e-5).double(), want, rtol=1e-5, atol=1e-6):
        raise RuntimeError("the built kernel failed its self-test (rms_norm)")
    gu = torch.randn(5, 2 * 150, generator=g) * 6
    gd = gu.double()
    want = torch.nn.functional.silu(gd[:, :150]) * gd[:, 150:]
    if not torch.allclose(silu_mul(gu, 150).double(), want, rtol=1e-5, atol=1e-6):
        raise RuntimeError("the built kernel failed its self-test (silu_mul)")
    for lo, hi, t in ((4, 5, 1), (0, 9, 3), (7, 21, 2), (3, 25, 2)):   # short, short, long
        if not torch.equal(attention(q[lo:hi], k[:int(pos[hi - 1]) + 1], v[:int(pos[hi - 1]) + 1],
                                     pos[lo:hi], 0.3, threads=t), whole[lo:hi]):
            raise RuntimeError("the built kernel failed its self-test (row bits)")
