"""Cache namespaces never share KV (docs/model-and-server.md, "Cache namespaces").

A namespace is every namespace field a request sets, all together (engine.core.namespace): the
same value under two fields, or one field more or less, is another namespace. Checked for every
pair of the namespaces below in every tier: L1 through the real HTTP server, L2 after eviction
in the cache facade, L3 through a second server process-local engine over the same file store
(so its hits can only come from L3), after ``convert-layout``, and on a TP group.
"""

from __future__ import annotations

import itertools
import os
import pickle

import numpy as np
import pytest
import requests

from engine.core.errors import InputError
from engine.core.hashing import namespace_seed, page_hashes
from engine.core.namespace import FIELDS, Namespace, as_namespace, from_wire, parse_text, text_of
from engine.runtime.launch import ServerConfig, start_server
from engine.runtime.serving.protocol import parse_chat, parse_completions, parse_generate
from engine.runtime.tokenizer import ByteTokenizer
from tests.factories import make_cache, serve

# The namespaces as request bodies send them: the same value "A" under every field, one field
# more (the adapter X, then Y, with salt A), SGLang's lora_id, and the default (no field).
NAMESPACES = {
    "default": {},
    "lora_path=A": {"lora_path": "A"},
    "lora_id=A": {"lora_id": "A"},
    "cache_salt=A": {"cache_salt": "A"},
    "extra_key=A": {"extra_key": "A"},
    "namespace=A": {"namespace": "A"},
    "lora_id=L1": {"lora_id": "L1"},
    "lora_id=L2": {"lora_id": "L2"},
    "cache_salt=A+lora_path=X": {"cache_salt": "A", "lora_path": "X"},
    "cache_salt=A+lora_path=Y": {"cache_salt": "A", "lora_path": "Y"},
}
NAMES = list(NAMESPACES)
PAIRS = list(itertools.combinations(NAMES, 2))
PAGE = 16
PROMPT_PAGES = 24                      # 384 tokens: the "384 cached tokens"


def typed(name: str) -> Namespace | None:
    return as_namespace(Namespace(**NAMESPACES[name]))


def prompt(i: int) -> list[int]:
    """A prompt of PROMPT_PAGES full pages (byte tokens) that shares not even its first token
    with another index's: within one namespace, partial last-page reuse copies the KV of any
    common start of a cached page (a shared BOS would be one token of it)."""
    assert 0 <= i < 256
    rng = np.random.default_rng(1000 + i)
    return [i] + rng.integers(0, 256, PROMPT_PAGES * PAGE - 1).tolist()


def gen(url: str, ids: list[int], ns: dict, n: int = 1) -> dict:
    r = requests.post(url + "/generate", json={"input_ids": ids, **ns, "sampling_params": {
        "max_new_tokens": n, "temperature": 0}}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def cached(out: dict, tier: str | None = None) -> int:
    m = out["meta_info"]
    return m["cached_tokens"] if tier is None else m["cached_tokens_details"][tier]


# -- the value: seeds, text, wire ---------------------------------------------------------------
def test_every_namespace_has_its_own_seed_and_text():
    seeds = {n: namespace_seed(typed(n)) for n in NAMES}
    assert seeds["default"] is None
    assert len(set(seeds.values())) == len(NAMES)
    texts = {n: text_of(typed(n)) for n in NAMES}
    assert len(set(texts.values())) == len(NAMES)
    for n in NAMES:
        assert parse_text(texts[n]) == typed(n)
        assert from_wire(None if typed(n) is None else typed(n).to_wire()) == typed(n)
    assert texts["cache_salt=A+lora_path=X"] == 'lora_path="X" cache_salt="A"'
    ns = typed("cache_salt=A+lora_path=X")        # what CP/TP/PP ranks broadcast
    assert pickle.loads(pickle.dumps(ns)) == ns and hash(pickle.loads(pickle.dumps(ns))) == hash(ns)
    assert texts["namespace=A"] == "A"             # what snapshots always showed for a name


@pytest.mark.parametrize("a, b", [
    ({"cache_salt": "ab", "extra_key": "c"}, {"cache_salt": "a", "extra_key": "bc"}),
    ({"cache_salt": "a\x00extra_key"}, {"cache_salt": "a", "extra_key": ""}),
    ({"namespace": 'x" cache_salt="y'}, {"namespace": "x", "cache_salt": "y"}),
    ({"lora_path": "A"}, {"lora_id": "A"}),
])
def test_seeds_are_not_joined_strings(a, b):
    """Values that would concatenate (or render) alike still seed different chains."""
    na = as_namespace(Namespace(**{k: v for k, v in a.items() if v}))
    nb = as_namespace(Namespace(**{k: v for k, v in b.items() if v}))
    assert na != nb and namespace_seed(na) != namespace_seed(nb)
    assert text_of(na) != text_of(nb) and parse_text(text_of(na)) == na
    toks = np.arange(8)
    assert page_hashes(toks, 4, namespace_seed(na)) != page_hashes(toks, 4, namespace_seed(nb))


def test_bad_namespace_text_and_wire_are_refused():
    for text in ('cache_salt=A', 'colour="red"', 'cache_salt="A" cache_salt="B"'):
        with pytest.raises(ValueError):
            parse_text(text)
    for wire in ({"colour": "red"}, ["A"], {"cache_salt": ""}, {"cache_salt": 3}):
        with pytest.raises((ValueError, TypeError)):
            from_wire(wire)


# -- request fields --------------------------------------------------------------------------
TOK = ByteTokenizer()


@pytest.mark.parametrize("name", NAMES)
def test_every_route_reads_every_field(name):
    body = NAMESPACES[name]
    want = typed(name)
    assert parse_generate({"input_ids": [1, 2], **body}, TOK).namespace == want
    assert parse_completions({"prompt": [1, 2], **body}, TOK).namespace == want
    msgs = [{"role": "user", "content": "hi"}]
    assert parse_chat({"messages": msgs, **body}, TOK).namespace == want


@pytest.mark.parametrize("field", ["lora_name", "lora_int_id", "lora_request"])
def test_adapter_fields_this_server_does_not_honour_are_refused(field):
    for parse, body in ((parse_generate, {"input_ids": [1, 2]}),
                        (parse_completions, {"prompt": [1, 2]})):
        with pytest.raises(InputError, match=field):
            parse({**body, field: "A"}, TOK)


@pytest.mark.parametrize("field", FIELDS)
def test_empty_long_or_non_string_fields_are_refused(field):
    for bad in ("", "x" * 1025, 7, ["A"]):
        with pytest.raises(InputError, match=field):
            parse_generate({"input_ids": [1, 2], field: bad}, TOK)


# -- L1: the real server ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def server():
    with start_server(ServerConfig(port=0, l1_tokens=8192, l2_tokens=0, page_size=PAGE)) as s:
        yield s


@pytest.mark.parametrize("a, b", PAIRS, ids=[f"{a}|{b}" for a, b in PAIRS])
def test_l1_pair_never_shares(server, a, b):
    """Same prompt in namespace a, then b: b computes every token (and so does a after b);
    a again hits its own whole prefix."""
    ids = prompt(PAIRS.index((a, b)))
    assert cached(gen(server.url, ids, NAMESPACES[a])) == 0
    assert cached(gen(server.url, ids, NAMESPACES[b])) == 0
    assert cached(gen(server.url, ids, NAMESPACES[a]), "device") >= (PROMPT_PAGES - 1) * PAGE


def test_openai_routes_refuse_another_model_name(server):
    """vLLM selects an adapter with ``model``; this server has none, so another name is a 400
    naming the field, not the base model's cache under the adapter's name."""
    for route, body in (("/v1/completions", {"prompt": "hi", "max_tokens": 1}),
                        ("/v1/chat/completions",
                         {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})):
        r = requests.post(server.url + route, json={**body, "model": "my-adapter"}, timeout=60)
        assert r.status_code == 400 and "'model'" in r.text, r.text
        tok_path = requests.get(server.url + "/model_info", timeout=30).json()["tokenizer_path"]
        for name in ("tiny", tok_path):   # the served name, or the path clients load it from
            ok = requests.post(server.url + route, json={**body, "model": name}, timeout=60)
            assert ok.status_code == 200, ok.text
    r = requests.post(server.url + "/generate", json={"input_ids": [1, 2], "lora_name": "A"},
                      timeout=60)
    assert r.status_code == 400 and "lora_name" in r.text


# -- L2: after eviction from L1 -----------------------------------------------------------------
@pytest.mark.parametrize("a, b", PAIRS, ids=[f"{a}|{b}" for a, b in PAIRS])
def test_l2_pair_never_shares_after_eviction(a, b):
    c = make_cache(page_size=4, l1_pages=4, l2_pages=32)
    toks = np.arange(16)
    serve(c, toks, namespace=typed(a))
    c.wait_all()
    serve(c, np.arange(100, 116))            # pushes a's pages out of L1 (still on L2)
    c.wait_all()
    assert c.match(toks, namespace=typed(b)).hit_len == 0
    m = c.match(toks, namespace=typed(a))
    assert m.l1_len == 0 and m.l2_len == 16          # a's own KV: from L2 only


# -- L3: a restarted server over the same file store, and after convert-layout -----------------
def l3_server(root, **kw) -> ServerConfig:
    return ServerConfig(port=0, l1_tokens=1024, l2_tokens=2048, page_size=PAGE,
                        hicache_storage_backend="file", hicache_storage_dir=str(root),
                        hicache_storage_prefetch_policy="wait_complete", **kw)


def _write_each(root, **kw) -> dict[str, list[int]]:
    """Namespace i writes prompt i (its greedy output is the uncached one: nothing shared)."""
    outs = {}
    with start_server(l3_server(root, **kw)) as s:
        for i, n in enumerate(NAMES):
            outs[n] = gen(s.url, prompt(i), NAMESPACES[n], n=4)["output_ids"]
    return outs


def _read_others_then_own(root, outs, **kw) -> None:
    with start_server(l3_server(root, **kw)) as s:
        for (i, w), r in itertools.product(enumerate(NAMES), NAMES):
            if r != w:
                out = gen(s.url, prompt(i), NAMESPACES[r], n=4)
                assert cached(out) == 0, f"{r} hit what {w} stored"
        for i, w in enumerate(NAMES):
            out = gen(s.url, prompt(i), NAMESPACES[w], n=4)
            assert cached(out, "storage") >= (PROMPT_PAGES - 1) * PAGE, w
            assert out["output_ids"] == outs[w]


def test_l3_pairs_never_share_after_restart(tmp_path):
    _read_others_then_own(tmp_path, _write_each(tmp_path))


def test_l3_pairs_never_share_after_convert_layout(tmp_path):
    from typer.testing import CliRunner

    from hicache_cli.app import app

    legacy, unified = tmp_path / "legacy", tmp_path / "unified"
    outs = _write_each(legacy, hicache_storage_layout="legacy")
    res = CliRunner().invoke(app, ["convert-layout", str(legacy), str(unified), "--to",
                                   "unified"])
    assert res.exit_code == 0, res.output
    assert os.listdir(unified / "objects")
    _read_others_then_own(unified, outs)


# -- a TP group ---------------------------------------------------------------------------------
def test_tp2_namespaces_never_share(tmp_path):
    cfg = l3_server(tmp_path, tp=2, collective_timeout_s=60)
    ids = prompt(99)
    with start_server(cfg) as s:
        first = gen(s.url, ids, {"cache_salt": "A"}, n=4)
        assert cached(gen(s.url, ids, {"lora_path": "A"})) == 0
        assert cached(gen(s.url, ids, {"cache_salt": "A", "lora_path": "X"})) == 0
        assert cached(gen(s.url, ids, {"cache_salt": "A"})) >= (PROMPT_PAGES - 1) * PAGE
    with start_server(cfg) as s:               # L3 only
        assert cached(gen(s.url, ids, {"extra_key": "A"})) == 0
        again = gen(s.url, ids, {"cache_salt": "A"}, n=4)
        assert cached(again, "storage") >= (PROMPT_PAGES - 1) * PAGE
        assert again["output_ids"] == first["output_ids"]


# -- P/D: the namespace crosses the link -------------------------------------------------------
def test_pd_namespaces_never_share():
    cfg = ServerConfig(model="tiny", port=0, page_size=PAGE, l1_tokens=4096, l2_tokens=8192,
                       chunked_prefill_size=128, disaggregation="pd", pd_transfer_timeout=60.0)
    ids = prompt(98)
    with start_server(cfg) as s:
        first = gen(s.url, ids, {"cache_salt": "A", "lora_path": "X"}, n=4)
        for other in ({"cache_salt": "A"}, {"lora_path": "A"}, {"lora_path": "X"}, {}):
            out = gen(s.url, ids, other)
            assert cached(out) == 0 and out["meta_info"]["pd_transfer"]["prefill_cached"] == 0
        again = gen(s.url, ids, {"lora_path": "X", "cache_salt": "A"}, n=4)
        assert cached(again) >= (PROMPT_PAGES - 1) * PAGE
        assert again["output_ids"] == first["output_ids"]


# -- snapshots and hicache inspect show the fields ---------------------------------------------
def test_inspect_shows_and_selects_namespaces_by_their_fields(tmp_path):
    import json

    from typer.testing import CliRunner

    from engine.snapshot.take import write_snapshot
    from hicache_cli.app import app

    c = make_cache(page_size=4, l1_pages=16)
    toks = np.arange(12)
    serve(c, toks, namespace=typed("cache_salt=A+lora_path=X"))
    serve(c, toks[:8], namespace=typed("lora_path=A"))
    path = tmp_path / "t.snapshot"
    write_snapshot(path, c)
    res = CliRunner().invoke(app, ["inspect", str(path)])
    assert res.exit_code == 0, res.output
    assert 'namespace lora_path="X" cache_salt="A"' in res.output
    assert 'namespace lora_path="A"' in res.output
    prefix = ",".join(map(str, toks.tolist()))
    for text, hit in (('cache_salt="A" lora_path="X"', 12), ('lora_path="A"', 8),
                      ('cache_salt="A"', 0), ("A", 0), (None, 0)):
        args = ["inspect", str(path), "--prefix", prefix, "--format", "json"]
        res = CliRunner().invoke(app, args + (["--namespace", text] if text else []))
        assert res.exit_code == 0, res.output
        assert json.loads(res.stdout)["prefix"]["l1_len"] == hit, text
    res = CliRunner().invoke(app, ["inspect", str(path), "--prefix", prefix, "--namespace",
                                   'colour="red"'])
    assert res.exit_code == 2 or res.exit_code == 1
    assert "colour" in res.output and "Traceback" not in res.output
