"""Rank processes and P/D workers, seen from outside (docs/reliability.md, "Ranks and workers"):

* every listening socket of a ``--tp 2`` / ``--cp 2`` / ``--pp 2`` / ``--disaggregation pd``
  server and its children is bound to 127.0.0.1 — none on 0.0.0.0 or ``::``;
* a stranger connecting to those ports and setting keys (the names an unprotected torch group
  would use) does not disturb serving: the same greedy output before and after;
* a rank or worker stopped with SIGSTOP is noticed from its missing heartbeats within a few
  seconds: the request on it fails at once with a 503 naming it, ``/health`` names it;
* a SIGKILLed server (front end) leaves no worker behind: all its children are gone within a
  few seconds.

Each case starts one small server (tiny model, two ranks); they are the expensive tests."""

from __future__ import annotations

import datetime
import os
import re
import signal
import time

import pytest
import requests

from checkers.procs import alive, descendants, listeners
from tests.serve_client import prompt, spawn

MODES = {"tp2": ["--tp", "2"], "cp2": ["--cp", "2"], "pp2": ["--pp", "2"],
         "pd": ["--disaggregation", "pd"]}
# every other timeout well past the request's 60 s: only the heartbeats can fail it in time
HB = ["--rank-heartbeat-timeout", "2", "--collective-timeout", "120", "--pd-link-timeout", "120",
      "--pd-transfer-timeout", "120"]
SP = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}


def stranger_sets_keys(port: int) -> int:
    """Connect to ``port`` as a torch store client and set the keys an unprotected group
    would read; how many it set (0: the port is not a store)."""
    import torch.distributed as dist

    try:
        s = dist.TCPStore("127.0.0.1", port, None, False, datetime.timedelta(seconds=3),
                          wait_for_workers=False)
    except Exception:  # noqa: BLE001 - not a store (a gloo link, the HTTP port)
        return 0
    keys = ["rank_0", "rank_1", "0", "1", "default_pg/0//0", "default_pg/0//1", "init/",
            "/default_pg/0//cpu//0", "prefill", "decode", "hicache/exit/rank1"]
    for k in keys:
        s.set(k, "x" * 64)
    return len(keys)


def strangers(ports: list[int]) -> int:
    """A stranger on each port at once (one that is a gloo link, not a store, holds its client
    until the link drops it); how many keys they set in all."""
    import threading

    got: dict[int, int] = {}

    def one(p: int) -> None:
        got[p] = stranger_sets_keys(p)
    threads = [threading.Thread(target=one, args=(p,), daemon=True) for p in ports]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    return sum(got.values())


def generate(url: str, ids: list[int], timeout: float = 120) -> requests.Response:
    return requests.post(url + "/generate", json={"input_ids": ids, "sampling_params": SP},
                         timeout=timeout)


def _cmd(pid: int) -> str:
    try:
        return open(f"/proc/{pid}/cmdline").read().replace("\0", " ")
    except OSError:
        return ""


def _is_helper(pid: int) -> bool:
    """multiprocessing's resource tracker (not a rank)."""
    return "resource_tracker" in _cmd(pid)


PID_LOG = {"tp2": r"TP rank 1: pid (\d+)", "cp2": r"CP rank 1: pid (\d+)",
           "pp2": r"pipeline stage 1: pid (\d+)", "pd": r"P/D decode worker: pid (\d+)"}
NAME = {"tp2": "rank 1", "cp2": "rank 1", "pp2": "pipeline stage 1", "pd": "decode worker"}


@pytest.mark.parametrize("mode", list(MODES), ids=list(MODES))
def test_ranks_listen_on_loopback_shrug_off_strangers_and_a_stopped_one_is_named(mode, tmp_path):
    log = tmp_path / "server.err"
    with open(log, "w") as err:
        proc, url = spawn(*MODES[mode], *HB, "--log-level", "info", stderr=err)
    try:
        ids = prompt(40, 7)
        first = generate(url, ids)
        assert first.status_code == 200, first.text
        kids = [k for k in descendants(proc.pid) if not _is_helper(k)]
        assert len(kids) >= (2 if mode == "pd" else 1)
        socks = listeners([proc.pid, *kids])
        assert socks, "no listening socket found"
        wild = [s for s in socks if s[0] in ("0.0.0.0", "::")]
        assert wild == [], f"wildcard listeners: {wild}"
        assert all(ip == "127.0.0.1" for ip, _ in socks), socks
        http_port = int(url.rsplit(":", 1)[1])
        set_keys = strangers([p for _, p in socks if p != http_port])
        assert set_keys > 0                          # the store took the stranger's writes …
        again = generate(url, ids)                   # … and the group did not notice
        assert again.status_code == 200, again.text
        assert again.json()["output_ids"] == first.json()["output_ids"]

        target = int(re.search(PID_LOG[mode], log.read_text()).group(1))
        name = NAME[mode]
        os.kill(target, signal.SIGSTOP)
        try:
            r = generate(url, prompt(30, 8), timeout=60)
            assert r.status_code == 503, r.text
            assert name in r.text and "stopped answering" in r.text, r.text
            try:
                h = requests.get(url + "/health", timeout=10)
                assert h.status_code == 503 and name in h.text, h.text
            except requests.ConnectionError:
                pass                                     # already stopped (ranks' servers)
        finally:
            try:
                os.kill(target, signal.SIGCONT)
            except ProcessLookupError:
                pass
    finally:
        if mode == "pd" or proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except Exception:  # noqa: BLE001
            proc.kill()
    assert "Traceback" not in log.read_text()


@pytest.mark.parametrize("mode", list(MODES), ids=list(MODES))
def test_a_killed_server_leaves_no_worker_behind(mode):
    proc, url = spawn(*MODES[mode])
    kids = [k for k in descendants(proc.pid) if not _is_helper(k)]
    assert kids
    proc.kill()
    proc.wait(10)
    deadline = time.monotonic() + 15
    while any(alive(k) for k in kids) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [k for k in kids if alive(k)]
    for k in left:
        os.kill(k, signal.SIGKILL)
    assert left == [], f"orphaned workers: {left}"


def test_a_store_client_without_the_secret_can_neither_read_nor_change_the_groups_keys(
        monkeypatch):
    """The rendezvous in one process: what the group stores lives under the secret's prefix;
    a raw client (or one with another secret) does not find it and cannot overwrite it."""
    import torch.distributed as dist

    from engine.parallel.rendezvous import Rendezvous, launch_secret, split_addr

    rdv = Rendezvous.host(None, launch_secret())
    host, port = split_addr(rdv.addr)
    assert host == "127.0.0.1"
    assert ("0.0.0.0", port) not in listeners([os.getpid()])
    group = rdv.store(5.0)                                    # the server, prefixed
    group.set("rank_0", "the real address")
    raw = dist.TCPStore(host, port, None, False, datetime.timedelta(seconds=5),
                        wait_for_workers=False)
    other = Rendezvous(rdv.addr, "another-secret-" + "z" * 16).store(5.0)
    assert not raw.check(["rank_0"]) and not other.check(["rank_0"])
    raw.set("rank_0", "evil")
    other.set("rank_0", "evil")
    assert group.get("rank_0") == b"the real address"
    monkeypatch.delenv("HICACHE_RANK_SECRET", raising=False)
    assert launch_secret() != launch_secret()                 # drawn per launch
    with pytest.raises(ValueError, match="HICACHE_RANK_SECRET"):
        launch_secret(nnodes=2)
    monkeypatch.setenv("HICACHE_RANK_SECRET", "short")
    with pytest.raises(ValueError, match="at least 16"):
        launch_secret(nnodes=2)


@pytest.mark.parametrize("mode", ["tp2", "pp2"])
def test_an_idle_group_serves_after_more_than_every_timeout(mode):
    """Ranks wait for the next step in a collective: a group left idle longer than the collective
    timeout (and the heartbeat timeout) must still serve, with the same output."""
    # 5 s: the collective timeout also bounds the start-up rendezvous of the ranks
    proc, url = spawn(*MODES[mode], "--collective-timeout", "5", "--rank-heartbeat-timeout", "2")
    try:
        ids = prompt(40, 7)
        body = {"input_ids": ids, "sampling_params": SP}
        first = requests.post(url + "/generate", json=body, timeout=60)
        time.sleep(12)                      # idle past every timeout the group has
        second = requests.post(url + "/generate", json=body, timeout=60)
        health = requests.get(url + "/health", timeout=10)
    finally:
        proc.terminate()
        proc.communicate(timeout=60)
    assert first.status_code == second.status_code == 200, second.text
    assert second.json()["output_ids"] == first.json()["output_ids"]
    assert health.status_code == 200
