"""Matrix products whose bits for one row are fixed by this code, not by the BLAS library.

A CPU GEMM library picks its summation order from the shape of the call and the number of
threads: few rows take a matrix-vector path, and with many threads a product whose output is
small is split along the reduction dimension, each thread summing part of it (on a Xeon with
AVX-512 and AMX, 16 threads gave a 768-wide product other bits than 1 thread, whatever the
row count). Padding rows to a multiple of the kernel's blocking only matched one machine.

Here every product on the exact path is cut into *items* of one fixed shape — ``T`` rows (a
tile, the rows zero-padded) by ``C`` columns (a fixed column block of the weight) over the
whole reduction — and an item is computed as the library computes that shape on one thread:
one code path, no split of the reduction, whatever the row count or thread count. The threads
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
import os
from typing import Callable

import torch

ROW_TILE = 64          # rows per item of a linear layer or a per-head product
WIDE_ROW_TILE = 16     # rows per item of a vocabulary-wide projection (few rows: the logits)
WIDE = 16384           # output columns from which a projection counts as vocabulary-wide
_BLOCKS = 8            # a weight is cut into about this many column blocks (a fixed function
                       # of its width: the threads share the blocks of a tile)

_log = logging.getLogger("hicache.model")
# (kind, shapes, strides-of-batch-zero, dtype, threads) -> batched kernel agreed with the safe one
_verdicts: dict[tuple, bool] = {}
_warned: set[str] = set()


def mode() -> str:
    """``HICACHE_EXACT_GEMM``: ``""`` (checked batched kernel), ``safe`` or ``library``."""
    return os.environ.get("HICACHE_EXACT_GEMM", "")


def report() -> dict[str, list[int]]:
    """Kinds of call whose batched kernel failed its check, with the thread counts it failed at
    (they take the safe kernel); empty when every checked call agreed."""
    out: dict[str, list[int]] = {}
    for key, ok in _verdicts.items():
        if not ok:
            out.setdefault(key[0], []).append(key[-1])
    return out


def reset() -> None:
    """Forget every verdict (tests; a changed ``HICACHE_EXACT_GEMM``)."""
    _verdicts.clear()
    _warned.clear()


def row_tile(n_out: int) -> int:
    return WIDE_ROW_TILE if n_out >= WIDE else ROW_TILE


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


def safe_items(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a [n, T, K] @ b [n, K, C]`` item by item, each a plain product on one thread."""
    def run() -> torch.Tensor:
        out = a.new_empty((a.shape[0], a.shape[1], b.shape[2]))
        for i in range(a.shape[0]):
            torch.mm(a[i], b[i], out=out[i])
        return out
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
        got, want = fast(), safe()
        ok = _verdicts[full] = torch.equal(got, want)
        if not ok and kind not in _warned:
            _warned.add(kind)
            _log.warning("exact path: the batched %s kernel is not batch invariant here "
                         "(%d threads, shape %s); using the single-thread kernel for it",
                         kind, full[-1], key)
        return want
    return fast() if ok else safe()


def items(kind: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a [n, T, K] @ b [n, K, C]`` with every item's bits those of :func:`safe_items`."""
    if a.shape[0] == 1:
        return safe_items(a, b)
    key = (tuple(a.shape), tuple(b.shape), a.stride(0) == 0, b.stride(0) == 0, a.dtype)
    return checked(kind, key, lambda: torch.bmm(a, b), lambda: safe_items(a, b))


def _pad_to(x: torch.Tensor, rows: int) -> torch.Tensor:
    extra = rows - x.shape[0]
    return x if not extra else torch.cat([x, x.new_zeros((extra, *x.shape[1:]))])


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x [M, K] @ w.T`` (``w [N, K]``, contiguous): each row's bits fixed by its own values."""
    M, K = x.shape
    N = w.shape[0]
    T = row_tile(N)
    Mp = max(T, -(-M // T) * T)
    xp = _pad_to(x, Mp).contiguous()
    if mode() == "library":
        return checked("linear-library", (Mp, K, N, x.dtype), lambda: torch.mm(xp, w.t()),
                       lambda: _linear_items(xp, w, T))[:M]
    return _linear_items(xp, w, T)[:M]


def _linear_items(xp: torch.Tensor, w: torch.Tensor, T: int) -> torch.Tensor:
    Mp, K = xp.shape
    N = w.shape[0]
    C = col_block(N)
    nb = N // C
    wb = w.view(nb, C, K).transpose(1, 2)                     # [nb, K, C], no copy
    out = xp.new_empty((Mp, N))
    ov = out.view(Mp // T, T, nb, C)
    for i in range(Mp // T):
        r = items("linear", xp[i * T:(i + 1) * T].expand(nb, T, K), wb)   # [nb, T, C]
        ov[i].copy_(r.transpose(0, 1))
    return out


def bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a [B, M, K] @ b [B, K, N]``: each row's bits fixed by its own values."""
    B, M, K = a.shape
    N = b.shape[2]
    T = row_tile(N)
    Mp = max(T, -(-M // T) * T)
    ap = a if Mp == M else torch.cat([a, a.new_zeros((B, Mp - M, K))], dim=1)
    out = a.new_empty((B, Mp, N))
    if B >= 2:
        for i in range(Mp // T):
            out[:, i * T:(i + 1) * T] = items("bmm", ap[:, i * T:(i + 1) * T], b)
        return out[:, :M]
    C = col_block(N)
    nb = N // C
    bb = b[0].view(K, nb, C).permute(1, 0, 2)                 # [nb, K, C], no copy
    ov = out[0].view(Mp // T, T, nb, C)
    for i in range(Mp // T):
        ov[i].copy_(items("bmm", ap[0, i * T:(i + 1) * T].expand(nb, T, K), bb).transpose(0, 1))
    return out[:, :M]
