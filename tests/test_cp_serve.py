"""``hicache bench serve --cp 2``: two rank processes behind one HTTP front end. Greedy outputs
equal ``--cp 1`` for fresh prompts, device hits and prefixes restored from host memory;
``/metrics`` shows each rank's KV bytes; the ranks' logs are consistent; a killed rank turns
``/health`` unhealthy and stops the server with a message naming it; the rank logs of a
``hicache bench run`` load are consistent."""

from __future__ import annotations

import json
import os
import re
import signal

import requests
from typer.testing import CliRunner

from hicache_cli.app import app
from tests.serve_client import SCRIPT, generate, spawn


def test_cp2_server_equals_cp1_and_its_ranks_agree(tmp_path):
    one, url1 = spawn()
    logs, snaps = tmp_path / "logs", tmp_path / "snaps"
    two, url2 = spawn("--cp", "2", "--rank-log-dir", str(logs), "--dump-tree-on-exit",
                       f"{snaps}/")
    try:
        got1 = [generate(url1, ids) for ids in SCRIPT]
        got2 = [generate(url2, ids) for ids in SCRIPT]
        metrics = requests.get(url2 + "/metrics", timeout=10).text
    finally:
        for p in (one, two):
            p.send_signal(signal.SIGINT)
        for p in (one, two):
            _, err = p.communicate(timeout=60)
            assert p.returncode == 0, err
    assert [o for o, _ in got2] == [o for o, _ in got1]
    assert got2[2][1]["device"] == 96                 # a device hit …
    assert got2[-1][1]["host"] > 0                     # … and a prefix back from host memory
    kv = {(m[0], m[1]): int(float(m[2])) for m in re.findall(
        r'hicache_kv_bytes\{rank="(\d)",tier="(\w+)"\} (\S+)', metrics)}
    assert set(kv) == {(r, t) for r in "01" for t in ("device", "host")}
    assert kv[("0", "host")] > 0 and kv[("1", "host")] > 0
    assert sorted(os.listdir(logs)) == ["rank0.ranklog", "rank1.ranklog"]
    res = CliRunner().invoke(app, ["consensus-check", str(logs), "--format", "json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["consistent"] is True
    # every rank wrote its tree: the same logical tree, one rotation, pages on both owners
    assert sorted(os.listdir(snaps)) == ["tree-rank0.snapshot", "tree-rank1.snapshot"]
    views = [_owners(snaps / f"tree-rank{r}.snapshot") for r in (0, 1)]
    assert [v["snapshot"]["rank"]["cp_rank"] for v in views] == [0, 1]
    assert views[0]["owners"] == views[1]["owners"]
    own = views[1]["owners"]
    assert own["sharded"] and own["cp_size"] == 2 and own["restarts"] == 0
    assert own["segments"] >= 1 and all(w["pages"] > 0 for w in own["owners"])


def _owners(path) -> dict:
    res = CliRunner().invoke(app, ["inspect", str(path), "--owners", "--format", "json"])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def test_cp_snapshot_on_exit_needs_a_directory(tmp_path):
    res = CliRunner().invoke(app, ["bench", "serve", "--cp", "2", "--dump-tree-on-exit",
                                   str(tmp_path / "tree.snapshot")])
    assert res.exit_code == 2 and "give a directory" in res.output




def test_bench_run_against_cp2_leaves_consistent_rank_logs(tmp_path):
    """The load generator (concurrent multi-turn clients, a device pool smaller than the
    conversations) against ``--cp 2``: both ranks' logs of the run agree."""
    logs = tmp_path / "logs"
    proc, url = spawn("--cp", "2", "--rank-log-dir", str(logs))
    try:
        res = CliRunner().invoke(app, ["bench", "run", "--url", url, "--num-clients", "4",
                                       "--num-rounds", "3", "--request-length", "48",
                                       "--output-length", "4", "--concurrency", "4",
                                       "--format", "json"])
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
    assert res.exit_code == 0, res.output
    run = json.loads(res.stdout)
    assert run["requests"]["ok"] == run["requests"]["sent"] == 12
    assert run["tokens"]["cached"] > 0                  # later rounds reuse their conversation
    res = CliRunner().invoke(app, ["consensus-check", str(logs), "--format", "json"])
    assert res.exit_code == 0, res.output
    check = json.loads(res.stdout)
    assert check["consistent"] is True and check["ranks"] == 2 and check["events"] > 0


def test_flush_cache_answers_with_the_pools_after_the_flush():
    """A rank group flushes at a step every rank sees; /flush_cache still reports the pools as
    they are after it (read at the next step), not before."""
    from engine.runtime.launch import ServerConfig, start_server

    h = start_server(ServerConfig(port=0, l1_tokens=256, l2_tokens=2048, cp=2))
    try:
        generate(h.url, SCRIPT[0])
        assert requests.get(h.url + "/metrics", timeout=10).ok
        flushed = requests.post(h.url + "/flush_cache", timeout=60).json()
    finally:
        h.stop()
    assert flushed["flushed"] and flushed["l1_used_tokens"] == 0, flushed
    assert flushed["l2_used_tokens"] == 0, flushed
