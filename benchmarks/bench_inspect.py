"""How fast ``hicache inspect`` loads and summarises a large tree snapshot.

Generates a synthetic snapshot (default one million nodes: a trie of multi-turn
conversations, page size 16, 1–4 pages per edge, L1 on the upper levels, L2 almost everywhere,
a few locked paths), then times, in this process:

* baseline: decoding the msgpack stream alone (the floor any reader pays),
* load: ``load_snapshot`` (decode + validation + numpy columns),
* summary and the default tree view on the columns,
* a diff against a second load of the same file (every page compared by token path),
* the node-object view (what a one-object-per-node loader would build),

and the whole default ``hicache inspect FILE`` command in a subprocess.

    .venv/bin/python benchmarks/bench_inspect.py [--nodes 1000000] [--keep FILE]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from engine.snapshot.take import load_snapshot  # noqa: E402
from engine.snapshot.views import diff, hot, summary, top  # noqa: E402
from formats import snapshot as fmt  # noqa: E402

PAGE = 16


def synthetic_records(n: int, seed: int = 0):
    """A heap-shaped trie (fan-out 1–6, depth ~10) under one root, deterministic."""
    rng = np.random.default_rng(seed)
    fan = rng.integers(1, 7, size=n)
    # parent of node i: nodes are filled level by level, each node taking `fan` children
    parent = np.zeros(n, dtype=np.int64)
    parent[0] = -1
    slots = np.repeat(np.arange(n), fan)[: n - 1]
    parent[1:] = slots
    pages = rng.integers(1, 5, size=n)
    pages[0] = 0
    depth = np.zeros(n, dtype=np.int64)
    for i in range(1, n):  # parents come first
        depth[i] = depth[parent[i]] + 1
    on_l1 = depth <= 4
    on_l2 = rng.random(n) < 0.95
    on_l2 |= ~on_l1  # everything off L1 is backed up (a live tree would have evicted it)
    locked = np.zeros(n, dtype=np.int64)
    for leaf in rng.choice(np.flatnonzero((depth == 4)), size=64, replace=False):
        q = leaf
        while q > 0:
            locked[q] += 1
            q = parent[q]
    tok = rng.integers(0, 150_000, size=int(pages.sum()) * PAGE, dtype=np.uint32)
    tok_bytes = tok.astype("<u4").tobytes()
    off = np.concatenate([[0], np.cumsum(pages * PAGE)]) * 4
    l1_next = l2_next = 0
    hits = rng.poisson(3.0 / (depth + 1)).astype(np.int64)
    for i in range(n):
        k = int(pages[i])
        l1 = l2 = None
        if i and on_l1[i]:
            l1 = np.arange(l1_next, l1_next + k, dtype="<i8").tobytes()
            l1_next += k
        if i and on_l2[i]:
            l2 = np.arange(l2_next, l2_next + k, dtype="<i8").tobytes()
            l2_next += k
        yield fmt.NodeRecord(i, None if i == 0 else int(parent[i]),
                             tok_bytes[off[i]:off[i + 1]], None, l1, l2, 0, int(locked[i]),
                             int(hits[i]), i, 0, None, 0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", type=int, default=1_000_000)
    ap.add_argument("--keep", help="write the snapshot here and keep it")
    args = ap.parse_args()

    path = args.keep or os.path.join(tempfile.mkdtemp(prefix="bench_inspect_"), "big.snapshot")
    header = fmt.make_header(PAGE, model="synthetic", rank={"rank": 0, "world_size": 1},
                             capacity={"l1": 8_000_000, "l2": 80_000_000},
                             meta={"source": "benchmarks/bench_inspect.py"})
    t0 = time.perf_counter()
    n = fmt.write_snapshot(path, header, synthetic_records(args.nodes))
    t_write = time.perf_counter() - t0
    size = os.path.getsize(path)
    print(f"snapshot: {n:,} nodes, {size / 1e6:,.1f} MB, generated+written in {t_write:.2f} s")

    t0 = time.perf_counter()
    with open(path, "rb") as f:
        count = sum(1 for _ in fmt._unpacker(f))
    t_raw = time.perf_counter() - t0
    assert count == n + 2

    t0 = time.perf_counter()
    snap = load_snapshot(path)
    t_load = time.perf_counter() - t0
    t0 = time.perf_counter()
    s = summary(snap)
    t_sum = time.perf_counter() - t0
    t0 = time.perf_counter()
    top(snap, depth=3, max_children=8)
    t_tree = time.perf_counter() - t0
    t0 = time.perf_counter()
    hot(snap, 10)
    t_hot = time.perf_counter() - t0
    t0 = time.perf_counter()
    other = load_snapshot(path)
    same = diff(snap, other)["same"]
    t_diff = time.perf_counter() - t0 - t_load  # the second load counted as the first
    assert same
    t0 = time.perf_counter()
    _ = snap.tree
    t_obj = time.perf_counter() - t0
    assert s["nodes"] == n - 1

    env = dict(os.environ, COLUMNS="200")
    hicache = os.path.join(os.path.dirname(sys.executable), "hicache")
    cmd = [hicache] if os.path.exists(hicache) else [sys.executable, "-m", "hicache_cli.app"]
    t0 = time.perf_counter()
    out = subprocess.run(cmd + ["inspect", path], capture_output=True, text=True, env=env)
    t_cli = time.perf_counter() - t0
    assert out.returncode == 0, out.stderr

    print(f"baseline: msgpack decode of the stream alone   {t_raw:6.2f} s")
    print(f"load_snapshot (decode + checks + columns)      {t_load:6.2f} s  "
          f"({t_load / t_raw:.2f}x the bare decode)")
    print(f"summary                                        {t_sum:6.2f} s")
    print(f"tree view (depth 3)                            {t_tree:6.2f} s")
    print(f"hot prefixes (top 10)                          {t_hot:6.2f} s")
    print(f"LOAD + SUMMARY                                 {t_load + t_sum:6.2f} s")
    print(f"diff against a second copy (all pages)         {t_diff:6.2f} s")
    print(f"node-object view (one object per node)         {t_obj:6.2f} s  "
          f"(load+summary is {t_obj / (t_load + t_sum):.2f}x faster than building it)")
    print(f"`hicache inspect FILE` end to end (subprocess)  {t_cli:6.2f} s")
    if not args.keep:
        os.unlink(path)
        os.rmdir(os.path.dirname(path))


if __name__ == "__main__":
    main()
