"""`hicache bench replay` through typer's CliRunner, both formats, bad input."""

import gzip
import json
import os

import pytest
from typer.testing import CliRunner

from hicache_cli.app import app

DATA = os.path.join(os.path.dirname(__file__), "data", "conversation_trace_head400.jsonl.gz")
runner = CliRunner()


def run(*args):
    return runner.invoke(app, ["bench", "replay", *args])


def test_json_output():
    r = run(DATA, "--l1-tokens", "200000", "--format", "json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    for key in ("requests", "token_hit_rate", "l1_hit_rate", "l2_hit_rate", "cache_seconds",
                "requests_per_s"):
        assert key in d
    assert d["requests"] == 400 and d["token_hit_rate"] == pytest.approx(0.035774, abs=1e-6)


def test_human_output():
    r = run(DATA, "--l1-tokens", "200000", "--l2-tokens", "400000", "--limit", "100")
    assert r.exit_code == 0, r.output
    assert "token hit rate" in r.stdout and "L2 hit rate" in r.stdout


def test_sweep_and_plot(tmp_path):
    png = tmp_path / "sweep.png"
    r = run(DATA, "--sweep", "--capacities", "100k,400k", "--limit", "120", "--plot", str(png),
            "--format", "json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    from engine.sim.sweep import default_policies

    assert "bip" in default_policies()
    assert {(x["policy"], x["l1_tokens"]) for x in d["sweep"]} == {
        (p, c) for p in default_policies() for c in (100_000, 400_000)}
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_rank_log(tmp_path):
    r = run(DATA, "--limit", "20", "--rank-log-dir", str(tmp_path), "--format", "json")
    assert r.exit_code == 0, r.output
    assert (tmp_path / "rank0.ranklog").stat().st_size > 0


@pytest.mark.parametrize("args,code,msg", [
    (["/nonexistent/trace.jsonl"], 1, "No such file"),
    ([DATA, "--page-size", "0"], 2, "--page-size"),
    ([DATA, "--l1-tokens", "-5"], 2, "--l1-tokens"),
    ([DATA, "--l1-tokens", "abc"], 2, ""),
    ([DATA, "--policy", "random"], 2, "--policy"),
    ([DATA, "--l3-tokens", "100"], 2, "--l2-tokens"),
])
def test_bad_arguments(args, code, msg):
    r = run(*args)
    assert r.exit_code == code, r.output
    assert msg in r.output
    assert "Traceback" not in r.output


def test_malformed_line_is_named(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n'
                 "{not json\n")
    r = run(str(p))
    assert r.exit_code == 1 and "bad.jsonl:2" in r.output and "Traceback" not in r.output


def test_corrupt_gzip(tmp_path):
    p = tmp_path / "bad.jsonl.gz"
    p.write_bytes(gzip.compress(b'{"timestamp": 0}\n' * 100)[:40])
    r = run(str(p))
    assert r.exit_code == 1 and "Traceback" not in r.output


def test_hash_ids_beyond_32_bit_tokens_are_renumbered(tmp_path):
    # block b is tokens b*512…: ids too large for that are renumbered by first appearance,
    # which keeps block equality — and so the hit rate
    lines = ['{"timestamp": 0, "input_length": 1024, "output_length": 1, "hash_ids": [%d, %d]}'
             % (a, b) for a, b in ((7, 8), (7, 9), (7, 8))]
    small = tmp_path / "small.jsonl"
    small.write_text("\n".join(lines) + "\n")
    big = tmp_path / "big.jsonl"
    big.write_text("\n".join(ln.replace("[7,", "[99999999,").replace("[7, ", "[99999999, ")
                             for ln in lines) + "\n")
    a = run(str(small), "--l1-tokens", "200000", "--format", "json")
    b = run(str(big), "--l1-tokens", "200000", "--format", "json")
    assert a.exit_code == 0 and b.exit_code == 0, b.output
    assert json.loads(a.stdout)["token_hit_rate"] == json.loads(b.stdout)["token_hit_rate"] > 0


@pytest.mark.parametrize("args,code,msg", [
    (["--sweep", "--capacities", "1e400"], 2, "'1e400' is not a token count"),  # was a traceback
    (["--sweep", "--capacities", "10"], 2, "10 tokens hold no page of 64 tokens"),
    (["--l1-tokens", str(10 ** 17)], 1, "not enough memory"),                   # was a traceback
])
def test_capacities_out_of_range(args, code, msg):
    r = run(DATA, "--limit", "5", *args)
    assert r.exit_code == code, r.output
    assert msg in r.stderr and "Traceback" not in r.output


def test_output_paths_are_checked_before_the_replay(tmp_path):
    (tmp_path / "file").write_text("x")
    for args, msg in [
        (["--sweep", "--plot", str(tmp_path / "no" / "s.png")],
         f"--plot {tmp_path / 'no' / 's.png'}: directory {tmp_path / 'no'} does not exist"),
        (["--dump-tree", str(tmp_path / "no" / "t.snap")],
         f"--dump-tree {tmp_path / 'no' / 't.snap'}: directory {tmp_path / 'no'} does not"),
        (["--dump-tree", str(tmp_path)], "is a directory, expected a file name"),
        (["--rank-log-dir", str(tmp_path / "file")], "exists and is not a directory"),
    ]:
        r = run(DATA, "--limit", "5", "--l1-tokens", "200000", *args)
        assert r.exit_code == 1, r.output
        assert msg in r.stderr and ".tmp-" not in r.stderr
        assert "hit rate" not in r.output        # failed before replaying, not after
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_replay_never_imports_torch():
    # the metadata-only path (single replay, sweep, conversion) must not pay for torch
    import subprocess
    import sys

    script = (
        "import sys\n"
        "from hicache_cli.app import app\n"
        "for args in (['bench', 'replay', sys.argv[1], '--limit', '50', '--format', 'json'],\n"
        "             ['bench', 'replay', sys.argv[1], '--limit', '50', '--sweep', '--capacities',\n"
        "              '100k', '--policies', 'lru,opt', '--format', 'json'],\n"
        "             ['bench', 'convert-trace', sys.argv[1], sys.argv[2], '--format', 'json']):\n"
        "    try:\n"
        "        app(args)\n"
        "    except SystemExit as e:\n"
        "        assert not e.code, e.code\n"
        "loaded = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
        "print('TORCH', loaded)\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root}
    out = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"notorch-{os.getpid()}.parquet")
    try:
        r = subprocess.run([sys.executable, "-c", script, DATA, out], capture_output=True,
                           text=True, env=env, timeout=300)
    finally:
        if os.path.exists(out):
            os.unlink(out)
    assert r.returncode == 0, r.stderr
    assert "TORCH []" in r.stdout, r.stdout[-2000:]


def test_convert_trace_then_replay_parquet(tmp_path):
    pq = tmp_path / "t.parquet"
    r = runner.invoke(app, ["bench", "convert-trace", DATA, str(pq), "--format", "json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["requests"] == 400 and pq.read_bytes()[:4] == b"PAR1"
    a = run(DATA, "--l1-tokens", "200000", "--format", "json")
    b = run(str(pq), "--l1-tokens", "200000", "--format", "json")
    assert json.loads(a.stdout)["token_hit_rate"] == json.loads(b.stdout)["token_hit_rate"]
    bad = runner.invoke(app, ["bench", "convert-trace", DATA, str(tmp_path / "t.csv")])
    assert bad.exit_code == 2 and ".parquet" in bad.output


def test_sweep_policies_from_the_registry():
    from engine.cache.policy import policy_names

    names = policy_names(include_offline=True)
    r = run(DATA, "--sweep", "--capacities", "100k", "--limit", "60", "--policies",
            ",".join(names), "--format", "json")
    assert r.exit_code == 0, r.output
    assert [x["policy"] for x in json.loads(r.stdout)["sweep"]] == names
    bad = run(DATA, "--sweep", "--capacities", "100k", "--policies", "lru,nope")
    assert bad.exit_code == 2 and "'nope' is not an eviction policy" in bad.output
    assert run(DATA, "--policies", "lru").exit_code == 2           # needs --sweep


def test_flags_read_as_flags_in_help():
    r = runner.invoke(app, ["bench", "replay", "--help"], env={"COLUMNS": "200"})
    assert r.exit_code == 0
    lines = [ln for ln in r.output.splitlines() if "--sweep " in ln or "--no-events" in ln]
    assert lines and not any("<bool>" in ln for ln in lines)
    assert "<bool>" not in r.output
