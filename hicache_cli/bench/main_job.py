"""``hicache bench`` with no sub-command: the all-in-one comparison.

Starts the benchmark server in-process (``engine.runtime.serving.start_server``) on a free 127.0.0.1
port, runs the default multi-turn workload against it with L1 only (``--l2-tokens 0``), restarts
it with HiCache (the same L1 plus L2, plus a file-backed L3 in a temporary directory when the
server offers one) and prints both runs side by side. The server is always stopped — on success,
on an error and on Ctrl-C.

The default sizes are chosen so the L1-only run thrashes: a client's history grows to ~1.6K
tokens, L1 holds 4K, and with 8 clients taking turns (FIFO) each client's history is evicted
before its next round, while the 32K-token L2 holds all of them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import tempfile
import time
from typing import Iterator

import typer

from engine.core.errors import HiCacheError
from engine.loadgen.driver import LoadConfig
from engine.loadgen.report import summarize_result
from engine.loadgen.workloads import ConversationConfig, multiturn
from hicache_cli.bench.run_cmd import report_table, run_with_progress
from hicache_cli.output import OutputFormat, emit_json, fail, handle_errors, stdout


class ServerStartError(HiCacheError):
    pass


@dataclasses.dataclass(frozen=True)
class MainJobConfig:
    num_clients: int = 8
    num_rounds: int = 8
    request_length: int = 192
    output_length: int = 8
    concurrency: int = 4
    l1_tokens: int = 4096
    l2_tokens: int = 4096       # = L1: the history spills to the file L3, so all three tiers hit
    storage: bool = True
    device: str = "auto"
    model: str = "tiny"
    seed: int = 0


def storage_fields() -> dict[str, str] | None:
    """``ServerConfig`` field names for a file L3 (backend, directory), if the server has one."""
    from engine.runtime.serving import ServerConfig

    names = {f.name for f in dataclasses.fields(ServerConfig)}
    for backend, directory in (("hicache_storage_backend", "hicache_storage_dir"),
                               ("storage_backend", "storage_dir")):
        if backend in names and directory in names:
            return {"backend": backend, "dir": directory}
    return None


def server_config(cfg: MainJobConfig, hicache: bool, storage_dir: str | None):
    from engine.runtime.serving import ServerConfig

    extra = {}
    fields = storage_fields()
    if hicache and storage_dir is not None and fields is not None:
        extra = {fields["backend"]: "file", fields["dir"]: storage_dir}
    return ServerConfig(host="127.0.0.1", port=0, device=cfg.device, model=cfg.model,
                        l1_tokens=cfg.l1_tokens, l2_tokens=cfg.l2_tokens if hicache else 0,
                        **extra)


@contextlib.contextmanager
def embedded_server(server_cfg, label: str) -> Iterator[str]:
    """Start the benchmark server in-process on a free 127.0.0.1 port; always stop it."""
    from engine.runtime.serving import start_server

    try:
        handle = start_server(server_cfg)
    except OSError as exc:
        raise ServerStartError(f"{label} server did not start: {exc}") from None
    try:
        yield handle.url
    finally:
        handle.stop()


def check_config(cfg: MainJobConfig) -> None:
    """Usage errors (``ValueError``) before anything starts: the device, and a last round that
    could never fit in L1 (the server would refuse it with HTTP 400 in both runs)."""
    from engine.core.device import resolve_device
    from engine.runtime.serving import ServerConfig

    resolve_device(cfg.device)
    shape = ConversationConfig(num_clients=cfg.num_clients, num_rounds=cfg.num_rounds,
                               request_length=cfg.request_length, output_length=cfg.output_length)
    # as the server counts: whole pages, KV for the prompt and every output token but the last
    page = ServerConfig.page_size
    need = -(-(shape.max_prompt_tokens + cfg.output_length - 1) // page) * page
    if need > cfg.l1_tokens // page * page:
        raise ValueError(f"the last round needs {need} tokens of KV (pages of {page}) but "
                         f"--l1-tokens {cfg.l1_tokens} holds {cfg.l1_tokens // page * page}; "
                         f"raise --l1-tokens or lower --num-rounds / --request-length")


def run_main_job(cfg: MainJobConfig, *, show_progress: bool = True) -> dict:
    """Both runs; returns ``{"config", "runs": {"l1_only", "hicache"}, "wall_s"}``."""
    t0 = time.perf_counter()
    use_storage = cfg.storage and storage_fields() is not None
    check_config(cfg)
    runs: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="hicache-bench-l3-") as l3_dir:
        servers = {"l1_only": server_config(cfg, False, None),
                   "hicache": server_config(cfg, True, l3_dir if use_storage else None)}
        for name, srv in servers.items():
            label = "HiCache" if name == "hicache" else "L1 only"
            wl = multiturn(cfg.num_clients, cfg.num_rounds, cfg.request_length,
                           cfg.output_length, seed=cfg.seed)
            with embedded_server(srv, label) as url:
                result = run_with_progress(wl, LoadConfig(url=url, concurrency=cfg.concurrency,
                                                          seed=cfg.seed),
                                           label=label, show=show_progress)
            runs[name] = summarize_result(result)
    tiers = "L1+L2+L3(file)" if use_storage else "L1+L2"
    return {"config": {**dataclasses.asdict(cfg), "hicache_tiers": tiers, "storage": use_storage},
            "runs": runs, "wall_s": time.perf_counter() - t0}


def _ratio(a: float | None, b: float | None) -> str:
    if not a or not b:
        return "-"
    return f"{a / b:.2f}x"


def _print_human(res: dict) -> None:
    cfg, a, b = res["config"], res["runs"]["l1_only"], res["runs"]["hicache"]
    title = (f"multiturn: {cfg['num_clients']} clients x {cfg['num_rounds']} rounds, "
             f"{cfg['request_length']} tokens/turn, L1 {cfg['l1_tokens']} tokens")
    stdout.print(report_table([("L1 only", a), (f"HiCache {cfg['hicache_tiers']}", b)],
                              title=title))
    stdout.print(f"HiCache vs L1 only: hit rate {100 * (a['hit_rate']['total'] or 0):.1f}% -> "
                 f"{100 * (b['hit_rate']['total'] or 0):.1f}%, "
                 f"TTFT p50 {_ratio(a['ttft_s']['p50'], b['ttft_s']['p50'])} lower, "
                 f"throughput {_ratio(b['throughput']['input_tokens_per_s'], a['throughput']['input_tokens_per_s'])}"
                 f" (input tokens/s); wall {res['wall_s']:.1f} s")


def main_job(
    ctx: typer.Context,
    num_clients: int = typer.Option(MainJobConfig.num_clients, min=1, help="Multi-turn clients."),
    num_rounds: int = typer.Option(MainJobConfig.num_rounds, min=1, help="Rounds per client."),
    request_length: int = typer.Option(MainJobConfig.request_length, min=1, help="New tokens per round."),
    output_length: int = typer.Option(MainJobConfig.output_length, min=1, help="Tokens generated per request."),
    concurrency: int = typer.Option(MainJobConfig.concurrency, min=1, help="Requests in flight."),
    l1_tokens: int = typer.Option(MainJobConfig.l1_tokens, min=1, help="L1 (device) size, same in both runs."),
    l2_tokens: int = typer.Option(MainJobConfig.l2_tokens, min=1, help="L2 (host) size of the HiCache run."),
    storage: bool = typer.Option(True, "--storage/--no-storage",
                                 help="Add a file L3 in a temp dir to the HiCache run (when the server has one)."),
    device: str = typer.Option("auto", help="auto | cpu | cuda[:N]."),
    model: str = typer.Option("tiny", help="Model preset or local checkpoint dir."),
    seed: int = typer.Option(0, help="Seed of the generated prompts."),
    fmt: OutputFormat = typer.Option(OutputFormat.human, "--format", help="human | json."),
) -> None:
    """Compare L1 only with HiCache on the default multi-turn workload (embedded server)."""
    if ctx.invoked_subcommand is not None:
        return
    _main_job(MainJobConfig(num_clients=num_clients, num_rounds=num_rounds,
                            request_length=request_length, output_length=output_length,
                            concurrency=concurrency, l1_tokens=l1_tokens, l2_tokens=l2_tokens,
                            storage=storage, device=device, model=model, seed=seed), fmt)


@handle_errors
def _main_job(cfg: MainJobConfig, fmt: OutputFormat) -> None:
    res = run_main_job(cfg)
    failed = {k: r["first_error"] for k, r in res["runs"].items() if r["requests"]["failed"]}
    if fmt is OutputFormat.json:
        emit_json(res)
    else:
        _print_human(res)
    if failed:
        fail("requests failed: " + "; ".join(f"{k}: {v}" for k, v in failed.items()))


def register(app: typer.Typer) -> None:
    app.callback(invoke_without_command=True)(main_job)
