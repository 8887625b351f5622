"""The load generator and ``hicache bench run`` against the real benchmark server (tiny model)."""

import json

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from engine.loadgen import LoadConfig, multiturn, run_load, summarize_result, trace_workload
from engine.loadgen.driver import ServerUnreachable, server_info
from engine.runtime.launch import ServerConfig, start_server
from hicache_cli.app import app

runner = CliRunner()


@pytest.fixture(scope="module")
def server():
    # L1 of 256 tokens thrashes; L2 holds every history, so later rounds hit on the host tier.
    with start_server(ServerConfig(port=0, l1_tokens=256, l2_tokens=8192, device="cpu")) as handle:
        yield handle


def flush(url):
    import urllib.request

    urllib.request.urlopen(urllib.request.Request(url + "/flush_cache", method="POST")).read()


def test_multiturn_against_server(server):
    flush(server.url)
    w = multiturn(num_clients=3, num_rounds=3, request_length=48, output_length=4, seed=1)
    res = run_load(w, LoadConfig(server.url, concurrency=2))
    assert res.stopped_by == "done" and len(res.records) == 9
    assert all(r.ok for r in res.records), [r.error for r in res.records]
    by = {(r.session, r.turn): r for r in res.records}
    for c in range(3):
        # prompt = previous prompt + 4 answer tokens + 48 new ones
        assert [by[c, t].prompt_tokens for t in range(3)] == [48, 100, 152]
        assert all(by[c, t].completion_tokens == 4 for t in range(3))
        assert by[c, 0].cached_tokens == 0
        # each later round finds the client's history (page-aligned) in some tier
        assert by[c, 2].cached_tokens >= 96
    rep = summarize_result(res)
    assert rep["hit_rate"]["host"] > 0
    assert rep["hit_rate"]["total"] == pytest.approx(
        sum(r.cached_tokens for r in res.records) / sum(r.prompt_tokens for r in res.records))
    assert rep["ttft_s"]["p50"] > 0 and rep["queue_time_s"]["p99"] is not None
    # concurrency bound held: never more than 2 requests overlapped
    spans = sorted((r.start, r.start + r.e2e_latency) for r in res.records)
    assert max(sum(1 for s, e in spans if s <= t0 < e) for t0, _ in spans) <= 2


def test_same_seed_same_answers_and_stream(server):
    w = lambda: multiturn(num_clients=1, num_rounds=2, request_length=20, output_length=3, seed=7)
    a = run_load(w(), LoadConfig(server.url))
    b = run_load(w(), LoadConfig(server.url, stream=True))
    assert [r.output_ids for r in a.records] == [r.output_ids for r in b.records]
    assert all(r.client_ttft > 0 for r in b.records)


def test_duration_stops_issuing(server):
    w = multiturn(num_clients=5000, num_rounds=1, request_length=16, output_length=1)
    res = run_load(w, LoadConfig(server.url, concurrency=2, duration=2.0))
    assert res.stopped_by == "duration"
    assert 0 < len(res.records) < 5000 and res.wall_s < 30
    assert all(r.start < 2.0 for r in res.records)


def test_trace_replay_and_bad_requests(server, tmp_path):
    lines = [{"timestamp": 0, "input_length": 600, "output_length": 2, "hash_ids": [0, 1]},
             {"timestamp": 1000, "input_length": 700, "output_length": 2, "hash_ids": [0, 1]}]
    p = tmp_path / "t.jsonl"
    p.write_text("".join(json.dumps(l) + "\n" for l in lines))
    flush(server.url)
    res = run_load(trace_workload(str(p), speedup=2, block_tokens_n=64), LoadConfig(server.url))
    assert [r.prompt_tokens for r in res.records] == [75, 88]
    assert res.records[1].start >= 0.49            # due 1000 ms / speedup 2 after the first
    assert res.records[1].cached_tokens == 64    # the first request's full pages
    # token ids beyond the model's vocabulary: HTTP 400, counted by status
    bad = run_load(multiturn(2, 2, 8, 1, vocab_size=100_000, seed=3), LoadConfig(server.url))
    assert summarize_result(bad)["errors_by_status"] == {"400": 2}   # failures end the client


def test_unreachable_and_server_info(server):
    with pytest.raises(ServerUnreachable, match="cannot reach server"):
        run_load(multiturn(1, 1, 4, 1), LoadConfig("http://127.0.0.1:9"))
    assert server_info(server.url)["device"] == "cpu"
    assert server_info("http://127.0.0.1:9", timeout=1) is None


@pytest.mark.parametrize("fmt", ["human", "json"])
def test_cli_run(server, tmp_path, fmt):
    out = tmp_path / "r.parquet"
    r = runner.invoke(app, ["bench", "run", "--url", server.url, "--num-clients", "2",
                            "--num-rounds", "2", "--request-length", "32", "--output-length", "2",
                            "--format", fmt, "--output", str(out)])
    assert r.exit_code == 0, r.output
    if fmt == "json":
        rep = json.loads(r.stdout)
        assert rep["requests"] == {"sent": 4, "ok": 4, "failed": 0}
        assert set(rep["hit_rate"]) == {"device", "host", "storage", "total"}
        assert rep["url"] == server.url
    else:
        assert "hit rate host" in r.stdout and "TTFT p99" in r.stdout
    t = pq.read_table(out)
    assert t.num_rows == 4 and t.column("status").to_pylist() == ["ok"] * 4
    assert t.column("prompt_tokens").to_pylist()[:2] == [32, 32]


def test_cli_agentic_scales_down_on_cpu():
    with start_server(ServerConfig(port=0, l1_tokens=4096, l2_tokens=0, device="cpu")) as big:
        r = runner.invoke(app, ["bench", "run", "--url", big.url, "-w", "agentic",
                                "--num-clients", "1", "--num-rounds", "2", "--format", "json"])
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout)
    assert rep["tokens"]["prompt"] == 1536 + (1536 + 16 + 128)   # CPU preset sizes


def test_cli_errors(server, tmp_path):
    r = runner.invoke(app, ["bench", "run", "--url", "http://127.0.0.1:9"])
    assert r.exit_code == 1
    assert r.stderr.count("\n") == 1 and "cannot reach server" in r.stderr
    for args in (["--url", "ftp://x"], ["-w", "nope"], ["--speedup", "2"],
                 ["--concurrency", "0"], ["-w", "trace:"]):
        r = runner.invoke(app, ["bench", "run", *args])
        assert r.exit_code == 2, (args, r.output)
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{oops\n")
    r = runner.invoke(app, ["bench", "run", "--url", server.url, "-w", f"trace:{bad}"])
    assert r.exit_code == 1 and "bad.jsonl:1: not JSON" in r.stderr
    r = runner.invoke(app, ["bench", "run", "--url", server.url, "--vocab-size", "100000",
                            "--num-clients", "1", "--num-rounds", "1", "--request-length", "8"])
    assert r.exit_code == 1 and "all 1 requests failed (400" in r.stderr


def test_cli_unwritable_output_fails_before_the_run(server, tmp_path):
    """--output into a missing directory or onto a directory: one line, exit 1, and no request
    sent (it used to run the whole benchmark, then lose the report on the failed write)."""
    sent = lambda: sum(server.engine.scheduler.metrics.requests.values())  # noqa: E731
    before = sent()
    for out in (tmp_path / "missing" / "r.parquet", tmp_path):
        r = runner.invoke(app, ["bench", "run", "--url", server.url, "--num-clients", "1",
                                "--num-rounds", "1", "--request-length", "8", "-o", str(out)])
        assert r.exit_code == 1, r.output
        assert r.stderr.count("\n") == 1 and "--output" in r.stderr, r.stderr
        assert r.stdout == ""
    assert sent() == before


def test_short_load_no_5xx_and_pools_back_to_baseline():
    """The issue's `bench run --concurrency 64 --duration 60`, shortened: no 5xx, and after
    /flush_cache the pools hold what they held before the load."""
    with start_server(ServerConfig(port=0, l1_tokens=1024, l2_tokens=4096)) as srv:
        before = server_info(srv.url)["cache"]
        r = runner.invoke(app, ["bench", "run", "--url", srv.url, "--num-clients", "200",
                                "--num-rounds", "3", "--request-length", "24",
                                "--output-length", "2", "--concurrency", "64",
                                "--duration", "3", "--format", "json"])
        assert r.exit_code == 0, r.output
        rep = json.loads(r.stdout)
        assert rep["requests"]["ok"] > 20
        assert not [s for s in rep["errors_by_status"] if s.startswith("5")]
        flush(srv.url)
        after = server_info(srv.url)["cache"]
        for key in ("l1_used_tokens", "l1_locked_tokens", "l2_used_tokens", "nodes"):
            assert after[key] == before[key], key
