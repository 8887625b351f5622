"""``hicache consensus-check LOGS…``: do all ranks of each replica agree on their cache decisions?

Reads rank logs (files, or directories of ``*.ranklog`` / ``*.jsonl``), compares the ranks of
each data-parallel group event by event and explains every divergence found. The work is done by
:mod:`checkers.consensus`; this module only renders its report. Exit codes: 0 consistent,
3 divergence found, 1 unreadable input, 2 usage.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich import box
from rich.markup import escape
from rich.padding import Padding
from rich.table import Table

from hicache_cli.options import Format
from hicache_cli.output import EXIT_CHECK, OutputFormat, emit_json, handle_errors, stderr, stdout


def _pl(n: int, word: str) -> str:
    return f"{n:,} {word}{'' if n == 1 else 's'}"


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _value(v: Any, limit: int = 48) -> str:
    s = repr(v)
    return s if len(s) <= limit else s[:limit - 1] + "…"


def _event_line(ev: dict[str, Any]) -> str:
    """``seq 41  step 3  match  rid='r7' l1_len=64 …`` with local fields dimmed (markup)."""
    head = f"seq {ev.get('seq')}  step {ev.get('step')}  [bold]{escape(str(ev.get('kind')))}[/]"
    parts = []
    for k, v in ev.items():
        if k in ("seq", "step", "kind"):
            continue
        text = escape(f"{k}={_value(v)}")
        parts.append(f"[dim]{text}[/]" if str(k).startswith("local_") else text)
    return head + ("  " + " ".join(parts) if parts else "")


def _columns(div: Any) -> list[list[int]]:
    """Ranks grouped by identical differing fields, the majority first."""
    cols: list[tuple[dict, list[int]]] = []
    order = list(div.majority) + list(div.ranks)
    for r in order:
        f = div.fields.get(r, {})
        for key, members in cols:
            if key == f:
                members.append(r)
                break
        else:
            cols.append((f, [r]))
    return [m for _, m in cols]


def _link_text(link: dict[str, Any]) -> str:
    """``hit_length_mismatch (step 7: match / match)``: a chain link, each rank's kind."""
    kinds = " / ".join(str(ev.get("kind")) if ev is not None else "no event"
                       for ev in link["events"].values())
    return f"{link['category']} (step {link['step']}: {kinds})"


def _render_divergence(n: int, d: Any) -> None:
    p = stdout.print
    p()
    where = []
    if d.group is not None:
        where.append(f"group dp_rank={d.group}")
    if d.step is not None:
        where.append(f"step {d.step}")
    if d.seq is not None:
        where.append(f"seq {d.seq}")
    p(f"[bold]#{n} [red]{d.category}[/red][/]" + ("  ·  " + "  ·  ".join(where)
                                                   if where else ""))
    p(f"   {escape(d.message)}")
    if d.ranks:
        p(f"   minority: {_ranks(d.ranks)}   majority: {_ranks(d.majority)}")
    t = d.trigger_request
    if t is not None:
        arrived = ("" if t["arrival_step"] is None else
                   f" (arrived at step {t['arrival_step']}, seq {t['arrival_seq']}: "
                   f"{t['arrival_kind']})")
        p(f"   trigger: request {escape(str(t['rid']))}{escape(arrived)}")
    if d.chain:
        p("   chain: " + escape(" → ".join(_link_text(c) for c in d.chain)))
    cols = _columns(d)
    fields = list(dict.fromkeys(k for f in d.fields.values() for k in f))
    if fields:
        t = Table(box=box.SIMPLE, show_edge=False, pad_edge=False, padding=(0, 2))
        t.add_column("field")
        for c in cols:
            t.add_column(escape(_ranks(c)))
        for f in fields:
            t.add_row(escape(f), *[escape(_value(d.fields[c[0]][f], 40))
                                   if f in d.fields[c[0]] else "[dim]—[/]" for c in cols])
        stdout.print(Padding(t, (0, 0, 0, 3), expand=False))
    for c in cols:
        ctx = d.context.get(c[0])
        if ctx is None:
            continue
        alike = f" ({escape(_ranks(c[1:]))} alike)" if len(c) > 1 else ""
        p(f"   [dim]context, rank {c[0]}{alike}:[/]")
        for ev in ctx["before"]:
            p(f"       {_event_line(ev)}")
        if ctx["at"] is not None:
            p(f"     [bold yellow]>[/] {_event_line(ctx['at'])}")
        else:
            p("     [bold yellow]>[/] [italic](end of log)[/]")
        for ev in ctx["after"]:
            p(f"       {_event_line(ev)}")


def render_human(report: Any, max_divergences: int) -> None:
    p = stdout.print
    groups = report.groups
    what = (f"{_pl(report.ranks, 'rank')} in {_pl(len(groups), 'group')}, "
            f"{report.events:,} events checked")
    if report.consistent:
        p(f"[bold green]✓ consistent[/]: {what}")
    else:
        bad = sum(1 for g in groups if g.divergences)
        # a rank with no log at all is a divergence of no group (group None)
        absent = any(d.group is None for d in report.divergences)
        where = f" in {bad} of {_pl(len(groups), 'group')}" if bad else ""
        if absent:
            where += ", plus ranks without a log" if bad else ": ranks without a log"
        p(f"[bold red]✗ inconsistent[/]: {_pl(len(report.divergences), 'divergence')}{where} "
          f"— {what}")
    for n, d in enumerate(report.divergences, 1):
        _render_divergence(n, d)
    if not report.complete:
        stdout.print()
        stdout.print(f"[yellow]stopped at --max-divergences {max_divergences}:[/] not every group "
                     f"was checked to the end")


Logs = Annotated[list[Path], typer.Argument(help="Rank log files (*.ranklog msgpack, *.jsonl "
                                                 "JSON Lines) and/or directories holding them.")]
MaxDivergences = Annotated[int, typer.Option("--max-divergences", min=1,
                                             help="Stop after this many divergences.")]
Context = Annotated[int, typer.Option("--context", min=0, help="Events of context shown before "
                                      "and after each divergence, per rank.")]


def consensus_check_cmd(logs: Logs, fmt: Format = OutputFormat.human,
                        max_divergences: MaxDivergences = 10, context: Context = 3) -> None:
    """Check that all ranks of each replica made the same cache decisions.

    Ranks with the same dp_rank must record identical events (by seq, ignoring local_*
    fields). Reports each divergence: category, step, seq, minority ranks, the differing
    fields and context. Exit 0 consistent, 3 divergence found, 1 unreadable input.

    Example: hicache consensus-check rank-logs/ --format json
    """
    from checkers.consensus import check_consensus

    report = check_consensus(logs, max_divergences=max_divergences, context=context)
    for note in report.notes:
        stderr.print(f"note: {note}", markup=False, highlight=False)
    if fmt is OutputFormat.json:
        emit_json(report.to_json())
    else:
        render_human(report, max_divergences)
    if not report.consistent:
        raise typer.Exit(EXIT_CHECK)


def register(app: typer.Typer) -> None:
    app.command("consensus-check")(handle_errors(consensus_check_cmd))
