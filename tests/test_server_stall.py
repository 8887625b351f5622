"""The server over a stalled store: requests, /flush_cache and SIGTERM all finish, /health and
/metrics say the store is degraded and why, and outputs equal the uncached ones."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
import requests

from engine.runtime.launch import ServerConfig, start_server
from tests.mooncake_master import MooncakeMaster
from tests.test_server_storage import PROMPT, cli_server, generate, metrics
from tests.test_storage_stall import hold_lock


def uncached_ids(text: str) -> list[int]:
    with start_server(ServerConfig(port=0, l1_tokens=2048, l2_tokens=0,
                                   disable_radix_cache=True)) as s:
        return generate(s.url, text)["output_ids"]


def test_stalled_store_never_stalls_the_server(tmp_path):
    other = "A different prompt that the store has never seen before, about tiers. " * 3
    want_a, want_b = uncached_ids(PROMPT), uncached_ids(other)
    store_dir = tmp_path / "store"
    conf = tmp_path / "l3.json"
    conf.write_text(json.dumps({"backend": "file", "file": {"dir": str(store_dir)},
                                "deadline_s": 0.5}))
    proc, url = cli_server("--l1-tokens", "1024", "--l2-tokens", "2048",
                           "--hicache-storage-backend-config", str(conf),
                           "--hicache-storage-prefetch-policy", "wait_complete")
    holder = None
    try:
        assert generate(url)["output_ids"] == want_a
        assert requests.get(url + "/health", timeout=10).json()["status"] == "ok"
        holder = hold_lock(str(store_dir))
        t0 = time.monotonic()
        r = requests.get(url + "/flush_cache", timeout=30)     # write-back waits on puts
        assert r.status_code == 200
        assert generate(url, other)["output_ids"] == want_b     # puts stall behind the lock
        assert generate(url, PROMPT)["output_ids"] == want_a
        assert requests.get(url + "/flush_cache", timeout=30).status_code == 200
        assert time.monotonic() - t0 < 30
        h = requests.get(url + "/health", timeout=10).json()
        assert h["status"] == "degraded" and "did not return within" in h["reason"], h
        m = metrics(url)
        assert any(k.startswith("hicache_l3_degraded{") and v == 1 for k, v in m.items()), m
        assert m["hicache_l3_abandoned_calls_total"] >= 1
        t1 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)
        assert time.monotonic() - t1 < 30
        assert proc.returncode is not None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if holder is not None:
            holder.kill()
            holder.wait()


def test_fifo_in_the_store_on_restart_is_a_miss(tmp_path):
    """The reported case: an object replaced by a FIFO, the server restarted on the store."""
    want = uncached_ids(PROMPT)
    cfg = ServerConfig(port=0, l1_tokens=1024, l2_tokens=2048, hicache_storage_backend="file",
                       hicache_storage_dir=str(tmp_path),
                       hicache_storage_prefetch_policy="wait_complete")
    with start_server(cfg) as s:
        assert generate(s.url)["output_ids"] == want
    objs = sorted(str(p) for p in (tmp_path / "objects").rglob("*") if p.is_file())
    assert objs
    for p in objs:                 # every object: whichever the prompt reads first
        os.unlink(p)
        os.mkfifo(p)
    with start_server(cfg) as s:
        out = generate(s.url)
        assert out["output_ids"] == want
        assert out["meta_info"]["cached_tokens"] == 0
        assert requests.get(s.url + "/flush_cache", timeout=30).status_code == 200
        assert requests.get(s.url + "/health", timeout=10).json()["status"] == "ok"
        assert metrics(s.url)['hicache_l3_pages_total{outcome="corrupt"}'] >= 1


@pytest.mark.mooncake
def test_stopped_mooncake_master_never_stalls_the_server(tmp_path):
    """A master that stops answering mid-run (SIGSTOP): requests, /flush_cache and SIGTERM
    finish, outputs stay right, /health says degraded while a call is stuck."""
    want = uncached_ids(PROMPT)
    m = MooncakeMaster(tmp_path / "m").start()
    conf = tmp_path / "l3.json"
    conf.write_text(json.dumps({"backend": "mooncake", "deadline_s": 0.5, "mooncake": {
        "master_server_address": f"127.0.0.1:{m.rpc_port}",
        "metadata_server": f"http://127.0.0.1:{m.http_port}/metadata",
        "global_segment_size": "128mb", "local_buffer_size": "64mb",
        "staging_bytes": "8mb"}}))
    proc, url = cli_server("--l1-tokens", "1024", "--l2-tokens", "2048",
                           "--hicache-storage-backend-config", str(conf),
                           "--hicache-storage-prefetch-policy", "wait_complete")
    try:
        assert generate(url)["output_ids"] == want
        os.kill(m.proc.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        assert requests.get(url + "/flush_cache", timeout=60).status_code == 200
        assert generate(url)["output_ids"] == want       # L2/L3 gone: from the store or computed
        assert requests.get(url + "/flush_cache", timeout=60).status_code == 200
        assert generate(url)["output_ids"] == want
        assert time.monotonic() - t0 < 60
        assert requests.get(url + "/health", timeout=10).status_code == 200
        t1 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
        assert time.monotonic() - t1 < 60
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.kill(m.proc.pid, signal.SIGCONT)
        m.stop()
