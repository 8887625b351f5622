"""Matrix products whose bits for one row are fixed by this code, not by the BLAS library.

A CPU GEMM library picks its summation order from the shape of the call and the number of
threads: few rows take a matrix-vector path, and with many threads a product whose output is
small is split along the reduction dimension, each thread summing part of it (on a Xeon with
AVX-512 and AMX, 16 threads gave a 768-wide product other bits than 1 thread, whatever the
row count). Padding rows to a multiple of the kernel's blocking only matched one machine.

Here every product on the exact path is cut into *items* — ``T`` rows (a tile, the rows
zero-padded) by ``C`` columns (a column block of the weight fixed by its width) over the whole
reduction — and an item is computed as the library computes that shape on one thread: one code
path, no split of the reduction, whatever the row count or thread count. Tiles are
:data:`MAX_TILE` rows with a last one rounded up to :data:`TILE_STEP` where the one-thread
kernel was seen to give a row the same bits in any such tile (:func:`tiles`), else
:data:`ROW_TILE` rows always. The threads
are used across items: ``torch.bmm`` over a batch of items runs each item on one thread. That
last point is the library's behaviour, not a promise, so it is checked: the first time a kind of
call is made at a thread count (:func:`items`), its batched result is compared bit for bit with
the items computed one by one on one thread (the *safe* kernel); if they differ, that kind of call
takes the safe kernel from then on and one line is logged. The safe kernel is exact by
construction and slower (one thread).

``HICACHE_EXACT_GEMM`` (for tests and measurements): ``safe`` always takes the safe kernel;
``library`` makes :func:`linear` offer the plain library call over all rows (the kernel known to
be non-invariant) as its fast kernel, which the check must then catch.
"""

from __future__ import annotations

import logging
import math
import os
import threading
from typing import Callable

import torch

from engine.runtime.model import native_gemm

MAX_TILE = 256         # rows per item: a product's rows are cut into tiles of this many,
TILE_STEP = 16         # the last tile (or a lone one) rounded up to a multiple of this
ROW_TILE = 64          # rows per item where the library's bits for a row follow the tile size
_BLOCKS = 4            # a weight is cut into about this many column blocks (a fixed function
                       # of its width: the threads share the blocks of a tile)

_log = logging.getLogger("hicache.model")
_batched = torch.bmm   # the batched kernel (a test swaps in one that follows the batch)
# (kind, shapes, strides-of-batch-zero, dtype, threads) -> batched kernel agreed with the safe one
_verdicts: dict[tuple, bool] = {}
_warned: set[str] = set()


_forced: dict[str, str] = {}    # "mode": "safe" once a start-up probe found a difference


def mode() -> str:
    """``safe`` (forced by :func:`force_safe`) or ``HICACHE_EXACT_GEMM``: ``""`` (the checked
    batched kernel), ``safe`` or ``library``."""
    return _forced.get("mode") or os.environ.get("HICACHE_EXACT_GEMM", "")


def force_safe() -> None:
    """Every exact product takes the single-thread kernel from now on."""
    _forced["mode"] = "safe"


def report() -> list[str]:
    """The checks that failed (those kinds take the safe kernel or fixed tiles), one line each;
    ``["safe kernel forced"]`` first where :func:`force_safe` was called."""
    out = ["safe kernel forced"] if _forced.get("mode") else []
    for key, ok in _verdicts.items():
        if not ok:
            out.append(" ".join(str(k) for k in key))
    return out


def reset() -> None:
    """Forget every verdict and the forced mode (tests; a changed ``HICACHE_EXACT_GEMM``)."""
    _verdicts.clear()
    _warned.clear()
    _forced.clear()


def tiles(M: int, key: tuple, make: Callable[[int], tuple[torch.Tensor, torch.Tensor]]
          ) -> list[int]:
    """Row tiles for ``M`` rows of a product whose items are ``make(T)``'s operands: whole
    :data:`MAX_TILE` tiles and a last one rounded up to :data:`TILE_STEP` (little padding for a
    decode step), where the single-thread kernel gives a row the same bits in a tile of 16, 48
    or MAX_TILE rows (checked once per kind of item); :data:`ROW_TILE`-row tiles otherwise."""
    if _adaptive(key, make):
        full, rest = divmod(M, MAX_TILE)
        return [MAX_TILE] * full + ([-(-rest // TILE_STEP) * TILE_STEP] if rest or not M else [])
    return [ROW_TILE] * max(1, -(-M // ROW_TILE))


def _adaptive(key: tuple, make: Callable[[int], tuple[torch.Tensor, torch.Tensor]]) -> bool:
    full = ("tile-size", *key)
    ok = _verdicts.get(full)
    if ok is None:
        a, b = make(MAX_TILE)
        ref = safe_items(a, b)[:, :TILE_STEP]
        ok = all(torch.equal(safe_items(a[:, :t], b)[:, :TILE_STEP], ref)
                 for t in (TILE_STEP, 3 * TILE_STEP))
        _verdicts[full] = ok
        if not ok:
            _log.info("exact path: %s items give a row other bits in other tile sizes; "
                      "using %d-row tiles", key[0], ROW_TILE)
    return ok


def col_block(n: int) -> int:
    """Column block width for an ``n``-wide output: a divisor of ``n`` (a multiple of 16 where
    one exists) giving about :data:`_BLOCKS` blocks, at least two where ``n`` allows."""
    cap = max(n // _BLOCKS, 128)
    for step in (16, 1):
        for c in range(min(cap, n // 2) // step * step, 0, -step):
            if n % c == 0:
                return c
    return n


def _single_thread(fn: Callable[[], torch.Tensor]) -> torch.Tensor:
    before = torch.get_num_threads()
    if before == 1:
        return fn()
    torch.set_num_threads(1)
    try:
        return fn()
    finally:
        torch.set_num_threads(before)


def safe_items(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None
               ) -> torch.Tensor:
    """``a [n, T, K] @ b [n, K, C]`` item by item, each a plain product on one thread (into
    ``out`` if given, contiguous)."""
    def run() -> torch.Tensor:
        o = a.new_empty((a.shape[0], a.shape[1], b.shape[2])) if out is None else out
        for i in range(a.shape[0]):
            torch.mm(a[i], b[i], out=o[i])
        return o
    return _single_thread(run)


def checked(kind: str, key: tuple, fast: Callable[[], torch.Tensor],
            safe: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``fast()`` where it has been seen to give ``safe()``'s bits for this kind of call at this
    thread count; ``safe()`` otherwise. The first call of a kind computes both and compares."""
    if mode() == "safe":
        return safe()
    full = (kind, *key, torch.get_num_threads())
    ok = _verdicts.get(full)
    if ok is None:
        got = fast().clone()
        want = safe()
        ok = _verdicts[full] = torch.equal(got, want)
        if not ok and kind not in _warned:
            _warned.add(kind)
            _log.warning("exact path: the batched %s kernel is not batch invariant here "
                         "(%d threads, shape %s); using the single-thread kernel for it",
                         kind, full[-1], key)
        return want
    return fast() if ok else safe()


def items(kind: str, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None
          ) -> torch.Tensor:
    """``a [n, T, K] @ b [n, K, C]`` with every item's bits those of :func:`safe_items`
    (into ``out`` if given, contiguous)."""
    if a.shape[0] == 1:
        return safe_items(a, b, out)
    key = (tuple(a.shape), tuple(b.shape), a.stride(0) == 0, b.stride(0) == 0, a.dtype)
    if out is None:
        return checked(kind, key, lambda: _batched(a, b), lambda: safe_items(a, b))
    return checked(kind, key, lambda: _batched(a, b, out=out), lambda: safe_items(a, b, out))


def width_free(kind: str, K: int, dtype: torch.dtype) -> bool:
    """Whether the single-thread kernel gives an item's first columns the same bits whatever
    the item's width and row count (a ``K``-deep product; checked once per kind)."""
    full = ("width", kind, K, dtype)
    ok = _verdicts.get(full)
    if ok is None:
        g = torch.Generator().manual_seed(K)
        a = torch.randn(1, MAX_TILE, K, generator=g).to(dtype)
        b = torch.randn(1, K, 1072, generator=g).to(dtype)
        ref = safe_items(a[:, :TILE_STEP], b[..., :256].contiguous())
        ok = all(torch.equal(safe_items(a[:, :t], b[..., :w].contiguous())[:, :TILE_STEP, :256],
                             ref) for t, w in ((TILE_STEP, 512), (TILE_STEP, 1072),
                                               (MAX_TILE, 1072)))
        _verdicts[full] = ok
    return ok


_scratch = threading.local()


def _buffer(name: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """A per-thread scratch tensor of ``shape``, reused from call to call: fresh memory of a
    few MB costs page faults that took as long as the product itself (measured in a VM)."""
    bufs = getattr(_scratch, "bufs", None)
    if bufs is None:
        bufs = _scratch.bufs = {}
    n = math.prod(shape)
    key = (name, like.dtype, like.device, torch.is_inference_mode_enabled())
    t = bufs.get(key)
    if t is None or t.numel() < n:
        t = bufs[key] = torch.empty(n, dtype=like.dtype, device=like.device)
    return t[:n].view(shape)


def _pad_to(x: torch.Tensor, rows: int) -> torch.Tensor:
    extra = rows - x.shape[0]
    return x if not extra else torch.cat([x, x.new_zeros((extra, *x.shape[1:]))])


def _probe_operands(K: int, C: int, dtype: torch.dtype, transposed: bool
                    ) -> Callable[[int], tuple[torch.Tensor, torch.Tensor]]:
    def make(T: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(T + K + C)
        a = torch.randn(1, T, K, generator=g).to(dtype)
        b = torch.randn(1, C, K, generator=g).to(dtype)
        return a, (b.transpose(1, 2) if transposed else b.view(1, K, C))
    return make


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x [M, K] @ w.T`` (``w [N, K]``, contiguous): each row's bits fixed by its own values.
    float32 on CPU takes the native kernel where it is built (:mod:`native_gemm`: invariant by
    construction; on one thread in ``safe`` mode, the same bits); else the torch items."""
    m = mode()
    if getattr(w, "_hicache_gemm", None) == "bfloat16":     # Model(gemm_dtype=bfloat16)
        return native_gemm.linear_bf16(x, w, threads=1 if m == "safe" else None)
    if (m != "library" and x.dtype == torch.float32 and w.dtype == torch.float32
            and x.device.type == "cpu" and w.device.type == "cpu" and native_gemm.available()):
        return native_gemm.linear(x, w, threads=1 if m == "safe" else None)
    M, K = x.shape
    N = w.shape[0]
    C = col_block(N)
    cut = tiles(M, ("linear", K, C, x.dtype), _probe_operands(K, C, x.dtype, True))
    xp = _pad_to(x, sum(cut)).contiguous()
    if mode() == "library":
        return checked("linear-library", (xp.shape[0], K, N, x.dtype),
                       lambda: torch.mm(xp, w.t()), lambda: _linear_items(xp, w, cut, C))[:M]
    return _linear_items(xp, w, cut, C)[:M]


def _linear_items(xp: torch.Tensor, w: torch.Tensor, cut: list[int], C: int) -> torch.Tensor:
    Mp, K = xp.shape
    N = w.shape[0]
    nb = N // C
    wb = w.view(nb, C, K).transpose(1, 2)                     # [nb, K, C], no copy
    out = xp.new_empty((Mp, N))
    s = 0
    for T in cut:
        # the tile copied per block: a batch whose left operand has stride 0 and whose
        # right one is transposed took twice as long (MKL 2024.2)
        a = _buffer("a", (nb, T, K), xp)
        a.copy_(xp[s:s + T].expand(nb, T, K))
        r = items("linear", a, wb, out=_buffer("r", (nb, T, C), xp))       # [nb, T, C]
        out[s:s + T].view(T, nb, C).copy_(r.transpose(0, 1))
        s += T
    return out


def bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a [B, M, K] @ b [B, K, N]``: each row's bits fixed by its own values."""
    B, M, K = a.shape
    N = b.shape[2]
    C = N if B >= 2 else col_block(N)
    cut = tiles(M, ("bmm", K, C, a.dtype), _probe_operands(K, C, a.dtype, False))
    Mp = sum(cut)
    ap = a if Mp == M else torch.cat([a, a.new_zeros((B, Mp - M, K))], dim=1)
    out = a.new_empty((B, Mp, N))
    s = 0
    if B >= 2:
        for T in cut:
            out[:, s:s + T] = items("bmm", ap[:, s:s + T], b, out=_buffer("r", (B, T, N), a))
            s += T
        return out[:, :M]
    nb = N // C
    bb = b[0].view(K, nb, C).permute(1, 0, 2)                 # [nb, K, C], no copy
    for T in cut:
        r = items("bmm", ap[0, s:s + T].expand(nb, T, K), bb, out=_buffer("r", (nb, T, C), a))
        out[0, s:s + T].view(T, nb, C).copy_(r.transpose(0, 1))
        s += T
    return out[:, :M]
