"""Tree snapshots: the format's round trip, snapshots of a real cache, and bad input."""

from __future__ import annotations

import io
import pickle

import msgpack
import numpy as np
import pytest

from checkers.invariants import check_tree
from engine.core.errors import InputError
from engine.core.namespace import text_of
from engine.snapshot import views as sv
from engine.snapshot.take import load_snapshot, snapshot_bytes, snapshot_of, write_snapshot
from formats import snapshot as fmt
from formats.errors import FormatError
from formats.snapshot import NodeRecord as R
from tests.factories import make_cache, serve

CREATED = 1_700_000_000.0


def t(a: int, b: int) -> np.ndarray:
    return np.arange(a, b + 1, dtype=np.uint32)


def small_records() -> list[R]:
    """Page size 4, two namespaces, every tier, locks, a CP restart (node 7).

    default:  #1 [1..8] L1+L2, L3 2/2, lock 1, hits 5, owner 0
                ├─ #2 [9..12] L1+L2, lock 1, hits 3, owner 2
                │    └─ #4 [30..33] L2, owner 3
                └─ #3 [20..27] L2, hits 1, owner 2
                     └─ #8 [50..57] L3 1/2, owner 4
    lora-a:   #6 [1..4] L1, hits 2, owner 0
                └─ #7 [40..47] L1, hits 1, owner 0 (the rotation would continue with 1)
    """
    return [
        R(0, None, t(1, 0)),
        R(1, 0, t(1, 8), None, [0, 1], [0, 1], 2, 1, 5, 10, 0, 0),
        R(2, 1, t(9, 12), None, [2], [2], 0, 1, 3, 11, 0, 2),
        R(4, 2, t(30, 33), None, None, [5], 0, 0, 0, 6, 0, 3),
        R(3, 1, t(20, 27), None, None, [3, 4], 0, 0, 1, 5, 0, 2),
        R(8, 3, t(50, 57), None, None, None, 1, 0, 0, 4, 0, 4),
        R(5, None, t(1, 0), "lora-a"),
        R(6, 5, t(1, 4), "lora-a", [3], None, 0, 0, 2, 12, 0, 0),
        R(7, 6, t(40, 47), "lora-a", [4, 5], None, 0, 0, 1, 13, 0, 0),
    ]


def small_header(**kw) -> dict:
    args = dict(created_at=CREATED, model="tiny",
                rank={"rank": 0, "world_size": 2, "cp_rank": 0, "cp_size": 2},
                capacity={"l1": 32, "l2": 64})
    args.update(kw)
    return fmt.make_header(4, **args)


def write_small(path, records=None, **header_kw) -> str:
    fmt.write_snapshot(path, small_header(**header_kw),
                       small_records() if records is None else records)
    return str(path)


def _same_record(a: R, b: R) -> None:
    for field in R._fields:
        x, y = getattr(a, field), getattr(b, field)
        if field in ("tokens", "l1", "l2"):
            if x is None or y is None:
                assert x is None and y is None, (a.id, field)
            else:
                assert np.array_equal(np.asarray(x), np.asarray(y)), (a.id, field)
        else:
            assert x == y, (a.id, field, x, y)


# ------------------------------------------------------------------------- round trips
def test_records_round_trip(tmp_path):
    path = write_small(tmp_path / "a.snapshot")
    data = fmt.read_snapshot(path)
    assert data.header == {**small_header(), "node_fields": tuple(fmt.NODE_FIELDS)}
    got = list(data.records())
    assert [r.id for r in got] == [0, 1, 2, 4, 3, 8, 5, 6, 7]
    for a, b in zip(small_records(), got):
        _same_record(a, b)
    assert got[1].l1.dtype == np.int64 and got[1].tokens.dtype == np.uint32


def test_encode_is_deterministic_and_matches_file(tmp_path):
    path = write_small(tmp_path / "a.snapshot")
    blob = fmt.encode_snapshot(small_header(), small_records())
    assert open(path, "rb").read() == blob
    assert fmt.read_snapshot(io.BytesIO(blob)).header["page_size"] == 4


def test_loaded_view_has_the_tree_attributes(tmp_path):
    snap = load_snapshot(write_small(tmp_path / "a.snapshot"))
    assert snap.page_size == 4 and snap.num_nodes == 7
    assert set(snap.roots) == {None, "lora-a"}
    n1 = snap.roots[None].children[t(1, 4).tobytes()]
    assert (n1.id, n1.lock_ref, n1.hit_count, n1.last_access, n1.l3, n1.cp_owner) == \
        (1, 1, 5, 10, 2, 0)
    assert n1.l1.tolist() == [0, 1] and n1.n_l1_children == 1
    assert [n.id for n in snap.iter_nodes()] and {n.id for n in snap.iter_nodes()} == \
        {1, 2, 3, 4, 6, 7, 8}
    assert check_tree(snap) == []


def _live_and_loaded(cache, loaded) -> None:
    live = {n.id: n for n in cache.tree.iter_nodes()}
    got = {n.id: n for n in loaded.iter_nodes()}
    assert live.keys() == got.keys() and len(live) > 3
    for nid, a in live.items():
        b = got[nid]
        assert np.array_equal(a.tokens, b.tokens)
        assert a.parent.id == b.parent.id and text_of(a.namespace) == b.namespace  # its text
        for tier in ("l1", "l2"):
            x, y = getattr(a, tier), getattr(b, tier)
            assert (x is None) == (y is None) and (x is None or np.array_equal(x, y))
        assert (a.l3, a.lock_ref, a.hit_count, a.last_access, a.priority, a.cp_owner) == \
            (b.l3, b.lock_ref, b.hit_count, b.last_access, b.priority, b.cp_owner)
        assert a.n_l1_children == b.n_l1_children
        assert {k: v.id for k, v in a.children.items()} == \
            {k: v.id for k, v in b.children.items()}
    assert loaded.num_nodes == cache.tree.num_nodes
    assert {text_of(ns): r.id for ns, r in cache.tree.roots.items()} == \
        {ns: r.id for ns, r in loaded.roots.items()}


def test_round_trip_of_a_real_cache(tmp_path):
    cache = make_cache(page_size=4, l1_pages=10, l2_pages=24, real=False)
    rng = np.random.default_rng(7)
    system = np.arange(100, 116)
    for k in range(12):
        ns = "lora-a" if k % 4 == 3 else None
        serve(cache, np.concatenate([system, rng.integers(0, 40, 4 + 4 * (k % 3))]),
              namespace=ns, rid=k)
    cache.wait_all()
    cache.poll()
    prompts = [np.concatenate([system, [1, 2, 3, 4]]), system[:9],
               np.concatenate([system, rng.integers(0, 40, 12)])]
    write_snapshot(tmp_path / "before.snapshot", cache)
    before = load_snapshot(tmp_path / "before.snapshot")
    for prompt in prompts:  # the snapshot predicts what the live match returns
        want = cache.match(prompt)
        got = sv.match(before, prompt)
        assert (got["l1_len"], got["l2_len"], got["l3_len"]) == \
            (want.l1_len, want.l2_len, want.l3_len)
    m = cache.match(prompts[0], rid="held")
    receipt = cache.lock(m)  # one request still holds its prefix
    path = tmp_path / "live.snapshot"
    n = write_snapshot(path, cache, meta={"source": "test", "model": "tiny"})
    assert n == cache.tree.num_nodes + len(cache.tree.roots)
    loaded = load_snapshot(path)
    _live_and_loaded(cache, loaded)
    assert check_tree(loaded) == check_tree(cache.tree) == []
    h = loaded.header
    assert h["capacity"] == {"l1": 40, "l2": 96, "l3": None}
    assert h["model"] == {"name": "tiny", "layout": None}
    assert h["meta"]["source"] == "test" and h["meta"]["eviction_policy"] == "lru"
    assert h["rank"]["world_size"] == 1 and h["rank"]["cp_size"] == 1
    s = sv.summary(loaded)
    assert s["nodes"] == cache.tree.num_nodes
    assert s["tiers"]["L1"]["tokens"] == cache.stats()["l1_used_tokens"]
    assert s["locked_tokens"] == m.l1_len + m.l2_len == 16
    cache.unlock(receipt)
    # the in-memory form is the same snapshot
    again = snapshot_of(cache, {"created_at": CREATED})
    blob = snapshot_bytes(cache, {"created_at": CREATED})
    assert blob == fmt.encode_snapshot(again.header, again.nodes)


def test_snapshot_of_a_bare_tree_and_a_kv_cache(tmp_path):
    cache = make_cache(page_size=4, l1_pages=8, real=True)
    serve(cache, np.arange(1, 13))
    snap = snapshot_of(cache.tree)
    assert snap.header["capacity"] == {"l1": None, "l2": None, "l3": None}
    assert [r.id for r in snap.nodes][0] == cache.tree.roots[None].id
    full = snapshot_of(cache)
    assert full.header["model"]["layout"]["num_layers"] == 2
    write_snapshot(tmp_path / "kv.snapshot", cache)
    assert sv.summary(load_snapshot(tmp_path / "kv.snapshot"))["tokens"] == 12


def test_inflight_load_is_recorded_and_not_a_hit(tmp_path):
    recs = small_records()
    recs[1] = recs[1]._replace(inflight=fmt.INFLIGHT_LOAD)   # node 1 still loading into L1
    snap = load_snapshot(write_small(tmp_path / "a.snapshot", recs))
    m = sv.match(snap, np.concatenate([t(1, 12)]))
    assert (m["l1_len"], m["l2_len"]) == (0, 12)
    assert sv.summary(snap)["loading_tokens"] == 8


# ------------------------------------------------------------------------- bad input
def _raw(objs) -> bytes:
    pack = msgpack.Packer(use_bin_type=True).pack
    return b"".join(pack(o) for o in objs)


def _node(i, parent, toks=b"", **kw):
    rec = [i, parent, toks, None, None, None, 0, 0, 0, 0, 0, None, 0, None, None]
    for k, v in kw.items():
        rec[fmt.NODE_FIELDS.index(k)] = v
    return rec


def _header(**kw):
    h = small_header()
    h["node_fields"] = list(h["node_fields"])
    h.update(kw)
    return h


GOOD = [_header(), _node(0, None), _node(1, 0, t(1, 4).tobytes(), l1=b"\0" * 8),
        {"end": fmt.FORMAT_NAME, "nodes": 2}]
BLOB = _raw(GOOD)

BAD = {
    "empty": (b"", "empty file"),
    "json": (b'{"format": "hicache-tree-snapshot"}\n', "not a hicache-tree-snapshot"),
    "pickle": (pickle.dumps({"format": fmt.FORMAT_NAME}), "not a hicache-tree-snapshot"),
    "garbage": (bytes(range(256)) * 4, "not a hicache-tree-snapshot"),
    "rank log": (_raw([{"format": "hicache-ranklog", "version": 1}]),
                 "not a hicache-tree-snapshot"),
    "truncated in a node": (BLOB[:-20], "truncated"),
    "truncated before the end": (_raw(GOOD[:-1]), "truncated snapshot (no end marker; 2 "
                                                  "complete nodes read)"),
    "truncated header": (BLOB[:30], "truncated snapshot (incomplete header)"),
    "newer version": (_raw([_header(version=3)] + GOOD[1:]), "version 3 is newer"),
    "unknown header field": (_raw([_header(colour="red")] + GOOD[1:]),
                             "unknown header field(s) ['colour']"),
    "missing header field": (_raw([{k: v for k, v in _header().items() if k != "capacity"}]
                                  + GOOD[1:]), "lacks field(s) ['capacity']"),
    "unknown node field": (_raw([_header(node_fields=list(fmt.NODE_FIELDS) + ["colour"])]
                                + GOOD[1:]), "unknown node field(s) ['colour']"),
    "node with an extra field": (_raw(GOOD[:2] + [_node(1, 0) + ["x"]] + GOOD[3:]),
                                 "node #1 has 16 fields"),
    "tokens as text": (_raw(GOOD[:2] + [_node(1, 0, "abcd")] + GOOD[3:]),
                       "'tokens' must be raw bytes"),
    "ragged tokens": (_raw(GOOD[:2] + [_node(1, 0, b"abcde")] + GOOD[3:]),
                      "not a multiple of 4 bytes"),
    "float count": (_raw(GOOD[:2] + [_node(1, 0, hit_count=1.5)] + GOOD[3:]),
                    "'hit_count' must be an integer, found float 1.5"),
    "negative owner": (_raw(GOOD[:2] + [_node(1, 0, cp_owner=-1)] + GOOD[3:]),
                       "'cp_owner' must be >= 0 or nil"),
    "namespace not text": (_raw(GOOD[:2] + [_node(1, 0, namespace=7)] + GOOD[3:]),
                           "'namespace' must be a string or nil"),
    "duplicate id": (_raw(GOOD[:2] + [_node(0, 0)] + GOOD[3:]), "node id 0 appears twice"),
    "unknown parent": (_raw(GOOD[:2] + [_node(1, 9)] + GOOD[3:]), "unknown parent 9"),
    "child first": (_raw([GOOD[0], _node(1, 0), _node(0, None), GOOD[3]]),
                    "comes before its parent"),
    "two roots": (_raw([GOOD[0], _node(0, None), _node(1, None), GOOD[3]]),
                  "two roots for namespace None"),
    "wrong count": (_raw(GOOD[:-1] + [{"end": fmt.FORMAT_NAME, "nodes": 3}]),
                    "end marker says 3 nodes, the file holds 2"),
    "data after the end": (BLOB + _raw([1]), "data after the end marker"),
    "ext type": (_raw(GOOD[:2]) + b"\xd4\x01\x00" + _raw(GOOD[3:]), "corrupt snapshot"),
    "huge string": (_raw([_header(model={"name": "x" * (fmt.MAX_STR_BYTES + 1),
                                         "layout": None})] + GOOD[1:]),
                    "not a hicache-tree-snapshot"),
    # a timestamp no date can show was a traceback (1e300) or "Invalid value NaN", exit 2
    "created_at NaN": (_raw([_header(created_at=float("nan"))] + GOOD[1:]),
                       "header created_at must be unix seconds"),
    "created_at huge": (_raw([_header(created_at=1e300)] + GOOD[1:]),
                        "header created_at must be unix seconds"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_one_clear_error(tmp_path, case):
    blob, expect = BAD[case]
    path = tmp_path / "bad.snapshot"
    path.write_bytes(blob)
    with pytest.raises(FormatError) as exc:
        fmt.read_snapshot(path)
    msg = str(exc.value)
    assert expect in msg and "\n" not in msg and msg.startswith(str(path))
    with pytest.raises(InputError, match="bad.snapshot"):
        load_snapshot(path)


def test_good_blob_reads_and_node_limit(tmp_path):
    assert len(fmt.read_snapshot(io.BytesIO(BLOB)).nodes) == 2
    with pytest.raises(FormatError, match="more than 1 nodes"):
        fmt.read_snapshot(io.BytesIO(BLOB), max_nodes=1)


def test_broken_tree_still_loads_for_the_checker(tmp_path):
    recs = small_records()
    recs[5] = recs[5]._replace(tokens=t(50, 55))      # node 8: 6 tokens, not page-aligned
    snap = load_snapshot(write_small(tmp_path / "a.snapshot", recs))
    assert any("node 8 edge of 6 tokens" in p for p in check_tree(snap))


def test_checker_sees_l3_beyond_the_edge_and_a_root_with_tokens(tmp_path):
    recs = small_records()
    recs[1] = recs[1]._replace(l3=9)                  # node 1 has 2 pages, records 9 in L3
    recs[6] = recs[6]._replace(tokens=t(1, 4))        # the lora-a root carries a page
    snap = load_snapshot(write_small(tmp_path / "a.snapshot", recs))
    problems = check_tree(snap)
    assert any("node 1 records 9 L3 pages for 2 pages" in p for p in problems)
    assert any("root 5 of namespace 'lora-a' holds tokens" in p for p in problems)


def test_write_error_names_the_file_not_its_temporary(tmp_path):
    for dest in (tmp_path / "missing" / "a.snapshot", tmp_path):
        with pytest.raises(OSError) as exc:
            write_small(dest)
        assert exc.value.filename == str(dest)
    assert [p.name for p in tmp_path.iterdir()] == []


def test_header_records_the_l3_capacity_of_a_replay(tmp_path):
    from engine.loadgen.trace import TraceRecord
    from engine.sim.replay import ReplayConfig, replay

    recs = [TraceRecord(0.0, 1024, 1, (0, 1)), TraceRecord(1.0, 1024, 1, (0, 2))]
    for l3, want in ((4096, 4096), (1000, 960), (-1, None)):
        _, cache = replay(recs, ReplayConfig(page_size=64, l1_tokens=1024, l2_tokens=2048,
                                             l3_tokens=l3), keep_cache=True)
        assert snapshot_of(cache).header["capacity"] == {"l1": 1024, "l2": 2048, "l3": want}


# ------------------------------------------------------------------------- diff internals
def _diff_counts(a, b) -> tuple:
    d = sv.diff(a, b)
    return (d["common"]["pages"], d["only_a"]["pages"], d["only_b"]["pages"],
            [(c["from"], c["to"], c["pages"]) for c in d["tier_changes"]])


def test_diff_is_exact_when_page_hashes_collide(tmp_path, monkeypatch):
    import engine.snapshot.take as es

    a = load_snapshot(write_small(tmp_path / "a.snapshot"))
    recs = [r._replace(tokens=t(13, 16), l1=None) if r.id == 2 else r
            for r in small_records()]
    b = load_snapshot(write_small(tmp_path / "b.snapshot", recs))
    want = _diff_counts(a, b)
    assert want == (9, 2, 2, [])   # node 2's page differs, so does its child's path
    monkeypatch.setattr(es, "_row_hashes", lambda rows: np.zeros(len(rows), dtype=np.uint64))
    a2 = load_snapshot(tmp_path / "a.snapshot")
    b2 = load_snapshot(tmp_path / "b.snapshot")
    assert _diff_counts(a2, b2) == want


def test_diff_with_odd_page_size_and_split_edges(tmp_path):
    def recs(split: bool) -> list[R]:
        out = [R(0, None, t(1, 0))]
        if split:
            out += [R(1, 0, t(1, 3), None, [0]), R(2, 1, t(4, 9), None, [1, 2])]
        else:
            out += [R(1, 0, t(1, 9), None, [0, 1, 2])]
        return out + [R(3, 0, t(50, 52), None, None, [0])]

    hdr = dict(created_at=CREATED)
    fmt.write_snapshot(tmp_path / "a.snapshot", fmt.make_header(3, **hdr), recs(False))
    fmt.write_snapshot(tmp_path / "b.snapshot", fmt.make_header(3, **hdr), recs(True))
    a, b = load_snapshot(tmp_path / "a.snapshot"), load_snapshot(tmp_path / "b.snapshot")
    assert sv.diff(a, b)["same"] is True and _diff_counts(a, b) == (4, 0, 0, [])
