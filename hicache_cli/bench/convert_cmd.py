"""``hicache bench convert-trace IN OUT``: a trace as Parquet/Arrow columns (parsed once) or as
JSONL, optionally annotated with oracle session hints (``--annotate-sessions``)."""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from engine.core.errors import UsageError
from hicache_cli.options import Format
from hicache_cli.output import OutputFormat, emit_json, fail, handle_errors, stdout

Src = Annotated[Path, typer.Argument(help="Trace to read: Mooncake JSONL (plain or .gz), "
                                          "Parquet or Arrow.")]
Dst = Annotated[Path, typer.Argument(help="File to write: .parquet (zstd), .arrow/.feather "
                                          "(Arrow IPC) or .jsonl/.jsonl.gz (Mooncake JSONL).")]
Annotate = Annotated[bool, typer.Option(
    "--annotate-sessions", help="Add oracle session_id / session_end / ttl_s, inferring "
                                "sessions from the hash-id chains.")]
TtlFactor = Annotated[Optional[float], typer.Option(
    "--ttl-factor", help="With --annotate-sessions: each ttl_s is off by a seeded log-uniform "
                         "factor in [1/F, F] (F >= 1; default 1: exact).")]
Seed = Annotated[Optional[int], typer.Option(
    "--seed", help="With --ttl-factor: the seed of the factors (default 0).")]
Reinfer = Annotated[bool, typer.Option(
    "--reinfer", help="With --annotate-sessions: replace the trace's own session ids by the "
                      "inferred ones (default: keep them, and score the inference on them).")]


def _annotate(trace, factor: float, seed: int, reinfer: bool):
    """``trace`` with oracle hints, and what to report about them."""
    import dataclasses

    import numpy as np

    from engine.loadgen.sessions import infer_sessions, link_quality, noisy_ttl, session_hints

    t0 = time.perf_counter()
    inferred = infer_sessions(trace)
    infer_s = time.perf_counter() - t0
    known = trace.sessions is not None
    report: dict = {"sessions_from": "trace" if known and not reinfer else "inferred",
                    "inferred": inferred.stats(), "infer_seconds": round(infer_s, 3)}
    quality = link_quality(trace.sessions, inferred, trace) if known else None
    if known and not reinfer:
        keys = trace.sessions
        ends, gaps = session_hints(trace, keys)
    else:
        keys, ends, gaps = inferred.session, inferred.session_end, inferred.gap_s
    ttl = noisy_ttl(gaps, factor, seed)
    hinted = ~np.isnan(ttl)
    out = dataclasses.replace(trace, sessions=keys, session_ends=ends,
                              ttl_s=ttl if hinted.any() else None)
    report.update({"session_ends": int(ends.sum()), "ttl_hints": int(hinted.sum()),
                   "ttl_factor": factor, "seed": seed})
    return out, report, quality


def convert_trace(src: Src, dst: Dst, annotate: Annotate = False, ttl_factor: TtlFactor = None,
                  seed: Seed = None, reinfer: Reinfer = False,
                  fmt: Format = OutputFormat.human) -> None:
    """Write a trace as columns, so `bench replay` skips JSON parsing on every later run; or as
    JSONL; --annotate-sessions adds oracle session hints.

    Example: hicache bench convert-trace trace.jsonl.gz trace.parquet
    """
    from engine.loadgen.trace import JSONL_SUFFIXES, load_trace, write_jsonl
    from engine.loadgen.trace_arrow import SUFFIXES, columnar_kind, write_columnar
    from formats.outpath import OutputPathError, check_output_file

    jsonl = str(dst).lower().endswith(JSONL_SUFFIXES)
    if columnar_kind(str(dst)) is None and not jsonl:
        raise UsageError(f"{dst}: the output name must end in "
                         f"{', '.join(sorted(SUFFIXES) + list(JSONL_SUFFIXES))}")
    if not annotate and (ttl_factor is not None or seed is not None or reinfer):
        raise UsageError("--ttl-factor, --seed and --reinfer need --annotate-sessions")
    factor = 1.0 if ttl_factor is None else ttl_factor
    if not (math.isfinite(factor) and factor >= 1):
        raise UsageError(f"--ttl-factor {ttl_factor}: must be a finite number >= 1")
    if seed is not None and not 0 <= seed < 1 << 63:
        raise UsageError(f"--seed {seed}: must be an integer in [0, 2**63)")
    if dst.exists() and dst.resolve() == src.resolve():
        raise UsageError(f"{dst}: is the input trace; name another file")
    try:
        check_output_file(dst)             # before parsing, not after
    except OutputPathError as e:
        fail(str(e))
    t0 = time.perf_counter()
    trace = load_trace(str(src))
    parse_s = time.perf_counter() - t0
    report = quality = None
    if annotate:
        trace, report, quality = _annotate(trace, factor, 0 if seed is None else seed, reinfer)
    (write_jsonl if jsonl else write_columnar)(trace, str(dst))
    out = {"input": str(src), "output": str(dst), "requests": len(trace),
           "blocks": int(trace.blocks.size), "bytes": os.path.getsize(dst),
           "parse_seconds": round(parse_s, 3)}
    if report is not None:
        out["annotate"] = report
    if quality is not None:
        out["inference"] = quality
    if fmt is OutputFormat.json:
        emit_json(out)
    else:
        _human(out, src, dst, factor)


def _human(out: dict, src: Path, dst: Path, factor: float) -> None:
    stdout.print(f"wrote {out['requests']:,} requests ({out['blocks']:,} blocks) to "
                 f"{dst} ({out['bytes']:,} bytes); parsing {src.name} took "
                 f"{out['parse_seconds']:.2f} s", markup=False)
    report, quality = out.get("annotate"), out.get("inference")
    if report is not None:
        st = report["inferred"]
        ttl = "exact" if factor == 1 else f"off by up to a factor of {factor:g}, seed " \
                                          f"{report['seed']}"
        stdout.print(f"sessions inferred: {st['sessions']:,} (turns per session mean "
                     f"{st['turns_mean']:.2f}, max {st['turns_max']}; "
                     f"{st['with_predecessor']:.1%} of requests continue an earlier one, "
                     f"{st['branches']:.1%} as a branch from inside its prompt; "
                     f"{report['infer_seconds']:.2f} s); hints from the "
                     f"{report['sessions_from']} sessions: session_end on "
                     f"{report['session_ends']:,} requests, ttl_s ({ttl}) on "
                     f"{report['ttl_hints']:,}", markup=False)
    if quality is not None:
        stdout.print(f"inference against the trace's session ids: link precision "
                     f"{quality['link_precision']:.4f}, recall {quality['link_recall']:.4f}, "
                     f"sessions recovered exactly {quality['sessions_exact']:.4f} (of "
                     f"{quality['true_sessions']:,})", markup=False)


def register(bench_app: typer.Typer) -> None:
    bench_app.command("convert-trace")(handle_errors(convert_trace))
