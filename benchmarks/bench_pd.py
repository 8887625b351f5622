"""P/D disaggregation: bytes on the link and TTFT with decode-side reuse on vs off (docs/pd.md).

    .venv/bin/python benchmarks/bench_pd.py [--clients 4] [--rounds 4] [--request-length 128]

For each setting this starts ``bench serve --disaggregation pd`` in-process (a decode worker
serving HTTP plus a prefill worker process, each its own cache stack), drives it with a
multi-turn ``hicache bench run`` (a separate process, the same command a user runs) and puts
the two reports side by side: prompt tokens the decode worker reused, tokens and bytes that
crossed the link, the missing-only audit (redundant bytes), TTFT. The link bytes are also read
back from ``/metrics`` and must agree with the per-request sums.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import requests  # noqa: E402

from engine.runtime.launch import ServerConfig, start_server  # noqa: E402


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise SystemExit(f"{name} missing from /metrics")


def one(reuse: bool, a: argparse.Namespace) -> dict:
    cfg = ServerConfig(port=0, model=a.model, page_size=16, l1_tokens=a.l1_tokens,
                       l2_tokens=a.l1_tokens * 4, chunked_prefill_size=512,
                       disaggregation="pd", pd_decode_reuse=reuse)
    with start_server(cfg) as h:
        cmd = [sys.executable, "-m", "hicache_cli.app", "bench", "run", "--url", h.url,
               "--workload", "multiturn", "--num-clients", str(a.clients),
               "--num-rounds", str(a.rounds), "--request-length", str(a.request_length),
               "--output-length", str(a.output_length), "--seed", "0", "--format", "json"]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True,
                             env={**os.environ, "PYTHONPATH": os.getcwd()})
        rep = json.loads(out.stdout)
        text = requests.get(h.url + "/metrics", timeout=30).text
    pd = rep["pd_transfer"]
    assert pd is not None, "no pd_transfer in the report"
    assert metric(text, "hicache_pd_transfer_bytes_total") == pd["bytes"], "metrics disagree"
    return {"requests_ok": rep["requests"]["ok"], "requests_sent": rep["requests"]["sent"],
            "prompt_tokens": rep["tokens"]["prompt"],
            "decode_reused_tokens": pd["decode_device"] + pd["decode_host"]
            + pd["decode_storage"],
            "transferred_tokens": pd["transferred"], "link_MiB": round(pd["bytes"] / 2**20, 2),
            "redundant_bytes": pd["redundant_bytes"],
            "ttft_p50_ms": round(rep["ttft_s"]["p50"] * 1e3, 1),
            "ttft_p90_ms": round(rep["ttft_s"]["p90"] * 1e3, 1),
            "ttft_mean_ms": round(rep["ttft_s"]["mean"] * 1e3, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--request-length", type=int, default=128)
    ap.add_argument("--output-length", type=int, default=8)
    ap.add_argument("--l1-tokens", type=int, default=16384)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    rows = {"reuse on": one(True, a), "reuse off": one(False, a)}
    if a.json:
        print(json.dumps(rows, indent=1))
        return
    keys = list(rows["reuse on"])
    print(f"{'':24}{'reuse on':>14}{'reuse off':>14}")
    for k in keys:
        print(f"{k:24}{rows['reuse on'][k]!s:>14}{rows['reuse off'][k]!s:>14}")


if __name__ == "__main__":
    main()
