"""``build_rank(config, topology)``: one rank's model, cache and scheduler, whatever the shape.

What differs between shapes is decided here, once, from the :class:`Topology`:

* the model: the whole one (one process), its TP shard (heads and MLP slice, an all-reduce over
  the TP group), its pipeline stage's layers, or both;
* the cache: a :class:`HiCache`; a :class:`CPCache` (its pools hold the pages it owns) with CP;
  a :class:`TPCache` around either with TP (transfer commits and L3 decisions agreed);
* the L3 store, opened with this rank's placement (its kv-heads, its layers) and, with CP, only
  the pages this rank owns;
* the scheduler: a plain :class:`Scheduler` for one process, else the lockstep one
  (:class:`LockstepScheduler`, or :class:`PipelineScheduler` with stages).

A rank that is not alone joins the group at ``rendezvous`` first (rank 0 hosts it; the launcher
starts the others before rank 0 builds).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from typing import Any, Callable

import torch

from engine.cache.events import EventLog, RankInfo
from engine.cache.facade import CacheConfig, HiCache
from engine.core.device import resolve_device
from engine.core.errors import InputError, StorageError, UsageError
from engine.runtime.config import ServerConfig, delay_for
from engine.runtime.model import Model, load_model
from engine.runtime.model.fingerprint import weights_digest
from engine.runtime.model_id import model_tag
from engine.runtime.ranks.diverge import (
    agreed_capacity,
    apply_to_cache,
    apply_to_l3,
    diverge_of,
    pp_sync_on,
    stage_agreement,
    wrap_store,
)
from engine.runtime.ranks.groups import RankGroups, cut_groups, rank_device, reduce_backend, share_cores
from engine.runtime.ranks.lockstep import LockstepScheduler
from engine.runtime.ranks.pipeline import PipelineScheduler, stage_model
from engine.runtime.scheduler import Scheduler, SchedulerConfig
from engine.runtime.topology import Topology

log = logging.getLogger("hicache.ranks")

DIVERGENCE_LOG_DIR = "hicache-rank-logs"   # online consensus without --rank-log-dir: here


@dataclasses.dataclass
class Rank:
    """One rank, built: what the HTTP engine (rank 0) or a rank worker runs."""

    config: ServerConfig
    topology: Topology
    device: str
    model: Model                     # this rank's part of the model
    full_config: Any                 # the model config before any TP/PP split
    cache: Any                       # HiCache, CPCache or TPCache (the facade's calls)
    scheduler: Scheduler
    draft: Any
    l2_tokens: int
    kv_bytes_per_token: dict
    weights_digest: str
    fingerprint_s: float
    model_tag: str
    l3_status: str = "off"
    l3_store: Any = None
    restore_threads: Callable[[], None] | None = None

    def rank_log_path(self) -> str:
        return os.path.join(self.config.rank_log_dir or ".",
                            f"rank{self.cache.events.rank.rank}.ranklog")

    def write_log(self) -> str | None:
        """This rank's event log into ``--rank-log-dir`` (when set): every transfer finished
        first, so the log is the whole run."""
        if self.config.rank_log_dir is None:
            return None
        online = getattr(self.scheduler, "consensus", None)
        if online is not None and getattr(online, "written", None):
            return online.written    # the log as it was at the divergence: finishing the
            # transfers now could commit on one rank what the others had not (and hide it)
        l3 = getattr(self.cache, "l3", None)
        if l3 is not None:                  # stopping: the other stages may be gone
            l3.agree_stages = None
        self.cache.wait_all()
        os.makedirs(self.config.rank_log_dir, exist_ok=True)
        path = self.rank_log_path()
        self.cache.events.write(path)
        log.info("rank log written to %s", path)
        return path

    def write_snapshot(self, directory: str, meta: dict) -> str:
        """This rank's tree as ``DIR/tree-rank{r}.snapshot`` (between steps: the tree is
        still)."""
        from engine.snapshot.take import snapshot_filename, write_snapshot

        path = os.path.join(directory, snapshot_filename(self.cache.events.rank.rank))
        write_snapshot(path, self.cache, meta)
        return path

    def close(self) -> None:
        self.cache.close()
        if self.restore_threads is not None:
            self.restore_threads()
            self.restore_threads = None


def build_rank(cfg: ServerConfig, topo: Topology, rendezvous: Any = None,
               health: Callable[[], list[str]] = lambda: [], remote: Any = None) -> Rank:
    """Rank ``topo.rank``'s parts. ``rendezvous``: where the group meets (needed unless the
    topology is one process); ``health``: rank 0's view of gone ranks (the launcher's);
    ``remote(cache)``: makes a P/D decode worker's link client (it fetches what admission
    lacks into the cache's L1)."""
    device = resolve_device(cfg.device)
    backend = "gloo"
    restore = None
    if topo.tp > 1:
        backend = reduce_backend(device, topo.world)
        device = rank_device(device, topo.rank, backend)
        restore = share_cores(device, topo.per_node)
    if cfg.threads:                      # --threads: this process's torch threads
        before, prev = torch.get_num_threads(), restore
        torch.set_num_threads(cfg.threads)
        restore = prev or (lambda: torch.set_num_threads(before))
    model = load_model(cfg.model, device, seed=cfg.seed, exact=cfg.exact,
                       gemm_dtype=None if cfg.gemm_dtype == "float32" else cfg.gemm_dtype)
    t0 = time.perf_counter()             # the weights as loaded, before any TP/PP split
    digest = weights_digest(model.w)
    fingerprint_s = time.perf_counter() - t0
    full = model.cfg
    if topo.single:                      # the exact path's start-up probe (one process)
        from engine.runtime.model.probe import check_exact

        check_exact(model, tokens=100)
    groups = None
    if not topo.single:
        _check_tp(model.cfg, topo.tp)
        if rendezvous is None:
            raise ValueError(f"{topo.describe()}: the ranks need a rendezvous")
        rendezvous.join(topo.rank, topo.world, cfg.collective_timeout_s, nnodes=topo.nnodes)
        groups = cut_groups(topo, backend)
    dv = diverge_of(cfg)
    l1_tokens = agreed_capacity(cfg, topo, dv)
    model = split_model(model, topo, groups)
    if cfg.context_length is not None:   # SGLang's --context-length
        if cfg.context_length > model.cfg.max_context:
            raise UsageError(f"--context-length {cfg.context_length} exceeds the model's "
                             f"context of {model.cfg.max_context} tokens")
        model.cfg = dataclasses.replace(model.cfg, max_context=cfg.context_length)
    spec = cfg.spec_config()
    draft = sidecar = None
    if spec is not None:
        from engine.runtime.model.draft import make_draft
        from engine.runtime.scheduler.spec import sidecar_layout

        draft = make_draft(model, spec.draft_preset)
        if spec.draft_layout == "sidecar":
            sidecar = sidecar_layout(model, cfg.page_size, draft)
    from engine.runtime.scheduler.spec import cache_layout

    layout = cache_layout(model, cfg.page_size, draft, spec)
    target_bytes = model.kv_layout(cfg.page_size).page_bytes // cfg.page_size
    token_bytes = (layout.page_bytes + (sidecar.page_bytes if sidecar else 0)) // cfg.page_size
    l2_tokens = cfg.l2_tokens_for(token_bytes)
    cfg.check_memory(token_bytes, l2_tokens, device)
    cache_cfg = CacheConfig(
        page_size=cfg.page_size, l1_tokens=l1_tokens, l2_tokens=l2_tokens,
        write_policy=cfg.write_policy, write_through_threshold=cfg.write_through_threshold,
        eviction_policy=cfg.eviction_policy, host_layout=cfg.host_layout, device=device,
        layout=layout, sidecar=sidecar, hint_kwargs={"trust_mode": cfg.hint_trust})
    cache = make_cache(cache_cfg, model, cfg, topo, groups)
    apply_to_cache(cache, topo, dv)
    if topo.pp > 1:
        cache.transfers.debug_delay_s = delay_for(cfg.debug_transfer_delay, topo.pp, topo.tp,
                                                  topo.stage, topo.tp_rank)
    if cfg.rank_log_dir is not None:     # fail at start, not at shutdown
        from formats.outpath import check_output_dir, check_output_file

        check_output_dir(cfg.rank_log_dir)
        check_output_file(os.path.join(cfg.rank_log_dir, f"rank{topo.rank}.ranklog"))
    tag = model_tag(full, digest, cfg.hicache_model_fingerprint)
    if draft is not None:                # the draft's KV is in the objects too
        tag += f"+{spec.draft_preset}"
    rank = Rank(cfg, topo, device, model, full, cache, None, draft, l2_tokens,  # type: ignore[arg-type]
                {"target": target_bytes, "draft": token_bytes - target_bytes}, digest,
                fingerprint_s, tag, restore_threads=restore)
    try:
        if cfg.hicache_storage_backend is not None or \
                cfg.hicache_storage_backend_config is not None:
            attach_storage(rank, layout)
            apply_to_l3(cache, topo, dv)
        rank.scheduler = make_scheduler(rank, groups, health,
                                        None if remote is None else remote(cache), spec)
    except BaseException:
        rank.close()
        raise
    return rank


def _check_tp(model_cfg: Any, tp: int) -> None:
    """A loaded model that does not split over ``tp`` ranks: a usage error."""
    from engine.runtime.model.tp import check_tp

    try:
        check_tp(model_cfg, tp)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def split_model(model: Model, topo: Topology, groups: RankGroups | None) -> Model:
    """This rank's part of ``model``: its TP shard, then its stage's layers."""
    if topo.tp > 1:
        from engine.runtime.model.tp import tp_model

        assert groups is not None
        model = tp_model(model, topo.tp_rank, topo.tp, groups.all_reduce())
    if topo.pp > 1:
        model = stage_model(model, topo.stage, topo.pp)
    return model


def event_log(cfg: ServerConfig, topo: Topology) -> EventLog:
    """This rank's event log (kept for ``--rank-log-dir`` / ``record_events``)."""
    keep = cfg.record_events or cfg.rank_log_dir is not None
    if topo.group_size > 1:
        info = RankInfo(rank=topo.rank, world_size=topo.world, tp_rank=topo.tp_rank,
                        tp_size=topo.tp, cp_rank=topo.cp_rank, cp_size=topo.cp,
                        pp_rank=topo.stage, pp_size=topo.pp)
    else:
        info = RankInfo(rank=topo.stage, world_size=topo.pp, pp_rank=topo.stage,
                        pp_size=topo.pp)
    online = cfg.consensus_check == "online"
    log_ = EventLog(info, enabled=keep or online or bool(cfg.inject_divergence), keep=keep)
    if cfg.inject_divergence:
        from engine.parallel.divergence import install

        install(log_, cfg.inject_divergence)
    return log_


def make_cache(cache_cfg: CacheConfig, model: Model, cfg: ServerConfig, topo: Topology,
               groups: RankGroups | None) -> Any:
    """This rank's cache facade."""
    events = event_log(cfg, topo)
    if topo.tp > 1:
        from engine.parallel.cp_cache import CPCache
        from engine.parallel.tp_cache import TPCache

        inner: Any = (CPCache(cache_cfg, topo.cp, events=events, rank=topo.cp_rank)
                      if topo.cp > 1 else HiCache(cache_cfg, events=events))
        (inner.cache if topo.cp > 1 else inner).hit_on_commit = True
        whole = model.kv_layout(cfg.page_size).whole()
        page_bytes = [whole.shard(topo.tp, r, topo.pp, topo.stage).page_bytes
                      for r in range(topo.tp)]
        assert groups is not None
        return TPCache(inner, topo.tp, topo.tp_rank, groups.stage, page_bytes)
    if topo.cp > 1:
        from engine.parallel.cp_cache import CPCache

        assert groups is not None
        return CPCache(cache_cfg, topo.cp, events=events, rank=topo.cp_rank, group=groups.stage)
    cache = HiCache(cache_cfg, events=events)
    # pipeline stages classify a match alike too: a load finished on one stage and not yet on
    # another is L2 on both until pp_sync's agreed commit (found by the PP divergence soak)
    cache.hit_on_commit = topo.pp > 1
    return cache


def attach_storage(rank: Rank, layout: Any) -> None:
    """L3 on, or — when a network store cannot be reached — off, said on stderr and
    /metrics (``rank.l3_status``)."""
    from engine.cache.l3 import StoreTier
    from engine.storage import BackendKind, L3Store, StorageConfig
    from engine.storage.placement import Placement, StorageLayout

    cfg, cache = rank.config, rank.cache
    if not rank.l2_tokens:
        raise ValueError("an L3 store needs an L2 host pool: set --l2-tokens > 0 "
                         "(or --hicache-ratio / --hicache-size)")
    scfg = StorageConfig.from_options(cfg.hicache_storage_backend, cfg.hicache_storage_dir,
                                      cfg.hicache_storage_backend_config,
                                      cfg.hicache_storage_size_limit)
    if rank.topology.cp > 1 and scfg.backend is BackendKind.MEMORY:
        from engine.runtime.config import MODE_RULES

        raise UsageError(next(r.message() for r in MODE_RULES if "memory" in r.second))
    info = cache.events.rank
    grid = cfg.hicache_storage_grid
    if grid is None and rank.draft is not None and cfg.hicache_storage_layout == "unified":
        grid = f"layers={rank.model.cfg.num_layers}"   # the draft's layers: objects of their own
    placement = Placement(StorageLayout.parse(cfg.hicache_storage_layout), grid,
                          tp=(info.tp_rank, info.tp_size), pp=(info.pp_rank, info.pp_size))
    try:
        store = L3Store.open(scfg, layout, model_tag=rank.model_tag, placement=placement)
        if cache.config.sidecar is not None:
            store = _sidecar_store(store, rank)
    except StorageError as exc:
        if scfg.backend is BackendKind.FILE:   # a local path: a configuration error
            raise InputError(f"L3 file store: {exc}") from None
        rank.l3_status = f"unavailable: {exc}"
        log.warning("L3 store (%s) unavailable, serving with L3 off: %s",
                    scfg.backend.value, exc)
        return
    if cfg.hicache_storage_prefetch_policy == "timeout" and store.guard.enabled:
        # existence queries run on the scheduler thread: never past the prefetch timeout
        store.exists_deadline_s = min(store.guard.deadline_s,
                                      max(cfg.hicache_storage_prefetch_timeout, 0.05))
    rank.l3_store = store
    if rank.topology.cp > 1:             # each CP rank moves the pages it owns
        from engine.parallel.cp_store import OwnedStore

        store = OwnedStore(store, cache.shape, info.cp_rank)
    tier = StoreTier(wrap_store(store, rank.topology, diverge_of(cfg)), cache.l2)
    if rank.topology.pp > 1:
        tier.debug_delay_s = cache.transfers.debug_delay_s
    cache.attach_l3(tier,
                    prefetch_policy=cfg.hicache_storage_prefetch_policy,
                    prefetch_timeout=cfg.hicache_storage_prefetch_timeout,
                    ordered=rank.topology.pp > 1)   # L3 results land where pp_sync says
    if rank.topology.pp > 1 and rank.topology.cp == 1:
        cache.l3.agree_stages = stage_agreement(cfg, diverge_of(cfg))   # one L3 decision
    rank.l3_status = f"on ({scfg.backend.value}, {placement.label(layout)})"


def _sidecar_store(store: Any, rank: Rank) -> Any:
    """Sidecar draft layout: a second store for the draft's pool, on the same backend, its
    objects cut at a grid that fits the draft's layer range (gcd of target and draft)."""
    from engine.cache.sidecar import PairedStore
    from engine.storage import L3Store
    from engine.storage.placement import Placement, StorageLayout

    cfg = rank.config
    side = rank.cache.config.sidecar
    info = rank.cache.events.rank
    grid = f"layers={math.gcd(side.layer_start, side.num_layers)}"
    layout = StorageLayout.parse(cfg.hicache_storage_layout)
    placement = Placement(layout, grid if layout is StorageLayout.UNIFIED else None,
                          tp=(info.tp_rank, info.tp_size), pp=(info.pp_rank, info.pp_size))
    try:
        draft = L3Store(store.backend, side, model_tag=rank.model_tag, placement=placement,
                        deadline_s=store.guard.deadline_s)
    except BaseException:
        store.close()
        raise
    return PairedStore(store, draft)


def make_scheduler(rank: Rank, groups: RankGroups | None, health: Callable[[], list[str]],
                   remote: Any, spec: Any) -> Scheduler:
    cfg, topo, cache = rank.config, rank.topology, rank.cache
    sched_cfg = SchedulerConfig(max_running_requests=cfg.max_running_requests,
                                chunked_prefill_size=cfg.chunked_prefill_size,
                                disable_radix_cache=cfg.disable_radix_cache,
                                disable_partial_page_reuse=cfg.disable_partial_page_reuse)
    kv_source = None
    if topo.cp > 1:
        from engine.runtime.ranks.cp_kv import sharded_source

        assert groups is not None
        kv_source = sharded_source(cache, topo.cp_rank, group=groups.cp)
    consensus = None
    if cfg.consensus_check == "online":      # every rank: a collective (its own gloo group)
        from engine.parallel.consensus_online import OnlineConsensus, consensus_group

        consensus = OnlineConsensus(cache.events, consensus_group(cache.events.rank),
                                    every=cfg.consensus_every,
                                    log_dir=cfg.rank_log_dir or DIVERGENCE_LOG_DIR)
    if topo.pp > 1:
        return PipelineScheduler(rank.model, cache, sched_cfg, topology=topo, groups=groups,
                                 pp_sync=pp_sync_on(cfg, diverge_of(cfg)),
                                 timeout_s=cfg.collective_timeout_s, consensus=consensus,
                                 num_micro_batches=cfg.pp_micro_batches, health=health,
                                 kv_source=kv_source)
    if not topo.single:
        return LockstepScheduler(rank.model, cache, sched_cfg, topology=topo, health=health,
                                 consensus=consensus,
                                 kv_source=kv_source)
    return Scheduler(rank.model, cache, sched_cfg, draft=rank.draft, spec=spec, remote=remote)
