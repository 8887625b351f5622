"""The HTTP server, in-process: OpenAI client, SSE streaming, metrics, bad input, disconnects,
a short concurrent load."""

from __future__ import annotations

import concurrent.futures
import json
import socket
import time
import urllib.parse

import numpy as np
import openai
import pytest
import requests

from checkers.invariants import check_cache
from engine.runtime.launch import ServerConfig, start_server
from engine.snapshot.take import load_snapshot


@pytest.fixture(scope="module")
def server():
    h = start_server(ServerConfig(port=0, l1_tokens=4096, l2_tokens=16384,
                                  chunked_prefill_size=256, max_running_requests=16))
    yield h
    h.stop()


def post(server, path, body, **kw):
    return requests.post(server.url + path, json=body, timeout=60, **kw)


def on_sched(server, fn):
    return server.engine.scheduler.call(fn).result(30)


def cache_stats(server):
    return on_sched(server, server.engine.cache.stats)


def wait_idle(server, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if on_sched(server, server.engine.scheduler.idle):
            return
        time.sleep(0.02)
    raise AssertionError("server did not become idle")


def metric(text, name, labels=""):
    for line in text.splitlines():
        if line.startswith(name + labels + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{name}{labels} not in /metrics")


def test_openai_client_reports_cached_tokens(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    prompt = "Tell me about hierarchical KV caches. " * 8
    a = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0)
    b = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0)
    assert a.choices[0].finish_reason == "length" and a.usage.completion_tokens == 8
    assert a.usage.prompt_tokens == len(prompt.encode()) + 1          # bytes + BOS
    assert b.choices[0].text == a.choices[0].text
    assert b.usage.prompt_tokens_details.cached_tokens > 0
    assert b.usage.prompt_tokens_details.cached_tokens % 16 == 0
    # token-id prompts and several prompts at once
    c = client.completions.create(model="tiny", prompt=[[256, 1, 2, 3], [256, 4, 5]],
                                  max_tokens=3, temperature=0)
    assert [ch.index for ch in c.choices] == [0, 1] and c.usage.prompt_tokens == 7


def test_openai_streaming_matches_non_streaming(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    kw = dict(model="tiny", prompt="stream me", max_tokens=10, temperature=0)
    whole = client.completions.create(**kw).choices[0].text
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True},
                                            **kw))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10


def test_generate_sse_stream(server):
    body = {"text": "Once upon a time", "stream": True,
            "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
    plain = post(server, "/generate", {**body, "stream": False}).json()
    with post(server, "/generate", body, stream=True) as r:
        assert r.status_code == 200 and r.headers["Content-Type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines(decode_unicode=True) if ln]
    assert all(ln.startswith("data: ") for ln in lines) and lines[-1] == "data: [DONE]"
    events = [json.loads(ln[6:]) for ln in lines[:-1]]
    assert len(events) == 6
    assert [len(e["output_ids"]) for e in events] == [1, 2, 3, 4, 5, 6]    # cumulative
    last = events[-1]
    assert last["output_ids"] == plain["output_ids"] and last["text"] == plain["text"]
    assert last["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
    assert events[0]["meta_info"]["finish_reason"] is None
    meta = plain["meta_info"]
    for key in ("prompt_tokens", "completion_tokens", "cached_tokens", "ttft", "e2e_latency",
                "queue_time"):
        assert key in meta
    assert set(meta["cached_tokens_details"]) == {"device", "host", "storage"}
    assert 0 <= meta["queue_time"] <= meta["ttft"] <= meta["e2e_latency"]


def test_metrics_present_and_moving(server):
    before = requests.get(server.url + "/metrics", timeout=10).text
    ids = [256] + list(range(100, 200))
    for _ in range(2):
        r = post(server, "/generate", {"input_ids": ids,
                                       "sampling_params": {"max_new_tokens": 4,
                                                           "temperature": 0}})
        assert r.status_code == 200
    after = requests.get(server.url + "/metrics", timeout=10).text
    for name in ("hicache_cache_hit_tokens_total", "hicache_evicted_pages_total",
                 "hicache_load_back_pages_total", "hicache_pool_used_tokens",
                 "hicache_queue_time_seconds_bucket", "hicache_ttft_seconds_bucket"):
        assert f"# TYPE {name.removesuffix('_bucket')}" in after
    assert metric(after, "hicache_ttft_seconds_count") == \
        metric(before, "hicache_ttft_seconds_count") + 2
    hit = 'hicache_cache_hit_tokens_total'
    assert metric(after, hit, '{tier="device"}') >= metric(before, hit, '{tier="device"}') + 96
    assert metric(after, "hicache_prompt_tokens_total") == \
        metric(before, "hicache_prompt_tokens_total") + 202
    assert metric(after, "hicache_pool_capacity_tokens", '{tier="host"}') == 16384


BAD_GENERATE = [
    b"{not json",
    b"[1, 2]",
    b"\xff\xfe",
    json.dumps({}).encode(),
    json.dumps({"text": "a", "input_ids": [1]}).encode(),
    json.dumps({"text": 5}).encode(),
    json.dumps({"text": []}).encode(),
    json.dumps({"text": ["a", 5]}).encode(),
    json.dumps({"input_ids": [[1, 2], [1, 300]]}).encode(),
    json.dumps({"text": "a", "sampling_params": {"n": 0}}).encode(),
    json.dumps({"text": "a", "sampling_params": {"regex": "a+"}}).encode(),
    json.dumps({"text": "a", "sampling_params": {"stop": 5}}).encode(),
    json.dumps({"text": "a", "top_logprobs_num": 50}).encode(),
    json.dumps({"input_ids": [1, "a"]}).encode(),
    json.dumps({"input_ids": []}).encode(),
    json.dumps({"input_ids": [1, 300]}).encode(),
    json.dumps({"input_ids": [1, -5]}).encode(),
    json.dumps({"input_ids": [1, 2 ** 70]}).encode(),
    json.dumps({"text": "a", "sampling_params": "greedy"}).encode(),
    json.dumps({"text": "a", "sampling_params": {"max_new_tokens": "5"}}).encode(),
    json.dumps({"text": "a", "sampling_params": {"max_new_tokens": 1.5}}).encode(),
    json.dumps({"text": "a", "sampling_params": {"max_new_tokens": -1}}).encode(),
    json.dumps({"text": "a", "sampling_params": {"temperature": "hot"}}).encode(),
    json.dumps({"text": "a", "sampling_params": {"temperature": -1}}).encode(),
    json.dumps({"text": "a", "sampling_params": {"top_p": 0}}).encode(),
    json.dumps({"text": "a", "sampling_params": {"temperature": 1, "seed": 2 ** 70}}).encode(),
    json.dumps({"text": "a", "priority": 2 ** 63}).encode(),
    json.dumps({"text": "a", "stream": "yes"}).encode(),
    json.dumps({"text": "a" * 17000}).encode(),                      # beyond the context
    json.dumps({"input_ids": [1] * 100, "sampling_params": {"max_new_tokens": 16300}}).encode(),
]

BAD_COMPLETIONS = [
    {"model": "tiny"},
    {"prompt": {"a": 1}},
    {"prompt": "x", "max_tokens": -1},
    {"prompt": "x", "max_tokens": "ten"},
    {"prompt": "x", "n": 0},
    {"prompt": "x", "n": 2, "best_of": 3},
    {"prompt": "x", "temperature": 3},
    {"prompt": "x", "echo": "yes"},
    {"prompt": "x", "stop": [1]},
    {"prompt": "x", "logprobs": 99},
    {"prompt": "x", "logit_bias": {"1": 5}},
    {"prompt": "x", "presence_penalty": 3},
    {"prompt": "x", "suffix": "tail"},
    {"prompt": [1, 2, 999]},
    {"prompt": "x", "stream_options": {"include_usage": "yes"}},
    {"prompt": "x", "temperature": 1, "seed": -2 ** 64},
    {"prompt": "x", "priority": -2 ** 63 - 1},
]


def test_bad_requests_get_400_and_the_server_keeps_serving(server):
    for raw in BAD_GENERATE:
        r = requests.post(server.url + "/generate", data=raw, timeout=30,
                          headers={"Content-Type": "application/json"})
        assert r.status_code == 400, (raw[:80], r.status_code, r.text)
        err = r.json()["error"]
        assert err["code"] == 400 and err["message"]
    for body in BAD_COMPLETIONS:
        r = post(server, "/v1/completions", body)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["type"] == "invalid_request_error"
    assert requests.get(server.url + "/generate", timeout=10).status_code == 405
    assert requests.get(server.url + "/health", timeout=10).status_code == 200
    r = post(server, "/generate", {"text": "still alive", "sampling_params": {
        "max_new_tokens": 2}})
    assert r.status_code == 200 and len(r.json()["output_ids"]) == 2
    assert on_sched(server, lambda: check_cache(server.engine.cache, idle=True)) == []


EXTREME_SAMPLING = [{"temperature": 1e-300}, {"temperature": 1e308},
                    {"temperature": 1, "top_p": 1e-300}, {"temperature": 1, "top_k": 2 ** 70},
                    {"temperature": 1, "seed": 2 ** 64 - 1}]


def test_extreme_sampling_values_are_served_and_spare_the_batch(server):
    """Legal but extreme sampling values (denormal temperature or top_p, a huge temperature or
    top_k) are served: before, one of them raised in the sampler and failed every request
    sharing its scheduler step with 500."""
    prompt = [256] + list(range(40))
    greedy = post(server, "/generate", {"input_ids": prompt, "sampling_params": {
        "max_new_tokens": 4, "temperature": 0}}).json()["output_ids"]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        bystander = pool.submit(post, server, "/generate", {
            "input_ids": [256] + list(range(100, 140)),
            "sampling_params": {"max_new_tokens": 48, "temperature": 0, "ignore_eos": True}})
        _wait_running(server)
        for sp in EXTREME_SAMPLING:
            r = post(server, "/generate", {"input_ids": prompt, "sampling_params": {
                "max_new_tokens": 4, "ignore_eos": True, **sp}})
            assert r.status_code == 200, (sp, r.text)
            out = r.json()["output_ids"]
            # bytes, or EOS (ignore_eos: it may be sampled); never BOS, PAD or SEP (banned)
            assert len(out) == 4 and all(0 <= t < 256 or t == 257 for t in out), (sp, out)
            if sp["temperature"] < 1e-6:
                assert out == greedy          # a vanishing temperature is greedy
        r = bystander.result(60)
    assert r.status_code == 200 and len(r.json()["output_ids"]) == 48, r.text


def _send_raw(url: str, body: dict) -> socket.socket:
    u = urllib.parse.urlsplit(url)
    sock = socket.create_connection((u.hostname, u.port), timeout=30)
    data = json.dumps(body).encode()
    sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)
    return sock


def _wait_running(server, n: int = 1, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while on_sched(server, server.engine.scheduler.num_running) < n:
        assert time.monotonic() < deadline, "request never started"
        time.sleep(0.01)


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_releases_everything(server, stream):
    """A client that goes away mid-request (streaming or not): the request is aborted, its
    pages and locks are released, the pools are back at their baseline."""
    post(server, "/flush_cache", {})
    base = cache_stats(server)
    sock = _send_raw(server.url, {"input_ids": [256] + list(range(250)), "stream": stream,
                                  "sampling_params": {"max_new_tokens": 3000,
                                                      "temperature": 0, "ignore_eos": True}})
    if stream:
        buf = sock.recv(65536)
        assert b" 200 " in buf.split(b"\r\n", 1)[0], buf[:500]
        while buf.count(b"data: ") < 2:          # two token events have arrived
            chunk = sock.recv(65536)
            assert chunk, "server closed the stream"
            buf += chunk
    _wait_running(server)
    aborted_before = metric(requests.get(server.url + "/metrics", timeout=10).text,
                            "hicache_requests_total", '{reason="abort"}')
    sock.close()
    wait_idle(server)
    after = cache_stats(server)
    assert after["l1_used_tokens"] == base["l1_used_tokens"]
    assert after["l1_locked_tokens"] == 0
    text = requests.get(server.url + "/metrics", timeout=10).text
    assert metric(text, "hicache_requests_total", '{reason="abort"}') == aborted_before + 1
    assert on_sched(server, lambda: check_cache(server.engine.cache, idle=True)) == []


def test_short_concurrent_load_has_no_5xx_and_flush_restores_the_pools():
    """16 clients x 3 requests on a small L1 (evictions, L2 load-backs under load): no 5xx, the
    sampled greedy outputs equal a fresh computation, invariants hold, and /flush_cache
    returns the pools to their starting usage."""
    h = start_server(ServerConfig(port=0, l1_tokens=2048, l2_tokens=16384,
                                  chunked_prefill_size=256, max_running_requests=8))
    try:
        start = cache_stats(h)
        rng = np.random.default_rng(0)
        systems = [rng.integers(0, 256, 200).tolist() for _ in range(3)]
        rounds = 3          # per client: a count, not a time, so a slow machine sends as many

        def client(i: int) -> list[tuple[int, list, list, dict]]:
            done = []
            r = np.random.default_rng(100 + i)
            history = [256] + systems[i % 3]
            for _ in range(rounds):
                history = history + r.integers(0, 256, int(r.integers(20, 150))).tolist()
                stream = bool(i % 2)
                body = {"input_ids": history, "stream": stream,
                        "sampling_params": {"max_new_tokens": int(r.integers(1, 12)),
                                            "temperature": 0, "ignore_eos": True}}
                resp = post(h, "/generate", body, stream=stream)
                out, meta = [], {}
                if resp.status_code == 200:
                    if stream:
                        last = [ln for ln in resp.iter_lines(decode_unicode=True) if ln][-2]
                        res = json.loads(last[6:])
                    else:
                        res = resp.json()
                    out, meta = res["output_ids"], res["meta_info"]
                done.append((resp.status_code, history, out, meta))
                history = history + out
                if len(history) > 1200:
                    history = [256] + systems[i % 3]
            return done

        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            results = [x for xs in pool.map(client, range(16)) for x in xs]
        codes = [c for c, *_ in results]
        assert len(codes) == 16 * rounds and all(c == 200 for c in codes), sorted(set(codes))
        wait_idle(h)
        stats = cache_stats(h)
        assert stats["evicted_l1_pages"] > 0 and stats["hit_l1_tokens"] > 0
        assert on_sched(h, lambda: check_cache(h.engine.cache, idle=True)) == []
        # spot-check outputs against a fresh, cache-less computation
        from engine.cache.facade import CacheConfig, HiCache
        from engine.runtime.scheduler import SamplingParams, Scheduler, SchedulerConfig

        ref = Scheduler(h.engine.model, HiCache(CacheConfig(
            page_size=16, l1_tokens=2048, layout=h.engine.model.kv_layout(16))),
            SchedulerConfig(disable_radix_cache=True, chunked_prefill_size=2048))
        host_hits = [x for x in results if x[3]["cached_tokens_details"]["host"] > 0]
        assert host_hits, "no request was served from L2"
        sample = host_hits[:3] + sorted(results, key=lambda x: -x[3]["cached_tokens"])[:3]
        for _, prompt, out, _ in sample:
            want = ref.generate(prompt, SamplingParams(max_new_tokens=len(out),
                                                       ignore_eos=True))[0]
            assert out == want
        r = post(h, "/flush_cache", {})
        assert r.status_code == 200
        end = cache_stats(h)
        assert (end["l1_used_tokens"], end["l2_used_tokens"]) == \
            (start["l1_used_tokens"], start["l2_used_tokens"]) == (0, 0)
    finally:
        h.stop()


def test_extreme_priorities_still_snapshot(server, tmp_path):
    """Priorities live in the tree and its msgpack snapshot: the 64-bit extremes are stored
    (a larger one is refused with 400 above; it used to make /dump_tree and
    --dump-tree-on-exit fail with OverflowError)."""
    for i, prio in enumerate((2 ** 63 - 1, -2 ** 63)):
        r = post(server, "/generate", {"input_ids": [256] + [i + 1] * 40, "priority": prio,
                                       "sampling_params": {"max_new_tokens": 1}})
        assert r.status_code == 200, r.text
    r = requests.post(server.url + "/dump_tree", timeout=30)
    assert r.status_code == 200, r.text
    (tmp_path / "t.snapshot").write_bytes(r.content)
    load_snapshot(tmp_path / "t.snapshot")


def test_dump_tree_and_server_info(server, tmp_path):
    post(server, "/generate", {"input_ids": [256] + list(range(64)),
                               "sampling_params": {"max_new_tokens": 1}})
    r = requests.post(server.url + "/dump_tree", timeout=30)
    assert r.status_code == 200
    path = tmp_path / "tree.snapshot"
    path.write_bytes(r.content)
    snap = load_snapshot(path)
    assert snap.header["page_size"] == 16
    info = requests.get(server.url + "/get_server_info", timeout=10).json()
    assert info["model"] == "tiny" and info["l2_tokens"] == 16384 and info["exact_kernels"]
    models = requests.get(server.url + "/v1/models", timeout=10).json()
    assert models["data"][0]["id"] == "tiny"
