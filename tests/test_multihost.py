"""Two hosts on one machine: two network namespaces joined by a veth pair, one node of a 2-rank CP
replay in each (`--nnodes 2 --node-rank R --dist-init-addr HOST:PORT`); the ranks agree online
and the result equals the single-node run. Needs root (as in CI); skipped with the reason
elsewhere."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid

import pytest

DATA = os.path.join(os.path.dirname(__file__), "data", "conversation_trace_head400.jsonl.gz")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARGS = ["bench", "replay", DATA, "--limit", "60", "--l1-tokens", "200000", "--l2-tokens",
        "400000", "--ranks", "2", "--cp", "2", "--enable-rank-consensus", "--consensus-every",
        "8", "--format", "json"]


def _sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, timeout=30)


@pytest.fixture
def two_hosts():
    if os.geteuid() != 0:
        pytest.skip("needs root to create network namespaces")
    if shutil.which("ip") is None:
        pytest.skip("needs iproute2 ('ip')")
    tag = uuid.uuid4().hex[:6]
    a, b = f"hcA{tag}", f"hcB{tag}"
    try:
        _sh("ip", "netns", "add", a)
        _sh("ip", "netns", "add", b)
    except (subprocess.CalledProcessError, OSError) as exc:
        for ns in (a, b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        pytest.skip(f"cannot create network namespaces here: {exc}")
    try:
        _sh("ip", "link", "add", f"va{tag}", "type", "veth", "peer", "name", f"vb{tag}")
        _sh("ip", "link", "set", f"va{tag}", "netns", a)
        _sh("ip", "link", "set", f"vb{tag}", "netns", b)
        for ns, dev, ip in ((a, f"va{tag}", "10.231.7.1/24"), (b, f"vb{tag}", "10.231.7.2/24")):
            _sh("ip", "-n", ns, "addr", "add", ip, "dev", dev)
            _sh("ip", "-n", ns, "link", "set", dev, "up")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
        yield (a, f"va{tag}"), (b, f"vb{tag}")
    finally:
        for ns in (a, b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def _node(ns: str, dev: str, rank: int, log_dir: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=ROOT, GLOO_SOCKET_IFNAME=dev)
    return subprocess.Popen(
        ["ip", "netns", "exec", ns, sys.executable, "-m", "hicache_cli.app", *ARGS,
         "--nnodes", "2", "--node-rank", str(rank), "--dist-init-addr", "10.231.7.1:29531",
         "--rank-log-dir", log_dir], cwd=ROOT, env=env, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)


def test_two_nodes_in_two_namespaces_equal_one_node(two_hosts, tmp_path):
    (a, dev_a), (b, dev_b) = two_hosts
    nodes = [_node(a, dev_a, 0, str(tmp_path / "n0")), _node(b, dev_b, 1, str(tmp_path / "n1"))]
    outs = []
    for p in nodes:
        try:
            out, err = p.communicate(timeout=240)
        finally:
            if p.poll() is None:
                p.kill()
        assert p.returncode == 0, err[-2000:]
        outs.append(json.loads(out))
    n0, n1 = outs
    assert (n0["local_ranks"], n1["local_ranks"]) == ([0], [1])
    assert n0["consistent"] and n1["consistent"] and n0["online_checks"] >= 5
    single = subprocess.run([sys.executable, "-m", "hicache_cli.app", *ARGS, "--rank-log-dir",
                             str(tmp_path / "single")], cwd=ROOT, capture_output=True, text=True,
                            env=dict(os.environ, PYTHONPATH=ROOT), timeout=240)
    assert single.returncode == 0, single.stderr[-2000:]
    one = json.loads(single.stdout)["result"]
    for key in ("token_hit_rate", "l1_hit_rate", "l2_hit_rate", "hit_tokens"):
        assert n0["result"][key] == n1["result"][key] == one[key]
