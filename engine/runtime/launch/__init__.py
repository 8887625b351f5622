"""The launcher: the top of the runtime. It starts the rank processes and watches them *before*
rank 0 builds its engine, then runs the HTTP server over that engine.

* :func:`start_server` — in-process on a background thread, returns a :class:`ServerHandle`
  (``.url``, ``.engine``, ``.stop()``): tests and embedding. A lost rank leaves it running,
  unhealthy (``/health`` 503 naming the rank).
* :func:`serve` — in the foreground until SIGINT/SIGTERM (``hicache bench serve``); a lost
  rank stops it (the caller exits 1), a rank that got a signal asks it to stop cleanly.
* :func:`serve_node` (:mod:`.node`) — a node other than 0 of a multi-host server.
* :mod:`.pd_frontend` — the P/D front end in front of its two worker processes.

Layers: engine.runtime.ranks builds and steps a rank, engine.runtime.serving serves HTTP over
rank 0; nothing below imports this package.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
from typing import Callable

from aiohttp import web

from engine.core.heap import freeze_startup_objects
from engine.runtime.config import ServerConfig
from engine.runtime.launch.group import RankGroup
from engine.runtime.launch.node import serve_node
from engine.runtime.ranks.build import build_rank
from engine.runtime.serving import Engine, make_app
from engine.runtime.topology import Topology

__all__ = ["Engine", "RankGroup", "ServerConfig", "ServerHandle", "make_engine", "serve",
           "serve_node", "start_server"]

log = logging.getLogger("hicache.server")

_SHUTDOWN_S = 5.0


def make_engine(cfg: ServerConfig) -> Engine:
    """Rank 0's engine for ``cfg``: the other ranks started first (their processes watched by
    a :class:`RankGroup`), then rank 0 built; the P/D decode worker for ``--disaggregation
    pd|decode``."""
    if cfg.disaggregation in ("pd", "decode"):
        from engine.runtime.pd.serve import PDEngine

        return PDEngine(cfg)
    topo = Topology.of(cfg)
    if topo.single:
        return Engine(cfg)
    group = RankGroup(cfg, topo)
    try:
        rank = build_rank(cfg, topo, rendezvous=group.rendezvous, health=group.health)
    except BaseException:
        group.join(0)
        raise
    return Engine(cfg, rank, group)


async def _start_site(engine: Engine, host: str, port: int) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(make_app(engine), handle_signals=False, access_log=None,
                           shutdown_timeout=_SHUTDOWN_S)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    h, p = runner.addresses[0][:2]
    shown = f"[{h}]" if ":" in h else h
    return runner, f"http://{shown}:{p}"


class ServerHandle:
    """A server running on a background thread. ``stop()`` is idempotent."""

    def __init__(self, engine: Engine, loop: asyncio.AbstractEventLoop, runner: web.AppRunner,
                 url: str, thread: threading.Thread):
        self.engine, self.url = engine, url
        self._loop, self._runner, self._thread = loop, runner, thread
        self._stopped = False

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        self.engine.scheduler.stop()          # aborts what is in flight: handlers return
        fut = asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop)
        try:
            fut.result(timeout=_SHUTDOWN_S + 5)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
            self.engine.stop()                # the other ranks halted, then the rank log

    def __enter__(self) -> "ServerHandle":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_server(cfg: ServerConfig, engine: Engine | None = None) -> ServerHandle:
    """Build (unless given) and start the engine and the HTTP server; return once listening.

    ``cfg.port = 0`` picks a free port (see ``handle.url``).
    """
    engine = engine or make_engine(cfg)
    engine.start()
    loop = asyncio.new_event_loop()
    ready: dict = {}
    started = threading.Event()

    def run() -> None:
        asyncio.set_event_loop(loop)
        try:
            ready["runner"], ready["url"] = loop.run_until_complete(
                _start_site(engine, cfg.host, cfg.port))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            ready["error"] = exc
            started.set()
            return
        started.set()
        loop.run_forever()
        loop.close()

    thread = threading.Thread(target=run, name="hicache-http", daemon=True)
    thread.start()
    started.wait()
    if "error" in ready:
        engine.stop()
        thread.join()
        raise ready["error"]
    return ServerHandle(engine, loop, ready["runner"], ready["url"], thread)


def serve(cfg: ServerConfig, on_ready: Callable[[str, Engine], None] | None = None,
          on_exit: Callable[[Engine], None] | None = None) -> None:
    """Run in the foreground until SIGINT or SIGTERM — or a rank that got one asks for a stop,
    or a lost rank stops the group (``engine.failure`` says which) — then shut down gracefully:
    every rank halted at one step writes its log and snapshot.

    ``on_exit`` runs after the scheduler stopped (the cache is quiescent), before it closes.
    """
    engine = make_engine(cfg)
    log.info("%d startup objects frozen out of the garbage collector's passes",
             freeze_startup_objects())
    engine.start()

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        def wake(_why: str) -> None:
            if not loop.is_closed():
                loop.call_soon_threadsafe(stop.set)
        engine.on_failure = wake
        if engine.group is not None:
            engine.group.watch_stop_requests(wake)
        runner, url = await _start_site(engine, cfg.host, cfg.port)
        try:
            if on_ready is not None:
                on_ready(url, engine)
            await stop.wait()
            if engine.failure:
                log.error("stopping the server: %s", engine.failure)
            log.info("shutting down")
        finally:
            await loop.run_in_executor(None, engine.scheduler.stop)
            await runner.cleanup()

    try:
        asyncio.run(main())
        if on_exit is not None:
            on_exit(engine)
    finally:
        engine.stop()
