"""Summary of a load run: latency percentiles, throughput, hit rate per tier, errors by status.

Latencies and hit rates are computed over the requests that succeeded; throughput divides the
successful requests' tokens by the wall time of the whole run. Hit rate of a tier = tokens the
server reported as cached on that tier (``meta_info.cached_tokens_details``) / prompt tokens.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Sequence

import numpy as np

from engine.loadgen.driver import PD_FIELDS, LoadResult, RequestRecord

PERCENTILES = (50, 90, 99)
TIERS = ("device", "host", "storage")


def latency_stats(values: Sequence[float]) -> dict[str, float | None]:
    """p50/p90/p99 (linear interpolation) and mean of the finite values; ``None`` when empty."""
    arr = np.asarray([v for v in values if v is not None and math.isfinite(v)], dtype=np.float64)
    if arr.size == 0:
        return {**{f"p{p}": None for p in PERCENTILES}, "mean": None}
    pct = np.percentile(arr, PERCENTILES)
    return {**{f"p{p}": float(v) for p, v in zip(PERCENTILES, pct)}, "mean": float(arr.mean())}


def pd_summary(ok: Sequence[RequestRecord]) -> dict | None:
    """Sums of ``meta_info.pd_transfer`` (tokens, bytes; ``redundant_bytes`` is the
    missing-only audit: 0), or None when the server is not disaggregated."""
    pd = [r.pd_transfer for r in ok if r.pd_transfer is not None]
    if not pd:
        return None
    return {"requests": len(pd), **{k: sum(x[k] for x in pd) for k in PD_FIELDS}}


def summarize(records: Sequence[RequestRecord], wall_s: float, *, workload: str = "",
              stopped_by: str = "done") -> dict:
    ok = [r for r in records if r.ok]
    errors = Counter(r.status for r in records if not r.ok)
    prompt = sum(r.prompt_tokens for r in ok)
    completion = sum(r.completion_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    per_tier = {t: sum(getattr(r, f"cached_{t}") for r in ok) for t in TIERS}
    wall = max(wall_s, 1e-9)

    def rate(n: int) -> float | None:
        return n / prompt if prompt else None

    spec = [r for r in ok if r.spec_verify_steps]
    spec_steps = sum(r.spec_verify_steps for r in spec)
    first_error = next((f"{r.status}: {r.error}" for r in records if not r.ok and r.error), None)
    return {
        "workload": workload,
        "stopped_by": stopped_by,
        "duration_s": wall_s,
        "requests": {"sent": len(records), "ok": len(ok), "failed": len(records) - len(ok)},
        "errors_by_status": dict(sorted(errors.items())),
        "first_error": first_error,
        "tokens": {"prompt": prompt, "completion": completion, "cached": cached, **per_tier},
        "hit_rate": {**{t: rate(per_tier[t]) for t in TIERS}, "total": rate(cached)},
        "ttft_s": latency_stats([r.ttft for r in ok]),
        "queue_time_s": latency_stats([r.queue_time for r in ok]),
        "e2e_latency_s": latency_stats([r.e2e_latency for r in ok]),
        # speculative decoding: output tokens per target forward (1.0 without speculation)
        "tokens_per_target_step": (sum(r.completion_tokens - 1 for r in spec) / spec_steps
                                   if spec_steps else None),
        "pd_transfer": pd_summary(ok),
        "throughput": {
            "requests_per_s": len(ok) / wall,
            "input_tokens_per_s": prompt / wall,
            "output_tokens_per_s": completion / wall,
        },
    }


def summarize_result(result: LoadResult) -> dict:
    return summarize(result.records, result.wall_s, workload=result.workload,
                     stopped_by=result.stopped_by)
