"""``hicache bench --replicas N --router POLICY[,POLICY…]``: the main job's workload through SGLang's
router over N replicas, one run per router policy.

Per policy: N in-process HiCache servers (the main job's HiCache configuration: L1, L2 and a file
L3 in one temporary directory that all N share), SGLang's router (``python -m
sglang_router.launch_router``, PyPI ``sglang-router``: the ``fleet`` extra) in front of them on
127.0.0.1, the workload sent through the router, the router and the replicas stopped. Each run
reports what ``bench run`` does (hit rate per tier, TTFT, throughput) plus the load spread: max /
mean over the replicas of the prompt tokens they computed (their
``hicache_computed_prompt_tokens_total``). Policies run one after another on fresh replicas and
a fresh store, so each starts cold.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import socket
import subprocess
import sys
import tempfile
import time
from typing import Iterator

from engine.core.errors import HiCacheError, UsageError
from engine.loadgen.driver import LoadConfig, LoadResult, run_load
from engine.loadgen.report import summarize_result
from engine.sim.main_job import (
    MainJobConfig,
    Runner,
    build_workload,
    check_config,
    fitted,
    server_config,
    torch_threads,
)

ROUTER_POLICIES = ("cache_aware", "round_robin", "power_of_two", "random")
ROUTER_START_S = 120.0
REQUEST_TIMEOUT_S = 120.0
"""One request's limit through the router (a replica or router that stops answering costs a
request this long at most; a dead one fails at once)."""
DEFAULT_CACHE_THRESHOLD = 0.5
"""The router's ``--cache-threshold`` in ``hicache bench --replicas`` (SGLang's own default is
0.3). On the default agentic workload a first prompt is 36% shared prefix: at 0.3 every new
session matches the replica that computed that prefix, and cache_aware puts every session on
one replica; at 0.5 a new session goes to the replica with the smaller tree and stays there."""
OWN_ROUTER_OPTIONS = ("--worker-urls", "--policy", "--host", "--port", "--prometheus-host",
                      "--prometheus-port")
"""Router options the fleet job sets itself; ``--router-args`` may not give them."""


class RouterError(HiCacheError):
    pass


class RouterUsageError(UsageError):
    """The router refused its options (it exited 2 at start, as argparse does)."""


@dataclasses.dataclass
class RunningRouter:
    url: str
    proc: subprocess.Popen
    policy: str

    def exit_code(self) -> int | None:
        """``None`` while it runs; its exit status once it has died (negative: a signal)."""
        return self.proc.poll()


def check_router_args(args: list[str]) -> None:
    own = [a for a in args if a.split("=", 1)[0] in OWN_ROUTER_OPTIONS]
    if own:
        raise ValueError(f"--router-args: {own[0].split('=', 1)[0]} is set by hicache bench "
                         f"itself")


def check_fleet(replicas: int, policies: list[str]) -> None:
    if replicas < 2:
        raise ValueError(f"--replicas must be >= 2 for a fleet run, got {replicas}")
    if replicas > 8:
        raise ValueError(f"--replicas must be at most 8 (in-process replicas), got {replicas}")
    bad = [p for p in policies if p not in ROUTER_POLICIES]
    if bad or not policies:
        raise ValueError(f"--router: unknown policy {bad[0] if bad else ''!r}; choose from "
                         f"{', '.join(ROUTER_POLICIES)}")
    if importlib.util.find_spec("sglang_router") is None:
        raise ValueError("--replicas needs SGLang's router: pip install 'hicache[fleet]' "
                         "(sglang-router)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def router(urls: list[str], policy: str, extra: list[str] | None = None
           ) -> Iterator[RunningRouter]:
    """SGLang's router over ``urls`` on a free 127.0.0.1 port, ready (every worker healthy);
    always stopped. ``extra``: more router options (``["--cache-threshold", "0.5"]``).
    A router that exits before it is ready raises :class:`RouterUsageError` when it exited 2
    (it refused its options), else :class:`RouterError`, with its last log line; one that does
    not register every replica within :data:`ROUTER_START_S` raises :class:`RouterError`
    naming the replicas it lacks."""
    from engine.loadgen.replicas import router_workers

    port = _free_port()
    log = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen([sys.executable, "-m", "sglang_router.launch_router",
                             "--worker-urls", *urls, "--policy", policy, "--host", "127.0.0.1",
                             "--port", str(port), "--prometheus-host", "127.0.0.1",
                             "--prometheus-port", str(_free_port()), "--log-level", "warn",
                             *(extra or [])],
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + ROUTER_START_S
        while True:
            if proc.poll() is not None:
                log.seek(0)
                tail = [ln for ln in log.read().splitlines() if ln.strip()][-1:]
                err = RouterUsageError if proc.returncode == 2 else RouterError
                raise err(f"the {policy} router exited {proc.returncode} at start: "
                          f"{_plain_text(tail[0])[:200] if tail else 'no output'}")
            ws = router_workers(url, timeout=2)
            healthy = {w["url"].rstrip("/") for w in ws if w.get("is_healthy")}
            if all(u.rstrip("/") in healthy for u in urls):
                break
            if time.monotonic() > deadline:
                lacking = [u for u in urls if u.rstrip("/") not in healthy]
                raise RouterError(f"the {policy} router did not register "
                                  f"{', '.join(lacking)} in {ROUTER_START_S:.0f} s")
            time.sleep(0.2)
        yield RunningRouter(url, proc, policy)
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()


def _plain_text(line: str) -> str:
    """A router log line without its ANSI colours."""
    import re

    return re.sub(r"\x1b\[[0-9;]*m", "", line).strip()


def _computed(url: str) -> float:
    from engine.loadgen.replicas import replica_counters

    return (replica_counters(url) or {}).get("computed_tokens", 0.0)


def _plain(wl, lc: LoadConfig, label: str) -> LoadResult:
    return run_load(wl, lc)


def run_fleet_job(cfg: MainJobConfig, replicas: int, policies: list[str],
                  runner: Runner = _plain, cache_threshold: float | None = DEFAULT_CACHE_THRESHOLD,
                  router_args: list[str] | None = None) -> dict:
    """One run per router policy; ``{"config", "replicas", "runs": {policy: summary +
    "replicas": {"computed_prompt_tokens", "load_spread"} + "router_exit"}, "wall_s"}``.
    ``cache_threshold``: the router's ``--cache-threshold`` (None: the router's own default,
    0.3); ``router_args``: more router options, as given. ``router_exit`` is ``None``, or the
    exit status of a router that died during its run (negative: the signal); the run's requests
    after that fail (``connection``) and the job goes on with the next policy."""
    from engine.runtime.launch import start_server

    t0 = time.perf_counter()
    cfg = fitted(cfg)
    check_config(cfg)
    check_fleet(replicas, policies)
    check_router_args(router_args or [])
    runs: dict[str, dict] = {}
    with torch_threads(cfg.threads):
        for policy in policies:
            with tempfile.TemporaryDirectory(prefix="hicache-fleet-l3-") as l3_dir, \
                    contextlib.ExitStack() as stack:
                srv = server_config(cfg, True, l3_dir if cfg.storage else None)
                urls = []
                for i in range(replicas):
                    try:
                        h = start_server(srv)
                    except UsageError:
                        raise
                    except (HiCacheError, OSError) as exc:
                        raise RouterError(f"replica {i} of {replicas} did not start: "
                                          f"{exc}") from None
                    stack.callback(h.stop)
                    urls.append(h.url)
                wl = build_workload(cfg)        # fresh sessions: the same prompts each run
                extra = ([] if cache_threshold is None
                         else ["--cache-threshold", str(cache_threshold)]) + (router_args or [])
                with router(urls, policy, extra) as rt:
                    result = runner(wl, LoadConfig(url=rt.url, concurrency=cfg.concurrency,
                                                   seed=cfg.seed, timeout=REQUEST_TIMEOUT_S),
                                    policy)
                    died = rt.exit_code()
                computed = [_computed(u) for u in urls]
            summary = summarize_result(result)
            mean = sum(computed) / len(computed)
            summary["replicas"] = {"computed_prompt_tokens": computed,
                                   "load_spread": max(computed) / mean if mean else 1.0}
            summary["router_exit"] = died
            runs[policy] = summary
    tiers = "L1+L2+L3(file, shared)" if cfg.storage else "L1+L2"
    return {"config": {**dataclasses.asdict(cfg), "shape": cfg.shape(), "hicache_tiers": tiers},
            "replicas": replicas, "cache_threshold": cache_threshold,
            "router_args": router_args or [], "runs": runs, "wall_s": time.perf_counter() - t0}
