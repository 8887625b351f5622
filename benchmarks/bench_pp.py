"""Pipeline parallelism: the same multi-turn load against `bench serve --pp 1` and `--pp 2`,
throughput and TTFT side by side (docs/parallelism.md).

    .venv/bin/python benchmarks/bench_pp.py [--clients 4] [--rounds 4] [--delay 1:5]
                                            [--micro-batches 1,2] [--tp 2]

The servers run in this process tree on this machine, one after the other, with the same L1/L2
sizes and the same workload: --pp 1, then --pp 2 once per --micro-batches value (1: the stages
take turns; 2 and more: a step's batch is cut so stage 0 works on micro-batch m + 1 while stage
1 works on m). ``--tp N``: every --pp 2 run is ``--pp 2 --tp N`` (each stage a TP group of N
processes). The stages share the machine's cores: on 2 cores expect little or no gain.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from engine.loadgen import LoadConfig, multiturn, run_load, summarize_result  # noqa: E402
from engine.runtime.launch import ServerConfig, start_server  # noqa: E402


def one(pp: int, args, micro_batches: int = 0) -> dict:
    tp = args.tp if pp > 1 else 1
    cfg = ServerConfig(port=0, l1_tokens=args.l1_tokens, l2_tokens=4 * args.l1_tokens, pp=pp, tp=tp,
                       debug_transfer_delay=args.delay if pp > 1 else None,
                       pp_micro_batches=micro_batches if pp > 1 else 0)
    h = start_server(cfg)
    try:
        wl = multiturn(num_clients=args.clients, num_rounds=args.rounds,
                       request_length=args.request_length, output_length=args.output_length,
                       vocab_size=256, seed=0)
        rep = summarize_result(run_load(wl, LoadConfig(url=h.url, concurrency=args.clients)))
    finally:
        h.stop()
    name = f"--pp {pp}" + (f" --tp {tp}" if tp > 1 else "") + \
        (f" mb {micro_batches or pp}" if pp > 1 else "")
    return {"server": name, "ok": rep["requests"]["ok"], "sent": rep["requests"]["sent"],
            "hit_rate": rep["hit_rate"]["total"], "ttft_p50_s": rep["ttft_s"]["p50"],
            "ttft_p99_s": rep["ttft_s"]["p99"],
            "input_tokens_per_s": rep["throughput"]["input_tokens_per_s"],
            "output_tokens_per_s": rep["throughput"]["output_tokens_per_s"]}


def median_row(rows: list[dict]) -> dict:
    """Per metric, the median over the repeats (``ok``: the fewest)."""
    out = dict(rows[0])
    for key, v in rows[0].items():
        if key == "ok":
            out[key] = min(r[key] for r in rows)
        elif isinstance(v, (int, float)) and v is not None:
            out[key] = statistics.median(r[key] for r in rows)
    out["repeats"] = len(rows)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--request-length", type=int, default=128)
    ap.add_argument("--output-length", type=int, default=16)
    ap.add_argument("--l1-tokens", type=int, default=2048)
    ap.add_argument("--delay", default=None, help="--debug-transfer-delay for the --pp 2 run")
    ap.add_argument("--micro-batches", default="1,2",
                    help="--pp-micro-batches values for the --pp 2 runs, comma-separated")
    ap.add_argument("--repeat", type=int, default=1,
                    help="run the servers this many times, interleaved, and report medians "
                         "(a shared, loaded machine varies more between runs than servers do)")
    ap.add_argument("--tp", type=int, default=1, help="--tp for the --pp 2 runs")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    configs = [(1, 0)] + [(2, int(m)) for m in args.micro_batches.split(",")]
    runs = [[one(pp, args, mb) for pp, mb in configs] for _ in range(max(1, args.repeat))]
    rows = [median_row([r[i] for r in runs]) for i in range(len(configs))]
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"{'':22}" + "".join(f"{r['server']:>20}" for r in rows))
    for key in ("ok", "hit_rate", "ttft_p50_s", "ttft_p99_s", "input_tokens_per_s",
                "output_tokens_per_s"):
        fmt = (lambda v: f"{v:.3f}") if isinstance(rows[0][key], float) else str
        print(f"{key:22}" + "".join(f"{fmt(r[key]):>20}" for r in rows))


if __name__ == "__main__":
    main()
