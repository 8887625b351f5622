"""pp_sync: stages consume the same ACK counts (docs/parallelism.md §2).

Unit tests script completion orders on real caches; the process tests run real gloo stages with
one stage's transfers delayed, and check the stages' rank logs with consensus-check.
"""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest
from typer.testing import CliRunner

from engine.parallel.pp_sync import PPSync, PPSyncError, StageLinks
from engine.sim.pp_stages import StagesRun, run_stages
from hicache_cli.app import app
from tests.factories import make_cache


def seq(start: int, pages: int, page_size: int = 4) -> np.ndarray:
    return np.arange(start, start + pages * page_size, dtype=np.uint32)


def issue_backup(c, toks) -> None:
    """Insert a prefix on a write-through cache: one backup op issued, nothing polled."""
    m = c.match(toks)
    r = c.lock(m)
    c.insert(toks, c.alloc(len(toks) // c.page_size), after=r)
    c.unlock(r)


def wait_ready(c, n: int) -> None:
    deadline = time.monotonic() + 10
    while c.ready_count("backup") < n:
        assert time.monotonic() < deadline, "backup never completed"
        time.sleep(0.005)


def two_backups(hold_second: bool):
    """A write-through cache with two backups issued; the second held in flight if asked."""
    c = make_cache(page_size=4, l1_pages=8, l2_pages=8, write_policy="write_through")
    issue_backup(c, seq(0, 2))
    wait_ready(c, 1)
    if hold_second:
        c.transfers.pause()
    issue_backup(c, seq(100, 2))
    if not hold_second:
        wait_ready(c, 2)
    return c


def stage1_sync() -> PPSync:
    # Stage 1 of 2 with its upstream link replaced by what stage 0 would have sent.
    return PPSync(StageLinks(stage=1, num_stages=2), enabled=True, timeout_s=5)


def test_later_stage_consumes_exactly_what_the_first_stage_decided():
    first = two_backups(hold_second=True)      # stage 0: ACK #1 ready, #2 still in flight
    later = two_backups(hold_second=False)     # stage 1: both ready
    try:
        counts = [first.ready_count("load"), first.ready_count("backup")]
        assert counts == [0, 1] and later.ready_count("backup") == 2
        sync = stage1_sync()
        sync._inbox.put([0, *counts])
        consumed = sync.step(later)
        assert consumed["backup"] == 1                 # ACK(#1) consumed ...
        assert later.ready_count("backup") == 1        # ... ACK(#2) left queued though done
    finally:
        first.transfers.resume()
        first.close()
        later.close()


def test_a_stage_that_is_behind_waits_for_its_own_completion():
    behind = two_backups(hold_second=True)           # its #2 is held in flight
    sync = stage1_sync()
    sync._inbox.put([0, 0, 2])                       # upstream consumed both
    threading.Timer(0.2, behind.transfers.resume).start()
    consumed = sync.step(behind)                     # waits for #2, then consumes both
    assert consumed["backup"] == 2 and behind.ready_count("backup") == 0
    behind.close()


def test_disabled_sync_consumes_whatever_is_ready():
    c = two_backups(hold_second=True)
    sync = PPSync(StageLinks(stage=1, num_stages=2), enabled=False)
    assert sync.step(c)["backup"] == 1
    c.transfers.resume()
    c.close()


def test_outstanding_messages_are_bounded():
    # Stage 0 whose next stage never takes anything: the third message blocks, then fails clearly.
    sync = PPSync(StageLinks(stage=0, num_stages=2), max_outstanding=2, timeout_s=0.2)
    c = make_cache(page_size=4, l1_pages=4, l2_pages=4)
    sync.step(c)
    sync.step(c)
    with pytest.raises(PPSyncError, match="stage 1 accepted no ACK counts"):
        sync.step(c)
    assert sync.max_seen_outstanding == 2


def test_a_silent_upstream_stage_is_an_error_naming_it():
    sync = PPSync(StageLinks(stage=1, num_stages=2), timeout_s=0.2)
    with pytest.raises(PPSyncError, match="heard nothing from stage 0"):
        sync.step(make_cache(page_size=4, l1_pages=4))


SMALL = dict(sessions=3, turns=4, turn_tokens=16, l1_tokens=128, l2_tokens=512)


def check(path) -> tuple[int, dict]:
    r = CliRunner().invoke(app, ["consensus-check", str(path), "--format", "json"])
    return r.exit_code, json.loads(r.stdout)


def test_two_stages_with_a_delayed_stage_stay_consistent(tmp_path):
    res = run_stages(StagesRun(**SMALL, delay={1: 0.01}, rank_log_dir=str(tmp_path)))
    assert all("error" not in r for r in res), res
    assert res[0]["hits"] == res[1]["hits"] and res[0]["hits"]["l2"] > 0
    assert all(r["wrong_kv"] == 0 for r in res)
    code, report = check(tmp_path)
    assert code == 0, report
    one = run_stages(StagesRun(**SMALL, num_stages=1))[0]
    assert one["hits"] == res[0]["hits"]             # two stages decide what one stage decides


def test_without_pp_sync_consensus_check_finds_the_ack_mismatch_first(tmp_path):
    res = run_stages(StagesRun(**SMALL, delay={1: 0.01}, pp_sync=False,
                               rank_log_dir=str(tmp_path)))
    assert all("error" not in r for r in res), res
    code, report = check(tmp_path)
    assert code == 3
    assert report["divergences"][0]["category"] == "pp_ack_consumption_mismatch", report


def test_a_stage_killed_mid_run_stops_the_pipeline_cleanly():
    res = run_stages(StagesRun(**SMALL, die={1: 3}, timeout_s=3, max_outstanding=2), timeout_s=60)
    assert "exited with code 17" in res[1]["error"]
    assert "pp_sync" in res[0]["error"] and "stage 1" in res[0]["error"]
