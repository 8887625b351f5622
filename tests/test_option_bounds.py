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
    ({"hicache_size_gb": 1e8}, "--hicache-size: an L2 of"),
    ({"hicache_ratio": 1e5}, "--hicache-ratio: an L2 of"),
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


# --- ranges of the numeric options no memory check covers (issue 24 §6) -----------------------

@pytest.mark.parametrize("args, msg", [
    (["--hicache-ratio", "1e308"], "--hicache-ratio must be a finite number >= 0 and <= 1e+06"),
    (["--hicache-size", "1e308"], "--hicache-size must be a finite number >= 0 and <= 1e+09"),
    (["--collective-timeout", "1e308"], "--collective-timeout must be a finite number >= 1 and"),
    (["--collective-timeout", "1e-300"], "--collective-timeout must be a finite number >= 1 and"),
    (["--collective-timeout", "nan"], "--collective-timeout must be a finite number"),
    (["--hicache-storage-prefetch-timeout", "1e308"],
     "--hicache-storage-prefetch-timeout must be a finite number >= 0 and <= 604800"),
    (["--pd-transfer-timeout", "1e308"], "--pd-transfer-timeout must be a finite number > 0"),
    (["--hicache-storage-backend", "file", "--hicache-storage-size-limit", "-5GiB"],
     "--hicache-storage-size-limit: not a size: '-5GiB'"),
    (["--hicache-storage-size-limit", "-5GiB"], "--hicache-storage-size-limit: not a size"),
    (["--seed", "-1"], "--seed must be an integer in [0, 2**63 - 1], got -1"),
    (["--seed", str(1 << 64)], "--seed must be an integer in [0, 2**63 - 1]"),
    (["--cp", "1000"], "--cp 1000: 1,000 rank processes on this host; it can run at most"),
    (["--cp", "16", "--tp", "2", "--pp", "8"], "256 rank processes on this host"),
])
def test_serve_refuses_out_of_range_values_at_once(args, msg):
    """Each was a traceback, a run that spawned hundreds of processes (--cp 1000), or a value
    silently accepted (a negative size limit, a negative seed): now exit 2, one line, the range."""
    r = runner.invoke(app, ["bench", "serve", "--port", "0", *args])
    assert r.exit_code == 2, r.output
    assert msg in r.stderr and "Traceback" not in r.output
    assert len(r.stderr.strip().splitlines()) == 1


def test_a_huge_prefetch_timeout_still_waits_and_returns():
    """The prefetch wait clamps its timer to what threading accepts (a library caller may pass
    any float; the 500 came from Event.wait(1e308) raising OverflowError)."""
    import threading

    import numpy as np

    from engine.cache.l3 import Job, StoreTier
    from engine.storage import L3Store, MemoryStoreConfig
    from engine.storage.backends.memory import MemoryBackend
    from tests.factories import make_cache

    c = make_cache(page_size=4, l1_pages=4, l2_pages=4)
    c.attach_l3(StoreTier(L3Store(MemoryBackend(MemoryStoreConfig()), c.config.layout), c.l2),
                prefetch_policy="timeout", prefetch_timeout=1e308)
    job = Job("get", [], np.zeros(0, np.int64), None, 0)
    threading.Timer(0.2, job.event.set).start()
    assert c.l3.wait(job) is True


@pytest.mark.parametrize("args, msg", [
    (["bench", "replay", DATA, "--limit", "5", "--cp", "100000"],
     "--cp must be 1..64 (the simulated ranks of one replica), got 100,000"),
    (["bench", "replay", DATA, "--limit", "5", "--sweep", "--capacities", "1e300"],
     "--capacities: capacities must be at most 1,000,000,000,000,000 tokens"),
    (["bench", "--threads", "100000"], "--threads must be 1..1024, got 100,000"),
    (["bench", "--seed", "-1"], "--seed must be an integer in [0, 2**63 - 1], got -1"),
    (["bench", "run", "--url", "http://127.0.0.1:9", "--vocab-size", str(10 ** 20)],
     "vocab-size must be at most 2,147,483,648"),
    (["bench", "run", "--url", "http://127.0.0.1:9", "-w", f"trace:{DATA}", "--vocab-size",
      str(10 ** 20)], "vocab-size must be in 2..2,147,483,648"),
    (["bench", "run", "--url", "http://127.0.0.1:9", "--request-length", str(10 ** 12)],
     "the last round's prompt would hold"),
    (["bench", "run", "--url", "http://127.0.0.1:9", "--num-rounds", str(10 ** 9)],
     "num-rounds must be at most 65,536"),
])
def test_bench_commands_refuse_out_of_range_values(args, msg):
    """Before: --cp 100000 was killed by the OOM killer in 60 s, --threads 100000 crashed the
    process (SIGSEGV), --request-length 1e12 a MemoryError traceback, the others 'internal
    error' (exit 1). Now each is a usage error (exit 2) naming the range."""
    r = runner.invoke(app, args)
    assert r.exit_code == 2, r.output
    assert msg in r.stderr and "Traceback" not in r.output, r.stderr
