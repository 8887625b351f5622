"""``hicache bench convert-trace IN OUT``: a trace as Parquet/Arrow columns, parsed once."""

from __future__ import annotations

import os
import time
from pathlib import Path

import typer

from hicache_cli.output import OutputFormat, emit_json, fail, handle_errors, stdout


def register(bench_app: typer.Typer) -> None:
    @bench_app.command("convert-trace")
    @handle_errors
    def convert_trace(
        src: Path = typer.Argument(..., help="Trace to read: Mooncake JSONL (plain or .gz), "
                                   "Parquet or Arrow."),
        dst: Path = typer.Argument(..., help="File to write: .parquet (zstd) or .arrow/"
                                   ".feather (Arrow IPC)."),
        fmt: OutputFormat = typer.Option(OutputFormat.human, "--format", help="human or json."),
    ) -> None:
        """Write a trace as columns, so `bench replay` skips JSON parsing on every later run.

        Example: hicache bench convert-trace trace.jsonl.gz trace.parquet
        """
        from engine.loadgen.trace import load_trace
        from engine.loadgen.trace_arrow import SUFFIXES, columnar_kind, write_columnar

        if columnar_kind(str(dst)) is None:
            fail(f"{dst}: the output name must end in {', '.join(sorted(SUFFIXES))}", code=2)
        if dst.is_dir():
            fail(f"{dst}: is a directory, expected a file name")
        if not dst.parent.is_dir():
            fail(f"{dst}: directory {dst.parent} does not exist")
        if dst.exists() and dst.resolve() == src.resolve():
            fail(f"{dst}: is the input trace; name another file", code=2)
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
