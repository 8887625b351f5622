"""``bench serve --disaggregation pd|prefill|decode``: the worker processes around the link.

* ``pd``: this process serves the HTTP API and is the decode worker; it starts the prefill
  worker as a child process (its own model copy and cache stack) and links to it.
* ``prefill``: this process is a prefill worker only (no HTTP); its link listens on
  ``--pd-addr``. ``decode``: the decode worker and HTTP front end, linking to a prefill worker
  already listening at ``--pd-addr`` (another host, say). Both need the same
  ``HICACHE_RANK_SECRET`` (the link takes only keys derived from it); ``pd`` draws its own.

Both workers build their model from the same ``--model``/``--seed``: the KV one computes is
the KV the other would have computed.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
from typing import Any

from engine.parallel.rendezvous import Watchdog, child_setup, launch_secret
from engine.runtime.config import ServerConfig, parse_pd_addr
from engine.runtime.pd.decode import PDClient
from engine.runtime.pd.link import DECODE, PREFILL, PDLink
from engine.runtime.pd.prefill import PrefillWorker
from engine.runtime.ranks.build import build_rank
from engine.runtime.serving.runtime import Engine
from engine.runtime.topology import Topology

log = logging.getLogger("hicache.pd")

CONNECT_TIMEOUT_S = 120.0
parse_addr = parse_pd_addr        # --pd-addr HOST:PORT (engine.runtime.config)


def prefill_main(cfg: ServerConfig, host: str, port: int, child: bool = False,
                 secret: str | None = None, beat: tuple | None = None) -> None:
    """Run a prefill worker until the decode side says stop or the link closes. ``child``: a
    process another one started — Ctrl-C and SIGTERM sent to the whole process group are left
    to the parent, which stops this worker over the link (or the link closes); it exits with
    its parent, beats for its watchdog (``beat``), and exits 1 when the link is lost."""
    if child:
        import signal

        child_setup(beat)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s prefill %(message)s")
    secret = secret or launch_secret(required=True)
    rank = build_rank(cfg, Topology())    # model + cache stack; no scheduler loop runs
    try:
        link = PDLink(PREFILL, host, port, secret, timeout_s=cfg.pd_link_timeout,
                      connect_timeout_s=CONNECT_TIMEOUT_S)
        log.info("prefill worker linked on %s:%d", host, port)
        stopped = PrefillWorker(rank.model, rank.cache, link,
                                chunk=cfg.chunked_prefill_size,
                                fault=cfg.pd_inject_fault,
                                partial=not cfg.disable_partial_page_reuse).serve_forever()
    finally:
        rank.write_log()
        rank.close()
    if child and not stopped:           # the decode side went away without a stop
        raise SystemExit(1)


def run_prefill(cfg: ServerConfig) -> None:
    """``--disaggregation prefill`` in the foreground: until the decode worker says stop, the
    link closes, or SIGINT/SIGTERM."""
    import signal

    def _exit(*_: Any) -> None:
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, _exit)
    host, port = parse_addr(cfg.pd_addr)
    try:
        prefill_main(cfg, host, port)
    except KeyboardInterrupt:
        pass


class PDEngine(Engine):
    """The decode worker: an :class:`Engine` whose scheduler fetches missing KV over the link
    (``scheduler.remote``), and — in ``pd`` mode — the owner of the prefill worker process."""

    def __init__(self, cfg: ServerConfig):
        if not cfg.pd_decode_reuse:
            cfg = dataclasses.replace(cfg, disable_radix_cache=True)
        host, port = parse_addr(cfg.pd_addr)
        self.prefill_proc: Any = None
        self.watchdog: Watchdog | None = None
        secret = launch_secret(required=cfg.disaggregation == "decode")
        if cfg.disaggregation == "pd":
            if port == 0:
                from engine.parallel.launch import free_port

                port = free_port()
            pcfg = dataclasses.replace(cfg, disaggregation="prefill", pd_addr=f"{host}:{port}",
                                       disable_radix_cache=False, rank_log_dir=None)
            ctx = multiprocessing.get_context("spawn")
            self.watchdog = Watchdog(ctx, 1, cfg.rank_heartbeat_timeout_s)
            self.prefill_proc = ctx.Process(
                target=prefill_main, args=(pcfg, host, port, True, secret,
                                           self.watchdog.beat(0)),
                name="hicache-prefill", daemon=True)
            self.prefill_proc.start()
            self.watchdog.watch({"prefill": (0, self.prefill_proc)}, lambda k: f"{k} worker")
        self.pd_addr = f"{host}:{port}"
        made: list[PDClient] = []

        def client(cache: Any) -> PDClient:      # the link, once the cache exists
            link = PDLink(DECODE, host, port, secret, timeout_s=cfg.pd_link_timeout,
                          connect_timeout_s=CONNECT_TIMEOUT_S)
            made.append(PDClient(link, cache.l1, cfg.page_size, cfg.pd_transfer_timeout))
            return made[0]
        try:
            super().__init__(cfg, remote=client)
        except BaseException:
            if made:
                made[0].close()
            self._stop_prefill(0)
            raise
        self.pd = made[0]

    def pd_health(self) -> str | None:
        """Why the prefill worker is unusable, or None."""
        p = self.prefill_proc
        if self.watchdog is not None and self.watchdog.silent:
            return next(iter(self.watchdog.silent.values()))
        if p is not None and not p.is_alive():
            return f"prefill worker down (exit code {p.exitcode})"
        if self.pd.down is not None:
            return f"prefill worker down: {self.pd.down}"
        return None

    def pd_stats(self) -> dict[str, Any]:
        return {"addr": self.pd_addr, "up": self.pd_health() is None,
                "decode_reuse": self.cfg.pd_decode_reuse, **self.pd.totals}

    def extra_metrics(self) -> str:
        from engine.runtime.pd.metrics import render_pd

        return render_pd(self.pd_stats())

    def _stop_prefill(self, grace: float) -> None:
        p = self.prefill_proc
        if p is None:
            return
        self.watchdog.close()
        p.join(grace)
        if p.is_alive():
            p.terminate()
            p.join(5)

    def stop(self) -> None:
        self.scheduler.stop()
        self.pd.close()
        self._stop_prefill(10)
        super().stop()

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "disaggregation": self.cfg.disaggregation,
                "pd_addr": self.pd_addr, "pd_decode_reuse": self.cfg.pd_decode_reuse}


def make_engine(cfg: ServerConfig) -> Engine:
    """The engine ``bench serve`` runs for ``cfg`` (a plain one without disaggregation)."""
    if cfg.disaggregation in ("pd", "decode"):
        return PDEngine(cfg)
    return Engine(cfg)
