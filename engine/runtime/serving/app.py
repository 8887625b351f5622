"""The aiohttp application: SGLang- and OpenAI-compatible endpoints over one :class:`Engine`.

Handlers run on the server's event loop; the scheduler runs in its own thread. A request is
submitted with a callback that hands each :class:`~engine.runtime.scheduler.RequestOutput` to the
handler's ``asyncio.Queue`` (``call_soon_threadsafe``). Whatever ends a handler early — the
client disconnecting, a failed write, cancellation — aborts the request in a ``finally``, so its
pages and locks are released.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from typing import Any, Callable

from aiohttp import web

from engine.core.errors import HiCacheError, InputError, OutOfCapacity
from engine.runtime.serving import info, shapes
from engine.runtime.serving import metrics as prom
from engine.runtime.serving.batch import Batch, ClientGone, Sub
from engine.runtime.serving.common import ENGINE_KEY, error_response, on_scheduler
from engine.runtime.serving.protocol import (
    MAX_BODY_BYTES,
    openai_finish_reason,
    parse_chat,
    parse_completions,
    parse_generate,
)
from engine.runtime.serving.runtime import Engine
from formats import boundedjson

log = logging.getLogger("hicache.server")

_error = error_response
_on_scheduler = on_scheduler


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
    except (ClientGone, ConnectionResetError):
        # the client went away (mid-upload, mid-response): one debug line, no traceback
        log.debug("client of %s %s went away", request.method, request.path)
        return web.Response(status=499)
    except asyncio.CancelledError:
        raise
    except Exception:  # noqa: BLE001 - logged with its traceback, answered as 500
        log.exception("unhandled error in %s %s", request.method, request.path)
        return _error(500, "internal server error (see the server log)", "server_error")


async def _json_body(request: web.Request) -> Any:
    """The body as JSON, bounded (:mod:`formats.boundedjson`: nesting depth, integer size,
    finite numbers, valid Unicode): anything else is a 400 ``invalid_request_error``."""
    try:
        raw = await request.read()
    except ConnectionResetError:        # the client left mid-upload (aiohttp: connection lost)
        raise ClientGone() from None
    try:
        return boundedjson.loads(raw)
    except boundedjson.JSONLimitError as exc:
        raise InputError(f"malformed JSON body: {exc}") from None


async def _sse(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                       "Cache-Control": "no-cache"})
    await resp.prepare(request)
    return resp


async def _send(resp: web.StreamResponse, obj: Any) -> None:
    data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))
    await resp.write(f"data: {data}\n\n".encode())


async def _respond(request: web.Request, batch: Batch, stream: bool,
                   whole: Callable[[], Any], chunk: Callable[[Sub], Any],
                   tail: Callable[[], dict | None] | None = None) -> web.StreamResponse:
    """The skeleton every endpoint shares: one JSON body (``whole``), or SSE events (``chunk``
    per update: a payload, a list of them or None; ``tail`` after the last) ending in
    ``[DONE]``. A client that goes away aborts the batch; so does any other way out."""
    resp: web.StreamResponse | None = None
    try:
        if not stream:
            fail = await batch.finish(request)
            return fail if fail is not None else web.json_response(whole())
        resp = await _sse(request)
        async for s in batch.updates(request):
            if s.reason in ("error", "abort"):     # 503: the server lost a rank or worker
                code = 503 if s.reason == "error" and batch.unavailable(s.error) else 500
                await _send(resp, {"error": {"message": s.error or s.reason, "code": code}})
                break
            payload = chunk(s)
            for p in payload if isinstance(payload, list) else [payload]:
                if p is not None:
                    await _send(resp, p)
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
    batch = Batch(engine, parsed)

    def whole() -> Any:
        items = [shapes.generate_item(batch, s, True) for s in batch.subs]
        return items if parsed.batched else items[0]

    def chunk(s: Sub) -> dict | None:
        if not s.new_ids and not s.finished:
            return None
        if not s.finished and parsed.stream_interval > 1 and \
                len(s.ids) % parsed.stream_interval:
            return None
        return shapes.generate_item(batch, s, s.finished)

    return await _respond(request, batch, parsed.stream, whole, chunk)


def _storage_backend(engine: Engine) -> str | None:
    return engine.cfg.hicache_storage_backend if engine.cache.l3 is not None else None


async def completions(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE_KEY]
    tok = engine.tokenizer
    parsed = parse_completions(await _json_body(request), tok)
    batch = Batch(engine, parsed)
    head = {"id": "cmpl-" + uuid.uuid4().hex, "object": "text_completion",
            "created": int(time.time()), "model": parsed.model or engine.model_name}
    prompt_text = [tok.decode(p) if tok is not None and parsed.echo else ""
                   for p in parsed.prompts]
    sent: set[int] = set()            # choices whose echo / logprob prefix went out

    def choice(s: Sub, text: str, ids: list[int], lps: list, first: bool) -> dict:
        c: dict[str, Any] = {"index": s.index, "text": text, "logprobs": None,
                             "finish_reason": openai_finish_reason(s.reason),
                             "matched_stop": s.matched_stop if s.finished else None}
        if parsed.logprobs is not None:
            view = Sub(s.index, s.prompt_index, s.rid, s.prompt_ids, None, (), ids,
                       logprobs=lps, input_logprobs=s.input_logprobs)
            c["logprobs"] = shapes.completion_logprobs(
                tok, view, parsed.echo and first,
                0 if first else len(prompt_text[s.prompt_index]) + len(s.text) - len(text))
        return c

    def whole() -> dict:
        body = {**head, "choices": [
            choice(s, prompt_text[s.prompt_index] + s.text, s.ids, s.logprobs, True)
            for s in batch.subs], "usage": shapes.usage(batch)}
        if parsed.cached_details:
            body["sglext"] = shapes.sglext(batch, _storage_backend(engine))
        return body

    def chunk(s: Sub) -> dict | None:
        first = s.index not in sent
        if not s.delta and not s.finished and not (first and parsed.echo):
            return None
        sent.add(s.index)
        text = (prompt_text[s.prompt_index] if first else "") + s.delta
        body = {**head, "choices": [choice(s, text, s.new_ids, s.new_logprobs, first)]}
        if s.finished and batch.done and parsed.cached_details:
            body["sglext"] = shapes.sglext(batch, _storage_backend(engine))
        return body

    def tail() -> dict | None:
        if not parsed.include_usage:
            return None
        return {**head, "choices": [], "usage": shapes.usage(batch)}

    return await _respond(request, batch, parsed.stream, whole, chunk, tail)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE_KEY]
    tok = engine.tokenizer
    parsed = parse_chat(await _json_body(request), tok)
    batch = Batch(engine, parsed)
    cid, created = "chatcmpl-" + uuid.uuid4().hex, int(time.time())
    model = parsed.model or engine.model_name
    started: set[int] = set()

    def lp(ids: list[int], lps: list) -> dict | None:
        return shapes.chat_logprobs(tok, ids, lps) if parsed.logprobs is not None else None

    def whole() -> dict:
        body = {"id": cid, "object": "chat.completion", "created": created, "model": model,
                "choices": [{"index": s.index,
                             "message": {"role": "assistant", "content": s.text,
                                         "reasoning_content": None, "tool_calls": None},
                             "logprobs": lp(s.ids, s.logprobs),
                             "finish_reason": openai_finish_reason(s.reason),
                             "matched_stop": s.matched_stop} for s in batch.subs],
                "usage": shapes.usage(batch)}
        if parsed.cached_details:
            body["sglext"] = shapes.sglext(batch, _storage_backend(engine))
        return body

    def event(choice: dict) -> dict:
        return {"id": cid, "object": "chat.completion.chunk", "created": created,
                "model": model, "choices": [choice]}

    def chunk(s: Sub) -> list[dict]:
        out = []
        if s.index not in started:
            started.add(s.index)
            out.append(event({"index": s.index, "delta": {"role": "assistant", "content": ""},
                              "logprobs": None, "finish_reason": None}))
        if s.delta or s.finished:
            out.append(event({"index": s.index, "delta": {"content": s.delta} if s.delta
                              else {}, "logprobs": lp(s.new_ids, s.new_logprobs),
                              "finish_reason": openai_finish_reason(s.reason),
                              "matched_stop": s.matched_stop if s.finished else None}))
            if s.finished and batch.done and parsed.cached_details:
                out[-1]["sglext"] = shapes.sglext(batch, _storage_backend(engine))
        return out

    def tail() -> dict | None:
        if not parsed.include_usage:
            return None
        return {"id": cid, "object": "chat.completion.chunk", "created": created,
                "model": model, "choices": [], "usage": shapes.usage(batch)}

    return await _respond(request, batch, parsed.stream, whole, chunk, tail)


async def metrics(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    sched = engine.scheduler

    def collect() -> str:
        info = {k: v for k, v in engine.describe().items()
                if k in ("model", "attention", "device", "page_size", "host_layout",
                         "write_policy", "l3")}
        text = prom.render(sched.metrics, engine.cache.stats(), sched.num_running(),
                           sched.num_waiting(), info)
        if hasattr(engine, "pd_stats"):          # P/D decode worker: the link's audit
            from engine.runtime.pd.metrics import render_pd

            text += render_pd(engine.pd_stats())
        return text

    text = await _on_scheduler(engine, collect)
    return web.Response(text=text, content_type="text/plain", charset="utf-8",
                        headers={"X-Prometheus-Format": "0.0.4"})


async def flush_cache(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]

    after = await _on_scheduler(engine, engine.flush)
    stats = await asyncio.wrap_future(after)
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
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/metrics", metrics)
    info.add_routes(app)
    app.router.add_route("GET", "/flush_cache", flush_cache)
    app.router.add_route("POST", "/flush_cache", flush_cache)
    app.router.add_post("/dump_tree", dump_tree)
    return app
