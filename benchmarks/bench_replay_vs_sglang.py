"""Side-by-side: `hicache bench replay` vs SGLang's own RadixCache on the same trace.

Usage:
  python benchmarks/bench_replay_vs_sglang.py TRACE \
      [--peer-python /tmp/peer-sglang-venv/bin/python --peer-script sglang_radix_replay.py] \
      [--page-size 64 --l1-tokens 5120000 --repeat 3 --policy lru]

Runs our replay in this process (best of --repeat, only cache operations timed) with events on
and off (the rank-log overhead), then — when a peer interpreter and script are given — the SGLang
peer in a subprocess on the same token mapping, and prints hit rates, seconds and the speed ratio.
The peer venv is built by the project's shared `make_sglang_venv.sh` (SGLang 0.5.23 from PyPI).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine.loadgen.trace import read_trace  # noqa: E402
from engine.sim.replay import ReplayConfig, replay  # noqa: E402


def ours(records, args, events: bool) -> dict:
    best = None
    for _ in range(args.repeat):
        res, _ = replay(records, ReplayConfig(page_size=args.page_size, l1_tokens=args.l1_tokens,
                                              l2_tokens=0, policy=args.policy, events=events))
        d = res.to_dict()
        if best is None or d["cache_seconds"] < best["cache_seconds"]:
            best = d
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--l1-tokens", type=int, default=5_120_000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--policy", default="lru", help="our eviction policy (SGLang's is LRU)")
    ap.add_argument("--peer-python", default=None)
    ap.add_argument("--peer-script", default=None)
    args = ap.parse_args()

    records = read_trace(args.trace)
    on = ours(records, args, events=True)
    off = ours(records, args, events=False)
    out = {
        "trace": args.trace, "requests": on["requests"], "page_size": args.page_size,
        "l1_tokens": args.l1_tokens, "policy": args.policy,
        "hicache": {"token_hit_rate": on["token_hit_rate"], "cache_seconds": on["cache_seconds"],
                    "cache_seconds_events_off": off["cache_seconds"],
                    "events": on["events"],
                    "event_overhead": round(on["cache_seconds"] / off["cache_seconds"] - 1, 4)},
    }
    if args.peer_python and args.peer_script:
        best = None
        for _ in range(args.repeat):
            proc = subprocess.run([args.peer_python, args.peer_script, args.trace,
                                   str(args.l1_tokens), str(args.page_size)],
                                  capture_output=True, text=True, check=True)
            line = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1]
            d = json.loads(line)
            if best is None or d["seconds"] < best["seconds"]:
                best = d
        out["sglang"] = {"peer": best["peer"], "token_hit_rate": best["token_hit_rate"],
                         "seconds": best["seconds"]}
        out["hit_rate_diff"] = round(on["token_hit_rate"] - best["token_hit_rate"], 4)
        out["speedup_vs_sglang"] = round(best["seconds"] / on["cache_seconds"], 2)
        out["meets_hit_rate_within_0.002"] = abs(out["hit_rate_diff"]) <= 0.002
        out["meets_half_time"] = on["cache_seconds"] <= best["seconds"] / 2
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    from _errors import run
    run("bench_replay_vs_sglang", main)
