"""``hicache bench replay TRACE --replicas N --router POLICY``: the fleet replay's options, their
checks and its output. The replay itself is :mod:`engine.sim.fleet`'s."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Optional

import typer

from engine.core.errors import UsageError
from hicache_cli.output import OutputFormat, emit_json, fail, stdout

Replicas = Annotated[int, typer.Option(
    "--replicas", min=1, help="Replay over N replicas (each with the L1/L2 budgets given) "
                              "sharing one L3, behind --router.")]
Router = Annotated[Optional[str], typer.Option(
    "--router", help="With --replicas: round-robin, least-load, session (by the trace's "
                     "session_id where it has one), consistent-hash, cache-aware, or a comma "
                     "list (default: all).")]
CacheThreshold = Annotated[float, typer.Option(
    "--cache-threshold", min=0.0, max=1.0, help="cache-aware: route by the prefix tree when "
                                                "matched / input exceeds this.")]
BalanceAbs = Annotated[int, typer.Option(
    "--balance-abs-threshold", min=0, help="cache-aware: in-flight max - min above this (and "
                                           "the relative one) routes to the least loaded.")]
BalanceRel = Annotated[float, typer.Option(
    "--balance-rel-threshold", min=1.0, help="cache-aware: in-flight max above min x this "
                                             "(and the absolute one) routes to the least "
                                             "loaded.")]
MaxTree = Annotated[int, typer.Option(
    "--max-tree-size", min=1, help="cache-aware: tokens each replica's approximate prefix "
                                   "tree keeps (least recently routed leaves go first).")]

DEFAULT_ROUTERS = "round-robin,least-load,session,consistent-hash,cache-aware"


def routers(text: Optional[str]) -> list[str]:
    from engine.sim.fleet import ROUTERS

    names = list(dict.fromkeys(p.strip() for p in (text or DEFAULT_ROUTERS).split(",")
                               if p.strip()))
    bad = [n for n in names if n not in ROUTERS]
    if bad or not names:
        raise UsageError(f"--router: unknown router {bad[0] if bad else text!r}; choose from "
                         f"{', '.join(ROUTERS)}")
    return names


def replica_counts(n: int) -> list[int]:
    """1, 2, 4, … up to ``n`` (and ``n`` itself)."""
    out, k = [], 1
    while k < n:
        out.append(k)
        k *= 2
    return out + [n]


def run(trace: Path, cfg, replicas: int, router: Optional[str], sweep: bool,
        plot: Optional[Path], fmt: OutputFormat, thresholds: tuple) -> None:
    """The fleet replay (``--sweep``: over 1, 2, 4 … N replicas), printed or as JSON."""
    from engine.loadgen.trace import load_trace
    from engine.sim.fleet import MAX_REPLICAS, RouterConfig, compare
    from engine.sim.replay import ReplayInput

    names = routers(router)
    if replicas > MAX_REPLICAS:
        raise UsageError(f"--replicas must be 1..{MAX_REPLICAS}, got {replicas:,}")
    if cfg.policy == "opt":
        raise UsageError("--replicas replays online policies; --policy opt needs the one "
                         "cache's future (drop --replicas)")
    if cfg.cp_size != 1:
        raise UsageError("--replicas does not combine with --cp")
    if plot is not None and not sweep:
        raise UsageError("--plot needs --sweep")
    ct, ba, br, mt = thresholds
    rc = RouterConfig(cache_threshold=ct, balance_abs_threshold=ba, balance_rel_threshold=br,
                      max_tree_tokens=mt)
    inp = ReplayInput(load_trace(str(trace), cfg.limit))
    counts = replica_counts(replicas) if sweep else [replicas]
    try:
        runs = [compare(inp, cfg, n, names, rc) for n in counts]
    except MemoryError:
        fail(f"not enough memory for {max(counts)} replicas of L1 {cfg.l1_tokens:,} + L2 "
             f"{cfg.l2_tokens:,} tokens; use smaller tiers or fewer replicas")
    if plot is not None:
        _plot(runs, plot, os.path.basename(str(trace)))
    if fmt is OutputFormat.json:
        emit_json({"trace": str(trace), "requests": len(inp) if cfg.limit is None
                   else min(cfg.limit, len(inp)), "page_size": cfg.page_size,
                   "l1_tokens": cfg.l1_tokens, "l2_tokens": cfg.l2_tokens,
                   "l3_tokens": cfg.l3_tokens, "policy": cfg.policy, "fleet": runs,
                   "plot": str(plot) if plot else None})
        return
    for r in runs:
        _print(r, cfg, str(trace))
    if plot is not None:
        stdout.print(f"plot written to {plot}")


def _print(run: dict, cfg, trace: str) -> None:
    from rich.table import Table

    l3 = {0: "off", -1: "unbounded"}.get(cfg.l3_tokens, f"{cfg.l3_tokens:,}")
    n = run["replicas"]
    t = Table(title=f"{n} replica{'' if n == 1 else 's'} (each L1 {cfg.l1_tokens:,}, L2 "
                    f"{cfg.l2_tokens:,}; shared L3 {l3})", title_justify="left")
    t.add_column("router", no_wrap=True)
    for col in ("hit", "L1", "L2", "L3", "spread", "busiest"):
        t.add_column(col, justify="right", no_wrap=True)
    pooled = run["pooled"]
    for r in run["rows"]:
        over = "*" if r["token_hit_rate"] > pooled["token_hit_rate"] else ""
        t.add_row(r["router"], f"{r['token_hit_rate']:.4f}{over}", f"{r['l1_hit_rate']:.4f}",
                  f"{r['l2_hit_rate']:.4f}", f"{r['l3_hit_rate']:.4f}",
                  f"{r['load_spread']:.2f}", f"{r['max_replica_share']:.3f}")
    t.add_row(f"pooled {n}x", f"{pooled['token_hit_rate']:.4f}",
              f"{pooled['l1_hit_rate']:.4f}", f"{pooled['l2_hit_rate']:.4f}",
              f"{pooled['l3_hit_rate']:.4f}", "-", "-")
    stdout.print(t)
    if any(r["token_hit_rate"] > pooled["token_hit_rate"] for r in run["rows"]):
        stdout.print("* above the pooled replica: under LRU a partition can keep streams from "
                     "evicting each other (docs/fleet.md)")
    stdout.print(f"pooled: one replica with {n}x the L1/L2; spread: max / mean tokens computed "
                 f"per replica; busiest: its share of them; {run['wall_seconds']} s wall")


def _plot(runs: list[dict], path: Path, trace_name: str) -> None:
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from formats.outpath import write_output

    xs = [r["replicas"] for r in runs]
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    for name in dict.fromkeys(row["router"] for r in runs for row in r["rows"]):
        ax.plot(xs, [next(row["token_hit_rate"] for row in r["rows"] if row["router"] == name)
                     for r in runs], marker="o", label=name)
    ax.plot(xs, [r["pooled"]["token_hit_rate"] for r in runs], "k--",
            label="pooled (one replica, N x capacity)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("replicas")
    ax.set_ylabel("token hit rate")
    ax.set_title(f"{trace_name}: routers over replicas")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    write_output(path, buf.getvalue())
