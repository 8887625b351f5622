"""Event kinds defined once (formats/ranklog_events.py): emitters, writer, reader, checker and the
documentation all follow the same table."""

from __future__ import annotations

import json
import pathlib
import re

import pytest

from checkers.consensus import check_consensus
from engine.cache.events import EV, EventLog
from formats import ranklog_compare as rc
from formats.errors import FormatError
from formats.ranklog import read_ranklog
from formats.ranklog_writer import write_ranklog
from tests.factories import make_cache, serve

DOC = pathlib.Path(__file__).resolve().parent.parent / "docs" / "rank-log-format.md"


def header(rank: int, world: int = 2) -> dict:
    return {"format": "hicache-ranklog", "version": 1, "rank": rank, "world_size": world}


def test_strict_emit_rejects_missing_and_unknown_fields():
    log = EventLog(strict=True)
    log.emit(EV.MATCH, rid="a", l1_len=0, l2_len=0, l3_len=0, local_ms=0.5)
    with pytest.raises(ValueError, match="match event lacks field.*l3_len"):
        log.emit(EV.MATCH, rid="a", l1_len=0, l2_len=0)
    with pytest.raises(ValueError, match="unknown field.*colour"):
        log.emit(EV.LOCK, rid="a", node=1, colour="red")
    assert len(log) == 1


def test_every_event_a_cache_records_fits_its_kind(tmp_path):
    c = make_cache(page_size=2, l1_pages=4, l2_pages=8)
    c.events.strict = True
    for t in ([1, 2, 3, 4], [5, 6, 7, 8, 9, 10], [1, 2, 3, 4, 11, 12]):
        serve(c, t, rid=str(t[0]))
    c.flush()
    kinds = {e["kind"] for e in c.events.events}
    assert {"match", "lock", "insert", "unlock", "backup", "backup_done", "evict",
            "restore", "restore_done", "flush"} <= kinds
    path = tmp_path / "rank0.jsonl"
    c.events.write(str(path))
    _, events = read_ranklog(path, strict=True)
    assert events == c.events.events
    c.close()


def test_strict_writer_and_reader_name_the_bad_event(tmp_path):
    bad = {"seq": 1, "step": 0, "kind": "restore_done"}          # lacks op
    good = {"seq": 0, "step": 0, "kind": "lock", "rid": "a", "node": 3}
    with pytest.raises(ValueError, match="seq 1: restore_done event lacks field.*op"):
        write_ranklog(tmp_path / "w.jsonl", header(0), [good, bad], strict=True)
    path = tmp_path / "r.jsonl"
    write_ranklog(path, header(0), [good, bad, {"seq": 2, "step": 0, "kind": "custom", "x": 1}])
    assert len(read_ranklog(path)[1]) == 3                        # lenient by default
    with pytest.raises(FormatError, match=r"r\.jsonl: line 3: restore_done event lacks"):
        read_ranklog(path, strict=True)


def test_checker_names_an_event_that_does_not_fit_its_kind(tmp_path):
    ok = {"seq": 0, "step": 0, "kind": "match", "rid": "a", "l1_len": 4, "l2_len": 0,
          "l3_len": 0}
    lost = {k: v for k, v in ok.items() if k != "l3_len"}
    for rank, ev in enumerate((ok, lost)):
        (tmp_path / f"rank{rank}.jsonl").write_text(
            "\n".join(json.dumps(x) for x in (header(rank), ev)) + "\n")
    d = check_consensus([tmp_path]).divergences[0]
    assert d.category == rc.HIT_LENGTH
    assert "malformed: rank 1: match event lacks field(s) l3_len" in d.message


def test_comparison_rules_come_from_the_kinds_table():
    for kind in EV.KINDS.values():
        if kind.category is None:
            assert kind.name not in rc.KIND_RULES
        else:
            assert rc.KIND_RULES[kind.name] == (kind.category, kind.deciding)
            assert set(kind.deciding) - {"step"} <= set(kind.fields)
    assert dict(rc.MIXED_KIND_ORDER)[rc.RESTORE_COMPLETION] == {"restore_done", "backup_done"}


def test_documented_kinds_are_the_table():
    text = DOC.read_text()
    table = text[text.index("### Kinds (v1)"):text.index("`op` is an integer")]
    documented = {}
    for kinds, fields in re.findall(r"^\| (`[a-z_]+`(?: / `[a-z_]+`)?) \| (.*?) \|", table, re.M):
        for kind in re.findall(r"`([a-z_]+)`", kinds):
            documented[kind] = set(re.findall(r"`([a-z_0-9]+)`", fields))
    assert set(documented) == set(EV.KINDS)
    for name, kind in EV.KINDS.items():
        assert documented[name] == set(kind.fields) | set(kind.optional), name


def test_transfers_and_l3_jobs_share_one_integer_op_sequence():
    from engine.cache.l3 import SimulatedTier

    c = make_cache(page_size=2, l1_pages=4, l2_pages=4, real=False)
    c.attach_l3(SimulatedTier(capacity_pages=64))
    for t in ([1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12], [1, 2, 3, 4]):
        serve(c, t, check_kv=False)
    c.wait_all()
    issued = [e for e in c.events.events if e["kind"] in ("restore", "backup")]
    assert any(e.get("dst") == "l3" for e in issued) and any("dst" not in e for e in issued)
    ops = [e["op"] for e in issued]
    assert all(type(op) is int for op in ops) and sorted(ops) == list(range(len(ops)))
    c.close()
