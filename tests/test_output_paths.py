"""Every output path follows one rule (formats.outpath): a device, FIFO or directory is never
replaced, a symlink is written through (it stays a link), errors name the path asked for, and
the CLI checks outputs before doing the work."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from formats.outpath import OutputPathError, check_output_dir, write_output
from hicache_cli.app import app

runner = CliRunner()
DATA = os.path.join(os.path.dirname(__file__), "data", "conversation_trace_head400.jsonl.gz")


def test_symlink_is_written_through_and_stays_a_link(tmp_path):
    (tmp_path / "real.bin").write_bytes(b"old")
    os.symlink("real.bin", tmp_path / "link.bin")
    write_output(tmp_path / "link.bin", b"new")
    assert os.path.islink(tmp_path / "link.bin")
    assert (tmp_path / "real.bin").read_bytes() == b"new"
    os.symlink(tmp_path / "fresh.bin", tmp_path / "dangling")    # target not there yet
    write_output(tmp_path / "dangling", b"x")
    assert os.path.islink(tmp_path / "dangling") and (tmp_path / "fresh.bin").read_bytes() == b"x"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dangling", "fresh.bin", "link.bin",
                                                         "real.bin"]


def test_fifo_device_and_links_to_them_are_refused_untouched(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    os.symlink(fifo, tmp_path / "to_fifo")
    targets = [(fifo, "is a FIFO"), (tmp_path / "to_fifo", f"is a FIFO (a symlink to {fifo})")]
    if os.geteuid() == 0:       # a real character device node (what /dev/full is)
        os.mknod(tmp_path / "full", stat.S_IFCHR | 0o666, os.makedev(1, 7))
        targets.append((tmp_path / "full", "is a character device"))
    for path, msg in targets:
        with pytest.raises(OutputPathError, match=msg.replace("(", r"\(").replace(")", r"\)")):
            write_output(path, b"data")
    assert stat.S_ISFIFO(os.stat(fifo).st_mode) and os.path.islink(tmp_path / "to_fifo")
    if os.geteuid() == 0:
        assert stat.S_ISCHR(os.stat(tmp_path / "full").st_mode)
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_output_dir_rule(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(OutputPathError, match="exists and is not a directory"):
        check_output_dir(tmp_path / "f")
    assert check_output_dir(tmp_path / "new" / "sub") == str(tmp_path / "new" / "sub")


@pytest.mark.parametrize("opt", ["--dump-tree", "--plot"])
def test_replay_outputs_refuse_a_fifo_before_replaying(tmp_path, opt):
    fifo = tmp_path / "out"
    os.mkfifo(fifo)
    extra = ["--sweep"] if opt == "--plot" else []
    r = runner.invoke(app, ["bench", "replay", DATA, "--limit", "5", *extra, opt, str(fifo)])
    assert r.exit_code == 1, r.output
    assert f"{opt} {fifo}: is a FIFO" in r.stderr and "hit rate" not in r.output
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)


def test_replay_dump_tree_through_a_symlink(tmp_path):
    os.symlink("real.snapshot", tmp_path / "t.snapshot")
    r = runner.invoke(app, ["bench", "replay", DATA, "--limit", "5", "--dump-tree",
                            str(tmp_path / "t.snapshot")])
    assert r.exit_code == 0, r.output
    assert os.path.islink(tmp_path / "t.snapshot") and (tmp_path / "real.snapshot").stat().st_size


def test_run_output_refuses_a_fifo_at_start(tmp_path):
    fifo = tmp_path / "rows.parquet"
    os.mkfifo(fifo)
    r = runner.invoke(app, ["bench", "run", "--url", "http://127.0.0.1:9", "-o", str(fifo)])
    assert r.exit_code == 1 and f"--output {fifo}: is a FIFO" in r.stderr


def serve_fails_at_start(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hicache_cli.app", "bench", "serve", "--port",
                           "0", "--l1-tokens", "1024", *args], capture_output=True, text=True,
                          timeout=120)


def test_serve_checks_outputs_at_start_and_names_the_real_path(tmp_path):
    fifo = tmp_path / "tree.snapshot"
    os.mkfifo(fifo)
    p = serve_fails_at_start("--dump-tree-on-exit", str(fifo))
    assert p.returncode == 2 and f"--dump-tree-on-exit {fifo}: is a FIFO" in p.stderr
    (tmp_path / "logs").write_text("a file where a directory should be")
    p = serve_fails_at_start("--rank-log-dir", str(tmp_path / "logs"))
    assert p.returncode == 1, p.stderr
    assert str(tmp_path / "logs") in p.stderr and "cannot listen" not in p.stderr
    assert "Traceback" not in p.stderr


def test_output_dir_to_be_created_later_is_checked_now(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(OutputPathError, match="cannot be created: .* is not a writable directory"):
        check_output_dir(tmp_path / "f" / "logs", create=False)
    assert check_output_dir(tmp_path / "a" / "b", create=False) == str(tmp_path / "a" / "b")
    assert not (tmp_path / "a").exists()          # checked, not created
    r = runner.invoke(app, ["bench", "replay", DATA, "--limit", "5", "--rank-log-dir",
                            str(tmp_path / "f" / "logs")])
    assert r.exit_code == 1 and "--rank-log-dir" in r.stderr and "hit rate" not in r.output
