"""``hicache bench replay TRACE``: offline, trace-driven simulation of the cache stack."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import typer

from hicache_cli.output import OutputFormat, emit_json, fail, handle_errors, stderr, stdout


def _positive(name: str, value: int, allow_zero: bool = True, allow_unbounded: bool = False):
    if allow_unbounded and value == -1:
        return
    lo = 0 if allow_zero else 1
    if value < lo:
        what = ">= 0" if allow_zero else ">= 1"
        if allow_unbounded:
            what += " (or -1 for unbounded)"
        fail(f"{name} must be {what}, got {value}", code=2)


def _parse_capacities(text: str) -> list[int]:
    out = []
    for part in text.split(","):
        part = part.strip().lower().replace("_", "")
        mult = 1
        for suf, m in (("k", 1_000), ("m", 1_000_000), ("g", 1_000_000_000)):
            if part.endswith(suf):
                part, mult = part[:-1], m
        try:
            val = int(float(part) * mult)
        except (ValueError, OverflowError):
            fail(f"--capacities: {part!r} is not a token count", code=2)
        if val < 1:
            fail(f"--capacities: capacities must be >= 1, got {val}", code=2)
        out.append(val)
    return out


def _check_output_path(name: str, path: Optional[Path], directory: bool = False) -> None:
    """Fail before the replay, not after it, when an output path cannot be written (the
    rule of :mod:`formats.outpath`: never a device/FIFO, through symlinks, writable)."""
    from formats.outpath import OutputPathError, check_output_dir, check_output_file

    if path is None:
        return
    try:
        if directory:
            check_output_dir(path, create=False)
            return
        check_output_file(path)
    except OutputPathError as e:
        fail(f"{name} {e}")


def _check_ranks(ranks: int) -> None:
    """``--ranks`` is at least 1 and at most what this machine can run (each rank is a
    process holding torch)."""
    from engine.core.device import max_local_ranks

    _positive("--ranks", ranks, allow_zero=False)
    cap, why = max_local_ranks()
    if ranks > cap:
        fail(f"--ranks {ranks}: this machine can run at most {cap} ranks ({why})", code=2)


def _check_nodes(ranks: int, nnodes: int, node_rank: int, addr: Optional[str]) -> tuple:
    """(nnodes, node_rank, HOST:PORT or None) after the usage checks."""
    _positive("--nnodes", nnodes, allow_zero=False)
    if not 0 <= node_rank < nnodes:
        fail(f"--node-rank must be in [0, --nnodes), got {node_rank} of {nnodes}", code=2)
    if ranks % nnodes:
        fail(f"--ranks {ranks} does not spread evenly over --nnodes {nnodes}", code=2)
    if nnodes > 1 and addr is None:
        fail("--nnodes > 1 needs --dist-init-addr HOST:PORT (node 0's address)", code=2)
    if addr is not None:
        host, _, port = addr.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            fail(f"--dist-init-addr must be HOST:PORT, got {addr!r}", code=2)
    return nnodes, node_rank, addr


def _check_cp(cp: int, cp_kv: str, l3_tokens: int, sweep: bool) -> None:
    from engine.sim.replay import CP_KV

    _positive("--cp", cp, allow_zero=False)
    if cp_kv not in CP_KV:
        fail(f"--cp-kv must be one of {list(CP_KV)}, got {cp_kv!r}", code=2)
    if cp > 1 and sweep:
        fail("--cp does not combine with --sweep", code=2)
    if cp > 1 and cp_kv == "sharded" and l3_tokens:
        fail("--cp with --cp-kv sharded does not simulate an L3 tier (drop --l3-tokens)",
             code=2)


def _replay(records, cfg, **kwargs):
    """``engine.sim.replay.replay``; tier sizes too large for this machine's memory are one line."""
    from engine.sim.replay import replay

    try:
        return replay(records, cfg, **kwargs)
    except MemoryError:
        pages = (cfg.l1_tokens + cfg.l2_tokens) // cfg.page_size
        fail(f"not enough memory for the metadata of {pages:,} pages (L1 {cfg.l1_tokens:,} + "
             f"L2 {cfg.l2_tokens:,} tokens, page size {cfg.page_size}); use smaller tiers")


def register(bench_app: typer.Typer) -> None:
    @bench_app.command("replay")
    @handle_errors
    def replay_cmd(
        trace: Path = typer.Argument(..., help="Mooncake JSONL trace (plain or .gz: timestamp, "
                                     "input_length, output_length, hash_ids), or the Parquet/"
                                     "Arrow file `hicache bench convert-trace` writes."),
        page_size: int = typer.Option(64, "--page-size", help="Tokens per KV page."),
        l1_tokens: int = typer.Option(5_120_000, "--l1-tokens", help="L1 (device) capacity."),
        l2_tokens: int = typer.Option(0, "--l2-tokens", help="L2 (host) capacity; 0 = no L2."),
        l3_tokens: int = typer.Option(0, "--l3-tokens", help="L3 (storage) capacity; "
                                      "0 = no L3, -1 = unbounded. Needs --l2-tokens > 0."),
        policy: str = typer.Option("lru", "--policy", help="Eviction policy: lru, lfu, priority, bip "
                                   "or opt (Belady's offline bound)."),
        write_policy: str = typer.Option("write_through", "--write-policy",
                                         help="L1->L2 write policy: write_through, "
                                              "write_through_selective, write_back."),
        limit: Optional[int] = typer.Option(None, "--limit", help="Replay the first N requests."),
        sweep: bool = typer.Option(False, "--sweep", help="Sweep L1 capacity for the eviction "
                                   "policies (L2 off) instead of one run, on all cores."),
        policies: Optional[str] = typer.Option(
            None, "--policies", help="With --sweep: any registered policies, e.g. 'lru,opt' "
                                     "(default: all but priority, which a trace cannot drive)."),
        jobs: Optional[int] = typer.Option(None, "--jobs", min=1, help="With --sweep: worker "
                                           "processes (default: one per core)."),
        capacities: Optional[str] = typer.Option(
            None, "--capacities", help="Sweep points, e.g. '640k,1.28m,2.56m' (default: "
                                       "--l1-tokens x 1/8 … 4)."),
        plot: Optional[Path] = typer.Option(None, "--plot", help="With --sweep: write a PNG of "
                                            "hit rate vs capacity."),
        dump_tree: Optional[Path] = typer.Option(None, "--dump-tree", help="Write a tree "
                                                 "snapshot (for `hicache inspect`) at the end; "
                                                 "with --ranks, a directory with one per rank."),
        rank_log_dir: Optional[Path] = typer.Option(None, "--rank-log-dir", help="Write this "
                                                    "rank's event log (for consensus-check)."),
        rank: int = typer.Option(0, "--rank", help="Rank number written into the rank log "
                                 "header (replays standing in for the ranks of one replica)."),
        world_size: int = typer.Option(1, "--world-size", help="World size for the rank log "
                                       "header."),
        inject_divergence: Optional[str] = typer.Option(
            None, "--inject-divergence", help="Debug: break this rank's decisions, e.g. "
            "'hit_length@rank=1,step=30' (kinds: hit_length, restore_completion, lock_order, "
            "eviction_eligibility, pp_ack, missing_events)."),
        ranks: int = typer.Option(1, "--ranks", help="Replay as N real ranks (processes over "
                                  "torch.distributed gloo) of one replica."),
        enable_rank_consensus: bool = typer.Option(
            False, "--enable-rank-consensus", help="With --ranks: compare the ranks' decisions "
            "online and stop at the first divergence (logs go to --rank-log-dir)."),
        consensus_every: int = typer.Option(16, "--consensus-every", help="Compare every N "
                                            "requests (online consensus)."),
        nnodes: int = typer.Option(1, "--nnodes", help="With --ranks: hosts the ranks are "
                                   "spread over (run the command on each, with its "
                                   "--node-rank)."),
        node_rank: int = typer.Option(0, "--node-rank", help="This host's index (0 … "
                                      "--nnodes-1); node 0 hosts the rendezvous."),
        dist_init_addr: Optional[str] = typer.Option(
            None, "--dist-init-addr", help="HOST:PORT of node 0's rendezvous (needed with "
            "--nnodes > 1)."),
        cp: int = typer.Option(1, "--cp", help="Context-parallel ranks of the replica; "
                               "--l1-tokens/--l2-tokens are then per-rank budgets."),
        cp_kv: str = typer.Option("sharded", "--cp-kv", help="With --cp N: 'sharded' (each KV "
                                  "page on one owner rank) or 'replicated' (device KV on every "
                                  "rank, host pool deduplicated across ranks)."),
        no_events: bool = typer.Option(False, "--no-events", help="Do not record cache "
                                       "decision events (to measure their overhead)."),
        fmt: OutputFormat = typer.Option(OutputFormat.human, "--format", help="human or json."),
        progress: bool = typer.Option(False, "--progress", help="Progress bar even with "
                                      "--format json."),
    ) -> None:
        """Replay a trace through the cache stack (metadata only) and report hit rates.

        Example: hicache bench replay trace.jsonl.gz --page-size 64 --l1-tokens 5120000
        """
        from engine.cache.policy import policy_names
        from engine.loadgen.trace import load_trace
        from engine.sim.replay import ReplayConfig

        _positive("--page-size", page_size, allow_zero=False)
        _check_ranks(ranks)
        _positive("--l1-tokens", l1_tokens, allow_zero=False)
        _positive("--l2-tokens", l2_tokens)
        _positive("--l3-tokens", l3_tokens, allow_unbounded=True)
        if l3_tokens and not l2_tokens:
            fail("--l3-tokens needs --l2-tokens > 0 (L3 pages are staged through L2)", code=2)
        if limit is not None:
            _positive("--limit", limit, allow_zero=False)
        if policy not in policy_names(include_offline=True):
            fail(f"--policy must be one of {policy_names(include_offline=True)}, got {policy!r}",
                 code=2)
        _check_cp(cp, cp_kv, l3_tokens, sweep)
        if plot is not None and not sweep:
            fail("--plot needs --sweep", code=2)
        if l1_tokens < page_size:
            fail(f"--l1-tokens {l1_tokens} holds no page of {page_size} tokens", code=2)
        _check_output_path("--plot", plot)
        _check_output_path("--dump-tree", dump_tree, directory=ranks > 1 or enable_rank_consensus)
        _check_output_path("--rank-log-dir", rank_log_dir, directory=True)

        if ranks > 1 or enable_rank_consensus:
            _positive("--ranks", ranks, allow_zero=False)
            _positive("--consensus-every", consensus_every, allow_zero=False)
            if sweep:
                fail("--ranks does not combine with --sweep", code=2)
            if cp > 1 and ranks != cp:
                fail(f"with --cp {cp}, --ranks stands for the CP ranks: give --ranks {cp}",
                     code=2)
            nodes = _check_nodes(ranks, nnodes, node_rank, dist_init_addr)
            _multi_rank(trace, ranks, ReplayConfig(
                page_size=page_size, l1_tokens=l1_tokens, l2_tokens=l2_tokens,
                l3_tokens=l3_tokens, policy=policy, write_policy=write_policy, limit=limit,
                cp_size=cp, cp_kv=cp_kv),
                rank_log_dir, consensus_every if enable_rank_consensus else 0,
                inject_divergence, fmt, dump_tree, nodes)
            return

        if (policies is not None or jobs is not None) and not sweep:
            fail("--policies and --jobs need --sweep", code=2)
        records = load_trace(str(trace), limit)
        show_progress = fmt is OutputFormat.human or progress

        if sweep:
            _sweep(trace, records, page_size, l1_tokens, capacities, policies, jobs, plot, fmt,
                   show_progress)
            return

        cfg = ReplayConfig(page_size=page_size, l1_tokens=l1_tokens, l2_tokens=l2_tokens,
                           l3_tokens=l3_tokens, policy=policy, write_policy=write_policy, limit=limit,
                           events=not no_events, cp_size=cp, cp_kv=cp_kv)
        n = len(records)
        from engine.cache.events import EventLog, RankInfo
        from engine.parallel.divergence import install

        if not 0 <= rank < world_size:
            fail(f"--rank must be in [0, --world-size), got rank {rank} of {world_size}", code=2)
        events = EventLog(RankInfo(rank=rank, world_size=world_size, tp_rank=rank,
                                   tp_size=world_size, cp_size=cp),
                          enabled=not no_events, keep=rank_log_dir is not None)
        if inject_divergence:
            install(events, inject_divergence)
        keep = dump_tree is not None
        if show_progress:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn

            with Progress("[progress.description]{task.description}", BarColumn(),
                          MofNCompleteColumn(), TimeRemainingColumn(), console=stderr,
                          transient=True) as bar:
                task = bar.add_task("replaying", total=n)
                step = max(1, n // 200)

                def tick(i: int) -> None:
                    if i % step == 0 or i == n:
                        bar.update(task, completed=i)

                result, cache = _replay(records, cfg, events=events, progress=tick,
                                        keep_cache=keep)
        else:
            result, cache = _replay(records, cfg, events=events, keep_cache=keep)
        out = result.to_dict()
        out["trace"] = str(trace)
        if rank_log_dir is not None:
            rank_log_dir.mkdir(parents=True, exist_ok=True)
            path = rank_log_dir / f"rank{events.rank.rank}.ranklog"
            events.write(str(path))
            out["rank_log"] = str(path)
        if dump_tree is not None:
            from engine.snapshot.take import write_snapshot

            write_snapshot(str(dump_tree), cache, meta={"source": "bench replay",
                                                        "trace": str(trace)})
            out["tree_snapshot"] = str(dump_tree)
        if fmt is OutputFormat.json:
            emit_json(out)
        else:
            _print_result(out)


def _parse_policies(text: str) -> list[str]:
    from engine.cache.policy import policy_names

    known = policy_names(include_offline=True)
    names = [p.strip() for p in text.split(",") if p.strip()]
    bad = [p for p in names if p not in known]
    if bad or not names:
        fail(f"--policies: {bad[0]!r} is not an eviction policy; choose from {', '.join(known)}"
             if bad else "--policies: name at least one policy", code=2)
    return list(dict.fromkeys(names))


def _sweep(trace: Path, records, page_size: int, l1_tokens: int, capacities: Optional[str],
           policies: Optional[str], jobs: Optional[int], plot: Optional[Path],
           fmt: OutputFormat, show_progress: bool) -> None:
    from engine.sim.replay import ReplayInput
    from engine.sim.sweep import default_capacities, default_policies, run_sweep, sweep_points

    caps = _parse_capacities(capacities) if capacities else \
        default_capacities(l1_tokens, page_size)
    small = [c for c in caps if c < page_size]
    if small:
        fail(f"--capacities: {small[0]} tokens hold no page of {page_size} tokens", code=2)
    pols = _parse_policies(policies) if policies is not None else default_policies()
    points = sweep_points(pols, caps)
    inp = ReplayInput(records)
    try:
        if show_progress:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

            # no refresh thread: the sweep forks its workers, so the bar redraws per point
            with Progress("[progress.description]{task.description}", BarColumn(),
                          MofNCompleteColumn(), TimeElapsedColumn(), console=stderr,
                          transient=True, auto_refresh=False) as bar:
                task = bar.add_task("sweep points", total=len(points))
                bar.refresh()

                def done(row) -> None:
                    bar.advance(task)
                    bar.refresh()

                rows = run_sweep(inp, points, page_size, jobs=jobs, on_point=done)
        else:
            rows = run_sweep(inp, points, page_size, jobs=jobs)
    except MemoryError:
        fail(f"not enough memory for the metadata of {max(caps) // page_size:,} pages; use "
             f"smaller capacities")
    rows = [r.to_dict() for r in rows]
    if plot is not None:
        _plot(rows, plot, os.path.basename(str(trace)), page_size)
    if fmt is OutputFormat.json:
        emit_json({"trace": str(trace), "requests": len(records), "page_size": page_size,
                   "sweep": rows, "plot": str(plot) if plot else None})
    else:
        _print_sweep(rows)
        if plot is not None:
            stdout.print(f"plot written to {plot}")


def _multi_rank(trace: Path, ranks: int, cfg, rank_log_dir: Optional[Path], every: int,
                inject: Optional[str], fmt: OutputFormat, dump_dir: Optional[Path],
                nodes: tuple = (1, 0, None)) -> None:
    from engine.loadgen.trace import load_trace
    from engine.parallel.divergence import parse_spec
    from engine.sim.replay_ranks import RankRun, replay_ranks
    from hicache_cli.output import EXIT_CHECK, EXIT_ERROR

    load_trace(str(trace), cfg.limit)        # fail fast, in this process, on a bad trace
    if inject:
        parse_spec(inject)
    if every and rank_log_dir is None:
        fail("--enable-rank-consensus needs --rank-log-dir (where logs go on divergence)",
             code=2)
    stderr.print(f"replaying on {ranks} rank{'' if ranks == 1 else 's'} (gloo)"
                 f"{' with online consensus' if every else ''}")
    results = replay_ranks(RankRun(str(trace), cfg, ranks,
                                   str(rank_log_dir) if rank_log_dir else None, every, inject,
                                   str(dump_dir) if dump_dir else None, *nodes))
    errors = [r for r in results if "error" in r]
    if errors:
        fail(f"rank {errors[0]['rank']} failed: {errors[0]['error']}", code=EXIT_ERROR)
    diverged = [r for r in results if "consensus_error" in r]
    # without online consensus nothing compared the ranks' decisions: consistent is unknown
    out = {"trace": str(trace), "ranks": ranks, "nnodes": nodes[0], "node_rank": nodes[1],
           "local_ranks": [r["rank"] for r in results], "online_consensus": bool(every),
           "consistent": not diverged if every else None}
    if diverged:
        out["consensus_error"] = diverged[0]["consensus_error"]
        out["rank_log_dir"] = diverged[0]["log_dir"]
    else:
        out["result"] = results[0]["result"]
        out["online_checks"] = results[0]["online_checks"]
        out["identical_hit_rates"] = len({r["result"]["token_hit_rate"] for r in results}) == 1
        if rank_log_dir is not None:
            out["rank_logs"] = [r["rank_log"] for r in results]
        if dump_dir is not None:
            out["tree_snapshots"] = [r["tree_snapshot"] for r in results]
    if fmt is OutputFormat.json:
        emit_json(out)
    elif diverged:
        stdout.print(f"[bold red]✗[/] {out['consensus_error']}", markup=True)
    else:
        _print_result({**out["result"], "trace": str(trace)})
        if every:
            stdout.print(f"{ranks} ranks agreed ({out['online_checks']} online checks)")
        else:
            hint = (f"; run `hicache consensus-check {rank_log_dir}` to compare their logs"
                    if rank_log_dir is not None else "")
            rates = "" if out["identical_hit_rates"] else " (their hit rates differ)"
            stdout.print(f"{ranks} ranks finished{rates}; their decisions were not compared "
                         f"(no --enable-rank-consensus){hint}", markup=False)
    if diverged:
        raise typer.Exit(EXIT_CHECK)


def _print_result(d: dict) -> None:
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


def _print_sweep(rows: list[dict]) -> None:
    from rich.table import Table

    caps = sorted({r["l1_tokens"] for r in rows})
    pols = list(dict.fromkeys(r["policy"] for r in rows))
    t = Table(title="token hit rate vs L1 capacity", title_justify="left")
    t.add_column("L1 tokens", justify="right")
    for pol in pols:
        t.add_column(pol, justify="right")
    by = {(r["policy"], r["l1_tokens"]): r["token_hit_rate"] for r in rows}
    for cap in caps:
        t.add_row(f"{cap:,}", *[f"{by[(p, cap)]:.4f}" for p in pols])
    stdout.print(t)


def _plot(rows: list[dict], path: Path, trace_name: str, page_size: int) -> None:
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
