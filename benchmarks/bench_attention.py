"""Time the exact (batch-invariant) CPU attention kernel, ``engine.runtime.model.ops.attention``.

Shapes of the ``tiny`` model (4 query heads, 2 kv heads, head dim 64): a decode query, a short
prefill chunk deep in a context, and 512-token prefill chunks over growing contexts. One torch
thread; best of ``--repeat`` rounds (a loaded machine only ever makes a run slower).

``--baseline FILE`` times another version of ``ops.py`` in the same process, interleaved with
this one, and prints the speed-up, e.g. the version before a change:

    git show HEAD~1:engine/runtime/model/ops.py > /tmp/ops_before.py
    python benchmarks/bench_attention.py --baseline /tmp/ops_before.py
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import time

import torch

from engine.runtime.model import ops

SHAPES = [(1, 701), (20, 700), (512, 512), (512, 1536), (512, 2560)]   # (queries, keys)


def _load(path: str):
    spec = importlib.util.spec_from_file_location("ops_baseline", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--baseline", help="another ops.py to compare with")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    kernels = {"current": ops}
    if args.baseline:
        kernels["baseline"] = _load(args.baseline)
    g = torch.Generator().manual_seed(0)
    best = {(shape, name): float("inf") for shape in SHAPES for name in kernels}
    for _ in range(args.repeat):
        for M, T in SHAPES:
            q = torch.randn(M, 4, 64, generator=g)
            k, v = torch.randn(T, 2, 64, generator=g), torch.randn(T, 2, 64, generator=g)
            pos = torch.arange(T - M, T)
            inner = 20 if M < 100 else 1
            for name, mod in kernels.items():
                t = time.perf_counter()
                for _ in range(inner):
                    mod.attention(q, k, v, pos, 0.125)
                dt = (time.perf_counter() - t) / inner
                best[((M, T), name)] = min(best[((M, T), name)], dt)
    rows = []
    for M, T in SHAPES:
        row = {"queries": M, "keys": T, "ms": best[((M, T), "current")] * 1e3}
        if args.baseline:
            row["baseline_ms"] = best[((M, T), "baseline")] * 1e3
            row["speedup"] = row["baseline_ms"] / row["ms"]
        rows.append(row)
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    for r in rows:
        extra = f"  baseline {r['baseline_ms']:.2f} ms -> {r['speedup']:.2f}x" if args.baseline else ""
        print(f"{r['queries']:4d} queries x {r['keys']:5d} keys: {r['ms']:.2f} ms{extra}")


if __name__ == "__main__":
    main()
