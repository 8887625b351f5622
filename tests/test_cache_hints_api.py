"""Client cache hints in the API (docs/cache-hints.md): every spelling parses to its
``CacheHint``; every bad hint is a 400 with its reason; ``cache_control`` never changes the
rendered prompt; the session registry stays bounded; hints cross the rank link; and, live, the
session whose client sends a TTL keeps its prefix while the one it closed goes first (a
hint-less run evicts the other way round); a TP server with hints keeps its ranks' logs
consistent."""

from __future__ import annotations

import json
import signal
import time
import tracemalloc

import numpy as np
import pytest
import requests
from typer.testing import CliRunner

from engine.cache.hints import CacheHint
from engine.cache.types import as_tokens
from engine.core.errors import InputError
from engine.runtime.model import preset
from engine.runtime.model_id import model_tokenizer
from engine.runtime.serving.protocol import parse_chat, parse_completions, parse_generate
from engine.runtime.serving.sessions import SessionRegistry

IDS = [1, 2, 3, 4]
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
PARSE = {"generate": lambda b: parse_generate({"input_ids": IDS, **b}, None),
         "completions": lambda b: parse_completions({"prompt": IDS, **b}, None),
         "chat": lambda b: parse_chat({"messages": CHAT, **b}, _tok())}


def _tok():
    return model_tokenizer("tiny", preset("tiny"))


def _cc(ttl=None, **kw):
    return {"type": "ephemeral", **({} if ttl is None else {"ttl": ttl}), **kw}


def _chat_cc(where: str, ttl: str) -> list:
    msgs = json.loads(json.dumps(CHAT))
    if where == "message":
        msgs[0]["cache_control"] = _cc(ttl)
    else:
        msgs[1]["content"] = [{"type": "text", "text": "hel"},
                              {"type": "text", "text": "lo", "cache_control": _cc(ttl)}]
    return msgs


SPELLINGS = [
    ("generate", {}, None),
    ("generate", {"session_id": "s1"}, CacheHint("s1")),
    ("generate", {"nvext": {"cache_control": _cc("1h")}}, CacheHint(None, 3600.0)),
    ("generate", {"session_id": "s1", "nvext": {"cache_control": _cc()}},
     CacheHint("s1", 300.0)),
    ("generate", {"session_params": {"id": "s2", "offset": 0, "replace": False}},
     CacheHint("s2")),
    ("generate", {"nvext": {"session_control": {"session_id": "s3", "action": "close"}}},
     CacheHint("s3", close=True)),
    ("completions", {"prompt_cache_key": "k"}, CacheHint("k")),
    ("completions", {"prompt_cache_key": "k", "prompt_cache_retention": "24h"},
     CacheHint("k", 86400.0)),
    ("completions", {"prompt_cache_retention": "in_memory"}, CacheHint(None, 600.0)),
    ("completions", {"prompt_cache_options": {"ttl": "30m"}}, CacheHint(None, 1800.0)),
    ("chat", {"messages": _chat_cc("message", "1h")}, CacheHint(None, 3600.0)),
    ("chat", {"messages": _chat_cc("part", "300s")}, CacheHint(None, 300.0)),
    ("chat", {"messages": _chat_cc("part", "1h30m"), "prompt_cache_key": "c"},
     CacheHint("c", 5400.0)),
    # what wins: nvext.cache_control over messages over prompt_cache_options/retention
    ("chat", {"messages": _chat_cc("part", "5m"), "prompt_cache_retention": "24h",
              "nvext": {"cache_control": _cc("2h")}}, CacheHint(None, 7200.0)),
    ("chat", {"messages": _chat_cc("part", "5m"), "prompt_cache_retention": "24h"},
     CacheHint(None, 300.0)),
    ("chat", {"nvext": {"session_control": {"session_id": "d", "action": "open",
                                            "timeout": 60}}, "prompt_cache_key": "d"},
     CacheHint("d")),
]


@pytest.mark.parametrize("route,body,want", SPELLINGS)
def test_every_spelling_parses_to_its_hint(route, body, want):
    assert PARSE[route](body).hint == want


BAD = [
    ("chat", {"messages": [{**CHAT[0], "cache_control": _cc("5m", scope="global")}]},
     "unknown key 'scope'"),
    ("chat", {"messages": [{**CHAT[0], "cache_control": {"type": "persistent"}}]},
     "must be \"ephemeral\""),
    ("chat", {"messages": _chat_cc("part", "-5m")}, "negative"),
    ("chat", {"messages": _chat_cc("message", "1000d")}, "longer than the longest TTL"),
    ("chat", {"messages": _chat_cc("message", "0s")}, "zero"),
    ("chat", {"messages": _chat_cc("message", "soon")}, "not a duration"),
    ("chat", {"messages": _chat_cc("message", "5m garbage")}, "not a duration"),
    ("completions", {"prompt_cache_retention": "forever"}, "in_memory"),
    ("completions", {"prompt_cache_key": "x" * 257}, "longer than 256"),
    ("completions", {"prompt_cache_key": ""}, "non-empty"),
    ("completions", {"prompt_cache_options": {"ttl": "5m", "mode": "explicit"}},
     "prompt_cache_options.mode"),
    ("generate", {"nvext": {"cache_control": _cc("5m", pin=True)}}, "unknown key 'pin'"),
    ("generate", {"nvext": {"session_control": {"action": "close"}}}, "session_id"),
    ("generate", {"nvext": {"session_control": {"session_id": "a", "action": "kill"}}},
     "\"open\" or \"close\""),
    ("generate", {"nvext": {"session_control": {"session_id": "a", "timeout": -1}}},
     "positive integer"),
    ("generate", {"session_params": {"id": "a", "rid": "r1"}}, "session_params.rid"),
    ("generate", {"session_params": {"id": "a", "offset": 5}}, "session_params.offset"),
    ("generate", {"session_params": {"id": "a", "drop_previous_output": True}},
     "drop_previous_output"),
    ("generate", {"session_params": {"id": "a"}, "session_id": "a"}, "cannot both be set"),
    ("generate", {"session_id": "a", "nvext": {"session_control": {"session_id": "b"}}},
     "different sessions"),
]


@pytest.mark.parametrize("route,body,match", BAD)
def test_bad_hints_are_input_errors_with_the_reason(route, body, match):
    with pytest.raises(InputError, match=match.replace("(", r"\(")):
        PARSE[route](body)


def test_priority_is_sglangs_or_dynamos():
    assert PARSE["generate"]({"priority": 5}).priority == 5
    assert PARSE["chat"]({"nvext": {"agent_hints": {"priority": 7, "osl": 10}}}).priority == 7
    assert PARSE["completions"]({"priority": 2, "nvext": {"agent_hints": {"priority": 7}}}
                                ).priority == 2
    with pytest.raises(InputError, match="nvext.agent_hints.priority"):
        PARSE["generate"]({"nvext": {"agent_hints": {"priority": "high"}}})


def test_cache_control_does_not_change_the_prompt_tokens():
    tok = _tok()
    plain = parse_chat({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "hel"}, {"type": "text", "text": "lo"}]}]}, tok)
    hinted = parse_chat({"messages": _chat_cc("part", "1h")[1:]}, tok)
    assert hinted.hint == CacheHint(None, 3600.0)
    assert hinted.prompts[0].tolist() == plain.prompts[0].tolist()
    a = parse_chat({"messages": _chat_cc("message", "5m")}, tok)
    b = parse_chat({"messages": CHAT}, tok)
    assert a.prompts[0].tolist() == b.prompts[0].tolist()


def test_session_registry_stays_bounded_and_refuses_past_its_size():
    reg = SessionRegistry(max_sessions=4096)
    for i in range(1_000_000):                 # 10^6 sessions seen: the oldest are forgotten
        reg.use(None, f"s-{i}")
    assert len(reg) == len(reg._d) == 4096 and len(reg._seen) == 4096
    tracemalloc.start()
    for i in range(8192):                      # every entry now allocated under the tracer
        reg.use(None, f"w-{i}")
    base = tracemalloc.get_traced_memory()[0]
    for i in range(50_000):                    # and memory does not grow past that
        reg.use(None, f"t-{i}")
    grown = tracemalloc.get_traced_memory()[0] - base
    assert len(reg) == 4096 and grown < 256 << 10, grown
    base = tracemalloc.get_traced_memory()[0]
    for i in range(4096):                      # opened sessions are kept: the 4097th refused
        reg.open(None, f"o-{i}")
    assert not reg._seen
    refused = 0
    for i in range(50_000):
        try:
            reg.open(None, f"late-{i}")
        except InputError as exc:
            assert "at most 4096 (--max-sessions)" in str(exc)
            refused += 1
    grown = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    assert refused == 50_000 and len(reg) == 4096 and grown < 512 << 10, grown
    with pytest.raises(InputError, match="already open"):
        reg.open(None, "o-1")
    with pytest.raises(InputError, match="not open"):
        reg.close(None, "never")
    reg.close(None, "o-1")
    assert reg.open(None, "o-1") == "o-1"


def test_sessions_are_per_namespace_and_expire():
    from engine.core.namespace import Namespace

    now = [0.0]
    reg = SessionRegistry(max_sessions=4, clock=lambda: now[0])
    reg.open(Namespace(namespace="a"), "s", timeout_s=10)
    with pytest.raises(InputError, match="not open in this namespace"):
        reg.close(Namespace(namespace="b"), "s")
    with pytest.raises(InputError, match="does not exist"):
        reg.use(None, "s", must_exist=True)
    now[0] = 11.0                              # idle past its timeout: gone
    with pytest.raises(InputError, match="does not exist"):
        reg.use(Namespace(namespace="a"), "s", must_exist=True)


def test_the_hint_crosses_the_rank_link():
    from engine.runtime.ranks.lockstep import decode_intake, encode_intake
    from engine.runtime.scheduler import SamplingParams
    from engine.runtime.scheduler.request import _Req

    r = _Req("r1", np.asarray(IDS), SamplingParams(max_new_tokens=2), None, 3, None,
             CacheHint("s", 60.0, True))
    w = decode_intake(encode_intake([["req", r.to_wire()], ["close_session", [None, "s"]],
                                     ["clock", 12.5]]))
    back = _Req.from_wire(w[0][1])
    assert back.hint == CacheHint("s", 60.0, True) and back.priority == 3
    assert _Req.from_wire(_Req("r2", np.asarray(IDS), SamplingParams(), None, 0,
                               None).to_wire()).hint is None
    bad = r.to_wire()
    bad[6] = ["s", -1.0, False]
    with pytest.raises(ValueError):
        _Req.from_wire(bad)
    with pytest.raises(ValueError):
        decode_intake(encode_intake([["pin", "s"]]))


# -- live servers ----------------------------------------------------------------------------
def _server(**kw):
    from engine.runtime.launch import ServerConfig, start_server

    return start_server(ServerConfig(port=0, **{"l1_tokens": 4096, "l2_tokens": 8192, **kw}))


def _post(h, path, body):
    return requests.post(h.url + path, json=body, timeout=60)


def test_session_endpoints_and_their_errors_over_http():
    h = _server(max_sessions=8)
    try:
        r = _post(h, "/open_session", {"capacity_of_str_len": 1000})
        assert r.status_code == 200 and isinstance(r.json(), str) and r.json()
        sid = r.json()
        assert _post(h, "/open_session", {"capacity_of_str_len": 1000,
                                          "session_id": "mine"}).json() == "mine"
        dup = _post(h, "/open_session", {"capacity_of_str_len": 1, "session_id": "mine"})
        assert dup.status_code == 400 and "already open" in dup.json()["error"]["message"]
        assert _post(h, "/open_session", {"capacity_of_str_len": 1,
                                          "streaming": True}).status_code == 400
        gen = {"input_ids": IDS, "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
        ok = _post(h, "/generate", {**gen, "session_params": {"id": sid}})
        assert ok.status_code == 200, ok.text
        unknown = _post(h, "/generate", {**gen, "session_params": {"id": "nope"}})
        assert unknown.status_code == 400 and "does not exist" in unknown.text
        bad = _post(h, "/v1/chat/completions", {"messages": [
            {"role": "user", "content": "x", "cache_control": {"type": "ephemeral",
                                                               "ttl": "-1h"}}]})
        assert bad.status_code == 400 and "negative" in bad.json()["error"]["message"]
        assert _post(h, "/close_session", {"session_id": sid}).status_code == 200
        again = _post(h, "/close_session", {"session_id": sid})
        assert again.status_code == 400 and "not open" in again.json()["error"]["message"]
        codes = [_post(h, "/open_session", {"capacity_of_str_len": 1}).status_code
                 for _ in range(40)]                     # 1 open + 7 = the bound of 8
        assert codes.count(200) == 7 and codes[7:] == [400] * 33
        full = _post(h, "/open_session", {"capacity_of_str_len": 1})
        assert "at most 8 (--max-sessions)" in full.json()["error"]["message"]
        assert len(h.engine.sessions) == 8
        info = requests.get(h.url + "/server_info", timeout=10).json()
        assert info["cache_hints"]["sessions"]["sessions"] == 8
        assert info["cache_hints"]["sessions"]["refused_total"] == 34
        metrics = requests.get(h.url + "/metrics", timeout=10).text
        assert "hicache_sessions 8" in metrics and "hicache_max_sessions 8" in metrics
        assert "hicache_hint_" in metrics
    finally:
        h.stop()


def _on_sched(h, fn):
    return h.engine.scheduler.call(fn).result(30)


def _held(h, ids) -> tuple[int, set]:
    """Tokens of ``ids`` the tree holds (any tier) and the ids of the nodes on that path, read
    without touching them (no recency update)."""
    def look():
        tree = h.engine.cache.tree
        path, n = tree.walk(as_tokens(ids), None, split=False)
        return n, {node.id for node in path}
    return _on_sched(h, look)


def _node_ids(h) -> set:
    return _on_sched(h, lambda: {n.id for n in h.engine.cache.tree.iter_nodes()})


def _idle(h):
    deadline = time.monotonic() + 30
    while not _on_sched(h, h.engine.scheduler.idle):
        assert time.monotonic() < deadline
        time.sleep(0.02)


def _earn_trust(generate, close, rng, hints: bool = True) -> None:
    """Ten sessions of two turns: each first turn declares the next within 0.3 s (it comes
    then), each second closes the session (it then stays away past twice the turn gap seen),
    so both kinds of hint are trusted (docs/eviction.md). ``hints=False``: the same requests,
    no hints."""
    warm = [rng.integers(0, 256, 20).tolist() for _ in range(10)]
    for turn in range(2):
        for i, p in enumerate(warm):
            w = ({"session_id": f"w{i}", "nvext": {"cache_control": {
                "type": "ephemeral", "ttl": "0.3s"}}} if turn == 0 else
                 {"session_id": f"w{i}"}) if hints else {}
            assert generate({"input_ids": p + [turn] * 4, **w}).status_code == 200
            if hints and turn:
                assert close(f"w{i}").status_code == 200
        time.sleep(0.3)
    time.sleep(1.0)                        # the closes stay unanswered: judged right


def _compete(hints: bool, warm: bool = True, **server) -> dict:
    """Sessions A and B each send a 96-token prefix (B after A: under LRU, A is older); A's
    client declares its next turn within 3 s (it comes sooner), B's closes its session.
    Unhinted traffic then presses on L1+L2 until one of the two prefixes has left the tree. The cache applies a
    namespace's hints once enough of them proved right (docs/eviction.md): ten earlier
    sessions of two turns earn that trust first, each first turn declaring the next within
    0.3 s (it comes then) and each second closing the session (it stays away past twice the
    turn gap seen); hint-less: the same requests, no hints. ``warm=False``: no such sessions
    (for ``--hint-trust always``)."""
    rng = np.random.default_rng(7)
    pa, pb = rng.integers(0, 256, 96).tolist(), rng.integers(0, 256, 96).tolist()
    sp = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
    h = _server(l1_tokens=128, l2_tokens=384, page_size=16, **server)
    try:
        if warm:
            _earn_trust(lambda body: _post(h, "/generate", {**body, "sampling_params": sp}),
                        lambda sid: _post(h, "/close_session", {"session_id": sid}), rng,
                        hints)
        a = {"session_id": "A", "nvext": {"cache_control": {"type": "ephemeral",
                                                            "ttl": "3s"}}} if hints else {}
        b = {"session_id": "B"} if hints else {}
        assert _post(h, "/generate", {"input_ids": pa, "sampling_params": sp, **a}).ok
        assert _post(h, "/generate", {"input_ids": pb, "sampling_params": sp, **b}).ok
        if hints:
            assert _post(h, "/close_session", {"session_id": "B"}).status_code == 200
        _idle(h)
        (na, ida), (nb, idb) = _held(h, pa), _held(h, pb)
        assert na == nb == 96, (na, nb, hints)
        gone_first = None
        for _ in range(60):
            p = rng.integers(0, 256, 48).tolist()
            assert _post(h, "/generate", {"input_ids": p, "sampling_params": {
                "max_new_tokens": 1, "temperature": 0}}).ok
            _idle(h)
            held_a, held_b = _held(h, pa)[0], _held(h, pb)[0]
            if held_a < 96 or held_b < 96:
                gone_first = "A" if held_a < 96 else "B"
                break
        alive = _node_ids(h)
        turn2 = _post(h, "/generate", {"input_ids": pa + [5, 6, 7], "sampling_params": sp,
                                       **a}).json()
        stats = _on_sched(h, h.engine.cache.hint_stats)
        metrics = requests.get(h.url + "/metrics", timeout=10).text
        b_again = _post(h, "/generate", {"input_ids": pb + [5, 6, 7], "sampling_params": sp}
                        ).json()["meta_info"]["cached_tokens_details"]
        return {"b_again": b_again, "gone_first": gone_first, "a_nodes_alive": ida <= alive,
                "b_nodes_alive": bool(idb & alive), "held": (held_a, held_b),
                "a_turn2_cached": turn2["meta_info"]["cached_tokens"], "hint_stats": stats,
                "metrics": metrics}
    finally:
        h.stop()


def test_the_session_with_a_ttl_keeps_its_prefix_and_the_closed_one_goes_first():
    without = _compete(hints=False)
    assert without["gone_first"] == "A", without     # LRU alone: the older session goes
    got = _compete(hints=True)
    assert got["gone_first"] == "B", got["hint_stats"]  # the closed session's KV goes first
    assert got["held"][0] == 96 and got["a_nodes_alive"] and not got["b_nodes_alive"], got
    assert got["a_turn2_cached"] >= 96, got          # A's next turn hits its whole prefix
    assert without["a_turn2_cached"] < 96, without
    st = got["hint_stats"]
    assert st["trusted_namespaces"] == 1 and st["sessions_closed"] >= 9, st
    assert st["closed_evictions"] > 0, st
    assert f"hicache_hint_closed_evictions_total {st['closed_evictions']}" in got["metrics"]
    assert "# TYPE hicache_hint_trusted_closes gauge" in got["metrics"]
    assert "\nhicache_hint_trusted_closes 1\n" in got["metrics"]


def test_hint_trust_always_applies_at_once_and_off_never():
    """``--hint-trust always``: with no sessions before (no trust earned) the hints order
    eviction from the first request; ``off``: after the same warm-up that earns trust, they
    are judged right and never applied (LRU's order: the older session goes)."""
    at_once = _compete(hints=True, warm=False, hint_trust="always")
    assert at_once["gone_first"] == "B" and at_once["a_turn2_cached"] >= 96, at_once
    assert at_once["hint_stats"]["trust_mode"] == "always"
    off = _compete(hints=True, hint_trust="off")
    st = off["hint_stats"]
    assert off["gone_first"] == "A", st
    assert st["hints_applied"] == 0 and st["hints_right"] >= 10 and st["trusted_namespaces"] == 0
    res = CliRunner().invoke(__import__("hicache_cli.app").app.app,
                             ["bench", "serve", "--hint-trust", "sometimes"])
    assert res.exit_code == 2 and "--hint-trust" in res.output and "Traceback" not in res.output


def test_a_closed_session_is_not_written_back_to_l3(tmp_path):
    """With an L3 store: the closed session's KV leaves L2 without a write-back (the store
    never gets it, so its next request hits nothing), the TTL session's prefix stays."""
    got = _compete(hints=True, hicache_storage_backend="file",
                   hicache_storage_dir=str(tmp_path / "l3"))
    assert got["gone_first"] == "B" and got["a_turn2_cached"] >= 96, got
    assert got["hint_stats"]["l3_writebacks_skipped"] > 0, got
    assert got["b_again"] == {"device": 0, "host": 0, "storage": 0}, got
    without = _compete(hints=False, hicache_storage_backend="file",
                       hicache_storage_dir=str(tmp_path / "l3-lru"))
    assert without["gone_first"] == "A" and without["hint_stats"]["l3_writebacks_skipped"] == 0
    assert without["a_turn2_cached"] >= 96, without      # LRU: A written back, read from L3


def test_a_closed_sessions_stored_kv_is_the_file_stores_first_to_evict(tmp_path):
    """KV a session wrote to the file L3 before it closed: the close demotes its objects
    (their mtime, the store's LRU clock, goes to the epoch), so the store evicts them before
    older objects of other sessions; another session's objects keep their time."""
    import glob
    import os

    rng = np.random.default_rng(3)
    sp = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
    h = _server(l1_tokens=1024, l2_tokens=2048, page_size=16, hint_trust="always",
                hicache_storage_backend="file", hicache_storage_dir=str(tmp_path))

    def objects():
        return {p: os.lstat(p).st_mtime_ns for p in glob.glob(str(tmp_path / "**" / "*"),
                                                               recursive=True)
                if os.path.isfile(p) and len(os.path.basename(p)) >= 64}

    try:
        for sid in ("T", "S"):
            p = rng.integers(0, 256, 64).tolist()
            assert _post(h, "/generate", {"input_ids": p, "sampling_params": sp,
                                          "session_id": sid}).ok
            _idle(h)
            deadline = time.monotonic() + 30
            while _on_sched(h, lambda: h.engine.cache.l3.inflight) or not objects():
                assert time.monotonic() < deadline
                time.sleep(0.05)
        before = objects()
        assert _post(h, "/close_session", {"session_id": "S"}).status_code == 200
        _idle(h)
        deadline = time.monotonic() + 30
        while not any(t == 1 for t in objects().values()):
            assert time.monotonic() < deadline, objects()
            time.sleep(0.05)
        after = objects()
        demoted = {p for p, t in after.items() if t == 1}
        stats = _on_sched(h, h.engine.cache.hint_stats)
        assert stats["l3_pages_demoted"] == 4, stats          # S's four 16-token pages
        assert demoted and len(demoted) < len(after), (len(demoted), len(after))
        assert all(after[p] == before[p] for p in after.keys() - demoted)   # T's untouched
    finally:
        h.stop()


@pytest.mark.parametrize("shape", [("--tp", "2"), ("--pp", "2"), ("--cp", "2")],
                         ids=["tp2", "pp2", "cp2"])
def test_ranks_agree_on_hint_decisions(tmp_path, shape):
    """Hints that are applied (the namespace earned trust), TTLs on rank 0's clock, closes by
    request and by endpoint, evictions they order: every rank's log records the same."""
    from hicache_cli.app import app
    from tests.serve_client import spawn

    proc, url = spawn(*shape, "--rank-log-dir", str(tmp_path), base=[
        "--l1-tokens", "128", "--l2-tokens", "384", "--page-size", "16", "--format", "json"])
    rng = np.random.default_rng(3)
    sp = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}

    def gen(ids, **hint):
        r = requests.post(url + "/generate", timeout=120,
                          json={"input_ids": ids, "sampling_params": sp, **hint})
        assert r.status_code == 200, r.text
        return r.json()

    try:
        _earn_trust(lambda body: requests.post(url + "/generate", json={
            **body, "sampling_params": sp}, timeout=120),
            lambda sid: requests.post(url + "/close_session", json={"session_id": sid},
                                      timeout=30), rng)
        prefixes = [rng.integers(0, 256, 64).tolist() for _ in range(3)]
        for turn in range(3):                        # a turn a second, as each declares
            time.sleep(1.0 if turn else 0)
            for k, p in enumerate(prefixes):
                nv = {"cache_control": {"type": "ephemeral", "ttl": "1s"}}
                if turn == 2 and k == 1:
                    nv["session_control"] = {"session_id": f"s{k}", "action": "close"}
                gen(p + rng.integers(0, 256, 8 * turn + 3).tolist(), session_id=f"s{k}",
                    nvext=nv)
        for _ in range(6):                           # unhinted pressure on L1 + L2
            gen(rng.integers(0, 256, 48).tolist())
        info = requests.get(url + "/server_info", timeout=10).json()
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=90)
        assert proc.returncode == 0, err
    hints = info["cache_hints"]
    assert hints["trusted_namespaces"] == 1 and hints["hints_applied"] > 0, hints
    assert hints["closed_evictions"] > 0, hints
    assert hints["sessions"]["closed_total"] == 11, hints
    res = CliRunner().invoke(app, ["consensus-check", str(tmp_path), "--format", "json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["consistent"] is True


def test_max_sessions_option_is_bounded():
    from engine.runtime.launch import ServerConfig
    from hicache_cli.app import app

    for bad in ("0", "2000000"):
        res = CliRunner().invoke(app, ["bench", "serve", "--max-sessions", bad])
        assert res.exit_code == 2 and "--max-sessions" in res.output, res.output
        assert "Traceback" not in res.output
    with pytest.raises(ValueError, match="--max-sessions"):
        ServerConfig(max_sessions=0)
