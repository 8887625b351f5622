"""``bench serve --disaggregation pd`` over HTTP: meta_info.pd_transfer and /metrics (the
missing-only audit), and faults — the prefill worker dying mid-transfer, a transfer timing out:
the request fails cleanly, the decode worker's cache holds no stray lock or page, the front end
stays up and /health names the prefill worker."""

from __future__ import annotations

import time

import pytest
import requests

from checkers.invariants import check_cache
from engine.runtime.launch import ServerConfig, start_server
from tests.test_pd import PS, reference, toks

GREEDY = {"max_new_tokens": 8, "ignore_eos": True, "temperature": 0}


def start(**kw):
    base = dict(model="tiny", port=0, page_size=PS, l1_tokens=4096, l2_tokens=8192,
                chunked_prefill_size=128, disaggregation="pd", pd_transfer_timeout=60.0)
    base.update(kw)
    return start_server(ServerConfig(**base))


def generate(h, ids):
    return requests.post(h.url + "/generate", json={"input_ids": ids, "sampling_params": GREEDY},
                         timeout=120)


def metric(text, name, labels=""):
    for line in text.splitlines():
        if line.startswith(name + labels + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{name}{labels} not in /metrics")


def clean(h):
    """The decode cache once idle: no locks, every page accounted for."""
    eng = h.engine
    deadline = time.monotonic() + 20
    while not eng.scheduler.call(eng.scheduler.idle).result(30):
        assert time.monotonic() < deadline, "decode worker did not become idle"
        time.sleep(0.05)
    return eng.scheduler.call(lambda: check_cache(eng.cache, idle=True)).result(30)


def test_pd_transfer_in_meta_info_and_metrics():
    with start() as h:
        first = toks(200, 11)
        r1 = generate(h, first)
        assert r1.status_code == 200, r1.text
        t1 = r1.json()["meta_info"]["pd_transfer"]
        assert t1 == {"decode_device": 0, "decode_host": 0, "decode_storage": 0,
                      "transferred": 199, "bytes": t1["bytes"], "redundant_bytes": 0,
                      "prefill_cached": 0}
        second = first + r1.json()["output_ids"] + toks(60, 12)
        r2 = generate(h, second)
        t2 = r2.json()["meta_info"]["pd_transfer"]
        assert t2["decode_device"] == (len(first) + 7) // PS * PS
        assert t2["transferred"] == len(second) - 1 - t2["decode_device"]
        assert r2.json()["output_ids"] == reference(second)
        text = requests.get(h.url + "/metrics", timeout=30).text
        assert metric(text, "hicache_pd_redundant_bytes_total") == 0
        assert metric(text, "hicache_pd_transfer_bytes_total") == t1["bytes"] + t2["bytes"]
        assert metric(text, "hicache_pd_prompt_tokens_total", '{source="transferred"}') == \
            t1["transferred"] + t2["transferred"]
        assert metric(text, "hicache_pd_link_up") == 1
        assert requests.get(h.url + "/health", timeout=30).status_code == 200
        assert clean(h) == []


def test_prefill_worker_dies_mid_transfer():
    with start(pd_inject_fault="die-after-layers:1") as h:
        r = generate(h, toks(300, 21))
        assert r.status_code == 503
        assert "prefill worker down" in r.json()["error"]["message"]
        assert clean(h) == []
        assert h.engine.cache.stats()["l1_used_tokens"] == 0   # the own pages went back
        health = requests.get(h.url + "/health", timeout=30)
        assert health.status_code == 503
        assert "prefill worker down" in health.json()["error"]["message"]
        again = generate(h, toks(50, 22))                # fails fast, the front end answers
        assert again.status_code == 503 and "prefill worker down" in again.text
        text = requests.get(h.url + "/metrics", timeout=30).text
        assert metric(text, "hicache_pd_link_up") == 0
        assert metric(text, "hicache_pd_failed_transfers_total") >= 1


def test_transfer_timeout_fails_the_request_and_the_link_recovers():
    with start(pd_inject_fault="delay:4", pd_transfer_timeout=1.0) as h:
        prompt = toks(120, 31)
        r = generate(h, prompt)
        assert r.status_code == 500 and "timed out" in r.json()["error"]["message"]
        assert clean(h) == []
        pd = h.engine.pd
        deadline = time.monotonic() + 30                  # the late reply is drained, unused
        while pd._pending:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert requests.get(h.url + "/health", timeout=30).status_code == 200
        ok = generate(h, prompt)
        assert ok.status_code == 200, ok.text
        assert ok.json()["output_ids"] == reference(prompt)
        assert clean(h) == []


@pytest.mark.parametrize("bad,msg", [({"disaggregation": "both"}, "--disaggregation"),
                                     ({"disaggregation": "decode"}, "--pd-addr"),
                                     ({"pd_addr": "nohost"}, "--pd-addr"),
                                     ({"pd_transfer_timeout": 0}, "--pd-transfer-timeout"),
                                     ({"pd_inject_fault": "boom:1"}, "--pd-inject-fault")])
def test_bad_options_are_usage_errors(bad, msg):
    with pytest.raises(ValueError, match=msg):
        ServerConfig(**{"disaggregation": "pd", **bad})



def test_prefill_and_decode_roles_as_separate_commands(tmp_path, monkeypatch):
    """The multi-host shape: ``bench serve --disaggregation prefill`` in its own process, a
    decode server linking to it by address; both with the same HICACHE_RANK_SECRET."""
    import os
    import subprocess
    import sys

    from engine.parallel.launch import free_port

    port = free_port()
    secret = "pd-test-secret-" + "y" * 20
    monkeypatch.setenv("HICACHE_RANK_SECRET", secret)
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    pre = subprocess.Popen([sys.executable, "-m", "hicache_cli.app", "bench", "serve",
                            "--disaggregation", "prefill", "--pd-addr", f"127.0.0.1:{port}",
                            "--l1-tokens", "4096", "--l2-tokens", "8192",
                            "--chunked-prefill-size", "128"],
                           env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with start(disaggregation="decode", pd_addr=f"127.0.0.1:{port}") as h:
            prompt = toks(90, 41)
            r = generate(h, prompt)
            assert r.status_code == 200, r.text
            assert r.json()["meta_info"]["pd_transfer"]["transferred"] == 89
            assert r.json()["output_ids"] == reference(prompt)
        assert pre.wait(30) == 0          # the decode side's stop ends the prefill worker
    finally:
        if pre.poll() is None:
            pre.kill()


def test_cli_usage_errors(monkeypatch):
    from typer.testing import CliRunner

    from hicache_cli.app import app

    monkeypatch.delenv("HICACHE_RANK_SECRET", raising=False)
    r = CliRunner().invoke(app, ["bench", "serve", "--disaggregation", "prefill",
                                 "--pd-addr", "127.0.0.1:5999"])
    assert r.exit_code == 2 and "HICACHE_RANK_SECRET" in r.output
    r = CliRunner().invoke(app, ["bench", "serve", "--disaggregation", "pd",
                                 "--pd-link-timeout", "0"])
    assert r.exit_code == 2 and "--pd-link-timeout" in r.output

    r = CliRunner().invoke(app, ["bench", "serve", "--disaggregation", "decode"])
    assert r.exit_code == 2 and "--pd-addr" in r.output
    r = CliRunner().invoke(app, ["bench", "serve", "--disaggregation", "pd",
                                 "--pd-decode-reuse", "maybe"])
    assert r.exit_code == 2 and "--pd-decode-reuse" in r.output


def test_concurrent_requests_match_the_plain_engine():
    """Several prompts in flight at once (transfers interleaved with other requests' decode
    steps, shared prefixes hit on decode): every output equals the non-disaggregated one."""
    import concurrent.futures

    base = toks(150, 61)
    prompts = [base + toks(40 + 17 * i, 62 + i) for i in range(5)] + [toks(90, 70)]
    with start(max_running_requests=8) as h:
        generate(h, base)                                  # a shared prefix on the decode L1
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            resps = list(pool.map(lambda p: generate(h, p), prompts))
        assert [r.status_code for r in resps] == [200] * len(prompts)
        metas = [r.json()["meta_info"]["pd_transfer"] for r in resps]
        assert all(m["decode_device"] >= 144 for m in metas[:5])
        assert all(m["redundant_bytes"] == 0 for m in metas)
        assert clean(h) == []
    for p, r in zip(prompts, resps):
        assert r.json()["output_ids"] == reference(p)



def test_request_aborted_while_its_kv_is_on_the_way():
    """A client that leaves before the KV arrives: the request's pages are freed at once and
    the late pages are dropped, never written into pages the cache has given to another
    prefix meanwhile (that prefix is reused afterwards: its output would differ)."""
    from engine.runtime.scheduler import SamplingParams

    with start(pd_inject_fault="delay:3") as h:
        eng = h.engine
        rid = eng.scheduler.submit(toks(400, 91), SamplingParams(max_new_tokens=4,
                                                                 ignore_eos=True))
        time.sleep(0.5)                                   # admitted, waiting on the link
        eng.scheduler.abort(rid)
        assert clean(h) == []
        assert eng.cache.stats()["l1_used_tokens"] == 0
        other = toks(400, 92)                             # computed on decode, into the freed
        remote, eng.scheduler.remote = eng.scheduler.remote, None      # pages
        try:
            eng.scheduler.generate(other, SamplingParams(max_new_tokens=1, ignore_eos=True))
        finally:
            eng.scheduler.remote = remote
        deadline = time.monotonic() + 30                  # the late reply arrives, dropped
        while eng.pd._pending:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        more = other + toks(30, 93)
        r = generate(h, more)
        assert r.status_code == 200, r.text
        assert r.json()["meta_info"]["pd_transfer"]["decode_device"] == 400
        assert r.json()["output_ids"] == reference(more)
        assert clean(h) == []
