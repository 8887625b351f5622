"""The exact path's float32 products in C: ``native/rowdot.c``, built once per machine.

Each output element of ``x @ w.T`` is computed by one fixed sequence (one accumulator, a fused
multiply-add per reduction index, in order), whatever the row count, the blocking or the thread
count: batch invariant by construction, not by a check. The weight is packed once into panels
of 32 columns (kept beside the weight: about the weights' size again), so a block of 12 rows reads
each weight value once and a decode step streams the weights once, where the torch items
(:mod:`engine.runtime.model.exact`) pad a decode step to 16 rows and go through the library's
packing for every item.

Built with the system C compiler for this CPU (``-march=native``: AVX-512 where the CPU has
it, else the same arithmetic one lane at a time) into the per-user cache directory the host
copies use (:mod:`engine.cache.hostcopy`), and self-tested against a float64 reference and
for invariance before use. ``HICACHE_EXACT_NATIVE=0`` turns it off (the torch items then take
every product); no compiler or a failed build does the same, logged once.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import threading
from pathlib import Path

import torch

from engine.core import native
from engine.runtime.model import native_quant

log = logging.getLogger("hicache.model")

ENV = "HICACHE_EXACT_NATIVE"
_SOURCE = Path(__file__).with_name("native") / "rowdot.c"
_FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-shared", "-fPIC", "-pthread"]

_lock = threading.Lock()
_state: dict = {}          # "fn": the C function or False; "what": a line for reports


def enabled() -> bool:
    """``HICACHE_EXACT_NATIVE`` is not ``0``."""
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def available() -> bool:
    """Whether the native kernel is on (built, loaded, self-tested, not turned off)."""
    return enabled() and _fn() is not False


def describe() -> str:
    _fn()
    return _state.get("what", "")


def linear(x: torch.Tensor, w: torch.Tensor, threads: int | None = None) -> torch.Tensor:
    """``x [M, K] @ w.T`` (``w [N, K]``), float32 on CPU, each element's bits its own."""
    fn = _fn()
    xc = x if x.is_contiguous() else x.contiguous()
    M, K = xc.shape
    N = w.shape[0]
    out = torch.empty((M, N), dtype=torch.float32)
    # threads start per call: a small product (a decode step's) takes fewer (same bits)
    t = torch.get_num_threads() if threads is None else threads
    t = max(1, min(t, (M * N * K) >> 15))
    if native_quant.product(xc, w, out, t):   # (at most native_quant.ROWS rows)
        return out                    # from the GGUF's blocks: the same bits, fewer bytes
    packed = pack(w)
    fn(xc.data_ptr(), K, packed.data_ptr(), out.data_ptr(), N, M, N, K, t)
    return out


def pack(w: torch.Tensor) -> torch.Tensor:
    """``w [N, K]`` as panels ``[ceil(N/32), K, 32]`` (columns past N zero), made once per
    weight tensor and kept on it (a weight is read-only once loaded)."""
    got = getattr(w, "_hicache_panels", None)
    if got is not None and got[0] == (w.data_ptr(), tuple(w.shape), tuple(w.stride())):
        return got[1]
    N, K = w.shape
    n_pad = -(-N // 32) * 32
    wp = w.detach().float()
    if n_pad != N:
        wp = torch.cat([wp, wp.new_zeros((n_pad - N, K))])
    panels = wp.reshape(n_pad // 32, 32, K).transpose(1, 2).contiguous()
    w._hicache_panels = ((w.data_ptr(), tuple(w.shape), tuple(w.stride())), panels)
    return panels


def pack_bf16(w: torch.Tensor) -> torch.Tensor:
    """``w [N, K]`` rounded to bfloat16 (nearest even) as panels of 32 columns by pairs of the
    reduction index, ``[ceil(N/32), ceil(K/2), 32, 2]`` (zeros past N and K; rowdot.c's
    ``hicache_rowdot_bf16``); made once per weight and kept on it (half the float32 bytes)."""
    got = getattr(w, "_hicache_bf16_panels", None)
    if got is not None and got[0] == (w.data_ptr(), tuple(w.shape), tuple(w.stride())):
        return got[1]
    N, K = w.shape
    n_pad, k_pad = -(-N // 32) * 32, K + (K & 1)
    wp = torch.zeros((n_pad, k_pad), dtype=torch.bfloat16)
    wp[:N, :K] = w.detach().to(torch.bfloat16)
    panels = wp.reshape(n_pad // 32, 32, k_pad // 2, 2).transpose(1, 2).contiguous()
    w._hicache_bf16_panels = ((w.data_ptr(), tuple(w.shape), tuple(w.stride())), panels)
    return panels


def bf16_available() -> bool:
    """Whether the bfloat16 kernel is on (this CPU has AVX512_BF16; built and self-tested)."""
    return enabled() and _fn_bf16() is not False


def linear_bf16(x: torch.Tensor, w: torch.Tensor, threads: int | None = None) -> torch.Tensor:
    """``bf16(x [M, K]) @ bf16(w).T`` accumulated in float32 on CPU, each element's bits its
    own (rowdot.c). ``w`` is float32; its bf16 panels are made once (:func:`pack_bf16`)."""
    fn = _fn_bf16()
    if fn is False:
        raise RuntimeError(f"bfloat16 products are not available here: {_state.get('bf16_what')}")
    xc = x if x.is_contiguous() else x.contiguous()
    M, K = xc.shape
    N = w.shape[0]
    packed = pack_bf16(w)
    out = torch.empty((M, N), dtype=torch.float32)
    t = torch.get_num_threads() if threads is None else threads
    t = max(1, min(t, (M * N * K) >> 19))
    rc = fn(xc.data_ptr(), K, packed.data_ptr(), out.data_ptr(), N, M, N, K, t)
    if rc == -2:
        raise MemoryError("bfloat16 products: no memory for the rounded rows")
    return out


def reset() -> None:
    with _lock:
        _state.clear()


def _fn_bf16():
    fn = _state.get("bf16")
    if fn is None:
        with _lock:
            if _state.get("bf16") is None:
                try:
                    lib, so = load_library(_SOURCE)
                    from engine.runtime.model import native_pool

                    native_pool.attach(lib)
                    if not lib.hicache_rowdot_bf16_available():
                        raise RuntimeError("this CPU has no AVX512_BF16")
                    fn = lib.hicache_rowdot_bf16
                    fn.restype = ctypes.c_int
                    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                                   ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                   ctypes.c_int64, ctypes.c_int64, ctypes.c_int32]
                    _self_test(fn, pack_bf16, rounded=True)
                    _state["bf16_what"] = f"native bf16 ({so.name}, AVX512_BF16)"
                except Exception as exc:  # reported once; a bf16 model then refuses to load
                    fn = False
                    _state["bf16_what"] = f"unavailable: {exc}"
                log.info("exact bf16 products: %s", _state["bf16_what"])
                _state["bf16"] = fn
            fn = _state["bf16"]
    return fn


def _fn():
    fn = _state.get("fn")
    if fn is None:
        with _lock:
            if _state.get("fn") is None:
                try:
                    fn, where = _load()
                    _state["what"] = f"native ({where})"
                    log.info("exact products: %s", _state["what"])
                except Exception as exc:  # any failure falls back, reported once
                    fn = False
                    _state["what"] = f"torch items (native kernel unavailable: {exc})"
                    log.info("exact products: %s", _state["what"])
                _state["fn"] = fn
            fn = _state["fn"]
    return fn


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line
    except OSError:
        pass
    return platform.processor()


def load_library(source_path: Path) -> "tuple[ctypes.CDLL, Path]":
    """``source_path`` (a C file of ``native/``) built for this machine and loaded
    (engine.core.native; the CPU's features are part of the build's key: -march=native)."""
    return native.load(source_path, _FLAGS, key_extra=_cpu_flags(), libs=("-lm",))


def _load():
    lib, so = load_library(_SOURCE)
    fn = lib.hicache_rowdot
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                   ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                   ctypes.c_int32]
    from engine.runtime.model import native_pool

    native_pool.attach(lib)           # (the bf16 kernel is in the same library)
    native_quant.attach(lib)          # (and the GGUF blocks' kernel)
    _self_test(fn)
    simd = {1: "AVX-512", 2: "AVX2"}.get(lib.hicache_rowdot_features(), "portable")
    return fn, f"{so.name}, {simd}"


def _self_test(fn, packer=None, rounded: bool = False) -> None:
    """Close to a float64 product (``rounded``: of the bf16-rounded operands), and the same
    bits for a row alone, in other row counts and on other thread counts (odd sizes: every
    block, panel and tail path; an odd K: bf16's half pair)."""
    g = torch.Generator().manual_seed(7)
    x, w = torch.randn(37, 83, generator=g), torch.randn(45, 83, generator=g)
    p = (packer or pack)(w)

    def run(xs, threads):
        o = torch.empty((xs.shape[0], 45))
        fn(xs.data_ptr(), 83, p.data_ptr(), o.data_ptr(), 45, xs.shape[0], 45, 83, threads)
        return o

    def cast(t: torch.Tensor) -> torch.Tensor:
        return (t.bfloat16() if rounded else t).double()

    ref = cast(x) @ cast(w).t()
    whole = run(x, 1)
    what = "bf16 kernel" if rounded else "kernel"
    if not torch.allclose(whole.double(), ref, rtol=1e-4, atol=1e-3 if rounded else 1e-4):
        raise RuntimeError(f"the built {what} failed its self-test (values)")
    for lo, hi, t in ((5, 6, 1), (0, 10, 3), (3, 37, 2), (0, 37, 4)):
        if not torch.equal(run(x[lo:hi].contiguous(), t), whole[lo:hi]):
            raise RuntimeError(f"the built {what} failed its self-test (row bits)")
