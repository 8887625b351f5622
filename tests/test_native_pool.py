"""The worker pool the exact path's C kernels share (engine/runtime/model/native_pool.py).

The pool only decides which thread computes an item, never how: every result is compared bit for
bit with a one-thread run. Attacks: calls from several Python threads at once (one gets the
pool, the others start their own threads), a forked child (the parent's workers do not exist
there), many back-to-back calls with workers asleep and awake, and the pool turned off.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from engine.runtime.model import native_attn, native_gemm, native_pool

pytestmark = pytest.mark.skipif(not native_gemm.available() or not native_pool.enabled(),
                                reason=f"native kernels: {native_gemm.describe()}")


def _operands(seed: int, M: int = 9, N: int = 200, K: int = 96):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(M, K, generator=g), torch.randn(N, K, generator=g)


def test_products_on_the_pool_have_the_one_thread_bits():
    x, w = _operands(1)
    want = native_gemm.linear(x, w, threads=1)
    for threads in (2, 3, 4, 2):
        assert torch.equal(native_gemm.linear(x, w, threads=threads), want)
    assert native_pool.workers() >= 3          # the 4-thread call started three workers
    assert native_pool.describe() == "shared workers"


def test_attention_on_the_pool_has_the_one_thread_bits():
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(7, 6, 32, generator=g), torch.randn(40, 2, 32, generator=g),
               torch.randn(40, 2, 32, generator=g))
    pos = torch.arange(33, 40)
    want = native_attn.attention(q, k, v, pos, 0.2, threads=1)
    for threads in (2, 4):
        assert torch.equal(native_attn.attention(q, k, v, pos, 0.2, threads=threads), want)


def test_workers_asleep_wake_for_the_next_call():
    x, w = _operands(3)
    want = native_gemm.linear(x, w, threads=1)
    native_gemm.linear(x, w, threads=2)
    time.sleep(0.05)                  # past the 2 ms an idle worker looks: it sleeps now
    assert torch.equal(native_gemm.linear(x, w, threads=2), want)


def test_calls_from_several_threads_at_once():
    """One caller holds the pool; the others start their own threads for that call."""
    cases = [_operands(10 + i, M=1 + 5 * i, N=96 + 32 * i) for i in range(4)]
    wants = [native_gemm.linear(x, w, threads=1) for x, w in cases]
    errors: list[str] = []

    def body(i: int) -> None:
        x, w = cases[i]
        for _ in range(60):
            if not torch.equal(native_gemm.linear(x, w, threads=2), wants[i]):
                errors.append(f"case {i}: other bits")
                return

    threads = [threading.Thread(target=body, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a caller never returned"
    assert errors == []


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork")
def test_a_forked_child_runs_its_products_without_the_parents_workers():
    x, w = _operands(4)
    want = native_gemm.linear(x, w, threads=1)
    native_gemm.linear(x, w, threads=2)          # the parent's pool has a worker now
    r, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:                                 # child: a worker-less copy of the pool
        try:
            got = native_gemm.linear(x, w, threads=2)
            os.write(wfd, b"1" if torch.equal(got, want) else b"0")
        finally:
            os._exit(0)
    os.close(wfd)
    _, status = os.waitpid(pid, 0)
    assert os.read(r, 1) == b"1" and status == 0


def test_the_pool_can_be_turned_off():
    code = ("import torch; from engine.runtime.model import native_gemm, native_pool; "
            "x = torch.randn(4, 64); w = torch.randn(300, 64); "
            "a = native_gemm.linear(x, w, threads=2); b = native_gemm.linear(x, w, threads=1); "
            "print(torch.equal(a, b), native_pool.workers(), native_pool.describe())")
    env = {**os.environ, native_pool.ENV: "0"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, timeout=120, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().split(maxsplit=2) == ["True", "0",
                                                 f"threads per call ({native_pool.ENV}=0)"]
