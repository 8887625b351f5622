"""Online consensus: two real processes over gloo, one rank with an injected divergence."""

from __future__ import annotations

import json
import os
import socket

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from checkers.consensus import check_consensus
from engine.cache.events import EV, EventLog, RankInfo
from engine.parallel.divergence import Injection, install, parse_spec, record, synthetic_decisions

WORLD = 2
STEPS = 24


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(rank: int, tmp: str, group, spec: str | None, every: int, keep: bool) -> dict:
    """One replica run of STEPS scheduler steps; returns what happened on this rank."""
    from engine.parallel.consensus_online import OnlineConsensus, RankConsensusError

    log = EventLog(RankInfo(rank=rank, world_size=WORLD, tp_rank=rank, tp_size=WORLD), keep=keep)
    log.mutator = lambda ev: {**ev, "local_rank": rank}   # rank-local data is never compared
    if spec:
        install(log, spec)
    out_dir = os.path.join(tmp, f"logs-{spec or 'ok'}-{keep}")
    online = OnlineConsensus(log, group, every=every, log_dir=out_dir)
    by_step: dict[int, list[dict]] = {}
    for d in synthetic_decisions(600, seed=3):
        by_step.setdefault(d["step"], []).append(d)
    try:
        for step in range(STEPS):
            log.set_step(step)
            record(log, by_step.get(step, []))
            online.step_done(step)
        online.check()
    except RankConsensusError as exc:
        n = len(log.events)
        log.emit(EV.RESTORE_DONE, op=10**6)    # e.g. a copy finishing in the shutdown drain
        return {"frozen": len(log.events) == n, "error": str(exc), "step": exc.step,
                "seq": exc.seq, "kind": exc.kind,
                "category": exc.category, "ranks": exc.ranks, "dir": exc.log_dir,
                "checks": online.checks}
    return {"error": None, "checks": online.checks, "events": len(log)}


def _worker(rank: int, tmp: str, port: int) -> None:
    from engine.parallel.consensus_online import consensus_group

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD)
    try:
        group = consensus_group(RankInfo(rank=rank, world_size=WORLD, tp_rank=rank,
                                         tp_size=WORLD))
        results = {
            "ok": _run(rank, tmp, group, None, every=4, keep=True),
            "hit": _run(rank, tmp, group, "hit_length@rank=1,step=9", every=4, keep=True),
            "gap": _run(rank, tmp, group, "missing_events@rank=0,step=13", every=5, keep=False),
        }
        with open(os.path.join(tmp, f"result{rank}.json"), "w") as fh:
            json.dump(results, fh)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("online"))
    mp.start_processes(_worker, args=(tmp, _free_port()), nprocs=WORLD, join=True,
                       start_method="spawn")
    out = []
    for r in range(WORLD):
        with open(os.path.join(tmp, f"result{r}.json")) as fh:
            out.append(json.load(fh))
    return out


def test_consistent_run_passes_every_check(results):
    for r in results:
        assert r["ok"]["error"] is None
        assert r["ok"]["checks"] == STEPS // 4 + 1
    assert results[0]["ok"]["events"] == results[1]["ok"]["events"] > 0


def test_divergence_stops_every_rank_naming_the_first_divergent_event(results):
    a, b = results[0]["hit"], results[1]["hit"]
    assert a["error"] is not None and a["error"] == b["error"]   # same message everywhere
    assert (a["category"], a["kind"], a["ranks"], a["step"]) == (
        "hit_length_mismatch", "match", [1], 9)
    assert a["checks"] == 3        # steps 0-3 and 4-7 agreed; the check after step 11 failed
    assert a["frozen"] and b["frozen"]   # nothing recorded after the loss (the exit rewrites it)
    assert f"rank consensus lost at step 9, seq {a['seq']}" in a["error"]
    assert "rank 1 recorded match (l1_len=" in a["error"]
    assert f"run `hicache consensus-check {a['dir']}`" in a["error"]
    # the logs written on divergence explain the same event offline
    rep = check_consensus([a["dir"]])
    (d,) = rep.divergences
    assert (d.category, d.step, d.seq, d.ranks) == ("hit_length_mismatch", 9, a["seq"], [1])


def test_window_logs_when_the_event_log_keeps_nothing(results):
    a, b = results[0]["gap"], results[1]["gap"]
    assert a["error"] == b["error"] and a["category"] == "missing_events"
    assert a["step"] == 13 and a["ranks"] == [0]
    rep = check_consensus([a["dir"]])
    d = rep.divergences[0]
    assert (d.category, d.step, d.ranks) == ("missing_events", 13, [0])
    # only the window since the last agreement (after step 9) was written
    first = rep.divergences[0].context[1]["before"]
    assert all(e["step"] >= 10 for e in first)


def test_parse_spec():
    assert parse_spec("hit_length@rank=1,step=3;pp_ack_consumption_mismatch@rank=0,count=2") == [
        Injection("hit_length", 1, 3, 1), Injection("pp_ack", 0, 0, 2)]
    for bad, msg in [("nope@rank=1", "unknown divergence kind 'nope'; choose one of hit_length"),
                     ("hit_length@step=3", "needs rank=R"),
                     ("hit_length@rank=x", "rank must be an integer"),
                     ("hit_length@rank=1,when=2", "bad divergence parameter 'when=2'"),
                     ("", "empty divergence spec")]:
        with pytest.raises(ValueError, match=msg):
            parse_spec(bad)


def test_install_only_on_the_named_rank():
    log0, log1 = EventLog(RankInfo(rank=0, world_size=2)), EventLog(RankInfo(rank=1, world_size=2))
    assert install(log0, "lock_order@rank=1,step=2") is None and log0.mutator is None
    inj = install(log1, "lock_order@rank=1,step=2")
    for log in (log0, log1):
        for step in range(4):
            log.set_step(step)
            log.emit(EV.LOCK, rid="a", node=step)
    assert [e["kind"] for e in log0.events] == ["lock"] * 4
    assert [e["kind"] for e in log1.events] == ["lock", "lock", "unlock", "lock"]
    assert inj.applied[0][1:] == (2, 2)
