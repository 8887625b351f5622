"""Multi-rank replay: real processes over gloo, online consensus, logs for consensus-check."""

import json
import os

from typer.testing import CliRunner

from hicache_cli.app import app

DATA = os.path.join(os.path.dirname(__file__), "data", "conversation_trace_head400.jsonl.gz")
runner = CliRunner()
BASE = ["bench", "replay", DATA, "--l1-tokens", "200000", "--l2-tokens", "400000",
        "--limit", "80", "--ranks", "2", "--enable-rank-consensus", "--consensus-every", "8",
        "--format", "json"]


def test_ranks_agree_and_logs_are_consistent(tmp_path):
    r = runner.invoke(app, BASE + ["--rank-log-dir", str(tmp_path)])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["consistent"] and d["identical_hit_rates"] and d["online_checks"] >= 10
    check = runner.invoke(app, ["consensus-check", str(tmp_path), "--format", "json"])
    assert check.exit_code == 0, check.output
    c = json.loads(check.stdout)
    assert c["consistent"] and c["ranks"] == 2 and c["events"] > 100


def test_injected_divergence_stops_both_ranks(tmp_path):
    r = runner.invoke(app, BASE + ["--rank-log-dir", str(tmp_path),
                                   "--inject-divergence", "lock_order@rank=1,step=30"])
    assert r.exit_code == 3, r.output
    d = json.loads(r.stdout)
    assert not d["consistent"] and "lock_order_mismatch" in d["consensus_error"]
    check = runner.invoke(app, ["consensus-check", str(tmp_path), "--format", "json"])
    assert check.exit_code == 3
    div = json.loads(check.stdout)["divergences"][0]
    assert div["category"] == "lock_order_mismatch" and div["ranks"] == [1]


def test_consensus_needs_a_log_dir():
    r = runner.invoke(app, BASE)
    assert r.exit_code == 2 and "--rank-log-dir" in r.output


def test_one_snapshot_per_rank_and_ranks_agree(tmp_path):
    r = runner.invoke(app, ["bench", "replay", DATA, "--l1-tokens", "200000", "--limit", "60",
                            "--ranks", "2", "--dump-tree", str(tmp_path), "--format", "json"])
    assert r.exit_code == 0, r.output
    snaps = json.loads(r.stdout)["tree_snapshots"]
    assert [os.path.basename(p) for p in snaps] == ["tree-rank0.snapshot", "tree-rank1.snapshot"]
    d = runner.invoke(app, ["inspect", snaps[0], "--diff", snaps[1], "--expect-same",
                            "--format", "json"])
    assert d.exit_code == 0, d.output


def test_without_online_consensus_ranks_are_not_said_to_agree(tmp_path):
    # rank 1 diverges; with nothing comparing the ranks this printed "2 ranks agreed"
    args = ["bench", "replay", DATA, "--l1-tokens", "200000", "--limit", "40", "--ranks", "2",
            "--rank-log-dir", str(tmp_path), "--inject-divergence", "hit_length@rank=1,step=10"]
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    assert "agreed" not in r.stdout
    assert f"not compared (no --enable-rank-consensus); run `hicache consensus-check " \
           f"{tmp_path}`" in r.stdout
    d = json.loads(runner.invoke(app, args + ["--format", "json"]).stdout)
    assert d["consistent"] is None and d["online_consensus"] is False
    assert runner.invoke(app, ["consensus-check", str(tmp_path)]).exit_code == 3
