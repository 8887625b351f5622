"""The engine a server's HTTP front end runs: rank 0's model, cache and scheduler (built by
engine.runtime.ranks.build, whatever the topology), its tokenizer, and — with other ranks — the
launcher's handle on their processes (engine.runtime.launch). It never branches on the
topology: the rank it is given already has the right model shard, cache and scheduler."""

from __future__ import annotations

import concurrent.futures
import logging
import os
import shutil
import tempfile
import threading
from typing import Any, Callable

import torch

from engine.runtime.config import MEMORY_SHARE, ServerConfig  # noqa: F401
from engine.runtime.model_id import model_tokenizer
from engine.runtime.ranks.build import Rank, build_rank
from engine.runtime.ranks.lockstep import LockstepScheduler
from engine.runtime.serving.sessions import SessionRegistry
from engine.runtime.tokenizer import Tokenizer
from engine.runtime.topology import Topology

log = logging.getLogger("hicache.server")

LOST_GROUP_GRACE_S = 5.0   # after a lost rank: how long the others get to exit (then killed)


def _exact_report() -> list[str]:
    from engine.runtime.model import exact

    return exact.report()


def _native_kernels() -> dict[str, str]:
    """Which C kernels the exact CPU path runs (instruction set) and how they get threads."""
    from engine.runtime.model import native_attn, native_gemm, native_pool, native_quant

    return {"products": native_gemm.describe(), "attention": native_attn.describe(),
            "threads": native_pool.describe(), "block_products": native_quant.describe()}


class Engine:
    """Rank 0's parts behind the HTTP API."""

    def __init__(self, cfg: ServerConfig, rank: Rank | None = None, group: Any = None,
                 remote: Any = None):
        """``rank``: rank 0, built by the launcher once the other ranks are started (default:
        built here — one process); ``group``: the launcher's handle on the other ranks
        (``health()``, ``join()``); ``remote``: P/D's link client factory (its decode worker)."""
        self.cfg = cfg
        self.rank = rank or build_rank(cfg, Topology.of(cfg), remote=remote)
        self.group = group
        self.model, self.cache, self.scheduler = self.rank.model, self.rank.cache, \
            self.rank.scheduler
        self.device, self.draft, self.l2_tokens = self.rank.device, self.rank.draft, \
            self.rank.l2_tokens
        self.failure: str | None = None      # why a rank group stopped (a rank died or hung)
        self.on_failure: Callable[[str], None] | None = None   # the foreground server: stop
        self.kv_events: Any = None           # the KV-event publisher (serving.kv_events)
        self.sessions = SessionRegistry(cfg.max_sessions)
        self.num_params = self.rank.full_config.num_params()   # of the whole model
        self.tokenizer: Tokenizer | None = model_tokenizer(cfg.model, self.model.cfg)
        self.model_name = cfg.served_model_name or self.model.cfg.name
        self.weight_version = cfg.weight_version
        model_dir = cfg.model if os.path.isdir(cfg.model) else None
        self.tokenizer_path, self._tmp_tokenizer = self._tokenizer_dir(cfg, model_dir)

    # the rank's figures, under the names the HTTP layer reads
    model_tag = property(lambda self: self.rank.model_tag)
    weights_digest = property(lambda self: self.rank.weights_digest)
    l3_status = property(lambda self: self.rank.l3_status)
    l3_store = property(lambda self: self.rank.l3_store)
    kv_bytes_per_token = property(lambda self: self.rank.kv_bytes_per_token)

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
        d = cfg.tokenizer_dir or tempfile.mkdtemp(prefix="hicache-tokenizer-")
        export_tokenizer(self.tokenizer, d, self.model_name, self.model.cfg.max_context)
        return os.path.abspath(d), tmp

    def start(self) -> None:
        self.scheduler.start()
        if isinstance(self.scheduler, LockstepScheduler):
            threading.Thread(target=self._watch, name="hicache-rank-watch", daemon=True).start()

    def _watch(self) -> None:
        """Once the lockstep scheduler stops on a lost rank: record it (``/health`` already
        says so), then — a foreground server — stop after a moment."""
        sched = self.scheduler
        while sched.alive:
            threading.Event().wait(0.2)
        if sched.last_error is None or not getattr(sched, "broken", False):
            return                            # a normal stop
        self.failure = sched.last_error
        if self.on_failure is not None:
            threading.Event().wait(1.0)       # let health checks see the 503 first
            self.on_failure(sched.last_error)

    def snapshot_meta(self) -> dict:
        """What a tree snapshot of this server says about it: the served name, and the model
        spec it ran (``hicache inspect --prefix TEXT`` picks its tokenizer from it)."""
        return {"model": self.model_name, "model_path": self.cfg.model, "source": "bench serve"}

    def flush(self, scope: str = "cache") -> "concurrent.futures.Future[dict]":
        """Empty the tiers ``scope`` names (a :class:`~engine.cache.types.FlushScope` value:
        cache = L1 + L2, storage = L3, all) on every rank. Call on the scheduler thread; the
        future holds the cache's stats from after the flush. A rank group flushes at a step
        every rank sees, so the stats are read by a call queued behind the flush (it runs at
        the next step, once the flush is done)."""
        if isinstance(self.scheduler, LockstepScheduler):
            self.scheduler.request_flush(scope)
            return self.scheduler.call(self.cache.stats)
        self.cache.flush(scope)
        fut: concurrent.futures.Future = concurrent.futures.Future()
        fut.set_result(self.cache.stats())
        return fut

    def group_health(self) -> str | None:
        """Why the rank group is unhealthy (a rank process gone or silent), or None."""
        if self.group is None:
            return None
        dead = self.group.health()
        if not dead:
            return None
        word = self.scheduler.group_word if isinstance(self.scheduler, LockstepScheduler) \
            else "group"
        return f"{dead[0]}; the {word} cannot continue"

    def stop(self) -> None:
        """Stop serving: the scheduler, then the other ranks (halted: each writes its log and
        snapshot), then this rank's log, then the cache."""
        self.scheduler.stop()
        if isinstance(self.scheduler, LockstepScheduler):
            self.scheduler.halt()
        if self.group is not None:      # halted ranks exit at once; after a lost rank the
            # others wait in a collective rank 0 never enters: they are not waited for long
            lost = getattr(self.scheduler, "broken", False)
            self.group.join(LOST_GROUP_GRACE_S if lost else self.cfg.collective_timeout_s)
        self.rank.write_log()
        self.rank.close()
        if self.group is not None:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        if self._tmp_tokenizer and self.tokenizer_path:
            shutil.rmtree(self.tokenizer_path, ignore_errors=True)

    def pd_health(self) -> str | None:
        """Why the P/D link's other side is unusable (a P/D decode worker), or None."""
        return None

    def extra_metrics(self) -> str:
        """What a subclass adds to ``GET /metrics`` (Prometheus text)."""
        return ""

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
                "exact_kernels": self.model.exact, "gemm_dtype": mc.gemm_dtype,
                "native_kernels": _native_kernels()
                if self.model.exact and self.device == "cpu" else None,
                "threads": torch.get_num_threads(),
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
                "weights_digest_seconds": round(self.rank.fingerprint_s, 4),
                "speculative": None if self.scheduler.spec is None else {
                    **self.scheduler.spec.stats(),
                    "kv_bytes_per_token": self.kv_bytes_per_token}}
