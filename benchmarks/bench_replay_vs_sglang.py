"""Side by side: `hicache bench replay` vs SGLang's own RadixCache on the same trace, fairly.

Usage:
  python benchmarks/bench_replay_vs_sglang.py TRACE --peer-python /tmp/peer-sglang-venv/bin/python
      [--peer-script benchmarks/peer_sglang_radix.py] [--page-size 64] [--l1-tokens 5120000]
      [--repeat 5] [--threads 1] [--json]
  python benchmarks/bench_replay_vs_sglang.py TRACE --no-peer      (hicache only, said so)

Both sides run as fresh processes with the same pinned thread counts (OMP_NUM_THREADS,
MKL_NUM_THREADS, OPENBLAS_NUM_THREADS, ... = --threads; the peer also calls
torch.set_num_threads and reports what it got). On a shared machine an unpinned torch spreads
OpenMP threads over busy cores and its time swings by an order of magnitude for the same work.
Repeats are interleaved (hicache, peer, peer, hicache, ...: each round swaps who goes first), and
every figure is printed as min / median / max over the repeats: cache seconds (cache operations
only, as each side times them), the whole command's wall and CPU seconds and its peak RSS.
Ratios are of the medians.

The peer script ships here (`peer_sglang_radix.py`); the peer interpreter is a venv with SGLang
0.5.23 (`pip install sglang==0.5.23` into any venv; CPU is enough). Without one the command
stops with one line instead of printing a one-sided result, unless --no-peer asks for that.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS",
               "NUMEXPR_NUM_THREADS", "VECLIB_MAXIMUM_THREADS", "RAYON_NUM_THREADS")


def pinned_env(threads: int) -> dict:
    env = {**os.environ, **{v: str(threads) for v in THREAD_VARS},
           "TOKENIZERS_PARALLELISM": "false", "PYTHONWARNINGS": "ignore"}
    env["PYTHONPATH"] = ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")
    return env


def timed(cmd: list[str], env: dict) -> dict:
    """One fresh process: its last JSON object on stdout, plus its wall and CPU seconds and
    peak RSS (``os.wait4`` on this child: its own rusage, not all children's)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    chunks: dict[str, bytes] = {}

    def drain(name, pipe):
        chunks[name] = pipe.read()

    ts = [threading.Thread(target=drain, args=(n, p))
          for n, p in (("out", proc.stdout), ("err", proc.stderr))]
    for t in ts:
        t.start()
    _, status, ru = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    for t in ts:
        t.join()
    proc.returncode = os.waitstatus_to_exitcode(status)
    out = chunks["out"].decode(errors="replace")
    err = chunks["err"].decode(errors="replace")
    if proc.returncode != 0:
        last = (err.strip().splitlines() or ["(no output)"])[-1]
        sys.exit(f"bench_replay_vs_sglang: {' '.join(os.path.basename(c) for c in cmd[:3])} "
                 f"… exited with {proc.returncode}: {last}")
    doc = _last_json(out)
    doc["_wall"] = wall
    doc["_cpu"] = ru.ru_utime + ru.ru_stime
    doc["_rss_mb"] = ru.ru_maxrss / 1024
    return doc


def _last_json(text: str) -> dict:
    """The last top-level JSON object in ``text`` (our command prints one indented object,
    the peer one line)."""
    dec = json.JSONDecoder()
    i, last = 0, None
    while True:
        j = text.find("{", i)
        if j < 0:
            break
        try:
            last, end = dec.raw_decode(text, j)
            i = end
        except ValueError:
            i = j + 1
    if last is None:
        sys.exit("bench_replay_vs_sglang: a side printed no JSON result")
    return last


def spread(xs: list[float], nd: int = 3) -> str:
    return (f"{min(xs):.{nd}f} / {statistics.median(xs):.{nd}f} / {max(xs):.{nd}f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--l1-tokens", type=int, default=5_120_000)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="thread count pinned on both sides")
    ap.add_argument("--policy", default="lru", help="our eviction policy (SGLang's is LRU)")
    ap.add_argument("--peer-python", default=None, help="interpreter of a venv with SGLang")
    ap.add_argument("--peer-script", default=os.path.join(HERE, "peer_sglang_radix.py"))
    ap.add_argument("--no-peer", action="store_true", help="run hicache only (said in the output)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    a = ap.parse_args()
    if a.repeat < 1 or a.threads < 1:
        sys.exit("bench_replay_vs_sglang: --repeat and --threads must be >= 1")
    if not os.path.isfile(a.trace):
        sys.exit(f"bench_replay_vs_sglang: {a.trace}: no such file")
    if not a.no_peer:
        if not a.peer_python:
            sys.exit("bench_replay_vs_sglang: no peer: pass --peer-python PATH (a venv with "
                     "sglang 0.5.23) or --no-peer for hicache alone")
        for what, path in (("--peer-python", a.peer_python), ("--peer-script", a.peer_script)):
            if not os.path.isfile(path):
                sys.exit(f"bench_replay_vs_sglang: {what} {path}: no such file")
    env = pinned_env(a.threads)
    ours_cmd = [sys.executable, "-m", "hicache_cli.app", "bench", "replay", a.trace,
                "--page-size", str(a.page_size), "--l1-tokens", str(a.l1_tokens),
                "--policy", a.policy, "--format", "json"]
    peer_cmd = [a.peer_python or "", a.peer_script, a.trace, str(a.l1_tokens), str(a.page_size)]
    load0 = os.getloadavg()[0]
    runs: dict[str, list[dict]] = {"hicache": [], "sglang": []}
    for r in range(a.repeat):
        order = ["hicache", "sglang"] if r % 2 == 0 else ["sglang", "hicache"]
        for side in order:
            if side == "sglang" and a.no_peer:
                continue
            runs[side].append(timed(ours_cmd if side == "hicache" else peer_cmd, env))
    load1 = os.getloadavg()[0]
    pin = " ".join(f"{v}={a.threads}" for v in THREAD_VARS[:3])
    rows = {}
    for side, docs in runs.items():
        if not docs:
            continue
        rows[side] = {
            "token_hit_rate": docs[0]["token_hit_rate"],
            "cache_seconds": [d.get("cache_seconds", d.get("seconds")) for d in docs],
            "wall_seconds": [round(d["_wall"], 3) for d in docs],
            "cpu_seconds": [round(d["_cpu"], 3) for d in docs],
            "peak_rss_mb": [round(d["_rss_mb"], 1) for d in docs],
        }
        if side == "sglang":
            rows[side]["torch_threads"] = sorted({d.get("torch_threads") for d in docs})
    out = {"trace": a.trace, "requests": runs["hicache"][0]["requests"],
           "page_size": a.page_size, "l1_tokens": a.l1_tokens, "policy": a.policy,
           "threads_pinned": {v: a.threads for v in THREAD_VARS}, "repeat": a.repeat,
           "interleaved": True, "load_average": [round(load0, 2), round(load1, 2)],
           "sides": rows}
    if "sglang" in rows:
        med = {s: {k: statistics.median(v) for k, v in rows[s].items()
                   if isinstance(v, list) and v and isinstance(v[0], (int, float))}
               for s in rows}
        out["ratio_sglang_over_hicache"] = {
            k: round(med["sglang"][k] / med["hicache"][k], 2)
            for k in ("cache_seconds", "wall_seconds", "cpu_seconds", "peak_rss_mb")}
        out["hit_rate_diff"] = round(rows["hicache"]["token_hit_rate"]
                                     - rows["sglang"]["token_hit_rate"], 6)
    if a.json:
        print(json.dumps(out, indent=2))
        return
    print(f"threads pinned on both sides: {pin} (and {', '.join(THREAD_VARS[3:])}); "
          f"peer torch threads: {rows.get('sglang', {}).get('torch_threads', '-')}")
    print(f"{out['requests']:,} requests, page {a.page_size}, L1 {a.l1_tokens:,} tokens, "
          f"{a.repeat} interleaved rounds, load average {load0:.2f} -> {load1:.2f}")
    if a.no_peer:
        print("no peer run (--no-peer): hicache figures only")
    print(f"{'':10s} {'hit rate':>9s}  {'cache s (min/med/max)':>24s}  "
          f"{'wall s':>22s}  {'CPU s':>22s}  {'peak RSS MB':>24s}")
    for side, row in rows.items():
        print(f"{side:10s} {row['token_hit_rate']:9.4f}  {spread(row['cache_seconds']):>24s}  "
              f"{spread(row['wall_seconds'], 2):>22s}  {spread(row['cpu_seconds'], 2):>22s}  "
              f"{spread(row['peak_rss_mb'], 0):>24s}")
    if "ratio_sglang_over_hicache" in out:
        r = out["ratio_sglang_over_hicache"]
        print(f"sglang / hicache (medians): cache {r['cache_seconds']}x, wall "
              f"{r['wall_seconds']}x, CPU {r['cpu_seconds']}x, peak RSS {r['peak_rss_mb']}x; "
              f"hit-rate difference {out['hit_rate_diff']:+.6f}")


if __name__ == "__main__":
    from _errors import run
    run("bench_replay_vs_sglang", main)
