"""Server configuration and the engine it serves: model + tokenizer + cache + scheduler."""

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

from engine.cache.events import EventLog, RankInfo
from engine.cache.facade import CacheConfig, HiCache, WritePolicy
from engine.cache.policy import policy_names
from engine.cache.pool import HostLayout
from engine.core.device import resolve_device
from engine.runtime.model import Model, load_model
from engine.runtime.scheduler import Scheduler, SchedulerConfig
from engine.runtime.serving.model_id import model_tag, model_tokenizer
from engine.runtime.tokenizer import Tokenizer

log = logging.getLogger("hicache.server")

MEMORY_STORE_CP = ("--cp with the memory L3 backend: a memory store lives in one process and "
                   "each CP rank is one; use file or mooncake")
MEMORY_SHARE = 0.9      # of the memory available at start, the KV pools may take at most this


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    """Everything ``hicache bench serve`` accepts. Tier sizes are tokens.

    L2 size: ``l2_tokens`` when given (0 = no L2); else ``hicache_size_gb`` (GB of host memory)
    when > 0; else ``hicache_ratio`` × ``l1_tokens`` (SGLang's meaning of the two options).
    """

    host: str = "127.0.0.1"
    port: int = 30000
    device: str = "auto"
    model: str = "tiny"
    seed: int | None = None
    page_size: int = 16
    l1_tokens: int = 16384
    l2_tokens: int | None = None
    hicache_ratio: float = 2.0
    hicache_size_gb: float = 0.0
    write_policy: str = "write_through"
    write_through_threshold: int = 2
    host_layout: str = "layer_first"
    eviction_policy: str = "lru"
    disable_radix_cache: bool = False
    max_running_requests: int = 64
    chunked_prefill_size: int = 512
    exact: bool | None = None          # batch-invariant kernels (default: on CPU)
    record_events: bool = False        # keep the cache's event log in memory
    # L3 (SGLang's names): backend None = no L3
    hicache_storage_backend: str | None = None       # file | mooncake | memory
    hicache_storage_dir: str | None = None           # file: directory (default: a temp dir)
    hicache_storage_backend_config: str | None = None  # JSON file (file/mooncake settings)
    hicache_storage_size_limit: str | None = None    # file: e.g. "20GiB" (LRU beyond it)
    hicache_storage_prefetch_policy: str = "timeout"  # best_effort | wait_complete | timeout
    hicache_storage_prefetch_timeout: float = 2.0    # seconds, for "timeout"
    hicache_storage_layout: str = "unified"          # unified | legacy (per-rank keys)
    hicache_storage_grid: str | None = None          # unified: "layers=N,heads=N" / "tp=N,pp=N"
    rank_log_dir: str | None = None    # write this rank's event log there on shutdown
    inject_divergence: str | None = None  # debug: break this rank's decisions (engine.parallel.divergence)
    tokenizer_dir: str | None = None   # where to export the preset's HF tokenizer (default: temp)
    served_model_name: str | None = None  # the model id clients see (default: the model's name)
    weight_version: str = "default"    # reported as SGLang reports it
    # speculative decoding (docs/speculative.md): 0 draft tokens = off
    speculative_num_draft_tokens: int = 0
    speculative_draft_preset: str = "mirror"
    hicache_draft_layout: str = "packed"   # packed | sidecar
    debug_skip_draft_restore: bool = False  # debug: restored prefixes lose their draft KV
    # P/D disaggregation (engine.runtime.pd, docs/pd.md): None | pd | prefill | decode
    disaggregation: str | None = None
    pd_addr: str = "127.0.0.1:0"       # where the prefill worker's link listens (0: pick one)
    pd_decode_reuse: bool = True       # decode matches its own cache before asking prefill
    pd_transfer_timeout: float = 30.0  # seconds a request waits for its KV on the link
    pd_inject_fault: str | None = None  # debug: die-after-layers:N | delay:S (prefill worker)
    # pipeline parallelism (docs/parallelism.md §2): stage processes, pp_sync, debug delays
    pp: int = 1
    pp_sync: bool = True                   # debug: False lets each stage consume what it has
    pp_micro_batches: int = 0              # micro-batches per step (0: one per stage)
    debug_transfer_delay: str | None = None  # "STAGE[.TP]:MS[,...]": slow a stage's copies
    collective_timeout_s: float = 60.0     # a stage silent this long stops the server
    cp: int = 1                        # context-parallel ranks (one process each; KV sharded)
    tp: int = 1                        # tensor-parallel ranks (one process each; heads sharded)
    # multi-host, as in SGLang: the --cp/--tp/--pp ranks spread evenly over nnodes hosts; node 0
    # serves HTTP and hosts the rendezvous dist_init_addr (HOST:PORT); None: a local one
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None
    snapshot_dir: str | None = None    # every --cp/--tp/--pp rank writes tree-rank{r}.snapshot

    def __post_init__(self) -> None:
        if self.cp < 1:
            raise ValueError(f"--cp must be >= 1, got {self.cp}")
        if not 1 <= self.tp <= 8:
            raise ValueError(f"--tp must be 1..8, got {self.tp}")
        if self.tp > 1:
            from engine.runtime.tp_serve import check_options

            check_options(self)
        if self.cp > 1 and (self.speculative_num_draft_tokens or self.disaggregation is not None):
            raise ValueError("--cp > 1 does not combine with P/D disaggregation or "
                             "speculative decoding yet")
        if self.cp > 1 and self.hicache_storage_backend == "memory":
            raise ValueError(MEMORY_STORE_CP)
        if self.page_size < 1:
            raise ValueError(f"--page-size must be >= 1, got {self.page_size}")
        if self.l1_tokens < self.page_size:
            raise ValueError(f"--l1-tokens must hold at least one page ({self.page_size})")
        if self.l2_tokens is not None and self.l2_tokens < 0:
            raise ValueError("--l2-tokens must be >= 0")
        for opt, v in (("--hicache-ratio", self.hicache_ratio),
                       ("--hicache-size", self.hicache_size_gb),
                       ("--hicache-storage-prefetch-timeout",
                        self.hicache_storage_prefetch_timeout)):
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"{opt} must be a finite number >= 0, got {v}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")
        WritePolicy.parse(self.write_policy)
        HostLayout.parse(self.host_layout)
        if self.eviction_policy not in policy_names():
            raise ValueError(f"unknown eviction policy {self.eviction_policy!r}; choose one of "
                             f"{policy_names()}")
        SchedulerConfig(self.max_running_requests, self.chunked_prefill_size)
        if self.hicache_storage_backend is not None:
            from engine.storage import BackendKind

            BackendKind.parse(self.hicache_storage_backend)
        from engine.cache.l3 import PrefetchPolicy

        PrefetchPolicy.parse(self.hicache_storage_prefetch_policy)
        if self.hicache_storage_prefetch_timeout < 0:
            raise ValueError("--hicache-storage-prefetch-timeout must be >= 0")
        from engine.storage.placement import StorageLayout, check_grid_spec

        if StorageLayout.parse(self.hicache_storage_layout) is StorageLayout.LEGACY and \
                self.hicache_storage_grid is not None:
            raise ValueError("--hicache-storage-grid applies to the unified layout only")
        check_grid_spec(self.hicache_storage_grid)
        self.spec_config()
        if self.disaggregation is not None:
            from engine.runtime.pd.serve import check_options

            check_options(self)
        if not 1 <= self.pp <= 8:
            raise ValueError(f"--pp must be 1..8, got {self.pp}")
        if self.pp > 1:
            from engine.runtime.pipeline import parse_delay

            parse_delay(self.debug_transfer_delay, self.pp, self.tp)
            if not 0 <= self.pp_micro_batches <= 64:
                raise ValueError(f"--pp-micro-batches must be 0..64 (0: one per stage), got "
                                 f"{self.pp_micro_batches}")
            if self.speculative_num_draft_tokens:
                raise ValueError("--pp cannot be combined with speculative decoding yet")
            if self.disaggregation is not None:
                raise ValueError("--pp cannot be combined with --disaggregation yet")
        elif self.debug_transfer_delay:
            raise ValueError("--debug-transfer-delay needs --pp 2 or more")
        elif self.pp_micro_batches:
            raise ValueError("--pp-micro-batches needs --pp 2 or more")
        self._check_nodes()
        if not (math.isfinite(self.collective_timeout_s) and self.collective_timeout_s > 0):
            raise ValueError("--collective-timeout must be a finite number > 0")
        if self.inject_divergence:
            from engine.parallel.divergence import parse_spec

            parse_spec(self.inject_divergence)

    @property
    def ranks(self) -> int:
        """Processes of the CP or TP group (1: a single process)."""
        return self.cp * self.tp

    def _check_nodes(self) -> None:
        from engine.parallel.launch import check_nodes

        world = self.ranks * self.pp
        if self.nnodes > 1 and world == 1:
            raise ValueError("--nnodes > 1 needs ranks to spread: --cp, --tp or --pp > 1")
        parts = [f"--{k} {v}" for k, v in (("tp", self.tp), ("cp", self.cp), ("pp", self.pp))
                 if v > 1]
        what = " ".join(parts) + (f" ({world})" if len(parts) > 1 else "")
        check_nodes(world, self.nnodes, self.node_rank, self.dist_init_addr, what)

    def spec_config(self) -> Any:
        """The speculative-decoding settings, or None when off (checks the options)."""
        from engine.runtime.model.draft import draft_preset
        from engine.runtime.scheduler.spec import DraftLayout, SpecConfig

        n = self.speculative_num_draft_tokens
        if not 0 <= n <= 16:
            raise ValueError(f"--speculative-num-draft-tokens must be 0..16, got {n}")
        draft_preset(self.speculative_draft_preset)
        layout = DraftLayout.parse(self.hicache_draft_layout)
        if n == 0:
            return None
        if layout is DraftLayout.SIDECAR and self.hicache_storage_grid is not None:
            raise ValueError("--hicache-storage-grid cannot be combined with --hicache-draft-"
                             "layout sidecar (the draft's objects get a grid of their own)")
        return SpecConfig(num_draft_tokens=n, draft_preset=self.speculative_draft_preset,
                          draft_layout=layout.value,
                          debug_skip_draft_restore=self.debug_skip_draft_restore)

    def check_memory(self, token_bytes: int, l2_tokens: int, device: str) -> None:
        """:class:`UsageError` naming the option when the L1 pool (on ``device``) or
        the L2 pool (host memory) cannot be allocated here, with what would fit."""
        from engine.core.device import available_memory, bytes_text
        from engine.core.errors import UsageError

        host = available_memory("cpu")
        dev = host if device == "cpu" else available_memory(device)
        l1_bytes, l2_bytes = self.l1_tokens * token_bytes, l2_tokens * token_bytes
        if l1_bytes > dev * MEMORY_SHARE:
            fit = int(dev * MEMORY_SHARE // token_bytes)
            raise UsageError(f"--l1-tokens {self.l1_tokens:,} needs {bytes_text(l1_bytes)} of "
                             f"KV memory on {device}; {bytes_text(dev)} is available: at most "
                             f"about {fit - fit % self.page_size:,} tokens fit")
        room = host * MEMORY_SHARE - (l1_bytes if device == "cpu" else 0)
        if l2_bytes > room:
            opt = ("--l2-tokens" if self.l2_tokens is not None else "--hicache-size"
                   if self.hicache_size_gb > 0 else "--hicache-ratio")
            fit = max(int(room // token_bytes), 0)
            raise UsageError(f"{opt}: an L2 of {l2_tokens:,} tokens needs "
                             f"{bytes_text(l2_bytes)} of host memory; {bytes_text(host)} is "
                             f"available{' beside L1' if device == 'cpu' else ''}: at most "
                             f"about {fit - fit % self.page_size:,} tokens of L2 fit")

    def l2_tokens_for(self, token_bytes: int) -> int:
        """Resolved L2 size in tokens (a multiple of the page size)."""
        if self.l2_tokens is not None:
            n = self.l2_tokens
        elif self.hicache_size_gb > 0:
            n = int(self.hicache_size_gb * 1e9 // token_bytes)
        else:
            n = int(self.hicache_ratio * self.l1_tokens)
        return n - n % self.page_size


class Engine:
    """The model, its tokenizer, the cache and the scheduler, wired together."""

    def __init__(self, cfg: ServerConfig, stage: int = 0, cp_rank: int = 0,
                 cp_addr: str | None = None):
        """``stage``: this process's pipeline stage (``cfg.pp`` > 1); stage 0 starts the others
        (engine.runtime.pipeline) and serves HTTP. ``cp_rank``/``cp_addr``: a follower rank of
        a CP or TP group (``cfg.cp`` or ``cfg.tp`` > 1, engine.runtime.cp_serve /
        engine.runtime.tp_serve); rank 0 spawns the followers."""
        self.cfg = cfg
        self.stage = stage
        self.stage_procs: list = []           # this node's other pipeline stages (stage 0)
        self._stage_ids: list[int] = []
        self._stage_board: tuple | None = None   # (ExitBoard, stages on other nodes)
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
        self.model: Model = load_model(cfg.model, self.device, seed=cfg.seed, exact=cfg.exact)
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
                cp_addr = self.followers.addr
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
        self.model_tag = model_tag(cfg.model, mc)
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
        import math

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

        self._stage_ids, self.stage_procs, self._stage_board = start_ranks(cfg)

    def flush(self) -> "concurrent.futures.Future[dict]":
        """Drop every unlocked page (on every pipeline stage / TP-CP rank). Call on the
        scheduler thread; the future holds the cache's stats from after the flush. Pipeline
        and rank groups flush at a step every rank sees, so the stats are read by a call queued
        behind the flush (it runs at the next step, once the flush is done)."""
        if self.cfg.pp > 1 or self.cfg.ranks > 1:
            self.scheduler.request_flush()
            return self.scheduler.call(self.cache.stats)
        self.cache.flush()
        fut: concurrent.futures.Future = concurrent.futures.Future()
        fut.set_result(self.cache.stats())
        return fut

    def stage_health(self) -> str | None:
        """Why the pipeline is unhealthy (a rank process gone), or None."""
        from engine.runtime.pp_grid import ranks_health

        return ranks_health(self.cfg, self._stage_ids, self.stage_procs, self._stage_board)

    def stop(self) -> None:
        self.scheduler.stop()
        if self.stage_procs:
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
                "exact_kernels": self.model.exact, "page_size": self.cfg.page_size,
                "l1_tokens": self.cfg.l1_tokens, "l2_tokens": self.l2_tokens,
                "host_layout": self.cfg.host_layout, "write_policy": self.cfg.write_policy,
                "radix_cache": not self.cfg.disable_radix_cache,
                "max_context": mc.max_context, "vocab_size": mc.vocab_size,
                "l3": self.l3_status,
                "l3_prefetch_policy": self.cfg.hicache_storage_prefetch_policy
                if self.cache.l3 is not None else None,
                "model_path": self.cfg.model, "tokenizer_path": self.tokenizer_path,
                "served_model_name": self.model_name,
                "speculative": None if self.scheduler.spec is None else {
                    **self.scheduler.spec.stats(),
                    "kv_bytes_per_token": self.kv_bytes_per_token}}
