"""Read-only endpoints about the server: model and server info (SGLang's names and shapes),
the OpenAI model list, and health checks."""

from __future__ import annotations

import asyncio
import time

from aiohttp import web

from engine.runtime.scheduler import RequestOutput, SamplingParams
from engine.runtime.serving.common import ENGINE_KEY, error_response, on_scheduler
from engine.runtime.serving.runtime import Engine

VERSION = "0.1.0"
HEALTH_GENERATE_TIMEOUT_S = 20.0


def model_info_of(engine: Engine) -> dict:
    mc = engine.model.cfg
    return {"model_path": engine.cfg.model, "tokenizer_path": engine.tokenizer_path,
            "served_model_name": engine.model_name, "is_generation": True,
            "preferred_sampling_params": None, "weight_version": engine.weight_version,
            "has_image_understanding": False, "has_audio_understanding": False,
            "model_type": "llama", "architectures": ["LlamaForCausalLM"],
            "max_context": mc.max_context, "vocab_size": mc.vocab_size}


async def model_info(request: web.Request) -> web.Response:
    return web.json_response(model_info_of(request.app[ENGINE_KEY]))


async def server_info(request: web.Request) -> web.Response:
    """SGLang's shape (top-level server settings, ``version``, ``internal_states``) plus ours
    (``cache``: the cache's counters; ``cache_hints``: the cache's hint counters and the
    session registry's, docs/cache-hints.md)."""
    engine = request.app[ENGINE_KEY]
    sched = engine.scheduler

    def collect() -> tuple[dict, int, int, dict]:
        return engine.cache.stats(), sched.num_running(), sched.num_waiting(), \
            engine.cache.hint_stats()

    sessions = engine.sessions.stats()         # the registry lives on the event loop
    stats, running, waiting, hints = await on_scheduler(engine, collect)
    d = engine.describe()
    return web.json_response({
        **d, "version": VERSION, "weight_version": engine.weight_version,
        "max_running_requests": engine.cfg.max_running_requests,
        "chunked_prefill_size": engine.cfg.chunked_prefill_size,
        "disable_radix_cache": engine.cfg.disable_radix_cache,
        "disable_partial_page_reuse": engine.cfg.disable_partial_page_reuse,
        "context_length": d["max_context"],
        "internal_states": [{"page_size": engine.cfg.page_size, "num_running_reqs": running,
                             "num_waiting_reqs": waiting,
                             "max_total_num_tokens": engine.cfg.l1_tokens,
                             "avg_spec_accept_length": (d["speculative"] or {}).get(
                                 "accept_length")}],
        "kv_events": None if getattr(engine, "kv_events", None) is None
        else engine.kv_events.describe(engine.cfg.page_size),
        "cache": stats,
        "cache_hints": {**hints, "sessions": sessions}})


def _model_card(engine: Engine) -> dict:
    return {"id": engine.model_name, "object": "model", "created": 0, "owned_by": "hicache",
            "root": engine.cfg.model, "max_model_len": engine.model.cfg.max_context}


async def models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [_model_card(request.app[ENGINE_KEY])]})


async def model_by_id(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    wanted = request.match_info["model_id"]
    if wanted not in (engine.model_name, engine.cfg.model):
        return error_response(404, f"model {wanted!r} is not served here (this server serves "
                                   f"{engine.model_name!r})", "not_found_error")
    return web.json_response(_model_card(engine))


async def health(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    gone = engine.group_health()
    if gone is not None:       # a pipeline stage died: say which
        return error_response(503, gone, "server_error")
    if not engine.scheduler.alive:
        return error_response(503, engine.scheduler.last_error or "scheduler not running",
                              "server_error")
    pd_down = engine.pd_health()
    if pd_down is not None:    # the HTTP front end is up; requests needing prefill fail
        return error_response(503, pd_down, "server_error")
    reason = engine.storage_degraded()
    if reason is not None:     # still serving (L3 calls fail fast), but say why it is slower
        return web.json_response({"status": "degraded", "reason": f"L3 store: {reason}"})
    return web.json_response({"status": "ok"})


async def health_generate(request: web.Request) -> web.Response:
    """Healthy only if the scheduler runs a one-token generation end to end."""
    engine = request.app[ENGINE_KEY]
    if not engine.scheduler.alive:
        return error_response(503, engine.scheduler.last_error or "scheduler not running",
                              "server_error")
    mc = engine.model.cfg
    first = mc.bos_id if mc.bos_id is not None else 0
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[RequestOutput] = loop.create_future()

    def settle(out: RequestOutput) -> None:
        if not fut.done():
            fut.set_result(out)

    def cb(out: RequestOutput) -> None:
        if out.finished:
            try:
                loop.call_soon_threadsafe(settle, out)
            except RuntimeError:          # the loop is closed: shutting down
                pass

    rid = f"health-{time.monotonic_ns()}"
    engine.scheduler.submit([first], SamplingParams(max_new_tokens=1), cb, rid=rid)
    try:
        out = await asyncio.wait_for(fut, HEALTH_GENERATE_TIMEOUT_S)
    except asyncio.TimeoutError:
        engine.scheduler.abort(rid)
        return error_response(503, "the health generation did not finish in "
                                   f"{HEALTH_GENERATE_TIMEOUT_S:.0f} s", "server_error")
    finally:
        if not fut.done():
            engine.scheduler.abort(rid)
    if out.error or out.finish_reason is None or out.finish_reason.value not in ("length",
                                                                                "stop"):
        return error_response(503, out.error or "the health generation was aborted",
                              "server_error")
    return web.Response(status=200)


def add_routes(app: web.Application) -> None:
    r = app.router
    for path in ("/model_info", "/get_model_info"):
        r.add_get(path, model_info)
    for path in ("/server_info", "/get_server_info"):
        r.add_get(path, server_info)
    r.add_get("/v1/models", models)
    r.add_get("/v1/models/{model_id:.+}", model_by_id)
    r.add_get("/health", health)
    r.add_get("/health_generate", health_generate)
