"""The server with an L3 store: sharing across server processes, corruption, store faults.

Every check compares greedy output with the uncached output of the same prompt: a wrong restore
would show up as different tokens.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import requests

from engine.runtime.launch import ServerConfig, start_server
from tests.mooncake_master import MooncakeMaster, free_port

PROMPT = "Hierarchical caches keep the history of long agentic sessions close at hand. " * 4
BASE = dict(port=0, l1_tokens=1024, l2_tokens=2048, page_size=16)


def generate(url: str, text: str = PROMPT, n: int = 10) -> dict:
    r = requests.post(url + "/generate", json={"text": text, "sampling_params": {
        "max_new_tokens": n, "temperature": 0}}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def metrics(url: str) -> dict[str, float]:
    out = {}
    for line in requests.get(url + "/metrics", timeout=30).text.splitlines():
        if line and not line.startswith("#"):
            k, v = line.rsplit(" ", 1)
            out[k] = float(v)
    return out


@pytest.fixture(scope="module")
def uncached():
    with start_server(ServerConfig(port=0, l1_tokens=2048, l2_tokens=0,
                                   disable_radix_cache=True)) as s:
        return generate(s.url)["output_ids"]


def cli_server(*args: str) -> tuple[subprocess.Popen, str]:
    """`hicache bench serve` in its own process; returns it and its URL."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "hicache_cli.app", "bench", "serve",
                             "--port", "0", "--format", "json", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    line = proc.stdout.readline()
    if not line:
        proc.kill()
        raise AssertionError(proc.stderr.read())
    return proc, json.loads(line)["url"]


def stop(proc: subprocess.Popen) -> str:
    proc.terminate()
    _, err = proc.communicate(timeout=60)
    return err


def test_second_server_process_hits_l3_and_outputs_equal(tmp_path, uncached):
    cfg = ServerConfig(**BASE, hicache_storage_backend="file",
                       hicache_storage_dir=str(tmp_path),
                       hicache_storage_prefetch_policy="wait_complete")
    with start_server(cfg) as a:
        first = generate(a.url)
        assert first["meta_info"]["cached_tokens"] == 0
    assert first["output_ids"] == uncached
    proc, url = cli_server("--l1-tokens", "1024", "--l2-tokens", "2048",
                           "--hicache-storage-backend", "file", "--hicache-storage-dir",
                           str(tmp_path), "--hicache-storage-prefetch-policy", "wait_complete")
    try:
        second = generate(url)
        m = metrics(url)
    finally:
        stop(proc)
    details = second["meta_info"]["cached_tokens_details"]
    assert details["storage"] > 0 and details["device"] == 0 and details["host"] == 0
    assert second["output_ids"] == uncached
    assert m['hicache_l3_pages_total{outcome="hits"}'] > 0


def test_corrupt_objects_are_misses_and_output_is_unchanged(tmp_path, uncached):
    cfg = ServerConfig(**BASE, hicache_storage_backend="file",
                       hicache_storage_dir=str(tmp_path),
                       hicache_storage_prefetch_policy="wait_complete")
    with start_server(cfg) as a:
        generate(a.url)
    files = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path) for f in fs
             if "quarantine" not in d and not f.startswith(".")]
    objects = [f for f in files if os.path.getsize(f) > 1000]
    assert objects
    for i, path in enumerate(sorted(objects)):
        raw = bytearray(open(path, "rb").read())
        if i % 2:
            raw[len(raw) // 2] ^= 0x5A             # flip a byte of the payload
        else:
            raw = raw[:len(raw) - 100]             # cut the file
        open(path, "wb").write(bytes(raw))
    with start_server(cfg) as b:
        out = generate(b.url)
        m = metrics(b.url)
    assert out["output_ids"] == uncached
    assert out["meta_info"]["cached_tokens_details"]["storage"] == 0
    assert m['hicache_l3_pages_total{outcome="corrupt"}'] >= 1


def test_unreachable_store_at_start_serves_with_l3_off(tmp_path, uncached):
    port = free_port()
    conf = tmp_path / "mooncake.json"
    conf.write_text(json.dumps({"backend": "mooncake", "mooncake": {
        "master_server_address": f"127.0.0.1:{port}",
        "metadata_server": f"http://127.0.0.1:{port}/metadata",
        "connect_timeout_s": 0.5}}))
    proc, url = cli_server("--l1-tokens", "1024", "--l2-tokens", "2048",
                           "--hicache-storage-backend-config", str(conf))
    try:
        out = generate(url)
        m = metrics(url)
    finally:
        err = stop(proc)
    assert out["output_ids"] == uncached
    enabled = [k for k in m if k.startswith("hicache_l3_enabled")]
    assert enabled and m[enabled[0]] == 0 and "unavailable" in enabled[0]
    assert "L3 off" in err or "unavailable" in err


@pytest.mark.mooncake
def test_mooncake_store_shared_and_survives_master_death(tmp_path, uncached):
    master = MooncakeMaster(tmp_path / "master").start()
    conf = tmp_path / "mooncake.json"
    conf.write_text(json.dumps({"backend": "mooncake", "mooncake": {
        **{k: v for k, v in master.config_dict().items() if k != "device_name"},
        "global_segment_size": "64mb", "local_buffer_size": "32mb"}}))
    common = dict(**BASE, hicache_storage_backend_config=str(conf),
                  hicache_storage_prefetch_policy="wait_complete")
    try:
        a = start_server(ServerConfig(**common))
        try:
            assert generate(a.url)["output_ids"] == uncached
            time.sleep(0.5)                     # write-through reaches the store
            with start_server(ServerConfig(**common)) as b:   # cold L1/L2, same store
                second = generate(b.url)
                assert second["output_ids"] == uncached
                assert second["meta_info"]["cached_tokens_details"]["storage"] > 0
                master.stop()                   # the store dies mid-run
                other = generate(b.url, text=PROMPT[::-1])
                # nothing from the dead store; only the BOS both prompts start with, whose KV
                # admission copies from the page of PROMPT in L1 (partial last-page reuse)
                assert other["meta_info"]["cached_tokens_details"] == \
                    {"device": 1, "host": 0, "storage": 0}
                assert generate(b.url)["output_ids"] == uncached
                master.start()                  # back on the same ports, before shutdown
        finally:
            a.stop()
    finally:
        if master.proc is None:
            master.start()
        master.stop()


def test_file_store_path_that_is_a_file_is_a_configuration_error(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    with pytest.raises(Exception, match="L3 file store"):
        start_server(ServerConfig(**BASE, hicache_storage_backend="file",
                                  hicache_storage_dir=str(blocker)))
