"""What ``hicache bench run`` (and the ``bench`` main job) show: the progress bar of a run and
the report table. No load generation lives here."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from hicache_cli.output import stderr

if TYPE_CHECKING:  # the driver loads the HTTP client: only when a run starts
    from engine.loadgen.driver import LoadConfig, LoadResult, RequestRecord
    from engine.loadgen.workloads import Workload


PROGRESS_EVERY_S = 10.0
"""Without a terminal (a pipe, a log file, CI): one progress line on stderr at most this often."""


def run_with_progress(workload: Workload, cfg: LoadConfig, *, label: str = "",
                      show: bool = True, every_s: float = PROGRESS_EVERY_S) -> LoadResult:
    """``run_load`` with a rich progress bar on stderr when stderr is a terminal, else a plain
    line (``LABEL: N/TOTAL requests, E errors, T s``) every ``every_s`` seconds, so a long run
    piped to a file still says it is alive."""
    import time

    from engine.loadgen.driver import run_load

    bar = show and stderr.is_terminal
    progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(),
                        MofNCompleteColumn(), TextColumn("{task.fields[errs]} errors"),
                        TimeElapsedColumn(), console=stderr, transient=True, disable=not bar)
    name = label or workload.name
    total = workload.total_requests
    t0 = time.monotonic()
    last = t0
    with progress:
        task = progress.add_task(name, total=total, errs=0)
        errs = done = 0

        def on_record(rec: RequestRecord) -> None:
            nonlocal errs, done, last
            errs += not rec.ok
            done += 1
            progress.update(task, advance=1, errs=errs)
            now = time.monotonic()
            if show and not bar and now - last >= every_s:
                last = now
                of = f"/{total}" if total else ""
                stderr.print(f"{name}: {done}{of} requests, {errs} errors, {now - t0:.0f} s",
                             highlight=False, markup=False)

        return run_load(workload, cfg, on_record=on_record)


def _fmt_s(v: float | None) -> str:
    if v is None or not math.isfinite(v):
        return "-"
    return f"{v * 1000:.0f} ms" if v < 1 else f"{v:.2f} s"


def _fmt_pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def report_rows(rep: dict) -> list[tuple[str, str]]:
    """The human rows of one report (shared by ``bench run`` and the ``bench`` main job)."""
    from engine.loadgen.report import TIERS

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
