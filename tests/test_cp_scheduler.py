"""The scheduler on 2 CP ranks (real gloo processes, tiny model): each rank runs the same requests
through its own scheduler over a CPCache (its pools hold its pages only) and ShardedKV forwards,
committing transfers when every rank has finished them. Greedy outputs equal one rank's — fresh
prompts, an L1 prefix hit, and a prefix restored from L2 after eviction — and the ranks' logs
are consistent."""

from __future__ import annotations

import numpy as np

from engine.parallel.launch import run_ranks

PS = 16
NEW = 6


def _prompt(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 256, n).tolist()


PHASES = [
    [("p1", _prompt(70, 1)), ("p2", _prompt(40, 2))],                      # fresh
    [("p1b", _prompt(70, 1)[:64] + _prompt(20, 3))],                       # L1 prefix hit
    [(f"f{i}", _prompt(60, 10 + i)) for i in range(4)],                    # push p1 out of L1
    [("p1c", _prompt(70, 1)[:64] + _prompt(9, 4))],                        # restored from L2
    # the start of p1's 4th page: one rank copies its 11 tokens (partial last-page reuse); a CP
    # group does not (that page and the request's first own page may sit on different ranks)
    [("p1d", _prompt(70, 1)[:60])],
]


def run(cache, model, kv_source=None) -> dict:
    from engine.runtime.scheduler import SamplingParams, Scheduler

    sched = Scheduler(model, cache)
    sched.kv_source = kv_source
    out: dict[str, list[int]] = {}
    meta: dict[str, dict] = {}

    def cb(o):
        out.setdefault(o.rid, []).extend(o.new_token_ids)
        if o.finished:
            meta[o.rid] = o.meta
    for phase in PHASES:
        for rid, ids in phase:
            sched.submit(ids, SamplingParams(max_new_tokens=NEW, ignore_eos=True), cb, rid=rid)
        sched.run_until_idle()
    cached = {rid: (m["cached_tokens_details"] if "cached_tokens_details" in m else m)
              for rid, m in meta.items()}
    return {"out": out, "meta": cached}


def _rank(rank: int, world: int, log_dir: str) -> dict:
    import torch.distributed as dist

    from engine.cache.events import EventLog, RankInfo
    from engine.cache.facade import CacheConfig, HiCache
    from engine.parallel.cp_cache import CPCache
    from engine.runtime.model import load_model
    from engine.runtime.ranks.cp_kv import ShardedKV

    model = load_model("tiny")

    def cfg(l1_pages):
        return CacheConfig(page_size=PS, l1_tokens=l1_pages * PS, l2_tokens=64 * PS,
                           layout=model.kv_layout(PS), write_policy="write_through")
    ref = run(HiCache(cfg(16)), model) if rank == 0 else None
    log = EventLog(RankInfo(rank=rank, world_size=world, cp_rank=rank, cp_size=world), keep=True)
    cache = CPCache(cfg(8), world, events=log, rank=rank, group=dist.group.WORLD)

    def sharded(chunks, hooks):
        def ready(layer):
            for h in hooks:
                h(layer)
        return ShardedKV(chunks, cache.l1.buf, cache.shape, rank, ready=ready)

    got = run(cache, model, sharded)
    log.write(f"{log_dir}/rank{rank}.ranklog")
    got["partial"] = [e for e in log.events if e["kind"] == "partial"]
    return {"ref": ref, "got": got, "rows": int(cache.l1.buf.shape[2]),
            "problems": cache.check_rotations(),
            "loaded": cache.transfers.bytes_moved["load"]}


def test_two_cp_ranks_serve_what_one_rank_serves(tmp_path):
    from typer.testing import CliRunner

    from hicache_cli.app import app

    r0, r1 = run_ranks(_rank, 2, str(tmp_path), timeout_s=300, collective_timeout_s=120)
    ref = r0["ref"]["out"]
    assert set(ref) == {rid for phase in PHASES for rid, _ in phase}
    assert r0["got"]["out"] == ref and r1["got"]["out"] == ref
    for r in (r0, r1):
        assert r["problems"] == [] and r["rows"] == 8 * PS and r["loaded"] > 0
        # the cases the phases set up: a device hit, then the same prefix back from the host
        assert r["got"]["meta"]["p1b"]["device"] == 64
        assert r["got"]["meta"]["p1c"]["host"] == 64
        assert r["got"]["meta"]["p1d"]["device"] == 48 and r["got"]["partial"] == []
    assert r0["ref"]["meta"]["p1d"]["device"] == 59       # one rank: 48 + 11 copied
    res = CliRunner().invoke(app, ["consensus-check", str(tmp_path), "--format", "json"])
    assert res.exit_code == 0, res.output
