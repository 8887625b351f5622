"""Server configuration and the engine it serves: model + tokenizer + cache + scheduler."""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

from engine.device import resolve_device
from engine.events import EventLog
from engine.hicache import CacheConfig, HiCache, WritePolicy
from engine.model import Model, load_model
from engine.pool import HostLayout
from engine.policy import policy_names
from engine.scheduler import Scheduler, SchedulerConfig
from engine.tokenizer import Tokenizer, load_tokenizer

log = logging.getLogger("hicache.server")


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

    def __post_init__(self) -> None:
        if self.page_size < 1:
            raise ValueError(f"--page-size must be >= 1, got {self.page_size}")
        if self.l1_tokens < self.page_size:
            raise ValueError(f"--l1-tokens must hold at least one page ({self.page_size})")
        if self.l2_tokens is not None and self.l2_tokens < 0:
            raise ValueError("--l2-tokens must be >= 0")
        if self.hicache_ratio < 0 or self.hicache_size_gb < 0:
            raise ValueError("--hicache-ratio and --hicache-size must be >= 0")
        if not 0 <= self.port < 65536:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")
        WritePolicy.parse(self.write_policy)
        HostLayout.parse(self.host_layout)
        if self.eviction_policy not in policy_names():
            raise ValueError(f"unknown eviction policy {self.eviction_policy!r}; choose one of "
                             f"{policy_names()}")
        SchedulerConfig(self.max_running_requests, self.chunked_prefill_size)

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

    def __init__(self, cfg: ServerConfig):
        self.cfg = cfg
        self.device = resolve_device(cfg.device)
        self.model: Model = load_model(cfg.model, self.device, seed=cfg.seed, exact=cfg.exact)
        mc = self.model.cfg
        model_dir = cfg.model if os.path.isdir(cfg.model) else None
        self.tokenizer: Tokenizer | None = load_tokenizer(
            model_dir, mc.vocab_size, mc.bos_id, mc.eos_ids[0] if mc.eos_ids else None)
        layout = self.model.kv_layout(cfg.page_size)
        token_bytes = layout.page_bytes // cfg.page_size
        self.l2_tokens = cfg.l2_tokens_for(token_bytes)
        self.cache = HiCache(CacheConfig(
            page_size=cfg.page_size, l1_tokens=cfg.l1_tokens, l2_tokens=self.l2_tokens,
            write_policy=cfg.write_policy, write_through_threshold=cfg.write_through_threshold,
            eviction_policy=cfg.eviction_policy, host_layout=cfg.host_layout,
            device=self.device, layout=layout),
            events=EventLog(enabled=cfg.record_events, keep=cfg.record_events))
        self.scheduler = Scheduler(self.model, self.cache, SchedulerConfig(
            max_running_requests=cfg.max_running_requests,
            chunked_prefill_size=cfg.chunked_prefill_size,
            disable_radix_cache=cfg.disable_radix_cache))
        self.model_name = mc.name

    def start(self) -> None:
        self.scheduler.start()

    def stop(self) -> None:
        self.scheduler.stop()
        self.cache.close()

    def describe(self) -> dict[str, Any]:
        mc = self.model.cfg
        return {"model": mc.name, "attention": mc.attention.value, "layers": mc.num_layers,
                "params": mc.num_params(), "device": self.device,
                "exact_kernels": self.model.exact, "page_size": self.cfg.page_size,
                "l1_tokens": self.cfg.l1_tokens, "l2_tokens": self.l2_tokens,
                "host_layout": self.cfg.host_layout, "write_policy": self.cfg.write_policy,
                "radix_cache": not self.cfg.disable_radix_cache,
                "max_context": mc.max_context, "vocab_size": mc.vocab_size}
