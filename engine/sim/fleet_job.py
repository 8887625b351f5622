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

from engine.core.errors import HiCacheError
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


class RouterError(HiCacheError):
    pass


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
def router(urls: list[str], policy: str, extra: list[str] | None = None) -> Iterator[str]:
    """SGLang's router over ``urls`` on a free 127.0.0.1 port, ready (every worker healthy);
    always stopped. ``extra``: more router options (``["--cache-threshold", "0.5"]``)."""
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
                raise RouterError(f"the {policy} router exited {proc.returncode}: "
                                  f"{tail[0][:200] if tail else 'no output'}")
            ws = router_workers(url, timeout=2)
            if len(ws) == len(urls) and all(w.get("is_healthy") for w in ws):
                break
            if time.monotonic() > deadline:
                raise RouterError(f"the {policy} router did not register its {len(urls)} "
                                  f"replicas in {ROUTER_START_S:.0f} s")
            time.sleep(0.2)
        yield url
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()


def _computed(url: str) -> float:
    from engine.loadgen.replicas import replica_counters

    return (replica_counters(url) or {}).get("computed_tokens", 0.0)


def _plain(wl, lc: LoadConfig, label: str) -> LoadResult:
    return run_load(wl, lc)


def run_fleet_job(cfg: MainJobConfig, replicas: int, policies: list[str],
                  runner: Runner = _plain, cache_threshold: float | None = None) -> dict:
    """One run per router policy; ``{"config", "replicas", "runs": {policy: summary +
    "replicas": {"computed_prompt_tokens", "load_spread"}}, "wall_s"}``.
    ``cache_threshold``: the router's ``--cache-threshold`` (None: its default, 0.3)."""
    from engine.runtime.launch import start_server

    t0 = time.perf_counter()
    cfg = fitted(cfg)
    check_config(cfg)
    check_fleet(replicas, policies)
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
                    except OSError as exc:
                        raise RouterError(f"replica {i} did not start: {exc}") from None
                    stack.callback(h.stop)
                    urls.append(h.url)
                wl = build_workload(cfg)        # fresh sessions: the same prompts each run
                extra = ([] if cache_threshold is None
                         else ["--cache-threshold", str(cache_threshold)])
                with router(urls, policy, extra) as url:
                    result = runner(wl, LoadConfig(url=url, concurrency=cfg.concurrency,
                                                   seed=cfg.seed), policy)
                computed = [_computed(u) for u in urls]
            summary = summarize_result(result)
            mean = sum(computed) / len(computed)
            summary["replicas"] = {"computed_prompt_tokens": computed,
                                   "load_spread": max(computed) / mean if mean else 1.0}
            runs[policy] = summary
    tiers = "L1+L2+L3(file, shared)" if cfg.storage else "L1+L2"
    return {"config": {**dataclasses.asdict(cfg), "shape": cfg.shape(), "hicache_tiers": tiers},
            "replicas": replicas, "cache_threshold": cache_threshold, "runs": runs, "wall_s": time.perf_counter() - t0}
