"""``hicache inspect``: every view on a small snapshot, exact output, all formats, bad input."""

from __future__ import annotations

import json
import shutil
import subprocess

import numpy as np
import pytest
from typer.testing import CliRunner

from engine.runtime.tokenizer import ByteTokenizer
from formats.snapshot import NodeRecord as R
from hicache_cli.app import app
from tests.test_snapshot import BAD, small_records, t, write_small

runner = CliRunner()

HEAD = """\
snapshot  small.snapshot  (v2, page size 4, rank 0/2 (cp 0/2), 2023-11-14 22:13:20 UTC)
model     tiny
"""

SUMMARY = """
nodes     7 (3 leaves, 2 namespaces)
tokens    44 (11 pages)
L1        24 tokens  ███████████████░░░░░  75.0% of 32
L2        24 tokens  ████████░░░░░░░░░░░░  37.5% of 64
L3        12 tokens
locked    12 tokens
evictable 12 tokens (on L1, unlocked)
depth     3 nodes / 24 tokens max, 17.3 tokens mean at leaves
fan-out   2 at the roots, 1.25 mean, 2 max
"""

TREE = """
(default namespace)  5 nodes 32 tok  L1 ███░░░░░  L2 ██████░░  L3 ███░░░░░
└── #1 [1 2 3 4 …] 8 tok  L1+L2+L3  hits 5  lock 1  · subtree 5 nodes 32 tok  L1 ███░░░░░  L2 ██████░░  L3 ███░░░░░
    ├── #3 [20 21 22 23 …] 8 tok  L2  hits 1  · subtree 2 nodes 16 tok  L1 ░░░░░░░░  L2 ████░░░░  L3 ██░░░░░░
    │   └── #8 [50 51 52 53 …] 8 tok  L3 1/2  hits 0  L1 ░░░░░░░░  L2 ░░░░░░░░  L3 ████░░░░
    └── #2 [9 10 11 12] 4 tok  L1+L2  hits 3  lock 1  · subtree 2 nodes 8 tok  L1 ████░░░░  L2 ████████  L3 ░░░░░░░░
        └── #4 [30 31 32 33] 4 tok  L2  hits 0  L1 ░░░░░░░░  L2 ████████  L3 ░░░░░░░░
namespace 'lora-a'  2 nodes 12 tok  L1 ████████  L2 ░░░░░░░░  L3 ░░░░░░░░
└── #6 [1 2 3 4] 4 tok  L1  hits 2  · subtree 2 nodes 12 tok  L1 ████████  L2 ░░░░░░░░  L3 ░░░░░░░░
    └── #7 [40 41 42 43 …] 8 tok  L1  hits 1  L1 ████████  L2 ░░░░░░░░  L3 ░░░░░░░░
"""  # noqa: E501

TREE_COLLAPSED = """
(default namespace)  5 nodes 32 tok  L1 ███░░░░░  L2 ██████░░  L3 ███░░░░░
└── #1 [1 2 3 4 …] 8 tok  L1+L2+L3  hits 5  lock 1  · subtree 5 nodes 32 tok  L1 ███░░░░░  L2 ██████░░  L3 ███░░░░░
    ├── #3 [20 21 22 23 …] 8 tok  L2  hits 1  · subtree 2 nodes 16 tok  L1 ░░░░░░░░  L2 ████░░░░  L3 ██░░░░░░
    │   └── … 1 child below: 1 node, 8 tok
    └── … 1 more child: 2 nodes, 8 tok
namespace 'lora-a'  2 nodes 12 tok  L1 ████████  L2 ░░░░░░░░  L3 ░░░░░░░░
└── #6 [1 2 3 4] 4 tok  L1  hits 2  · subtree 2 nodes 12 tok  L1 ████████  L2 ░░░░░░░░  L3 ░░░░░░░░
    └── #7 [40 41 42 43 …] 8 tok  L1  hits 1  L1 ████████  L2 ░░░░░░░░  L3 ░░░░░░░░
"""  # noqa: E501

HOT = """
hot prefixes (score = hits × prefix length)
  #  node  score  hits  prefix  tier      tokens (prefix start … | node's edge)
  1  #1       40     5       8  L1+L2+L3  1 2 3 4 …
  2  #2       36     3      12  L1+L2     1 2 3 4 … | 9 10 11 12
  3  #3       16     1      16  L2        1 2 3 4 … | 20 21 22 23 …
  4  #7       12     1      12  L1        lora-a: 1 2 3 4 … | 40 41 42 43 …
"""

PROMPT = "1,2,3,4,5,6,7,8,20,21,22,23,24,25,26,27,50,51,52,53,54,55,56,57,1"
PREFIX = """
prompt    25 tokens (6 full pages of 4 + 1 in a partial page) in the default namespace
hit       20 tokens (80.0%): L1 8, L2 8, L3 4; miss 5
          4 more tokens are in the tree but not reachable as a hit
path      node  matched  hit   resident
          #1        8/8  L1 8  L1+L2+L3
          #3        8/8  L2 8  L2
          #8        8/8  L3 4  L3
"""

OWNERS = """
CP owners (cp_size 2): 3 rotation segments, 1 restart, imbalance 1.091 (max / mean pages)
  rank  pages  L1  L2
     0      6   4   3
     1      5   2   3
segments start on owner  0: 3, 1: 0
restart   #7 under #6 (prefix 12): owner 0, the parent's rotation continues with 1
"""

DIFF = """
diff      A = small.snapshot, B = b.snapshot (pages compared by token path)
common    10 pages (40 tokens)
only in A 1 page (4 tokens) in 1 node
          #4: 1 page, prefix 16, L2
only in B 1 page (4 tokens) in 1 node
          #9: 1 page, prefix 16, L1
tier      L1+L2 -> L2: 1 page (4 tokens)
          e.g. A #2 / B #2 (prefix 12): L1+L2 -> L2
"""


def other_records() -> list[R]:
    """The small tree as another rank / a later moment sees it: node 4 gone, node 2 off L1,
    node 1 split in two (same pages, other ids: diff must not care), a new node 9."""
    out = []
    for r in small_records():
        if r.id == 4:
            continue
        if r.id == 2:
            r = r._replace(l1=None)
        if r.id == 1:
            out.append(r._replace(id=11, tokens=t(1, 4), l1=[0], l2=[0], l3=1))
            r = r._replace(parent=11, tokens=t(5, 8), l1=[1], l2=[1], l3=1, cp_owner=1)
        out.append(r)
    out.append(R(9, 7, t(60, 63), "lora-a", [6], None, 0, 0, 0, 14, 0, 2))
    return out


@pytest.fixture()
def snaps(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_small(tmp_path / "small.snapshot")
    write_small(tmp_path / "b.snapshot", other_records())
    return tmp_path


def run(*args: str):
    return runner.invoke(app, ["inspect", *args])


# ------------------------------------------------------------------------- human views
def test_default_view_is_summary_and_tree(snaps):
    res = run("small.snapshot")
    assert res.exit_code == 0, res.output
    assert res.stdout == HEAD + SUMMARY + TREE


def test_tree_collapses_beyond_depth_and_max_children(snaps):
    res = run("small.snapshot", "--depth", "2", "--max-children", "1")
    assert res.exit_code == 0
    assert res.stdout == HEAD + SUMMARY + TREE_COLLAPSED


def test_hot(snaps):
    res = run("small.snapshot", "--hot", "4")
    assert res.exit_code == 0 and res.stdout == HEAD + HOT


def test_prefix_token_ids(snaps):
    res = run("small.snapshot", "--prefix", PROMPT)
    assert res.exit_code == 0 and res.stdout == HEAD + PREFIX


def test_prefix_in_another_namespace(snaps):
    res = run("small.snapshot", "--prefix", "1,2,3,4,40,41,42,43", "--namespace", "lora-a",
              "--format", "json")
    m = json.loads(res.stdout)["prefix"]
    assert (m["l1_len"], m["l2_len"], m["miss_tokens"]) == (8, 0, 0)
    res = run("small.snapshot", "--prefix", "1,2,3,4,40,41,42,43", "--format", "json")
    m = json.loads(res.stdout)["prefix"]  # the default namespace has [1..4] but not [40..]
    assert (m["l1_len"], m["tree_tokens"], [s["id"] for s in m["path"]]) == (4, 4, [1])


def test_prefix_text_goes_through_the_byte_tokenizer(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ids = np.asarray(ByteTokenizer().encode("Hello, world"), dtype=np.uint32)  # BOS + 12
    recs = [R(0, None, t(1, 0)), R(1, 0, ids[:8], None, [0, 1], [0, 1]),
            R(2, 1, ids[8:12], None, None, [2])]
    write_small(tmp_path / "text.snapshot", recs)
    res = run("text.snapshot", "--prefix", "Hello, world", "--format", "json")
    m = json.loads(res.stdout)["prefix"]
    assert (m["prompt_tokens"], m["l1_len"], m["l2_len"], m["miss_tokens"]) == (13, 8, 4, 1)
    res = run("text.snapshot", "--prefix", "Hello, there", "--format", "json")
    assert json.loads(res.stdout)["prefix"]["l1_len"] == 8


def test_owners(snaps):
    res = run("small.snapshot", "--owners")
    assert res.exit_code == 0 and res.stdout == HEAD + OWNERS


def test_owners_when_not_sharded(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_small(tmp_path / "u.snapshot", rank={"rank": 0, "world_size": 1})
    res = run("u.snapshot", "--owners", "--format", "json")
    assert json.loads(res.stdout)["owners"] == {"sharded": False, "cp_size": 1,
                                                "nodes_with_owner": 7}


def test_diff_known_difference(snaps):
    res = run("small.snapshot", "--diff", "b.snapshot")
    assert res.exit_code == 0 and res.stdout == HEAD + DIFF
    d = json.loads(run("small.snapshot", "--diff", "b.snapshot", "--format", "json").stdout)
    d = d["diff"]
    assert (d["only_a"]["tokens"], d["only_b"]["tokens"], d["common"]["pages"]) == (4, 4, 10)
    assert d["tier_changes"] == [{"from": "L1+L2", "to": "L2", "pages": 1, "tokens": 4}]
    assert d["same"] is False


def test_diff_same_and_expect_same(snaps):
    res = run("small.snapshot", "--diff", "small.snapshot", "--expect-same")
    assert res.exit_code == 0
    assert "same      both snapshots hold the same pages in the same tiers" in res.stdout
    res = run("small.snapshot", "--diff", "b.snapshot", "--expect-same")
    assert res.exit_code == 3 and "small.snapshot and b.snapshot differ" in res.stderr


def test_check_ok(snaps):
    res = run("small.snapshot", "--check")
    assert res.exit_code == 0
    assert res.stdout == HEAD + "\ncheck     ok: 7 nodes, no invariant violated\n"


@pytest.mark.parametrize("plant, invariant", [
    (lambda r: r[5]._replace(l1=[7, 6]),                         # node 8 on L1, parent not
     "residency: node 8 is on L1 but its parent 3 is not (L1 must be prefix-closed)"),
    (lambda r: r[1]._replace(lock_ref=0),                        # node 1 below its child
     "locks: node 1 lock count 0 is below a child's"),
    (lambda r: r[2]._replace(l1=[0]),                            # page 0 owned twice
     "slots: L1 pages [0] belong to more than one node"),
    (lambda r: r[2]._replace(l1=[9]),                            # beyond 8 pages of L1
     "slots: L1 page ids [9] are outside the 8 pages of capacity"),
    (lambda r: r[4]._replace(cp_owner=None),                     # sharded, no owner
     "cp owner: 1 node(s) of a CP-sharded snapshot (cp_size 2) have no owner, e.g. node 3"),
])
def test_check_catches_a_planted_violation(tmp_path, monkeypatch, plant, invariant):
    monkeypatch.chdir(tmp_path)
    recs = small_records()
    planted = plant(recs)
    recs[[r.id for r in recs].index(planted.id)] = planted
    write_small(tmp_path / "bad.snapshot", recs)
    res = run("bad.snapshot", "--check")
    assert res.exit_code == 3
    assert invariant in res.stdout
    assert res.stderr.startswith(f"error: invariant violated: bad.snapshot: {invariant}")
    res = run("bad.snapshot", "--check", "--format", "json")
    assert res.exit_code == 3
    check = json.loads(res.stdout)["check"]
    assert check["ok"] is False and any(invariant in v for v in check["violations"])


def test_check_lists_at_most_max_violations_with_a_count(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    recs = small_records()
    recs[5] = recs[5]._replace(l1=[7, 6])
    recs[1] = recs[1]._replace(lock_ref=0)
    recs[2] = recs[2]._replace(l1=[9])
    write_small(tmp_path / "bad.snapshot", recs)
    full = json.loads(run("bad.snapshot", "--check", "--format", "json").stdout)["check"]
    total = full["violation_count"]
    assert total >= 3 and len(full["violations"]) == total
    res = run("bad.snapshot", "--check", "--max-violations", "1")
    assert res.exit_code == 3
    listed = [ln for ln in res.stdout.splitlines() if ln.startswith("  ")]
    assert listed[0] == "  " + full["violations"][0]
    assert listed[1].startswith(f"  … {total - 1} more (shown: the first 1")
    assert len(listed) == 2 and f"check     {total} violations" in res.stdout
    assert f"(+{total - 1} more)" in res.stderr
    doc = json.loads(run("bad.snapshot", "--check", "--max-violations", "2", "--format",
                         "json").stdout)["check"]
    assert doc["violation_count"] == total and doc["violations"] == full["violations"][:2]
    assert run("bad.snapshot", "--check", "--max-violations", "0").exit_code == 2


def test_check_capacity_from_the_header(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_small(tmp_path / "c.snapshot", capacity={"l1": 16, "l2": 64})
    res = run("c.snapshot", "--check")
    assert res.exit_code == 3
    assert "capacity: L1 holds 24 tokens, the snapshot's capacity is 16" in res.stdout


# ------------------------------------------------------------------------- formats
def test_json_default_view(snaps):
    res = run("small.snapshot", "--format", "json")
    assert res.exit_code == 0
    doc = json.loads(res.stdout)
    assert set(doc) == {"snapshot", "summary", "tree"}
    assert doc["snapshot"]["model"] == {"name": "tiny", "layout": None}
    s = doc["summary"]
    assert (s["nodes"], s["tokens"], s["locked_tokens"], s["evictable_tokens"]) == \
        (7, 44, 12, 12)
    assert {t: v["tokens"] for t, v in s["tiers"].items()} == {"L1": 24, "L2": 24, "L3": 12}
    assert s["depth"] == {"max_nodes": 3, "max_tokens": 24, "mean_leaf_tokens": 17.3}
    assert s["fanout"] == {"root": 2, "mean": 1.25, "max": 2}
    roots = doc["tree"]
    assert [r["namespace"] for r in roots] == [None, "lora-a"]
    n1 = roots[0]["children"][0]
    assert (n1["id"], n1["tiers"], n1["lock"], n1["subtree"]["tokens"]) == \
        (1, "L1+L2+L3", 1, 32)
    assert [c["id"] for c in n1["children"]] == [3, 2]


def test_json_views_and_many_snapshots(snaps):
    res = run("small.snapshot", "b.snapshot", "--hot", "2", "--owners", "--check",
              "--prefix", PROMPT, "--format", "json")
    assert res.exit_code == 0
    docs = json.loads(res.stdout)
    assert isinstance(docs, list) and len(docs) == 2
    assert set(docs[0]) == {"snapshot", "hot", "prefix", "owners", "check"}
    assert [h["id"] for h in docs[0]["hot"]] == [1, 2]
    assert [(h["id"], h["score"]) for h in docs[1]["hot"]] == [(1, 40), (2, 36)]
    p = docs[0]["prefix"]
    assert (p["l1_len"], p["l2_len"], p["l3_len"], p["hit_tokens"]) == (8, 8, 4, 20)
    assert docs[0]["owners"]["owners"] == [{"rank": 0, "pages": 6, "L1": 4, "L2": 3},
                                           {"rank": 1, "pages": 5, "L1": 2, "L2": 3}]
    assert docs[1]["check"] == {"ok": True, "violation_count": 0, "violations": []}


DOT = """\
digraph "small.snapshot" {
  rankdir=LR;
  node [shape=box, style="rounded,filled", fontname="monospace", fontsize=10];
  n0 [label="(default namespace)\\n5 nodes 32 tok", fillcolor="#eeeeee"];
  n1 [label="#1  8 tok\\nL1+L2+L3  hits 5\\nsubtree 5 nodes 32 tok", fillcolor="#b7e4c7", penwidth=2];
  n0 -> n1;
  h1 [label="… 2 children below: 4 nodes, 24 tok", style=dashed];
  n1 -> h1 [style=dashed];
  n5 [label="namespace 'lora-a'\\n2 nodes 12 tok", fillcolor="#eeeeee"];
  n6 [label="#6  4 tok\\nL1  hits 2\\nsubtree 2 nodes 12 tok", fillcolor="#b7e4c7"];
  n5 -> n6;
  h2 [label="… 1 child below: 1 node, 8 tok", style=dashed];
  n6 -> h2 [style=dashed];
}
"""  # noqa: E501


def test_dot(snaps):
    res = run("small.snapshot", "--format", "dot", "--depth", "1")
    assert res.exit_code == 0 and res.stdout == DOT
    if shutil.which("dot"):  # render when Graphviz is installed; never required
        full = run("small.snapshot", "--format", "dot").stdout
        out = subprocess.run(["dot", "-Tsvg"], input=full, capture_output=True, text=True,
                             timeout=30)
        assert out.returncode == 0, out.stderr
        assert "<svg" in out.stdout and "#8" in out.stdout


# ------------------------------------------------------------------------- errors
@pytest.mark.parametrize("case", ["empty", "json", "pickle", "truncated in a node",
                                  "newer version", "unknown node field"])
def test_bad_snapshot_is_one_line_exit_1(tmp_path, monkeypatch, case):
    monkeypatch.chdir(tmp_path)
    blob, expect = BAD[case]
    (tmp_path / "x.snapshot").write_bytes(blob)
    for fmt in ("human", "json", "dot"):
        res = run("x.snapshot", "--format", fmt)
        assert res.exit_code == 1
        assert res.stdout == ""
        assert res.stderr.startswith("error: x.snapshot: ") and expect in res.stderr
        assert res.stderr.count("\n") == 1 and "Traceback" not in res.stderr


def test_missing_file_and_diff_of_a_bad_file(snaps):
    res = run("nope.snapshot")
    assert res.exit_code == 1 and "nope.snapshot" in res.stderr
    (snaps / "x.snapshot").write_bytes(b"")
    res = run("small.snapshot", "--diff", "x.snapshot")
    assert res.exit_code == 1 and "x.snapshot: empty file" in res.stderr


@pytest.mark.parametrize("args, message", [
    (["--format", "dot", "--hot", "3"], "--format dot renders the tree view only"),
    (["--hot", "0"], "--hot must be >= 1"),
    (["--depth", "-1"], "--depth must be >= 0"),
    (["--expect-same"], "--expect-same needs --diff"),
    (["--prefix", "1,99999999999"], "token ids must be in [0, 2**32)"),
    (["--prefix", "0,1,-2"], "token ids must be in [0, 2**32)"),   # was matched as text
])
def test_usage_errors_exit_2(snaps, args, message):
    res = run("small.snapshot", *args)
    assert res.exit_code == 2 and message in res.stderr
