"""Rank log format v1: writing, reading with limits, and clear errors on bad input."""

from __future__ import annotations

import json

import msgpack
import numpy as np
import pytest

from engine.cache.events import EV, EventLog, RankInfo
from formats import ranklog as rl
from formats import ranklog_compare as rc
from formats.errors import FormatError
from formats.ranklog import RankLogFile, read_ranklog
from formats.ranklog_writer import write_ranklog

HEADER = {"format": "hicache-ranklog", "version": 1, "rank": 1, "world_size": 2}
EVENTS = [
    {"seq": 0, "step": 0, "kind": "match", "rid": "a", "l1_len": 16, "l2_len": 0, "l3_len": 0},
    {"seq": 1, "step": 0, "kind": "restore", "op": 0, "rid": "a", "pages": 2,
     "local_slots": [4, 5]},
    {"seq": 2, "step": 1, "kind": "restore_done", "op": 0, "local_us": 12.5},
    {"seq": 3, "step": 1, "kind": "evict", "tier": "l1", "eligible": [1, 2], "evicted": [1]},
]


def pack(*objs) -> bytes:
    return b"".join(msgpack.packb(o, use_bin_type=True) for o in objs)


def write_bytes(tmp_path, name, data: bytes):
    p = tmp_path / name
    p.write_bytes(data)
    return p


def error_of(path) -> str:
    with pytest.raises(FormatError) as exc:
        read_ranklog(path)
    return str(exc.value)


@pytest.mark.parametrize("suffix", [".ranklog", ".jsonl"])
def test_round_trip_both_encodings(tmp_path, suffix):
    path = tmp_path / f"rank1{suffix}"
    write_ranklog(path, HEADER, EVENTS)
    header, events = read_ranklog(path)
    assert events == EVENTS
    # missing parallel fields default to rank 0 of size 1
    assert header == {**HEADER, "dp_rank": 0, "tp_rank": 0, "tp_size": 1, "pp_rank": 0,
                      "pp_size": 1, "cp_rank": 0, "cp_size": 1}
    assert not (tmp_path / f"rank1{suffix}.tmp").exists()


def test_msgpack_is_a_stream_of_maps_and_jsonl_one_map_per_line(tmp_path):
    write_ranklog(tmp_path / "r.ranklog", HEADER, EVENTS)
    write_ranklog(tmp_path / "r.jsonl", HEADER, EVENTS)
    assert list(msgpack.Unpacker(open(tmp_path / "r.ranklog", "rb"))) == [HEADER, *EVENTS]
    lines = (tmp_path / "r.jsonl").read_text().splitlines()
    assert [json.loads(x) for x in lines] == [HEADER, *EVENTS]


def test_event_log_write_numpy_values(tmp_path):
    log = EventLog(RankInfo(rank=3, world_size=4, dp_rank=1, tp_rank=1, tp_size=2))
    log.set_step(7)
    log.emit(EV.MATCH, rid="r", l1_len=np.int64(32), l2_len=0, l3_len=0,
             local_pages=np.arange(2, dtype=np.int64))
    log.emit(EV.LOCK, rid="r", node=5)
    log.write(str(tmp_path / "rank3.ranklog"))
    header, events = read_ranklog(tmp_path / "rank3.ranklog")
    assert (header["rank"], header["dp_rank"], header["tp_size"]) == (3, 1, 2)
    assert events == [
        {"seq": 0, "step": 7, "kind": "match", "rid": "r", "l1_len": 32, "l2_len": 0,
         "l3_len": 0, "local_pages": [0, 1]},
        {"seq": 1, "step": 7, "kind": "lock", "rid": "r", "node": 5},
    ]


def test_writer_rejects_bad_suffix_and_bad_header(tmp_path):
    with pytest.raises(ValueError, match=r"\.ranklog, \.jsonl"):
        write_ranklog(tmp_path / "r.txt", HEADER, [])
    with pytest.raises(ValueError, match="rank 2 is not below world_size 2"):
        write_ranklog(tmp_path / "r.ranklog", {**HEADER, "rank": 2}, [])


def test_jsonl_blank_lines_and_line_numbers(tmp_path):
    text = (json.dumps(HEADER) + "\n\n" + json.dumps(EVENTS[0]) + "\n   \n"
            + '{"seq": 1, "step": 0, "kind": \n')
    p = write_bytes(tmp_path, "r.jsonl", text.encode())
    assert error_of(p).endswith("r.jsonl: line 5: invalid JSON (Expecting value at column 31)")


@pytest.mark.parametrize("value, problem", [("NaN", "NaN is not a JSON value"),
                                            ("-Infinity", "-Infinity is not a JSON value"),
                                            ("1e400", "number 1e400 is out of range")])
def test_jsonl_refuses_non_finite_numbers(tmp_path, value, problem):
    # NaN != NaN made equal logs diverge, and --format json then printed invalid JSON
    text = json.dumps(HEADER) + '\n{"seq": 0, "step": 0, "kind": "match", "x": ' + value + "}\n"
    p = write_bytes(tmp_path, "r.jsonl", text.encode())
    assert error_of(p).endswith(f"r.jsonl: line 2: invalid JSON (ValueError: {problem})")


def test_unknown_suffix_is_sniffed(tmp_path):
    write_ranklog(tmp_path / "r.jsonl", HEADER, EVENTS)
    write_ranklog(tmp_path / "r.ranklog", HEADER, EVENTS)
    (tmp_path / "a.log").write_bytes((tmp_path / "r.jsonl").read_bytes())
    (tmp_path / "b.log").write_bytes((tmp_path / "r.ranklog").read_bytes())
    assert read_ranklog(tmp_path / "a.log")[1] == EVENTS
    assert read_ranklog(tmp_path / "b.log")[1] == EVENTS


# -- bad input: every case names the file and the byte offset or line --------------------------
def test_empty_file(tmp_path):
    p = write_bytes(tmp_path, "r.ranklog", b"")
    assert error_of(p) == f"{p}: empty file: no rank log header"


def test_truncated_msgpack_names_the_record_offset(tmp_path):
    data = pack(HEADER, *EVENTS)
    p = write_bytes(tmp_path, "r.ranklog", data[:-3])
    last = len(pack(HEADER, *EVENTS[:-1]))
    assert error_of(p) == (f"{p}: byte offset {last}: truncated record: the file ends at byte "
                           f"{len(data) - 3} inside it")


def test_truncated_header(tmp_path):
    p = write_bytes(tmp_path, "r.ranklog", pack(HEADER)[:10])
    assert "byte offset 0: truncated record" in error_of(p)


def test_garbage_bytes_after_events(tmp_path):
    good = pack(HEADER, *EVENTS[:2])
    p = write_bytes(tmp_path, "r.ranklog", good + b"\xc1\xff\x00garbage")
    assert error_of(p).startswith(f"{p}: byte offset {len(good)}: undecodable msgpack")


def test_garbage_that_decodes_to_non_maps(tmp_path):
    good = pack(HEADER, EVENTS[0])
    p = write_bytes(tmp_path, "r.ranklog", good + b"\x05\x06")
    assert error_of(p) == f"{p}: byte offset {len(good)}: record is an integer, not an event map"


def test_whole_file_of_garbage(tmp_path):
    p = write_bytes(tmp_path, "r.ranklog", bytes(range(7, 200)))
    assert error_of(p) == \
        f"{p}: byte offset 0: first record is an integer, not a rank log header map"


@pytest.mark.parametrize("header, problem", [
    ({"format": "hicache-snapshot", "version": 1, "rank": 0, "world_size": 1},
     "wrong header: format is 'hicache-snapshot', expected 'hicache-ranklog'"),
    ({"format": "hicache-ranklog", "version": "1", "rank": 0, "world_size": 1},
     "wrong header: version must be a positive integer, got '1'"),
    ({"format": "hicache-ranklog", "version": 1, "world_size": 1}, "wrong header: no 'rank' field"),
    ({"format": "hicache-ranklog", "version": 1, "rank": 0, "world_size": 2, "tp_rank": 2,
      "tp_size": 2}, "wrong header: tp_rank 2 is not below tp_size 2"),
    ({"format": "hicache-ranklog", "version": 1, "rank": -1, "world_size": 2},
     "wrong header: rank must be an integer >= 0, got -1"),
    (EVENTS[0], "no header: the first record is an event"),
    ([1, 2, 3], "first record is an array, not a rank log header map"),
])
def test_wrong_header(tmp_path, header, problem):
    p = write_bytes(tmp_path, "r.ranklog", pack(header, *EVENTS))
    assert error_of(p).startswith(f"{p}: byte offset 0: {problem}")


def test_unsupported_version(tmp_path):
    p = write_bytes(tmp_path, "r.ranklog", pack({**HEADER, "version": 2}, *EVENTS))
    with RankLogFile(p) as f:          # opening works: the version is reported by the caller
        assert f.version == 2
    assert error_of(p) == (f"{p}: byte offset 0: unsupported rank log version 2 (this hicache "
                           f"reads version 1)")


@pytest.mark.parametrize("event, problem", [
    ({"step": 0, "kind": "lock"}, "event has no 'seq' field"),
    ({"seq": 1, "kind": "lock"}, "event has no 'step' field"),
    ({"seq": 1, "step": 0}, "event has no 'kind' field"),
    ({"seq": "1", "step": 0, "kind": "lock"}, "event field 'seq' must be an integer, got string"),
    ({"seq": 1, "step": -2, "kind": "lock"}, "event field 'step' must be >= 0, got -2"),
    ({"seq": 1, "step": 0, "kind": 3}, "event field 'kind' must be a string, got integer 3"),
    ({"seq": True, "step": 0, "kind": "x"}, "event field 'seq' must be an integer, got boolean"),
    (HEADER, "a second header in the middle of the log"),
])
def test_bad_event_records(tmp_path, event, problem):
    good = pack(HEADER, EVENTS[0])
    p = write_bytes(tmp_path, "r.ranklog", good + pack(event))
    assert error_of(p).startswith(f"{p}: byte offset {len(good)}: {problem}")
    j = write_bytes(tmp_path, "r.jsonl", "\n".join(json.dumps(x) for x in
                                                   (HEADER, EVENTS[0], event)).encode())
    assert error_of(j).startswith(f"{j}: line 3: {problem}")


def test_extension_types_are_refused(tmp_path):
    good = pack(HEADER)
    p = write_bytes(tmp_path, "r.ranklog", good + msgpack.packb(
        {"seq": 0, "step": 0, "kind": "x", "t": msgpack.Timestamp(5)}))
    assert error_of(p) == (f"{p}: byte offset {len(good)}: msgpack extension types (timestamps, "
                           f"...) are not allowed in a rank log")


def test_size_limits(tmp_path, monkeypatch):
    huge = {"seq": 0, "step": 0, "kind": "x", "blob": "a" * (rl.MAX_STR_BYTES + 1)}
    good = pack(HEADER)
    p = write_bytes(tmp_path, "r.ranklog", good + pack(huge))
    assert error_of(p).startswith(f"{p}: byte offset {len(good)}: undecodable msgpack")
    # a length prefix claiming a 4 GiB string is refused without allocating it
    p = write_bytes(tmp_path, "r.ranklog", good + b"\x81\xa3seq\xdb\xff\xff\xff\xff")
    assert error_of(p) == f"{p}: byte offset {len(good)}: truncated record: the file ends at " \
                          f"byte {len(good) + 10} inside it"
    big = {"seq": 1, "step": 0, "kind": "x", "nodes": list(range(3000))}
    monkeypatch.setattr(rl, "MAX_RECORD_BYTES", 4096)
    p = write_bytes(tmp_path, "r.ranklog", good + pack(EVENTS[0], big))
    assert error_of(p) == (f"{p}: byte offset {len(pack(HEADER, EVENTS[0]))}: record larger than "
                           f"the 4,096 bytes limit")
    monkeypatch.setattr(rl, "MAX_RECORD_BYTES", 90)
    j = write_bytes(tmp_path, "r.jsonl", (json.dumps(HEADER) + "\n" + " " * 100 + "{}\n").encode())
    assert error_of(j) == f"{j}: line 2: line longer than the 90 bytes limit"


def test_run_reading_matches_record_reading(tmp_path):
    events = [{"seq": i, "step": i // 3, "kind": "lock", "node": i, **({"local_t": i} if i % 4
                                                                        else {})}
              for i in range(50)]
    write_ranklog(tmp_path / "r.ranklog", HEADER, events)
    with RankLogFile(tmp_path / "r.ranklog") as f:
        run, end = f.read_run(f.body_offset, 20)
        assert run.seqs == list(range(20)) and run.steps == [i // 3 for i in range(20)]
        assert run.events[5] == {"step": 1, "kind": "lock", "node": 5}   # no seq, no local_*
        assert [run.full(i) for i in range(20)] == events[:20]
        ends = f.record_ends(f.body_offset, 20)
        assert ends[-1] == end
        offset, decoded = f.body_offset, []
        for e in ends:
            obj, offset = f.decode_at(offset)
            assert offset == e
            decoded.append(obj)
        assert decoded == events[:20]
        assert f.decode_at(f.size) is None


def test_classify_rules():
    m = {"kind": "match", "rid": "a", "l1_len": 16, "l2_len": 0, "l3_len": 0, "step": 1}
    assert rc.classify([m, {**m, "l2_len": 16}]) == rc.HIT_LENGTH
    assert rc.classify([m, {**m, "rid": "b"}]) == rc.EVENT
    assert rc.classify([m, None]) == rc.MISSING
    done = {"kind": "restore_done", "op": 1, "step": 1}
    assert rc.classify([done, {**done, "step": 2}]) == rc.RESTORE_COMPLETION
    assert rc.classify([done, {"kind": "unlock", "rid": "a", "node": 1, "step": 1}]) == \
        rc.RESTORE_COMPLETION
    lock = {"kind": "lock", "rid": "a", "node": 1, "step": 0}
    assert rc.classify([lock, {**lock, "kind": "unlock"}]) == rc.LOCK_ORDER
    ack = {"kind": "pp_ack", "queue": "load", "consumed": 1, "acks": [4], "step": 0}
    assert rc.classify([ack, ack, {**ack, "acks": [6]}]) == rc.PP_ACK
    assert rc.classify([ack, lock]) == rc.PP_ACK
    ev = {"kind": "evict", "tier": "l1", "eligible": [1], "evicted": [], "step": 0}
    assert rc.classify([ev, {**ev, "evicted": [1]}]) == rc.EVICTION
    assert rc.classify([{"kind": "x", "a": 1, "step": 0}, {"kind": "x", "a": 2, "step": 0}]) == \
        rc.EVENT
    assert rc.differing_fields([m, {**m, "l1_len": 0, "extra": 1}]) == ["l1_len", "extra"]
