"""SGLang's ``/open_session`` and ``/close_session``, and what a generate request's session
fields ask of the server's :class:`~engine.runtime.serving.sessions.SessionRegistry`.

A close reaches the cache at a scheduler step (every rank of a group at the same one):
``Scheduler.close_session`` marks that session's private KV of that namespace first to go.
"""

from __future__ import annotations

import math
from typing import Any, Awaitable, Callable

from aiohttp import web

from engine.cache.hints import MAX_TTL_S
from engine.core.errors import InputError
from engine.runtime.serving.common import ENGINE_KEY
from engine.runtime.serving.hints import MAX_SESSION_ID_CHARS, SessionUse
from engine.runtime.serving.protocol import _namespace, _require_object


def _sid(v: Any, name: str = "session_id") -> str:
    if not isinstance(v, str) or not v:
        raise InputError(f"field {name!r} must be a non-empty string")
    if len(v) > MAX_SESSION_ID_CHARS:
        raise InputError(f"field {name!r} is longer than {MAX_SESSION_ID_CHARS} characters")
    return v


def parse_open(body: Any) -> tuple[Any, str | None, float | None, int]:
    """SGLang's OpenSessionReqInput: ``capacity_of_str_len`` (required), ``session_id``,
    ``streaming`` (refused: streaming sessions continue the previous request's context, which
    this server does not rebuild), ``timeout`` (idle seconds until it expires)."""
    body = _require_object(body)
    cap = body.get("capacity_of_str_len")
    if isinstance(cap, bool) or not isinstance(cap, int):
        raise InputError("field 'capacity_of_str_len' must be an integer")
    if cap < 0:
        raise InputError("field 'capacity_of_str_len' must be >= 0")
    sid = None if body.get("session_id") is None else _sid(body["session_id"])
    if body.get("streaming"):
        raise InputError("field 'streaming': streaming sessions are not supported by this "
                         "server (it does not rebuild a prompt from a session's history)")
    t = body.get("timeout")
    if t is not None:
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) \
                or t <= 0:
            raise InputError("field 'timeout' must be a positive number of seconds")
        if t > MAX_TTL_S:
            raise InputError(f"field 'timeout' is longer than {MAX_TTL_S / 86400:g} days")
    return _namespace(body), sid, None if t is None else float(t), cap


async def open_session(request: web.Request, body: Any) -> web.Response:
    """Returns the session id as SGLang does (a JSON string)."""
    engine = request.app[ENGINE_KEY]
    ns, sid, timeout, cap = parse_open(body)
    sid = engine.sessions.open(ns, sid, timeout_s=timeout, capacity=cap)
    return web.json_response(sid)


async def close_session(request: web.Request, body: Any) -> web.Response:
    """SGLang's CloseSessionReqInput ``{"session_id"}`` (and this server's namespace fields):
    200 with an empty body; an unknown session is a 400."""
    engine = request.app[ENGINE_KEY]
    body = _require_object(body)
    sid, ns = _sid(body.get("session_id")), _namespace(body)
    engine.sessions.close(ns, sid)
    engine.scheduler.close_session(ns, sid)
    return web.Response(status=200)


def use_sessions(engine: Any, ns: Any, use: SessionUse | None) -> None:
    """Before a request is submitted: open, refresh or check the session it names (a close
    rides on the request's hint and ends the session here)."""
    if use is None:
        return
    reg = engine.sessions
    if use.open:
        reg.open(ns, use.session, timeout_s=use.timeout_s, exist_ok=True)
    reg.use(ns, use.session, must_exist=use.must_exist)


def end_sessions(engine: Any, ns: Any, use: SessionUse | None) -> None:
    """After a request with a close was submitted: the registry forgets the session (the
    cache closes it at the request's release)."""
    if use is not None and use.close and reg_has(engine, ns, use.session):
        engine.sessions.close(ns, use.session)


def reg_has(engine: Any, ns: Any, session: str) -> bool:
    return engine.sessions.key(ns, session) in engine.sessions


def add_routes(app: web.Application, read_json: Callable[[web.Request], Awaitable[Any]]
               ) -> None:
    """The two endpoints; ``read_json(request)``: the app's bounded JSON body reader."""
    def route(handler: Any) -> Any:
        async def h(request: web.Request) -> web.Response:
            return await handler(request, await read_json(request))
        return h

    for method in ("GET", "POST"):
        app.router.add_route(method, "/open_session", route(open_session))
        app.router.add_route(method, "/close_session", route(close_session))
