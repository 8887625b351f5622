"""Report math on known inputs."""

import math

import pytest

from engine.loadgen.driver import LoadConfig, RequestRecord, normalize_url
from engine.loadgen.report import latency_stats, summarize


def rec(i, status="ok", prompt=100, cached=0, dev=0, host=0, sto=0, ttft=0.0, q=0.0, out=10):
    return RequestRecord(session=i, turn=0, start=float(i), status=status, prompt_tokens=prompt,
                         completion_tokens=out, cached_tokens=cached, cached_device=dev,
                         cached_host=host, cached_storage=sto, ttft=ttft, queue_time=q,
                         e2e_latency=2 * ttft)


def test_percentiles_linear():
    s = latency_stats([float(v) for v in range(1, 101)])
    assert s["p50"] == pytest.approx(50.5)
    assert s["p90"] == pytest.approx(90.1)
    assert s["p99"] == pytest.approx(99.01)
    assert s["mean"] == pytest.approx(50.5)
    assert latency_stats([]) == {"p50": None, "p90": None, "p99": None, "mean": None}
    assert latency_stats([1.0, math.nan])["p99"] == 1.0


def test_summary_hit_rates_throughput_errors():
    records = [
        rec(0, prompt=100, cached=0, ttft=0.1, q=0.01),
        rec(1, prompt=200, cached=150, dev=100, host=50, ttft=0.3, q=0.03),
        rec(2, prompt=100, cached=100, dev=20, host=30, sto=50, ttft=0.2, q=0.02),
        rec(3, status="400", prompt=0, out=0),
        rec(4, status="connection", prompt=0, out=0),
        rec(5, status="400", prompt=0, out=0),
    ]
    s = summarize(records, wall_s=2.0, workload="w")
    assert s["requests"] == {"sent": 6, "ok": 3, "failed": 3}
    assert s["errors_by_status"] == {"400": 2, "connection": 1}
    assert s["tokens"] == {"prompt": 400, "completion": 30, "cached": 250, "device": 120,
                           "host": 80, "storage": 50}
    assert s["hit_rate"] == {"device": 0.3, "host": 0.2, "storage": 0.125, "total": 0.625}
    assert s["ttft_s"]["p50"] == pytest.approx(0.2)
    assert s["queue_time_s"]["mean"] == pytest.approx(0.02)
    assert s["throughput"] == {"requests_per_s": 1.5, "input_tokens_per_s": 200.0,
                               "output_tokens_per_s": 15.0}


def test_all_failed_has_no_rates():
    s = summarize([rec(0, status="500", prompt=0)], wall_s=1.0)
    assert s["hit_rate"]["total"] is None and s["ttft_s"]["p50"] is None
    assert s["throughput"]["requests_per_s"] == 0


def test_url_and_config_validation():
    assert normalize_url("127.0.0.1:30000/") == "http://127.0.0.1:30000"
    assert normalize_url("https://h:1") == "https://h:1"
    for bad in ("ftp://x:1", "http://", "http://h:notaport"):
        with pytest.raises(ValueError):
            normalize_url(bad)
    with pytest.raises(ValueError, match="concurrency"):
        LoadConfig("h:1", concurrency=0)
    with pytest.raises(ValueError, match="duration"):
        LoadConfig("h:1", duration=-1)
