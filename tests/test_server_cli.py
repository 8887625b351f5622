"""``hicache bench serve``: a real child process (ready line, requests, graceful shutdown) and
usage errors through typer's CliRunner."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import pytest
import requests
from typer.testing import CliRunner

from hicache_cli.app import app

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _spawn(*args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "hicache_cli.app", "bench", "serve", "--port", "0",
         "--l1-tokens", "2048", *args],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen, sig: int) -> tuple[str, str]:
    proc.send_signal(sig)
    try:
        out, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    assert proc.returncode == 0, err
    return out, err


def test_serve_json_ready_line_then_sigterm(tmp_path):
    snap = tmp_path / "tree.snapshot"
    proc = _spawn("--format", "json", "--l2-tokens", "0", "--dump-tree-on-exit", str(snap))
    try:
        ready = json.loads(proc.stdout.readline())
        assert ready["url"].startswith("http://127.0.0.1:") and ready["l2_tokens"] == 0
        r = requests.post(ready["url"] + "/generate", timeout=30, json={
            "input_ids": [256] + list(range(40)), "sampling_params": {"max_new_tokens": 3}})
        assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 3
    finally:
        out, err = _finish(proc, signal.SIGTERM)
    assert "listening on" in err and "Traceback" not in err
    assert snap.stat().st_size > 0 and "wrote" in err


def test_serve_human_prints_url_on_stderr_and_stops_on_sigint():
    proc = _spawn("--hicache-mem-layout", "page_first", "--hicache-ratio", "4")
    try:
        line = proc.stderr.readline()
        m = re.search(r"listening on (http://\S+)", line)
        assert m, line
        assert "L2 8192 tokens" in line and "page_first" in line
        assert requests.get(m.group(1) + "/health", timeout=10).status_code == 200
    finally:
        out, err = _finish(proc, signal.SIGINT)
    assert out == "" and "Traceback" not in err


@pytest.mark.parametrize("args,msg", [
    (["--model", "no-such-model"], "unknown model preset"),
    (["--page-size", "0"], "page-size"),
    (["--eviction-policy", "fifo"], "fifo"),
    (["--eviction-policy", "opt"], "unknown eviction policy"),    # registered, but offline
    (["--l1-tokens", "8"], "at least one page"),
    (["--hicache-mem-layout", "diagonal"], "diagonal"),
    (["--device", "tpu"], "tpu"),
])
@pytest.mark.parametrize("fmt", ["human", "json"])
def test_serve_usage_errors(args, msg, fmt):
    res = CliRunner().invoke(app, ["bench", "serve", "--port", "0", "--format", fmt, *args])
    assert res.exit_code == 2, res.output
    assert msg in res.output
    assert "Traceback" not in res.output


def test_serve_rank_log_and_snapshot_dir_on_shutdown(tmp_path):
    out_dir = tmp_path / "run"
    proc = _spawn("--format", "json", "--rank-log-dir", str(out_dir),
                  "--dump-tree-on-exit", str(out_dir) + "/")
    try:
        url = json.loads(proc.stdout.readline())["url"]
        for _ in range(2):
            r = requests.post(url + "/generate", timeout=30, json={
                "input_ids": [256] + list(range(40)), "sampling_params": {"max_new_tokens": 3}})
            assert r.status_code == 200
    finally:
        _, err = _finish(proc, signal.SIGTERM)
    assert "Traceback" not in err
    assert sorted(os.listdir(out_dir)) == ["rank0.ranklog", "tree-rank0.snapshot"]
    check = CliRunner().invoke(app, ["consensus-check", str(out_dir / "rank0.ranklog"),
                                     "--format", "json"])
    assert check.exit_code == 0 and json.loads(check.stdout)["events"] > 4
    insp = CliRunner().invoke(app, ["inspect", str(out_dir / "tree-rank0.snapshot"), "--check"])
    assert insp.exit_code == 0, insp.output


def test_serve_rank_log_dir_that_is_a_file_fails_at_start(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    r = CliRunner().invoke(app, ["bench", "serve", "--port", "0", "--rank-log-dir", str(blocker)])
    assert r.exit_code == 1 and "Traceback" not in r.output and "exists" in r.output.lower()
