"""Multi-rank trace replay: N real processes over ``torch.distributed`` (gloo).

Each rank stands for one tensor-parallel rank of a replica: it replays the same trace through
its own cache stack, records its decisions, and — with online consensus on — compares them with
the other ranks every ``every`` requests (:mod:`engine.parallel.consensus_online`). Ranks that agree
produce identical logs (``hicache consensus-check`` says consistent); a divergence injected on
one rank stops every rank at the first divergent event, with the logs written.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import time
import traceback
from typing import Any

from engine.parallel.launch import RankProcesses
from engine.parallel.rendezvous import Rendezvous, launch_secret
from engine.sim.replay import ReplayConfig


@dataclasses.dataclass
class RankRun:
    trace: str
    config: ReplayConfig
    world_size: int
    rank_log_dir: str | None = None
    online_every: int = 0                 # 0: no online consensus
    inject: str | None = None
    dump_tree_dir: str | None = None      # each rank writes tree-rank{N}.snapshot there
    nnodes: int = 1                       # hosts the ranks are spread over, evenly
    node_rank: int = 0                    # this host: it runs ranks node_rank*k … (k per node)
    init_addr: str | None = None          # HOST:PORT of the rendezvous (node 0); None: local


def _rank_main(rank: int, run: RankRun, addr: Any, out: Any) -> None:
    import torch.distributed as dist

    from engine.cache.events import EventLog, RankInfo
    from engine.loadgen.trace import load_trace
    from engine.parallel.consensus_online import OnlineConsensus, RankConsensusError, consensus_group
    from engine.parallel.divergence import install
    from engine.sim.replay import replay

    result: dict[str, Any] = {"rank": rank}
    try:
        addr.join(rank, run.world_size, 300.0, nnodes=run.nnodes)   # bound, keyed by the secret
        if run.config.cp_size > 1:     # the ranks are the CP group: one logical tree each
            info = RankInfo(rank=rank, world_size=run.world_size, cp_rank=rank,
                            cp_size=run.world_size)
        else:
            info = RankInfo(rank=rank, world_size=run.world_size, tp_rank=rank,
                            tp_size=run.world_size)
        log = EventLog(info, keep=run.rank_log_dir is not None)
        if run.inject:
            install(log, run.inject)
        online = None
        if run.online_every:
            group = consensus_group(info)
            online = OnlineConsensus(log, group, every=run.online_every,
                                     log_dir=run.rank_log_dir or ".")
        records = load_trace(run.trace, run.config.limit)
        step_hook = (lambda i: online.step_done(i - 1)) if online is not None else None
        try:
            res, cache = replay(records, run.config, events=log, progress=step_hook,
                                keep_cache=run.dump_tree_dir is not None)
            if online is not None:
                online.check()
            result["result"] = res.to_dict()
            result["online_checks"] = online.checks if online is not None else 0
        except RankConsensusError as exc:
            result["consensus_error"] = str(exc)
            result["log_dir"] = exc.log_dir
        if run.dump_tree_dir and "result" in result:
            from engine.snapshot.take import snapshot_filename, write_snapshot

            os.makedirs(run.dump_tree_dir, exist_ok=True)
            path = os.path.join(run.dump_tree_dir, snapshot_filename(rank))
            write_snapshot(path, cache, {"source": "bench replay --ranks", "rank": info,
                                         "trace": run.trace})
            result["tree_snapshot"] = path
        if run.rank_log_dir and "consensus_error" not in result:
            os.makedirs(run.rank_log_dir, exist_ok=True)
            path = os.path.join(run.rank_log_dir, f"rank{rank}.ranklog")
            log.write(path)
            result["rank_log"] = path
        dist.destroy_process_group()
    except BaseException as exc:  # reported to the parent, never swallowed
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc()
    out.put(result)


def replay_ranks(run: RankRun, timeout_s: float = 600.0) -> list[dict]:
    """Run this node's ranks (all of them on one node); returns one dict per rank, by rank."""
    import torch.multiprocessing as mp

    if run.world_size < 1:
        raise ValueError(f"world size must be >= 1, got {run.world_size}")
    if run.nnodes < 1 or run.world_size % run.nnodes or not 0 <= run.node_rank < run.nnodes:
        raise ValueError(f"{run.world_size} ranks do not spread evenly over {run.nnodes} nodes "
                         f"(node rank {run.node_rank})")
    out = mp.get_context("spawn").Queue()
    secret = launch_secret(run.nnodes)
    # node 0 hosts the rendezvous in this process (127.0.0.1, or exactly init_addr's host)
    addr = Rendezvous.host(run.init_addr, secret) if run.node_rank == 0 else \
        Rendezvous(run.init_addr, secret)
    server = addr.store(300.0) if run.node_rank == 0 else None  # noqa: F841 - kept alive
    k = run.world_size // run.nnodes
    # the server's launcher parts: spawned, beating, watched, exiting with this process
    procs = RankProcesses(_rank_main, range(run.node_rank * k, (run.node_rank + 1) * k),
                          (run, addr, out), name="replay-rank")
    results: dict[int, dict] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < len(procs.procs) and time.monotonic() < deadline:
            try:
                r = out.get(timeout=0.5)
                results[r["rank"]] = r
                continue
            except queue.Empty:
                pass
            for why in procs.dead():          # a rank gone without a result (killed, hung)
                rank = next((r for r in procs.procs if why.startswith(f"rank {r} ")), None)
                if rank is not None and rank not in results and out.empty():
                    results[rank] = {"rank": rank, "error": why}
        for rank in procs.procs:
            results.setdefault(rank, {"rank": rank,
                                      "error": f"did not finish within {timeout_s:g} s"})
    finally:
        procs.join(timeout=10)
    return [results[r] for r in sorted(results)]


def summarize_ranks(run: RankRun, results: list[dict]) -> dict:
    """One report of a multi-rank replay. ``consistent`` is None without online consensus
    (nothing compared the ranks' decisions); a divergence carries ``consensus_error`` and the
    ``rank_log_dir`` holding the logs. A rank that failed raises ``RuntimeError``."""
    errors = [r for r in results if "error" in r]
    if errors:
        raise RuntimeError(f"rank {errors[0]['rank']} failed: {errors[0]['error']}")
    diverged = [r for r in results if "consensus_error" in r]
    every = run.online_every
    out: dict[str, Any] = {"trace": run.trace, "ranks": run.world_size, "nnodes": run.nnodes,
                           "node_rank": run.node_rank,
                           "local_ranks": [r["rank"] for r in results],
                           "online_consensus": bool(every),
                           "consistent": not diverged if every else None}
    if diverged:
        out["consensus_error"] = diverged[0]["consensus_error"]
        out["rank_log_dir"] = diverged[0]["log_dir"]
        return out
    out["result"] = results[0]["result"]
    out["online_checks"] = results[0]["online_checks"]
    out["identical_hit_rates"] = len({r["result"]["token_hit_rate"] for r in results}) == 1
    if run.rank_log_dir is not None:
        out["rank_logs"] = [r["rank_log"] for r in results]
    if run.dump_tree_dir is not None:
        out["tree_snapshots"] = [r["tree_snapshot"] for r in results]
    return out
