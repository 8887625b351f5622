"""How the fleet replay's cost grows with the replica count (engine.sim.fleet).

Usage:
  python benchmarks/bench_fleet.py TRACE [--replicas 1,4,16,64,256] [--l1-tokens 160000]
      [--l2-tokens 0] [--l3-tokens 0] [--routers round-robin,cache-aware] [--repeat 2]

Parses TRACE once, then for every (router, replica count) replays it through the fleet and
prints the best CPU seconds of --repeat runs (process time: on a shared machine wall time follows
the load, CPU time much less), the ratio to the same router at the smallest count, and the hit
rate. The cache work per request is one step on one replica whatever N; what grows with N is the
router's.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine.loadgen.trace import load_trace  # noqa: E402
from engine.sim.fleet import ROUTERS, fleet_replay  # noqa: E402
from engine.sim.replay import ReplayConfig, ReplayInput  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--replicas", default="1,4,16,64,256")
    ap.add_argument("--routers", default=",".join(ROUTERS))
    ap.add_argument("--l1-tokens", type=int, default=160_000)
    ap.add_argument("--l2-tokens", type=int, default=0)
    ap.add_argument("--l3-tokens", type=int, default=0)
    ap.add_argument("--repeat", type=int, default=2)
    a = ap.parse_args()
    inp = ReplayInput(load_trace(a.trace))
    cfg = ReplayConfig(l1_tokens=a.l1_tokens, l2_tokens=a.l2_tokens, l3_tokens=a.l3_tokens,
                       events=False)
    counts = [int(x) for x in a.replicas.split(",")]
    print(f"{len(inp)} requests; L1 {a.l1_tokens:,} L2 {a.l2_tokens:,} L3 {a.l3_tokens:,} per "
          f"replica; load average {os.getloadavg()[0]:.1f}")
    print(f"{'router':<16} {'replicas':>8} {'cpu s':>7} {'x first':>8} {'hit rate':>9}")
    for router in a.routers.split(","):
        base = None
        for n in counts:
            best, hit = float("inf"), 0.0
            for _ in range(a.repeat):
                c0 = time.process_time()
                res = fleet_replay(inp, cfg, n, router)
                best = min(best, time.process_time() - c0)
                hit = res.token_hit_rate
            base = base or best
            print(f"{router:<16} {n:>8} {best:>7.2f} {best / base:>8.2f} {hit:>9.4f}")


if __name__ == "__main__":
    main()
