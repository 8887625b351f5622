"""Rank logs are untrusted input: what a header claims never sizes an allocation, records are at
most 16 MiB wherever they sit, and one finding never prints megabytes."""

from __future__ import annotations

import resource
import subprocess
import sys

import msgpack
import pytest

from checkers.consensus import MAX_LISTED_RANKS, check_consensus, missing_ranges
from formats.errors import FormatError
from formats.ranklog import MAX_RECORD_BYTES, RankLogFile
from formats.ranklog_writer import write_ranklog

HEADER = {"format": "hicache-ranklog", "version": 1}
EV = [{"seq": i, "step": 0, "kind": "lock", "node": i} for i in range(3)]


def test_missing_ranges_cost_nothing_for_a_huge_world():
    assert missing_ranges(10**9, [0, 1, 5]) == [(2, 4), (6, 10**9 - 1)]
    assert missing_ranges(3, [0, 1, 2]) == []
    assert missing_ranges(4, [3]) == [(0, 2)]


def test_world_size_of_a_billion_is_reported_as_ranges(tmp_path):
    for r in (0, 2):
        write_ranklog(tmp_path / f"r{r}.ranklog", {**HEADER, "rank": r, "world_size": 10**9},
                      EV)
    rep = check_consensus([tmp_path])
    d = rep.divergences[0]
    assert d.category == "missing_events" and len(d.ranks) == MAX_LISTED_RANKS
    assert d.ranks[:3] == [1, 3, 4]
    assert d.message == ("no log for ranks 1, 3-999999999 (999,999,998 ranks) (world_size "
                         f"1,000,000,000; the first {MAX_LISTED_RANKS:,} are listed)")
    assert len(str(rep.to_json())) < 100_000


def test_world_size_of_a_billion_under_a_memory_limit(tmp_path):
    """The reported case, end to end: under a 3 GiB address-space limit the CLI answers with
    the finding (exit 3), no MemoryError, no traceback."""
    for r in (0, 1):
        write_ranklog(tmp_path / f"r{r}.ranklog", {**HEADER, "rank": r, "world_size": 10**9},
                      EV)

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))

    p = subprocess.run([sys.executable, "-m", "hicache_cli.app", "consensus-check",
                        str(tmp_path)], capture_output=True, text=True, timeout=120,
                       preexec_fn=limit)
    assert p.returncode == 3, p.stderr
    assert "Traceback" not in p.stderr and "MemoryError" not in p.stderr
    assert "ranks 2-999999999" in p.stdout
    assert len(p.stdout) < 20_000


def big_strings() -> list[str]:
    return ["a" * ((1 << 20) - 64)] * (MAX_RECORD_BYTES // (1 << 20) + 2)


@pytest.mark.parametrize("where", ["header", "event"])
def test_record_over_16_mib_is_refused(tmp_path, where):
    path = tmp_path / "r0.ranklog"
    head = {**HEADER, "rank": 0, "world_size": 1}
    with open(path, "wb") as f:
        if where == "header":
            f.write(msgpack.packb({**head, "pad": big_strings()}))
        else:
            f.write(msgpack.packb(head))
            f.write(msgpack.packb({"seq": 0, "step": 0, "kind": "x",
                                   "local_pad": big_strings()}))
    assert path.stat().st_size > MAX_RECORD_BYTES
    with pytest.raises(FormatError, match="record larger than the 16 MiB limit"):
        with RankLogFile(path) as f:
            list(f.events())


def test_blank_lines_in_a_jsonl_log_are_skipped_and_counted_in_positions(tmp_path):
    import json

    from formats.ranklog import read_ranklog

    p = tmp_path / "r0.jsonl"
    head = json.dumps({**HEADER, "rank": 0, "world_size": 1})
    body = "\n".join(json.dumps(e) for e in EV)
    p.write_text(head + "\n" + "\n" * 200_000 + " \t\r\n" + body + "\n" + "\n" * 1000)
    assert read_ranklog(p)[1] == EV
    p.write_text(head + "\n" + "\n" * 1000 + '{"seq": 0}\n')
    with pytest.raises(FormatError, match="event has no 'step' field"):
        read_ranklog(p)


def test_a_huge_differing_value_is_quoted_short(tmp_path):
    big = "x" * (1 << 20)
    ev_a = [{"seq": 0, "step": 0, "kind": "lock", "node": big}]
    ev_b = [{"seq": 0, "step": 0, "kind": "lock", "node": "y"}]
    for r, ev in ((0, ev_a), (1, ev_b), (2, ev_b)):
        write_ranklog(tmp_path / f"r{r}.ranklog", {**HEADER, "rank": r, "world_size": 3}, ev)
    rep = check_consensus([tmp_path])
    d = rep.divergences[0]
    assert d.ranks == [0] and len(d.message) < 1000 and "xxx…" in d.message
