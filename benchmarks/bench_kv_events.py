"""Cost of one KV-event sync (engine.runtime.serving.kv_events.BlockTracker) on the scheduler
thread: the first sync of a tree of N nodes × 8 pages (every page hashed and published), then a
sync with nothing changed (a walk of the nodes), then one after one new prompt.

  python benchmarks/bench_kv_events.py [NODES]
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine.cache.facade import HiCache  # noqa: E402
from engine.cache.types import CacheConfig  # noqa: E402
from engine.runtime.serving.kv_events import BlockTracker  # noqa: E402


def main(n: int) -> None:
    cache = HiCache(CacheConfig(page_size=16, l1_tokens=16 * (n + 1) * 8, l2_tokens=0))
    rng = np.random.default_rng(0)
    for _ in range(n):
        cache.insert(rng.integers(0, 1000, 128).astype(np.uint32), cache.alloc(8))
    tracker = BlockTracker(cache.tree, "DISK")
    t0 = time.perf_counter()
    first = tracker.sync()
    t1 = time.perf_counter()
    again = tracker.sync()
    t2 = time.perf_counter()
    cache.insert(rng.integers(0, 1000, 128).astype(np.uint32), cache.alloc(8))
    t3 = time.perf_counter()
    one = tracker.sync()
    t4 = time.perf_counter()
    print(f"{n} nodes, {n * 8} pages: first sync {t1 - t0:.3f} s ({len(first)} events), "
          f"unchanged {1e3 * (t2 - t1):.1f} ms ({len(again)} events), after one prompt "
          f"{1e3 * (t4 - t3):.1f} ms ({len(one)} events)")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 8000)
