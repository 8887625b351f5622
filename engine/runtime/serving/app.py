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
import os
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from aiohttp import web

from engine.core.errors import HiCacheError, InputError, OutOfCapacity
from engine.runtime.serving import info, session_routes, shapes
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


BIG_BODY_BYTES = 256 << 10
"""A body at least this large (or of unknown length) is read under one of BODY_SLOTS and
parsed on a worker thread, never on the event loop."""
BODY_SLOTS = 2
"""Large bodies read and parsed at once: memory stays at a few times MAX_BODY_BYTES however
many clients send them; the rest wait their turn (the loop keeps answering meanwhile)."""
MAX_TOKEN_CHARS = 64
"""Prompt text longer than ``max_context`` x this many characters cannot fit the context (no
token spans more) and is refused before it is tokenized."""
_SLOTS_KEY = web.AppKey("body_slots", asyncio.Semaphore)
_parsers = ThreadPoolExecutor(max_workers=BODY_SLOTS, thread_name_prefix="hicache-body")


def _loads(raw: bytes) -> Any:
    try:
        return boundedjson.loads(raw)
    except boundedjson.JSONLimitError as exc:
        raise InputError(f"malformed JSON body: {exc}") from None


async def _read(request: web.Request) -> bytes:
    try:
        return await request.read()
    except ConnectionResetError:        # the client left mid-upload (aiohttp: connection lost)
        raise ClientGone() from None


async def _json_body(request: web.Request) -> Any:
    """The body as JSON, bounded (:mod:`formats.boundedjson`: nesting depth, integer size,
    finite numbers, valid Unicode): anything else is a 400 ``invalid_request_error``."""
    return await _parsed_body(request, lambda body: body)


class _BoundedTokenizer:
    """The engine's tokenizer, refusing text too long for the model's context before
    encoding it (a 60 MiB prompt would otherwise become tens of millions of token ids)."""

    def __init__(self, tok: Any, max_context: int):
        self._tok, self._max_chars = tok, max_context * MAX_TOKEN_CHARS
        self._max_context = max_context

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tok, name)

    def encode(self, text: str, *args: Any, **kw: Any) -> list[int]:
        if len(text) > self._max_chars:
            raise InputError(f"the prompt text of {len(text):,} characters cannot fit the "
                             f"model's context of {self._max_context:,} tokens (at most "
                             f"{self._max_chars:,} characters are tokenized)")
        return self._tok.encode(text, *args, **kw)


async def _parsed_body(request: web.Request, parse: Callable[[Any], Any]) -> Any:
    """``parse(body)`` of the JSON body. The declared length is checked before anything is
    read (413); a large body is read under a slot and parsed, with ``parse``, on a worker
    thread, so the event loop never stalls on one and memory stays bounded."""
    n = request.content_length
    if n is not None and n > MAX_BODY_BYTES:
        raise web.HTTPRequestEntityTooLarge(max_size=MAX_BODY_BYTES, actual_size=n)
    if n is not None and n < BIG_BODY_BYTES:
        return parse(_loads(await _read(request)))
    async with request.app[_SLOTS_KEY]:
        raw = await _read(request)
        return await asyncio.get_running_loop().run_in_executor(
            _parsers, lambda: parse(_loads(raw)))


def _tokenizer(engine: Engine) -> Any:
    tok = engine.tokenizer
    return None if tok is None else _BoundedTokenizer(tok, engine.model.cfg.max_context)


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
    tok = _tokenizer(engine)
    parsed = await _parsed_body(request, lambda body: parse_generate(body, tok))
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


def _check_model(engine: Engine, model: str | None) -> None:
    """OpenAI routes: ``model`` names the served model (or is left out). Any other name would
    be an adapter (vLLM's ``model=<adapter>``, SGLang's ``base:adapter``) this server does not
    have; serving the base model under it would share the base model's cache, so it is
    refused."""
    if model is None:
        return
    known = {engine.model_name, engine.model.cfg.name, engine.cfg.model}
    paths = [p for p in (engine.cfg.model, engine.tokenizer_path) if p]   # /model_info's paths:
    known.update(os.path.abspath(p) for p in paths if os.path.isdir(p))   # clients send them
    if model in known or (os.path.isabs(model) and os.path.normpath(model) in known):
        return
    raise InputError(f"field 'model': {model!r} is not served here (this server serves "
                     f"{engine.model_name!r} and no adapters; name a cache namespace with "
                     "lora_path, lora_id, cache_salt, extra_key or namespace)")


def _storage_backend(engine: Engine) -> str | None:
    return engine.cfg.hicache_storage_backend if engine.cache.l3 is not None else None


async def completions(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE_KEY]
    tok = engine.tokenizer
    parsed = await _parsed_body(request, lambda body: parse_completions(body, _tokenizer(engine)))
    _check_model(engine, parsed.model)
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
    parsed = await _parsed_body(request, lambda body: parse_chat(body, _tokenizer(engine)))
    _check_model(engine, parsed.model)
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
    sessions = engine.sessions.stats()         # the registry lives on the event loop

    def collect() -> str:
        info = {k: v for k, v in engine.describe().items()
                if k in ("model", "attention", "device", "page_size", "host_layout",
                         "write_policy", "l3")}
        text = prom.render(sched.metrics, engine.cache.stats(), sched.num_running(),
                           sched.num_waiting(), info)
        text += prom.render_hints(engine.cache.hint_stats(), sessions)
        if getattr(engine, "kv_events", None) is not None:
            text += engine.kv_events.metrics_text()
        return text + engine.extra_metrics()     # P/D decode worker: the link's audit

    text = await _on_scheduler(engine, collect)
    return web.Response(text=text, content_type="text/plain", charset="utf-8",
                        headers={"X-Prometheus-Format": "0.0.4"})


_TRUE = ("1", "true", "yes", "on")


async def _flush(engine: Any, scope: str) -> dict:
    after = await _on_scheduler(engine, lambda: engine.flush(scope))
    return await asyncio.wrap_future(after)


async def flush_cache(request: web.Request) -> web.Response:
    """SGLang's ``/flush_cache`` (and vLLM's ``/reset_prefix_cache``): L1 and L2 by default;
    ``?storage=true``, or a server started with ``--flush-cache-scope all``, the L3 store too."""
    engine = request.app[ENGINE_KEY]
    scope = engine.cfg.flush_cache_scope
    if request.query.get("storage", "").lower() in _TRUE:
        scope = "all"
    stats = await _flush(engine, scope)
    storage = scope == "all" and stats.get("l3") is not None
    return web.json_response({"flushed": True, "tiers": ["l1", "l2", "l3"] if storage
                              else ["l1", "l2"], "l1_used_tokens": stats["l1_used_tokens"],
                              "l2_used_tokens": stats["l2_used_tokens"]})


async def clear_storage(request: web.Request) -> web.Response:
    """SGLang's ``/clear_hicache_storage_backend`` (and ``POST /hicache/storage-backend/clear``):
    every object of the L3 store; L1 and L2 stay."""
    engine = request.app[ENGINE_KEY]
    if engine.cache.l3 is None:
        return error_response(400, "no L3 storage backend is configured (start the server "
                                   "with --hicache-storage-backend)", "invalid_request_error")
    await _flush(engine, "storage")
    return web.json_response("Hierarchical cache storage backend cleared.")


async def dump_tree(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    from engine.snapshot.take import encode_snapshot, snapshot_of

    meta = engine.snapshot_meta()
    # Only the copy of the tree runs on the scheduler thread; encoding runs off it.
    snap = await _on_scheduler(engine, lambda: snapshot_of(engine.cache, meta))
    data = await asyncio.get_running_loop().run_in_executor(None, encode_snapshot, snap)
    return web.Response(body=data, content_type="application/octet-stream",
                        headers={"Content-Disposition": 'attachment; filename="tree.snapshot"'})


class _OneLineBadRequests(logging.Filter):
    """aiohttp answers bytes that are not an HTTP/1 request with a 400 and logs a traceback at
    ERROR; SGLang's router opens every worker with an HTTP/2 preface (looking for gRPC ones), so
    make that one INFO line: the 400 is the answer, nothing failed."""

    def filter(self, record: logging.LogRecord) -> bool:
        from aiohttp.http_exceptions import BadHttpMessage

        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, BadHttpMessage):
            why = (exc.message or "").strip().splitlines()
            peer = record.args[0] if isinstance(record.args, tuple) and record.args else "?"
            record.msg = (f"not an HTTP/1 request from {peer} (an HTTP/2 or gRPC probe?): "
                          f"answered 400 ({why[0].rstrip(':') if why else 'bad request'})")
            record.args = ()
            record.exc_info = record.exc_text = None
            record.levelno, record.levelname = logging.INFO, "INFO"
        return True


_BAD_REQUESTS = _OneLineBadRequests()


def make_app(engine: Engine) -> web.Application:
    logging.getLogger("aiohttp.server").addFilter(_BAD_REQUESTS)   # once: a set of filters
    app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[_errors])
    app[ENGINE_KEY] = engine
    app[_SLOTS_KEY] = asyncio.Semaphore(BODY_SLOTS)
    app.router.add_post("/generate", generate)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/metrics", metrics)
    info.add_routes(app)
    session_routes.add_routes(app, _json_body)
    for method in ("GET", "POST"):
        app.router.add_route(method, "/flush_cache", flush_cache)
        app.router.add_route(method, "/clear_hicache_storage_backend", clear_storage)
    app.router.add_post("/reset_prefix_cache", flush_cache)          # vLLM's spelling
    app.router.add_post("/hicache/storage-backend/clear", clear_storage)
    app.router.add_post("/dump_tree", dump_tree)
    return app
