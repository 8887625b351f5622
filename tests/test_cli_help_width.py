"""Every option name of every command is readable in ``--help`` at 80 columns (a default
terminal, or help piped to a file or pager): typer's table cut long names ("--hicache-storage…");
narrow help is stacked instead (hicache_cli/options.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import typer.main

from hicache_cli.app import app
from tests.serve_client import ROOT


def _leaves(cmd, path=()):
    subs = getattr(cmd, "commands", None)
    if not subs:
        yield path, cmd
        return
    yield path, cmd
    for name, sub in subs.items():
        yield from _leaves(sub, path + (name,))


COMMANDS = list(_leaves(typer.main.get_command(app)))


@pytest.mark.parametrize("path, cmd", COMMANDS, ids=[" ".join(p) or "hicache" for p, _ in COMMANDS])
@pytest.mark.parametrize("columns", ["80", "120"])
def test_every_option_name_is_whole_in_help(path, cmd, columns):
    r = subprocess.run([sys.executable, "-m", "hicache_cli.app", *path, "--help"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, COLUMNS=columns, TERMINAL_WIDTH=columns))
    assert r.returncode == 0, r.stderr
    names = [n for p in cmd.params for n in (*p.opts, *p.secondary_opts) if n.startswith("--")]
    missing = [n for n in names if n not in r.stdout.replace("│", " ").split() and
               f"{n}," not in r.stdout and f"{n} " not in r.stdout]
    assert not missing, f"cut or missing at {columns} columns: {missing}"
    assert all(len(line) <= int(columns) for line in r.stdout.splitlines())
