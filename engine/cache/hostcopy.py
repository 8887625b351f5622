"""Copying lists of chunks between host buffers: one native call per list, or a Python loop.

A host-to-host transfer (:func:`engine.cache.transfer.copy_pages_host`) is a list of equal-size
chunks (one per page and K/V) between two buffers, at ``(dst_off, src_off)``; chunks adjacent on
both sides form one run. :func:`copy_chunks` moves a whole list:

* **native** — the C loop in ``native/copyruns.c``, one ``ctypes`` call per list. ctypes
  releases the GIL for the call, so the copy threads run at once, and a run costs a loop
  iteration instead of a ~1 µs Python-level ``memmove`` call (what limits 16-token pages).
  With ``stream=True`` (large transfers; x86-64) it writes with non-temporal stores, which do
  not read each destination line before overwriting it and do not flush the caches, and
  prefetches the next run while it copies the current one.
* **python** — runs merged with numpy, one ``ctypes.memmove`` each: the fallback, the same
  bytes.

The library is built on first use, never at import: the system C compiler (``$CC``, else
``cc``/``gcc``/``clang``) compiles the source into ``$XDG_CACHE_HOME/hicache`` (default
``~/.cache/hicache``; ``$TMPDIR/hicache-<uid>`` when that is not writable) under a name keyed by
the source's hash, via a temporary file and an atomic rename, so ranks that start together
may both compile and neither loads a half-written file. No compiler, a failed build or load, or
``HICACHE_NATIVE_COPY=0`` selects the Python loop; one ``hicache.transfer`` log line says
which path is used and why (INFO; WARNING when a compiler exists but the build or the load
failed), and :func:`copy_path` returns the same text.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from pathlib import Path

import numpy as np

from engine.core import native

log = logging.getLogger("hicache.transfer")

ENV = "HICACHE_NATIVE_COPY"
_SOURCE = Path(__file__).with_name("native") / "copyruns.c"
_FLAGS = ["-O2", "-shared", "-fPIC"]

_lock = threading.Lock()
_fn = None            # the C function once loaded, False when the Python loop is chosen
_path = ""            # what copy_path() reports


def copy_chunks(dst_base: int, src_base: int, dst_off: np.ndarray, src_off: np.ndarray,
                chunk: int, stream: bool = False) -> int:
    """Copy ``len(dst_off)`` chunks of ``chunk`` bytes: chunk i from ``src_base + src_off[i]``
    to ``dst_base + dst_off[i]`` (int64 offsets; the bases are raw pointers the caller keeps
    alive). Chunks adjacent on both sides are one run. ``stream``: a hint that the transfer
    is larger than the caches (the bytes are the same either way). Returns the bytes."""
    n = len(dst_off)
    if n == 0:
        return 0
    fn = _native()
    if fn is False:
        return python_chunks(dst_base, src_base, dst_off, src_off, chunk)
    d = np.ascontiguousarray(dst_off, dtype=np.int64)
    s = np.ascontiguousarray(src_off, dtype=np.int64)
    return fn(dst_base, src_base, d.ctypes.data, s.ctypes.data, n, chunk, int(stream))


def python_chunks(dst_base: int, src_base: int, dst_off, src_off, chunk: int) -> int:
    """The fallback: chunks merged into runs with numpy, one ``ctypes.memmove`` per run."""
    do = np.asarray(dst_off, dtype=np.int64)
    so = np.asarray(src_off, dtype=np.int64)
    if do.size == 0:
        return 0
    # A run continues while both sides advance by exactly one chunk.
    brk = np.flatnonzero((np.diff(so) != chunk) | (np.diff(do) != chunk)) + 1
    starts = np.concatenate(([0], brk))
    lens = np.diff(np.concatenate((starts, [so.size]))) * chunk
    mm = ctypes.memmove
    for d, s, n in zip((do[starts] + dst_base).tolist(), (so[starts] + src_base).tolist(),
                       lens.tolist()):
        mm(d, s, n)
    return int(do.size) * chunk


def copy_path() -> str:
    """Which copy loop this process uses, e.g. ``native (~/.cache/hicache/copyruns-….so)`` or
    ``python (no C compiler …)``. Builds or loads the library if that has not happened yet."""
    _native()
    return _path


def reset() -> None:
    """Forget the choice: the next copy decides again (reads ``HICACHE_NATIVE_COPY`` anew)."""
    global _fn, _path
    with _lock:
        _fn, _path = None, ""


def _native():
    global _fn, _path
    if _fn is None:
        with _lock:
            if _fn is None:
                fn, _path, level = _choose()
                log.log(level, "host copies: %s", _path)
                _fn = fn
    return _fn


def _choose():
    """(function or False, what copy_path() says, log level): a build that fails where a
    compiler exists is a WARNING, the other choices INFO."""
    if os.environ.get(ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return False, f"python ({ENV}=0)", logging.INFO
    try:
        fn, where = _load()
    except Exception as exc:  # any failure falls back; the reason is reported, never raised
        level = logging.INFO if native.compiler() is None else logging.WARNING
        return False, f"python (native copy unavailable: {exc})", level
    return fn, f"native ({where})", logging.INFO


def _load():
    """Load the library (built on first use: engine.core.native), self-tested."""
    lib, so = native.load(_SOURCE, _FLAGS)
    fn = lib.hicache_copy_chunks
    fn.restype = ctypes.c_int64
    fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64, ctypes.c_int64, ctypes.c_int32]
    _self_test(fn)
    stores = "streaming stores" if lib.hicache_copy_features() else "memmove only"
    return fn, f"{so}, {stores}"


def _self_test(fn) -> None:
    """The library must move the same bytes as the fallback on both store paths (unaligned
    chunks, runs of adjacent chunks, lengths around the streaming cut-off), or it is unused."""
    src = np.random.default_rng(1).integers(0, 256, 8192, dtype=np.uint8)
    for chunk, d_off, s_off in ((300, [4000, 4300, 17, 900, 1500], [5, 305, 6000, 1, 7000]),
                                (8, [3, 11, 100], [50, 58, 7])):
        d, s = np.array(d_off, dtype=np.int64), np.array(s_off, dtype=np.int64)
        for stream in (0, 1):
            want, got = np.zeros(8192, np.uint8), np.zeros(8192, np.uint8)
            python_chunks(want.ctypes.data, src.ctypes.data, d, s, chunk)
            moved = fn(got.ctypes.data, src.ctypes.data, d.ctypes.data, s.ctypes.data, len(d),
                       chunk, stream)
            if moved != chunk * len(d) or not np.array_equal(got, want):
                raise RuntimeError("the built library failed its self-test")
