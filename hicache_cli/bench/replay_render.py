"""What ``hicache bench replay`` prints: the result table, the sweep table and plot, the
multi-rank verdict, and the progress bars. No replay logic lives here."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Callable, Iterator

from hicache_cli.output import stderr, stdout


def print_result(d: dict) -> None:
    from rich.table import Table

    c = d["config"]
    t = Table(title=f"replay of {d['trace']}", show_header=False, title_justify="left")
    t.add_column(style="bold")
    t.add_column(justify="right")
    t.add_row("requests", f"{d['requests']:,}")
    t.add_row("input tokens", f"{d['input_tokens']:,}")
    t.add_row("page size", str(c["page_size"]))
    l3 = {0: "off", -1: "unbounded"}.get(c["l3_tokens"], f"{c['l3_tokens']:,}")
    t.add_row("L1 / L2 / L3 capacity (tokens)", f"{c['l1_tokens']:,} / {c['l2_tokens']:,} / {l3}")
    if c.get("cp_size", 1) > 1:
        t.add_row("CP ranks / KV", f"{c['cp_size']} / {c['cp_kv']} (capacities per rank)")
    t.add_row("policy / write policy", f"{c['policy']} / {c['write_policy']}")
    t.add_row("token hit rate", f"{d['token_hit_rate']:.4f}")
    t.add_row("  L1 hit rate", f"{d['l1_hit_rate']:.4f}")
    t.add_row("  L2 hit rate", f"{d['l2_hit_rate']:.4f}")
    if d["l3_hit_rate"]:
        t.add_row("  L3 hit rate", f"{d['l3_hit_rate']:.4f}")
    s = d["stats"]
    t.add_row("L1 evicted pages", f"{s['evicted_l1_pages']:,}")
    t.add_row("L2 load-back pages", f"{s['loadback_pages']:,}")
    t.add_row("cache seconds", f"{d['cache_seconds']:.3f}")
    t.add_row("requests / s (cache ops)", f"{d['requests_per_s']:,}")
    t.add_row("events recorded", f"{d['events']:,}")
    for key in ("rank_log", "tree_snapshot"):
        if key in d:
            t.add_row(key.replace("_", " "), d[key])
    stdout.print(t)


def print_sweep(rows: list[dict], base: str = "lru") -> None:
    """Hit rate per (policy, capacity); with the base policy and ``opt`` in the sweep, each
    other cell also shows the share of the gap between them it closes."""
    from rich.table import Table

    caps = sorted({r["l1_tokens"] for r in rows})
    pols = list(dict.fromkeys(r["policy"] for r in rows))
    shares = any("gap_closed" in r for r in rows if r["policy"] not in (base, "opt"))
    t = Table(title="token hit rate vs L1 capacity" + (
        f" (share of the {base}→opt gap closed)" if shares else ""), title_justify="left")
    t.add_column("L1 tokens", justify="right")
    for pol in pols:
        t.add_column(pol, justify="right")
    by = {(r["policy"], r["l1_tokens"]): r for r in rows}

    def cell(pol: str, cap: int) -> str:
        r = by[(pol, cap)]
        g = r.get("gap_closed")
        return f"{r['token_hit_rate']:.4f}" + (
            f" ({g:.0%})" if g is not None and pol not in (base, "opt") else "")

    for cap in caps:
        t.add_row(f"{cap:,}", *[cell(p, cap) for p in pols])
    stdout.print(t)


def plot(rows: list[dict], path: Path, trace_name: str, page_size: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    for pol in dict.fromkeys(r["policy"] for r in rows):
        pts = sorted((r["l1_tokens"], r["token_hit_rate"]) for r in rows if r["policy"] == pol)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                label=pol + (" (Belady bound)" if pol == "opt" else ""))
    ax.set_xscale("log")
    ax.set_xlabel("L1 capacity (tokens)")
    ax.set_ylabel("token hit rate")
    ax.set_title(f"{trace_name}, page size {page_size}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    import io

    from formats.outpath import write_output

    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    write_output(path, buf.getvalue())


def print_ranks(out: dict, rank_log_dir: Path | None) -> None:
    """The verdict of a multi-rank replay (``engine.sim.replay_ranks.summarize_ranks``)."""
    if "consensus_error" in out:
        stdout.print(f"[bold red]✗[/] {out['consensus_error']}", markup=True)
        return
    print_result({**out["result"], "trace": out["trace"]})
    ranks = out["ranks"]
    if out["online_consensus"]:
        stdout.print(f"{ranks} ranks agreed ({out['online_checks']} online checks)")
        return
    hint = (f"; run `hicache consensus-check {rank_log_dir}` to compare their logs"
            if rank_log_dir is not None else "")
    rates = "" if out["identical_hit_rates"] else " (their hit rates differ)"
    stdout.print(f"{ranks} ranks finished{rates}; their decisions were not compared "
                 f"(no --enable-rank-consensus){hint}", markup=False)


@contextlib.contextmanager
def request_bar(total: int, show: bool) -> Iterator[Callable[[int], None] | None]:
    """A bar over the requests of one replay; yields the per-request callback (None: no bar)."""
    if not show:
        yield None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn

    with Progress("[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(),
                  TimeRemainingColumn(), console=stderr, transient=True) as bar:
        task = bar.add_task("replaying", total=total)
        step = max(1, total // 200)

        def tick(i: int) -> None:
            if i % step == 0 or i == total:
                bar.update(task, completed=i)

        yield tick


@contextlib.contextmanager
def point_bar(total: int, show: bool) -> Iterator[Callable[[object], None] | None]:
    """A bar over sweep points; yields the per-point callback (None: no bar). It has no refresh
    thread, since the sweep forks its workers: it redraws as each point lands."""
    if not show:
        yield None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    with Progress("[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=stderr, transient=True, auto_refresh=False) as bar:
        task = bar.add_task("sweep points", total=total)
        bar.refresh()

        def done(_row: object) -> None:
            bar.advance(task)
            bar.refresh()

        yield done
