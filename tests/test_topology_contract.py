"""The contract every rank topology keeps (docs/parallelism.md, "The topology contract"), one
suite over ``cp2``, ``tp2``, ``pp2``, ``pp2xtp2`` and ``pp2xcp2``:

* greedy outputs equal one process's for a fresh prompt, an L1 hit and an L2 restore, with the
  same cache tiers reported; every rank's log agrees (``consensus-check``);
* a SIGKILLed rank and a hung (SIGSTOPped) rank are named by the server, which stops (exit 1,
  one line, no traceback); a rank whose forward raises stops the group at once, named;
* SIGTERM or SIGINT sent to the whole process group (systemd's ``KillMode=control-group``, a
  terminal's Ctrl-C) stops the server cleanly (exit 0) with every rank's log written and
  consistent.

It replaces the per-mode copies these checks had in the CP, TP and pipeline test files.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import requests
from typer.testing import CliRunner

from engine.runtime.launch import ServerConfig, start_server
from engine.runtime.topology import Topology
from hicache_cli.app import app
from tests.serve_client import ROOT, SCRIPT, SERVE_ARGS, generate

SHAPES = {"cp2": dict(cp=2), "tp2": dict(tp=2), "pp2": dict(pp=2),
          "pp2xtp2": dict(pp=2, tp=2), "pp2xcp2": dict(pp=2, cp=2)}
FLAGS = {k: [x for kv in v.items() for x in (f"--{kv[0]}", str(kv[1]))]
         for k, v in SHAPES.items()}
# The last rank of each shape: the one killed, hung or failed below.
LAST = {k: Topology(**v).world - 1 for k, v in SHAPES.items()}


def _cfg(**kw) -> ServerConfig:
    return ServerConfig(port=0, l1_tokens=256, l2_tokens=2048, page_size=16,
                        collective_timeout_s=30, **kw)


def _workload(url: str) -> list:
    """A fresh prompt, an L1 hit (request 2) and, after the L1 has cycled, an L2 restore."""
    return [list(generate(url, ids)) for ids in SCRIPT]


@pytest.fixture(scope="module")
def one_process():
    h = start_server(_cfg())
    try:
        return _workload(h.url)
    finally:
        h.stop()


def _consistent(log_dir, ranks: int) -> dict:
    r = CliRunner().invoke(app, ["consensus-check", str(log_dir), "--format", "json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["consistent"] is True and out["ranks"] == ranks and out["events"] > 0, out
    return out


@pytest.mark.parametrize("shape", list(SHAPES))
def test_outputs_equal_one_process_and_rank_logs_agree(one_process, tmp_path, shape):
    h = start_server(_cfg(rank_log_dir=str(tmp_path), **SHAPES[shape]))
    try:
        got = _workload(h.url)
    finally:
        h.stop()
    assert [o for o, _ in got] == [o for o, _ in one_process]
    tiers = [(c["device"] > 0, c["host"] > 0) for _, c in got]
    assert tiers == [(c["device"] > 0, c["host"] > 0) for _, c in one_process]
    assert tiers[2][0] and tiers[-1][1]          # the L1 hit and the L2 restore happened
    world = Topology(**SHAPES[shape]).world
    assert sorted(os.listdir(tmp_path)) == sorted(f"rank{r}.ranklog" for r in range(world))
    _consistent(tmp_path, world)


def _spawn(tmp_path, *args: str, env: dict | None = None) -> tuple[subprocess.Popen, str, str]:
    """``bench serve`` in its own process group (as a supervisor starts it); its stderr goes
    to a file. Returns the process, its URL and the stderr path."""
    err_path = str(tmp_path / "server.err")
    err = open(err_path, "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "hicache_cli.app", "bench", "serve", "--port", "0", *SERVE_ARGS,
         "--log-level", "info", *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=err,
        text=True, start_new_session=True, env=dict(os.environ, PYTHONPATH=ROOT, **(env or {})))
    err.close()
    line = proc.stdout.readline()
    assert line, open(err_path).read()
    return proc, json.loads(line)["url"], err_path


def _finish(proc: subprocess.Popen, timeout: float = 90) -> None:
    try:
        proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _pid(err_path: str, name: str) -> int:
    return int(re.search(re.escape(name) + r": pid (\d+)", open(err_path).read()).group(1))


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_a_group_signal_keeps_every_rank_log(tmp_path, shape, sig):
    logs = tmp_path / "logs"
    proc, url, err = _spawn(tmp_path, *FLAGS[shape], "--rank-log-dir", str(logs))
    try:
        generate(url, SCRIPT[0])
        generate(url, SCRIPT[2])
        os.killpg(proc.pid, sig)            # every process of the group gets it
        _finish(proc)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = open(err).read()
    assert proc.returncode == 0, text
    assert " ERROR " not in text and "Traceback" not in text, text
    world = Topology(**SHAPES[shape]).world
    assert sorted(os.listdir(logs)) == sorted(f"rank{r}.ranklog" for r in range(world)), text
    _consistent(logs, world)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_a_killed_rank_is_named_and_stops_the_server(tmp_path, shape):
    name = Topology(**SHAPES[shape]).name(LAST[shape])
    proc, url, err = _spawn(tmp_path, *FLAGS[shape], "--collective-timeout", "30")
    try:
        generate(url, SCRIPT[0])
        os.kill(_pid(err, name), signal.SIGKILL)
        health = None
        for _ in range(100):
            try:
                r = requests.get(url + "/health", timeout=5)
            except requests.ConnectionError:
                break
            if r.status_code == 503:
                health = r.text
                break
            time.sleep(0.1)
        _finish(proc)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = open(err).read()
    assert proc.returncode == 1, text
    assert f"stopped: {name} exited (code -9)" in text, text
    assert health is None or f"{name} exited (code -9)" in health, health
    assert "Traceback" not in text, text


@pytest.mark.parametrize("shape", list(SHAPES))
def test_a_hung_rank_is_named_from_its_heartbeats(tmp_path, shape):
    name = Topology(**SHAPES[shape]).name(LAST[shape])
    proc, url, err = _spawn(tmp_path, *FLAGS[shape], "--collective-timeout", "60",
                            "--rank-heartbeat-timeout", "2")
    pid = _pid(err, name)
    try:
        os.kill(pid, signal.SIGSTOP)
        try:
            r = requests.post(url + "/generate", timeout=60, json={
                "input_ids": SCRIPT[1], "sampling_params": {"max_new_tokens": 2}})
            assert r.status_code == 503 and f"{name} stopped answering" in r.text, r.text
        except requests.ConnectionError:
            pass                                      # … or cut off by the shutdown
        _finish(proc, 60)
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = open(err).read()
    assert proc.returncode == 1, text
    assert f"stopped: {name} stopped answering" in text and "Traceback" not in text, text


@pytest.mark.parametrize("shape", ["tp2", "pp2", "pp2xcp2"])
def test_a_rank_whose_forward_raises_stops_the_group_at_once_named(tmp_path, shape):
    """Its peers ran that step: the group cannot go on. The failing rank posts why and exits;
    rank 0 names it well before the collective timeout (300 s here)."""
    name = Topology(**SHAPES[shape]).name(LAST[shape])
    proc, url, err = _spawn(tmp_path, *FLAGS[shape], "--collective-timeout", "300",
                            env={"HICACHE_DEBUG_RANK_FAULT": str(LAST[shape])})
    t0 = time.monotonic()
    try:
        r = requests.post(url + "/generate", timeout=120, json={
            "input_ids": SCRIPT[0], "sampling_params": {"max_new_tokens": 2}})
        assert r.status_code == 503 and f"{name} failed: RuntimeError: injected" in r.text, \
            r.text
        _finish(proc, 60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert time.monotonic() - t0 < 100
    text = open(err).read()
    assert proc.returncode == 1 and f"stopped: {name} failed" in text, text
    assert "Traceback" not in text, text
