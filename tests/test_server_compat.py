"""Drop-in for SGLang's and OpenAI's clients: info endpoints, the exported tokenizer, chat,
cache details, logprobs, stop strings, n, batches, echo and penalties (docs/sglang-compat.md)."""

from __future__ import annotations

import json
import os

import openai
import pytest
import requests
from tokenizers import Tokenizer as HFTok

from engine.runtime.chat_template import normalize_messages, render
from engine.runtime.serving import ServerConfig, start_server
from engine.runtime.tokenizer import ByteTokenizer
from engine.runtime.tokenizer_export import export_tokenizer


@pytest.fixture(scope="module")
def server():
    h = start_server(ServerConfig(port=0, l1_tokens=4096, l2_tokens=8192,
                                  chunked_prefill_size=256, max_running_requests=16))
    yield h
    h.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused")


def get(server, path):
    return requests.get(server.url + path, timeout=30)


def post(server, path, body, **kw):
    return requests.post(server.url + path, json=body, timeout=60, **kw)


def sse(server, path, body):
    with post(server, path, body, stream=True) as r:
        assert r.status_code == 200, r.text
        lines = [ln for ln in r.iter_lines(decode_unicode=True) if ln]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(ln[6:]) for ln in lines[:-1]]


# -- (a) info endpoints --------------------------------------------------------------------
def test_model_and_server_info_in_sglang_shape(server):
    for path in ("/model_info", "/get_model_info"):
        info = get(server, path).json()
        assert info["model_path"] == "tiny" and info["is_generation"] is True
        assert info["served_model_name"] == "tiny" and info["weight_version"] == "default"
        assert os.path.isfile(os.path.join(info["tokenizer_path"], "tokenizer.json"))
    for path in ("/server_info", "/get_server_info"):
        si = get(server, path).json()
        assert si["page_size"] == 16 and si["version"] and si["model_path"] == "tiny"
        assert si["tokenizer_path"] == info["tokenizer_path"]
        assert si["internal_states"][0]["page_size"] == 16
        assert si["cache"]["l1_capacity_tokens"] == 4096 or "l1_used_tokens" in si["cache"]
    card = get(server, "/v1/models/tiny").json()
    assert card["id"] == "tiny" and card["object"] == "model"
    r = get(server, "/v1/models/other-model")
    assert r.status_code == 404 and "tiny" in r.json()["error"]["message"]
    assert get(server, "/health_generate").status_code == 200


def test_health_generate_is_503_when_the_scheduler_is_gone():
    h = start_server(ServerConfig(port=0, l1_tokens=1024, l2_tokens=0))
    try:
        h.engine.scheduler.stop()
        r = requests.get(h.url + "/health_generate", timeout=30)
        assert r.status_code == 503 and r.json()["error"]["message"]
    finally:
        h.stop()


# -- (b) the exported tokenizer ------------------------------------------------------------
ROUND_TRIP = ["hello world", "héllo ✓ 漢字 🙂", "a<eos>b<sep>user\n<bos>x", "<eo s><pad>",
              " lead", "\x00\x01\t\x7f"]


def test_exported_tokenizer_round_trips_with_the_server(server, tmp_path):
    info = get(server, "/model_info").json()
    hf = HFTok.from_file(os.path.join(info["tokenizer_path"], "tokenizer.json"))
    for text in ROUND_TRIP:
        ids = hf.encode(text).ids
        r = post(server, "/v1/completions", {"prompt": text, "max_tokens": 1,
                                             "temperature": 0})
        assert r.json()["usage"]["prompt_tokens"] == len(ids), text
        assert ids == ByteTokenizer().encode(text)
        assert hf.decode(ids) == ByteTokenizer().decode(ids)
    cfg = json.load(open(os.path.join(info["tokenizer_path"], "tokenizer_config.json")))
    assert cfg["chat_template"] and cfg["bos_token"] == "<bos>"
    specials = json.load(open(os.path.join(info["tokenizer_path"],
                                           "special_tokens_map.json")))
    assert specials["eos_token"] == "<eos>"
    # The export command writes the same directory.
    d = export_tokenizer(ByteTokenizer(), str(tmp_path / "tok"), "tiny", 16384)
    assert open(os.path.join(d, "tokenizer.json")).read() == \
        open(os.path.join(info["tokenizer_path"], "tokenizer.json")).read()


# -- (c) chat ------------------------------------------------------------------------------
def test_chat_template_matches_the_exported_one():
    tok = ByteTokenizer()
    msgs = normalize_messages([{"role": "system", "content": "be brief"},
                               {"role": "user", "content": [{"type": "text", "text": "hi"}]}])
    text = render(tok.chat_template, tok.special_tokens, msgs)
    assert text == "<bos><sep>system\nbe brief<eos><sep>user\nhi<eos><sep>assistant\n"
    ids = tok.encode(text, add_bos=False)
    assert ids[0] == 256 and ids.count(259) == 3 and ids.count(257) == 2


def test_chat_completions_with_the_openai_client(server, client):
    msgs = [{"role": "user", "content": "Tell me about hierarchical caches. " * 4}]
    a = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=6,
                                       temperature=0)
    b = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=6,
                                       temperature=0)
    assert a.object == "chat.completion" and a.choices[0].message.role == "assistant"
    assert a.choices[0].finish_reason in ("length", "stop")
    assert b.choices[0].message.content == a.choices[0].message.content
    tok = ByteTokenizer()
    prompt = tok.encode(render(tok.chat_template, tok.special_tokens, msgs), add_bos=False)
    assert a.usage.prompt_tokens == len(prompt)
    assert b.usage.prompt_tokens_details.cached_tokens >= (len(prompt) - 1) // 16 * 16 > 0
    # streaming: role first, the same text, usage last with choices == []
    chunks = list(client.chat.completions.create(
        model="tiny", messages=msgs, max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == a.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == \
        a.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0
    assert chunks[-2].choices[0].finish_reason == a.choices[0].finish_reason


def test_multi_turn_chat_hits_the_previous_turn(server, client):
    msgs = [{"role": "user", "content": "first question, long enough to fill pages " * 3}]
    a = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=8,
                                       temperature=0, extra_body={"ignore_eos": True})
    msgs += [{"role": "assistant", "content": a.choices[0].message.content},
             {"role": "user", "content": "second question"}]
    b = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=4,
                                       temperature=0)
    # round 1's prompt is a prefix of round 2's: its full pages are hits
    assert b.usage.prompt_tokens_details.cached_tokens >= a.usage.prompt_tokens // 16 * 16


def test_chat_bad_input_is_400(server):
    for body in [{"messages": []}, {"messages": [{"content": "x"}]},
                 {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
                 {"messages": [{"role": "user", "content": "x"}],
                  "tools": [{"type": "function", "function": {"name": "f"}}]},
                 {"messages": [{"role": "user", "content": "x"}],
                  "response_format": {"type": "json_object"}},
                 {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 50}]:
        r = post(server, "/v1/chat/completions", body)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["message"]


# -- (d) cache details ---------------------------------------------------------------------
def test_completions_return_cached_tokens_details(server):
    prompt = "cached details prompt " * 6
    body = {"prompt": prompt, "max_tokens": 3, "temperature": 0,
            "return_cached_tokens_details": True}
    post(server, "/v1/completions", body)
    r = post(server, "/v1/completions", body).json()
    d = r["sglext"]["cached_tokens_details"]
    assert d["device"] + d["host"] + d["storage"] == \
        r["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert "sglext" not in post(server, "/v1/completions",
                                {**body, "return_cached_tokens_details": False}).json()
    events = sse(server, "/v1/completions", {**body, "stream": True,
                                             "stream_options": {"include_usage": True}})
    with_ext = [e for e in events if "sglext" in e]
    assert len(with_ext) == 1 and with_ext[0]["choices"]          # the last with a choice
    assert with_ext[0]["choices"][0]["finish_reason"] is not None
    assert with_ext[0]["sglext"]["cached_tokens_details"]["device"] == d["device"]
    assert events[-1]["choices"] == [] and "usage" in events[-1]
    chat = sse(server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": prompt}], "max_tokens": 2, "stream": True,
        "return_cached_tokens_details": True})
    ext = [e for e in chat if "sglext" in e]
    assert len(ext) == 1 and ext[0]["choices"][0]["finish_reason"] is not None
