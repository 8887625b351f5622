"""The aiohttp application: SGLang- and OpenAI-compatible endpoints over one :class:`Engine`.

Handlers run on the server's event loop; the scheduler runs in its own thread. A request is
submitted with a callback that hands each :class:`~engine.runtime.scheduler.RequestOutput` to the
handler's ``asyncio.Queue`` (``call_soon_threadsafe``). Whatever ends a handler early — the
client disconnecting, a failed write, cancellation — aborts the request in a ``finally``, so its
pages and locks are released.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from typing import Any, AsyncIterator, Callable

from aiohttp import web

from engine.core.errors import HiCacheError, InputError, OutOfCapacity
from engine.runtime.scheduler import RequestOutput
from engine.runtime.serving import metrics as prom
from engine.runtime.serving.protocol import (
    MAX_BODY_BYTES,
    ParsedRequest,
    openai_finish_reason,
    parse_completions,
    parse_generate,
    sglang_finish_reason,
)
from engine.runtime.serving.runtime import Engine

log = logging.getLogger("hicache.server")

ENGINE_KEY: web.AppKey[Engine] = web.AppKey("engine", Engine)
_POLL_S = 0.25          # how often a waiting handler checks that its client is still there


class ClientGone(Exception):
    """The client closed the connection; the request is aborted."""


def _error(status: int, message: str, kind: str = "invalid_request_error") -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "code": status}},
                             status=status)


@web.middleware
async def _errors(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        return await handler(request)
    except InputError as exc:
        return _error(400, str(exc))
    except OutOfCapacity as exc:
        return _error(503, str(exc), "overloaded")
    except HiCacheError as exc:
        return _error(500, str(exc), "server_error")
    except web.HTTPException as exc:
        if exc.status >= 400 and exc.content_type != "application/json":
            return _error(exc.status, exc.reason)
        raise
    except (ClientGone, ConnectionResetError, asyncio.CancelledError):
        raise
    except Exception:  # noqa: BLE001 - logged with its traceback, answered as 500
        log.exception("unhandled error in %s %s", request.method, request.path)
        return _error(500, "internal server error (see the server log)", "server_error")


async def _json_body(request: web.Request) -> Any:
    raw = await request.read()
    try:
        return json.loads(raw)
    except UnicodeDecodeError:
        raise InputError("the request body is not UTF-8") from None
    except json.JSONDecodeError as exc:
        raise InputError(f"malformed JSON: {exc.msg} at line {exc.lineno} column "
                         f"{exc.colno}") from None


def _gone(request: web.Request) -> bool:
    t = request.transport
    return t is None or t.is_closing()


# -- one submitted request ---------------------------------------------------------------
@dataclasses.dataclass
class _Sub:
    rid: str
    prompt_len: int
    stream: Any                        # tokenizer StreamDecoder or None
    ids: list[int] = dataclasses.field(default_factory=list)
    text: str = ""
    delta: str = ""
    meta: dict | None = None
    reason: str | None = None
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.reason is not None

    def apply(self, out: RequestOutput) -> None:
        self.ids.extend(out.new_token_ids)
        d = []
        if self.stream is not None:
            d = [self.stream.push(t) for t in out.new_token_ids]
            if out.finished:
                d.append(self.stream.flush())
        self.delta = "".join(d)
        self.text += self.delta
        if out.meta is not None:
            self.meta = out.meta
        if out.finished:
            self.reason = out.finish_reason.value if out.finish_reason else "error"
            self.error = out.error


class _Batch:
    """The sub-requests of one HTTP request and the queue their outputs arrive on."""

    def __init__(self, engine: Engine, parsed: ParsedRequest):
        self.engine = engine
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[tuple[int, RequestOutput]] = asyncio.Queue()
        tok = engine.tokenizer
        sched = engine.scheduler
        for ids in parsed.prompts:            # validate all before submitting any
            sched.validate(ids, parsed.sampling)
        self.subs: list[_Sub] = []
        try:
            for i, ids in enumerate(parsed.prompts):
                rid = parsed.rid if parsed.rid and len(parsed.prompts) == 1 else \
                    uuid.uuid4().hex
                sched.submit(ids, parsed.sampling, self._callback(i), rid=rid,
                             namespace=parsed.namespace, priority=parsed.priority)
                self.subs.append(_Sub(rid, len(ids), tok.stream() if tok else None))
        except BaseException:
            self.abort()
            raise

    def _callback(self, index: int):
        def cb(out: RequestOutput) -> None:
            try:
                self.loop.call_soon_threadsafe(self.queue.put_nowait, (index, out))
            except RuntimeError:      # the event loop is closed: the server is shutting down
                pass
        return cb

    def abort(self) -> None:
        for s in self.subs:
            if not s.finished:
                self.engine.scheduler.abort(s.rid)

    async def updates(self, request: web.Request) -> AsyncIterator[_Sub]:
        """Yield the sub-request each output updated, until all finished."""
        while not all(s.finished for s in self.subs):
            try:
                i, out = await asyncio.wait_for(self.queue.get(), _POLL_S)
            except asyncio.TimeoutError:
                i, out = -1, None
            if _gone(request):
                raise ClientGone()
            if out is None:
                continue
            sub = self.subs[i]
            sub.apply(out)
            yield sub

    async def finish(self, request: web.Request) -> web.Response | None:
        """Run to completion (non-streaming); the error response if a request failed."""
        async for _ in self.updates(request):
            pass
        return self.failure()

    def failure(self) -> web.Response | None:
        for s in self.subs:
            if s.reason == "error":
                return _error(500, s.error or "internal error", "server_error")
            if s.reason == "abort":
                return _error(503, "the request was aborted (server shutting down)",
                              "overloaded")
        return None


def _sglang_meta(s: _Sub, final: bool) -> dict:
    m = dict(s.meta or {})
    m.setdefault("prompt_tokens", s.prompt_len)
    m["completion_tokens"] = len(s.ids)
    m["finish_reason"] = sglang_finish_reason(s.reason, s.ids, s.error) if final else None
    m.setdefault("cached_tokens", 0)
    m.setdefault("cached_tokens_details", {"device": 0, "host": 0, "storage": 0})
    return m


async def _sse(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                       "Cache-Control": "no-cache"})
    await resp.prepare(request)
    return resp


async def _send(resp: web.StreamResponse, obj: Any) -> None:
    data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))
    await resp.write(f"data: {data}\n\n".encode())


async def _respond(request: web.Request, batch: "_Batch", stream: bool,
                   whole: Callable[[], dict], chunk: Callable[["_Sub"], dict | None],
                   tail: Callable[[], dict | None] | None = None) -> web.StreamResponse:
    """The skeleton both endpoints share: one JSON body (``whole``), or SSE events (``chunk`` per
    update, ``tail`` after the last) ending in ``[DONE]``. A client that goes away aborts the
    batch; so does any other way out."""
    resp: web.StreamResponse | None = None
    try:
        if not stream:
            fail = await batch.finish(request)
            return fail if fail is not None else web.json_response(whole())
        resp = await _sse(request)
        async for s in batch.updates(request):
            if s.reason in ("error", "abort"):
                await _send(resp, {"error": {"message": s.error or s.reason, "code": 500}})
                break
            payload = chunk(s)
            if payload is not None:
                await _send(resp, payload)
        else:
            last = tail() if tail is not None else None
            if last is not None:
                await _send(resp, last)
        await _send(resp, "[DONE]")
        await resp.write_eof()
        return resp
    except (ClientGone, ConnectionResetError):
        log.debug("client of %s went away; request aborted", request.path)
        return resp if resp is not None else web.Response(status=499)
    finally:
        batch.abort()


# -- handlers ------------------------------------------------------------------------------
async def generate(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE_KEY]
    parsed = parse_generate(await _json_body(request), engine.tokenizer)
    batch = _Batch(engine, parsed)

    def whole() -> dict:
        s = batch.subs[0]
        return {"text": s.text, "output_ids": s.ids, "meta_info": _sglang_meta(s, True)}

    def chunk(s: _Sub) -> dict:
        return {"text": s.text, "output_ids": s.ids, "meta_info": _sglang_meta(s, s.finished)}

    return await _respond(request, batch, parsed.stream, whole, chunk)


async def completions(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE_KEY]
    parsed = parse_completions(await _json_body(request), engine.tokenizer)
    batch = _Batch(engine, parsed)
    head = {"id": "cmpl-" + uuid.uuid4().hex, "object": "text_completion",
            "created": int(time.time()), "model": parsed.model or engine.model_name}

    def whole() -> dict:
        return {**head, "choices": [{"index": i, "text": s.text, "logprobs": None,
                                     "finish_reason": openai_finish_reason(s.reason)}
                                    for i, s in enumerate(batch.subs)],
                "usage": _usage(batch.subs)}

    def chunk(s: _Sub) -> dict | None:
        if not s.delta and not s.finished:
            return None
        return {**head, "choices": [{"index": batch.subs.index(s), "text": s.delta,
                                     "logprobs": None,
                                     "finish_reason": openai_finish_reason(s.reason)}]}

    def tail() -> dict | None:
        if not parsed.include_usage:
            return None
        return {**head, "choices": [], "usage": _usage(batch.subs)}

    return await _respond(request, batch, parsed.stream, whole, chunk, tail)


def _usage(subs: list[_Sub]) -> dict:
    prompt = sum(s.prompt_len for s in subs)
    completion = sum(len(s.ids) for s in subs)
    cached = sum((s.meta or {}).get("cached_tokens", 0) for s in subs)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


async def _on_scheduler(engine: Engine, fn: Any) -> Any:
    return await asyncio.wrap_future(engine.scheduler.call(fn))


async def metrics(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    sched = engine.scheduler

    def collect() -> str:
        info = {k: v for k, v in engine.describe().items()
                if k in ("model", "attention", "device", "page_size", "host_layout",
                         "write_policy", "l3")}
        return prom.render(sched.metrics, engine.cache.stats(), sched.num_running(),
                           sched.num_waiting(), info)

    text = await _on_scheduler(engine, collect)
    return web.Response(text=text, content_type="text/plain", charset="utf-8",
                        headers={"X-Prometheus-Format": "0.0.4"})


async def health(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    if not engine.scheduler.alive:
        return _error(503, engine.scheduler.last_error or "scheduler not running",
                      "server_error")
    return web.json_response({"status": "ok"})


async def server_info(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    stats = await _on_scheduler(engine, engine.cache.stats)
    return web.json_response({**engine.describe(), "cache": stats})


async def models(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    return web.json_response({"object": "list", "data": [
        {"id": engine.model_name, "object": "model", "created": 0, "owned_by": "hicache",
         "max_model_len": engine.model.cfg.max_context}]})


async def flush_cache(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]

    def flush() -> dict:
        engine.cache.flush()
        return engine.cache.stats()

    stats = await _on_scheduler(engine, flush)
    return web.json_response({"flushed": True, "l1_used_tokens": stats["l1_used_tokens"],
                              "l2_used_tokens": stats["l2_used_tokens"]})


async def dump_tree(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    from engine.snapshot.take import encode_snapshot, snapshot_of

    meta = {"model": engine.model_name, "source": "bench serve"}
    # Only the copy of the tree runs on the scheduler thread; encoding runs off it.
    snap = await _on_scheduler(engine, lambda: snapshot_of(engine.cache, meta))
    data = await asyncio.get_running_loop().run_in_executor(None, encode_snapshot, snap)
    return web.Response(body=data, content_type="application/octet-stream",
                        headers={"Content-Disposition": 'attachment; filename="tree.snapshot"'})


def make_app(engine: Engine) -> web.Application:
    app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[_errors])
    app[ENGINE_KEY] = engine
    app.router.add_post("/generate", generate)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/health", health)
    app.router.add_get("/get_server_info", server_info)
    app.router.add_route("GET", "/flush_cache", flush_cache)
    app.router.add_route("POST", "/flush_cache", flush_cache)
    app.router.add_post("/dump_tree", dump_tree)
    return app
