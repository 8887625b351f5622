"""``hicache convert-layout SRC DST``: convert an L3 store at rest between layouts.

The work is done by :mod:`engine.storage.convert`; this module parses options, draws the
progress bar and renders the summary. Exit codes: 0 converted (corrupt source objects are
skipped and counted), 1 error (missing store, mixed layouts, conflicting destination, no room,
interrupted), 2 usage (unknown layout strings, shapes the model cannot take, DST inside SRC),
3 ``--verify`` found written objects that do not hold the source's KV.
"""

from __future__ import annotations

from typing import Any, Optional

import typer

from hicache_cli.options import Format, usage
from hicache_cli.output import (
    EXIT_CHECK,
    EXIT_ERROR,
    OutputFormat,
    emit_json,
    fail,
    handle_errors,
    stderr,
    stdout,
)

HELP = """Convert an L3 store at rest: legacy per-rank -> unified, one unified grid to another,
layer_first <-> page_first payloads; SGLang's own file stores (sglang-file:DIR?geometry) to and
from any of them.

SRC and DST are file-store directories or
mooncake://HOST:PORT[?metadata=URL&admin=PORT&timeout=SECONDS] addresses. The source's
layout is read from its objects; the source is never modified, and DST may not lie inside it.
Objects already in DST are checked and skipped, so an interrupted run resumes. --verify
decodes every target object and compares each KV element with the source's (exit 3 if any
differs).

Examples:
  hicache convert-layout /data/old-store /data/store --to unified
  hicache convert-layout /data/store /data/store8 --to unified:layers=8,heads=2 --verify
  hicache convert-layout /data/store mooncake://10.0.0.1:50051 --dry-run
  hicache convert-layout --scan 'sglang-file:/data/sglang'
  hicache convert-layout 'sglang-file:/data/sglang?model=M&layers=32&kv_heads=8&head_dim=128\
&dtype=bf16&page_size=64&layout=page_first&tp=2' 'sglang-file:/data/sglang-tp1?tp=1' --verify
"""


def _mb(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{n:,.0f} B"


def _human_plan(s: dict[str, Any], title: str) -> None:
    stdout.print(f"{title}: {s['source_layout']} -> {s['target_layout']}")
    stdout.print(f"  model tag: {s['model_tag']} (kept)")
    stdout.print(f"  in:  {s['objects_in']:,} objects, {_mb(s['bytes_in'])} "
                 f"({s['pages']:,} pages)")
    stdout.print(f"  out: {s['objects_out']:,} objects, {_mb(s['bytes_out'])} "
                 f"({s['present']:,} already in the destination)")
    skipped = {k: s[k] for k in ("corrupt", "foreign", "other_layout", "incomplete_pages")
               if s.get(k)}
    if skipped:
        stdout.print("  skipped: " + ", ".join(f"{k.replace('_', ' ')} {v:,}"
                                               for k, v in skipped.items()))


def _human_result(s: dict[str, Any]) -> None:
    _human_plan(s, "converted")
    rate = s["bytes_in"] / s["seconds"] if s["seconds"] > 0 else 0.0
    stdout.print(f"  written {s['written']:,} ({_mb(s['bytes_written'])}), already present "
                 f"{s['skipped_present']:,}, verified {s['verified']:,}"
                 + (f" ({s['verify_failed']:,} WRONG)" if s["verify_failed"] else "")
                 + f", corrupt on read "
                 f"{s['read_corrupt']:,}; {s['seconds']:.2f} s ({_mb(rate)}/s in)")


def _run(src, dst, plan, verify: bool, fmt: OutputFormat):
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    from engine.storage.convert import run

    with Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                  TransferSpeedColumn(), TimeRemainingColumn(), console=stderr,
                  disable=fmt is OutputFormat.json or not stderr.is_terminal,
                  transient=True) as bar:
        task = bar.add_task("converting", total=plan.counts["bytes_in"] or None)
        return run(plan, src, dst, verify=verify,
                   progress=lambda n: bar.advance(task, n))


def convert(src_spec: str, dst_spec: str, to: str, from_: Optional[str], verify: bool,
            dry_run: bool, max_bytes: Optional[str], fmt: OutputFormat,
            model_tag: Optional[str] = None, verbose: bool = False) -> None:
    from engine.core.errors import InputError
    from engine.storage.config import parse_size
    from engine.storage.convert import check_shape
    from engine.storage.convert import plan as make_plan
    from engine.storage.endpoints import nested_stores, open_endpoint, same_store
    from engine.storage.placement import Placement

    with usage():                   # usage errors before any store is opened
        limit = parse_size(max_bytes) if max_bytes is not None else None
        for flag, spec in (("--to", to), ("--from", from_)):
            if spec is not None:
                check_shape(Placement.parse_target(spec), f"{flag} {spec}")
    if same_store(src_spec, dst_spec):
        raise InputError("source and destination are the same store")
    nested = nested_stores(src_spec, dst_spec)
    if nested:
        raise InputError(f"{nested}; nothing was written")
    with usage():                   # a malformed store address
        src = open_endpoint(src_spec, source=True, verbose=verbose)
    try:
        with usage():
            dst = open_endpoint(dst_spec, source=False, dry_run=dry_run, verbose=verbose)
        try:
            plan = make_plan(src, dst, to, from_, limit, model_tag=model_tag)
            if dry_run:
                s = {**plan.summary(), "dry_run": True}
                emit_json(s) if fmt is OutputFormat.json else _human_plan(s, "plan")
                return
            res = _run(src, dst, plan, verify, fmt)
        finally:
            dst.close()
    finally:
        src.close()
    s = {**plan.summary(), **res.counts, "seconds": round(res.seconds, 3),
         "interrupted": res.interrupted, "dry_run": False, "verify_problems": res.problems}
    emit_json(s) if fmt is OutputFormat.json else _human_result(s)
    if s["verify_failed"]:
        fail(f"--verify: {s['verify_failed']:,} written object(s) do not hold the source's KV "
             f"(e.g. {res.problems[0]})", EXIT_CHECK)
    if res.interrupted:
        fail(f"interrupted after writing {s['written']:,} objects (each one whole); run the "
             "same command again to resume", EXIT_ERROR)
    if s["read_corrupt"] or s["corrupt"]:
        stderr.print(f"warning: {s['corrupt'] + s['read_corrupt']:,} corrupt source object(s) "
                     "skipped (never copied)")


def _sg_human(s: dict[str, Any], title: str) -> None:
    stdout.print(f"{title}: {s['source_layout']} -> {s['target_layout']}")
    if s.get("model_tag") is not None:
        stdout.print(f"  model tag: {s['model_tag']}")
    stdout.print(f"  pages: {s['pages']:,} complete, {s.get('incomplete_pages', 0):,} "
                 f"incomplete (skipped); in: {_mb(s.get('bytes_in', 0))}")
    stdout.print(f"  out: {s['objects_out']:,} objects, {_mb(s['bytes_out'])} "
                 f"({s.get('present', 0):,} already in the destination)")
    skipped = {k: s[k] for k in ("mis_sized", "other_files", "corrupt", "foreign",
                                 "read_failed", "not_produced") if s.get(k)}
    if skipped:
        stdout.print("  skipped: " + ", ".join(f"{k.replace('_', ' ')} {v:,}"
                                               for k, v in skipped.items()))
    if "written" in s:
        stdout.print(f"  written {s['written']:,} ({_mb(s['bytes_written'])}), already present "
                     f"{s['skipped_present']:,}, verified {s['verified']:,}"
                     + (f" ({s['verify_failed']:,} WRONG)" if s["verify_failed"] else "")
                     + f"; {s['seconds']:.2f} s")


def convert_sglang(src_spec: str, dst_spec: str, to: str, verify: bool, dry_run: bool,
                   fmt: OutputFormat, model_tag: Optional[str], verbose: bool) -> None:
    """SGLang file stores on either side (engine/storage/sglang_convert.py)."""
    from engine.storage import sglang_convert as sc

    p = sc.plan(src_spec, dst_spec, to=to, model_tag=model_tag, dry_run=dry_run,
                verbose=verbose)
    try:
        if dry_run:
            s = {**p.summary, "dry_run": True}
            emit_json(s) if fmt is OutputFormat.json else _sg_human(s, "plan")
            return
        from rich.progress import BarColumn, DownloadColumn, Progress

        with Progress("[progress.description]{task.description}", BarColumn(),
                      DownloadColumn(), console=stderr, transient=True,
                      disable=fmt is OutputFormat.json or not stderr.is_terminal) as bar:
            task = bar.add_task("converting", total=p.summary.get("bytes_in") or None)
            res = sc.run(p, verify=verify, progress=lambda n: bar.advance(task, n))
    finally:
        sc.close(p)
    s = {**p.summary, **res.counts, "seconds": round(res.seconds, 3),
         "interrupted": res.interrupted, "dry_run": False, "verify_problems": res.problems}
    emit_json(s) if fmt is OutputFormat.json else _sg_human(s, "converted")
    if s["verify_failed"]:
        fail(f"--verify: {s['verify_failed']:,} written object(s) do not hold the source's KV "
             f"(e.g. {res.problems[0]})", EXIT_CHECK)
    if res.interrupted:
        fail(f"interrupted after writing {s['written']:,} objects (each one whole); run the "
             "same command again to resume", EXIT_ERROR)


def scan_sglang(src_spec: str, fmt: OutputFormat) -> None:
    """``--scan`` of an SGLang store: the shapes its file names show, and the stated geometry
    checked (exit 3 when the store contradicts it)."""
    from engine.core.errors import InputError
    from engine.storage import sglang_geometry as sg
    from engine.storage import sglang_store as ss

    if not sg.is_sglang(src_spec):
        raise usage_error("--scan reads SGLang stores: give sglang-file:DIR[?geometry]")
    root, fields = sg.parse_spec(src_spec)
    listing = ss.list_store(root)
    out: dict[str, Any] = {"store": root, "sglang_version_followed": sg.SGLANG_VERSION,
                           "page_files": sum(len(f) for f in listing.by_suffix.values()),
                           "bytes": sum(sum(f.values()) for f in listing.by_suffix.values()),
                           "other_files": listing.other_files, "not_regular_skipped": listing.not_regular,
                           "shapes": ss.shapes(listing), "geometry_check": None}
    problem = None
    if fields:
        g = sg.geometry(fields, f"SRC {root}")
        try:
            out["geometry_check"] = {"ok": True, **ss.check(listing, g, f"SRC {root}").summary()}
        except InputError as e:
            problem = str(e)
            out["geometry_check"] = {"ok": False, "problem": problem}
    if fmt is OutputFormat.json:
        emit_json(out)
    else:
        stdout.print(f"SGLang store {root}: {out['page_files']:,} page files, "
                     f"{_mb(out['bytes'])}" + (f", {out['other_files']:,} other files"
                                                if out["other_files"] else ""))
        for sh in out["shapes"]:
            what = "MLA" if sh["mla"] else f"tp={sh['tp']}"
            if sh.get("namespace"):
                what = f"unified-scheme namespace {sh['namespace']}" + (
                    " (MLA)" if sh["mla"] else "")
            stdout.print((f"  model {sh['model']!r} " if sh["model"] else "  ") + what +
                         (f" pp={sh['pp']}" if sh["pp"] > 1 else "") +
                         f": {sh['files']:,} files, {_mb(sh['bytes'])}")
            for suffix, r in sh["ranks"].items():
                sizes = ", ".join(f"{k} B x{v}" for k, v in r["object_sizes"].items())
                stdout.print(f"    *{suffix}.bin: {r['files']:,} files ({sizes})")
        gc = out["geometry_check"]
        if gc is not None and gc["ok"]:
            stdout.print(f"  geometry {g.label()}: {gc['pages']:,} complete pages, "
                         f"{gc['incomplete_pages']:,} incomplete, {gc['mis_sized']:,} "
                         f"mis-sized files, {gc['other_files']:,} files of other shapes")
        elif gc is not None:
            stdout.print(f"  geometry check: {problem}")
    if problem is not None:
        fail(f"--scan: {problem}", EXIT_CHECK)


def usage_error(msg: str):
    from engine.core.errors import UsageError

    return UsageError(msg)


def dispatch(src: str, dst: Optional[str], to: Optional[str], from_: Optional[str],
             verify: bool, dry_run: bool, max_bytes: Optional[str], fmt: OutputFormat,
             model_tag: Optional[str], verbose: bool, scan: bool) -> None:
    """--scan, an SGLang store on either side, or hicache stores only."""
    from engine.storage.sglang_geometry import is_sglang

    if scan:
        if dst is not None:
            raise usage_error("--scan takes SRC only")
        scan_sglang(src, fmt)
        return
    if dst is None:
        raise usage_error("DST is missing (or give --scan to only read SRC)")
    if is_sglang(src) or is_sglang(dst):
        if from_ is not None or max_bytes is not None or \
                (to is not None and is_sglang(dst)):
            raise usage_error("--from, --max-bytes and --to (into an SGLang store) are not "
                              "for SGLang stores: their shape goes in the sglang-file: "
                              "address")
        convert_sglang(src, dst, to or "unified", verify, dry_run, fmt, model_tag, verbose)
        return
    to = to or "unified"
    convert(src, dst, to, from_, verify, dry_run, max_bytes, fmt, model_tag=model_tag,
            verbose=verbose)


def register(app: typer.Typer) -> None:
    @app.command("convert-layout", help=HELP)
    @handle_errors
    def convert_layout_cmd(
        src: str = typer.Argument(..., metavar="SRC", help="Source store: a directory or "
                                  "mooncake://HOST:PORT[?metadata=URL&admin=PORT&timeout=S]."),
        dst: Optional[str] = typer.Argument(None, metavar="DST", help="Destination store "
                                            "(created when a directory does not exist); not "
                                            "with --scan."),
        to: Optional[str] = typer.Option(None, "--to", help="Target layout: unified (the default "
                               "grid), unified:layers=N,heads=N, unified:tp=N,pp=N, or "
                               "legacy:tp=N,pp=N; append +page_first for token-major "
                               "payloads (default unified). Into an SGLang store the target "
                               "shape goes in its sglang-file: address instead."),
        from_: Optional[str] = typer.Option(None, "--from", help="Convert only the source "
                                            "objects of this layout (same forms as --to); "
                                            "needed when the source mixes layouts."),
        verify: bool = typer.Option(False, "--verify", help="Read every target object back, "
                                    "decode it through its own header's layout and compare "
                                    "every KV element with the source's (exit 3 if any "
                                    "differs)."),
        dry_run: bool = typer.Option(False, "--dry-run", help="Print the plan (objects and "
                                     "bytes in/out) and write nothing."),
        max_bytes: Optional[str] = typer.Option(None, "--max-bytes", help="Room the "
                                                "destination may use, e.g. 10GiB (refused up "
                                                "front when the conversion needs more)."),
        model_tag: Optional[str] = typer.Option(None, "--model-tag", metavar="TAG", help="Convert "
                                                "only the objects of this model (its name and "
                                                "fingerprint, as the error listing a mixed "
                                                "source or --dry-run shows it). From an SGLang "
                                                "store to a hicache one: the tag to write (the "
                                                "servers' /get_server_info model_tag)."),
        verbose: bool = typer.Option(False, "--verbose", help="Let the Mooncake client's own "
                                     "log lines through to stderr (kept off by default)."),
        scan: bool = typer.Option(False, "--scan", help="Only read SRC, an SGLang store "
                                  "(sglang-file:DIR[?geometry]): the models and shapes its "
                                  "file names show, files and bytes per rank; with a geometry, "
                                  "complete and incomplete pages and what the check found "
                                  "(exit 3 when the store contradicts it)."),
        fmt: Format = OutputFormat.human,
    ) -> None:
        dispatch(src, dst, to, from_, verify, dry_run, max_bytes, fmt, model_tag, verbose, scan)
