"""Two hosts on one machine: two network namespaces joined by a veth pair, one node in each
(`--nnodes 2 --node-rank R --dist-init-addr HOST:PORT`):

* a 2-rank CP replay: the ranks agree online and the result equals the single-node run;
* `bench serve --cp 2`, `--tp 2` and `--pp 2`: node 0 serves HTTP, node 1 runs its rank only;
  the outputs (and cache hits) equal the single-node server's, node 1 exits cleanly when node 0
  stops, the two nodes' rank logs are consistent and node 1's tree snapshot shows the rotation;
* `--tp 2 --cp 2`, two ranks a node: tokens equal one rank's, the four logs agree;
* a rank killed on node 1 is named by node 0's server, which stops (exit 1); a pipeline stage
  killed there turns node 0's `/health` unhealthy naming it; a rank hung there (SIGSTOP) stops
  node 0 after the collective timeout.

Every node gets the same ``HICACHE_RANK_SECRET`` (a multi-node server refuses to start
without one). The namespaces need root (as in CI); those tests are skipped with the reason
elsewhere. The flag checks run everywhere."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import uuid

import pytest
from typer.testing import CliRunner

from hicache_cli.app import app
from tests.test_rank_liveness import descendants, listeners

DATA = os.path.join(os.path.dirname(__file__), "data", "conversation_trace_head400.jsonl.gz")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECRET = {"HICACHE_RANK_SECRET": "test-secret-" + "x" * 20}
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
    env = {k: v for k, v in os.environ.items() if k != "GLOO_SOCKET_IFNAME"}   # picked
    env.update(PYTHONPATH=ROOT, **SECRET)
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


# -- bench serve on two nodes ------------------------------------------------------------------
SERVE = ["bench", "serve", "--port", "0", "--l1-tokens", "256", "--l2-tokens", "2048",
         "--page-size", "16", "--format", "json"]


def _popen(ns: str | None, dev: str | None, *args: str, ifname: str | None = None
           ) -> subprocess.Popen:
    """A process in namespace ``ns``. No ``GLOO_SOCKET_IFNAME`` (the ranks pick the interface
    that routes to the rendezvous) unless ``ifname`` forces one."""
    env = {k: v for k, v in os.environ.items() if k != "GLOO_SOCKET_IFNAME"}
    env.update(PYTHONPATH=ROOT, **SECRET)
    if ifname is not None:
        env["GLOO_SOCKET_IFNAME"] = ifname
    prefix = ["ip", "netns", "exec", ns] if ns else []
    return subprocess.Popen([*prefix, sys.executable, *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _first_line(p: subprocess.Popen) -> dict:
    line = p.stdout.readline()
    if not line:
        p.kill()
        raise AssertionError(f"did not start: {p.stderr.read()[-2000:]}")
    return json.loads(line)


def _client(ns: str | None, url: str) -> list:
    """The request script of tests/serve_client.py, sent from inside namespace ``ns``."""
    p = _popen(ns, None, "-m", "tests.serve_client", url)
    out, err = p.communicate(timeout=240)
    assert p.returncode == 0, err[-2000:]
    return json.loads(out)


def _stop(*procs: subprocess.Popen) -> list[str]:
    """SIGINT the first (node 0), then wait for all; their stderr, each must exit 0."""
    procs[0].send_signal(signal.SIGINT)
    errs = []
    for p in procs:
        try:
            _, err = p.communicate(timeout=120)
        finally:
            if p.poll() is None:
                p.kill()
        assert p.returncode == 0, err[-2000:]
        errs.append(err)
    return errs


@pytest.mark.parametrize("mode", [["--cp", "2"], ["--tp", "2"], ["--pp", "2"]],
                         ids=["cp", "tp", "pp"])
def test_serve_on_two_nodes_equals_one_node(two_hosts, tmp_path, mode):
    (a, dev_a), (b, dev_b) = two_hosts
    nodes = ["--nnodes", "2", "--dist-init-addr", "10.231.7.1:29533"]
    out = {r: tmp_path / f"n{r}" for r in (0, 1)}
    snap = (lambda r: ["--dump-tree-on-exit", f"{out[r]}/"]) if mode[0] != "--pp" else \
        (lambda r: [])
    n1 = _popen(b, dev_b, "-m", "hicache_cli.app", *SERVE, *mode, *nodes, "--node-rank", "1",
                "--rank-log-dir", str(out[1]), *snap(1))
    n0 = _popen(a, dev_a, "-m", "hicache_cli.app", *SERVE, *mode, *nodes, "--node-rank", "0",
                "--rank-log-dir", str(out[0]), *snap(0))
    single = _popen(None, None, "-m", "hicache_cli.app", *SERVE, *mode)   # the reference
    try:
        assert _first_line(n1)["ranks"] == [1]
        url = _first_line(n0)["url"]
        # node 0's rendezvous binds the given address, nothing listens on the wildcard
        socks = listeners([n0.pid, *descendants(n0.pid)])
        assert ("10.231.7.1", 29533) in socks, socks
        assert not [s for s in socks if s[0] in ("0.0.0.0", "::")], socks
        got = _client(a, url)                        # node 0's HTTP, from inside its host
        one = _client(None, _first_line(single)["url"])
    finally:
        try:
            errs = _stop(n0, n1)
        finally:
            _stop(single)
    assert "node 0 halted" in errs[1] and "Traceback" not in errs[1]
    assert got == one                                # outputs and cache hits
    assert got[2][1]["device"] == 96 and got[-1][1]["host"] > 0
    logs = tmp_path / "logs"                         # one log per rank, one rank per node
    logs.mkdir()
    for r in (0, 1):
        shutil.copy(out[r] / f"rank{r}.ranklog", logs)
    res = CliRunner().invoke(app, ["consensus-check", str(logs), "--format", "json"])
    assert res.exit_code == 0 and json.loads(res.stdout)["consistent"] is True, res.output
    if mode[0] != "--pp":                            # node 1's rank wrote its tree
        assert (out[1] / "tree-rank1.snapshot").is_file()
    if mode[0] == "--cp":
        res = CliRunner().invoke(app, ["inspect", str(out[1] / "tree-rank1.snapshot"),
                                       "--owners", "--format", "json"])
        assert res.exit_code == 0, res.output
        view = json.loads(res.stdout)
        assert view["snapshot"]["rank"]["cp_rank"] == 1
        own = view["owners"]
        assert own["segments"] >= 1 and own["restarts"] == 0
        assert all(w["pages"] > 0 for w in own["owners"])


@pytest.mark.parametrize("shape,port", [(["--tp", "2", "--cp", "2"], 29534),
                                        (["--pp", "2", "--tp", "2"], 29536)],
                         ids=["tp2xcp2", "pp2xtp2"])
def test_four_ranks_on_two_nodes_two_each(two_hosts, tmp_path, shape, port):
    """``--tp 2 --cp 2`` (or ``--pp 2 --tp 2``: a stage per node) over two nodes: node 0 runs
    ranks 0 and 1 (the leader and a local follower), node 1 ranks 2 and 3; tokens equal one
    rank's, the four logs agree."""
    (a, dev_a), (b, dev_b) = two_hosts
    mode = [*shape, "--nnodes", "2", "--dist-init-addr", f"10.231.7.1:{port}"]
    out = {r: tmp_path / f"n{r}" for r in (0, 1)}
    n1 = _popen(b, dev_b, "-m", "hicache_cli.app", *SERVE, *mode, "--node-rank", "1",
                "--rank-log-dir", str(out[1]))
    n0 = _popen(a, dev_a, "-m", "hicache_cli.app", *SERVE, *mode, "--node-rank", "0",
                "--rank-log-dir", str(out[0]))
    try:
        assert _first_line(n1)["ranks"] == [2, 3]
        got = _client(a, _first_line(n0)["url"])
    finally:
        _stop(n0, n1)
    single = _popen(None, None, "-m", "hicache_cli.app", *SERVE)       # one rank
    try:
        one = _client(None, _first_line(single)["url"])
    finally:
        _stop(single)
    assert [o for o, _ in got] == [o for o, _ in one]
    assert sorted(os.listdir(out[0])) == ["rank0.ranklog", "rank1.ranklog"]
    assert sorted(os.listdir(out[1])) == ["rank2.ranklog", "rank3.ranklog"]
    logs = tmp_path / "logs"
    logs.mkdir()
    for r in range(4):
        shutil.copy(out[r // 2] / f"rank{r}.ranklog", logs)
    res = CliRunner().invoke(app, ["consensus-check", str(logs), "--format", "json"])
    assert res.exit_code == 0 and json.loads(res.stdout)["consistent"] is True, res.output


def test_a_node_whose_links_would_advertise_loopback_is_said_in_one_line(two_hosts):
    """Node 1 forced onto ``lo`` (as a host whose name resolves to 127.0.x.x would be): node 0
    refuses in one line naming the rank and the fix, instead of a connect timeout."""
    (a, dev_a), (b, dev_b) = two_hosts
    mode = ["--tp", "2", "--nnodes", "2", "--dist-init-addr", "10.231.7.1:29538",
            "--collective-timeout", "20"]
    n1 = _popen(b, dev_b, "-m", "hicache_cli.app", *SERVE, *mode, "--node-rank", "1",
                ifname="lo")
    n0 = _popen(a, dev_a, "-m", "hicache_cli.app", *SERVE, *mode, "--node-rank", "0")
    try:
        _, err0 = n0.communicate(timeout=120)
    finally:
        for p in (n0, n1):
            if p.poll() is None:
                p.kill()
            p.wait()
    assert n0.returncode == 1, err0[-2000:]
    assert "rank 1 (node 1) would advertise the loopback address 127.0.0.1" in err0, err0
    assert "GLOO_SOCKET_IFNAME on node 1" in err0 and "Traceback" not in err0, err0


def test_a_rank_killed_on_node_1_is_named_by_node_0(two_hosts, tmp_path):
    """Node 1 posts its dead rank on the rendezvous store: node 0's server stops naming it
    (exit 1), and node 1 exits 1 too."""
    (a, dev_a), (b, dev_b) = two_hosts
    mode = ["--cp", "2", "--nnodes", "2", "--dist-init-addr", "10.231.7.1:29535"]
    n1 = _popen(b, dev_b, "-m", "hicache_cli.app", *SERVE, *mode, "--node-rank", "1")
    n0 = _popen(a, dev_a, "-m", "hicache_cli.app", *SERVE, *mode, "--node-rank", "0")
    try:
        pid = _first_line(n1)["pids"][0]
        _client(a, _first_line(n0)["url"])           # serving: the group is up
        os.kill(pid, signal.SIGKILL)
        _, err0 = n0.communicate(timeout=120)
        _, err1 = n1.communicate(timeout=120)
    finally:
        for p in (n0, n1):
            if p.poll() is None:
                p.kill()
    assert n0.returncode == 1 and "rank 1 exited (code -9) on another node" in err0, err0
    assert n1.returncode == 1 and "rank 1 exited (code -9)" in err1, err1
    assert "Traceback" not in err0 + err1


ONE_REQUEST = """import sys, requests
try:
    r = requests.post(sys.argv[1] + "/generate", timeout=90, json={
        "input_ids": list(range(40)), "sampling_params": {"max_new_tokens": 2}})
    print(r.status_code)
except requests.ConnectionError:
    print("cut off")
"""


def test_a_hung_rank_on_node_1_is_named_by_node_0(two_hosts):
    """A rank that stops answering (SIGSTOP) on another host: its node's watchdog kills it
    after the heartbeat timeout and posts it; node 0's collective fails, the request fails and
    node 0's server stops (exit 1) naming it, no silent hang."""
    (a, dev_a), (b, dev_b) = two_hosts
    mode = ["--cp", "2", "--nnodes", "2", "--dist-init-addr", "10.231.7.1:29537",
            "--collective-timeout", "15"]
    n1 = _popen(b, dev_b, "-m", "hicache_cli.app", *SERVE, *mode, "--node-rank", "1")
    n0 = _popen(a, dev_a, "-m", "hicache_cli.app", *SERVE, *mode, "--node-rank", "0")
    pid = None
    try:
        pid = _first_line(n1)["pids"][0]
        url = _first_line(n0)["url"]
        os.kill(pid, signal.SIGSTOP)
        req = _popen(a, None, "-c", ONE_REQUEST, url)
        answer, _ = req.communicate(timeout=120)
        _, err0 = n0.communicate(timeout=120)
        _, err1 = n1.communicate(timeout=60)         # its watchdog killed the stopped rank
    finally:
        if pid is not None:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass                                 # gone already
        for p in (n0, n1):
            if p.poll() is None:
                p.kill()
                p.wait()
    assert answer.strip() != "200", answer
    assert n0.returncode == 1, err0
    # the hung rank itself is named (its node posts why it killed it), not a peer that gave up
    assert "stopped: CP rank 1 stopped answering" in err0 and "on node 1" in err0, err0
    assert n1.returncode == 1 and "rank 1 stopped answering" in err1, err1
    assert "Traceback" not in err0 + err1


HEALTH = """import sys, time, requests
for _ in range(300):
    r = requests.get(sys.argv[1] + "/health", timeout=5)
    if r.status_code == 503:
        print(r.text)
        break
    time.sleep(0.1)
"""


def test_a_stage_killed_on_node_1_turns_health_unhealthy_naming_it(two_hosts):
    (a, dev_a), (b, dev_b) = two_hosts
    mode = ["--pp", "2", "--nnodes", "2", "--dist-init-addr", "10.231.7.1:29536",
            "--collective-timeout", "20"]
    n1 = _popen(b, dev_b, "-m", "hicache_cli.app", *SERVE, *mode, "--node-rank", "1")
    n0 = _popen(a, dev_a, "-m", "hicache_cli.app", *SERVE, *mode, "--node-rank", "0")
    try:
        pid = _first_line(n1)["pids"][0]
        url = _first_line(n0)["url"]
        _client(a, url)                              # serving: the pipeline is up
        os.kill(pid, signal.SIGKILL)
        probe = _popen(a, None, "-c", HEALTH, url)   # /health, from inside node 0's host
        health, _ = probe.communicate(timeout=60)
        _, err1 = n1.communicate(timeout=60)
    finally:
        for p in (n0, n1):
            if p.poll() is None:
                p.kill()
                p.wait()
    assert "pipeline stage 1 exited (code -9) on another node" in health, health
    assert n1.returncode == 1 and "stage 1 exited (code -9)" in err1, err1


@pytest.mark.parametrize("args, message", [
    (["--cp", "2", "--nnodes", "2"], "--dist-init-addr"),
    (["--cp", "3", "--nnodes", "2", "--dist-init-addr", "h:1"], "evenly"),
    (["--cp", "2", "--nnodes", "2", "--node-rank", "2", "--dist-init-addr", "h:1"],
     "--node-rank"),
    (["--nnodes", "2", "--dist-init-addr", "h:1"], "needs ranks to spread"),
    (["--pp", "2", "--nnodes", "2", "--dist-init-addr", "nohost"], "HOST:PORT"),
    (["--pp", "2", "--nnodes", "2", "--dist-init-addr", "h:99999"], "HOST:PORT"),
    (["--pp", "2", "--nnodes", "2", "--dist-init-addr", "h:1"], "HICACHE_RANK_SECRET"),
])
def test_serve_node_flags_are_checked(args, message, monkeypatch):
    monkeypatch.delenv("HICACHE_RANK_SECRET", raising=False)
    res = CliRunner().invoke(app, ["bench", "serve", *args])
    assert res.exit_code == 2, res.output
    assert message in res.output and len(res.output.strip().splitlines()) == 1
