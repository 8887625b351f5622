"""Exact products read from a GGUF file's own quantised blocks: the same float32 weight values,
the same bits, a fifth of the bytes.

A GGUF weight stored as Q4_1, Q4_0 or Q8_0 is dequantised to float32 once at load
(:mod:`engine.runtime.model.gguf_loader`), and the exact path's products read those float32
panels: 4 bytes a weight, which bounds a decode step by memory bandwidth. Each block value is
``d*q + m`` (Q4_1) or ``d*q`` (Q8_0, Q4_0), with ``d``/``m`` float16 and ``q`` a small integer,
and ``d*q`` is exact in float32, so a kernel can rebuild the float32 values in registers bit for
bit. ``native/rowdot.c``'s ``hicache_rowdot_quant`` does that block by block (32 k x 32 output
columns into a buffer that stays in L1) and runs the rows' chains of fused multiply-adds
through it exactly as through the float32 panels: every output element is the same sequence on
the same values, so the same bits as :func:`native_gemm.linear` (batch invariance unchanged;
tests/test_native_quant.py). It reads 0.75 bytes a weight (Q4_1) or 1.125 (Q8_0, Q4_0).

Where it applies: products of at most :data:`ROWS` rows (decode steps and short tails; more
rows are compute-bound and keep the float32 panels) of a weight the loader tagged with its
blocks (:func:`tag`), once :func:`panels` has checked that the regrouped blocks give exactly the
float32 weight (``torch.equal`` over every value; a mismatch keeps float32 for that weight,
logged). ``HICACHE_EXACT_QUANT=0`` turns it off (A/B runs; the bits do not change).
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import threading

import numpy as np
import torch

log = logging.getLogger("hicache.model")

ENV = "HICACHE_EXACT_QUANT"
ROWS = 8          # the most rows a product takes from the blocks (docs/model-and-server.md)
QK = 32           # values per block along the reduction index
# GGUF type -> the kernel's block layout (1: d, m and nibbles; 2: d and signed bytes)
KINDS = {"Q4_1": 1, "Q4_0": 2, "Q8_0": 2}
_ROW_BYTES = {"Q4_1": 20, "Q4_0": 18, "Q8_0": 34}   # one block's bytes in the file

_lock = threading.Lock()
_state: dict = {}


@dataclasses.dataclass(frozen=True)
class Blocks:
    """A weight ``[N, K]``'s rows as the file stores them: ``rows[n]`` is row n's
    ``K / 32`` blocks of GGUF type ``kind``."""

    kind: str
    rows: np.ndarray        # uint8 [N, K / 32 * block bytes]


def enabled() -> bool:
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def attach(lib) -> None:
    """Take the block kernel from the products' library (native_gemm hands it over)."""
    P, I64, I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32
    fn = getattr(lib, "hicache_rowdot_quant", None)
    vals = getattr(lib, "hicache_quant_values", None)
    if fn is None or vals is None:
        return
    fn.restype = ctypes.c_int
    fn.argtypes = [P, I64, P, I32, P, I64, I64, I64, I64, I32]
    lib.hicache_quant_products.restype = ctypes.c_int64
    _state["count"] = lib.hicache_quant_products
    vals.restype = ctypes.c_int
    vals.argtypes = [P, I32, P, I64, I64]
    _state["fn"], _state["values"] = fn, vals


def products() -> int:
    """How many products the blocks have served in this process."""
    count = _state.get("count")
    return int(count()) if count is not None else 0


def describe() -> str:
    """A line for reports (``/get_server_info``)."""
    if not enabled():
        return f"off ({ENV}=0)"
    if _state.get("fn") is None:
        return "not loaded (the products' library is not built or not used yet)"
    return (f"GGUF Q4_1/Q4_0/Q8_0 blocks for products of at most {ROWS} rows, where the "
            f"model's weights came from them ({products()} products so far)")


def kernel():
    """The C function ``hicache_rowdot_quant`` (for native_layers), or None."""
    return _state.get("fn") if enabled() else None


def tag(w: torch.Tensor, kind: str, rows: np.ndarray) -> torch.Tensor:
    """Note on ``w`` (float32 ``[N, K]``, dequantised from ``rows``) the blocks it came from,
    when the kernel takes their type; returns ``w``."""
    if kind in KINDS and rows.ndim == 2 and rows.shape[0] == w.shape[0] and w.dim() == 2 \
            and w.shape[1] % QK == 0 and rows.shape[1] == w.shape[1] // QK * _ROW_BYTES[kind]:
        w._hicache_blocks = Blocks(kind, rows)   # type: ignore[attr-defined]
    return w


def blocks_of(w: torch.Tensor) -> Blocks | None:
    return getattr(w, "_hicache_blocks", None)


def concat(ws: list[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """Tag ``out`` (``torch.cat(ws)``) with the parts' blocks when all have blocks of one
    type; returns ``out``."""
    parts = [b for b in (blocks_of(w) for w in ws) if b is not None]
    if parts and len(parts) == len(ws) and len({b.kind for b in parts}) == 1:
        tag(out, parts[0].kind, np.concatenate([b.rows for b in parts]))
    return out


def _f16(b: np.ndarray) -> np.ndarray:
    """float16 scales (2 bytes each on the last axis) as float32 ``[..]``."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def regroup(b: Blocks, N: int, K: int) -> tuple[int, np.ndarray]:
    """The kernel's layout (rowdot.c): per panel of 32 columns, per block of 32 k, the columns'
    scales as float32, then (Q4_1) their offsets, then the integers k by k."""
    nb, P = K // QK, -(-N // 32)
    r = np.asarray(b.rows).reshape(N, nb, _ROW_BYTES[b.kind])
    d = _f16(r[:, :, 0:2])
    if b.kind == "Q4_1":
        m = _f16(r[:, :, 2:4])
        qs = r[:, :, 4:20]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=2)              # [N, nb, 32 k]
    elif b.kind == "Q4_0":
        qs = r[:, :, 2:18]
        q = (np.concatenate([qs & 0x0F, qs >> 4], axis=2).astype(np.int8) - 8).view(np.uint8)
    else:
        q = r[:, :, 2:34]
    pad = P * 32 - N

    def cols(a: np.ndarray) -> np.ndarray:                       # [N, ...] -> [P, 32, ...]
        if pad:
            a = np.concatenate([a, np.zeros((pad,) + a.shape[1:], a.dtype)])
        return a.reshape((P, 32) + a.shape[1:])

    scale = [cols(d).transpose(0, 2, 1)]                         # [P, nb, 32 columns]
    if b.kind == "Q4_1":
        scale.append(cols(m).transpose(0, 2, 1))
    qk = cols(q).transpose(0, 2, 3, 1)                           # [P, nb, 32 k, 32 columns]
    if KINDS[b.kind] == 1:
        qk = qk[..., :16] | (qk[..., 16:] << 4)                  # column j low, j + 16 high
    parts = [np.ascontiguousarray(s).view(np.uint8) for s in scale]
    parts.append(np.ascontiguousarray(qk).reshape(P, nb, -1))
    return KINDS[b.kind], np.ascontiguousarray(np.concatenate(parts, axis=2)).reshape(-1)


def panels(w: torch.Tensor) -> tuple[int, torch.Tensor] | None:
    """``(kind, panel bytes)`` for ``w`` when it has blocks that give exactly its float32
    values; made and checked once per weight (kept on it), else None."""
    key = (w.data_ptr(), tuple(w.shape), tuple(w.stride()))
    got = getattr(w, "_hicache_qpanels", None)
    if got is not None and got[0] == key:
        return got[1]
    b = blocks_of(w)
    vals = _state.get("values")
    if vals is None:                  # the library not loaded (yet): nothing decided
        return None
    res = None
    if b is not None and w.dtype == torch.float32 and w.device.type == "cpu":
        with _lock:
            N, K = w.shape
            kind, raw = regroup(b, N, K)
            p = torch.from_numpy(raw)
            back = torch.empty((N, K), dtype=torch.float32)
            rc = vals(p.data_ptr(), kind, back.data_ptr(), N, K)
            if rc == 0 and torch.equal(back, w):
                res = (kind, p)
            else:
                log.warning("exact products: a %s weight [%d, %d] did not match its blocks; "
                            "it keeps float32 panels", b.kind, N, K)
    w._hicache_qpanels = (key, res)   # type: ignore[attr-defined]
    return res


def product(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, threads: int) -> bool:
    """``out = x @ w.T`` from ``w``'s blocks (``x`` contiguous float32, at most :data:`ROWS`
    rows); False (nothing written) where that path does not apply."""
    fn = kernel()
    if fn is None or x.shape[0] > ROWS:
        return False
    got = panels(w)
    if got is None:
        return False
    kind, p = got
    M, K = x.shape
    N = w.shape[0]
    return fn(x.data_ptr(), K, p.data_ptr(), kind, out.data_ptr(), N, M, N, K, threads) != -2
