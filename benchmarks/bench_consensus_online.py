"""What ``--consensus-check online`` costs a live multi-rank server (target: ≤ 5% of step time
on the tiny model).

The same request script runs against a ``--tp 2`` (or ``--pp 2``) server three ways — online
check off, ``--consensus-every 8`` (the default) and ``--consensus-every 1`` (before every
step's forward) — in rounds that alternate the three (A/B/C, B/C/A, …) so the machine's drift
hits each alike. Per run: wall seconds and scheduler steps (``/metrics``
``scheduler_steps_total``); the figures are the median time per step of each mode, its ratio
to the run without the check (noisy on 2 shared cores: the rank processes and the HTTP server
share them), and the check's own time on rank 0 per step (digesting each event and comparing,
timed inside :class:`~engine.parallel.consensus_online.OnlineConsensus`) as a share of the
step — the direct cost.

    .venv/bin/python benchmarks/bench_consensus_online.py            # tp 2, 3 rounds
    .venv/bin/python benchmarks/bench_consensus_online.py --pp 2 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import requests

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from engine.runtime.launch import ServerConfig, start_server  # noqa: E402

MODES = {"off": None, "every 8": 8, "every 1": 1}


def _script(n: int) -> list[list[int]]:
    """Sessions that share prefixes and grow (matches, hits, evictions, backups)."""
    base = [256] + [(7 * i) % 250 for i in range(120)]
    return [base[:40 + 13 * (i % 7)] + [(i * 31 + j) % 250 for j in range(20 + i % 9)]
            for i in range(n)]


def _steps(url: str) -> float:
    text = requests.get(url + "/metrics", timeout=30).text
    m = re.search(r"^\S*scheduler_steps_total(?:\{[^}]*\})? ([0-9.e+]+)$", text, re.M)
    return float(m.group(1)) if m else float("nan")


def one_run(args, every: int | None, prompts: list[list[int]]) -> dict:
    kw = dict(consensus_check="online", consensus_every=every) if every else {}
    with tempfile.TemporaryDirectory() as logs:
        cfg = ServerConfig(port=0, tp=args.tp, pp=args.pp, l1_tokens=512, l2_tokens=4096,
                           page_size=16, rank_log_dir=logs, **kw)
        with start_server(cfg) as h:
            body = (lambda ids: {"input_ids": ids, "sampling_params": {
                "max_new_tokens": args.new_tokens, "temperature": 0, "ignore_eos": True}})
            requests.post(h.url + "/generate", json=body(prompts[0]), timeout=120)  # warm
            s0 = _steps(h.url)
            online = h.engine.scheduler.consensus   # rank 0's check, in this process
            c0 = online.seconds if online is not None else 0.0
            t0 = time.perf_counter()
            with ThreadPoolExecutor(args.clients) as pool:
                codes = list(pool.map(lambda ids: requests.post(
                    h.url + "/generate", json=body(ids), timeout=300).status_code, prompts))
            wall = time.perf_counter() - t0
            steps = _steps(h.url) - s0
            spent = online.seconds - c0 if online is not None else 0.0
    assert all(c == 200 for c in codes), codes
    return {"wall_s": wall, "steps": steps, "ms_per_step": 1000 * wall / max(steps, 1),
            "check_ms_per_step": 1000 * spent / max(steps, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--clients", type=int, default=2)
    args = ap.parse_args()
    prompts = _script(args.requests)
    names = list(MODES)
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for n in order:
            runs[n].append(one_run(args, MODES[n], prompts))
    base = statistics.median(x["ms_per_step"] for x in runs["off"])
    out = {"shape": {"tp": args.tp, "pp": args.pp}, "rounds": args.rounds,
           "requests": args.requests, "new_tokens": args.new_tokens, "cpus": os.cpu_count(),
           "modes": {}}
    for n in names:
        med = statistics.median(x["ms_per_step"] for x in runs[n])
        out["modes"][n] = {"median_ms_per_step": round(med, 3),
                           "vs_off": round(med / base, 3),
                           "steps": [x["steps"] for x in runs[n]],
                           # the check's own time on rank 0 over the timed requests
                           "check_ms_per_step": round(statistics.median(
                               x["check_ms_per_step"] for x in runs[n]), 3),
                           "check_share_of_step": round(statistics.median(
                               x["check_ms_per_step"] / x["ms_per_step"] for x in runs[n]), 4),
                           "ms_per_step": [round(x["ms_per_step"], 3) for x in runs[n]]}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
