"""What the model fingerprint costs at load: :func:`weights_digest` (XXH3-128 over every loaded
tensor) against the model's own load time.

    python benchmarks/bench_fingerprint.py --model smollm2-135m --repeat 5

Prints the weights' size, the load time, the digest's best and median time, its throughput and
its share of the load. Figures: docs/storage.md, "Model fingerprint".
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from engine.runtime.model import load_model  # noqa: E402
from engine.runtime.model.fingerprint import _tensors, weights_digest  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m", help="preset, GGUF or checkpoint dir")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    t0 = time.perf_counter()
    model = load_model(args.model, args.device)
    load_s = time.perf_counter() - t0
    nbytes = sum(t.numel() * t.element_size() for _, t in _tensors(model.w) if t is not None)
    runs = []
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        digest = weights_digest(model.w)
        runs.append(time.perf_counter() - t0)
    best, med = min(runs), statistics.median(runs)
    print(f"{args.model} ({model.cfg.dtype}, {args.device}): {nbytes / 1e6:.1f} MB of weights, "
          f"load {load_s:.2f} s")
    print(f"digest {digest}: best {best * 1e3:.1f} ms, median {med * 1e3:.1f} ms "
          f"({nbytes / best / 1e9:.1f} GB/s), {100 * best / load_s:.1f}% of the load")


if __name__ == "__main__":
    main()
