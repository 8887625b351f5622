"""Sizes and counts from the command line are checked against the machine before anything is
allocated or spawned: a usage error (exit 2) naming the option and what would fit."""

from __future__ import annotations

import os

import pytest
from typer.testing import CliRunner

from engine.core.device import max_local_ranks
from engine.runtime.serving import Engine, ServerConfig
from hicache_cli.app import app

runner = CliRunner()
DATA = os.path.join(os.path.dirname(__file__), "data", "conversation_trace_head400.jsonl.gz")


@pytest.mark.parametrize("kw, opt", [
    ({"l1_tokens": 10**18}, "--l1-tokens 1,000,000,000,000,000,000 needs"),
    ({"l2_tokens": 10**18}, "--l2-tokens: an L2 of 1,000,000,000,000,000,000 tokens needs"),
    ({"hicache_size_gb": 1e12}, "--hicache-size: an L2 of"),
    ({"hicache_ratio": 1e15}, "--hicache-ratio: an L2 of"),
])
def test_tier_sizes_beyond_memory_are_usage_errors(kw, opt):
    with pytest.raises(ValueError, match=opt) as e:
        Engine(ServerConfig(port=0, **kw))
    assert "fit" in str(e.value) and "available" in str(e.value)


@pytest.mark.parametrize("kw, opt", [
    ({"hicache_ratio": float("inf")}, "--hicache-ratio"),
    ({"hicache_ratio": float("nan")}, "--hicache-ratio"),
    ({"hicache_size_gb": float("nan")}, "--hicache-size"),
    ({"hicache_storage_prefetch_timeout": float("nan")}, "--hicache-storage-prefetch-timeout"),
    ({"hicache_storage_prefetch_timeout": float("inf")}, "--hicache-storage-prefetch-timeout"),
])
def test_non_finite_values_are_refused(kw, opt):
    with pytest.raises(ValueError, match=f"{opt} must be a finite number >= 0"):
        ServerConfig(**kw)


def test_serve_and_main_job_report_the_option():
    r = runner.invoke(app, ["bench", "serve", "--port", "0", "--l1-tokens", str(10**18)])
    assert r.exit_code == 2 and "--l1-tokens 1,000,000,000,000,000,000 needs" in r.stderr
    assert "Traceback" not in r.output
    r = runner.invoke(app, ["bench", "--num-clients", "1", "--num-rounds", "1", "--l1-tokens",
                            str(10**18)])
    assert r.exit_code == 2 and "--l1-tokens" in r.output and "Traceback" not in r.output


@pytest.mark.parametrize("n, msg", [("0", "--ranks must be >= 1, got 0"),
                                    ("-3", "--ranks must be >= 1, got -3"),
                                    ("100000", "--ranks 100000: this machine can run at most")])
def test_ranks_are_bounded(n, msg):
    r = runner.invoke(app, ["bench", "replay", DATA, "--limit", "5", "--ranks", n])
    assert r.exit_code == 2 and msg in r.stderr, r.output
    cap, why = max_local_ranks()
    assert 1 <= cap and "CPUs" in why
