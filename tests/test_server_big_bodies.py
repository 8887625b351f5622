"""Large request bodies: the declared length is checked before anything is read, a large body
is parsed on a worker thread (under one of a few slots), and prompt text longer than the
context could hold is refused before it is tokenized. So /health keeps answering while several
clients upload tens of MiB each, and a huge chat body costs a few times its size, not 19x."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import requests

from engine.runtime.launch import ServerConfig, start_server
from engine.runtime.serving.protocol import MAX_BODY_BYTES


@pytest.fixture(scope="module")
def server():
    with start_server(ServerConfig(port=0, l1_tokens=1024, l2_tokens=0)) as s:
        yield s


def _rss_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise AssertionError(field)


def test_health_answers_while_big_input_ids_bodies_are_parsed(server):
    body = b'{"input_ids": [' + b"7," * (8 << 20) + b'7], "sampling_params": {"max_new_tokens": 1}}'
    codes: list[int] = []

    def send() -> None:
        r = requests.post(server.url + "/generate", data=body, timeout=300,
                          headers={"Content-Type": "application/json"})
        codes.append(r.status_code)

    senders = [threading.Thread(target=send) for _ in range(3)]
    for t in senders:
        t.start()
    time.sleep(1.0)                     # the uploads are in; their parsing has begun
    worst = 0.0
    while any(t.is_alive() for t in senders):
        t0 = time.monotonic()
        assert requests.get(server.url + "/health", timeout=60).status_code == 200
        worst = max(worst, time.monotonic() - t0)
        time.sleep(0.2)
    for t in senders:
        t.join()
    assert codes == [400] * 3           # past the context: refused, after a parse off the loop
    assert worst < 2.0, f"/health took {worst:.1f} s while bodies were parsed"


def test_a_huge_chat_body_costs_a_few_times_its_size(server):
    size = 40 << 20
    body = b'{"messages": [{"role": "user", "content": "' + b"a" * size + b'"}]}'
    open("/proc/self/clear_refs", "w").write("5")     # VmHWM := current RSS
    before = _rss_mib("VmRSS")
    r = requests.post(server.url + "/v1/chat/completions", data=body, timeout=300,
                      headers={"Content-Type": "application/json"})
    grown = _rss_mib("VmHWM") - before
    # the client's copy of the body and the server's raw bytes, text and rendered prompt
    assert grown < 6 * (size >> 20), f"RSS grew {grown:.0f} MiB for a {size >> 20} MiB body"
    assert r.status_code == 400 and "cannot fit the model's context" in r.text, r.text[:300]


def test_declared_length_past_the_limit_is_refused_before_reading(server):
    host, port = server.url.split("//")[1].split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: " + str(MAX_BODY_BYTES + 1).encode() + b"\r\n\r\n{")
        reply = s.recv(4096)
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
    r = requests.post(server.url + "/generate", json={"text": "ok", "sampling_params":
                                                       {"max_new_tokens": 1}}, timeout=60)
    assert r.status_code == 200
