"""`hicache bench replay --cp N --cp-kv sharded|replicated`: per-rank budgets, the device/host
hit split, CP rank logs and owner snapshots."""

from __future__ import annotations

import gzip
import json
import random

import pytest
from typer.testing import CliRunner

from hicache_cli.app import app

runner = CliRunner()
BLOCK = 512


def multiturn_trace(path, conversations: int = 24, turns: int = 6, seed: int = 1) -> str:
    """Chats whose every turn repeats the history and adds 2 blocks, turns interleaved."""
    rng = random.Random(seed)
    nxt = [0]

    def fresh(k):
        out = list(range(nxt[0], nxt[0] + k))
        nxt[0] += k
        return out

    history = [fresh(rng.randint(2, 6)) for _ in range(conversations)]
    lines = []
    for _ in range(turns):
        for c in rng.sample(range(conversations), conversations):
            history[c] = history[c] + fresh(2)
            lines.append({"timestamp": len(lines), "input_length": len(history[c]) * BLOCK - 100,
                          "output_length": 10, "hash_ids": history[c]})
    with gzip.open(path, "wt") as f:
        f.write("\n".join(json.dumps(x) for x in lines) + "\n")
    return str(path)


def replay(*args) -> dict:
    r = runner.invoke(app, ["bench", "replay", *args, "--format", "json"])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    return multiturn_trace(tmp_path_factory.mktemp("cp") / "chat.jsonl.gz")


def test_sharding_moves_hits_from_host_to_device_at_the_same_total(trace):
    budgets = ["--l1-tokens", "60000", "--l2-tokens", "400000", "--page-size", "64"]
    rep = replay(trace, "--cp", "2", "--cp-kv", "replicated", *budgets)
    sh = replay(trace, "--cp", "2", "--cp-kv", "sharded", *budgets)
    assert sh["l1_hit_rate"] > rep["l1_hit_rate"] + 0.1
    assert sh["l2_hit_rate"] < rep["l2_hit_rate"] - 0.1
    assert sh["token_hit_rate"] == pytest.approx(rep["token_hit_rate"], abs=0.03)
    # per-rank budgets: a sharded rank holds at most its own budget of each tier
    cp = sh["stats"]["cp"]
    assert cp["cp_size"] == 2 and max(cp["l1_used_tokens_per_rank"]) <= 60000
    assert max(cp["l2_used_tokens_per_rank"]) <= 400000
    assert sh["stats"]["l1_capacity_tokens"] == 2 * (60000 // 64) * 64
    assert rep["stats"]["l1_capacity_tokens"] == (60000 // 64) * 64
    assert (sh["config"]["cp_size"], sh["config"]["cp_kv"]) == (2, "sharded")


def test_cp_1_is_the_plain_replay(trace):
    plain = replay(trace, "--l1-tokens", "60000", "--l2-tokens", "400000")
    one = replay(trace, "--l1-tokens", "60000", "--l2-tokens", "400000", "--cp", "1")
    assert plain["token_hit_rate"] == one["token_hit_rate"]
    assert plain["l1_hit_rate"] == one["l1_hit_rate"]


def test_cp_ranks_agree_and_snapshots_show_one_rotation_per_path(trace, tmp_path):
    logs, trees = tmp_path / "logs", tmp_path / "trees"
    d = replay(trace, "--cp", "2", "--ranks", "2", "--l1-tokens", "60000", "--l2-tokens",
               "400000", "--rank-log-dir", str(logs), "--dump-tree", str(trees))
    assert d["identical_hit_rates"]
    r = runner.invoke(app, ["consensus-check", str(logs), "--format", "json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["consistent"] is True
    r = runner.invoke(app, ["inspect", str(trees / "tree-rank1.snapshot"), "--owners",
                            "--format", "json"])
    assert r.exit_code == 0, r.output
    o = json.loads(r.stdout)["owners"]
    assert o["sharded"] and o["cp_size"] == 2 and o["restarts"] == 0
    assert o["nodes_without_owner"] == 0
    pages = [w["pages"] for w in o["owners"]]
    assert min(pages) > 0 and max(pages) - min(pages) <= o["segments"]


@pytest.mark.parametrize("args,msg", [
    (["--cp", "0"], "--cp"),
    (["--cp", "2", "--cp-kv", "mirrored"], "--cp-kv"),
    (["--cp", "2", "--l2-tokens", "1000", "--l3-tokens", "-1"], "L3"),
    (["--cp", "2", "--ranks", "3"], "--ranks 2"),
    (["--cp", "2", "--sweep"], "--sweep"),
    (["--ranks", "2", "--nnodes", "2"], "--dist-init-addr"),
    (["--ranks", "2", "--nnodes", "2", "--node-rank", "2", "--dist-init-addr", "h:1"],
     "--node-rank"),
    (["--ranks", "3", "--nnodes", "2", "--dist-init-addr", "h:1"], "evenly"),
    (["--ranks", "2", "--nnodes", "2", "--dist-init-addr", "nohost"], "HOST:PORT"),
])
def test_bad_cp_options_are_usage_errors(trace, args, msg):
    r = runner.invoke(app, ["bench", "replay", trace, *args])
    assert r.exit_code == 2, r.output
    assert msg in r.output and "Traceback" not in r.output
