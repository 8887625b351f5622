"""``hicache bench run``: drive a running server with a workload and report what it saw."""

from __future__ import annotations

import math
import os
from typing import Optional

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from engine.loadgen.driver import (
    LoadConfig,
    LoadResult,
    RequestRecord,
    records_as_columns,
    run_load,
    server_info,
)
from engine.loadgen.report import TIERS, summarize_result
from engine.loadgen.trace import TRACE_BLOCK, trace_workload
from engine.loadgen.workloads import AGENTIC_CPU, AGENTIC_GPU, DEFAULT_VOCAB, Workload, agentic, multiturn
from hicache_cli.output import OutputFormat, emit_json, fail, handle_errors, stderr, stdout

MULTITURN_DEFAULTS = dict(num_clients=8, num_rounds=4, request_length=256, output_length=16)


def build_workload(spec: str, *, num_clients: int | None = None, num_rounds: int | None = None,
                   request_length: int | None = None, output_length: int | None = None,
                   context_length: int | None = None, system_length: int | None = None,
                   speedup: float | None = None, limit: int | None = None,
                   trace_block_tokens: int | None = None, max_tokens: int | None = None,
                   vocab_size: int = DEFAULT_VOCAB, seed: int = 0,
                   server_device: str | None = None) -> Workload:
    """``multiturn`` | ``agentic`` | ``trace:PATH`` plus the options that apply to it; an option
    given for another workload is a usage error (``ValueError``). ``agentic`` sizes default to
    the GPU preset (32K-token contexts), or the CPU preset when ``server_device`` is ``cpu``."""
    conv = dict(num_clients=num_clients, num_rounds=num_rounds, request_length=request_length,
                output_length=output_length)
    agent_only = dict(context_length=context_length, system_length=system_length)
    trace_only = dict(speedup=speedup, limit=limit, trace_block_tokens=trace_block_tokens)

    def reject(opts: dict, kind: str) -> None:
        given = [k for k, v in opts.items() if v is not None]
        if given:
            names = ", ".join("--" + k.replace("_", "-") for k in given)
            raise ValueError(f"{names} does not apply to the {kind} workload")

    if spec.startswith("trace:"):
        path = spec[len("trace:"):]
        if not path:
            raise ValueError("trace workload needs a path: trace:PATH")
        reject({**conv, **agent_only}, "trace")
        return trace_workload(path, speedup=1.0 if speedup is None else speedup, limit=limit,
                              block_tokens_n=TRACE_BLOCK if trace_block_tokens is None
                              else trace_block_tokens,
                              vocab_size=vocab_size, max_tokens=max_tokens)
    given = {k: v for k, v in conv.items() if v is not None}
    if spec == "multiturn":
        reject({**agent_only, **trace_only}, "multiturn")
        return multiturn(**{**MULTITURN_DEFAULTS, **given}, vocab_size=vocab_size, seed=seed)
    if spec == "agentic":
        reject(trace_only, "agentic")
        given.update({k: v for k, v in agent_only.items() if v is not None})
        preset = AGENTIC_CPU if server_device == "cpu" else AGENTIC_GPU
        return agentic(**{**preset, **given}, vocab_size=vocab_size, seed=seed)
    raise ValueError(f"unknown workload {spec!r}; choose multiturn, agentic or trace:PATH")


def run_with_progress(workload: Workload, cfg: LoadConfig, *, label: str = "",
                      show: bool = True) -> LoadResult:
    """``run_load`` with a rich progress bar on stderr (drawn only when stderr is a terminal)."""
    progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(),
                        MofNCompleteColumn(), TextColumn("{task.fields[errs]} errors"),
                        TimeElapsedColumn(), console=stderr, transient=True,
                        disable=not (show and stderr.is_terminal))
    with progress:
        task = progress.add_task(label or workload.name, total=workload.total_requests, errs=0)
        errs = 0

        def on_record(rec: RequestRecord) -> None:
            nonlocal errs
            errs += not rec.ok
            progress.update(task, advance=1, errs=errs)

        return run_load(workload, cfg, on_record=on_record)


def write_parquet(result: LoadResult, path: str) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    cols = records_as_columns(result.records)
    table = pa.table({"workload": [result.workload] * len(result.records), **cols})
    from formats.outpath import atomic_output

    with atomic_output(path) as f:
        pq.write_table(table, f)


def check_output_path(path: str) -> None:
    """Fail before the run, not after it, when ``--output`` could not be written (the rule
    of :mod:`formats.outpath`: never a device/FIFO/directory, through symlinks, writable)."""
    from formats.outpath import OutputPathError, check_output_file

    if os.path.isdir(path):
        fail(f"--output {path} is a directory; give a file name such as run.parquet")
    try:
        check_output_file(path)
    except OutputPathError as e:
        fail(f"--output {e}")


def _fmt_s(v: float | None) -> str:
    if v is None or not math.isfinite(v):
        return "-"
    return f"{v * 1000:.0f} ms" if v < 1 else f"{v:.2f} s"


def _fmt_pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def report_rows(rep: dict) -> list[tuple[str, str]]:
    """The human rows of one report (shared by ``bench run`` and the ``bench`` main job)."""
    req = rep["requests"]
    thr = rep["throughput"]
    rows = [
        ("requests ok / sent", f"{req['ok']} / {req['sent']}"),
        ("errors", ", ".join(f"{k}: {v}" for k, v in rep["errors_by_status"].items()) or "none"),
        ("duration", f"{rep['duration_s']:.1f} s"),
    ]
    for t in TIERS:
        rows.append((f"hit rate {t}", _fmt_pct(rep["hit_rate"][t])))
    rows.append(("hit rate total", _fmt_pct(rep["hit_rate"]["total"])))
    for p in ("p50", "p90", "p99"):
        rows.append((f"TTFT {p}", _fmt_s(rep["ttft_s"][p])))
    rows += [
        ("queue time p50 / p99",
         f"{_fmt_s(rep['queue_time_s']['p50'])} / {_fmt_s(rep['queue_time_s']['p99'])}"),
        ("latency p50 / p99",
         f"{_fmt_s(rep['e2e_latency_s']['p50'])} / {_fmt_s(rep['e2e_latency_s']['p99'])}"),
        ("throughput", f"{thr['requests_per_s']:.2f} req/s"),
        ("input tokens/s", f"{thr['input_tokens_per_s']:.0f}"),
        ("output tokens/s", f"{thr['output_tokens_per_s']:.0f}"),
    ]
    if rep.get("tokens_per_target_step") is not None:     # speculative decoding on the server
        rows.append(("tokens / target step", f"{rep['tokens_per_target_step']:.2f}"))
    pd = rep.get("pd_transfer")
    if pd is not None:                     # P/D disaggregated server: the link's audit
        rows += [("P/D prompt tokens decode-reused",
                  f"{pd['decode_device'] + pd['decode_host'] + pd['decode_storage']}"),
                 ("P/D tokens transferred", f"{pd['transferred']}"),
                 ("P/D bytes on the link", f"{pd['bytes'] / 2**20:.2f} MiB"),
                 ("P/D redundant bytes", f"{pd['redundant_bytes']}")]
    return rows


def report_table(columns: list[tuple[str, dict]], title: str | None = None) -> Table:
    table = Table(title=title, title_justify="left", show_edge=False)
    table.add_column("")
    for name, _ in columns:
        table.add_column(name, justify="right")
    rows = [report_rows(rep) for _, rep in columns]
    for i, (label, _) in enumerate(rows[0]):
        table.add_row(label, *(r[i][1] for r in rows))
    return table


def register(app: typer.Typer) -> None:
    @app.command("run")
    @handle_errors
    def run(
        url: str = typer.Option("http://127.0.0.1:30000", "--url", help="Server base URL."),
        workload: str = typer.Option("multiturn", "--workload", "-w",
                                     help="multiturn | agentic | trace:PATH (Mooncake JSONL or .gz)."),
        num_clients: Optional[int] = typer.Option(None, min=1, help="Clients (default: multiturn 8, agentic 4)."),
        num_rounds: Optional[int] = typer.Option(
            None, min=1, help="Rounds per client (default: multiturn 4, agentic 8, CPU 6)."),
        request_length: Optional[int] = typer.Option(
            None, min=1, help="New tokens per round (default: multiturn 256; agentic tool output 1024, CPU 128)."),
        output_length: Optional[int] = typer.Option(
            None, min=0, help="Tokens generated per request (default: multiturn 16, agentic 128, CPU 16)."),
        context_length: Optional[int] = typer.Option(
            None, min=2, help="agentic: first-turn prompt tokens (default 32768; 1536 when the server runs on CPU)."),
        system_length: Optional[int] = typer.Option(
            None, min=0, help="agentic: prefix shared by all clients (default 4096; CPU 512)."),
        speedup: Optional[float] = typer.Option(None, help="trace: replay this many times faster (default 1)."),
        limit: Optional[int] = typer.Option(None, min=1, help="trace: first N requests only."),
        trace_block_tokens: Optional[int] = typer.Option(
            None, min=1, max=TRACE_BLOCK, help="trace: tokens per 512-token block (scale down for small models)."),
        vocab_size: int = typer.Option(DEFAULT_VOCAB, min=2, help="Token ids are drawn below this."),
        seed: int = typer.Option(0, help="Seed of the generated prompts and arrival times."),
        concurrency: int = typer.Option(8, min=1, help="Requests in flight at most."),
        duration: Optional[float] = typer.Option(None, help="Stop issuing requests after this many seconds."),
        request_rate: float = typer.Option(math.inf, help="Requests per second (Poisson); default: no limit."),
        max_tokens: Optional[int] = typer.Option(None, min=1, help="Cap on tokens generated per request."),
        stream: bool = typer.Option(False, "--stream/--no-stream", help="Stream responses; adds client-side TTFT."),
        timeout: float = typer.Option(600.0, help="Seconds one request may take."),
        fmt: OutputFormat = typer.Option(OutputFormat.human, "--format", help="human | json."),
        output: Optional[str] = typer.Option(
            None, "--output", "-o", help="Write one row per request to this .parquet file."),
    ) -> None:
        """Send a workload to a running server (hicache bench serve, or SGLang) and report TTFT,
        queue time, throughput and hit rate per cache tier."""
        try:
            device = (server_info(url) or {}).get("device") if workload == "agentic" else None
            wl = build_workload(workload, num_clients=num_clients, num_rounds=num_rounds,
                                request_length=request_length, output_length=output_length,
                                context_length=context_length, system_length=system_length,
                                speedup=speedup, limit=limit, trace_block_tokens=trace_block_tokens,
                                max_tokens=max_tokens, vocab_size=vocab_size, seed=seed,
                                server_device=device)
            cfg = LoadConfig(url=url, concurrency=concurrency, duration=duration,
                             request_rate=request_rate, max_tokens=max_tokens, stream=stream,
                             timeout=timeout, seed=seed)
        except ValueError as exc:
            fail(str(exc), 2)
        if output:
            check_output_path(output)
        result = run_with_progress(wl, cfg)
        rep = summarize_result(result)
        if output:
            write_parquet(result, output)
        if fmt is OutputFormat.json:
            emit_json({**rep, "url": cfg.url, "output": output})
        else:
            stdout.print(report_table([(wl.name, rep)], title=f"{wl.name} against {cfg.url}"))
            if rep["first_error"] and rep["requests"]["ok"]:
                stderr.print(f"first error: {rep['first_error']}")
            if output:
                stderr.print(f"wrote {len(result.records)} rows to {output}")
        if result.records and rep["requests"]["ok"] == 0:
            fail(f"all {rep['requests']['sent']} requests failed ({rep['first_error']})")
