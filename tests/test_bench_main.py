"""``hicache bench`` (the main job) on tiny configurations, both formats, and its failures."""

import dataclasses
import gzip
import json
import os
import urllib.error
import urllib.request

import pytest
import torch
from typer.testing import CliRunner

from engine.runtime.serving import ServerConfig
from engine.sim.main_job import (
    MAIN_AGENTIC,
    MainJobConfig,
    build_workload,
    check_config,
    embedded_server,
    run_main_job,
)
from hicache_cli.app import app

runner = CliRunner()
TINY = ["--num-clients", "3", "--num-rounds", "3", "--request-length", "48",
        "--output-length", "2", "--concurrency", "1", "--l1-tokens", "256", "--l2-tokens", "8192"]
# (one request at a time: the order of requests, hence the hit rates, do not depend on timing)
# 4 sessions x 4 turns: 32 shared + 64 own tokens, then +16 tool and +2 answer tokens a turn
AGENTIC = dict(num_clients=4, num_rounds=4, context_length=96, system_length=32,
               request_length=16, output_length=2, concurrency=1, l1_tokens=192,
               l2_tokens=256, device="cpu")


def test_main_job_multiturn_json():
    r = runner.invoke(app, ["bench", "-w", "multiturn", *TINY, "--format", "json"])
    assert r.exit_code == 0, r.output
    res = json.loads(r.stdout)
    a, b = res["runs"]["l1_only"], res["runs"]["hicache"]
    assert a["requests"] == b["requests"] == {"sent": 9, "ok": 9, "failed": 0}
    # same prompts in both runs; L1 alone thrashes, HiCache serves the histories from L2
    assert a["tokens"]["prompt"] == b["tokens"]["prompt"] == 3 * (48 + 98 + 148)
    assert a["tokens"]["host"] == 0 and b["tokens"]["host"] > 0
    assert b["hit_rate"]["total"] > a["hit_rate"]["total"] + 0.2   # 0.49 vs 0.22 here
    assert res["config"]["l1_tokens"] == 256 and res["wall_s"] > 0 and res["cpu_s"] > 0
    assert res["comparison"]["hit_rate_hicache"] == b["hit_rate"]["total"]


def test_agentic_is_the_default_and_uses_every_tier():
    """L1 keeps only the shared prefix; L2 and the file L3 keep every session's history."""
    before = torch.get_num_threads()
    res = run_main_job(MainJobConfig(**AGENTIC))
    a, b, c = res["runs"]["l1_only"], res["runs"]["hicache"], res["comparison"]
    assert MainJobConfig().workload == "agentic" and res["config"]["workload"] == "agentic"
    assert a["requests"]["failed"] == b["requests"]["failed"] == 0
    # turn t of a session: 96 + 18 t tokens
    assert a["tokens"]["prompt"] == b["tokens"]["prompt"] == 4 * (96 * 4 + 18 * 6)
    assert a["tokens"]["host"] == a["tokens"]["storage"] == 0
    assert b["tokens"]["host"] > 0 and b["tokens"]["storage"] > 0
    # every session's first turn finds the shared prefix (but the very first request)
    assert a["tokens"]["device"] >= 3 * 32
    assert c["hit_rate_hicache"] > c["hit_rate_l1_only"] + 0.3
    assert c["ttft_p50_ratio"] == pytest.approx(a["ttft_s"]["p50"] / b["ttft_s"]["p50"])
    assert res["config"]["hicache_tiers"] == "L1+L2+L3(file)"
    assert torch.get_num_threads() == before          # the job's thread setting is undone


def test_the_hints_run_sends_hints_the_server_takes_and_finds_right():
    """``--hints``: a third run, the same prompts; its clients' retentions (the gap each saw)
    are judged right by the server, which applies them (the job's clients are its own:
    ``--hint-trust always``), and each session's last turn closes it. The retentions keep the
    sessions due next in L1 (FIFO turns: LRU evicts exactly those), so L1 hits more."""
    res = run_main_job(MainJobConfig(**{**AGENTIC, "num_rounds": 6, "l1_tokens": 384},
                                     hints=True))
    runs = res["runs"]
    assert list(runs) == ["l1_only", "hicache", "hicache_hints"]
    h = runs["hicache_hints"]
    assert h["requests"] == runs["hicache"]["requests"] == {"sent": 24, "ok": 24, "failed": 0}
    assert h["tokens"]["prompt"] == runs["hicache"]["tokens"]["prompt"]
    st = h["cache_hints"]
    assert st["trust_mode"] == "always" and res["config"]["hint_trust"] == "always"
    # 4 x 4 retentions judged (a stall of the machine can put one turn gap off by 4x; the
    # first gap, a cold prefill, can be 4x the later ones)
    assert st["sessions_closed"] == 4 and st["hints_wrong"] <= 5, st
    assert st["hints_right"] + st["hints_wrong"] >= 16, st
    c = res["comparison"]["hints"]
    # every turn but each session's first carries a retention or a close, all applied
    assert c["hints_sent"] == 24 and c["hints_applied"] == 20, c
    assert c["hit_rate_hints"] == h["hit_rate"]["total"]
    assert c["l1_hit_rate_hints"] > c["l1_hit_rate_hicache"], c
    assert "cache_hints" not in runs["hicache"]


def test_hint_trust_is_checked_and_needs_hints():
    with pytest.raises(ValueError, match="--hint-trust: choose"):
        check_config(MainJobConfig(hints=True, hint_trust="maybe"))
    with pytest.raises(ValueError, match="add --hints"):
        check_config(MainJobConfig(hint_trust="off"))
    r = runner.invoke(app, ["bench", "--hint-trust", "earned"])
    assert r.exit_code == 2 and "add --hints" in r.output and "Traceback" not in r.output


def test_main_job_human():
    r = runner.invoke(app, ["bench", "-w", "multiturn", *TINY, "--no-storage"])
    assert r.exit_code == 0, r.output
    assert "L1 only" in r.stdout and "HiCache L1+L2" in r.stdout
    assert "hit rate host" in r.stdout and "TTFT p90" in r.stdout
    assert "HiCache vs L1 only: hit rate" in r.stdout and "multiturn: 3 clients" in r.stdout


def _trace(tmp_path, n=6):
    path = tmp_path / "t.jsonl.gz"
    rows = [{"timestamp": 10 * i, "input_length": 1024 + 512 * (i % 3), "output_length": 50,
             "hash_ids": [0, 1, 2 + i % 3, 9 + i][:2 + i % 3]} for i in range(n)]
    with gzip.open(path, "wt") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_trace_workload(tmp_path):
    cfg = MainJobConfig(workload="trace:" + _trace(tmp_path), trace_block_tokens=32,
                        device="cpu")
    wl = build_workload(cfg)
    specs = [s.first() for s in wl.sessions]
    assert len(specs) == 6 and all(s.max_tokens == 8 for s in specs)   # capped by default
    assert [s.prompt_len for s in specs[:3]] == [64, 96, 128]
    r = runner.invoke(app, ["bench", "-w", cfg.workload, "--trace-block-tokens", "32",
                            "--l1-tokens", "512", "--format", "json"])
    assert r.exit_code == 0, r.output
    res = json.loads(r.stdout)
    assert res["runs"]["hicache"]["requests"]["ok"] == 6
    assert res["config"]["shape"]["trace_limit"] == 256


@pytest.mark.parametrize("args", [["--num-clients", "0"], ["--l1-tokens", "4"],
                                  ["--format", "xml"], ["--device", "tpu"],
                                  ["--num-rounds", "30"], ["--threads", "0"],
                                  ["-w", "chat"], ["-w", "trace:"],
                                  ["--trace-limit", "5"],
                                  ["--context-length", "64", "--system-length", "64"],
                                  # 492 + 8 tokens fit 500 but not its 31 whole pages (496)
                                  ["--num-clients", "1", "--num-rounds", "2",
                                   "--request-length", "242", "--output-length", "8",
                                   "--l1-tokens", "500"]])
def test_bad_options_exit_2(args):
    r = runner.invoke(app, ["bench", "-w", "multiturn", *TINY, *args])
    assert r.exit_code == 2, r.output
    if "--num-rounds" in args:
        assert "raise --l1-tokens" in r.stderr and r.stderr.count("\n") == 1


def test_options_of_another_workload_are_refused():
    r = runner.invoke(app, ["bench", "-w", "multiturn", "--system-length", "64"])
    assert r.exit_code == 2 and "--system-length does not apply to the multiturn" in r.stderr
    r = runner.invoke(app, ["bench", "-w", "trace:x.jsonl", "--num-rounds", "3"])
    assert r.exit_code == 2 and "--num-rounds does not apply to the trace" in r.stderr
    r = runner.invoke(app, ["bench", "-w", "trace:/nonexistent/t.jsonl"])
    assert r.exit_code == 1 and r.stderr.count("\n") == 1


def test_default_last_turn_fits_l1_and_check_counts_whole_pages():
    check_config(MainJobConfig(device="cpu"))
    assert MAIN_AGENTIC["num_clients"] * MAIN_AGENTIC["context_length"] > MainJobConfig.l1_tokens
    # the last round: prompt 488 + 8 output tokens = 495 positions with KV = 31 pages = 496
    check_config(MainJobConfig(workload="multiturn", num_clients=1, num_rounds=2,
                               request_length=240, output_length=8, l1_tokens=500, device="cpu"))
    with pytest.raises(ValueError, match="needs 512 tokens of KV"):
        check_config(MainJobConfig(workload="multiturn", num_clients=1, num_rounds=2,
                                   request_length=242, output_length=8, l1_tokens=500,
                                   device="cpu"))


def test_server_stopped_on_error():
    with pytest.raises(RuntimeError):
        with embedded_server(ServerConfig(port=0, l1_tokens=256, l2_tokens=0), "test") as url:
            assert urllib.request.urlopen(url + "/health", timeout=5).status == 200
            raise RuntimeError("boom")
    with pytest.raises((urllib.error.URLError, OSError)):
        urllib.request.urlopen(url + "/health", timeout=2)


SHIPPED_TRACE = "trace:" + os.path.join(os.path.dirname(__file__), "data",
                                         "conversation_trace_head400.jsonl.gz")


def test_a_trace_too_big_for_l1_is_refused_or_l1_grows_to_fit():
    """The README's ``hicache bench -w trace:PATH`` on the shipped trace: with the default L1
    some requests need more KV than L1 holds (they were 400s after minutes of running); an
    explicit --l1-tokens that small is a usage error up front, the default grows to fit."""
    from engine.sim.main_job import fitted

    small = MainJobConfig(workload=SHIPPED_TRACE, device="cpu", trace_limit=256)
    with pytest.raises(ValueError, match=r"of the trace's 256 requests need more KV"):
        check_config(small)
    grown = fitted(dataclasses.replace(small, fit_l1=True))
    assert grown.l1_tokens > small.l1_tokens and grown.l1_tokens % 16 == 0
    assert grown.l2_tokens / grown.l1_tokens == pytest.approx(
        small.l2_tokens / small.l1_tokens, rel=0.01)
    check_config(grown)
    check_config(dataclasses.replace(grown, fit_l1=False))        # fits exactly: no refusal
    with pytest.raises(ValueError):
        check_config(dataclasses.replace(grown, l1_tokens=grown.l1_tokens - 16, fit_l1=False))


def test_progress_lines_without_a_terminal(capsys):
    """Piped output gets a progress line every ``every_s`` (here every request) instead of a
    silent run."""
    from engine.loadgen.driver import LoadConfig
    from engine.loadgen.workloads import multiturn
    from hicache_cli.bench.run_render import run_with_progress

    wl = multiturn(num_clients=1, num_rounds=2, request_length=16, output_length=2)
    with embedded_server(ServerConfig(port=0, l1_tokens=512, l2_tokens=0), "test") as url:
        res = run_with_progress(wl, LoadConfig(url=url, concurrency=1), label="demo",
                                every_s=0.0)
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("demo:")]
    assert len(res.records) == 2
    assert lines == ["demo: 1/2 requests, 0 errors, " + lines[0].split(", ")[-1],
                     "demo: 2/2 requests, 0 errors, " + lines[1].split(", ")[-1]]
