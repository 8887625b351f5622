"""Tensor parallelism: the same multi-turn load against `bench serve --tp 1` and `--tp 2`,
throughput, TTFT and KV bytes per rank side by side (docs/parallelism.md, "bench serve --tp N").

    .venv/bin/python benchmarks/bench_tp.py [--model tiny] [--clients 4] [--rounds 4] [--json]

The servers run one after the other on this machine, with the same L1/L2 sizes and workload.
Each TP rank is a process doing half the attention heads and half the MLP, then two all-reduces
per layer; on 2 shared CPU cores the ranks compete for the same cores, so expect no speed-up —
the figure worth reading there is the KV bytes per rank (half).
"""

from __future__ import annotations

import argparse
import json
import os
import re

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import requests  # noqa: E402

from engine.loadgen import LoadConfig, multiturn, run_load, summarize_result  # noqa: E402
from engine.runtime.launch import ServerConfig, start_server  # noqa: E402


def _kv_bytes(url: str) -> list[int]:
    text = requests.get(url + "/metrics", timeout=30).text
    got = re.findall(r'hicache_kv_bytes\{rank="(\d+)",tier="device"\} (\S+)', text)
    if got:
        return [int(float(b)) for _, b in sorted(got)]
    used = re.search(r'hicache_pool_used_tokens\{tier="device"\} (\S+)', text)
    return [int(float(used.group(1)))] if used else []      # tokens; scaled below


def one(tp: int, args) -> dict:
    cfg = ServerConfig(port=0, model=args.model, l1_tokens=args.l1_tokens,
                       l2_tokens=4 * args.l1_tokens, tp=tp)
    h = start_server(cfg)
    try:
        wl = multiturn(num_clients=args.clients, num_rounds=args.rounds,
                       request_length=args.request_length, output_length=args.output_length,
                       vocab_size=256, seed=0)
        rep = summarize_result(run_load(wl, LoadConfig(url=h.url, concurrency=args.clients)))
        kv = _kv_bytes(h.url)
        if tp == 1 and kv:                 # one rank: used tokens x bytes per token
            kv = [kv[0] * h.engine.model.kv_layout(cfg.page_size).page_bytes // cfg.page_size]
    finally:
        h.stop()
    return {"tp": tp, "ok": rep["requests"]["ok"], "sent": rep["requests"]["sent"],
            "hit_rate": rep["hit_rate"]["total"], "ttft_p50_s": rep["ttft_s"]["p50"],
            "ttft_p99_s": rep["ttft_s"]["p99"],
            "input_tokens_per_s": rep["throughput"]["input_tokens_per_s"],
            "output_tokens_per_s": rep["throughput"]["output_tokens_per_s"],
            "device_kv_bytes_per_rank": kv}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--request-length", type=int, default=128)
    ap.add_argument("--output-length", type=int, default=16)
    ap.add_argument("--l1-tokens", type=int, default=2048)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = [one(1, args), one(2, args)]
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"{'':26}{'--tp 1':>24}{'--tp 2':>24}")
    for key in ("ok", "hit_rate", "ttft_p50_s", "ttft_p99_s", "input_tokens_per_s",
                "output_tokens_per_s", "device_kv_bytes_per_rank"):
        a, b = rows[0][key], rows[1][key]
        fmt = (lambda v: f"{v:.3f}") if isinstance(a, float) else str
        print(f"{key:26}{fmt(a):>24}{fmt(b):>24}")


if __name__ == "__main__":
    main()
