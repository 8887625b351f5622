"""``ServerConfig``: everything ``hicache bench serve`` accepts, checked when it is built.

It sits at the bottom of the runtime (beside the model): every layer above reads it, it imports
none of them. Its fields are flat and named as SGLang's server arguments are (an embedding
caller passes ``ServerConfig(tp=2, page_size=16, ...)``); each field also declares the concern
it belongs to (:data:`GROUPS`: parallel, cache, storage, speculative, pd, server), which gives
``bench serve --help`` its panels and :meth:`ServerConfig.group` its typed views. Which modes
combine is one table, :data:`MODE_RULES`."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from engine.cache.facade import WritePolicy
from engine.cache.hints import TRUST_MODES
from engine.cache.policy import policy_names
from engine.cache.pool import HostLayout
from engine.runtime.config_fields import (  # noqa: F401 - the groups, re-exported
    FIELD_GROUP,
    GROUP_TITLES,
    GROUPS,
    Disaggregation,
)
from engine.runtime.model.config import GEMM_DTYPES
from engine.runtime.scheduler import SchedulerConfig

MEMORY_STORE_CP = ("--cp with the memory L3 backend: a memory store lives in one process and "
                   "each CP rank is one; use file or mooncake")
MEMORY_SHARE = 0.9      # of the memory available at start, the KV pools may take at most this
# Ranges of the numeric options that no memory check covers (docs/reliability.md, "Named
# limits"): a value outside is a usage error naming the range, never a timer or a size
# computation that overflows later.
MAX_TIMEOUT_S = 7 * 24 * 3600          # every timeout option: a week at most
MIN_COLLECTIVE_TIMEOUT_S = 1.0         # also the start-up rendezvous limit of the ranks
MAX_HICACHE_RATIO = 1e6                # L2 as a multiple of L1
MAX_HICACHE_SIZE_GB = 1e9              # L2 in GB (an exabyte)
MAX_SEED = (1 << 63) - 1
MAX_SESSIONS = 1 << 20                 # --max-sessions: the session registry's bound


def _in_range(opt: str, v: Any, lo: float, hi: float, lo_open: bool = False) -> None:
    """``ValueError`` naming ``opt`` and its range unless ``v`` is a finite number in it."""
    ok = (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
          and (v > lo if lo_open else v >= lo) and v <= hi)
    if not ok:
        low = f"> {lo:g}" if lo_open else f">= {lo:g}"
        raise ValueError(f"{opt} must be a finite number {low} and <= {hi:g}, got {v}")


def parse_delay(spec: str | None, num_stages: int, tp: int = 1) -> dict:
    """``--debug-transfer-delay STAGE[.TP]:MS[,...]`` → {stage: seconds} for a whole stage,
    {(stage, tp_rank): seconds} for one TP rank of a stage (``--pp K --tp N``)."""
    out: dict = {}
    for part in (spec or "").split(","):
        if not part.strip():
            continue
        try:
            s, ms = part.split(":")
            where, delay = s.split("."), float(ms)
            stage, rank = int(where[0]), (int(where[1]) if len(where) == 2 else None)
            if len(where) > 2:
                raise ValueError
        except ValueError:
            raise ValueError(f"--debug-transfer-delay {spec!r}: expected STAGE:MS or "
                             f"STAGE.TP:MS, e.g. 1:20") from None
        if not 0 <= stage < num_stages or not 0 <= delay <= 60_000 or \
                (rank is not None and not 0 <= rank < tp):
            raise ValueError(f"--debug-transfer-delay {spec!r}: stage must be 0..{num_stages - 1}"
                             f"{f', TP rank 0..{tp - 1}' if tp > 1 else ' (no TP rank without --tp)'}"
                             f" and MS 0..60000")
        out[stage if rank is None else (stage, rank)] = delay / 1000.0
    return out


def delay_for(spec: str | None, num_stages: int, tp: int, stage: int, tp_rank: int) -> float:
    """The debug delay of one rank: its own (``STAGE.TP``), else its stage's, else none."""
    d = parse_delay(spec, num_stages, tp)
    return d.get((stage, tp_rank), d.get(stage, 0.0))


def parse_fault(spec: str | None) -> dict[str, float]:
    """``--pd-inject-fault`` (debug, for tests): ``die-after-layers:N`` (the prefill worker
    exits after sending N layers in all) or ``delay:S`` (sleep S seconds before the first
    request's first layer)."""
    if not spec:
        return {}
    kind, _, val = spec.partition(":")
    try:
        v = float(val)
    except ValueError:
        v = -1.0
    if kind not in ("die-after-layers", "delay") or v < 0:
        raise ValueError(f"--pd-inject-fault: expected die-after-layers:N or delay:SECONDS, "
                         f"got {spec!r}")
    return {kind: v}


def parse_pd_addr(addr: str) -> tuple[str, int]:
    """``--pd-addr HOST:PORT`` → (host, port); port 0: pick one."""
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"--pd-addr: expected HOST:PORT, got {addr!r}")
    return host.strip("[]"), int(port)


PD_ROLES = ("pd", "prefill", "decode")


@dataclasses.dataclass(frozen=True)
class Diverge:
    """``--debug-diverge CLASS@RANK[:AFTER][,unguarded]``: rank ``rank`` behaves as ``cls``
    says from its ``after``-th occasion on; ``unguarded`` also turns off the agreement that
    prevents the class (so the online check and consensus-check can be shown catching it)."""

    cls: str
    rank: int
    after: int = 0
    unguarded: bool = False


DIVERGE_CLASSES = ("capacity", "prefetch-count", "ack-order", "clock", "host-alloc",
                   "backup-alloc", "l3-exists", "evict-order")
# the shapes each class applies to (a class needs ranks that make the same decision)
DIVERGE_SHAPES = {"capacity": lambda c: c.ranks * c.pp > 1,
                  "prefetch-count": lambda c: c.tp > 1 and c.hicache_storage_backend is not None,
                  "ack-order": lambda c: c.ranks * c.pp > 1,
                  "clock": lambda c: c.tp > 1 and c.hicache_storage_backend is not None,
                  "host-alloc": lambda c: c.tp > 1 and c.hicache_storage_backend is not None,
                  "backup-alloc": lambda c: c.tp > 1 and c.l2_tokens != 0,
                  "l3-exists": lambda c: c.pp > 1 and c.cp == 1 and
                  c.hicache_storage_backend is not None,
                  "evict-order": lambda c: c.ranks * c.pp > 1}
DIVERGE_NEEDS = {"capacity": "needs --tp, --cp or --pp > 1",
                 "prefetch-count": "needs --tp > 1 and an L3 store (--hicache-storage-backend)",
                 "ack-order": "needs --tp, --cp or --pp > 1",
                 "clock": "needs --tp > 1 and an L3 store (--hicache-storage-backend)",
                 "host-alloc": "needs --tp > 1 and an L3 store (--hicache-storage-backend)",
                 "backup-alloc": "needs --tp > 1 and an L2 host pool (--l2-tokens not 0)",
                 "l3-exists": "needs --pp > 1 without --cp and an L3 store "
                              "(--hicache-storage-backend)",
                 "evict-order": "needs --tp, --cp or --pp > 1"}


def parse_diverge(spec: str) -> Diverge:
    """``ValueError`` naming the expected form unless ``spec`` is one."""
    head, _, flag = spec.partition(",")
    cls, at, where = head.partition("@")
    rank_s, _, after_s = where.partition(":")
    if cls not in DIVERGE_CLASSES or not at or not rank_s.isdigit() or \
            (after_s and not after_s.isdigit()) or flag not in ("", "unguarded"):
        raise ValueError(f"--debug-diverge {spec!r}: expected CLASS@RANK[:AFTER][,unguarded] "
                         f"with CLASS one of {', '.join(DIVERGE_CLASSES)}")
    return Diverge(cls, int(rank_s), int(after_s or 0), flag == "unguarded")


@dataclasses.dataclass(frozen=True)
class ModeRule:
    """Two modes that do not combine: ``applies(cfg)`` says the config asks for both."""

    first: str
    second: str
    applies: Any
    why: str = "yet"

    def message(self) -> str:
        return f"{self.first} does not combine with {self.second} {self.why}".rstrip()


def _spec(c: Any) -> bool:
    return bool(c.speculative_num_draft_tokens)


def _pd(c: Any) -> bool:
    return c.disaggregation is not None


# Every mode combination the server refuses, in one place (checked in this order; the first
# that applies is the usage error). docs/parallelism.md lists the same table.
MODE_RULES: tuple[ModeRule, ...] = (
    ModeRule("--tp > 1", "P/D disaggregation", lambda c: c.tp > 1 and _pd(c)),
    ModeRule("--tp > 1", "speculative decoding", lambda c: c.tp > 1 and _spec(c)),
    ModeRule("--cp > 1", "P/D disaggregation", lambda c: c.cp > 1 and _pd(c)),
    ModeRule("--cp > 1", "speculative decoding", lambda c: c.cp > 1 and _spec(c)),
    ModeRule("--cp > 1", "the memory L3 backend",
             lambda c: c.cp > 1 and c.hicache_storage_backend == "memory",
             "(a memory store lives in one process and each CP rank is one; use file or "
             "mooncake)"),
    ModeRule("--pp > 1", "speculative decoding", lambda c: c.pp > 1 and _spec(c)),
    ModeRule("--pp > 1", "--disaggregation", lambda c: c.pp > 1 and _pd(c)),
    ModeRule("--disaggregation", "speculative decoding", lambda c: _pd(c) and _spec(c),
             "yet (the link carries the target's KV only)"),
    ModeRule("--debug-transfer-delay", "--pp 1",
             lambda c: c.pp == 1 and bool(c.debug_transfer_delay), "(it needs --pp 2 or more)"),
    ModeRule("--pp-micro-batches", "--pp 1",
             lambda c: c.pp == 1 and bool(c.pp_micro_batches), "(it needs --pp 2 or more)"),
)


def check_modes(cfg: Any) -> None:
    """``ValueError`` for the first :data:`MODE_RULES` entry ``cfg`` breaks."""
    for rule in MODE_RULES:
        if rule.applies(cfg):
            raise ValueError(rule.message())


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
    disable_partial_page_reuse: bool = False   # recompute the tokens after the last whole page
    max_running_requests: int = 64
    max_sessions: int = 4096           # client sessions the server keeps (docs/cache-hints.md)
    hint_trust: str = "earned"         # when client hints are applied: earned | always | off
    chunked_prefill_size: int = 512
    exact: bool | None = None          # batch-invariant kernels (default: on CPU)
    gemm_dtype: str = "float32"        # the exact path's weight products: float32 | bfloat16
    threads: int = 0                   # torch threads per process (0: torch's own / TP's share)
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
    # what /flush_cache and /reset_prefix_cache empty: cache = L1 + L2 (SGLang's meaning), all =
    # every tier (benchmarks whose client can only call /flush_cache, e.g. bench_serving)
    flush_cache_scope: str = "cache"
    context_length: int | None = None  # SGLang's --context-length: requests limited below the model's
    hicache_model_fingerprint: str | None = None     # declare builds identical (model_id.py)
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
    pd_link_timeout: float = 60.0      # seconds one link send/receive may take (idle: pinged)
    # pipeline parallelism (docs/parallelism.md §2): stage processes, pp_sync, debug delays
    pp: int = 1
    pp_sync: bool = True                   # debug: False lets each stage consume what it has
    pp_micro_batches: int = 0              # micro-batches per step (0: one per stage)
    debug_transfer_delay: str | None = None  # "STAGE[.TP]:MS[,...]": slow a stage's copies
    collective_timeout_s: float = 60.0     # a stage silent this long stops the server
    rank_heartbeat_timeout_s: float = 5.0  # a worker process silent this long is killed (0: off)
    cp: int = 1                        # context-parallel ranks (one process each; KV sharded)
    tp: int = 1                        # tensor-parallel ranks (one process each; heads sharded)
    # multi-host, as in SGLang: the --cp/--tp/--pp ranks spread evenly over nnodes hosts; node 0
    # serves HTTP and hosts the rendezvous dist_init_addr (HOST:PORT); None: a local one
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None
    snapshot_dir: str | None = None    # every --cp/--tp/--pp rank writes tree-rank{r}.snapshot
    # rank divergence (docs/parallelism.md, "Rank divergence classes"): online consensus of
    # every rank's cache decisions, and a debug injector of one divergence class on one rank
    consensus_check: str = "off"       # off | online
    consensus_every: int = 8           # steps between online comparisons
    debug_diverge: str | None = None   # CLASS@RANK[:AFTER][,unguarded]

    def __post_init__(self) -> None:
        if not 0 <= self.threads <= 1024:
            raise ValueError(f"--threads must be 0..1024, got {self.threads}")
        if self.cp < 1:
            raise ValueError(f"--cp must be >= 1, got {self.cp}")
        if not 1 <= self.tp <= 8:
            raise ValueError(f"--tp must be 1..8, got {self.tp}")
        check_modes(self)
        if self.tp > 1:
            from engine.runtime.model.config import PRESETS
            from engine.runtime.model.tp import check_tp

            if self.model in PRESETS:     # other models are checked once loaded
                check_tp(PRESETS[self.model], self.tp)
        if self.page_size < 1:
            raise ValueError(f"--page-size must be >= 1, got {self.page_size}")
        if self.l1_tokens < self.page_size:
            raise ValueError(f"--l1-tokens must hold at least one page ({self.page_size})")
        if self.l2_tokens is not None and self.l2_tokens < 0:
            raise ValueError("--l2-tokens must be >= 0")
        for opt, v, hi in (("--hicache-ratio", self.hicache_ratio, MAX_HICACHE_RATIO),
                           ("--hicache-size", self.hicache_size_gb, MAX_HICACHE_SIZE_GB),
                           ("--hicache-storage-prefetch-timeout",
                            self.hicache_storage_prefetch_timeout, MAX_TIMEOUT_S)):
            _in_range(opt, v, 0, hi)
        _in_range("--pd-transfer-timeout", self.pd_transfer_timeout, 0, MAX_TIMEOUT_S,
                  lo_open=True)
        if self.seed is not None and not (type(self.seed) is int and 0 <= self.seed <= MAX_SEED):
            raise ValueError(f"--seed must be an integer in [0, 2**63 - 1], got {self.seed}")
        if self.hicache_storage_size_limit is not None:
            from engine.storage.config import parse_size

            try:
                parse_size(self.hicache_storage_size_limit)
            except ValueError as exc:
                raise ValueError(f"--hicache-storage-size-limit: {exc}; give a size >= 0 "
                                 f"such as 20GiB (0: no limit)") from None
        if self.flush_cache_scope not in ("cache", "all"):
            raise ValueError(f"--flush-cache-scope: choose cache or all, got "
                             f"{self.flush_cache_scope!r}")
        if self.gemm_dtype not in GEMM_DTYPES:
            raise ValueError(f"--gemm-dtype: choose {', '.join(GEMM_DTYPES)}, got "
                             f"{self.gemm_dtype!r:.40}")
        if self.hint_trust not in TRUST_MODES:
            raise ValueError(f"--hint-trust: choose {', '.join(TRUST_MODES)}, got "
                             f"{self.hint_trust!r:.40}")
        if not 1 <= self.max_sessions <= MAX_SESSIONS:
            raise ValueError(f"--max-sessions must be 1..{MAX_SESSIONS}, got {self.max_sessions}")
        if self.context_length is not None and self.context_length < 1:
            raise ValueError(f"--context-length must be >= 1, got {self.context_length}")
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
        from engine.runtime.model_id import check_fingerprint

        check_fingerprint(self.hicache_model_fingerprint)
        self.spec_config()
        if self.disaggregation is not None:
            self._check_pd()
        if not 1 <= self.pp <= 8:
            raise ValueError(f"--pp must be 1..8, got {self.pp}")
        if self.pp > 1:
            parse_delay(self.debug_transfer_delay, self.pp, self.tp)
            if not 0 <= self.pp_micro_batches <= 64:
                raise ValueError(f"--pp-micro-batches must be 0..64 (0: one per stage), got "
                                 f"{self.pp_micro_batches}")
        self._check_nodes()
        _in_range("--collective-timeout", self.collective_timeout_s, MIN_COLLECTIVE_TIMEOUT_S,
                  MAX_TIMEOUT_S)
        hb = self.rank_heartbeat_timeout_s
        if not (isinstance(hb, (int, float)) and math.isfinite(hb) and (hb == 0 or 1 <= hb <= 3600)):
            raise ValueError(f"--rank-heartbeat-timeout must be 0 (off) or 1..3600 seconds, got {hb}")
        if self.consensus_check not in ("off", "online"):
            raise ValueError(f"--consensus-check: choose off or online, got "
                             f"{self.consensus_check!r}")
        if not 1 <= self.consensus_every <= 1_000_000:
            raise ValueError(f"--consensus-every must be 1..1000000 steps, got "
                             f"{self.consensus_every}")
        if self.consensus_check == "online" and self.ranks * self.pp == 1:
            raise ValueError("--consensus-check online needs ranks to compare: --tp, --cp or "
                             "--pp > 1")
        if self.debug_diverge is not None:
            d = parse_diverge(self.debug_diverge)
            if d.rank >= self.ranks * self.pp:
                raise ValueError(f"--debug-diverge {self.debug_diverge!r}: rank {d.rank} is "
                                 f"outside the {self.ranks * self.pp} ranks")
            if d.cls not in DIVERGE_SHAPES or not DIVERGE_SHAPES[d.cls](self):
                raise ValueError(f"--debug-diverge {d.cls}: {DIVERGE_NEEDS[d.cls]}")
        if self.inject_divergence:
            from engine.parallel.divergence import parse_spec

            parse_spec(self.inject_divergence)

    def _check_pd(self) -> None:
        if self.disaggregation not in PD_ROLES:
            raise ValueError(f"--disaggregation: choose one of {', '.join(PD_ROLES)}, got "
                             f"{self.disaggregation!r}")
        _, port = parse_pd_addr(self.pd_addr)
        if self.disaggregation != "pd" and port == 0:
            raise ValueError(f"--disaggregation {self.disaggregation} needs --pd-addr HOST:PORT "
                             f"(where the prefill worker listens)")
        t = self.pd_link_timeout
        if not (isinstance(t, (int, float)) and math.isfinite(t) and 0.5 <= t <= 86400):
            raise ValueError(f"--pd-link-timeout must be 0.5..86400 seconds, got {t}")
        parse_fault(self.pd_inject_fault)

    def group(self, name: str) -> dict[str, Any]:
        """The fields of one concern (a :data:`GROUPS` key), by name."""
        return {f: getattr(self, f) for f in GROUPS[name]}

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
        from engine.core.device import max_local_ranks

        local = -(-world // self.nnodes)
        cap, why = max_local_ranks()
        if local > cap:       # refused before one process is spawned
            raise ValueError(f"{what}: {local:,} rank processes on this host; it can run at "
                             f"most {cap} ({why})")
        if self.nnodes > 1:
            from engine.parallel.rendezvous import launch_secret

            launch_secret(self.nnodes)    # every node needs the same HICACHE_RANK_SECRET

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
