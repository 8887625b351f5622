"""The P/D front end: one HTTP endpoint in its own process, in front of a decode worker process
and a prefill worker process (``hicache bench serve --disaggregation pd``).

It starts both workers (each its own model and cache stack; they link to each other directly),
and forwards every request to the decode worker unchanged — JSON bodies as they are, SSE
streams chunk by chunk — so the API is the decode worker's, i.e. the usual one. ``/health``
is its own: 503 naming the worker when either process is gone, else the decode worker's answer
(which reports a broken link). If the decode worker cannot be reached, requests get a 503 and
the front end stays up. Both workers beat; one silent for ``--rank-heartbeat-timeout`` (stopped,
frozen) is killed and named, so requests on it fail at once instead of hanging. Both exit when
the front end dies.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import multiprocessing
import threading
from typing import Any

import aiohttp
from aiohttp import web

from engine.parallel.rendezvous import SECRET_ENV, Watchdog, child_setup, launch_secret
from engine.runtime.config import ServerConfig, parse_pd_addr
from engine.runtime.pd.serve import prefill_main
from engine.runtime.serving.common import error_response
from engine.runtime.serving.protocol import MAX_BODY_BYTES

log = logging.getLogger("hicache.pd")

_STATE: web.AppKey = web.AppKey("pd_frontend", dict)
WORKER_START_TIMEOUT_S = 300.0


def decode_main(cfg: ServerConfig, urls: Any, secret: str | None = None,
                beat: tuple | None = None) -> None:
    """The decode worker process: the usual server (``--disaggregation decode``) on a free
    port; its URL goes back to the front end. ``secret``: the pair's (from the front end, over
    the spawn pipe); ``beat``: its heartbeat slot."""
    import os
    import signal

    from engine.runtime.launch import serve

    child_setup(beat)
    if secret:
        os.environ[SECRET_ENV] = secret       # for this process's link only
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # the front end stops this worker (SIGTERM)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s decode %(message)s")
    serve(cfg, on_ready=lambda url, _engine: urls.put(url))


class Workers:
    """The two worker processes of one front end."""

    def __init__(self, cfg: ServerConfig):
        from engine.parallel.launch import free_port

        host, port = parse_pd_addr(cfg.pd_addr)
        port = port or free_port()
        addr = f"{host}:{port}"
        ctx = multiprocessing.get_context("spawn")
        pcfg = dataclasses.replace(cfg, disaggregation="prefill", pd_addr=addr,
                                   rank_log_dir=None)
        dcfg = dataclasses.replace(cfg, disaggregation="decode", pd_addr=addr,
                                   host="127.0.0.1", port=0, pd_inject_fault=None)
        urls = ctx.Queue()
        secret = launch_secret()
        self.watchdog = Watchdog(ctx, 2, cfg.rank_heartbeat_timeout_s)
        self.prefill = ctx.Process(target=prefill_main,
                                   args=(pcfg, host, port, True, secret, self.watchdog.beat(0)),
                                   name="hicache-prefill", daemon=True)
        self.decode = ctx.Process(target=decode_main,
                                  args=(dcfg, urls, secret, self.watchdog.beat(1)),
                                  name="hicache-decode", daemon=True)
        self.prefill.start()
        self.decode.start()
        self.watchdog.watch({"prefill": (0, self.prefill), "decode": (1, self.decode)},
                            lambda k: f"{k} worker")
        for name, pid in self.pids().items():
            log.info("P/D %s worker: pid %d", name, pid)
        try:
            self.decode_url = urls.get(timeout=WORKER_START_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - queue.Empty: the decode worker never came up
            self.stop()
            code = self.decode.exitcode
            raise RuntimeError(f"the decode worker did not start (exit code {code})") from None

    def down(self) -> str | None:
        """Why the pair cannot serve, naming the worker that failed first: one the watchdog
        killed (silent), else one that died — before its peer, which exits (code 1) when it
        loses the link."""
        if self.watchdog.silent:
            return next(iter(self.watchdog.silent.values()))
        gone = [(p.exitcode in (0, 1), name, p.exitcode)
                for name, p in (("decode", self.decode), ("prefill", self.prefill))
                if not p.is_alive()]
        if gone:
            _, name, code = min(gone)
            return f"{name} worker down (exit code {code})"
        return None

    def pids(self) -> dict[str, int | None]:
        return {"prefill": self.prefill.pid, "decode": self.decode.pid}

    def stop(self) -> None:
        """SIGTERM the decode worker (it stops the prefill worker over the link), then make
        sure both are gone."""
        self.watchdog.close()
        if self.decode.is_alive():
            self.decode.terminate()
        self.decode.join(20)
        self.prefill.join(10)
        for p in (self.decode, self.prefill):
            if p.is_alive():
                p.kill()
                p.join(5)


async def _proxy(request: web.Request) -> web.StreamResponse:
    st = request.app[_STATE]
    url = st["workers"].decode_url + str(request.rel_url)
    body = await request.read()
    headers = {k: v for k, v in request.headers.items()
               if k.lower() in ("content-type", "accept", "authorization")}
    try:
        async with st["session"].request(request.method, url, data=body,
                                         headers=headers) as up:
            ctype = up.headers.get("Content-Type", "application/octet-stream")
            if ctype.startswith("text/event-stream"):
                resp = web.StreamResponse(status=up.status, headers={
                    "Content-Type": ctype, "Cache-Control": "no-cache"})
                await resp.prepare(request)
                async for chunk in up.content.iter_any():
                    await resp.write(chunk)
                await resp.write_eof()
                return resp
            extra = {k: v for k, v in up.headers.items()
                     if k.lower() in ("content-disposition", "x-prometheus-format")}
            return web.Response(status=up.status, body=await up.read(),
                                headers={"Content-Type": ctype, **extra})
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        why = st["workers"].down() or f"decode worker unreachable: {exc}"
        return error_response(503, why, "server_error")


async def _health(request: web.Request) -> web.StreamResponse:
    down = request.app[_STATE]["workers"].down()
    if down is not None:
        return error_response(503, down, "server_error")
    return await _proxy(request)


def make_frontend_app(workers: Workers) -> web.Application:
    app = web.Application(client_max_size=MAX_BODY_BYTES)
    app[_STATE] = {"workers": workers, "session": None}

    async def session_ctx(app: web.Application):
        app[_STATE]["session"] = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10))
        yield
        await app[_STATE]["session"].close()

    app.cleanup_ctx.append(session_ctx)
    app.router.add_get("/health", _health)
    app.router.add_route("*", "/{tail:.*}", _proxy)
    return app


class FrontendHandle:
    """A front end on a background thread with its two workers (tests, embedding)."""

    def __init__(self, cfg: ServerConfig):
        self.workers = Workers(cfg)
        self._loop = asyncio.new_event_loop()
        ready: dict = {}
        started = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self._loop)

            async def up() -> None:
                runner = web.AppRunner(make_frontend_app(self.workers), access_log=None)
                await runner.setup()
                site = web.TCPSite(runner, cfg.host, cfg.port)
                await site.start()
                ready["runner"] = runner
                h, p = runner.addresses[0][:2]
                ready["url"] = f"http://{h}:{p}"

            try:
                self._loop.run_until_complete(up())
            except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
                ready["error"] = exc
            started.set()
            if "error" not in ready:
                self._loop.run_forever()

        self._thread = threading.Thread(target=run, name="hicache-pd-frontend", daemon=True)
        self._thread.start()
        started.wait()
        if "error" in ready:
            self.workers.stop()
            raise ready["error"]
        self.url, self._runner = ready["url"], ready["runner"]

    def stop(self) -> None:
        fut = asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop)
        try:
            fut.result(15)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self.workers.stop()

    def __enter__(self) -> "FrontendHandle":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve_frontend(cfg: ServerConfig, on_ready: Any = None) -> None:
    """``bench serve --disaggregation pd`` in the foreground, until SIGINT/SIGTERM."""
    import signal

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    with FrontendHandle(cfg) as h:
        if on_ready is not None:
            on_ready(h.url, h.workers)
        while not stop.wait(0.5):
            pass
