"""``consensus-check``: hand-written cases per category, the fast path, bad input, the CLI."""

from __future__ import annotations

import json
import os
import shutil

import msgpack
import pytest
from typer.testing import CliRunner

from checkers.consensus import check_consensus
from engine.cache.events import EventLog, RankInfo
from engine.core.errors import InputError
from engine.parallel.divergence import install, record, synthetic_decisions
from formats.errors import FormatError
from formats.ranklog import read_ranklog
from formats.ranklog_writer import write_ranklog
from hicache_cli.app import app

CASES = os.path.join(os.path.dirname(__file__), "data", "ranklogs")
runner = CliRunner()


def case(name: str) -> str:
    return os.path.join(CASES, name)


def summary(report) -> list[tuple]:
    return [(d.category, d.group, d.step, d.seq, d.ranks, d.majority, d.fields)
            for d in report.divergences]


# -- hand-written JSONL cases ------------------------------------------------------------------
def test_consistent_logs_ignore_local_fields():
    r = check_consensus([case("consistent")])
    assert r.consistent and r.complete and r.divergences == []
    assert (r.ranks, r.events, len(r.groups)) == (3, 36, 1)
    # the ranks really differ in local_* fields
    assert read_ranklog(os.path.join(case("consistent"), "rank0.jsonl"))[1][2]["local_slots"] != \
        read_ranklog(os.path.join(case("consistent"), "rank1.jsonl"))[1][2]["local_slots"]


@pytest.mark.parametrize("name, expected", [
    ("hit_length", ("hit_length_mismatch", 0, 1, 3, [1], [0, 2],
                    {0: {"l1_len": 16}, 1: {"l1_len": 0}, 2: {"l1_len": 16}})),
    ("lock_order", ("lock_order_mismatch", 0, 1, 4, [1], [0, 2],
                    {0: {"node": 2}, 1: {"node": 1}, 2: {"node": 2}})),
    # the reference rank (0) is the odd one out: the majority decides, not rank order
    ("eviction", ("eviction_eligibility_divergence", 0, 2, 9, [0], [1, 2],
                  {0: {"eligible": [1, 2]}, 1: {"eligible": [1]}, 2: {"eligible": [1]}})),
    ("pp_ack", ("pp_ack_consumption_mismatch", 0, 1, 6, [2], [0, 1],
                {0: {"consumed": 1, "acks": [0]}, 1: {"consumed": 1, "acks": [0]},
                 2: {"consumed": 0, "acks": []}})),
    ("restore_completion", ("restore_completion_mismatch", 0, 1, 5, [2], [0, 1],
                            {0: {"step": 1}, 1: {"step": 1}, 2: {"step": 2}})),
    ("missing_end", ("missing_events", 0, 2, 9, [1], [0, 2],
                     {0: {"seq": 9}, 1: {"seq": None}, 2: {"seq": 9}})),
    ("event_mismatch", ("event_mismatch", 0, 2, 8, [1], [0, 2],
                        {0: {"pages": 2}, 1: {"pages": 3}, 2: {"pages": 2}})),
])
def test_each_category(name, expected):
    r = check_consensus([case(name)])
    assert not r.consistent
    assert summary(r)[0] == expected


def test_seq_gap_is_missing_events():
    r = check_consensus([case("missing_gap")])
    (d,) = r.divergences
    assert (d.category, d.step, d.seq, d.ranks) == ("missing_events", 1, 4, [2])
    assert d.fields[2]["seq"] == 5 and d.fields[0]["seq"] == 4
    assert "rank 2 jumps from seq 3 to 5 (event 4 missing)" in d.message
    # after resynchronising on step 2 the rest agrees (the gap shifted rank 2's seq by one)
    assert r.events == 35 and r.complete


def test_resynchronise_on_step_and_max_divergences():
    r = check_consensus([case("restore_completion")])
    assert [(d.category, d.step, d.seq) for d in r.divergences] == [
        ("restore_completion_mismatch", 1, 5), ("restore_completion_mismatch", 2, 7)]
    assert "rank 2 recorded restore_done (op=0) where ranks 0, 1 recorded unlock" in \
        r.divergences[1].message
    assert r.complete and r.events == 36
    r1 = check_consensus([case("restore_completion")], max_divergences=1)
    assert len(r1.divergences) == 1 and not r1.complete


def test_groups_are_checked_independently():
    r = check_consensus([case("two_groups")])
    assert [(g.dp_rank, g.ranks, g.divergences, g.events) for g in r.groups] == [
        (0, [0, 1], 0, 24), (1, [2, 3], 1, 24)]
    assert summary(r) == [("hit_length_mismatch", 1, 1, 3, [3], [2],
                           {2: {"l1_len": 16}, 3: {"l1_len": 0}})]


def test_a_log_that_ends_drops_out_and_the_others_go_on():
    r = check_consensus([case("missing_end")])
    assert len(r.divergences) == 1 and r.complete
    assert r.events == 12 + 9 + 12
    assert r.divergences[0].message == \
        "rank 1's log ends before seq 9; ranks 0, 2 continue with seq 9"


def test_context_events():
    d = check_consensus([case("hit_length")], context=2).divergences[0]
    ctx = d.context[1]
    assert [e["seq"] for e in ctx["before"]] == [1, 2]
    assert ctx["at"]["l1_len"] == 0 and ctx["at"]["seq"] == 3
    assert [e["seq"] for e in ctx["after"]] == [4, 5]
    assert ctx["before"][1]["local_slots"] == [14, 15]   # context shows events as recorded
    d0 = check_consensus([case("hit_length")], context=0).divergences[0]
    assert d0.context[0] == {"before": [], "at": d0.context[0]["at"], "after": []}


# -- generated logs: the msgpack fast path must agree with the plain comparison ----------------
def make_logs(tmp_path, spec: str | None, *, ranks: int = 3, n: int = 3000, suffix=".ranklog",
              local_every: int = 7, seed: int = 1) -> str:
    decisions = synthetic_decisions(n, seed)
    out = tmp_path / f"logs{suffix}{abs(hash((spec, ranks, n, local_every)))}"
    out.mkdir(exist_ok=True)
    for r in range(ranks):
        log = EventLog(RankInfo(rank=r, world_size=ranks, tp_rank=r, tp_size=ranks))
        if local_every:   # a rank-local timing on some events, different on every rank
            log.mutator = (lambda ev, r=r: ev if ev["seq"] % local_every
                           else {**ev, "local_us": 100 * r + ev["seq"]})
        if spec:
            install(log, spec)
        record(log, [dict(d) for d in decisions])
        log.write(str(out / f"rank{r}{suffix}"))
    return str(out)


SPECS = [
    None,
    "hit_length@rank=1,step=40",
    "restore_completion@rank=0,step=40",
    "lock_order@rank=2,step=10;eviction_eligibility@rank=1,step=60",
    "pp_ack@rank=1,step=30",
    "missing_events@rank=2,step=20;hit_length@rank=1,step=80",
]


@pytest.mark.parametrize("spec", SPECS)
def test_fast_path_agrees_with_record_by_record(tmp_path, spec):
    mp = make_logs(tmp_path, spec)
    js = make_logs(tmp_path, spec, suffix=".jsonl")
    want = summary(check_consensus([js], chunk=1))   # JSONL: never the raw-bytes path
    assert bool(want) == bool(spec)
    for chunk in (1, 5, 64, 8192):
        assert summary(check_consensus([mp], chunk=chunk)) == want, chunk
    # one group mixing both encodings
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    shutil.copy(os.path.join(js, "rank0.jsonl"), mixed)
    for r in (1, 2):
        shutil.copy(os.path.join(mp, f"rank{r}.ranklog"), mixed)
    assert summary(check_consensus([mixed], chunk=64)) == want


def test_injected_kinds_give_their_category(tmp_path):
    for kind, category in [("hit_length", "hit_length_mismatch"),
                           ("restore_completion", "restore_completion_mismatch"),
                           ("lock_order", "lock_order_mismatch"),
                           ("eviction_eligibility", "eviction_eligibility_divergence"),
                           ("pp_ack", "pp_ack_consumption_mismatch"),
                           ("missing_events", "missing_events")]:
        r = check_consensus([make_logs(tmp_path, f"{kind}@rank=1,step=25", n=1500)])
        assert [(d.category, d.ranks) for d in r.divergences] == [(category, [1])], kind
        assert r.divergences[0].step >= 25


def test_many_events_all_consistent(tmp_path):
    r = check_consensus([make_logs(tmp_path, None, ranks=4, n=30000, local_every=0)])
    assert r.consistent and r.events == 4 * 30000


# -- bad input ---------------------------------------------------------------------------------
HEADER = {"format": "hicache-ranklog", "version": 1, "world_size": 2}
EV = [{"seq": i, "step": i // 2, "kind": "lock", "rid": "a", "node": i} for i in range(6)]


def write(tmp_path, name, rank, events=EV, **header):
    write_ranklog(tmp_path / name, {**HEADER, "rank": rank, **header}, events)
    return tmp_path / name


def test_duplicate_ranks(tmp_path):
    a, b = write(tmp_path, "a.ranklog", 0), write(tmp_path, "b.jsonl", 0)
    with pytest.raises(InputError, match=f"duplicate rank 0: {a} and {b}"):
        check_consensus([a, b])


def test_mixed_versions(tmp_path):
    a = write(tmp_path, "a.ranklog", 0)
    b = tmp_path / "b.ranklog"
    b.write_bytes(msgpack.packb({**HEADER, "rank": 1, "version": 2}))
    with pytest.raises(InputError, match=rf"mixed rank log versions \(v1: {a}; v2: {b}\)"):
        check_consensus([a, b])
    with pytest.raises(FormatError, match="unsupported rank log version 2"):
        check_consensus([b])


def test_world_size_disagreement(tmp_path):
    a, b = write(tmp_path, "a.ranklog", 0), write(tmp_path, "b.ranklog", 1, world_size=4)
    with pytest.raises(InputError, match="logs disagree on world_size"):
        check_consensus([a, b])


def test_zero_events(tmp_path):
    a, b = write(tmp_path, "a.ranklog", 0), write(tmp_path, "b.ranklog", 1, events=[])
    r = check_consensus([a, b])
    assert summary(r) == [("missing_events", 0, 0, 0, [1], [0], {0: {"seq": 0}, 1: {"seq": None}})]
    assert r.notes == [f"rank 1 ({b}) has 0 events"]
    c = write(tmp_path, "c.ranklog", 0, events=[])
    r = check_consensus([c, b])
    assert r.consistent and r.events == 0 and len(r.notes) == 2


def test_missing_rank_log(tmp_path):
    r = check_consensus([write(tmp_path, "a.ranklog", 0)])
    assert [(d.category, d.group, d.ranks) for d in r.divergences] == [
        ("missing_events", None, [1])]
    assert r.divergences[0].message == "no log for rank 1 (world_size 2)"


def test_directory_without_logs_and_missing_path(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError, match="no \\*.ranklog or \\*.jsonl files"):
        check_consensus([tmp_path / "empty"])
    with pytest.raises(FileNotFoundError):
        check_consensus([tmp_path / "nope.ranklog"])


def test_truncated_log_of_a_non_reference_rank(tmp_path):
    events = [{"seq": i, "step": i // 10, "kind": "lock", "node": i} for i in range(200)]
    a = write(tmp_path, "a.ranklog", 0, events)
    b = write(tmp_path, "b.ranklog", 1, events)
    data = b.read_bytes()
    b.write_bytes(data[:-2])
    with pytest.raises(FormatError, match=rf"{b}: byte offset \d+: truncated record"):
        check_consensus([a, b], chunk=16)


def test_seq_and_step_must_not_go_backwards(tmp_path):
    bad_seq = [*EV[:3], {**EV[3], "seq": 1}, *EV[4:]]
    a, b = write(tmp_path, "a.ranklog", 0), write(tmp_path, "b.ranklog", 1, bad_seq)
    with pytest.raises(FormatError, match="seq 1 after seq 2: seq must grow by one per event"):
        check_consensus([b, a])
    bad_step = [*EV[:4], {**EV[4], "step": 0}, EV[5]]
    b = write(tmp_path, "b.ranklog", 1, bad_step)
    with pytest.raises(FormatError, match="step 0 after step 1: steps never decrease"):
        check_consensus([b, a])


# -- the CLI -----------------------------------------------------------------------------------
def cli(*args):
    return runner.invoke(app, ["consensus-check", *map(str, args)])


def test_cli_consistent_both_formats():
    r = cli(case("consistent"))
    assert r.exit_code == 0, r.output
    assert "✓ consistent: 3 ranks in 1 group, 36 events checked" in r.stdout
    r = cli(case("consistent"), "--format", "json")
    assert r.exit_code == 0
    d = json.loads(r.stdout)
    assert (d["consistent"], d["ranks"], d["events"], d["divergences"]) == (True, 3, 36, [])
    assert d["groups"] == [{"dp_rank": 0, "ranks": [0, 1, 2], "events": 36, "divergences": 0,
                            "complete": True}]


def test_cli_divergence_both_formats():
    r = cli(case("hit_length"))
    assert r.exit_code == 3, r.output
    out = r.stdout
    assert "✗ inconsistent: 1 divergence in 1 of 1 group" in out
    assert "#1 hit_length_mismatch  ·  group dp_rank=0  ·  step 1  ·  seq 3" in out
    assert "rank 1 recorded match (l1_len=0) where ranks 0, 2 recorded match (l1_len=16)" in out
    assert "minority: rank 1   majority: ranks 0, 2" in out
    assert "> seq 3  step 1  match  rid='b' l1_len=0" in out
    r = cli(case("hit_length"), "--format", "json", "--context", "1")
    assert r.exit_code == 3
    d = json.loads(r.stdout)
    (div,) = d["divergences"]
    assert {k: div[k] for k in ("category", "group", "step", "seq", "ranks")} == {
        "category": "hit_length_mismatch", "group": 0, "step": 1, "seq": 3, "ranks": [1]}
    assert div["fields"] == {"0": {"l1_len": 16}, "1": {"l1_len": 0}, "2": {"l1_len": 16}}
    assert [e["seq"] for e in div["context"]["1"]["before"]] == [2]
    assert [e["seq"] for e in div["context"]["1"]["after"]] == [4]


def test_cli_max_divergences_and_files_as_arguments():
    files = sorted(os.path.join(case("restore_completion"), f)
                   for f in os.listdir(case("restore_completion")))
    r = cli(*files, "--max-divergences", "1", "--format", "json")
    assert r.exit_code == 3
    d = json.loads(r.stdout)
    assert len(d["divergences"]) == 1 and d["complete"] is False
    r = cli(*files, "--max-divergences", "1")
    assert "stopped at --max-divergences 1" in r.stdout


def test_cli_unreadable_input_exit_1(tmp_path):
    write(tmp_path, "a.ranklog", 0)
    (tmp_path / "b.ranklog").write_bytes(b"\xc1garbage")
    r = cli(tmp_path)
    assert r.exit_code == 1
    assert r.stdout == ""
    assert f"{tmp_path / 'b.ranklog'}: byte offset 0: undecodable msgpack" in r.stderr
    assert "Traceback" not in r.output
    assert cli(tmp_path / "missing").exit_code == 1


def test_cli_notes_go_to_stderr(tmp_path):
    write(tmp_path, "a.ranklog", 0, world_size=2, dp_rank=0)
    write(tmp_path, "b.ranklog", 1, world_size=2, dp_rank=1)
    r = cli(tmp_path, "--format", "json")
    assert r.exit_code == 0
    assert json.loads(r.stdout)["consistent"] is True
    assert "note: group dp_rank=0 has one rank (0): nothing to compare it with" in r.stderr


@pytest.mark.parametrize("args", [[], [CASES + "/consistent", "--max-divergences", "0"],
                                  [CASES + "/consistent", "--context", "-1"],
                                  [CASES + "/consistent", "--format", "xml"]])
def test_cli_usage_errors_exit_2(args):
    assert cli(*args).exit_code == 2


def test_cli_rank_without_log_and_non_finite_values(tmp_path):
    # only a missing rank diverges: the summary said "1 divergence in 0 of 1 group"
    r = cli(write(tmp_path, "a.ranklog", 0))
    assert r.exit_code == 3
    assert "✗ inconsistent: 1 divergence: ranks without a log — 1 rank in 1 group" in r.stdout
    # a NaN recorded in a msgpack log is shown, not written as invalid JSON
    nan = [*EV[:2], {**EV[2], "x": float("nan")}, *EV[3:]]
    write(tmp_path, "b.ranklog", 1, nan)
    r = cli(tmp_path, "--format", "json")
    assert r.exit_code == 3
    d = json.loads(r.stdout, parse_constant=lambda c: pytest.fail(f"{c} in JSON output"))
    assert d["divergences"][0]["fields"]["1"] == {"x": "nan"}


def test_missing_events_message_grammar(tmp_path):
    a = write(tmp_path, "a.ranklog", 0)
    b = write(tmp_path, "b.ranklog", 1, EV[3:])
    d = check_consensus([a, b]).divergences[0]
    assert d.message == "rank 1 starts at seq 3 (events 0..2 missing); rank 0 continues with seq 0"


# -- trigger request and causal chain (checkers.consensus_chain) ----------------------------------
def _chain_logs(tmp_path) -> str:
    """Two TP ranks: rank 1 skips a backup (its L2 allocation failed), so it evicts another
    node and a later request hits less there."""
    def stream(skip_backup: bool) -> list[dict]:
        ev = [{"step": 0, "kind": "match", "rid": "a", "l1_len": 0, "l2_len": 0, "l3_len": 0},
              {"step": 0, "kind": "insert", "rid": "a", "node": 1, "tokens": 32,
               "new_tokens": 32},
              {"step": 1, "kind": "match", "rid": "b", "l1_len": 0, "l2_len": 0, "l3_len": 0},
              {"step": 1, "kind": "insert", "rid": "b", "node": 2, "tokens": 32,
               "new_tokens": 32}]
        if not skip_backup:
            ev.append({"step": 1, "kind": "backup", "op": 0, "pages": 2})
        ev += [{"step": 2, "kind": "evict", "tier": "l1", "eligible": [1, 2],
                "evicted": [2] if skip_backup else [1]},
               {"step": 3, "kind": "match", "rid": "c", "l1_len": 0 if skip_backup else 32,
                "l2_len": 0, "l3_len": 0},
               {"step": 3, "kind": "lock", "rid": "c", "node": 1 if skip_backup else 2}]
        return [{"seq": i, **e} for i, e in enumerate(ev)]
    d = tmp_path / "chain"
    d.mkdir()
    for r in (0, 1):
        write_ranklog(d / f"rank{r}.jsonl", {"format": "hicache-ranklog", "version": 1, "rank": r,
                                             "world_size": 2, "tp_rank": r, "tp_size": 2},
                      stream(skip_backup=r == 1))
    return str(d)


def test_the_report_names_the_trigger_request_and_the_causal_chain(tmp_path):
    r = check_consensus([_chain_logs(tmp_path)])
    d = r.divergences[0]
    assert (d.category, d.step, d.seq) == ("eviction_eligibility_divergence", 1, 4)
    # the backup names no request: the trigger is the last one named before it, and it
    # arrived at its first event (its match at step 1, seq 2)
    assert d.trigger_request == {"rid": "b", "arrival_step": 1, "arrival_seq": 2,
                                 "arrival_kind": "match"}
    # backup / evict (the divergence), evict / evict (other victims: the same category), the
    # match (a shorter hit on rank 1), the lock (another node)
    assert [(c["category"], c["step"]) for c in d.chain] == [
        ("eviction_eligibility_divergence", 1), ("hit_length_mismatch", 3),
        ("lock_order_mismatch", 3)]
    assert d.chain[0]["events"]["0"]["kind"] == "backup"
    assert d.chain[0]["events"]["1"]["kind"] == "evict"
    text = runner.invoke(app, ["consensus-check", str(tmp_path / "chain")])
    assert text.exit_code == 3
    assert "trigger: request b (arrived at step 1, seq 2: match)" in text.stdout
    assert "chain: eviction_eligibility_divergence (step 1: backup / evict) → " \
        "hit_length_mismatch (step 3: match / match) → lock_order_mismatch (step 3: lock / " \
        "lock)" in text.stdout
    js = json.loads(runner.invoke(app, ["consensus-check", str(tmp_path / "chain"), "--format",
                                        "json"]).stdout)["divergences"][0]
    assert js["trigger_request"] == d.trigger_request and js["chain"] == d.chain
