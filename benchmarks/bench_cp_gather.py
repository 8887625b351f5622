"""Context parallelism on 2 gloo ranks (CPU): the per-layer owner-grouped gather against a plain
``all_gather`` of the same bytes, and time to first token at CP 1 vs CP 2.

1. **Gather.** A cached prefix of ``--prefix`` tokens of the ``tiny`` model's KV layout (4 layers,
   K and V, 2 kv-heads x 64 dims, float32, page 64), its pages on the rotation 0, 1, 0, 1, …
   Ours: one :class:`engine.parallel.cp_gather.LayerGather` pass (copy this rank's pages out of
   its pool, all-gather into the alternating scratch buffers, read back in logical order through
   the page table), per layer. Plain: ``dist.all_gather`` of one contiguous tensor of the same
   size per rank and layer, nothing else. Best and median of ``--repeat`` runs.
2. **TTFT.** The ``tiny`` model prefills ``--new`` tokens after the cached prefix and returns the
   first token's logits: CP 1 (one rank, the whole prefix in its pool) vs CP 2 (each rank holds
   half the pages and gathers per layer). In this runtime every CP rank computes all new tokens,
   so CP 2 can only add the gather's cost; what it buys is half the KV memory per rank. Also the
   prefill of the prefix itself (no cached part: no gather).

    .venv/bin/python benchmarks/bench_cp_gather.py [--prefix 8192] [--new 256] [--repeat 5]
        [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PS = 64


def _stats(xs: list[float]) -> dict:
    return {"best_ms": round(min(xs) * 1e3, 3), "median_ms": round(statistics.median(xs) * 1e3, 3)}


def _gather_part(rank: int, world: int, prefix: int, repeat: int) -> dict:
    import torch
    import torch.distributed as dist

    from engine.parallel.cp import CPShape, OwnerAllocator
    from engine.parallel.cp_gather import GatherPlan, LayerGather
    from engine.runtime.model import preset

    lay = preset("tiny").kv_layout(PS)
    shape = CPShape(world, PS)
    n_pages = prefix // PS
    alloc = OwnerAllocator(shape, n_pages, "L1")
    pages = alloc.alloc_rotation(n_pages, 0)
    rows = n_pages * PS
    pool = torch.randn((lay.num_layers, lay.kv_kinds, rows, lay.kv_heads, lay.head_dim))
    plan = GatherPlan.build(shape, pages)
    ours, plain = [], []
    block = torch.randn((lay.kv_kinds, plan.per_rank * PS, lay.kv_heads, lay.head_dim))
    out = [torch.empty_like(block) for _ in range(world)]
    for _ in range(repeat):
        dist.barrier()
        t0 = time.perf_counter()
        g = LayerGather(plan, rank, pool, [plan.slots(prefix)])
        for layer in range(lay.num_layers):
            g.wait(layer)
            g.release(layer)
        g.close()
        ours.append((time.perf_counter() - t0) / lay.num_layers)
        dist.barrier()
        t0 = time.perf_counter()
        for _layer in range(lay.num_layers):
            dist.all_gather(out, block)
        plain.append((time.perf_counter() - t0) / lay.num_layers)
    layer_bytes = world * block.numel() * block.element_size()
    return {"ours_per_layer": _stats(ours), "plain_per_layer": _stats(plain),
            "assembled_bytes_per_layer": layer_bytes,
            "peak_scratch_bytes": 2 * layer_bytes}


def _ttft_part(rank: int, world: int, prefix: int, new: int, repeat: int) -> dict:
    import numpy as np
    import torch
    import torch.distributed as dist

    from engine.parallel.cp import CPShape, OwnerAllocator
    from engine.runtime.model import Chunk, load_model
    from engine.runtime.ranks.cp_kv import ShardedKV

    model = load_model("tiny")
    lay = model.kv_layout(PS)
    toks = np.random.default_rng(0).integers(0, 256, prefix + new).tolist()
    n_pages = -(-(prefix + new) // PS)
    res: dict = {}
    # CP 1: rank 0 alone, the whole prefix in its pool
    if rank == 0:
        full = torch.zeros((lay.num_layers, lay.kv_kinds, n_pages * PS, lay.kv_heads,
                            lay.head_dim))
        pages = np.arange(n_pages)
        fresh, hit = [], []
        for _ in range(repeat):
            t0 = time.perf_counter()
            model.forward([Chunk(toks[:prefix], 0, pages)], full, PS)
            fresh.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            model.forward([Chunk(toks[prefix:], prefix, pages)], full, PS)
            hit.append(time.perf_counter() - t0)
        res["cp1"] = {"prefill_prefix": _stats(fresh), "ttft_after_prefix": _stats(hit)}
    dist.barrier()
    # CP 2: every rank holds its pages only
    shape = CPShape(world, PS)
    alloc = OwnerAllocator(shape, n_pages, "L1")
    pages = alloc.alloc_rotation(n_pages, 0)
    pool = torch.zeros((lay.num_layers, lay.kv_kinds, n_pages * PS, lay.kv_heads, lay.head_dim))
    fresh, hit = [], []
    for _ in range(repeat):
        dist.barrier()
        t0 = time.perf_counter()
        with ShardedKV([Chunk(toks[:prefix], 0, pages)], pool, shape, rank) as io:
            model.forward([Chunk(toks[:prefix], 0, pages)], io, PS)
        fresh.append(time.perf_counter() - t0)
        dist.barrier()
        t0 = time.perf_counter()
        chunk = Chunk(toks[prefix:], prefix, pages)
        with ShardedKV([chunk], pool, shape, rank) as io:
            model.forward([chunk], io, PS)
        hit.append(time.perf_counter() - t0)
    res["cp2"] = {"prefill_prefix": _stats(fresh), "ttft_after_prefix": _stats(hit),
                  "kv_bytes_per_rank": int(alloc.used_per_rank()[rank]) * PS
                  * lay.token_bytes_per_layer * lay.num_layers}
    return res


def _rank(rank: int, world: int, prefix: int, new: int, repeat: int) -> dict:
    import torch

    torch.set_num_threads(1)          # two ranks on a small machine: one core each
    return {"gather": _gather_part(rank, world, prefix, repeat),
            "ttft": _ttft_part(rank, world, prefix, new, repeat)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefix", type=int, default=8192, help="cached prefix tokens")
    ap.add_argument("--new", type=int, default=256, help="new tokens after the prefix")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if a.prefix % PS or a.prefix < 2 * PS or a.new < 1:
        ap.error(f"--prefix must be a multiple of {PS} (>= {2 * PS}) and --new >= 1")
    from engine.parallel.launch import run_ranks

    r0, _ = run_ranks(_rank, 2, a.prefix, a.new, a.repeat, timeout_s=3600,
                      collective_timeout_s=600)
    out = {"prefix": a.prefix, "new": a.new, "repeat": a.repeat, **r0}
    if a.json:
        print(json.dumps(out, indent=1))
        return
    g = out["gather"]
    print(f"gather of a {a.prefix}-token prefix, per layer "
          f"({g['assembled_bytes_per_layer'] / 2**20:.1f} MiB assembled):")
    print(f"  owner-grouped gather  best {g['ours_per_layer']['best_ms']:8.2f} ms  "
          f"median {g['ours_per_layer']['median_ms']:8.2f} ms")
    print(f"  plain all_gather      best {g['plain_per_layer']['best_ms']:8.2f} ms  "
          f"median {g['plain_per_layer']['median_ms']:8.2f} ms")
    t = out["ttft"]
    for k in ("cp1", "cp2"):
        print(f"{k}: prefill of the prefix best {t[k]['prefill_prefix']['best_ms']:.1f} ms; "
              f"TTFT of {a.new} new tokens after it best "
              f"{t[k]['ttft_after_prefix']['best_ms']:.1f} ms "
              f"(median {t[k]['ttft_after_prefix']['median_ms']:.1f})")


if __name__ == "__main__":
    main()
