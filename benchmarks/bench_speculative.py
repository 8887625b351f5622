"""Speculative decoding: decode tokens/s with and without speculation, acceptance, and the bytes
each cached token costs for target and draft in each draft layout (docs/speculative.md).

    .venv/bin/python benchmarks/bench_speculative.py [--requests 4] [--new-tokens 64] [--k 4]

Every configuration runs the same greedy requests in the same process (a fresh cache each);
outputs are checked equal to the non-speculative run. Figures are ratios within this run.
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402

from engine.cache.facade import HiCache  # noqa: E402
from engine.cache.types import CacheConfig  # noqa: E402
from engine.runtime.model import load_model  # noqa: E402
from engine.runtime.model.draft import make_draft  # noqa: E402
from engine.runtime.scheduler import SamplingParams, Scheduler  # noqa: E402
from engine.runtime.scheduler.spec import SpecConfig, cache_layout, sidecar_layout  # noqa: E402

P = 16


def run(target, draft, spec: SpecConfig | None, prompts, sp) -> dict:
    if spec is None:
        cache = HiCache(CacheConfig(page_size=P, l1_tokens=16384, layout=target.kv_layout(P)))
        s = Scheduler(target, cache)
    else:
        side = sidecar_layout(target, P, draft) if spec.draft_layout == "sidecar" else None
        layout = cache_layout(target, P, draft, spec)
        cache = HiCache(CacheConfig(page_size=P, l1_tokens=16384, layout=layout, sidecar=side))
        s = Scheduler(target, cache, draft=draft, spec=spec)
    lay = cache.config.layout
    per_token = lay.page_bytes // P + (side.page_bytes // P if spec and side else 0)
    s.start()
    try:
        t0 = time.perf_counter()
        outs = [s.generate(p, sp) for p in prompts]          # one at a time: decode-bound
        wall = time.perf_counter() - t0
    finally:
        s.stop()
        cache.close()
    gen = sum(len(o[0]) for o in outs)
    res = {"wall_s": round(wall, 3), "generated_tokens": gen,
           "decode_tokens_per_s": round(gen / wall, 1), "kv_bytes_per_token": per_token,
           "outputs": [o[0] for o in outs]}
    if s.spec is not None:
        res["speculative"] = s.spec.stats()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    target = load_model(a.model)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 256, a.prompt_tokens).tolist() for _ in range(a.requests)]
    sp = SamplingParams(max_new_tokens=a.new_tokens, temperature=0, ignore_eos=True)
    base = run(target, None, None, prompts, sp)
    rows = {"off": base}
    for preset in ("mirror", "mirror-half"):
        draft = make_draft(target, preset)
        for layout in ("packed", "sidecar"):
            r = run(target, draft, SpecConfig(a.k, preset, layout), prompts, sp)
            assert r["outputs"] == base["outputs"], f"{preset}/{layout}: outputs differ"
            r["speedup"] = round(r["decode_tokens_per_s"] / base["decode_tokens_per_s"], 3)
            rows[f"{preset}/{layout}"] = r
    for r in rows.values():
        r.pop("outputs")
    if a.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"{'config':22} {'tok/s':>8} {'speedup':>8} {'accept':>7} {'len':>5} {'B/token':>8}")
    for name, r in rows.items():
        st = r.get("speculative") or {}
        print(f"{name:22} {r['decode_tokens_per_s']:8.1f} {r.get('speedup', 1.0):8.3f} "
              f"{st.get('accept_rate') or '-':>7} {st.get('accept_length') or '-':>5} "
              f"{r['kv_bytes_per_token']:8d}")


if __name__ == "__main__":
    main()
