"""The worker threads the exact path's C kernels share: ``native/pool.c``, built into the same
cache as :mod:`engine.runtime.model.native_gemm`'s kernels and handed to each kernel library as
it loads (the kernels import this module, never the other way).

Threads started per call (37 us each on a 2-core VM) came too late for a decode step's
products (150-600 us each): two threads read the weights no faster than one. The pool's
workers stay between calls; an idle one looks for the next job for 2 ms, yielding its core
between looks, then sleeps until woken. Which thread computes an item never changes a bit (the
kernels are invariant by construction), and whatever keeps a call from the pool (another thread
in it, a forked child) makes that call start its own threads, as before.

``HICACHE_EXACT_POOL=0`` turns the pool off (every call starts its threads: for A/B runs).
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from pathlib import Path

log = logging.getLogger("hicache.model")

ENV = "HICACHE_EXACT_POOL"
_SOURCE = Path(__file__).with_name("native") / "pool.c"
_lock = threading.Lock()
_state: dict = {}
_FLAGS = ["-O2", "-shared", "-fPIC", "-pthread"]   # no -march: it computes nothing


def enabled() -> bool:
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def _lib():
    lib = _state.get("lib")
    if lib is None:
        with _lock:
            if _state.get("lib") is None:
                from engine.core import native

                try:
                    lib, _ = native.load(_SOURCE, _FLAGS)
                    lib.hicache_pool_workers.restype = ctypes.c_int
                    _state["what"] = "shared workers"
                except Exception as exc:   # the kernels then start their threads per call
                    lib = False
                    _state["what"] = f"threads per call (pool unavailable: {exc})"
                    log.info("exact kernels: %s", _state["what"])
                _state["lib"] = lib
            lib = _state["lib"]
    return lib


def attach(kernel_lib) -> bool:
    """Hand the pool to a kernel library (one with ``hicache_set_runner``); whether it was."""
    if not enabled():
        return False
    lib = _lib()
    if lib is False:
        return False
    kernel_lib.hicache_set_runner.argtypes = [ctypes.c_void_p]
    kernel_lib.hicache_set_runner.restype = None
    kernel_lib.hicache_set_runner(ctypes.cast(lib.hicache_pool_run, ctypes.c_void_p))
    return True


def workers() -> int:
    """Workers started in this process so far (0 without the pool)."""
    lib = _state.get("lib")
    return int(lib.hicache_pool_workers()) if lib else 0


def describe() -> str:
    if not enabled():
        return f"threads per call ({ENV}=0)"
    _lib()
    return _state.get("what", "")
