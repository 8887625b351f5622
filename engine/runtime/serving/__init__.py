"""The benchmark server: an aiohttp app over the model, the cache and the scheduler.

* :func:`start_server` runs it in-process on a background thread and returns a
  :class:`ServerHandle` (``.url``, ``.engine``, ``.stop()``) — for tests and embedding.
* :func:`serve` runs it in the foreground until SIGINT/SIGTERM (``hicache bench serve``).

Endpoints and their formats: docs/model-and-server.md.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
from typing import Callable

from aiohttp import web

from engine.runtime.serving.app import make_app
from engine.runtime.serving.runtime import Engine, ServerConfig

__all__ = ["Engine", "ServerConfig", "ServerHandle", "make_app", "serve", "start_server"]

log = logging.getLogger("hicache.server")

_SHUTDOWN_S = 5.0


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
            self.engine.stop()                # rank log (if asked), then the cache closes

    def __enter__(self) -> "ServerHandle":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def make_engine(cfg: ServerConfig) -> Engine:
    """A plain :class:`Engine`, or the P/D decode worker for ``--disaggregation pd|decode``."""
    if cfg.disaggregation is None:
        return Engine(cfg)
    from engine.runtime.pd.serve import make_engine as make_pd_engine

    return make_pd_engine(cfg)


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
    """Run in the foreground until SIGINT or SIGTERM; then shut down gracefully.

    ``on_exit`` runs after the scheduler stopped (the cache is quiescent), before it closes.
    """
    engine = make_engine(cfg)
    engine.start()

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        runner, url = await _start_site(engine, cfg.host, cfg.port)
        try:
            if on_ready is not None:
                on_ready(url, engine)
            await stop.wait()
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
