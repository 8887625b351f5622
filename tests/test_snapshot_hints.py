"""Client hints in tree snapshots (format version 2): each node's session and predicted next
use, written from a live cache, read back (version 1 files too), shown by ``hicache inspect``
(human and JSON), and bad values refused with one line."""

from __future__ import annotations

import json
import math
import os

import msgpack
import numpy as np
import pytest
import requests
from typer.testing import CliRunner

from checkers.invariants import SHARED_SESSION, check_tree
from engine.cache.hints import SHARED, CacheHint
from engine.snapshot import views as sv
from engine.snapshot.take import load_snapshot, snapshot_of, write_snapshot
from formats import snapshot as fmt
from formats.errors import FormatError
from formats.snapshot import NodeRecord as R
from hicache_cli.app import app
from tests.serve_client import ROOT
from tests.test_hints import req, toks, trusting
from tests.test_snapshot import CREATED, small_header, small_records, t

runner = CliRunner()


def run(*args):
    return runner.invoke(app, ["inspect", *map(str, args)])


def hinted_cache():
    """A system prompt (2 pages) two sessions share; under it ``chat-7``'s turn (its next in
    30 s), and ``done``'s (closed by ``close_session``); ``bye``'s own prompt (closed by its
    request); the integer session 42's prompt (no retention). The hint clock then reads 10."""
    c = trusting(l1_pages=32)
    system = toks(0, 2)
    req(c, np.concatenate([system, toks(500, 2)]), CacheHint("chat-7", 30.0), t=0.0)
    req(c, np.concatenate([system, toks(900, 2)]), CacheHint("done", 60.0), t=1.0)
    req(c, toks(2000, 2), CacheHint(42), t=2.0)
    req(c, toks(3000, 1), CacheHint("bye", close=True), t=3.0)
    assert c.close_session(None, "done") == 1
    c.set_clock(10.0)
    return c


def node_of(cache, tokens):
    return cache.tree.walk(np.asarray(tokens, dtype=np.uint32), None, split=False)[0][-1]


@pytest.fixture()
def hinted(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cache = hinted_cache()
    write_snapshot("h.snapshot", cache, meta={"created_at": CREATED})
    return cache


# ------------------------------------------------------------------------- a live cache
def test_snapshot_of_a_live_cache_carries_each_nodes_session_and_hint(hinted):
    cache = hinted
    snap = snapshot_of(cache)
    assert snap.header["hint_clock"] == 10.0 and snap.header["version"] == 2
    rec = {r.id: r for r in snap.nodes}
    want = {  # node: (session as written, hint_until)
        node_of(cache, toks(0, 2)).id: (True, None),
        node_of(cache, np.concatenate([toks(0, 2), toks(500, 2)])).id: ("chat-7", 30.0),
        node_of(cache, np.concatenate([toks(0, 2), toks(900, 2)])).id: ("done", math.inf),
        node_of(cache, toks(2000, 2)).id: (42, None),
        node_of(cache, toks(3000, 1)).id: ("bye", math.inf),
    }
    assert {i: (rec[i].session, rec[i].hint_until) for i in want} == want
    assert len(want) == cache.tree.num_nodes
    assert all(r.session is None and r.hint_until is None for r in snap.nodes
               if r.parent is None)
    # loaded back, the node objects carry the live tree's session markers and hints
    loaded = load_snapshot("h.snapshot")
    live = {n.id: n for n in cache.tree.iter_nodes()}
    got = {n.id: n for n in loaded.iter_nodes()}
    for nid, a in live.items():
        b = got[nid]
        assert b.hint_until == a.hint_until and b.session_key == want[nid][0]
        assert (b.session == SHARED) == (a.session == SHARED) and (b.session is None) == \
            (a.session is None)
    numbers = {b.session_key: b.session for b in got.values() if b.session != SHARED}
    assert len(set(numbers.values())) == 4 and min(numbers.values()) >= 0
    assert SHARED_SESSION == SHARED and check_tree(loaded) == check_tree(cache.tree) == []


def test_inspect_shows_the_session_and_deadline_of_each_node(hinted):
    res = run("h.snapshot")
    assert res.exit_code == 0, res.output
    out = res.stdout
    assert "(v2, page size 4" in out
    by_edge = {ln.split("[")[1].split(" ")[0]: ln for ln in out.splitlines() if "── #" in ln}
    assert len(by_edge) == 5
    assert "  shared  " in by_edge["0"]
    assert "session chat-7, next use in 20.0 s" in by_edge["500"]
    assert "session done, closed (first to go)" in by_edge["900"]
    assert "session bye, closed (first to go)" in by_edge["3000"]
    assert by_edge["2000"].split("hits 0  ")[1].startswith("session 42  ")
    assert "next use" not in by_edge["2000"] and "session" not in by_edge["0"]
    summary = dict((ln[:10].strip(), ln[10:]) for ln in out.splitlines()[3:20] if ln[:10].strip())
    assert summary["sessions"] == "4 owning nodes (hint clock 10.0 s)"
    assert summary["private"] == "4 nodes, 28 tokens (one session's)"
    assert summary["shared"].startswith("1 node, 8 tokens")
    assert summary["retained"] == "1 node, 8 tokens (next use in 20.0 s)"
    assert summary["closed"] == "2 nodes, 12 tokens (session closed: first to go)"
    hot = run("h.snapshot", "--hot", "3", "--prefix", "0-7,500-507").stdout
    assert "session / hint" in hot and "shared" in hot
    assert "session chat-7, next use in 20.0 s" in hot      # the prompt's path


def test_inspect_json_carries_the_same_fields(hinted):
    res = run("h.snapshot", "--format", "json", "--hot", "5", "--prefix", "0-7,900-907")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["snapshot"]["hint_clock"] == 10.0
    assert [(s["session"], s["hint"]) for s in doc["prefix"]["path"]] == [
        (True, None), ("done", {"closed": True, "next_use": None, "in_s": None})]
    assert {(h["id"], h["session"]) for h in doc["hot"]} >= {(doc["prefix"]["path"][0]["id"],
                                                              True)}
    doc = json.loads(run("h.snapshot", "--format", "json").stdout)
    h = doc["summary"]["hints"]
    assert h == {"hint_clock": 10.0, "sessions": 4, "private": {"nodes": 4, "tokens": 28},
                 "shared": {"nodes": 1, "tokens": 8},
                 "ttl": {"nodes": 1, "tokens": 8, "next_use_in_s": [20.0, 20.0]},
                 "closed": {"nodes": 2, "tokens": 12},
                 "dropped_session": {"nodes": 0, "tokens": 0}}
    nodes = {}
    stack = list(doc["tree"])
    while stack:
        v = stack.pop()
        nodes[v["preview"][0] if v["preview"] else None] = v
        stack += v["children"]
    assert (nodes[0]["session"], nodes[0]["hint"]) == (True, None)
    assert (nodes[500]["session"], nodes[500]["hint"]) == \
        ("chat-7", {"closed": False, "next_use": 30.0, "in_s": 20.0})
    assert nodes[900]["hint"] == {"closed": True, "next_use": None, "in_s": None}
    assert (nodes[2000]["session"], nodes[2000]["hint"]) == (42, None)
    assert (nodes[None]["session"], nodes[None]["hint"]) == (None, None)     # the root


def test_a_session_the_bounded_book_dropped_keeps_its_hint(tmp_path):
    """The book keeps at most ``max_sessions``: a node of a dropped session is written with a
    nil session (its client key is gone) and its hint (it still orders eviction)."""
    from tests.factories import make_cache

    c = make_cache(page_size=4, real=False, l1_pages=16,
                   hint_kwargs={"min_evidence": 0, "max_sessions": 1})
    req(c, toks(0, 2), CacheHint("a", 30.0), t=0.0)
    req(c, toks(100, 2), CacheHint("b"), t=1.0)            # the book drops "a"
    a = node_of(c, toks(0, 2))
    assert a.session is not None and a.session != SHARED and a.hint_until == 30.0
    rec = {r.id: r for r in snapshot_of(c).nodes}
    assert (rec[a.id].session, rec[a.id].hint_until) == (None, 30.0)
    assert rec[node_of(c, toks(100, 2)).id].session == "b"
    write_snapshot(tmp_path / "d.snapshot", c)
    out = run(tmp_path / "d.snapshot").stdout
    assert "session (dropped from the cache's book), next use in 29.0 s" in out
    assert "1 node, 8 tokens hinted for a session the cache's book dropped" in out


def test_a_snapshot_without_hints_shows_nothing_new(tmp_path, monkeypatch):
    from tests.factories import make_cache, serve

    monkeypatch.chdir(tmp_path)
    c = make_cache(page_size=4, real=False, l1_pages=8)
    serve(c, np.arange(1, 13))
    write_snapshot("n.snapshot", c)
    snap = snapshot_of(c)
    assert "hint_clock" not in snap.header
    assert all(r.session is None and r.hint_until is None for r in snap.nodes)
    out = run("n.snapshot", "--hot", "3", "--prefix", "1-12").stdout
    out += run("n.snapshot").stdout
    for word in ("session", "shared", "hint", "closed", "retained", "private"):
        assert word not in out


# ------------------------------------------------------------------------- the format
ODD_KEYS = [0, 2**63 - 1, "x" * fmt.MAX_SESSION_KEY_CHARS, "chat 7\n", "Ünïcode", "42"]


def test_every_field_round_trips(tmp_path):
    recs = small_records()
    values = [(None, None), (True, None), (ODD_KEYS[0], 0.0), (ODD_KEYS[1], 12.5),
              (ODD_KEYS[2], math.inf), (ODD_KEYS[3], 1e9), (ODD_KEYS[4], None),
              (ODD_KEYS[5], 3.0), (ODD_KEYS[2], 7.0)]
    recs = [r._replace(session=s, hint_until=u) for r, (s, u) in zip(recs, values)]
    path = tmp_path / "a.snapshot"
    fmt.write_snapshot(path, small_header(hint_clock=5.5), recs)
    data = fmt.read_snapshot(path)
    assert data.header["hint_clock"] == 5.5 and data.header["version"] == fmt.VERSION == 2
    assert data.header["node_fields"] == fmt.NODE_FIELDS
    got = list(data.records())
    for a, b in zip(recs, got):
        assert (b.session, b.hint_until) == (a.session, a.hint_until)
        assert type(b.session) is type(a.session)          # "42" stays a string, 0 an int
        assert b._replace(session=None, hint_until=None, tokens=None, l1=None, l2=None) == \
            a._replace(session=None, hint_until=None, tokens=None, l1=None, l2=None)
    assert data.nodes.sessions.count(ODD_KEYS[2]) == 1      # one code per distinct key
    snap = load_snapshot(path)
    by_id = {n.id: n for n in snap.iter_nodes()}
    assert by_id[3].session == by_id[7].session >= 0 and by_id[3].session_key == ODD_KEYS[2]
    assert by_id[1].session == SHARED and by_id[1].session_key is True
    out = run(path).stdout
    assert "session 'chat 7\\n', next use in 999,999,994.5 s" in out   # quoted, escaped
    assert "session '42', next use was due 2.5 s ago" in out      # the string '42'
    assert "session '" + "x" * 39 + "…', next use in 1.5 s" in out     # cut to 40 characters
    assert "session 0, next use was due 5.5 s ago" in out


def test_the_writer_refuses_what_the_reader_would(tmp_path):
    for bad in ({"session": 1.5}, {"session": False}, {"session": ""}, {"session": -1},
                {"session": "x" * 257}, {"hint_until": math.nan}, {"hint_until": -1.0},
                {"hint_until": "soon"}):
        with pytest.raises(ValueError):
            fmt.encode_snapshot(small_header(), [R(0, None, t(1, 0), **bad)])
    with pytest.raises(FormatError, match="hint_clock"):
        small_header(hint_clock=math.nan)


def _raw(objs) -> bytes:
    pack = msgpack.Packer(use_bin_type=True).pack
    return b"".join(pack(o) for o in objs)


def _v1_header(**kw) -> dict:
    h = small_header()
    h.update(version=1, node_fields=list(fmt.NODE_FIELDS_V1), **kw)
    return h


V1_NODES = [[0, None, b"", None, None, None, 0, 0, 0, 0, 0, None, 0],
            [1, 0, t(1, 4).tobytes(), None, b"\0" * 8, None, 0, 0, 3, 1, 0, 0, 0]]


def test_a_version_1_file_still_loads(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "v1.snapshot").write_bytes(_raw([_v1_header(), *V1_NODES,
                                                 {"end": fmt.FORMAT_NAME, "nodes": 2}]))
    data = fmt.read_snapshot("v1.snapshot")
    assert [(r.session, r.hint_until) for r in data.records()] == [(None, None)] * 2
    assert [r.hit_count for r in data.records()] == [0, 3]
    snap = load_snapshot("v1.snapshot")
    assert all(n.session is None and n.hint_until is None for n in snap.iter_nodes())
    assert sv.summary(snap)["hints"]["private"] == {"nodes": 0, "tokens": 0}
    res = run("v1.snapshot", "--check")
    assert res.exit_code == 0 and "(v1, page size 4" in res.stdout
    assert "session" not in res.stdout
    doc = json.loads(run("v1.snapshot", "--format", "json").stdout)
    assert doc["snapshot"]["hint_clock"] is None and doc["tree"][0]["children"][0]["hint"] is None


def _v2(node=None, **header) -> bytes:
    h = small_header()
    h["node_fields"] = list(h["node_fields"])
    h.update(header)
    root = [0, None, b"", None, None, None, 0, 0, 0, 0, 0, None, 0, None, None]
    kid = [1, 0, t(1, 4).tobytes(), None, b"\0" * 8, None, 0, 0, 0, 0, 0, 0, 0, None, None]
    for k, v in (node or {}).items():
        kid[fmt.NODE_FIELDS.index(k)] = v
    return _raw([h, root, kid, {"end": fmt.FORMAT_NAME, "nodes": 2}])


BAD = {
    "session float": (_v2({"session": 1.5}), "node #1: field 'session' must be nil, true"),
    "session false": (_v2({"session": False}), "found bool False"),
    "session list": (_v2({"session": [1]}), "found tuple"),
    "session empty": (_v2({"session": ""}), "field 'session' key is an empty string"),
    "session too long": (_v2({"session": "k" * 300}), "key is 300 characters long, at most 256"),
    "session negative": (_v2({"session": -3}), "key must be an integer in [0, 2**63), found -3"),
    "session huge": (_v2({"session": 2**64 - 1}), "key must be an integer in [0, 2**63)"),
    "hint NaN": (_v2({"hint_until": math.nan}), "node #1: field 'hint_until' must be seconds"),
    "hint negative": (_v2({"hint_until": -1.0}), "found float -1.0"),
    "hint -inf": (_v2({"hint_until": -math.inf}), "found float -inf"),
    "hint text": (_v2({"hint_until": "soon"}), "found str 'soon'"),
    "hint bool": (_v2({"hint_until": True}), "found bool True"),
    "hint_clock NaN": (_v2(hint_clock=math.nan), "header hint_clock must be seconds >= 0"),
    "hint_clock text": (_v2(hint_clock="10"), "header hint_clock must be seconds >= 0"),
    "hint_clock negative": (_v2(hint_clock=-1.0), "header hint_clock must be seconds >= 0"),
    "v1 header with hint_clock": (_raw([_v1_header(hint_clock=1.0), *V1_NODES]),
                                  "unknown header field(s) ['hint_clock'] in a version 1"),
    "v1 header with v2 fields": (_raw([{**_v1_header(), "node_fields": list(fmt.NODE_FIELDS)},
                                       *V1_NODES]),
                                 "unknown node field(s) ['session', 'hint_until'] for a "
                                 "version 1 snapshot"),
    "v1 header, v2 nodes": (_raw([_v1_header(), V1_NODES[0] + [None, None]]),
                            "node #0 has 15 fields, version 1 nodes have 13"),
    "v2 header, v1 fields": (_v2(node_fields=list(fmt.NODE_FIELDS_V1)),
                             "missing node field(s) ['session', 'hint_until'] for a version 2"),
    "v2 header, v1 nodes": (_raw([{**small_header(), "node_fields": list(fmt.NODE_FIELDS)},
                                  *V1_NODES]), "node #0 has 13 fields, version 2 nodes have 15"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_malformed_hints_are_one_line_exit_1(tmp_path, monkeypatch, case):
    monkeypatch.chdir(tmp_path)
    blob, expect = BAD[case]
    (tmp_path / "x.snapshot").write_bytes(blob)
    with pytest.raises(FormatError):
        fmt.read_snapshot("x.snapshot")
    for form in ("human", "json"):
        res = run("x.snapshot", "--format", form)
        assert res.exit_code == 1 and res.stdout == ""
        assert res.stderr.startswith("error: x.snapshot: ") and expect in res.stderr, \
            res.stderr
        assert res.stderr.count("\n") == 1 and "Traceback" not in res.stderr


def test_check_flags_a_shared_node_holding_a_hint(tmp_path):
    recs = small_records()
    recs[2] = recs[2]._replace(session=True, hint_until=5.0)      # node 2
    path = tmp_path / "s.snapshot"
    fmt.write_snapshot(path, small_header(hint_clock=1.0), recs)
    res = run(path, "--check")
    assert res.exit_code == 3
    assert "hints: node 2 is shared by several sessions but holds a hint" in res.stderr


# ------------------------------------------------------------------------- the writers
def test_bench_replay_dump_tree_with_hints(tmp_path, monkeypatch):
    """``bench replay --hints on --dump-tree``: the snapshot holds the trace's sessions (the
    annotated trace's hash-id chains), its shared system prompt and its closed sessions."""
    monkeypatch.chdir(tmp_path)
    cli = CliRunner()
    head = "tests/data/conversation_trace_head400.jsonl.gz"
    r = cli.invoke(app, ["bench", "convert-trace", os.path.join(ROOT, head), "conv.jsonl.gz",
                         "--annotate-sessions"])
    assert r.exit_code == 0, r.output
    r = cli.invoke(app, ["bench", "replay", "conv.jsonl.gz", "--hints", "on", "--page-size",
                         "512", "--l1-tokens", "200000", "--l2-tokens", "400000",
                         "--dump-tree", "r.snapshot"])
    assert r.exit_code == 0, r.output
    doc = json.loads(run("r.snapshot", "--format", "json").stdout)
    h = doc["summary"]["hints"]
    assert h["sessions"] > 10 and h["shared"]["nodes"] >= 1 and h["closed"]["nodes"] >= 1, h
    assert h["private"]["nodes"] + h["shared"]["nodes"] == doc["summary"]["nodes"]
    assert doc["snapshot"]["hint_clock"] > 0
    system = doc["tree"][0]["children"][0]                 # every chat starts with it
    assert system["session"] is True and system["hits"] > 300
    out = run("r.snapshot").stdout
    assert f"sessions  {h['sessions']} owning nodes (hint clock" in out
    off = cli.invoke(app, ["bench", "replay", "conv.jsonl.gz", "--page-size", "512",
                           "--l1-tokens", "200000", "--dump-tree", "plain.snapshot"])
    assert off.exit_code == 0
    assert "session" not in run("plain.snapshot").stdout


@pytest.mark.parametrize("trust", ["earned", "always"])
def test_server_dump_tree_carries_the_sessions(tmp_path, trust):
    """``POST /dump_tree`` of a server that got session hints: the sessions' keys are in the
    snapshot and the hint clock is set; a deadline only where the server applied the
    retentions (``--hint-trust always``; ``earned``: nothing proved right yet, none)."""
    from tests.test_cache_hints_api import _post, _server

    rng = np.random.default_rng(3)
    system = rng.integers(0, 256, 32).tolist()
    sp = {"max_new_tokens": 2, "temperature": 0}
    h = _server(page_size=16, hint_trust=trust)
    try:
        for key, tail in (("chat-7", 1), ("other", 2)):
            body = {"input_ids": system + [tail] * 32, "sampling_params": sp,
                    "session_id": key,
                    "nvext": {"cache_control": {"type": "ephemeral", "ttl": "30s"}}}
            assert _post(h, "/generate", body).status_code == 200
        r = requests.post(h.url + "/dump_tree", timeout=60)
        assert r.status_code == 200
    finally:
        h.stop()
    (tmp_path / "srv.snapshot").write_bytes(r.content)
    doc = json.loads(run(tmp_path / "srv.snapshot", "--format", "json").stdout)
    assert doc["snapshot"]["hint_clock"] is not None
    hs = doc["summary"]["hints"]
    assert hs["sessions"] == 2 and hs["shared"]["nodes"] >= 1, hs
    assert hs["closed"]["nodes"] == 0, hs
    keys, hinted = set(), {}
    stack = list(doc["tree"])
    while stack:
        v = stack.pop()
        keys.add(v["session"])
        if v["hint"] is not None:
            hinted[v["session"]] = v["hint"]
        stack += v["children"]
    assert {"chat-7", "other", True} <= keys
    if trust == "earned":
        assert hs["ttl"]["nodes"] == 0 and not hinted, hs      # nothing trusted yet
    else:                                  # each session's own 32 tokens: next use in ~30 s
        assert hs["ttl"]["nodes"] >= 2 and set(hinted) == {"chat-7", "other"}, hs
        assert all(not x["closed"] and 25 < x["in_s"] <= 30 for x in hinted.values()), hinted
