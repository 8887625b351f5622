"""Two hicache replicas sharing a file L3 behind SGLang's own router (PyPI ``sglang-router``, the
``fleet`` extra; installed by ``make``): cache_aware sends a repeated prompt back to the replica
that holds it; round_robin sends it to the other one, which still finds it in the shared L3."""

from __future__ import annotations

import json
import logging
import socket
import subprocess
import sys
import time

import pytest
import requests

from engine.runtime.launch import ServerConfig, start_server

PAGE = 16


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _router(urls: list[str], policy: str, log, *extra: str) -> tuple[subprocess.Popen, str]:
    port = _port()
    proc = subprocess.Popen([sys.executable, "-m", "sglang_router.launch_router",
                             "--worker-urls", *urls, "--policy", policy, "--host", "127.0.0.1",
                             "--port", str(port), "--prometheus-host", "127.0.0.1",
                             "--prometheus-port", str(_port()), "--log-level", "warn", *extra],
                            stdout=log, stderr=subprocess.STDOUT)
    return proc, f"http://127.0.0.1:{port}"


def _ready(proc: subprocess.Popen, url: str, log_path) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"router exited: {log_path.read_text()[-2000:]}"
        try:
            workers = requests.get(url + "/workers", timeout=2).json()["workers"]
            if len(workers) == 2 and all(w.get("is_healthy") for w in workers):
                return
        except (requests.RequestException, ValueError, KeyError):
            pass
        time.sleep(0.2)
    raise AssertionError(f"router not ready: {log_path.read_text()[-2000:]}")


def _generate(url: str, text: str) -> dict:
    r = requests.post(url + "/generate", timeout=120, json={
        "text": text, "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
    assert r.status_code == 200, r.text
    return r.json()["meta_info"]


def _puts(urls: list[str]) -> float:
    total = 0.0
    for u in urls:
        for line in requests.get(u + "/metrics", timeout=30).text.splitlines():
            if line.startswith('hicache_l3_pages_total{outcome="puts"}'):
                total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    pytest.importorskip("sglang_router", reason="the fleet extra (sglang-router) is not "
                                                "installed")
    store = tmp_path_factory.mktemp("l3")
    logs = tmp_path_factory.mktemp("router")
    cfg = dict(port=0, l1_tokens=2048, l2_tokens=4096, page_size=PAGE,
               hicache_storage_backend="file", hicache_storage_dir=str(store),
               hicache_storage_prefetch_policy="wait_complete")
    with start_server(ServerConfig(**cfg)) as a, start_server(ServerConfig(**cfg)) as b:
        urls = [a.url, b.url]
        routers = {}
        files = []
        try:
            for policy in ("cache_aware", "round_robin"):     # both start at once
                path = logs / f"{policy}.log"
                files.append(open(path, "w"))
                routers[policy] = (*_router(urls, policy, files[-1]), path)
            for proc, url, path in routers.values():
                _ready(proc, url, path)
            yield urls, {k: v[1] for k, v in routers.items()}
        finally:
            for proc, _, _ in routers.values():
                proc.terminate()
            for proc, _, _ in routers.values():
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()
            for f in files:
                f.close()


def test_cache_aware_routes_the_repeat_to_the_replica_that_has_it(fleet):
    _, router = fleet
    text = "cache-aware routing keeps a session's prefix where it was computed. " * 5
    first = _generate(router["cache_aware"], text)
    # nothing of the text was cached: no whole page (the BOS a cached page of another prompt
    # starts with may be copied: partial last-page reuse)
    assert first["cached_tokens"] < PAGE
    second = _generate(router["cache_aware"], text)
    d = second["cached_tokens_details"]
    full = first["prompt_tokens"] // PAGE * PAGE
    assert d["device"] >= full - PAGE and d["storage"] == 0, second
    assert second["cached_tokens"] == d["device"] + d["host"] + d["storage"]


def test_round_robin_moves_the_repeat_and_the_shared_l3_still_hits(fleet):
    urls, router = fleet
    text = "round-robin spreads a session over replicas; the shared store remembers it. " * 5
    before = _puts(urls)
    first = _generate(router["round_robin"], text)
    assert first["cached_tokens"] < PAGE          # (as above: at most a shared BOS)
    pages = first["prompt_tokens"] // PAGE
    deadline = time.monotonic() + 30           # the backup to L3 is written behind the request
    while _puts(urls) < before + pages - 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    second = _generate(router["round_robin"], text)
    d = second["cached_tokens_details"]
    assert d["device"] < PAGE and d["host"] == 0, f"landed on the same replica: {second}"
    assert d["storage"] >= (pages - 1) * PAGE, second


def test_the_routers_http2_probe_is_a_400_and_one_log_line(caplog):
    # sglang-router opens every worker with an HTTP/2 preface (looking for gRPC workers).
    with start_server(ServerConfig(port=0, l1_tokens=1024)) as s:
        host, port = s.url.rsplit("/", 1)[1].rsplit(":", 1)
        with caplog.at_level(logging.INFO, logger="aiohttp.server"), \
                socket.create_connection((host, int(port)), timeout=10) as c:
            c.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x18\x04\x00\x00\x00\x00\x00")
            reply = c.recv(64)
            time.sleep(0.2)
    assert reply.startswith(b"HTTP/1.0 400") or reply.startswith(b"HTTP/1.1 400"), reply
    records = [r for r in caplog.records if r.name == "aiohttp.server"]
    assert records and all(r.exc_info is None and "\n" not in r.getMessage() for r in records)
    assert "answered 400" in records[0].getMessage()
    assert all(r.levelno == logging.INFO for r in records)


def test_bench_replicas_runs_both_policies_side_by_side():
    pytest.importorskip("sglang_router", reason="the fleet extra (sglang-router) is not "
                                                "installed")
    import json

    from typer.testing import CliRunner

    from hicache_cli.app import app

    r = CliRunner().invoke(app, ["bench", "--replicas", "2", "--num-clients", "2",
                                 "--num-rounds", "3", "--format", "json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert list(d["runs"]) == ["round_robin", "cache_aware"] and d["replicas"] == 2
    assert d["cache_threshold"] == 0.5          # the job's default, not the router's 0.3
    assert all(run["router_exit"] is None for run in d["runs"].values())
    for run in d["runs"].values():
        assert run["requests"]["ok"] == 6 and run["requests"]["failed"] == 0
        computed = run["replicas"]["computed_prompt_tokens"]
        assert len(computed) == 2 and sum(computed) > 0
    assert d["runs"]["round_robin"]["replicas"]["load_spread"] < 1.5   # both replicas worked


@pytest.mark.parametrize("args,needle", [(["--replicas", "1"], "--replicas must be >= 2"),
                                         (["--replicas", "2", "--router", "nearest"],
                                          "unknown policy 'nearest'")])
def test_bench_replicas_bad_input(args, needle):
    from typer.testing import CliRunner

    from hicache_cli.app import app

    r = CliRunner().invoke(app, ["bench", *args])
    assert r.exit_code == 2, r.output
    assert needle in r.output and "Traceback" not in r.output


def test_bench_run_through_the_router_reports_each_replica(fleet):
    import json

    from typer.testing import CliRunner

    from hicache_cli.app import app

    urls, router = fleet
    r = CliRunner().invoke(app, ["bench", "run", "--url", router["round_robin"], "-w",
                                 "multiturn", "--num-clients", "2", "--num-rounds", "2",
                                 "--request-length", "32", "--max-tokens", "2",
                                 "--format", "json"])
    assert r.exit_code == 0, r.output
    fig = json.loads(r.stdout)["per_replica"]
    assert sorted(x["url"] for x in fig["replicas"]) == sorted(urls)
    assert all(x["answered"] for x in fig["replicas"])
    assert [x["requests"] for x in fig["replicas"]] == [2, 2]       # round-robin: 2 each
    assert sum(x["prompt_tokens"] for x in fig["replicas"]) > 0


def test_a_router_that_dies_mid_run_ends_the_run_with_errors(fleet, tmp_path):
    # The run reports the failed requests and finishes; nothing hangs.
    import threading

    from typer.testing import CliRunner

    from hicache_cli.app import app

    urls, _ = fleet
    with open(tmp_path / "router.log", "w") as log:
        proc, url = _router(urls, "round_robin", log)
        try:
            _ready(proc, url, tmp_path / "router.log")
            threading.Timer(1.5, proc.kill).start()   # far fewer rounds than 400 fit in 1.5 s
            t0 = time.monotonic()
            r = CliRunner().invoke(app, ["bench", "run", "--url", url, "-w", "multiturn",
                                         "--num-clients", "2", "--num-rounds", "400",
                                         "--request-length", "16", "--max-tokens", "2",
                                         "--timeout", "20", "--format", "json"])
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    assert time.monotonic() - t0 < 60
    assert r.exit_code in (0, 1), r.output
    assert "Traceback" not in r.output
    d = json.loads(r.stdout) if r.exit_code == 0 else None
    if d is not None:
        assert d["requests"]["failed"] > 0 and d["requests"]["ok"] > 0
    else:
        assert "requests failed" in r.output or "failed" in r.output


# ---------------------------------------------------------------- bad input of the live fleet

def _bench(*args: str):
    from typer.testing import CliRunner

    from hicache_cli.app import app

    return CliRunner().invoke(app, ["bench", *args])


def _one_line_error(r) -> str:
    assert "Traceback" not in r.output, r.output
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, r.stderr
    return lines[0]


@pytest.mark.parametrize("args,needle", [
    (["--router-args", "--port 9"], "--port is set by hicache bench itself"),
    (["--router-args", "'unbalanced"], "quotation"),
])
def test_bench_replicas_bad_router_args_are_usage_errors(args, needle):
    pytest.importorskip("sglang_router", reason="the fleet extra is not installed")
    r = _bench("--replicas", "2", *args)
    assert r.exit_code == 2, r.output
    assert needle in _one_line_error(r)


def test_bench_replicas_without_the_router_installed_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "sglang_router", None)     # as if not installed
    r = _bench("--replicas", "2")
    assert r.exit_code == 2, r.output
    assert "pip install 'hicache[fleet]'" in _one_line_error(r)


def test_bench_replicas_a_router_that_refuses_to_start_is_one_line():
    # the real router, given an option it does not know: it exits 2 at start
    pytest.importorskip("sglang_router", reason="the fleet extra is not installed")
    t0 = time.monotonic()
    r = _bench("--replicas", "2", "--router", "round_robin", "--router-args",
               "--no-such-router-option 1")
    assert time.monotonic() - t0 < 120
    assert r.exit_code == 2, r.output
    line = _one_line_error(r)
    assert "round_robin router exited 2 at start" in line and "no-such-router-option" in line


def test_bench_replicas_a_replica_that_fails_to_start_is_one_line(tmp_path):
    # a checkpoint whose config passes the checks before the start and whose weights are
    # cut short: the first replica fails while it loads them
    pytest.importorskip("sglang_router", reason="the fleet extra is not installed")
    from engine.runtime.model import ModelConfig, random_weights, save_hf

    cfg = ModelConfig(name="cut", num_layers=2, hidden=64, num_heads=2, num_kv_heads=1,
                      head_dim=32, intermediate=128, max_context=2048)
    save_hf(str(tmp_path), cfg, random_weights(cfg, 3))
    w = tmp_path / "model.safetensors"
    w.write_bytes(w.read_bytes()[:w.stat().st_size // 2])
    r = _bench("--replicas", "2", "--model", str(tmp_path))
    assert r.exit_code == 1, r.output
    line = _one_line_error(r)
    assert "replica 0 of 2 did not start" in line and "model.safetensors" in line
    assert not _children("sglang_router.launch_router")      # no router was left running


def _children(pattern: str) -> list[int]:
    """Live child processes of this process whose command line contains ``pattern``."""
    import os

    me, out = os.getpid(), []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == me and pattern in cmd:
            out.append(int(d))
    return out


def _listening_ports(pid: int) -> list[str]:
    """The TCP ports process ``pid`` listens on (its socket inodes in /proc/net/tcp{,6})."""
    import os

    try:
        inodes = {os.readlink(f"/proc/{pid}/fd/{fd}")[8:-1]
                  for fd in os.listdir(f"/proc/{pid}/fd")
                  if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:[")}
    except OSError:
        return []
    ports = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if len(cols) > 9 and cols[3] == "0A" and cols[9] in inodes:     # 0A: LISTEN
                ports.append(str(int(cols[1].rsplit(":", 1)[1], 16)))
    return ports


def test_bench_replicas_a_router_killed_mid_run_reports_and_finishes():
    # SIGKILL the router `hicache bench --replicas` started, once it has served requests: the
    # run's later requests fail as `connection`, the report says so, the command exits 1.
    pytest.importorskip("sglang_router", reason="the fleet extra is not installed")
    import os
    import re
    import signal
    import threading

    killed: list[int] = []
    ports: dict[int, list[str]] = {}

    before = set(_children("sglang"))    # another test's router (a module fixture's): not ours

    def killer() -> None:
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline and not killed:
            for pid in set(_children("sglang")) - before:
                try:                    # its arguments, until it retitles itself sglang::router
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        m = re.search(r"--port (\d+)", f.read().replace(b"\0", b" ").decode())
                    if m:
                        ports.setdefault(pid, [m.group(1)])
                except OSError:
                    continue
                if pid not in ports:            # retitled before it was seen: its sockets
                    got = _listening_ports(pid)
                    if got:
                        ports[pid] = got
                m = {}
                for port in ports.get(pid, []):
                    try:
                        m = requests.get(f"http://127.0.0.1:{port}/workers", timeout=2).json()
                        break
                    except (requests.RequestException, ValueError):
                        continue
                if len([w for w in m.get("workers", []) if w.get("is_healthy")]) == 2:
                    time.sleep(2.0)                 # let it route a few turns
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
            time.sleep(0.2)

    t = threading.Thread(target=killer, daemon=True)
    t.start()
    t0 = time.monotonic()
    # rounds enough to outlast the killer's look on a loaded machine: the kill ends the run
    # (40 rounds were done before the router was seen once, in a whole-suite run; 200 rounds
    # need an L1 of 4096 tokens)
    r = _bench("--replicas", "2", "--router", "round_robin", "--num-clients", "2",
               "--num-rounds", "200", "--l1-tokens", "4096", "--format", "json")
    t.join(timeout=10)
    assert killed, "the router was never seen"
    assert time.monotonic() - t0 < 180
    assert r.exit_code == 1, r.output
    assert "requests failed: round_robin: connection" in _one_line_error(r)
    assert "round_robin router died during its run (exit -9)" in r.stderr
    run = json.loads(r.stdout)["runs"]["round_robin"]
    assert run["router_exit"] == -signal.SIGKILL
    assert run["requests"]["ok"] > 0 and run["errors_by_status"].get("connection", 0) > 0
    assert run["requests"]["sent"] == run["requests"]["ok"] + run["requests"]["failed"] < 400


def test_bench_run_through_the_router_with_a_replica_killed_mid_run(tmp_path):
    # Two replicas behind the real router, one of them its own process: SIGKILL it while
    # `bench run --url ROUTER` sends. The run finishes, its report counts the failures by
    # status, and the per-replica figures say the killed one did not answer. (With its
    # retries on, the router resends to the live replica and the run sees no error.)
    pytest.importorskip("sglang_router", reason="the fleet extra is not installed")
    import os
    import signal
    import threading

    from engine.loadgen.replicas import replica_counters
    from tests.serve_client import spawn

    store = tmp_path / "l3"
    args = ["--hicache-storage-backend", "file", "--hicache-storage-dir", str(store)]
    victim, vurl = spawn(*args, stderr=subprocess.DEVNULL)
    try:
        with start_server(ServerConfig(port=0, l1_tokens=2048, l2_tokens=4096, page_size=PAGE,
                                       hicache_storage_backend="file",
                                       hicache_storage_dir=str(store))) as a, \
                open(tmp_path / "router.log", "w") as log:
            # without the router's retries, a request sent to the dead replica fails to us
            proc, url = _router([a.url, vurl], "round_robin", log, "--disable-retries")
            try:
                _ready(proc, url, tmp_path / "router.log")
                served: list[float] = []

                def killer() -> None:        # once the victim has answered a few requests
                    deadline = time.monotonic() + 60
                    while time.monotonic() < deadline:
                        n = (replica_counters(vurl, timeout=2) or {}).get("requests", 0)
                        if n >= 4:
                            served.append(n)
                            os.kill(victim.pid, signal.SIGKILL)
                            return
                        time.sleep(0.05)

                t = threading.Thread(target=killer, daemon=True)
                t.start()
                t0 = time.monotonic()
                r = _bench("run", "--url", url, "-w", "multiturn", "--num-clients", "2",
                           "--num-rounds", "100", "--request-length", "16", "--max-tokens",
                           "2", "--timeout", "30", "--format", "json")
                wall = time.monotonic() - t0
                t.join(timeout=5)
                alive = proc.poll() is None
            finally:
                proc.kill()
                proc.wait()
    finally:
        if victim.poll() is None:
            victim.kill()
        victim.wait()
    assert served and victim.returncode == -signal.SIGKILL and alive
    assert wall < 90
    assert r.exit_code in (0, 1), r.output
    assert "Traceback" not in r.output
    d = json.loads(r.stdout)
    rows = {x["url"]: x for x in d["per_replica"]["replicas"]}
    assert rows[a.url]["answered"] and rows[a.url]["requests"] > 0
    assert not rows[vurl]["answered"]
    assert rows[vurl]["reason"].startswith("no answer") and "after the run" in rows[vurl]["reason"]
    assert d["requests"]["sent"] == d["requests"]["ok"] + d["requests"]["failed"]
    assert d["requests"]["failed"] > 0 and d["requests"]["ok"] > 0 and r.exit_code == 0
    kinds = set(d["errors_by_status"])
    assert kinds and kinds <= {str(c) for c in range(500, 600)}, d["errors_by_status"]
    assert sum(d["errors_by_status"].values()) == d["requests"]["failed"]
    assert d["first_error"].split(":", 1)[0] in kinds
