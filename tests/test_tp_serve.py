"""``hicache bench serve --tp 2``: two rank processes behind one HTTP front end, each with half
the heads, half the MLP and KV pools holding its kv-head. Greedy outputs equal ``--tp 1`` for
fresh prompts, device hits and prefixes restored from host memory (tokens compared: the
all-reduce sums in another order than one rank's products, see engine.runtime.model.tp);
``/metrics`` shows each rank's KV bytes (half a single rank's per token); the ranks' logs are
consistent; a killed rank turns ``/health`` unhealthy and stops the server naming it. The same
for ``--tp 2 --cp 2`` (four processes: pages sharded by owner over CP, heads over TP)."""

from __future__ import annotations

import json
import os
import re
import signal

import pytest
import requests
from typer.testing import CliRunner

from engine.runtime.model import preset
from engine.runtime.serving import ServerConfig
from hicache_cli.app import app
from tests.serve_client import SCRIPT, generate, spawn


def _kv_bytes(metrics: str) -> dict:
    return {(m[0], m[1]): int(float(m[2])) for m in re.findall(
        r'hicache_kv_bytes\{rank="(\d)",tier="(\w+)"\} (\S+)', metrics)}


def _used(metrics: str, tier: str) -> int:
    return int(float(re.search(rf'hicache_pool_used_tokens\{{tier="{tier}"\}} (\S+)',
                               metrics).group(1)))


@pytest.fixture(scope="module")
def one_rank():
    proc, url = spawn()
    try:
        return [generate(url, ids) for ids in SCRIPT]
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err


@pytest.mark.parametrize("shape", [("--tp", "2"), ("--tp", "2", "--cp", "2")],
                         ids=["tp2", "tp2xcp2"])
def test_tp_server_equals_one_rank_and_its_ranks_agree(one_rank, tmp_path, shape):
    proc, url = spawn(*shape, "--rank-log-dir", str(tmp_path))
    try:
        got = [generate(url, ids) for ids in SCRIPT]
        metrics = requests.get(url + "/metrics", timeout=10).text
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
    world = 2 if len(shape) == 2 else 4
    assert [o for o, _ in got] == [o for o, _ in one_rank]
    if world == 2:
        assert [c for _, c in got] == [c for _, c in one_rank]   # the same hits, tier by tier
    assert got[2][1]["device"] == 96                      # a device hit …
    assert got[-1][1]["host"] > 0                         # … and a prefix back from host memory
    kv = _kv_bytes(metrics)
    assert set(kv) == {(str(r), t) for r in range(world) for t in ("device", "host")}
    per_token = preset("tiny").kv_layout(16).page_bytes // 16 // 2     # one of two kv-heads
    for tier in ("device", "host"):
        # TP ranks of a CP rank hold the same pages, half the heads each; CP ranks split pages
        assert all(kv[(str(r), tier)] == kv[(str(r + 1), tier)] > 0 for r in range(0, world, 2))
        assert sum(kv[(str(r), tier)] for r in range(world)) == \
            _used(metrics, tier) * per_token * 2
    assert sorted(os.listdir(tmp_path)) == [f"rank{r}.ranklog" for r in range(world)]
    res = CliRunner().invoke(app, ["consensus-check", str(tmp_path), "--format", "json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["consistent"] is True




def test_tp_options_that_do_not_fit_are_refused():
    with pytest.raises(ValueError, match="attention heads do not split"):
        ServerConfig(tp=3)
    with pytest.raises(ValueError, match="memory L3 backend"):
        ServerConfig(tp=2, cp=2, hicache_storage_backend="memory")
    with pytest.raises(ValueError, match="1..8"):
        ServerConfig(tp=9)
    res = CliRunner().invoke(app, ["bench", "serve", "--tp", "3"])
    assert res.exit_code == 2 and "--tp 3" in res.output and "Traceback" not in res.output


