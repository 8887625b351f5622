"""``hicache bench replay TRACE``: offline, trace-driven simulation of the cache stack.

Options are read and checked here; the runs are the library's (``engine.sim``: replay_run,
sweep, replay_ranks) and the output is :mod:`hicache_cli.bench.replay_render`'s.
"""

from __future__ import annotations

import enum
import os
from pathlib import Path
from typing import Annotated, Optional

import typer

from engine.cache.policy import PolicyName
from engine.cache.types import WritePolicy
from engine.core.errors import UsageError
from hicache_cli.bench import fleet_cmd
from hicache_cli.bench import replay_render as render
from hicache_cli.options import (
    DistInitAddr,
    Format,
    InjectDivergence,
    L1Tokens,
    L2Tokens,
    L3Tokens,
    Limit,
    NNodes,
    NodeRank,
    PageSize,
    Policy,
    Progress,
    RankLogDir,
    WritePolicyOpt,
    policy_list,
    token_counts,
    usage,
)
from hicache_cli.output import (
    EXIT_CHECK,
    OutputFormat,
    emit_json,
    fail,
    handle_errors,
    stderr,
    stdout,
)

Trace = Annotated[Path, typer.Argument(help="Mooncake JSONL trace (plain or .gz: timestamp, "
                                            "input_length, output_length, hash_ids), or the "
                                            "Parquet/Arrow file `hicache bench convert-trace` "
                                            "writes.")]
Sweep = Annotated[bool, typer.Option("--sweep", help="Sweep L1 capacity for the eviction "
                                                     "policies (L2 off) instead of one run, on "
                                                     "all cores.")]
Policies = Annotated[Optional[str], typer.Option(
    "--policies", help="With --sweep: any registered policies, e.g. 'lru,opt' (default: all "
                       "but priority, which a trace cannot drive).")]
Jobs = Annotated[Optional[int], typer.Option("--jobs", min=1, help="With --sweep: worker "
                                                                   "processes (default: one per "
                                                                   "core).")]
Capacities = Annotated[Optional[str], typer.Option(
    "--capacities", help="Sweep points, e.g. '640k,1.28m,2.56m' (default: --l1-tokens x 1/8 "
                         "… 4).")]
Plot = Annotated[Optional[Path], typer.Option("--plot", help="With --sweep: write a PNG of hit "
                                                             "rate vs capacity.")]
DumpTree = Annotated[Optional[Path], typer.Option(
    "--dump-tree", help="Write a tree snapshot (for `hicache inspect`) at the end; with "
                        "--ranks, a directory with one per rank.")]
Rank = Annotated[int, typer.Option("--rank", min=0, help="Rank number written into the rank "
                                                         "log header (replays standing in for "
                                                         "the ranks of one replica).")]
WorldSize = Annotated[int, typer.Option("--world-size", min=1,
                                        help="World size for the rank log header.")]
Ranks = Annotated[int, typer.Option("--ranks", help="Replay as N real ranks (processes "
                                                           "over torch.distributed gloo) of one "
                                                           "replica.")]
Consensus = Annotated[bool, typer.Option(
    "--enable-rank-consensus", help="With --ranks: compare the ranks' decisions online and stop "
                                    "at the first divergence (logs go to --rank-log-dir).")]
ConsensusEvery = Annotated[int, typer.Option("--consensus-every", min=1, help="Compare every N "
                                             "requests (online consensus).")]
Cp = Annotated[int, typer.Option("--cp", min=1, help="Context-parallel ranks of the replica; "
                                 "--l1-tokens/--l2-tokens are then per-rank budgets.")]
CpKv = Annotated[str, typer.Option("--cp-kv", help="With --cp N: 'sharded' (each KV page on "
                                   "one owner rank) or 'replicated' (device KV on every rank, "
                                   "host pool deduplicated across ranks).")]
class HintsMode(str, enum.Enum):
    off = "off"
    on = "on"
    session_end = "session-end"
    ttl = "ttl"
    compare = "compare"


Hints = Annotated[HintsMode, typer.Option(
    "--hints", help="Send the trace's client hints (session_id, session_end, ttl_s: see "
                    "`convert-trace --annotate-sessions`) with its requests: 'on' (all it "
                    "carries, over --policy), one signal ('session-end', 'ttl'), or 'compare' "
                    "(with --sweep: --policy, density, each signal and opt, with the share of "
                    "the LRU-to-opt gap each closes).")]
NoEvents = Annotated[bool, typer.Option("--no-events", help="Do not record cache decision "
                                                            "events (to measure their "
                                                            "overhead).")]


def replay_cmd(
    trace: Trace, page_size: PageSize = 64, l1_tokens: L1Tokens = 5_120_000,
    l2_tokens: L2Tokens = 0, l3_tokens: L3Tokens = 0, policy: Policy = PolicyName.lru,
    write_policy: WritePolicyOpt = WritePolicy.WRITE_THROUGH, limit: Limit = None,
    sweep: Sweep = False, policies: Policies = None, jobs: Jobs = None,
    capacities: Capacities = None, plot: Plot = None, dump_tree: DumpTree = None,
    rank_log_dir: RankLogDir = None, rank: Rank = 0, world_size: WorldSize = 1,
    inject_divergence: InjectDivergence = None, ranks: Ranks = 1,
    enable_rank_consensus: Consensus = False, consensus_every: ConsensusEvery = 16,
    nnodes: NNodes = 1, node_rank: NodeRank = 0, dist_init_addr: DistInitAddr = None,
    cp: Cp = 1, cp_kv: CpKv = "sharded", no_events: NoEvents = False,
    hints: Hints = HintsMode.off,
    fmt: Format = OutputFormat.human, progress: Progress = False,
    replicas: fleet_cmd.Replicas = 1, router: fleet_cmd.Router = None,
    cache_threshold: fleet_cmd.CacheThreshold = 0.3,
    balance_abs_threshold: fleet_cmd.BalanceAbs = 64,
    balance_rel_threshold: fleet_cmd.BalanceRel = 1.5,
    max_tree_size: fleet_cmd.MaxTree = 1 << 26,
) -> None:
    """Replay a trace through the cache stack (metadata only) and report hit rates.

    Example: hicache bench replay trace.jsonl.gz --page-size 64 --l1-tokens 5120000
    """
    from engine.parallel.divergence import parse_spec
    from engine.sim.replay import ReplayConfig

    multi = ranks > 1 or enable_rank_consensus
    _check_tiers(page_size, l1_tokens, l2_tokens, l3_tokens, cp, cp_kv, sweep)
    _check_modes(sweep, multi, plot, policies, jobs, ranks, cp, rank, world_size)
    _check_outputs(plot, dump_tree, rank_log_dir, multi)
    _check_hints(hints, sweep, multi or replicas > 1 or router is not None, policies)
    if inject_divergence:
        with usage("--inject-divergence"):
            parse_spec(inject_divergence)
    cfg = ReplayConfig(page_size=page_size, l1_tokens=l1_tokens, l2_tokens=l2_tokens,
                       l3_tokens=l3_tokens, policy=policy.value,
                       write_policy=write_policy.value, limit=limit,
                       events=not no_events, cp_size=cp, cp_kv=cp_kv,
                       hints="off" if hints is HintsMode.compare else hints.value)
    show = fmt is OutputFormat.human or progress
    if replicas > 1 or router is not None:     # a fleet: engine.sim.fleet
        if multi or rank_log_dir or dump_tree or inject_divergence or capacities or policies \
                or jobs:
            raise UsageError("--replicas does not combine with --ranks, --rank-log-dir, "
                             "--dump-tree, --inject-divergence, --capacities, --policies or "
                             "--jobs")
        fleet_cmd.run(trace, cfg, replicas, router, sweep, plot, fmt,
                      (cache_threshold, balance_abs_threshold, balance_rel_threshold,
                       max_tree_size))
    elif multi:
        nodes = _check_nodes(ranks, nnodes, node_rank, dist_init_addr)
        _multi_rank(trace, ranks, cfg, rank_log_dir, consensus_every if enable_rank_consensus
                    else 0, inject_divergence, fmt, dump_tree, nodes)
    elif sweep:
        _sweep(trace, cfg, capacities, policies, jobs, plot, fmt, show,
               hints is HintsMode.compare)
    else:
        _single(trace, cfg, rank, world_size, rank_log_dir, dump_tree, inject_divergence,
                fmt, show)


MAX_REPLAY_CP = 64


def _check_tiers(page_size: int, l1: int, l2: int, l3: int, cp: int, cp_kv: str,
                 sweep: bool) -> None:
    from engine.sim.replay import CP_KV

    if l3 and not l2:
        raise UsageError("--l3-tokens needs --l2-tokens > 0 (L3 pages are staged through L2)")
    if l1 < page_size:
        raise UsageError(f"--l1-tokens {l1} holds no page of {page_size} tokens")
    if cp_kv not in CP_KV:
        raise UsageError(f"--cp-kv must be one of {list(CP_KV)}, got {cp_kv!r}")
    if cp > MAX_REPLAY_CP:      # the budgets are per rank: --cp multiplies the metadata
        raise UsageError(f"--cp must be 1..{MAX_REPLAY_CP} (the simulated ranks of one "
                         f"replica), got {cp:,}")
    if cp > 1 and sweep:
        raise UsageError("--cp does not combine with --sweep")
    if cp > 1 and cp_kv == "sharded" and l3:
        raise UsageError("--cp with --cp-kv sharded does not simulate an L3 tier (drop "
                         "--l3-tokens)")


def _check_modes(sweep: bool, multi: bool, plot: Optional[Path], policies: Optional[str],
                 jobs: Optional[int], ranks: int, cp: int, rank: int, world_size: int) -> None:
    from engine.core.device import max_local_ranks

    if not sweep and (plot is not None or policies is not None or jobs is not None):
        raise UsageError("--plot, --policies and --jobs need --sweep")
    if multi and sweep:
        raise UsageError("--ranks does not combine with --sweep")
    if multi and cp > 1 and ranks != cp:
        raise UsageError(f"with --cp {cp}, --ranks stands for the CP ranks: give --ranks {cp}")
    if ranks < 1:
        raise UsageError(f"--ranks must be >= 1, got {ranks}")
    cap, why = max_local_ranks()
    if ranks > cap:
        raise UsageError(f"--ranks {ranks}: this machine can run at most {cap} ranks ({why})")
    if rank >= world_size:
        raise UsageError(f"--rank must be in [0, --world-size), got rank {rank} of "
                         f"{world_size}")


def _check_hints(hints: HintsMode, sweep: bool, multi: bool, policies: Optional[str]) -> None:
    if hints is HintsMode.off:
        return
    if multi:
        raise UsageError("--hints does not combine with --ranks, --replicas or --router")
    if hints is HintsMode.compare and not sweep:
        raise UsageError("--hints compare needs --sweep")
    if hints is HintsMode.compare and policies is not None:
        raise UsageError("--hints compare chooses the policies itself (drop --policies)")


def _need_hints(inp, trace: Path, signals: set[str]) -> None:
    """A hinted run over a trace that carries no session keys would be the plain policy."""
    for s in signals - {"off"}:
        if not inp.hints(s).sessions:
            fail(f"{trace}: no request carries a session key (session_id), so there are no "
                 f"hints to send; add oracle ones with `hicache bench convert-trace "
                 f"--annotate-sessions`")


def _check_nodes(ranks: int, nnodes: int, node_rank: int, addr: Optional[str]) -> tuple:
    """(nnodes, node_rank, HOST:PORT or None) after the usage checks."""
    from engine.parallel.launch import check_nodes

    with usage():
        check_nodes(ranks, nnodes, node_rank, addr, f"--ranks {ranks}")
    return nnodes, node_rank, addr


def _check_outputs(plot: Optional[Path], dump_tree: Optional[Path],
                   rank_log_dir: Optional[Path], multi: bool) -> None:
    """Fail before the replay, not after it, when an output path cannot be written (the
    rule of :mod:`formats.outpath`: never a device/FIFO, through symlinks, writable)."""
    from formats.outpath import OutputPathError, check_output_dir, check_output_file

    for flag, path, directory in (("--plot", plot, False), ("--dump-tree", dump_tree, multi),
                                  ("--rank-log-dir", rank_log_dir, True)):
        if path is None:
            continue
        try:
            if directory:
                check_output_dir(path, create=False)
            else:
                check_output_file(path)
        except OutputPathError as e:
            fail(f"{flag} {e}")


def _load(trace: Path, limit: Optional[int]):
    from engine.loadgen.trace import load_trace
    from engine.sim.replay import ReplayInput

    return ReplayInput(load_trace(str(trace), limit))


def _memory(cfg, caps: list[int]) -> str:
    pages = (max(caps) + cfg.l2_tokens) // cfg.page_size
    return (f"not enough memory for the metadata of {pages:,} pages (L1 {max(caps):,} + "
            f"L2 {cfg.l2_tokens:,} tokens, page size {cfg.page_size}); use smaller tiers")


def _single(trace: Path, cfg, rank: int, world_size: int, rank_log_dir: Optional[Path],
            dump_tree: Optional[Path], inject: Optional[str], fmt: OutputFormat,
            show: bool) -> None:
    from engine.sim.replay_run import ReplayRun, run_replay

    inp = _load(trace, cfg.limit)
    _need_hints(inp, trace, {cfg.hints})
    run = ReplayRun(str(trace), cfg, rank, world_size,
                    str(rank_log_dir) if rank_log_dir else None,
                    str(dump_tree) if dump_tree else None, inject)
    try:
        with render.request_bar(len(inp), show) as tick:
            out = run_replay(inp, run, progress=tick)
    except MemoryError:
        fail(_memory(cfg, [cfg.l1_tokens]))
    if fmt is OutputFormat.json:
        emit_json(out)
    else:
        render.print_result(out)


def _sweep(trace: Path, cfg, capacities: Optional[str], policies: Optional[str],
           jobs: Optional[int], plot: Optional[Path], fmt: OutputFormat, show: bool,
           compare: bool = False) -> None:
    from engine.sim.sweep import (
        compare_labels,
        default_capacities,
        default_policies,
        gap_closed,
        run_sweep,
        sweep_points,
    )

    p = cfg.page_size
    caps = (token_counts("--capacities", capacities) if capacities
            else default_capacities(cfg.l1_tokens, p))
    small = [c for c in caps if c < p]
    if small:
        raise UsageError(f"--capacities: {small[0]} tokens hold no page of {p} tokens")
    names = (compare_labels(cfg.policy) if compare else policy_list("--policies", policies)
             if policies is not None else default_policies())
    with usage("--policies"):
        points = sweep_points(names, caps, cfg.hints)
    inp = _load(trace, cfg.limit)
    _need_hints(inp, trace, {pt.hints for pt in points})
    try:
        with render.point_bar(len(points), show) as done:
            rows = [r.to_dict() for r in run_sweep(inp, points, p, jobs=jobs, on_point=done)]
    except MemoryError:
        fail(_memory(cfg, caps))
    base = cfg.policy if cfg.policy != "opt" else "lru"
    for (label, cap), share in gap_closed(rows, base).items():
        for r in rows:
            if r["policy"] == label and r["l1_tokens"] == cap:
                r["gap_closed"] = round(share, 4)
    if plot is not None:
        render.plot(rows, plot, os.path.basename(str(trace)), p)
    if fmt is OutputFormat.json:
        emit_json({"trace": str(trace), "requests": len(inp), "page_size": p, "sweep": rows,
                   "plot": str(plot) if plot else None})
    else:
        render.print_sweep(rows, base)
        if plot is not None:
            stdout.print(f"plot written to {plot}")


def _multi_rank(trace: Path, ranks: int, cfg, rank_log_dir: Optional[Path], every: int,
                inject: Optional[str], fmt: OutputFormat, dump_dir: Optional[Path],
                nodes: tuple = (1, 0, None)) -> None:
    from engine.loadgen.trace import load_trace
    from engine.sim.replay_ranks import RankRun, replay_ranks, summarize_ranks

    load_trace(str(trace), cfg.limit)        # fail fast, in this process, on a bad trace
    if every and rank_log_dir is None:
        raise UsageError("--enable-rank-consensus needs --rank-log-dir (where logs go on "
                         "divergence)")
    stderr.print(f"replaying on {ranks} rank{'' if ranks == 1 else 's'} (gloo)"
                 f"{' with online consensus' if every else ''}")
    run = RankRun(str(trace), cfg, ranks, str(rank_log_dir) if rank_log_dir else None, every,
                  inject, str(dump_dir) if dump_dir else None, *nodes)
    try:
        out = summarize_ranks(run, replay_ranks(run))
    except RuntimeError as exc:
        fail(str(exc))
    if fmt is OutputFormat.json:
        emit_json(out)
    else:
        render.print_ranks(out, rank_log_dir)
    if "consensus_error" in out:
        raise typer.Exit(EXIT_CHECK)


def register(bench_app: typer.Typer) -> None:
    bench_app.command("replay")(handle_errors(replay_cmd))
