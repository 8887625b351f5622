"""Client hints in traces (session_end / ttl_s / priority) and the sessions
`convert-trace --annotate-sessions` infers from hash-id chains."""

import json
import math
import os

import numpy as np
import pytest
from typer.testing import CliRunner

from engine.core.errors import InputError
from engine.loadgen.sessions import (
    infer_sessions,
    known_sessions_trace,
    link_quality,
    noisy_ttl,
)
from engine.loadgen.trace import Trace, TraceRecord, load_trace, write_jsonl
from engine.loadgen.trace_arrow import write_columnar
from hicache_cli.app import app

DATA = os.path.join(os.path.dirname(__file__), "data", "conversation_trace_head400.jsonl.gz")
B = 512
runner = CliRunner()


def line(ts, n, ids, **extra):
    return json.dumps({"timestamp": ts, "input_length": n, "output_length": 3, "hash_ids": ids,
                       **extra}) + "\n"


def hinted(tmp_path):
    path = tmp_path / "h.jsonl"
    path.write_text(line(0, 600, [0, 1], session_id="a", ttl_s=2.5, priority=-3)
                    + line(1000, 1100, [0, 1, 2], session_id="a", session_end=True,
                           ttl_s=None, priority=2**63 - 1)
                    + line(1500, 100, [7], session_end=False, ttl_s=0))
    return path


def same(a: Trace, b: Trace):
    for name in ("timestamps_ms", "input_lengths", "output_lengths", "offsets", "blocks",
                 "sessions", "session_ends", "priorities"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is not None:
            assert np.array_equal(x, y), name
    assert np.array_equal(a.ttl_s, b.ttl_s, equal_nan=True)


def test_hint_fields_round_trip_jsonl_columnar_jsonl(tmp_path):
    t = load_trace(str(hinted(tmp_path)))
    assert t.session_ends.tolist() == [False, True, False]
    assert t.ttl_s[0] == 2.5 and math.isnan(t.ttl_s[1]) and t.ttl_s[2] == 0.0
    assert t.priorities.tolist() == [-3, 2**63 - 1, 0] and t.priorities.dtype == np.int64
    assert t.has_hints and t.sessions[0] == t.sessions[1] and t.sessions[2] == -1
    for name in ("t.parquet", "t.arrow", "t.jsonl", "t.jsonl.gz"):
        out = str(tmp_path / name)
        (write_jsonl if ".jsonl" in name else write_columnar)(t, out)
        same(t, load_trace(out))
    same(t, Trace.from_records(t.records()))
    r = t.records()[0]
    assert (r.session_end, r.ttl_s, r.priority) == (False, 2.5, -3)
    assert t.records()[1].ttl_s is None and t.records()[1].session_end
    h = t.head(1)
    assert h.session_ends is not None and len(h.ttl_s) == 1 and h.priorities.tolist() == [-3]


def test_traces_without_hints_carry_no_hint_arrays(tmp_path):
    t = load_trace(DATA)
    assert (t.session_ends, t.ttl_s, t.priorities) == (None, None, None) and not t.has_hints
    out = str(tmp_path / "t.parquet")
    write_columnar(t, out)
    u = load_trace(out)
    assert (u.session_ends, u.ttl_s, u.priorities) == (None, None, None)
    import pyarrow.parquet as pq

    assert pq.read_schema(out).names == ["timestamp", "input_length", "output_length",
                                         "hash_ids"]
    recs = [TraceRecord(0.0, 600, 1, (0, 1))]
    assert Trace.from_records(recs).ttl_s is None
    keyed = tmp_path / "k.jsonl"
    keyed.write_text(line(0, 600, [0, 1], session_id=4) + line(1, 600, [0, 2]))
    k = load_trace(str(keyed))
    assert k.sessions.tolist() == [4, -1] and (k.session_ends, k.ttl_s, k.priorities) == (
        None, None, None) and k.has_hints
    late = tmp_path / "late.jsonl"       # the first hint on line 3: lines 1-2 get defaults
    late.write_text(line(0, 600, [0, 1]) + line(1, 600, [0, 2], session_id=1)
                    + line(2, 600, [0, 3], ttl_s=4) + line(3, 600, [0, 4]))
    t = load_trace(str(late))
    assert np.array_equal(t.ttl_s, [np.nan, np.nan, 4.0, np.nan], equal_nan=True)
    assert (t.session_ends, t.priorities) == (None, None)


@pytest.mark.parametrize("field, raw", [
    ("ttl_s", "-1"), ("ttl_s", '"NaN"'), ("ttl_s", "NaN"), ("ttl_s", "1e9"), ("ttl_s", "true"),
    ("session_end", '"yes"'), ("session_end", "1"), ("priority", str(2**64)),
    ("priority", "1.5"), ("priority", "false"),
])
def test_bad_hint_values_are_one_line_errors(tmp_path, field, raw):
    path = tmp_path / "t.jsonl"
    bad = line(1, 600, [0, 1])[:-2] + f', "{field}": {raw}}}\n'
    path.write_text(line(0, 600, [0, 1]) + bad)
    with pytest.raises(InputError) as e:
        load_trace(str(path))
    msg = str(e.value)
    assert msg.startswith("t.jsonl:2: ") and field in msg and "\n" not in msg


@pytest.mark.parametrize("column, values, needle", [
    ("ttl_s", [1.0, -2.0], "row 2: ttl_s"), ("ttl_s", [1.0, float("inf")], "row 2: ttl_s"),
    ("session_end", [1, 0], "'session_end' must hold booleans"),
    ("priority", [0.5, 1.0], "'priority' must hold integers"),
])
def test_bad_hint_columns_are_one_line_errors(tmp_path, column, values, needle):
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"timestamp": [0.0, 1.0], "input_length": [600, 600],
                      "output_length": [1, 1], "hash_ids": [[0, 1], [0, 2]], column: values})
    pq.write_table(table, tmp_path / "t.parquet")
    with pytest.raises(InputError, match=needle):
        load_trace(str(tmp_path / "t.parquet"))


def test_inference_recovers_known_sessions():
    t = known_sessions_trace(300, seed=0)
    truth = t.sessions
    stripped = Trace(t.name, t.timestamps_ms, t.input_lengths, t.output_lengths, t.offsets,
                     t.blocks)
    inf = infer_sessions(stripped)
    q = link_quality(truth, inf, stripped)
    # measured: every inferred link is true; the links lost are those out of a first turn
    # whose full blocks are only the shared system prompt (10% of the sessions)
    assert q == {"link_precision": 1.0, "link_recall": 0.9796, "sessions_exact": 0.8867,
                 "true_sessions": 300}
    assert inf.stats()["sessions"] == 334


def _records(rows):
    return Trace.from_records([TraceRecord(float(ts), n, 1, tuple(ids)) for ts, n, ids in rows])


def test_a_shared_system_prompt_does_not_chain_sessions():
    # 20 sessions open with a prompt whose only full block is the shared system prompt 0,
    # then extend it with their own blocks; one more session has a real first turn.
    rows = []
    for s in range(20):
        rows.append((s, 700, [0, 1000 + s]))                     # chain [0]
        rows.append((100 + s, 1600, [0, 2000 + s, 3000 + s, 4000 + s]))
    rows.append((200, 1100, [0, 50, 51]))                         # chain [0, 50]
    rows.append((300, 1700, [0, 50, 52, 53]))                     # extends it
    t = _records(rows)
    inf = infer_sessions(t)
    assert inf.predecessor.tolist() == [-1] * 41 + [40]
    # the trap is real: without the rule every second turn would chain through block 0
    loose = infer_sessions(t, max_branches=10**6)
    assert (loose.predecessor[1:40:2] >= 0).all()


def test_branches_stay_in_their_session():
    rows = [(0, 1100, [0, 1, 2]),             # p: chain [0, 1]
            (1000, 1700, [0, 1, 3, 4]),        # extends p
            (3000, 1700, [0, 1, 5, 6]),        # regenerated: extends p again (2 branches)
            (6000, 2200, [0, 1, 5, 7, 8])]     # extends the second branch
    t = _records(rows)
    inf = infer_sessions(t)
    assert inf.predecessor.tolist() == [-1, 0, 0, 2]
    assert inf.session.tolist() == [0, 0, 0, 0]
    assert inf.session_end.tolist() == [False, False, False, True]
    assert inf.gap_s[:3].tolist() == [1.0, 2.0, 3.0] and math.isnan(inf.gap_s[3])
    # a third distinct continuation makes block 1 a shared prefix: no link through it (the
    # link through block 5, which one request continues, stays)
    t3 = _records(rows + [(7000, 1700, [0, 1, 9, 10])])
    assert infer_sessions(t3).predecessor.tolist() == [-1, -1, -1, 2, -1]
    assert infer_sessions(t3, max_branches=3).predecessor.tolist() == [-1, 0, 0, 2, 0]


def test_ttl_is_the_gap_to_the_next_turn():
    t = known_sessions_trace(60, seed=3)
    inf = infer_sessions(t)
    ts = t.timestamps_ms
    nxt = {}
    for r in np.argsort(ts, kind="stable").tolist()[::-1]:
        s = int(inf.session[r])
        if s in nxt:
            assert inf.gap_s[r] == (ts[nxt[s]] - ts[r]) / 1000.0
        else:
            assert math.isnan(inf.gap_s[r]) and inf.session_end[r]
        nxt[s] = r
    assert inf.session_end.sum() == inf.stats()["sessions"]
    g = inf.gap_s
    two = noisy_ttl(g, 2.0, seed=5)
    ok = ~np.isnan(g)
    assert np.array_equal(np.isnan(two), ~ok)
    assert ((two[ok] >= g[ok] / 2) & (two[ok] <= g[ok] * 2)).all()
    assert not np.allclose(two[ok], g[ok])
    assert np.array_equal(two, noisy_ttl(g, 2.0, seed=5), equal_nan=True)
    assert not np.array_equal(two, noisy_ttl(g, 2.0, seed=6), equal_nan=True)
    assert np.array_equal(noisy_ttl(g, 1.0), g, equal_nan=True)
    assert noisy_ttl(np.array([9e6, 3e7]), 4.0, seed=1).max() <= 1e7   # what a trace may carry


def test_cli_output_with_a_gap_past_the_ttl_limit_reads_back(tmp_path):
    src, dst = tmp_path / "in.jsonl", str(tmp_path / "out.jsonl")
    src.write_text(line(0, 1100, [0, 1, 2]) + line(2e10, 1700, [0, 1, 3, 4]))   # 2e7 s later
    r = runner.invoke(app, ["bench", "convert-trace", str(src), dst, "--annotate-sessions"])
    assert r.exit_code == 0, r.output
    assert load_trace(dst).ttl_s[0] == 1e7


def test_cli_annotates_and_scores_a_known_trace(tmp_path):
    src, dst = str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl")
    write_jsonl(known_sessions_trace(300, seed=0), src)
    r = runner.invoke(app, ["bench", "convert-trace", src, dst, "--annotate-sessions",
                            "--format", "json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["inference"] == {"link_precision": 1.0, "link_recall": 0.9796,
                              "sessions_exact": 0.8867, "true_sessions": 300}
    assert d["annotate"]["sessions_from"] == "trace" and d["annotate"]["session_ends"] == 300
    assert d["annotate"]["inferred"]["sessions"] == 334
    out = load_trace(dst)
    src_t = load_trace(src)
    assert np.array_equal(out.sessions, src_t.sessions)        # kept as they were
    assert out.session_ends.sum() == 300
    ts = out.timestamps_ms
    i = int(np.flatnonzero(~np.isnan(out.ttl_s))[0])
    later = np.flatnonzero((out.sessions == out.sessions[i]) & (ts > ts[i]))
    assert out.ttl_s[i] == (ts[later].min() - ts[i]) / 1000.0
    # --reinfer, a factor, Parquet out; human output
    pq = str(tmp_path / "out.parquet")
    r = runner.invoke(app, ["bench", "convert-trace", src, pq, "--annotate-sessions",
                            "--reinfer", "--ttl-factor", "2", "--seed", "1"])
    assert r.exit_code == 0, r.output
    assert "sessions inferred: 334" in r.stdout and "link precision 1.0000" in r.stdout
    re = load_trace(pq)
    assert int(np.unique(re.sessions).size) == 334 and re.session_ends.sum() == 334


def test_cli_annotates_a_trace_without_sessions_and_refuses_bad_factors(tmp_path):
    dst = str(tmp_path / "out.jsonl.gz")
    r = runner.invoke(app, ["bench", "convert-trace", DATA, dst, "--annotate-sessions",
                            "--format", "json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert "inference" not in d and d["annotate"]["sessions_from"] == "inferred"
    out = load_trace(dst)
    assert out.has_hints and out.session_ends.sum() == d["annotate"]["inferred"]["sessions"]
    for opt, bad in (("--ttl-factor", "0.5"), ("--ttl-factor", "nan"), ("--ttl-factor", "inf"),
                     ("--seed", "-1")):
        r = runner.invoke(app, ["bench", "convert-trace", DATA, str(tmp_path / "x.jsonl"),
                                "--annotate-sessions", opt, bad])
        assert r.exit_code == 2 and opt in r.output, (bad, r.output)
    r = runner.invoke(app, ["bench", "convert-trace", DATA, str(tmp_path / "x.jsonl"),
                            "--ttl-factor", "2"])
    assert r.exit_code == 2 and "--annotate-sessions" in r.output
    assert not (tmp_path / "x.jsonl").exists()


def test_a_branch_from_inside_an_earlier_prompt_joins_its_session():
    rows = [(0, 2600, [0, 1, 2, 3, 4, 5]),        # a long first prompt
            (1000, 1700, [0, 1, 2, 9]),            # shares 3 blocks inside it: an edit
            (2000, 1100, [0, 20, 21]),             # other sessions behind system prompt 0
            (3000, 1100, [0, 30, 31]),
            (4000, 1100, [0, 40, 41])]
    inf = infer_sessions(_records(rows))
    assert inf.predecessor.tolist() == [-1, 0, -1, -1, -1]
    assert inf.branch.tolist() == [False, True, False, False, False]
    assert inf.session.tolist() == [0, 0, 2, 3, 4] and inf.gap_s[0] == 1.0


def test_shared_prefix_matches_a_direct_scan():
    from engine.loadgen.sessions import _shared_prefix

    recs = known_sessions_trace(80, seed=2).records() + load_trace(DATA).head(150).records()
    rng = np.random.default_rng(0)
    t = Trace.from_records([recs[i] for i in rng.permutation(len(recs))])   # not time-sorted
    order = np.argsort(t.timestamps_ms, kind="stable").tolist()
    k, holder = _shared_prefix(t, order)
    first: dict[int, int] = {}
    for r in order:
        ids = t.hash_ids(r).tolist()
        n = 0
        while n < len(ids) and ids[n] in first:
            n += 1
        assert k[r] == n and holder[r] == (first[ids[n - 1]] if n else -1)
        for b in ids:
            first.setdefault(b, r)
