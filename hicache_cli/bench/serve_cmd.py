"""``hicache bench serve``: the benchmark server (SGLang- and OpenAI-compatible HTTP API)."""

from __future__ import annotations

import dataclasses
import enum
import errno
import json
import logging
import os
import sys
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from engine.cache.l3 import PrefetchPolicy
from engine.cache.policy import PolicyName
from engine.cache.types import HostLayout, WritePolicy
from engine.core.errors import UsageError
from engine.runtime.config_fields import FIELD_GROUP, GROUP_TITLES, Disaggregation, DraftLayout
from engine.storage.config import BackendKind, StorageLayout
from hicache_cli.bench.sglang_args import apply_extra
from hicache_cli.options import Format, usage
from hicache_cli.output import OutputFormat, fail, handle_errors, stderr


class DeviceChoice(str, enum.Enum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


class FlushScopeChoice(str, enum.Enum):
    cache = "cache"
    all = "all"


class GemmDtypeChoice(str, enum.Enum):
    float32 = "float32"
    bfloat16 = "bfloat16"


class HintTrustChoice(str, enum.Enum):
    earned = "earned"
    always = "always"
    off = "off"


class OnOff(str, enum.Enum):
    on = "on"
    off = "off"


class ConsensusMode(str, enum.Enum):
    off = "off"
    online = "online"


class LogLevel(str, enum.Enum):
    debug = "debug"
    info = "info"
    warning = "warning"
    error = "error"


def _O(*names: str, field: str | None = None, **kw: Any) -> Any:
    """A ``bench serve`` option; ``field``: the ServerConfig field it sets (its group gives
    the help panel: engine.runtime.config_fields.GROUPS)."""
    if field is not None:
        kw["rich_help_panel"] = GROUP_TITLES[FIELD_GROUP[field]]
    return typer.Option(*names, **kw)


Host = Annotated[str, _O("--host", field="host", help="Address to listen on.")]
Port = Annotated[int, _O("--port", field="port", help="Port (0 = pick a free one).")]
Device = Annotated[DeviceChoice, _O("--device", field="device",
                                    help="auto = cuda when a GPU is usable, else "
                                                     "cpu.")]
Model = Annotated[str, _O("--model", "--model-path", field="model",
                          help="Preset (tiny, tiny-mla, small, small-mla, medium), "
                                          "smollm2-135m (the real SmolLM2-135M-Instruct; needs "
                                          "the smollm extra), a *.gguf file (llama), or a local "
                                          "Hugging Face Llama checkpoint directory (config.json "
                                          "+ *.safetensors).")]
ServeL2 = Annotated[Optional[int], _O("--l2-tokens", field="l2_tokens",
                                      min=0, help="L2 (host) KV capacity in "
                                      "tokens; 0 = no L2. Default: --hicache-size, else "
                                      "--hicache-ratio x L1.")]
Ratio = Annotated[float, _O("--hicache-ratio", field="hicache_ratio",
                            help="L2 size as a multiple of L1 (SGLang).")]
SizeGb = Annotated[float, _O("--hicache-size", field="hicache_size_gb",
                             help="L2 size in GB of host memory (SGLang; "
                                                    "overrides --hicache-ratio).")]
ServeWrite = Annotated[WritePolicy, _O("--hicache-write-policy", "--write-policy", field="write_policy",

                                       help="When L1 pages are copied to L2.")]
MemLayout = Annotated[HostLayout, _O("--hicache-mem-layout", field="host_layout",
                                     help="Host (L2) pool layout.")]
NoRadix = Annotated[bool, _O("--disable-radix-cache", field="disable_radix_cache",
                             help="No prefix reuse: every prompt is "
                                                           "computed in full.")]
NoPartial = Annotated[bool, _O("--disable-partial-page-reuse", field="disable_partial_page_reuse",
                               help="Recompute the tokens after the last whole cached page "
                               "(as SGLang and vLLM do) instead of copying the KV of a cached "
                               "page that starts with them (A/B runs).")]
MaxRunning = Annotated[int, _O("--max-running-requests", field="max_running_requests",
                               help="Requests decoding at once.")]
MaxSessions = Annotated[int, _O("--max-sessions", field="max_sessions", min=1, max=1 << 20,
                                help="Client sessions the server keeps open at most "
                                "(/open_session, session ids, prompt_cache_key; "
                                "docs/cache-hints.md); opening more is refused.")]
HintTrust = Annotated[HintTrustChoice, _O(
    "--hint-trust", field="hint_trust",
    help="When client cache hints (retentions, session closes) order eviction: earned = "
    "once a namespace's hints proved right (docs/cache-hints.md), always = from the first "
    "request (clients you run), off = never (recorded and judged only).")]
Chunk = Annotated[int, _O("--chunked-prefill-size", field="chunked_prefill_size",
                          help="Prompt tokens prefilled per step.")]
Eviction = Annotated[PolicyName, _O("--eviction-policy", "--radix-eviction-policy", field="eviction_policy",

                                    help="Eviction policy (not opt: it needs the future).")]
Seed = Annotated[Optional[int], _O("--seed", field="seed",
                                   help="Seed of the random weights (presets; "
                                                  "default: the preset's).")]
Backend = Annotated[Optional[BackendKind], _O(
    "--hicache-storage-backend", field="hicache_storage_backend",
    help="L3 store: file (a directory), mooncake (a Mooncake "
                                      "Store) or memory (in-process, for tests); default none.")]
StoreDir = Annotated[Optional[str], _O("--hicache-storage-dir", field="hicache_storage_dir",
                                       help="file backend: the "
                                       "directory (default: a temporary one).")]
StoreConfig = Annotated[Optional[Path], _O(
    "--hicache-storage-backend-config", field="hicache_storage_backend_config",
    help="JSON file with backend settings, e.g. "
    "{\"backend\": \"mooncake\", \"mooncake\": {\"master_server_address\": "
    "\"127.0.0.1:50051\", ...}} (see docs/storage.md).")]
SizeLimit = Annotated[Optional[str], _O("--hicache-storage-size-limit", field="hicache_storage_size_limit",
                                        help="file backend: size "
                                        "limit such as 20GiB (LRU eviction beyond it).")]
Prefetch = Annotated[PrefetchPolicy, _O(
    "--hicache-storage-prefetch-policy", field="hicache_storage_prefetch_policy",
    help="L3 -> L2 prefetch on a miss: best_effort "
                                              "(never wait), wait_complete, or timeout.")]
PrefetchTimeout = Annotated[float, _O("--hicache-storage-prefetch-timeout", field="hicache_storage_prefetch_timeout",
                                      help="Seconds a "
                                      "prefetch may hold a request (timeout policy).")]
StoreLayout = Annotated[StorageLayout, _O(
    "--hicache-storage-layout", field="hicache_storage_layout",
    help="L3 object layout: unified (named by page x layer range x "
    "kv-head range, shared by every TP/PP shape) or legacy (one object per rank, the rank in "
    "the key; for old stores, see convert-layout).")]
StoreGrid = Annotated[Optional[str], _O(
    "--hicache-storage-grid", field="hicache_storage_grid",
    help="unified layout: the fleet's cut of a page, layers=N,heads=N "
    "or tp=N,pp=N (the finest shape of the fleet); default tp=8,pp=2.")]
ModelPrint = Annotated[Optional[str], _O(
    "--hicache-model-fingerprint", field="hicache_model_fingerprint",
    metavar="VALUE", help="Declare this build's weights identical "
    "to every other server given the same VALUE: their L3 objects are shared whenever the "
    "architecture and KV dtype match (default: a digest of the loaded weights; a wrong "
    "declaration serves another model's KV).")]
DumpOnExit = Annotated[Optional[str], _O(
    "--dump-tree-on-exit", help="Write a radix-tree snapshot (for `hicache inspect`) when the "
    "server stops: a file, or a directory (an existing one, or a path ending in /) that gets "
    "tree-rank0.snapshot (with --cp/--tp/--pp: tree-rank<N>.snapshot of every rank).")]
TokenizerDir = Annotated[Optional[Path], _O(
    "--tokenizer-dir", field="tokenizer_dir",
    help="Write the model's Hugging Face tokenizer directory there "
    "(reported as tokenizer_path by /model_info); default: a temporary directory removed at "
    "exit (a checkpoint with a tokenizer.json: the checkpoint itself).")]
ServedName = Annotated[Optional[str], _O("--served-model-name", field="served_model_name",
                                         help="Model id in /v1/models "
                                         "and responses (default: the model's name).")]
SpecTokens = Annotated[int, _O("--speculative-num-draft-tokens", field="speculative_num_draft_tokens",
                               min=0, max=16, help="Speculative "
                               "decoding: tokens the draft proposes per step for greedy "
                               "requests (0: off).")]
SpecPreset = Annotated[str, _O("--speculative-draft-preset", field="speculative_draft_preset",
                               help="Draft model: mirror (a "
                               "perturbed copy of every target layer) or mirror-half (of the "
                               "first half).")]
DraftLayoutOpt = Annotated[DraftLayout, _O("--hicache-draft-layout", field="hicache_draft_layout",
                                           help="Where the draft's KV lives in "
                                "the cache: packed (extra layers of the same pools) or sidecar "
                                "(own pools, same page ids).")]
SkipDraft = Annotated[bool, _O("--debug-skip-draft-restore", field="debug_skip_draft_restore",
                               help="Debug: prefixes restored "
                               "from L2/L3 lose their draft KV (shows the acceptance collapse "
                               "that restoring it prevents).")]
DisaggregationOpt = Annotated[Optional[Disaggregation], _O(
    "--disaggregation", field="disaggregation",
    help="Prefill-decode disaggregation (docs/pd.md): pd = an HTTP front "
    "end, a decode worker process and a prefill worker process that computes what the decode "
    "cache lacks; prefill / decode = one role alone, linked over --pd-addr.")]
PdAddr = Annotated[str, _O("--pd-addr", field="pd_addr",
                           help="HOST:PORT where the prefill worker's link listens "
                           "(prefill: bind there; decode: connect there; pd: 0 = pick a "
                           "port).")]
PdReuse = Annotated[OnOff, _O("--pd-decode-reuse", field="pd_decode_reuse",
                              help="on: the decode worker reuses its own "
                            "L1/L2/L3 and asks only for the missing suffix; off: every prompt's "
                            "KV crosses the link.")]
PdTimeout = Annotated[float, _O("--pd-transfer-timeout", field="pd_transfer_timeout",
                                help="Seconds a request waits for its "
                                "KV on the link before it fails.")]
PdLinkTimeout = Annotated[float, _O("--pd-link-timeout", field="pd_link_timeout",
                                    help="Seconds one P/D link send or "
                                    "receive may take; an idle link is pinged well within it.")]
HeartbeatTimeout = Annotated[float, _O("--rank-heartbeat-timeout", field="rank_heartbeat_timeout_s",
                                       help="Seconds a rank or "
                                       "P/D worker process may miss its heartbeats before it "
                                       "is killed and named (0: no watch).")]
PdFault = Annotated[Optional[str], _O("--pd-inject-fault", field="pd_inject_fault",
                                      help="Debug (prefill worker): "
                                      "die-after-layers:N or delay:SECONDS.")]
Pp = Annotated[int, _O("--pp", "--pp-size", "--pipeline-parallel-size", field="pp",
                       min=1, max=8, help="Pipeline parallelism: split the layers over "
                       "this many stage processes (KV stays on its stage; pp_sync keeps cache "
                       "decisions equal). With --tp N each stage is N TP processes.")]
PpSync = Annotated[bool, _O("--pp-sync/--no-pp-sync", field="pp_sync",
                            help="Debug: --no-pp-sync lets each stage "
                            "consume the transfers it has finished (shows the divergence "
                            "pp_sync prevents).")]
TransferDelay = Annotated[Optional[str], _O("--debug-transfer-delay", field="debug_transfer_delay",
                                            help="Debug: slow one "
                                            "stage's copies, STAGE:MS (e.g. 1:20), so completions "
                                            "arrive at different times on different stages; "
                                            "STAGE.TP:MS slows one TP rank of a stage.")]
PpMicro = Annotated[int, _O("--pp-micro-batches", field="pp_micro_batches",
                            min=0, max=64, help="With --pp: cut each "
                            "step's batch into this many micro-batches so the stages overlap "
                            "(0: one per stage).")]
CollectiveTimeout = Annotated[float, _O("--collective-timeout", field="collective_timeout_s",
                                        help="Seconds a pipeline stage "
                                        "may stay silent before the server stops and names it.")]
Cp = Annotated[int, _O("--cp", field="cp",
                       min=1, help="Context-parallel ranks: one process each, KV pages "
                       "sharded by owner, --l1-tokens/--l2-tokens per rank "
                       "(docs/parallelism.md).")]
Tp = Annotated[int, _O("--tp", "--tp-size", "--tensor-parallel-size", field="tp",
                       min=1, max=8, help="Tensor-parallel ranks: one process each, "
                       "attention heads and the MLP split over them, each rank's KV pools "
                       "holding its kv-heads (docs/parallelism.md). With --cp M: tp x cp "
                       "processes, pages sharded over CP, heads over TP.")]
FlushScopeOpt = Annotated[FlushScopeChoice, _O(
    "--flush-cache-scope", field="flush_cache_scope",
    help="What /flush_cache and /reset_prefix_cache empty: cache = L1 "
    "and L2 (SGLang's meaning), all = every tier, L3 included (for benchmark clients that "
    "flush between runs, e.g. bench_serving --flush-cache).")]
GemmDtype = Annotated[GemmDtypeChoice, _O(
    "--gemm-dtype", field="gemm_dtype",
    help="The exact CPU path's weight products: float32, or bfloat16 (weights and inputs "
    "rounded to bf16, float32 sums, on CPUs with AVX512_BF16: about 1.4x the prefill, still "
    "batch invariant; its KV is its own in L3). docs/model-and-server.md.")]
Threads = Annotated[int, _O("--threads", field="threads",
                            min=0, max=1024, help="Torch compute threads per "
                           "server process (0: torch's default; with --tp, the host's cores "
                           "shared by its ranks). The exact CPU path gives the same bits at "
                           "any count.")]
Level = Annotated[LogLevel, _O("--log-level", help="Server log verbosity (stderr).")]
ServeL1 = Annotated[int, _O("--l1-tokens", field="l1_tokens", min=1,
                            help="L1 (device) KV capacity in tokens (per CP rank).")]
ServePage = Annotated[int, _O("--page-size", field="page_size", min=1,
                              help="Tokens per KV page.")]
ServeRankLogDir = Annotated[Optional[Path], _O(
    "--rank-log-dir", field="rank_log_dir", help="Write each rank's log of cache decisions "
    "there on shutdown (for `hicache consensus-check`).")]
ServeDivergence = Annotated[Optional[str], _O(
    "--inject-divergence", field="inject_divergence", help="Debug: break this rank's recorded "
    "decisions, e.g. 'hit_length@rank=1,step=30' (kinds: hit_length, restore_completion, "
    "lock_order, eviction_eligibility, pp_ack, missing_events).")]
ServeNNodes = Annotated[int, _O("--nnodes", field="nnodes", min=1, help="Hosts the ranks "
                                "spread over, evenly (node 0 serves HTTP; see --node-rank).")]
ServeNodeRank = Annotated[int, _O("--node-rank", field="node_rank", min=0, help="This host's "
                                  "index (0 … --nnodes-1); node 0 hosts the rendezvous and "
                                  "rank 0.")]
ServeDistAddr = Annotated[Optional[str], _O(
    "--dist-init-addr", field="dist_init_addr", help="HOST:PORT of the rendezvous on node 0 "
    "(needed with --nnodes > 1).")]

ConsensusCheck = Annotated[ConsensusMode, _O(
    "--consensus-check", field="consensus_check", help="online: every rank compares a digest "
    "of its cache decisions with the others' every --consensus-every steps and the server "
    "stops, in one line naming the divergence class and the first divergent event, before a "
    "collective can hang (rank logs written to --rank-log-dir, else ./hicache-rank-logs).")]
ConsensusEvery = Annotated[int, _O("--consensus-every", field="consensus_every", min=1,
                                   help="Steps between two online comparisons.")]
DebugDiverge = Annotated[Optional[str], _O(
    "--debug-diverge", field="debug_diverge", metavar="CLASS@RANK[:AFTER][,unguarded]",
    help="Debug: drive one rank into a divergence class (capacity, prefetch-count, ack-order, "
    "clock, host-alloc, backup-alloc, l3-exists, evict-order; docs/parallelism.md); unguarded "
    "also turns off the agreement that prevents it.")]

KvEvents = Annotated[Optional[str], _O(
    "--kv-events-config", metavar="JSON",
    help="Publish the cache's block events for KV-aware routers as SGLang does (ZMQ PUB, "
    "docs/kv-events.md), e.g. '{\"publisher\": \"zmq\", \"endpoint\": "
    "\"tcp://127.0.0.1:5557\"}'; keys: publisher (zmq|null), endpoint (binds 127.0.0.1 "
    "unless another host is written), replay_endpoint, buffer_steps, hwm, max_queue_size, "
    "topic.")]

# Parameters of serve_cmd that are not ServerConfig fields (every other one is, by name).
CLI_ONLY = frozenset({"ctx", "dump_tree_on_exit", "log_level", "fmt", "kv_events_config"})


def serve_cmd(
    ctx: typer.Context, host: Host = "127.0.0.1", port: Port = 30000,
    device: Device = DeviceChoice.auto, model: Model = "tiny", seed: Seed = None,
    threads: Threads = 0, gemm_dtype: GemmDtype = GemmDtypeChoice.float32,
    served_model_name: ServedName = None,
    tokenizer_dir: TokenizerDir = None, max_running_requests: MaxRunning = 64,
    max_sessions: MaxSessions = 4096, hint_trust: HintTrust = HintTrustChoice.earned,
    chunked_prefill_size: Chunk = 512, flush_cache_scope: FlushScopeOpt = FlushScopeChoice.cache,
    hicache_model_fingerprint: ModelPrint = None, rank_log_dir: ServeRankLogDir = None,
    inject_divergence: ServeDivergence = None, dump_tree_on_exit: DumpOnExit = None,
    page_size: ServePage = 16, l1_tokens: ServeL1 = 16384, l2_tokens: ServeL2 = None,
    hicache_ratio: Ratio = 2.0, hicache_size_gb: SizeGb = 0.0,
    write_policy: ServeWrite = WritePolicy.WRITE_THROUGH,
    host_layout: MemLayout = HostLayout.LAYER_FIRST,
    eviction_policy: Eviction = PolicyName.lru, disable_radix_cache: NoRadix = False,
    disable_partial_page_reuse: NoPartial = False,
    hicache_storage_backend: Backend = None, hicache_storage_dir: StoreDir = None,
    hicache_storage_backend_config: StoreConfig = None,
    hicache_storage_size_limit: SizeLimit = None,
    hicache_storage_prefetch_policy: Prefetch = PrefetchPolicy.TIMEOUT,
    hicache_storage_prefetch_timeout: PrefetchTimeout = 2.0,
    hicache_storage_layout: StoreLayout = StorageLayout.UNIFIED,
    hicache_storage_grid: StoreGrid = None,
    speculative_num_draft_tokens: SpecTokens = 0, speculative_draft_preset: SpecPreset = "mirror",
    hicache_draft_layout: DraftLayoutOpt = DraftLayout.PACKED,
    debug_skip_draft_restore: SkipDraft = False,
    disaggregation: DisaggregationOpt = None, pd_addr: PdAddr = "127.0.0.1:0",
    pd_decode_reuse: PdReuse = OnOff.on, pd_transfer_timeout: PdTimeout = 30.0,
    pd_link_timeout: PdLinkTimeout = 60.0, pd_inject_fault: PdFault = None,
    tp: Tp = 1, cp: Cp = 1, pp: Pp = 1, nnodes: ServeNNodes = 1, node_rank: ServeNodeRank = 0,
    dist_init_addr: ServeDistAddr = None, pp_sync: PpSync = True,
    pp_micro_batches: PpMicro = 0, debug_transfer_delay: TransferDelay = None,
    collective_timeout_s: CollectiveTimeout = 60.0,
    rank_heartbeat_timeout_s: HeartbeatTimeout = 5.0,
    consensus_check: ConsensusCheck = ConsensusMode.off, consensus_every: ConsensusEvery = 8,
    debug_diverge: DebugDiverge = None, kv_events_config: KvEvents = None,
    log_level: Level = LogLevel.warning, fmt: Format = OutputFormat.human,
) -> None:
    """Run the benchmark server until Ctrl-C / SIGTERM (--format json: also one JSON line with
    the URL and configuration on stdout when it listens).

    Example: hicache bench serve --l1-tokens 8192 --l2-tokens 65536
    then:    curl -s localhost:30000/generate -d '{"text": "Hi", "sampling_params":
             {"max_new_tokens": 8, "temperature": 0}}'
    Two hosts: --cp 2 --nnodes 2 --dist-init-addr HOST0:5000 and --node-rank 0 / 1.
    An SGLang launch line ports as it is (docs/sglang-compat.md): --model-path, --tp-size,
    --context-length, --enable-hierarchical-cache, ... are accepted or refused in one line.
    """
    opts = dict(locals())
    del opts["ctx"]
    _say_loading(model)
    try:
        _serve_cmd(ctx, opts, log_level, fmt, dump_tree_on_exit)
    finally:
        _loaded()


def _serve_cmd(ctx: typer.Context, opts: dict, log_level: LogLevel, fmt: OutputFormat,
               dump_tree_on_exit: Optional[str]) -> None:
    opts["context_length"] = None
    known = [n for p in ctx.command.params for n in p.opts]
    apply_extra(ctx.args, opts, known, lambda msg: stderr.print(f"hicache bench serve: {msg}"))
    disaggregation = opts["disaggregation"]
    disaggregation = disaggregation.value if isinstance(disaggregation, enum.Enum) \
        else disaggregation
    kv_events = _kv_events_config(opts.pop("kv_events_config", None), disaggregation,
                                  opts["node_rank"])
    _prepare(log_level, disaggregation)
    cfg = _server_config(opts)
    if disaggregation in ("prefill", "decode"):
        from engine.parallel.rendezvous import launch_secret

        with usage():                     # the two commands must share HICACHE_RANK_SECRET
            launch_secret(required=True)
    if disaggregation in ("prefill", "pd"):
        _serve_pd(cfg, fmt, dump_tree_on_exit)
        return
    dump_path, cfg = _dump_path(dump_tree_on_exit, cfg)
    if cfg.node_rank > 0:
        _serve_node(cfg, fmt)
        return
    _serve(cfg, fmt, dump_path, kv_events)


def _kv_events_config(text: Optional[str], disaggregation: Optional[str], node_rank: int):
    """``--kv-events-config``, parsed (a bad one is a usage error before anything starts)."""
    if text is None:
        return None
    from engine.runtime.serving.kv_events import parse_config

    if disaggregation or node_rank > 0:
        raise UsageError("--kv-events-config: one server's cache only (not with "
                         "--disaggregation or --node-rank > 0)")
    try:
        return parse_config(text)
    except ValueError as exc:
        raise UsageError(f"--kv-events-config: {exc}") from None


LOADING_NOTE_S = 2.0
"""A server not listening this long after start says it is loading (a real checkpoint takes
10-20 s on 2 cores); one that fails or starts sooner prints nothing extra."""
_loading: list = []


def _say_loading(model: str) -> None:
    import threading

    from engine.runtime.model.config import PRESETS

    if model in PRESETS:                 # random weights: nothing to read
        return

    t = threading.Timer(LOADING_NOTE_S, lambda: stderr.print(
        f"hicache bench serve: loading {model} …", highlight=False, markup=False))
    t.daemon = True
    _loading.append(t)
    t.start()


def _loaded() -> None:
    """Called when the server (or node, or worker set) is up, and when it fails."""
    while _loading:
        _loading.pop().cancel()


def _serve_node(cfg, fmt: OutputFormat) -> None:
    """``--node-rank R > 0``: this host's ranks, no HTTP, until node 0 stops them."""
    from engine.runtime.launch import serve_node
    from engine.runtime.topology import Topology

    topo = Topology.of(cfg)
    ranks = list(topo.node_ranks(cfg.node_rank))
    which = ", ".join(topo.name(r) for r in ranks)

    def ready(pids: dict) -> None:
        _loaded()
        if fmt is OutputFormat.json:
            sys.stdout.write(json.dumps({"node_rank": cfg.node_rank, "nnodes": cfg.nnodes,
                                         "ranks": ranks, "pids": list(pids.values()),
                                         "dist_init_addr": cfg.dist_init_addr}) + "\n")
            sys.stdout.flush()
        stderr.print(f"hicache bench serve: node {cfg.node_rank} of {cfg.nnodes}: {which} (no "
                     f"HTTP: node 0 serves), rendezvous {cfg.dist_init_addr}")

    failed = serve_node(cfg, on_ready=ready)
    if failed:
        fail(f"node {cfg.node_rank} stopped: {failed[0]}: it lost the group (node 0 or "
             f"another rank stopped; see above)")
    stderr.print(f"hicache bench serve: node {cfg.node_rank}: node 0 halted {which}; stopped")


def _serve_pd(cfg, fmt: OutputFormat, dump_tree_on_exit: Optional[str]) -> None:
    """``--disaggregation prefill`` (the worker alone) or ``pd`` (front end + both workers)."""
    if dump_tree_on_exit is not None:
        raise UsageError(f"--dump-tree-on-exit: not with --disaggregation "
                         f"{cfg.disaggregation} (use POST /dump_tree)")
    if cfg.disaggregation == "prefill":
        from engine.runtime.pd.serve import run_prefill

        stderr.print(f"hicache bench serve: prefill worker, link on {cfg.pd_addr}")
        run_prefill(cfg)
        return
    from engine.runtime.launch.pd_frontend import serve_frontend

    def ready(url: str, workers) -> None:
        _loaded()
        if fmt is OutputFormat.json:
            sys.stdout.write(json.dumps({"url": url, "disaggregation": "pd",
                                         "decode_url": workers.decode_url,
                                         "model": cfg.model}) + "\n")
            sys.stdout.flush()
        stderr.print(f"hicache bench serve: listening on {url}  (P/D: decode worker "
                     f"{workers.decode_url}, prefill worker pid {workers.prefill.pid})")

    serve_frontend(cfg, on_ready=ready)


def _prepare(log_level: LogLevel, disaggregation: Optional[str]) -> None:
    # Before torch loads (no effect if it already has): OpenMP threads that spin-wait
    # collapse when another process, e.g. the load generator, shares the cores (measured:
    # 2 instead of 80 decode steps/s on 2 busy cores); passive waiting keeps the speed-up.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if disaggregation:     # c10d's C++ retry log would bury the one-line link error
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")
    logging.basicConfig(level=log_level.value.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _server_config(o: dict):
    """The options as a ``ServerConfig``: every option that names a field sets it (derived
    from the names: engine.runtime.config.GROUPS); its checks of the values are usage errors."""
    from engine.runtime.config import ServerConfig

    def plain(v: Any) -> Any:
        if isinstance(v, OnOff):
            return v is OnOff.on
        if isinstance(v, enum.Enum):
            return v.value
        if isinstance(v, Path):
            return str(v) if str(v) else None
        return v

    with usage():
        return ServerConfig(**{k: plain(v) for k, v in o.items() if k in FIELD_GROUP})


def _dump_path(dump_tree_on_exit: Optional[str], cfg) -> tuple[Optional[Path], Any]:
    """Settle (and check) the snapshot destination before serving: rank 0's file, and the
    config with ``snapshot_dir`` set where every CP/TP/PP rank writes one."""
    if dump_tree_on_exit is None:
        return None, cfg
    from engine.snapshot.take import snapshot_filename
    from formats.outpath import OutputPathError, check_output_dir, check_output_file

    dump_path = Path(dump_tree_on_exit)
    is_dir = dump_tree_on_exit.endswith(("/", os.sep)) or dump_path.is_dir()
    group = " ".join(f"--{k} {v}" for k, v in (("tp", cfg.tp), ("cp", cfg.cp)) if v > 1)
    if cfg.ranks > 1 and cfg.pp == 1 and not is_dir:
        raise UsageError(f"--dump-tree-on-exit: with {group} every rank writes "
                         f"tree-rank<N>.snapshot: give a directory (an existing one or a path "
                         f"ending in /), got {dump_tree_on_exit!r}")
    if cfg.node_rank > 0 and (cfg.ranks == 1 or cfg.pp > 1):
        raise UsageError("--dump-tree-on-exit: with --pp only node 0's ranks write "
                         "snapshots")
    try:
        if is_dir:
            check_output_dir(dump_path)
            if cfg.ranks > 1 or cfg.pp > 1:     # every rank (of this node) writes one
                cfg = dataclasses.replace(cfg, snapshot_dir=str(dump_path))
            dump_path = dump_path / snapshot_filename(0)
        check_output_file(dump_path)      # writable now, or we say so before serving
    except OutputPathError as e:
        fail(f"--dump-tree-on-exit {e}", code=2)
    return dump_path, cfg


def _serve(cfg, fmt: OutputFormat, dump_path: Optional[Path], kv_events: Any = None) -> None:
    from engine.runtime.launch import Engine, serve

    events = None
    if kv_events is not None:             # bind now: a port in use is a usage error
        from engine.runtime.serving.kv_events import KVEventsService

        try:
            events = KVEventsService(kv_events)
        except OSError as exc:
            fail(f"--kv-events-config: {exc.strerror or exc}", code=2)

    def ready(url: str, engine: Engine) -> None:
        _loaded()
        if events is not None:
            events.attach(engine, cfg.hicache_storage_backend)
        d = engine.describe()
        if fmt is OutputFormat.json:      # one line, so a parent can read it as it comes
            sys.stdout.write(json.dumps({"url": url, **d}) + "\n")
            sys.stdout.flush()
        l2 = f"{d['l2_tokens']} tokens" if d["l2_tokens"] else "off"
        stderr.print(f"hicache bench serve: listening on {url}  (model {d['model']}, "
                     f"{d['device']}, L1 {d['l1_tokens']} tokens, L2 {l2}, L3 {d['l3']}, "
                     f"page {d['page_size']}, {d['host_layout']})")

    failure: list[str] = []

    def on_exit(engine: Engine) -> None:
        if engine.failure:                # a CP rank died or hung: exit 1 after the stop
            failure.append(engine.failure)
        if events is not None:            # the last changes, then the sockets
            events.close()
        if dump_path is not None:
            from engine.snapshot.take import write_snapshot

            n = write_snapshot(dump_path, engine.cache, engine.snapshot_meta())
            stderr.print(f"wrote {dump_path} ({n} nodes)")

    try:
        serve(cfg, on_ready=ready, on_exit=on_exit)
        if failure:
            fail(f"stopped: {failure[0]}")
    except OSError as exc:
        # a bind error names no file; any other OSError (an unwritable --rank-log-dir,
        # store dir, ...) is reported with its own path by the error table
        if exc.filename is None and exc.errno in (errno.EADDRINUSE, errno.EADDRNOTAVAIL,
                                                  errno.EACCES):
            fail(f"cannot listen on {cfg.host}:{cfg.port}: {exc.strerror}")
        raise
    finally:
        if events is not None:
            events.close()


def register(bench_app: typer.Typer) -> None:
    # Options of SGLang's launch line that hicache has no flag for arrive as extra arguments
    # (hicache_cli/bench/sglang_args.py): applied, accepted or refused in one line each.
    bench_app.command("serve", context_settings={"ignore_unknown_options": True,
                                                 "allow_extra_args": True})(
        handle_errors(serve_cmd))
