"""The PP ACK step: ``HiCache.poll(limits)`` records ``pp_ack`` events, and consensus-check
compares them across the stages of one replica."""

from checkers.consensus import check_consensus
from engine.cache.events import EventLog, RankInfo
from engine.cache.facade import CacheConfig, HiCache
from formats.ranklog import read_ranklog
from tests.factories import tiny_layout

STAGES = 2


def seq(start, n):
    return list(range(start, start + n))


def stage(rank: int) -> HiCache:
    cfg = CacheConfig(page_size=2, l1_tokens=16, l2_tokens=16, layout=tiny_layout(2))
    info = RankInfo(rank=rank, world_size=STAGES, pp_rank=rank, pp_size=STAGES)
    return HiCache(cfg, events=EventLog(info))


def serve_two(c: HiCache) -> None:
    """Two requests, each inserting new KV: two write-through backups (L1 -> L2) in flight."""
    for step, t in enumerate((seq(0, 4), seq(10, 4))):
        c.events.set_step(step)
        a = c.admit(t, rid=f"r{step}")
        c.insert(t, a.pages, rid=f"r{step}", after=a.receipt)
        c.unlock(a.receipt)


def acks_of(c: HiCache) -> list[dict]:
    return [e for e in c.events.events if e["kind"] == "pp_ack"]


def run(tmp_path, honest: bool):
    stages = [stage(r) for r in range(STAGES)]
    stages[1].transfers.pause()                       # stage 1's copies lag behind
    for c in stages:
        serve_two(c)
    for op in stages[0]._inflight_ops("backup"):
        op.wait()
    ready = [c.ready_count("backup") for c in stages]
    assert ready == [2, 0]
    for c in stages:                                  # step 2: they agree on min(ready) = 0
        c.events.set_step(2)
        c.poll(limits={"backup": min(ready)})
    stages[1].transfers.resume()
    for op in stages[1]._inflight_ops("backup"):
        op.wait()
    ready = [c.ready_count("backup") for c in stages]
    assert ready == [2, 2]
    agreed = [1, 1] if honest else [1, 2]             # a dishonest stage 1 takes all it has
    for c, n in zip(stages, agreed):
        c.events.set_step(3)
        assert c.poll(limits={"backup": n})["backup"] == n
    for c in stages:
        c.events.write(str(tmp_path / f"rank{c.events.rank.rank}.ranklog"))
    return stages


def test_poll_with_limits_records_pp_ack_and_ranks_agree(tmp_path):
    stages = run(tmp_path, honest=True)
    acks = acks_of(stages[0])
    assert [(e["step"], e["queue"], e["consumed"], e["acks"]) for e in acks] == \
        [(2, "backup", 0, []), (3, "backup", 1, [acks[1]["acks"][0]])]
    done = [e["op"] for e in stages[0].events.events
            if e["kind"] == "backup_done" and e["step"] == 3]
    assert done == acks[1]["acks"]                    # exactly the acknowledged op committed
    _, events = read_ranklog(tmp_path / "rank1.ranklog", strict=True)
    assert [e for e in events if e["kind"] == "pp_ack"] == acks_of(stages[1])
    report = check_consensus([tmp_path])
    assert report.consistent and report.events == 2 * len(stages[0].events)
    for c in stages:
        c.close()


def test_consensus_check_flags_a_stage_that_consumes_more_acks(tmp_path):
    for c in run(tmp_path, honest=False):
        c.close()
    report = check_consensus([tmp_path])
    assert not report.consistent
    d = report.divergences[0]
    assert d.category == "pp_ack_consumption_mismatch" and d.step == 3
    assert d.fields[0]["consumed"] == 1 and d.fields[1]["consumed"] == 2
