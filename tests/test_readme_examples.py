"""Every command block of README.md runs as written (a doc-test harness).

The harness reads the README's fenced blocks, takes each block that shows commands (lines after
a ``$`` prompt, with ``\\`` continuations and ``<<'PY'`` here-documents) or Python, and runs it
in a scratch directory where ``tests/`` and ``benchmarks/`` resolve as in a checkout:

* ``hicache`` and ``.venv/bin/python`` are this interpreter (``python -m hicache_cli.app``);
* inputs larger than a test should take are made small by :data:`SMALLER` (each entry says what
  it shrinks); the README's port 30000 becomes a free port;
* ``hicache bench serve`` is started in the background (whether or not the line ends in ``&``)
  and stopped at the end of its block; a block that only talks to ``127.0.0.1:30000`` gets one;
* ``echo $?`` checks the previous command's exit status against the figure the README shows;
  otherwise every command must exit 0;
* the README's first output line of each command is checked for its first word, up to a colon
  (``converted``, ``plan``, ``replay`` …): the command printed the report the README shows, not
  some other.

Blocks whose commands need another machine are listed in :data:`ELSEWHERE` with the test that
covers them. A new README block with commands runs here without any change to this file.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

import pytest
import requests

from tests.serve_client import ROOT

README = os.path.join(ROOT, "README.md")

SMALLER = [
    # the synthetic rank logs: 100k events per rank take ~10 s to write; 10k reach the injected
    # step 500 and show the same finding
    (r"--events 100000", "--events 10000"),
    # the full Mooncake trace is not shipped; the committed head of it is
    (r"trace:conversation_trace\.jsonl\.gz", "trace:tests/data/conversation_trace_head400.jsonl.gz"),
    # bench run: 40 trace requests instead of 200
    (r"--limit 200 \\?\s*\n?\s*--speedup 20", "--limit 40 --speedup 20"),
    (r"(hicache bench run .*)--limit 200", r"\1--limit 40"),
    # the main job: 2 sessions x 3 turns instead of 4 x 12 (same comparison, ~10x less work)
    (r"^hicache bench$", "hicache bench --num-clients 2 --num-rounds 3"),
]

ELSEWHERE = {
    "host0$": "two hosts: tests/test_multihost.py runs --cp 2 --nnodes 2 across network "
              "namespaces",
}

FIRST_WORD_OPTIONAL = {"(snapshot"}     # README prose inside an output block


@dataclass
class Command:
    text: str
    output: list[str] = field(default_factory=list)


@dataclass
class Block:
    line: int
    lang: str
    body: str
    commands: list[Command]


def _blocks() -> list[Block]:
    text = open(README, encoding="utf-8").read()
    out = []
    for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.S | re.M):
        lang, body = m.group(1), m.group(2)
        line = text.count("\n", 0, m.start()) + 1
        out.append(Block(line, lang, body, _commands(body)))
    return [b for b in out if b.commands or b.lang == "python"]


def _commands(body: str) -> list[Command]:
    cmds: list[Command] = []
    lines = body.splitlines()
    i = 0
    while i < len(lines):
        ln = lines[i]
        m = re.match(r"^(\$|host\d\$) (.*)$", ln)
        if not m:
            if cmds:
                cmds[-1].output.append(ln)
            i += 1
            continue
        cmd = m.group(2)
        if m.group(1) != "$":
            cmd = m.group(1) + " " + cmd
        while i + 1 < len(lines) and (cmd.endswith("\\") or _open_quote(cmd)):
            i += 1
            cmd = (cmd[:-1].rstrip() if cmd.endswith("\\") else cmd) + " " + lines[i].strip()
        here = re.search(r"<<'(\w+)'$", cmd)
        if here:
            end = here.group(1)
            body_lines = []
            i += 1
            while i < len(lines) and lines[i] != end:
                body_lines.append(lines[i])
                i += 1
            cmd = cmd + "\n" + "\n".join(body_lines) + "\n" + end
        cmds.append(Command(cmd))
        i += 1
    return cmds


def _open_quote(cmd: str) -> bool:
    """A command whose quoted string goes on to the next line (``curl -d '{…`` over two)."""
    if "<<" in cmd:
        return False
    try:
        shlex.split(cmd, comments=True)
    except ValueError:
        return True
    return False


BLOCKS = _blocks()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _adapt(cmd: str, port: int) -> str:
    for pat, rep in SMALLER:
        cmd = re.sub(pat, rep, cmd, flags=re.M)
    cmd = cmd.replace("30000", str(port))
    py = shlex.quote(sys.executable)
    cmd = re.sub(r"(^|\s|\|\s*)\.venv/bin/python\b", lambda m: m.group(1) + py, cmd)
    return re.sub(r"(^|&&\s*|\|\s*|;\s*)hicache\b",
                  lambda m: m.group(1) + f"{py} -m hicache_cli.app", cmd)


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    """One directory for the whole README, as a reader's shell has: a later block reads what an
    earlier one wrote (``inspect tree.snapshot`` after ``replay --dump-tree tree.snapshot``)."""
    d = tmp_path_factory.mktemp("readme")
    for name in ("tests", "benchmarks"):
        os.symlink(os.path.join(ROOT, name), d / name)
    return d


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=ROOT, COLUMNS="120", PYTHONUNBUFFERED="1")


class _Server:
    def __init__(self, cmd: str, cwd, port: int):
        cmd = cmd.rstrip("& ")
        if "--port" not in cmd:
            cmd += f" --port {port}"
        self.proc = subprocess.Popen("exec " + cmd, shell=True, cwd=cwd, env=_env(),
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited {self.proc.returncode}: "
                                     f"{self.proc.stdout.read()}")
            try:
                if requests.get(url + "/health", timeout=2).status_code == 200:
                    return
            except requests.ConnectionError:
                pass
            time.sleep(0.3)
        raise AssertionError(f"server did not answer: {cmd}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)


def _setup(block: Block, cwd) -> None:
    """Inputs a block uses that an earlier README step (outside the block) made."""
    if "old-store" in block.body and not (cwd / "old-store").exists():  # a legacy TP2 store
        from tests.test_cli_convert import legacy_source

        (cwd / "made").mkdir()
        src, _ = legacy_source(cwd / "made")
        os.rename(src, cwd / "old-store")


def _ids(b: Block) -> str:
    first = b.commands[0].text.split("\n")[0] if b.commands else b.body.splitlines()[0]
    return f"L{b.line}: {first[:50]}"


@pytest.mark.parametrize("block", BLOCKS, ids=[_ids(b) for b in BLOCKS])
def test_readme_block_runs_as_written(block: Block, scratch):
    for marker, why in ELSEWHERE.items():
        if any(c.text.startswith(marker) for c in block.commands):
            covered = why.split(": ", 1)[1].split(" ", 1)[0]
            assert os.path.exists(os.path.join(ROOT, covered)), why
            return
    port = _free_port()
    servers: list[_Server] = []
    _setup(block, scratch)
    try:
        serves = any("bench serve" in c.text for c in block.commands)
        if not serves and ("127.0.0.1:30000" in block.body or "localhost:30000" in block.body):
            servers.append(_Server(_adapt("hicache bench serve", port), scratch, port))
        if block.lang == "python":
            r = subprocess.run([sys.executable, "-c", block.body.replace("30000", str(port))],
                               cwd=scratch, env=_env(), capture_output=True, text=True,
                               timeout=300)
            assert r.returncode == 0, r.stderr
            return
        last_rc = 0
        for c in block.commands:
            cmd = _adapt(c.text, port)
            if "bench serve" in c.text:
                servers.append(_Server(cmd, scratch, port))
                continue
            if c.text.strip() == "echo $?":
                want = int(c.output[0].strip())
                assert last_rc == want, f"README says exit {want}, got {last_rc}"
                continue
            r = subprocess.run(cmd, shell=True, executable="/bin/bash", cwd=scratch, env=_env(),
                               capture_output=True, text=True, timeout=600)
            last_rc = r.returncode
            follows_echo = block.commands.index(c) + 1 < len(block.commands) and \
                block.commands[block.commands.index(c) + 1].text.strip() == "echo $?"
            if not follows_echo:
                assert r.returncode == 0, f"{c.text}\n-> exit {r.returncode}\n{r.stderr[-2000:]}"
            shown = [ln for ln in c.output if ln.strip()]
            if shown:
                word = shown[0].split()[0].split(":")[0] or shown[0].split()[0]
                if word not in FIRST_WORD_OPTIONAL:
                    assert word in r.stdout + r.stderr, \
                        f"{c.text}: README's output starts with {word!r}; got:\n{r.stdout[:1500]}"
    finally:
        for s in servers:
            s.stop()


def test_the_harness_finds_the_readme_commands():
    texts = [c.text for b in BLOCKS for c in b.commands]
    assert any(t.startswith("hicache convert-layout") for t in texts)
    assert any(t.startswith("hicache consensus-check") for t in texts)
    assert any("<<'PY'" in t for t in texts)
    assert sum(b.lang == "python" for b in BLOCKS) >= 1
