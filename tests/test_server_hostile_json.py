"""Malformed JSON bodies (a lone surrogate, 100k-deep nesting, a 5,000-digit integer, NaN) on
/generate and /v1/completions: 400 invalid_request_error, nothing logged as an error, and the
server keeps serving."""

from __future__ import annotations

import logging

import pytest
import requests

from engine.runtime.launch import ServerConfig, start_server

DEEP = b"[" * 100_000 + b"]" * 100_000
HOSTILE = {
    "lone surrogate": (b'{"text": "\\ud800"}', b'{"prompt": "a\\udfffb"}'),
    "deep nesting": (b'{"text": "a", "x": ' + DEEP + b"}", b'{"prompt": ' + DEEP + b"}"),
    "5000-digit int": (b'{"text": "a", "sampling_params": {"max_new_tokens": ' + b"9" * 5000
                       + b"}}", b'{"prompt": "a", "max_tokens": ' + b"9" * 5000 + b"}"),
    "NaN": (b'{"text": "a", "sampling_params": {"temperature": NaN}}',
            b'{"prompt": "a", "temperature": Infinity}'),
    "surrogate key": (b'{"\\ud800": 1, "text": "a"}', b'{"prompt": "a", "\\udc00": 1}'),
}


@pytest.fixture(scope="module")
def server():
    with start_server(ServerConfig(port=0, l1_tokens=1024, l2_tokens=0)) as s:
        yield s


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_malformed_json_is_a_400_without_a_traceback(server, name, caplog):
    gen, comp = HOSTILE[name]
    with caplog.at_level(logging.WARNING):
        for path, body in (("/generate", gen), ("/v1/completions", comp)):
            r = requests.post(server.url + path, data=body, timeout=60,
                              headers={"Content-Type": "application/json"})
            assert r.status_code == 400, (name, path, r.status_code, r.text[:200])
            err = r.json()["error"]
            assert err["type"] == "invalid_request_error" and err["code"] == 400
            assert err["message"].startswith("malformed JSON body: ")
            assert len(err["message"]) < 300
    assert not [rec for rec in caplog.records if rec.levelno >= logging.ERROR]
    r = requests.post(server.url + "/generate", json={"text": "still here", "sampling_params":
                                                       {"max_new_tokens": 2}}, timeout=60)
    assert r.status_code == 200 and len(r.json()["output_ids"]) == 2


def test_clients_leaving_mid_upload_log_one_debug_line_each(server, caplog):
    import socket
    import time
    import urllib.parse

    u = urllib.parse.urlparse(server.url)
    n = 20
    with caplog.at_level(logging.DEBUG):
        for _ in range(n):
            c = socket.create_connection((u.hostname, u.port))
            c.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 100000\r\n\r\n{\"text\": \"abc")
            time.sleep(0.05)
            c.close()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and sum(
                "went away" in r.getMessage() for r in caplog.records) < n:
            time.sleep(0.05)
    gone = [r for r in caplog.records if "went away" in r.getMessage()]
    assert len(gone) == n and all(r.levelno == logging.DEBUG for r in gone)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert not [r for r in caplog.records if r.exc_info]
