"""One replay as ``hicache bench replay`` runs it: the rank it stands for, an optional injected
divergence, the rank log and tree snapshot it writes, one result dict. The command line only
parses options and renders this dict."""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable

from engine.cache.events import EventLog, RankInfo
from engine.sim.replay import ReplayConfig, ReplayInput, replay


@dataclasses.dataclass
class ReplayRun:
    trace_path: str
    config: ReplayConfig
    rank: int = 0
    world_size: int = 1
    rank_log_dir: str | None = None       # write rank{N}.ranklog there
    dump_tree: str | None = None          # write a tree snapshot there
    inject: str | None = None             # divergence spec (engine.parallel.divergence)


def run_replay(inp: ReplayInput, run: ReplayRun,
               progress: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Replay once and write what ``run`` asks for; the result's dict plus ``trace`` and the
    paths written (``rank_log``, ``tree_snapshot``)."""
    cfg = run.config
    if not 0 <= run.rank < run.world_size:
        raise ValueError(f"rank must be in [0, world size), got {run.rank} of {run.world_size}")
    events = EventLog(RankInfo(rank=run.rank, world_size=run.world_size, tp_rank=run.rank,
                               tp_size=run.world_size, cp_size=cfg.cp_size),
                      enabled=cfg.events, keep=run.rank_log_dir is not None)
    if run.inject:
        from engine.parallel.divergence import install

        install(events, run.inject)
    result, cache = replay(inp, cfg, events=events, progress=progress,
                           keep_cache=run.dump_tree is not None)
    out = result.to_dict()
    out["trace"] = run.trace_path
    if run.rank_log_dir is not None:
        os.makedirs(run.rank_log_dir, exist_ok=True)
        path = os.path.join(run.rank_log_dir, f"rank{run.rank}.ranklog")
        events.write(path)
        out["rank_log"] = path
    if run.dump_tree is not None:
        from engine.snapshot.take import write_snapshot

        write_snapshot(run.dump_tree, cache, meta={"source": "bench replay",
                                                   "trace": run.trace_path})
        out["tree_snapshot"] = run.dump_tree
    return out
