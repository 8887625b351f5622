"""``hicache bench convert-trace IN OUT``: a trace as Parquet/Arrow columns, parsed once."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Annotated

import typer

from engine.core.errors import UsageError
from hicache_cli.options import Format
from hicache_cli.output import OutputFormat, emit_json, fail, handle_errors, stdout

Src = Annotated[Path, typer.Argument(help="Trace to read: Mooncake JSONL (plain or .gz), "
                                          "Parquet or Arrow.")]
Dst = Annotated[Path, typer.Argument(help="File to write: .parquet (zstd) or .arrow/.feather "
                                          "(Arrow IPC).")]


def convert_trace(src: Src, dst: Dst, fmt: Format = OutputFormat.human) -> None:
    """Write a trace as columns, so `bench replay` skips JSON parsing on every later run.

    Example: hicache bench convert-trace trace.jsonl.gz trace.parquet
    """
    from engine.loadgen.trace import load_trace
    from engine.loadgen.trace_arrow import SUFFIXES, columnar_kind, write_columnar
    from formats.outpath import OutputPathError, check_output_file

    if columnar_kind(str(dst)) is None:
        raise UsageError(f"{dst}: the output name must end in {', '.join(sorted(SUFFIXES))}")
    if dst.exists() and dst.resolve() == src.resolve():
        raise UsageError(f"{dst}: is the input trace; name another file")
    try:
        check_output_file(dst)             # before parsing, not after
    except OutputPathError as e:
        fail(str(e))
    t0 = time.perf_counter()
    trace = load_trace(str(src))
    parse_s = time.perf_counter() - t0
    write_columnar(trace, str(dst))
    out = {"input": str(src), "output": str(dst), "requests": len(trace),
           "blocks": int(trace.blocks.size), "bytes": os.path.getsize(dst),
           "parse_seconds": round(parse_s, 3)}
    if fmt is OutputFormat.json:
        emit_json(out)
    else:
        stdout.print(f"wrote {out['requests']:,} requests ({out['blocks']:,} blocks) to "
                     f"{dst} ({out['bytes']:,} bytes); parsing {src.name} took "
                     f"{parse_s:.2f} s", markup=False)


def register(bench_app: typer.Typer) -> None:
    bench_app.command("convert-trace")(handle_errors(convert_trace))
