"""Whole-command time of `hicache bench replay`: what a user waits for, not only cache work.

Usage:
  python benchmarks/bench_replay_cli.py TRACE [--repeat 3] [--page-size 64]
      [--l1-tokens 5120000] [--capacities 320k,640k,1.28m,2.56m,5.12m] [--policies lru,lfu,opt]

Runs, each --repeat times in a fresh interpreter: `hicache --help` (the baseline: what any
command pays to start), a single replay of TRACE, the same from a Parquet copy (`bench
convert-trace`, written to a temporary directory), and a capacity sweep. Prints wall seconds
and CPU seconds (user + sys of the command and its worker processes) for the best run of each,
and the machine's load average, since on a shared machine wall time follows the load and CPU
time much less.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def timed(args: list[str]) -> tuple[float, float]:
    """(wall, cpu) seconds of ``python -m hicache_cli.app ARGS``."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    # stderr passes through: on bad input the command's own one-line error says why
    subprocess.run([sys.executable, "-m", "hicache_cli.app", *args], check=True, env=env,
                   stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def best(args: list[str], repeat: int) -> tuple[float, float]:
    runs = [timed(args) for _ in range(repeat)]
    return min(r[0] for r in runs), min(r[1] for r in runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--page-size", default="64")
    ap.add_argument("--l1-tokens", default="5120000")
    ap.add_argument("--capacities", default="320k,640k,1.28m,2.56m,5.12m")
    ap.add_argument("--policies", default=None, help="sweep policies (default: the command's)")
    a = ap.parse_args()
    single = ["--page-size", a.page_size, "--l1-tokens", a.l1_tokens]
    sweep = ["--page-size", a.page_size, "--sweep", "--capacities", a.capacities]
    if a.policies:
        sweep += ["--policies", a.policies]
    with tempfile.TemporaryDirectory() as tmp:
        parquet = os.path.join(tmp, "trace.parquet")
        timed(["bench", "convert-trace", a.trace, parquet])
        timed(["bench", "replay", a.trace, "--limit", "5"])          # warm the file cache
        rows = [("baseline: hicache --help (interpreter + CLI start-up)",
                 best(["--help"], a.repeat)),
                ("single replay, " + os.path.basename(a.trace),
                 best(["bench", "replay", a.trace, *single], a.repeat)),
                ("single replay, Parquet copy",
                 best(["bench", "replay", parquet, *single], a.repeat)),
                ("sweep " + a.capacities + (f" x {a.policies}" if a.policies else ""),
                 best(["bench", "replay", a.trace, *sweep], a.repeat))]
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs; best of {a.repeat}")
    for name, (wall, cpu) in rows:
        print(f"  {name:<60s} {wall:6.2f} s wall  {cpu:6.2f} s CPU")


if __name__ == "__main__":
    from _errors import run
    run("bench_replay_cli", main)
