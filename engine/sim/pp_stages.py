"""Pipeline stages over real cache stacks: K processes, one per stage, kept consistent by pp_sync.

The cache-level half of pipeline parallelism (docs/parallelism.md §2), runnable without a model:
each stage process owns the KV of its layer range (real L1/L2 pools, real asynchronous
transfers), runs the same requests through the same cache steps (match → lock → load-back →
alloc → write KV → insert → unlock), and after every request runs one :class:`PPSync` step. One
stage's transfers can be slowed (``delay``) to make completions arrive at different times, and
pp_sync can be switched off to show the divergence it prevents. Every stage writes its rank log;
``hicache consensus-check`` compares them.

The KV each stage writes is a deterministic function of (token, position, global layer), and every
restore is checked against it, so a wrong restore is counted (``wrong_kv``), not hidden.
"""

from __future__ import annotations

import dataclasses
import os
import time
import traceback
from typing import Any

import numpy as np

from engine.parallel.launch import RankProcesses
from engine.parallel.rendezvous import Rendezvous, launch_secret


@dataclasses.dataclass
class StagesRun:
    num_stages: int = 2
    layers: int = 4                       # model layers, split evenly across stages
    page_size: int = 4
    l1_tokens: int = 256
    l2_tokens: int = 1024                 # asked per stage; stages agree on the minimum
    sessions: int = 4
    turns: int = 6
    turn_tokens: int = 24
    seed: int = 0
    delay: dict[int, float] = dataclasses.field(default_factory=dict)   # stage -> s per transfer
    pp_sync: bool = True
    max_outstanding: int = 8
    rank_log_dir: str | None = None
    timeout_s: float = 60.0               # pp_sync: silence after which a stage gives up
    die: dict[int, int] = dataclasses.field(default_factory=dict)   # debug: stage -> exit at step


def workload(run: StagesRun) -> list[np.ndarray]:
    """Interleaved multi-turn sessions: each turn resends the session's history plus new tokens."""
    rng = np.random.default_rng(run.seed)
    history = [rng.integers(0, 50_000, run.turn_tokens, dtype=np.uint32) for _ in range(run.sessions)]
    out = []
    for _ in range(run.turns):
        for s in range(run.sessions):
            out.append(history[s].copy())
            history[s] = np.concatenate(
                [history[s], rng.integers(0, 50_000, run.turn_tokens, dtype=np.uint32)])
    return out


def kv_value(tokens: np.ndarray, positions: np.ndarray, layer: int, kind: int, heads: int,
             dim: int):
    """The KV a model would have computed for these tokens at this (global) layer."""
    import torch

    v = (torch.as_tensor(tokens.astype(np.int64) % 4096, dtype=torch.float32) * 1024.0
         + torch.as_tensor(positions, dtype=torch.float32) + layer * 0.25 + kind * 0.125)
    return v.view(-1, 1, 1).expand(-1, heads, dim)


def _serve_one(cache, toks: np.ndarray, rid: int, layer0: int) -> tuple[Any, int]:
    """One request through the cache; returns the match and how many restored KV rows were wrong."""
    import torch

    p = cache.page_size
    m = cache.match(toks, rid=rid)
    receipt = cache.lock(m)
    handle = cache.load_back(m) if m.l2_len or m.l3_len else None
    n_full = len(toks) // p
    have = len(m.l1_pages)
    new = cache.alloc(n_full - have) if n_full > have else np.empty(0, dtype=np.int64)
    pages = np.concatenate([m.l1_pages, new]) if have else new
    lay = cache.l1.layout
    buf = cache.l1.buf
    if len(new):
        slots = torch.as_tensor(cache.l1.slots(new))
        pos = np.arange(have * p, n_full * p)
        for layer in range(lay.num_layers):
            for kind in range(lay.kv_kinds):
                buf[layer, kind, slots] = kv_value(toks[pos], pos, layer0 + layer, kind,
                                                   lay.kv_heads, lay.head_dim)
    wrong = 0
    if have:
        slots = torch.as_tensor(cache.l1.slots(m.l1_pages))
        pos = np.arange(have * p)
        for layer in range(lay.num_layers):
            if handle is not None:
                handle.wait_layer(layer)
            for kind in range(lay.kv_kinds):
                want = kv_value(toks[pos], pos, layer0 + layer, kind, lay.kv_heads, lay.head_dim)
                wrong += int((buf[layer, kind, slots] != want).any(dim=(1, 2)).sum())
    cache.insert(toks[:n_full * p], pages, rid=rid, after=receipt)
    cache.unlock(receipt)
    return m, wrong


def _stage_main(stage: int, run: StagesRun, port: Any, out: Any) -> None:
    import torch.distributed as dist

    from engine.cache.events import EventLog, RankInfo
    from engine.cache.facade import CacheConfig, HiCache
    from engine.core.layout import KVLayout
    from engine.parallel.pp_sync import PPSync, adjacent_groups, agree_min, links_for

    result: dict[str, Any] = {"stage": stage}
    try:
        k = run.num_stages
        port.join(stage, k, 300.0)        # a Rendezvous on 127.0.0.1, keyed by the secret
        groups = adjacent_groups(k)
        per = run.layers // k
        layout = KVLayout(num_layers=per, kv_heads=2, head_dim=4, page_size=run.page_size,
                          layer_start=stage * per, total_layers=run.layers)
        # Host-pool sizing agrees across stages: every stage uses the smallest one asked for.
        l2_tokens = agree_min([run.l2_tokens])[0] if k > 1 else run.l2_tokens
        info = RankInfo(rank=stage, world_size=k, pp_rank=stage, pp_size=k)
        events = EventLog(info, keep=True)
        cache = HiCache(CacheConfig(page_size=run.page_size, l1_tokens=run.l1_tokens,
                                    l2_tokens=l2_tokens, layout=layout,
                                    write_policy="write_through"), events=events)
        if run.delay.get(stage):
            cache.transfers.debug_delay_s = run.delay[stage]
        sync = PPSync(links_for(stage, k, groups), enabled=run.pp_sync,
                      max_outstanding=run.max_outstanding, timeout_s=run.timeout_s)
        hits = {"l1": 0, "l2": 0, "tokens": 0}
        wrong = 0
        for i, toks in enumerate(workload(run)):
            events.set_step(i)
            if run.die.get(stage) == i:
                os._exit(17)               # debug: this stage dies mid-run, without a word
            m, bad = _serve_one(cache, toks, i, stage * per)
            wrong += bad
            hits["l1"] += m.l1_len
            hits["l2"] += m.l2_len
            hits["tokens"] += len(toks)
            sync.step(cache)
        sync.close()
        result.update(hits=hits, wrong_kv=wrong, steps=sync.steps, l2_tokens=l2_tokens,
                      max_outstanding=sync.max_seen_outstanding, events=len(events))
        if run.rank_log_dir:
            os.makedirs(run.rank_log_dir, exist_ok=True)
            path = os.path.join(run.rank_log_dir, f"stage{stage}.ranklog")
            events.write(path)
            result["rank_log"] = path
        cache.wait_all()
        cache.close()
        dist.destroy_process_group()
    except BaseException as exc:  # reported to the parent, never swallowed
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc()
    out.put(result)


def run_stages(run: StagesRun, timeout_s: float = 300.0) -> list[dict]:
    """Run the stages as processes; one result dict per stage, ordered by stage."""
    import queue as queue_mod

    import torch.multiprocessing as mp

    if run.num_stages < 1 or run.layers % run.num_stages:
        raise ValueError(f"{run.layers} layers do not split evenly over {run.num_stages} stages")
    out = mp.get_context("spawn").Queue()
    port = Rendezvous.host(None, launch_secret())
    server = port.store(300.0)  # noqa: F841 - this process hosts the rendezvous; kept alive
    group = RankProcesses(_stage_main, range(run.num_stages), (run, port, out), name="stage",
                          label=lambda s: f"stage {s}")
    procs = [group.procs[s] for s in range(run.num_stages)]
    results: dict[int, dict] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < len(procs) and time.monotonic() < deadline:
            try:
                r = out.get(timeout=0.5)
                results[r["stage"]] = r
                continue
            except queue_mod.Empty:
                pass
            for s, p in enumerate(procs):   # a stage that died without reporting
                if s not in results and p.exitcode is not None and out.empty():
                    results[s] = {"stage": s, "error": f"stage {s} exited with code {p.exitcode}"}
        for s in range(len(procs)):
            results.setdefault(s, {"stage": s, "error": f"stage {s} did not finish in {timeout_s:g} s"})
    finally:
        group.join(timeout=10)
    return [results[s] for s in range(len(procs))]
