"""How fast ``consensus-check`` reads and compares msgpack rank logs (target: ≥ 1M events/s/core).

Generates 8 ranks of synthetic rank logs (benchmarks/gen_ranklogs.py; one data-parallel group
unless ``--dp``), then times, in this process and single-threaded (CPU time = one core):

* baseline: decoding every record of every log with msgpack's C unpacker and nothing else —
  what any checker that looks at every event of every rank pays before comparing anything,
* ``check_consensus`` over the same logs (read, validate, compare, explain),

and the whole ``hicache consensus-check DIR --format json`` command in a subprocess.

    .venv/bin/python benchmarks/bench_consensus.py                # 8 ranks x 250k events
    .venv/bin/python benchmarks/bench_consensus.py --full         # 8 ranks x 2M events
        [--local-diff-rate 0.01] [--inject 'hit_length@rank=3,step=5000'] [--dir DIR] [--keep]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from itertools import islice

import msgpack

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

from gen_ranklogs import generate  # noqa: E402

from checkers.consensus import check_consensus  # noqa: E402


def baseline_decode(paths: list[str]) -> tuple[int, float]:
    """Events decoded and CPU seconds for a plain msgpack decode of every record."""
    gc.disable()
    try:
        t = time.process_time()
        n = 0
        for p in paths:
            with open(p, "rb") as fh:
                u = msgpack.Unpacker(fh, read_size=1 << 20, raw=False)
                while True:
                    got = len(list(islice(u, 65536)))
                    n += got
                    if got < 65536:
                        break
        return n - len(paths), time.process_time() - t   # headers are not events
    finally:
        gc.enable()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--full", action="store_true", help="8 ranks x 2M events (the target size)")
    ap.add_argument("--events", type=int, default=None, help="events per rank (default 250k, "
                    "2M with --full)")
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--local-diff-rate", type=float, default=0.0)
    ap.add_argument("--inject", default=None)
    ap.add_argument("--max-divergences", type=int, default=10)
    ap.add_argument("--dir", default=None, help="where the logs go (default: a temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the generated logs")
    a = ap.parse_args()
    events = a.events or (2_000_000 if a.full else 250_000)
    out = a.dir or tempfile.mkdtemp(prefix="ranklogs-")
    try:
        t0 = time.perf_counter()
        paths = generate(out, ranks=a.ranks, events=events, dp=a.dp,
                         local_diff_rate=a.local_diff_rate, inject=a.inject, quiet=True)
        size = sum(os.path.getsize(p) for p in paths)
        print(f"logs: {a.ranks} ranks x {events:,} events in {a.dp} group(s), "
              f"{size / 1e6:,.0f} MB, local-diff-rate {a.local_diff_rate}, "
              f"inject {a.inject or 'none'} (generated in {time.perf_counter() - t0:.1f} s)")

        base_n, base_s = baseline_decode(paths)
        base_rate = base_n / base_s
        print(f"baseline  msgpack decode of every record : {base_n:>12,} events "
              f"{base_s:7.2f} s  {base_rate / 1e6:6.2f} M events/s/core")

        t_wall, t_cpu = time.perf_counter(), time.process_time()
        report = check_consensus([out], max_divergences=a.max_divergences)
        cpu = time.process_time() - t_cpu
        wall = time.perf_counter() - t_wall
        rate = report.events / cpu
        print(f"consensus-check (check_consensus)        : {report.events:>12,} events "
              f"{cpu:7.2f} s  {rate / 1e6:6.2f} M events/s/core  (wall {wall:.2f} s, "
              f"{rate / base_rate:.1f}x the baseline)")
        print(f"  verdict: {'consistent' if report.consistent else 'inconsistent'}, "
              f"{len(report.divergences)} divergence(s)"
              + "".join(f"\n    {d.category} step {d.step} seq {d.seq} ranks {d.ranks}"
                        for d in report.divergences))

        exe = os.path.join(os.path.dirname(sys.executable), "hicache")
        cmd = ([exe] if os.path.exists(exe) else [sys.executable, "-m", "hicache_cli.app"]) + [
            "consensus-check", out, "--format", "json"]
        t = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        cli_s = time.perf_counter() - t
        verdict = json.loads(proc.stdout)["consistent"] if proc.stdout else proc.stderr.strip()
        print(f"hicache consensus-check DIR --format json: exit {proc.returncode}, "
              f"{cli_s:.2f} s wall ({report.events / cli_s / 1e6:.2f} M events/s including "
              f"start-up), consistent={verdict}")
        target = "meets" if rate >= 1e6 else "MISSES"
        print(f"target >= 1M events/s/core: {target} ({rate / 1e6:.2f} M)")
    finally:
        if not a.keep and not a.dir:
            shutil.rmtree(out, ignore_errors=True)
        elif a.keep:
            print(f"logs kept in {out}")


if __name__ == "__main__":
    main()
