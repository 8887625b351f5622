"""``hicache bench`` with no sub-command: the all-in-one comparison (``engine.sim.main_job``).

Runs the workload (default: agentic sessions over a long shared context) against an in-process
server with L1 only, then with HiCache (same L1, plus L2 and a file L3), and prints both runs side
by side with the hit rates and how many times lower HiCache's TTFT is.
"""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from engine.loadgen.driver import LoadConfig, LoadResult
from engine.loadgen.workloads import Workload
from engine.sim.fleet_job import DEFAULT_CACHE_THRESHOLD as FLEET_THRESHOLD
from engine.sim.main_job import MainJobConfig, check_config, fitted, run_main_job, title
from hicache_cli.bench.run_cmd import report_table, run_with_progress
from hicache_cli.output import OutputFormat, emit_json, fail, handle_errors, stderr, stdout

D = MainJobConfig
Hints = Annotated[bool, typer.Option("--hints", help="Add a run of HiCache whose clients send "
                                     "cache hints (a retention each turn, a close at the end).")]
HintTrust = Annotated[str, typer.Option(
    "--hint-trust", help="The --hints run's server --hint-trust: always (default: the job's "
    "own clients), earned (as for unknown clients) or off (hints carried, never applied).")]


def main_job(
    ctx: typer.Context,
    workload: str = typer.Option(D.workload, "--workload", "-w",
                                 help="agentic | multiturn | trace:PATH (Mooncake JSONL or .gz)."),
    num_clients: Optional[int] = typer.Option(None, min=1, help="Sessions (default: agentic 4, multiturn 8)."),
    num_rounds: Optional[int] = typer.Option(None, min=1, help="Turns per session (default: agentic 12, multiturn 8)."),
    request_length: Optional[int] = typer.Option(
        None, min=1, help="New tokens per turn: agentic tool output (default 12), multiturn user turn (192)."),
    output_length: Optional[int] = typer.Option(
        None, min=1, help="Tokens generated per request (default: agentic 4, multiturn 8; trace: a cap, default 8)."),
    context_length: Optional[int] = typer.Option(
        None, min=2, help="agentic: first-turn prompt tokens, shared prefix included (default 896)."),
    system_length: Optional[int] = typer.Option(
        None, min=0, help="agentic: prefix shared by every session (default 320)."),
    trace_limit: Optional[int] = typer.Option(None, min=1, help="trace: first N requests (default 256)."),
    trace_block_tokens: Optional[int] = typer.Option(
        None, min=1, help="trace: tokens per 512-token block (default 16, scaled for the tiny model)."),
    concurrency: int = typer.Option(D.concurrency, min=1, help="Requests in flight."),
    l1_tokens: Optional[int] = typer.Option(
        None, min=1, help="L1 (device) size, same in both runs (default 2560; a trace: grown to "
                          "its largest request when that needs more)."),
    l2_tokens: int = typer.Option(D.l2_tokens, min=1, help="L2 (host) size of the HiCache run."),
    storage: bool = typer.Option(D.storage, "--storage/--no-storage",
                                 help="Add a file L3 in a temp dir to the HiCache run."),
    device: str = typer.Option(D.device, help="auto | cpu | cuda[:N]."),
    model: str = typer.Option(D.model, help="Model preset or local checkpoint dir."),
    seed: int = typer.Option(D.seed, help="Seed of the generated prompts."),
    threads: Optional[int] = typer.Option(D.threads, min=1, help="torch intra-op threads for the model."),
    hints: Hints = D.hints, hint_trust: HintTrust = D.hint_trust,
    fmt: OutputFormat = typer.Option(OutputFormat.human, "--format", help="human | json."),
    replicas: Optional[int] = typer.Option(
        None, "--replicas", help="Run the workload through SGLang's router over N HiCache "
                                 "replicas sharing one file L3, once per --router policy."),
    router: str = typer.Option("round_robin,cache_aware", "--router",
                               help="With --replicas: router policies, side by side."),
    cache_threshold: float = typer.Option(
        FLEET_THRESHOLD, "--cache-threshold", min=0.0, max=1.0,
        help="With --replicas: the router's cache_aware match threshold. Default 0.5, not the "
             "router's own 0.3: at 0.3 the default workload's 36% shared prefix sends every "
             "session to one replica (docs/fleet.md)."),
    router_args: str = typer.Option(
        "", "--router-args", help="With --replicas: more sglang-router options, as one string "
                                  "(e.g. '--balance-abs-threshold 8')."),
) -> None:
    """Compare L1 only with HiCache on one workload (embedded server): hit rate, TTFT, rate."""
    if ctx.invoked_subcommand is not None:
        return
    job = MainJobConfig(
        workload=workload, num_clients=num_clients, num_rounds=num_rounds,
        request_length=request_length, output_length=output_length,
        context_length=context_length, system_length=system_length, trace_limit=trace_limit,
        trace_block_tokens=trace_block_tokens, concurrency=concurrency,
        l1_tokens=l1_tokens or D.l1_tokens,
        fit_l1=l1_tokens is None, l2_tokens=l2_tokens, storage=storage,
        device=device, model=model, seed=seed, threads=threads, hints=hints, hint_trust=hint_trust)
    if replicas is not None:
        _fleet_job(job, replicas, [p.strip() for p in router.split(",") if p.strip()], fmt,
                   cache_threshold, router_args)
    else:
        _main_job(job, fmt)


def _with_progress(wl: Workload, lc: LoadConfig, label: str) -> LoadResult:
    return run_with_progress(wl, lc, label=label, show=True)


@handle_errors
def _main_job(cfg: MainJobConfig, fmt: OutputFormat) -> None:
    try:
        check_config(cfg)
    except ValueError as exc:
        fail(str(exc), 2)
    grown = fitted(cfg)
    if grown.l1_tokens != cfg.l1_tokens:
        stderr.print(f"hicache bench: L1 {grown.l1_tokens} tokens, L2 {grown.l2_tokens} (grown "
                     f"from {cfg.l1_tokens} / {cfg.l2_tokens} to fit the trace's largest "
                     f"request)", highlight=False)
    res = run_main_job(grown, _with_progress)
    failed = {k: r["first_error"] for k, r in res["runs"].items() if r["requests"]["failed"]}
    if fmt is OutputFormat.json:
        emit_json(res)
    else:
        _print_human(res)
    if failed:
        fail("requests failed: " + "; ".join(f"{k}: {v}" for k, v in failed.items()))


@handle_errors
def _fleet_job(cfg: MainJobConfig, replicas: int, policies: list[str], fmt: OutputFormat,
               cache_threshold: float, router_args: str) -> None:
    import shlex

    from engine.sim.fleet_job import check_fleet, check_router_args, run_fleet_job

    try:
        check_config(cfg)
        check_fleet(replicas, policies)
        extra = shlex.split(router_args)
        check_router_args(extra)
    except ValueError as exc:
        fail(str(exc), 2)
    res = run_fleet_job(fitted(cfg), replicas, policies, _with_progress, cache_threshold,
                        extra)
    failed = {k: r["first_error"] for k, r in res["runs"].items() if r["requests"]["failed"]}
    for p, r in res["runs"].items():
        if r["router_exit"] is not None:
            stderr.print(f"hicache bench: the {p} router died during its run (exit "
                         f"{r['router_exit']}); its requests after that failed",
                         highlight=False, markup=False)
    if fmt is OutputFormat.json:
        emit_json(res)
    else:
        runs = res["runs"]
        stdout.print(report_table([(p, r) for p, r in runs.items()],
                                  title=f"{replicas} replicas behind SGLang's router, "
                                        f"{res['config']['hicache_tiers']}: {title(res)}"))
        spread = ", ".join(f"{p} {r['replicas']['load_spread']:.2f}" for p, r in runs.items())
        stdout.print(f"load spread (max / mean prompt tokens computed per replica): {spread}; "
                     f"wall {res['wall_s']:.1f} s")
    if failed:
        fail("requests failed: " + "; ".join(f"{k}: {v}" for k, v in failed.items()))


def _times(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def _print_human(res: dict) -> None:
    a, b, c = res["runs"]["l1_only"], res["runs"]["hicache"], res["comparison"]
    tiers = res["config"]["hicache_tiers"]
    rows = [("L1 only", a), (f"HiCache {tiers}", b)]
    if "hicache_hints" in res["runs"]:
        rows.append((f"HiCache {tiers} + hints ({res['config']['hint_trust']})",
                     res["runs"]["hicache_hints"]))
    stdout.print(report_table(rows, title=title(res)))
    pct = [f"{100 * (v or 0):.1f}%" for v in (c["hit_rate_l1_only"], c["hit_rate_hicache"])]
    stdout.print(f"HiCache vs L1 only: hit rate {pct[0]} -> {pct[1]}, "
                 f"TTFT p50 {_times(c['ttft_p50_ratio'])} lower, "
                 f"throughput {_times(c['input_throughput_ratio'])} (input tokens/s); "
                 f"wall {res['wall_s']:.1f} s (CPU {res['cpu_s']:.1f} s)")
    h = c.get("hints")
    if h is not None:
        pct = [f"{100 * (v or 0):.1f}%" for v in (h["l1_hit_rate_hicache"], h["l1_hit_rate_hints"],
                                                 h["hit_rate_hicache"], h["hit_rate_hints"])]
        stdout.print(f"hints vs none: L1 hit rate {pct[0]} -> {pct[1]} (all tiers {pct[2]} -> "
                     f"{pct[3]}), TTFT p50 {_times(h['ttft_p50_ratio'])} lower, p90 "
                     f"{_times(h['ttft_p90_ratio'])}; {h['hints_applied']} of "
                     f"{h['hints_sent']} hints applied (--hint-trust "
                     f"{res['config']['hint_trust']})")


def register(app: typer.Typer) -> None:
    app.callback(invoke_without_command=True)(main_job)
