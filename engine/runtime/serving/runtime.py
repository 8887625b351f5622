"""The engine a server runs: model + tokenizer + cache + scheduler (its configuration,
``ServerConfig``, is in engine/runtime/serving/config.py and re-exported here)."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import math
import os
import shutil
import tempfile
import time
from typing import Any

import torch

from engine.cache.events import EventLog, RankInfo
from engine.cache.facade import CacheConfig, HiCache
from engine.core.device import resolve_device
from engine.core.errors import UsageError
from engine.runtime.model import Model, load_model
from engine.runtime.model.fingerprint import weights_digest
from engine.runtime.scheduler import Scheduler, SchedulerConfig
from engine.runtime.serving.config import MEMORY_SHARE, MEMORY_STORE_CP, ServerConfig  # noqa: F401
from engine.runtime.serving.model_id import model_tag, model_tokenizer
from engine.runtime.tokenizer import Tokenizer

log = logging.getLogger("hicache.server")


def _exact_report() -> list[str]:
    from engine.runtime.model import exact

    return exact.report()


class Engine:
    """The model, its tokenizer, the cache and the scheduler, wired together."""

    def __init__(self, cfg: ServerConfig, stage: int = 0, cp_rank: int = 0,
                 cp_addr: Any = None):
        """``stage``: this process's pipeline stage (``cfg.pp`` > 1); stage 0 starts the others
        (engine.runtime.pipeline) and serves HTTP. ``cp_rank``/``cp_addr``: a follower rank of
        a CP or TP group (``cfg.cp`` or ``cfg.tp`` > 1, engine.runtime.cp_serve /
        engine.runtime.tp_serve) and the group's rendezvous; rank 0 spawns the followers."""
        self.cfg = cfg
        self.stage = stage
        self.stage_procs: list = []           # this node's other pipeline stages (stage 0)
        self._stage_ids: list[int] = []
        self._stage_board: tuple | None = None   # (ExitBoard, stages on other nodes)
        self._stage_group = None              # their RankProcesses (its watchdog)
        self.cp_rank = cp_rank
        self.followers = None
        self.failure: str | None = None      # why a CP/TP group stopped (a rank died or hung)
        self.device = resolve_device(cfg.device)
        backend = None                  # of the TP all-reduce
        self._restore_threads = None
        self.grid = None                # --pp with --tp/--cp: its groups (engine.runtime.pp_grid)
        world = cfg.ranks * cfg.pp
        rank = stage * cfg.ranks + cp_rank           # global: a stage's ranks are consecutive
        if cfg.tp > 1:
            from engine.runtime.tp_serve import probe_backend, share_cores

            backend, self.device = probe_backend(self.device, world, rank)
            self._restore_threads = share_cores(self.device, world // cfg.nnodes)
        if cfg.threads:                 # --threads: this process's torch threads
            before, restore = torch.get_num_threads(), self._restore_threads
            torch.set_num_threads(cfg.threads)
            self._restore_threads = restore or (lambda: torch.set_num_threads(before))
        self.model: Model = load_model(cfg.model, self.device, seed=cfg.seed, exact=cfg.exact)
        t0 = time.perf_counter()          # the weights as loaded, before any TP/PP split
        self.weights_digest = weights_digest(self.model.w)
        self.fingerprint_s = time.perf_counter() - t0
        full_cfg = self.model.cfg
        if cfg.ranks == 1 and cfg.pp == 1:   # the exact path's start-up probe (one process)
            from engine.runtime.model.probe import check_exact

            check_exact(self.model, tokens=100)
        self.num_params = self.model.cfg.num_params()     # of the whole model (before TP/PP)
        if cfg.tp > 1:                  # a shape that does not split: said before spawning
            from engine.runtime.tp_serve import check_model

            check_model(self.model.cfg, cfg.tp)
        self.cp_group = None            # with TP and CP: this rank's CP group (the gather)
        if cfg.ranks > 1 and cfg.pp == 1:
            from engine.runtime.cp_serve import Followers, init_group
            from engine.runtime.tp_serve import rank_label

            if cp_rank == 0:
                self.followers = Followers(cfg, cfg.ranks, cfg.collective_timeout_s,
                                           label=rank_label(cfg.tp, cfg.cp))
                cp_addr = self.followers.rendezvous
            init_group(cp_rank, cfg.ranks, cp_addr, cfg.collective_timeout_s)
        if cfg.pp > 1 and rank == 0:
            self._start_stages(cfg)
        if cfg.ranks > 1 and cfg.pp > 1:
            from engine.runtime.pp_grid import grid_model

            self.model, self.grid = grid_model(self.model, cfg, rank, backend)
            self.cp_group = self.grid.cp_group
        elif cfg.tp > 1:
            from engine.runtime.tp_serve import shard_model

            self.model, self.cp_group = shard_model(self.model, cfg, cp_rank, backend)
        if cfg.pp > 1:
            from engine.runtime.pipeline import stage_model

            self.model = stage_model(self.model, stage, cfg.pp)
        if cfg.context_length is not None:       # SGLang's --context-length
            if cfg.context_length > self.model.cfg.max_context:
                raise UsageError(f"--context-length {cfg.context_length} exceeds the model's "
                                 f"context of {self.model.cfg.max_context} tokens")
            self.model.cfg = dataclasses.replace(self.model.cfg, max_context=cfg.context_length)
        mc = self.model.cfg
        model_dir = cfg.model if os.path.isdir(cfg.model) else None
        self.tokenizer: Tokenizer | None = model_tokenizer(cfg.model, mc)
        spec = cfg.spec_config()
        self.draft = None
        sidecar = None
        if spec is not None:
            from engine.runtime.model.draft import make_draft
            from engine.runtime.scheduler.spec import cache_layout, sidecar_layout

            self.draft = make_draft(self.model, spec.draft_preset)
            if spec.draft_layout == "sidecar":
                sidecar = sidecar_layout(self.model, cfg.page_size, self.draft)
        layout = (self.model.kv_layout(cfg.page_size) if spec is None
                  else cache_layout(self.model, cfg.page_size, self.draft, spec))
        token_bytes = (layout.page_bytes + (sidecar.page_bytes if sidecar else 0)) // cfg.page_size
        self.kv_bytes_per_token = {"target": self.model.kv_layout(cfg.page_size).page_bytes
                                   // cfg.page_size,
                                   "draft": token_bytes - self.model.kv_layout(
                                       cfg.page_size).page_bytes // cfg.page_size}
        self.l2_tokens = cfg.l2_tokens_for(token_bytes)
        cfg.check_memory(token_bytes, self.l2_tokens, self.device)
        cache_cfg = CacheConfig(
            page_size=cfg.page_size, l1_tokens=cfg.l1_tokens, l2_tokens=self.l2_tokens,
            write_policy=cfg.write_policy, write_through_threshold=cfg.write_through_threshold,
            eviction_policy=cfg.eviction_policy, host_layout=cfg.host_layout,
            device=self.device, layout=layout, sidecar=sidecar)
        if cfg.tp > 1:
            from engine.runtime.tp_serve import tp_cache

            self.cache = tp_cache(cache_cfg, self.model, cfg, cp_rank,
                                  events=self._event_log(cfg, stage, group_rank=cp_rank),
                                  group=self.grid and self.grid.stage_group, stage=stage)
        elif cfg.cp > 1:
            import torch.distributed as dist

            from engine.parallel.cp_cache import CPCache

            self.cache = CPCache(cache_cfg, cfg.cp,
                                 events=self._event_log(cfg, stage, group_rank=cp_rank),
                                 rank=cp_rank, group=self.grid.stage_group if self.grid
                                 else dist.group.WORLD)
        else:
            self.cache = HiCache(cache_cfg, events=self._event_log(cfg, stage))
        if cfg.pp > 1:
            from engine.runtime.pipeline import delay_for

            self.cache.transfers.debug_delay_s = delay_for(cfg.debug_transfer_delay, cfg.pp,
                                                           cfg.tp, stage, cp_rank)
        if cfg.rank_log_dir is not None:      # fail at start, not at shutdown
            from formats.outpath import check_output_dir, check_output_file

            check_output_dir(cfg.rank_log_dir)
            check_output_file(self._rank_log_path())
        self.model_tag = model_tag(full_cfg, self.weights_digest, cfg.hicache_model_fingerprint)
        if self.draft is not None:           # the draft's KV is in the objects too
            self.model_tag += f"+{spec.draft_preset}"
        self.l3_status = "off"
        self.l3_store = None
        if cfg.hicache_storage_backend is not None or \
                cfg.hicache_storage_backend_config is not None:
            self._attach_storage(cfg, layout)
        if cfg.pp > 1 and getattr(self.cache, "l3", None) is not None:
            self.cache.l3.ordered = True     # L3 results land at the step pp_sync names
            self.cache.l3.impl.debug_delay_s = self.cache.transfers.debug_delay_s
        sched_cfg = SchedulerConfig(max_running_requests=cfg.max_running_requests,
                                    chunked_prefill_size=cfg.chunked_prefill_size,
                                    disable_radix_cache=cfg.disable_radix_cache)
        if cfg.pp > 1:
            from engine.runtime.pipeline import PipelineScheduler

            self.scheduler: Scheduler = PipelineScheduler(
                self.model, self.cache, sched_cfg, stage=stage, num_stages=cfg.pp,
                pp_sync=cfg.pp_sync, timeout_s=cfg.collective_timeout_s,
                num_micro_batches=cfg.pp_micro_batches, grid=self.grid)
            self.scheduler.dead_stage = self.stage_health
            if cfg.cp > 1:
                from engine.runtime.cp_serve import sharded_source

                self.scheduler.kv_source = sharded_source(self.cache, self.grid.cp_rank,
                                                          group=self.cp_group)
        elif cfg.ranks > 1:
            from engine.runtime.cp_serve import RankScheduler, broadcast_sync, sharded_source

            self.scheduler = RankScheduler(
                self.model, self.cache, sched_cfg, sync=broadcast_sync(), leader=cp_rank == 0,
                dead_ranks=self.followers.dead if self.followers else (lambda: []))
            from engine.runtime.tp_serve import rank_label, split_rank

            self.scheduler.group_name = rank_label(cfg.tp, cfg.cp)
            if cfg.cp > 1:
                self.scheduler.kv_source = sharded_source(
                    self.cache, split_rank(cp_rank, cfg.tp)[1], group=self.cp_group)
        else:
            self.scheduler = Scheduler(self.model, self.cache, sched_cfg, draft=self.draft,
                                       spec=spec)
        self.model_name = cfg.served_model_name or mc.name
        self.weight_version = cfg.weight_version
        self.tokenizer_path, self._tmp_tokenizer = self._tokenizer_dir(cfg, model_dir)

    def _tokenizer_dir(self, cfg: ServerConfig, model_dir: str | None) -> tuple[str | None, bool]:
        """A Hugging Face tokenizer directory clients can load: the checkpoint's own, else the
        tokenizer exported to ``cfg.tokenizer_dir`` (or a temporary one, removed at stop)."""
        if self.tokenizer is None:
            return None, False
        if model_dir is not None and os.path.exists(os.path.join(model_dir, "tokenizer.json")) \
                and cfg.tokenizer_dir is None:
            return os.path.abspath(model_dir), False
        from engine.runtime.tokenizer_export import export_tokenizer

        tmp = cfg.tokenizer_dir is None
        d = tempfile.mkdtemp(prefix="hicache-tokenizer-") if tmp else cfg.tokenizer_dir
        export_tokenizer(self.tokenizer, d, self.model_name, self.model.cfg.max_context)
        return os.path.abspath(d), tmp

    @staticmethod
    def _event_log(cfg: ServerConfig, stage: int = 0, group_rank: int | None = None) -> EventLog:
        keep = cfg.record_events or cfg.rank_log_dir is not None
        rank = RankInfo(rank=stage, world_size=cfg.pp, pp_rank=stage, pp_size=cfg.pp)
        if group_rank is not None:      # a TP / CP rank: group_rank = cp_rank * tp + tp_rank
            rank = RankInfo(rank=stage * cfg.ranks + group_rank, world_size=cfg.ranks * cfg.pp,
                            tp_rank=group_rank % cfg.tp, tp_size=cfg.tp,
                            cp_rank=group_rank // cfg.tp, cp_size=cfg.cp,
                            pp_rank=stage, pp_size=cfg.pp)
        log_ = EventLog(rank, enabled=keep or bool(cfg.inject_divergence), keep=keep)
        if cfg.inject_divergence:
            from engine.parallel.divergence import install

            install(log_, cfg.inject_divergence)
        return log_

    def _attach_storage(self, cfg: ServerConfig, layout) -> None:
        """L3 on, or — when the store cannot be reached — off, said on stderr and /metrics."""
        from engine.cache.l3 import StoreTier
        from engine.core.errors import InputError, StorageError
        from engine.storage import BackendKind, L3Store, StorageConfig

        if not self.l2_tokens:
            raise ValueError("an L3 store needs an L2 host pool: set --l2-tokens > 0 "
                             "(or --hicache-ratio / --hicache-size)")
        scfg = StorageConfig.from_options(cfg.hicache_storage_backend, cfg.hicache_storage_dir,
                                          cfg.hicache_storage_backend_config,
                                          cfg.hicache_storage_size_limit)
        from engine.storage.placement import Placement

        if cfg.cp > 1 and scfg.backend is BackendKind.MEMORY:
            from engine.core.errors import UsageError

            raise UsageError(MEMORY_STORE_CP)
        rank = self.cache.events.rank
        grid = cfg.hicache_storage_grid
        if grid is None and self.draft is not None and cfg.hicache_storage_layout == "unified":
            # the draft's layers become objects of their own layer range
            grid = f"layers={self.model.cfg.num_layers}"
        placement = Placement(cfg.hicache_storage_layout, grid,
                              tp=(rank.tp_rank, rank.tp_size), pp=(rank.pp_rank, rank.pp_size))
        try:
            store = L3Store.open(scfg, layout, model_tag=self.model_tag, placement=placement)
            if self.cache.config.sidecar is not None:
                store = self._sidecar_store(store, cfg)
        except StorageError as exc:
            if scfg.backend is BackendKind.FILE:   # a local path: a configuration error
                raise InputError(f"L3 file store: {exc}") from None
            self.l3_status = f"unavailable: {exc}"
            log.warning("L3 store (%s) unavailable, serving with L3 off: %s",
                        scfg.backend.value, exc)
            return
        if cfg.hicache_storage_prefetch_policy == "timeout" and store.guard.enabled:
            # existence queries run on the scheduler thread: never past the prefetch timeout
            store.exists_deadline_s = min(store.guard.deadline_s,
                                          max(cfg.hicache_storage_prefetch_timeout, 0.05))
        self.l3_store = store
        if cfg.cp > 1:                  # each CP rank moves the pages it owns
            from engine.parallel.cp_store import OwnedStore

            store = OwnedStore(store, self.cache.shape, rank.cp_rank)
        self.cache.attach_l3(StoreTier(store, self.cache.l2),
                             prefetch_policy=cfg.hicache_storage_prefetch_policy,
                             prefetch_timeout=cfg.hicache_storage_prefetch_timeout)
        self.l3_status = f"on ({scfg.backend.value}, {placement.label(layout)})"

    def _sidecar_store(self, store, cfg: ServerConfig):
        """Sidecar draft layout: a second store for the draft's pool, on the same backend, its
        objects cut at a grid that fits the draft's layer range (gcd of target and draft)."""

        from engine.cache.sidecar import PairedStore
        from engine.storage import L3Store
        from engine.storage.placement import Placement

        side = self.cache.config.sidecar
        rank = self.cache.events.rank
        grid = f"layers={math.gcd(side.layer_start, side.num_layers)}"
        placement = Placement(cfg.hicache_storage_layout,
                              grid if cfg.hicache_storage_layout == "unified" else None,
                              tp=(rank.tp_rank, rank.tp_size), pp=(rank.pp_rank, rank.pp_size))
        try:
            draft = L3Store(store.backend, side, model_tag=self.model_tag, placement=placement,
                            deadline_s=store.guard.deadline_s)
        except BaseException:
            store.close()
            raise
        return PairedStore(store, draft)

    def start(self) -> None:
        self.scheduler.start()
        if self.followers is not None:
            self.followers.watch(self.scheduler, self._rank_failed)

    def stop_on_rank_failure(self) -> None:
        """A pipeline (``--pp``) server: stop, as a CP/TP group does, once a lost rank stops
        the pipeline (the CLI's server; an embedding process keeps running, unhealthy)."""
        if self.cfg.pp > 1:
            from engine.runtime.cp_serve import watch_scheduler

            watch_scheduler(self.scheduler, self._rank_failed)

    def _rank_failed(self, message: str) -> None:
        """A CP rank died or hung: /health already says so; stop serving after a moment."""
        from engine.runtime.cp_serve import stop_server

        self.failure = message
        time.sleep(1.0)                      # let health checks see the 503 first
        stop_server(message)

    def _start_stages(self, cfg: ServerConfig) -> None:
        """Rank 0: start this node's other pipeline ranks and join the group."""
        from engine.runtime.pp_grid import start_ranks

        self._stage_ids, self._stage_group, self._stage_board = start_ranks(cfg)
        self.stage_procs = list(self._stage_group.procs.values())

    def snapshot_meta(self) -> dict:
        """What a tree snapshot of this server says about it: the served name, and the model
        spec it ran (``hicache inspect --prefix TEXT`` picks its tokenizer from it)."""
        return {"model": self.model_name, "model_path": self.cfg.model, "source": "bench serve"}

    def flush(self, scope: str = "cache") -> "concurrent.futures.Future[dict]":
        """Empty the tiers ``scope`` names (a :class:`~engine.cache.types.FlushScope` value:
        cache = L1 + L2, storage = L3, all) on every pipeline stage / TP-CP rank. Call on the
        scheduler thread; the future holds the cache's stats from after the flush. Pipeline
        and rank groups flush at a step every rank sees, so the stats are read by a call queued
        behind the flush (it runs at the next step, once the flush is done)."""
        if self.cfg.pp > 1 or self.cfg.ranks > 1:
            self.scheduler.request_flush(scope)
            return self.scheduler.call(self.cache.stats)
        self.cache.flush(scope)
        fut: concurrent.futures.Future = concurrent.futures.Future()
        fut.set_result(self.cache.stats())
        return fut

    def stage_health(self) -> str | None:
        """Why the pipeline or the TP/CP group is unhealthy (a rank process gone or silent),
        or None."""
        if self.followers is not None:
            dead = self.followers.dead()
            return f"{dead[0]}; the group cannot continue" if dead else None
        if self._stage_group is None:
            return None
        from engine.runtime.pp_grid import ranks_health

        return ranks_health(self.cfg, self._stage_ids, self.stage_procs, self._stage_board,
                            self._stage_group.silent())

    def stop(self) -> None:
        self.scheduler.stop()
        if self.stage_procs:
            self._stage_group.watchdog.close()
            for p in self.stage_procs:
                p.join(timeout=self.cfg.collective_timeout_s)
                if p.is_alive():
                    p.kill()
        if self.followers is not None:
            self.scheduler.halt_followers()
            self.followers.join()
        if self.cfg.rank_log_dir is not None:
            self.cache.wait_all()
            os.makedirs(self.cfg.rank_log_dir, exist_ok=True)
            path = self._rank_log_path()
            self.cache.events.write(path)
            log.info("rank log written to %s", path)
        self.cache.close()
        if self.cfg.ranks > 1:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        if self._restore_threads is not None:
            self._restore_threads()
        if self._tmp_tokenizer and self.tokenizer_path:
            shutil.rmtree(self.tokenizer_path, ignore_errors=True)
        if self.stage_procs:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()

    def _rank_log_path(self) -> str:
        return os.path.join(self.cfg.rank_log_dir or ".",
                            f"rank{self.cache.events.rank.rank}.ranklog")

    def storage_degraded(self) -> str | None:
        """Why the L3 store is degraded (a call stuck past its deadline), or None. Reads the
        store's guard only: safe from any thread, never blocks."""
        store = self.l3_store
        if store is None or not store.degraded:
            return None
        return store.guard.reason or "a store call is stuck"

    def describe(self) -> dict[str, Any]:
        mc = self.model.cfg
        return {"model": mc.name, "attention": mc.attention.value, "layers": mc.num_layers,
                "params": self.num_params, "device": self.device,
                "exact_kernels": self.model.exact, "threads": torch.get_num_threads(),
                "exact_fallbacks": _exact_report(), "page_size": self.cfg.page_size,
                "l1_tokens": self.cfg.l1_tokens, "l2_tokens": self.l2_tokens,
                "host_layout": self.cfg.host_layout, "write_policy": self.cfg.write_policy,
                "radix_cache": not self.cfg.disable_radix_cache,
                "max_context": mc.max_context, "vocab_size": mc.vocab_size,
                "l3": self.l3_status,
                "l3_prefetch_policy": self.cfg.hicache_storage_prefetch_policy
                if self.cache.l3 is not None else None,
                "model_path": self.cfg.model, "tokenizer_path": self.tokenizer_path,
                "served_model_name": self.model_name,
                "model_tag": self.model_tag, "weights_digest": self.weights_digest,
                "weights_digest_seconds": round(self.fingerprint_s, 4),
                "speculative": None if self.scheduler.spec is None else {
                    **self.scheduler.spec.stats(),
                    "kv_bytes_per_token": self.kv_bytes_per_token}}
