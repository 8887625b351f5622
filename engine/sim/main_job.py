"""The main job behind ``hicache bench``: the same workload against L1 only, then HiCache.

Starts the benchmark server in-process (``engine.runtime.serving.start_server``) on a free
127.0.0.1 port, runs the workload with L1 only (no L2), restarts the server with HiCache (the same
L1 plus L2, plus a file L3 in a temporary directory) and returns both runs' reports and their
ratios. Each server is always stopped, on success, on an error and on Ctrl-C.

The default workload is ``agentic`` (see :data:`MAIN_AGENTIC` and docs/benchmarking.md): agent
sessions that share a system prompt and tool definitions, each with its own task context and a
history that grows by one tool output and one answer per turn. The sessions' histories together
are several times L1, and the driver serves the sessions' turns in FIFO order, so with L1 alone a
session's history has been evicted by the time its next turn comes (only the shared prefix
stays), while L2 and the file L3 keep every history.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import tempfile
import time
from typing import Callable, Iterator

from engine.cache.hints import TRUST_MODES
from engine.core.errors import HiCacheError
from engine.loadgen.driver import LoadConfig, LoadResult, run_load, server_info
from engine.loadgen.report import summarize_result
from engine.loadgen.trace import trace_workload
from engine.loadgen.workloads import ConversationConfig, Workload, agentic, multiturn

# The main job's sizes, scaled for the ``tiny`` model on 2 CPU cores (docs/benchmarking.md).
MAIN_AGENTIC = dict(num_clients=4, num_rounds=12, context_length=896, system_length=320,
                    request_length=12, output_length=4)
"""4 sessions x 12 turns: a 320-token prefix shared by all (system prompt, tool definitions), a
576-token task context of each session's own, then per turn a 4-token tool call (the answer)
and a 12-token tool result: one 16-token page a turn, prompts grow from 896 to 1072 tokens."""
MAIN_MULTITURN = dict(num_clients=8, num_rounds=8, request_length=192, output_length=8)
MAIN_TRACE = dict(trace_limit=256, trace_block_tokens=16, output_length=8)
"""A trace: its first 256 requests, 16 tokens per 512-token block, at most 8 output tokens."""
TRACE_SPEEDUP = 1000.0
"""Trace time runs this much faster: the requests queue up and are sent in trace order as fast
as the concurrency allows (the job measures the cache, not the arrival process)."""
SHAPE_FIELDS = ("num_clients", "num_rounds", "request_length", "output_length",
                "context_length", "system_length")
TRACE_FIELDS = ("trace_limit", "trace_block_tokens")
RUNS = (("l1_only", "L1 only"), ("hicache", "HiCache"))
HINTS_RUN = ("hicache_hints", "HiCache + hints")

Runner = Callable[[Workload, LoadConfig, str], LoadResult]
"""Runs one workload against a server (``run_load`` plus, in the CLI, a progress bar)."""


class ServerStartError(HiCacheError):
    pass


@dataclasses.dataclass(frozen=True)
class MainJobConfig:
    """``workload``: ``agentic`` | ``multiturn`` | ``trace:PATH``. Workload fields left ``None``
    take the main-job default (:data:`MAIN_AGENTIC`, :data:`MAIN_MULTITURN`, :data:`MAIN_TRACE`);
    for a trace, ``output_length`` caps each request's output."""

    workload: str = "agentic"
    num_clients: int | None = None
    num_rounds: int | None = None
    request_length: int | None = None
    output_length: int | None = None
    context_length: int | None = None
    system_length: int | None = None
    trace_limit: int | None = None
    trace_block_tokens: int | None = None
    concurrency: int = 2
    l1_tokens: int = 2560
    l2_tokens: int = 3072
    """L2 of the HiCache run; the rest of the histories spill to the file L3."""
    fit_l1: bool = False
    """A trace whose largest request needs more KV than ``l1_tokens``: grow L1 (and L2 with it)
    to fit it instead of refusing (the CLI sets this when --l1-tokens was not given)."""
    storage: bool = True
    device: str = "auto"
    model: str = "tiny"
    seed: int = 0
    hints: bool = False
    """Add a third run: HiCache again, its clients sending cache hints (each turn a retention,
    the last turn a session close; docs/cache-hints.md)."""
    hint_trust: str = "always"
    """The hinted run's server ``--hint-trust``: ``always`` (the job's clients are its own, and a
    48-request job is too short to earn trust), ``earned`` (what a server facing unknown clients
    does) or ``off`` (hints sent, never applied: the cost of carrying them)."""
    threads: int | None = 1
    """torch intra-op threads during the job (``None``: leave torch's setting). The server's
    HTTP thread and the load generator share the process, so one thread for the model leaves a
    core to them on a small machine, and stays fast when other processes load the cores."""

    @property
    def is_trace(self) -> bool:
        return self.workload.startswith("trace:")

    def shape(self) -> dict[str, int]:
        """The workload's sizes actually used (defaults filled in)."""
        if self.is_trace:
            preset, fields = MAIN_TRACE, ("output_length", *TRACE_FIELDS)
        else:
            preset = {"agentic": MAIN_AGENTIC, "multiturn": MAIN_MULTITURN}.get(self.workload, {})
            fields = SHAPE_FIELDS
        given = {k: getattr(self, k) for k in fields if getattr(self, k) is not None}
        return {**preset, **given}


def check_options(cfg: MainJobConfig) -> None:
    """``ValueError`` for an unknown workload or an option that does not apply to it."""
    given = {k for k in SHAPE_FIELDS + TRACE_FIELDS if getattr(cfg, k) is not None}
    if cfg.is_trace:
        if cfg.workload == "trace:":
            raise ValueError("trace workload needs a path: trace:PATH")
        allowed = {"output_length", *TRACE_FIELDS}
    elif cfg.workload == "agentic":
        allowed = set(SHAPE_FIELDS)
    elif cfg.workload == "multiturn":
        allowed = set(SHAPE_FIELDS) - {"context_length", "system_length"}
    else:
        raise ValueError(f"unknown workload {cfg.workload!r}; choose agentic, multiturn or "
                         f"trace:PATH")
    extra = [k for k in SHAPE_FIELDS + TRACE_FIELDS if k in given - allowed]
    if extra:
        opts = ", ".join("--" + k.replace("_", "-") for k in extra)
        kind = "trace" if cfg.is_trace else cfg.workload
        raise ValueError(f"{opts} does not apply to the {kind} workload")


def build_workload(cfg: MainJobConfig, hints: bool = False) -> Workload:
    """The workload of ``cfg`` (fresh sessions: the same prompts every time); ``hints``: its
    clients send cache hints."""
    check_options(cfg)
    shape = cfg.shape()
    if cfg.is_trace:
        return trace_workload(cfg.workload[len("trace:"):], speedup=TRACE_SPEEDUP,
                              limit=shape["trace_limit"],
                              block_tokens_n=shape["trace_block_tokens"],
                              max_tokens=shape["output_length"])
    if cfg.workload == "agentic":
        return agentic(**shape, seed=cfg.seed, hints=hints)
    return multiturn(**shape, seed=cfg.seed, hints=hints)


def conversation_config(cfg: MainJobConfig) -> ConversationConfig | None:
    """The conversation shape (``None`` for a trace)."""
    if cfg.is_trace:
        return None
    shape = cfg.shape()
    if cfg.workload == "agentic":
        ctx, sys_len = shape.pop("context_length"), shape.pop("system_length")
        if ctx <= sys_len:
            raise ValueError(f"context-length ({ctx}) must exceed system-length ({sys_len})")
        shape.update(first_length=ctx - sys_len, system_length=sys_len)
    return ConversationConfig(**shape, seed=cfg.seed)


MAX_THREADS = 1024          # torch's thread pool crashes (SIGSEGV) when asked for 100,000
MAX_SEED = (1 << 63) - 1


def check_config(cfg: MainJobConfig) -> None:
    """Usage errors (``ValueError``) before anything starts: the device, the workload, and a last
    turn that could never fit in L1 (the server would refuse it with HTTP 400 in both runs)."""
    from engine.core.device import resolve_device
    from engine.runtime.launch import ServerConfig

    resolve_device(cfg.device)
    if cfg.hints and cfg.is_trace:
        raise ValueError("--hints needs a generated workload (agentic or multiturn): a trace's "
                         "clients send no hints")
    if cfg.hint_trust not in TRUST_MODES:
        raise ValueError(f"--hint-trust: choose {', '.join(TRUST_MODES)}, got "
                         f"{cfg.hint_trust!r:.40}")
    if cfg.hint_trust != "always" and not cfg.hints:
        raise ValueError("--hint-trust applies to the --hints run; add --hints")
    if cfg.concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {cfg.concurrency}")
    if cfg.threads is not None and not 1 <= cfg.threads <= MAX_THREADS:
        raise ValueError(f"--threads must be 1..{MAX_THREADS}, got {cfg.threads:,}")
    if not 0 <= cfg.seed <= MAX_SEED:
        raise ValueError(f"--seed must be an integer in [0, 2**63 - 1], got {cfg.seed}")
    check_options(cfg)
    page = ServerConfig.page_size
    if cfg.is_trace:
        wl = build_workload(cfg)    # reads the trace: a bad file fails before any server starts
        needs = [_kv_need(s.first().prompt_len, s.first().max_tokens, page) for s in wl.sessions]
        over = [n for n in needs if n > cfg.l1_tokens // page * page]
        if over and not cfg.fit_l1:
            raise ValueError(f"{len(over)} of the trace's {len(needs)} requests need more KV "
                             f"than --l1-tokens {cfg.l1_tokens} holds (the largest "
                             f"{max(over)} tokens, pages of {page}); raise --l1-tokens, lower "
                             f"--trace-block-tokens or --output-length, or leave --l1-tokens "
                             f"out to size L1 from the trace")
        return
    shape = conversation_config(cfg)
    # as the server counts: whole pages, KV for the prompt and every output token but the last
    need = _kv_need(shape.max_prompt_tokens, shape.output_length, page)
    if need > cfg.l1_tokens // page * page:
        raise ValueError(f"the last round needs {need} tokens of KV (pages of {page}) but "
                         f"--l1-tokens {cfg.l1_tokens} holds {cfg.l1_tokens // page * page}; "
                         f"raise --l1-tokens or lower --num-rounds / --request-length")


def _kv_need(prompt: int, output: int, page: int) -> int:
    """KV tokens the server reserves for a request: whole pages for the prompt and every output
    token but the last."""
    return -(-(prompt + max(output, 1) - 1) // page) * page


def fitted(cfg: MainJobConfig) -> MainJobConfig:
    """``cfg`` with L1 grown to the trace's largest request when ``fit_l1`` asks for it (L2
    keeps its ratio to L1, so the HiCache run still has room beyond L1)."""
    from engine.runtime.launch import ServerConfig

    if not (cfg.is_trace and cfg.fit_l1):
        return cfg
    page = ServerConfig.page_size
    wl = build_workload(cfg)
    need = max((_kv_need(s.first().prompt_len, s.first().max_tokens, page)
                for s in wl.sessions), default=0)
    if need <= cfg.l1_tokens // page * page:
        return cfg
    l2 = -(-cfg.l2_tokens * need // cfg.l1_tokens)
    return dataclasses.replace(cfg, l1_tokens=need, l2_tokens=l2)


def server_config(cfg: MainJobConfig, hicache: bool, storage_dir: str | None,
                  hints: bool = False):
    """L1 only: no L2, no L3. HiCache: the same L1, ``l2_tokens`` of L2, and a file L3 in
    ``storage_dir`` when given; ``hints``: the server applies client hints as ``hint_trust``
    says."""
    from engine.runtime.launch import ServerConfig

    extra: dict = {"hint_trust": cfg.hint_trust} if hints else {}
    if hicache and storage_dir is not None:
        extra.update(hicache_storage_backend="file", hicache_storage_dir=storage_dir)
    return ServerConfig(host="127.0.0.1", port=0, device=cfg.device, model=cfg.model,
                        l1_tokens=cfg.l1_tokens, l2_tokens=cfg.l2_tokens if hicache else 0,
                        **extra)


@contextlib.contextmanager
def embedded_server(server_cfg, label: str) -> Iterator[str]:
    """Start the benchmark server in-process on a free 127.0.0.1 port; always stop it."""
    from engine.runtime.launch import start_server

    try:
        handle = start_server(server_cfg)
    except OSError as exc:
        raise ServerStartError(f"{label} server did not start: {exc}") from None
    try:
        yield handle.url
    finally:
        handle.stop()


def _plain_runner(wl: Workload, lc: LoadConfig, label: str) -> LoadResult:
    return run_load(wl, lc)


@contextlib.contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """Run with ``n`` torch intra-op threads, then restore the previous setting."""
    import torch

    prev = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(prev)


def run_main_job(cfg: MainJobConfig, runner: Runner = _plain_runner) -> dict:
    """Both runs; returns ``{"config", "runs": {"l1_only", "hicache"}, "comparison", "wall_s",
    "cpu_s"}`` (``cpu_s``: CPU time of this process, the figure to compare on a loaded machine)."""
    t0, c0 = time.perf_counter(), time.process_time()
    cfg = fitted(cfg)
    check_config(cfg)
    runs: dict[str, dict] = {}
    with torch_threads(cfg.threads), \
            tempfile.TemporaryDirectory(prefix="hicache-bench-l3-") as l3_dir:
        for name, label in RUNS + ((HINTS_RUN,) if cfg.hints else ()):
            hicache = name != "l1_only"
            srv = server_config(cfg, hicache, _fresh(l3_dir, name) if cfg.storage else None,
                                hints=name == HINTS_RUN[0])
            # fresh sessions: the same prompts in every run
            wl = build_workload(cfg, hints=name == HINTS_RUN[0])
            with embedded_server(srv, label) as url:
                result = runner(wl, LoadConfig(url=url, concurrency=cfg.concurrency,
                                               seed=cfg.seed), label)
                info = server_info(url) or {}
            runs[name] = summarize_result(result)
            if name == HINTS_RUN[0]:           # what the server made of the hints
                runs[name]["cache_hints"] = info.get("cache_hints")
    tiers = "L1+L2+L3(file)" if cfg.storage else "L1+L2"
    config = {**dataclasses.asdict(cfg), "shape": cfg.shape(), "hicache_tiers": tiers}
    comparison = compare(runs["l1_only"], runs["hicache"])
    if cfg.hints:
        comparison["hints"] = compare_hints(runs["hicache"], runs[HINTS_RUN[0]])
    return {"config": config, "runs": runs, "comparison": comparison,
            "wall_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0}


def _fresh(l3_dir: str, name: str) -> str:
    """The run's own file-L3 directory (a run must not read what an earlier one stored)."""
    import os

    path = os.path.join(l3_dir, name)
    os.makedirs(path, exist_ok=True)
    return path


def compare_hints(plain: dict, hinted: dict) -> dict:
    """The hinted HiCache run beside the plain one: hit rates (all tiers, and L1 alone — what
    the hints move), how many times lower the hinted run's TTFT is, and how many of the
    hints the server applied."""
    seen = hinted.get("cache_hints") or {}
    return {
        "hints_sent": int(seen.get("hints_applied", 0)) + int(seen.get("hints_ignored", 0)),
        "hints_applied": int(seen.get("hints_applied", 0)),
        "hit_rate_hicache": plain["hit_rate"]["total"],
        "hit_rate_hints": hinted["hit_rate"]["total"],
        "l1_hit_rate_hicache": plain["hit_rate"]["device"],
        "l1_hit_rate_hints": hinted["hit_rate"]["device"],
        "ttft_p50_ratio": _ratio(plain["ttft_s"]["p50"], hinted["ttft_s"]["p50"]),
        "ttft_p90_ratio": _ratio(plain["ttft_s"]["p90"], hinted["ttft_s"]["p90"]),
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    if not a or not b or not (math.isfinite(a) and math.isfinite(b)):
        return None
    return a / b


def compare(l1_only: dict, hicache: dict) -> dict:
    """Hit rates side by side; how many times lower HiCache's TTFT is, and how many times higher
    its input throughput."""
    return {
        "hit_rate_l1_only": l1_only["hit_rate"]["total"],
        "hit_rate_hicache": hicache["hit_rate"]["total"],
        "ttft_p50_ratio": _ratio(l1_only["ttft_s"]["p50"], hicache["ttft_s"]["p50"]),
        "ttft_p90_ratio": _ratio(l1_only["ttft_s"]["p90"], hicache["ttft_s"]["p90"]),
        "input_throughput_ratio": _ratio(hicache["throughput"]["input_tokens_per_s"],
                                         l1_only["throughput"]["input_tokens_per_s"]),
    }


def title(res: dict) -> str:
    """One line naming the workload and the cache sizes of a :func:`run_main_job` result."""
    cfg, shape = res["config"], res["config"]["shape"]
    sizes = f"L1 {cfg['l1_tokens']} tokens, L2 {cfg['l2_tokens']}"
    if cfg["workload"] == "agentic":
        return (f"agentic: {shape['num_clients']} sessions x {shape['num_rounds']} turns, "
                f"{shape['system_length']}-token shared prefix, {shape['context_length']}-token "
                f"first prompt, +{shape['request_length']} tool tokens/turn; {sizes}")
    if cfg["workload"] == "multiturn":
        return (f"multiturn: {shape['num_clients']} clients x {shape['num_rounds']} rounds, "
                f"{shape['request_length']} tokens/turn; {sizes}")
    return (f"{cfg['workload']}: first {shape['trace_limit']} requests, "
            f"{shape['trace_block_tokens']} tokens per block, <= {shape['output_length']} output "
            f"tokens; {sizes}")
