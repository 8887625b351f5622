"""``hicache bench run``: drive a running server with a workload and report what it saw."""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from engine.core.errors import UsageError
from engine.loadgen.trace import TRACE_BLOCK, trace_workload
from engine.loadgen.workloads import AGENTIC_CPU, AGENTIC_GPU, DEFAULT_VOCAB, Workload, agentic, multiturn
from hicache_cli.bench.run_render import report_rows, report_table, run_with_progress  # noqa: F401 (main job)
from hicache_cli.options import Format, Limit, usage
from hicache_cli.output import OutputFormat, emit_json, fail, handle_errors, stderr, stdout

if TYPE_CHECKING:
    from engine.loadgen.driver import LoadResult

MULTITURN_DEFAULTS = dict(num_clients=8, num_rounds=4, request_length=256, output_length=16)


def build_workload(spec: str, *, num_clients: int | None = None, num_rounds: int | None = None,
                   request_length: int | None = None, output_length: int | None = None,
                   context_length: int | None = None, system_length: int | None = None,
                   speedup: float | None = None, limit: int | None = None,
                   trace_block_tokens: int | None = None, max_tokens: int | None = None,
                   vocab_size: int = DEFAULT_VOCAB, seed: int = 0,
                   server_device: str | None = None) -> Workload:
    """``multiturn`` | ``agentic`` | ``trace:PATH`` plus the options that apply to it; an option
    given for another workload is a usage error (:class:`UsageError`). ``agentic`` sizes default to
    the GPU preset (32K-token contexts), or the CPU preset when ``server_device`` is ``cpu``."""
    conv = dict(num_clients=num_clients, num_rounds=num_rounds, request_length=request_length,
                output_length=output_length)
    agent_only = dict(context_length=context_length, system_length=system_length)
    trace_only = dict(speedup=speedup, limit=limit, trace_block_tokens=trace_block_tokens)

    def reject(opts: dict, kind: str) -> None:
        given = [k for k, v in opts.items() if v is not None]
        if given:
            names = ", ".join("--" + k.replace("_", "-") for k in given)
            raise UsageError(f"{names} does not apply to the {kind} workload")

    if spec.startswith("trace:"):
        path = spec[len("trace:"):]
        if not path:
            raise UsageError("trace workload needs a path: trace:PATH")
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
    raise UsageError(f"unknown workload {spec!r}; choose multiturn, agentic or trace:PATH")


def write_parquet(result: "LoadResult", path: str) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from engine.loadgen.driver import records_as_columns

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


Url = Annotated[str, typer.Option("--url", help="Server base URL.")]
WorkloadOpt = Annotated[str, typer.Option("--workload", "-w", help="multiturn | agentic | trace:PATH "
                                  "(Mooncake JSONL or .gz, or a convert-trace Parquet file).")]
Clients = Annotated[Optional[int], typer.Option(min=1, help="Clients (default: multiturn 8, agentic 4).")]
Rounds = Annotated[Optional[int], typer.Option(min=1, help="Rounds per client (default: multiturn 4, "
                                       "agentic 8, CPU 6).")]
RequestLength = Annotated[Optional[int], typer.Option(min=1, help="New tokens per round (default: "
                                              "multiturn 256; agentic tool output 1024, CPU "
                                              "128).")]
OutputLength = Annotated[Optional[int], typer.Option(min=0, help="Tokens generated per request "
                                             "(default: multiturn 16, agentic 128, CPU 16).")]
ContextLength = Annotated[Optional[int], typer.Option(min=2, help="agentic: first-turn prompt tokens "
                                              "(default 32768; 1536 when the server runs on "
                                              "CPU).")]
SystemLength = Annotated[Optional[int], typer.Option(min=0, help="agentic: prefix shared by all "
                                             "clients (default 4096; CPU 512).")]
Speedup = Annotated[Optional[float], typer.Option(help="trace: replay this many times faster (default "
                                          "1).")]
BlockTokens = Annotated[Optional[int], typer.Option(min=1, max=TRACE_BLOCK, help="trace: tokens per "
                                            "512-token block (scale down for small models).")]
Vocab = Annotated[int, typer.Option(min=2, help="Token ids are drawn below this.")]
Seed = Annotated[int, typer.Option(help="Seed of the generated prompts and arrival times.")]
Concurrency = Annotated[int, typer.Option(min=1, help="Requests in flight at most.")]
Duration = Annotated[Optional[float], typer.Option(help="Stop issuing requests after this many "
                                           "seconds.")]
Rate = Annotated[float, typer.Option(help="Requests per second (Poisson); default: no limit.")]
MaxTokens = Annotated[Optional[int], typer.Option(min=1, help="Cap on tokens generated per request.")]
Stream = Annotated[bool, typer.Option("--stream/--no-stream", help="Stream responses; adds "
                              "client-side TTFT.")]
Timeout = Annotated[float, typer.Option(help="Seconds one request may take.")]
Output = Annotated[Optional[str], typer.Option("--output", "-o", help="Write one row per request to "
                                       "this .parquet file.")]


def run(
    url: Url = "http://127.0.0.1:30000", workload: WorkloadOpt = "multiturn",
    num_clients: Clients = None, num_rounds: Rounds = None,
    request_length: RequestLength = None, output_length: OutputLength = None,
    context_length: ContextLength = None, system_length: SystemLength = None,
    speedup: Speedup = None, limit: Limit = None, trace_block_tokens: BlockTokens = None,
    vocab_size: Vocab = DEFAULT_VOCAB, seed: Seed = 0, concurrency: Concurrency = 8,
    duration: Duration = None, request_rate: Rate = math.inf, max_tokens: MaxTokens = None,
    stream: Stream = False, timeout: Timeout = 600.0, fmt: Format = OutputFormat.human,
    output: Output = None,
) -> None:
    """Send a workload to a running server (hicache bench serve, or SGLang) and report TTFT,
    queue time, throughput and hit rate per cache tier."""
    from engine.loadgen.driver import LoadConfig, server_info
    from engine.loadgen.report import summarize_result

    device = (server_info(url) or {}).get("device") if workload == "agentic" else None
    with usage():                       # the workload's own checks of the option values
        wl = build_workload(workload, num_clients=num_clients, num_rounds=num_rounds,
                            request_length=request_length, output_length=output_length,
                            context_length=context_length, system_length=system_length,
                            speedup=speedup, limit=limit,
                            trace_block_tokens=trace_block_tokens, max_tokens=max_tokens,
                            vocab_size=vocab_size, seed=seed, server_device=device)
    with usage():
        cfg = LoadConfig(url=url, concurrency=concurrency, duration=duration,
                         request_rate=request_rate, max_tokens=max_tokens, stream=stream,
                         timeout=timeout, seed=seed)
    if output:
        check_output_path(output)
    from engine.loadgen import replicas

    workers = [w["url"] for w in replicas.router_workers(cfg.url)]   # [] unless a router
    before = replicas.snapshot(workers)
    result = run_with_progress(wl, cfg)
    rep = summarize_result(result)
    if workers:
        rep["per_replica"] = replicas.per_replica(before, replicas.snapshot(workers))
    if output:
        write_parquet(result, output)
    _report(wl, cfg.url, rep, fmt, output, len(result.records))


def _report(wl: Workload, url: str, rep: dict, fmt: OutputFormat, output: Optional[str],
            rows: int) -> None:
    if fmt is OutputFormat.json:
        emit_json({**rep, "url": url, "output": output})
    else:
        stdout.print(report_table([(wl.name, rep)], title=f"{wl.name} against {url}"))
        if rep.get("per_replica"):
            _print_replicas(rep["per_replica"])
        if rep["first_error"] and rep["requests"]["ok"]:
            stderr.print(f"first error: {rep['first_error']}")
        if output:
            stderr.print(f"wrote {rows} rows to {output}")
    if rows and rep["requests"]["ok"] == 0:
        fail(f"all {rep['requests']['sent']} requests failed ({rep['first_error']})")


def _print_replicas(fig: dict) -> None:
    """Per-replica figures of a run through a router (engine.loadgen.replicas)."""
    for r in fig["replicas"]:
        if r["answered"]:
            stdout.print(f"  {r['url']}: {r['requests']} requests, {r['prompt_tokens']} prompt "
                         f"tokens, {r['computed_tokens']} computed, hit rate "
                         f"{100 * r['hit_rate']:.1f}%", highlight=False)
        else:
            stdout.print(f"  {r['url']}: {r.get('reason', 'no hicache counters')}",
                         highlight=False)
    stdout.print(f"load spread over the replicas (max / mean computed): {fig['load_spread']:.2f}",
                 highlight=False)


def register(app: typer.Typer) -> None:
    app.command("run")(handle_errors(run))
