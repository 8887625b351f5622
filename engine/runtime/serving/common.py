"""What every handler module shares: the engine key, the JSON error body, scheduler calls."""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from engine.runtime.serving.runtime import Engine

ENGINE_KEY: web.AppKey[Engine] = web.AppKey("engine", Engine)


def error_response(status: int, message: str, kind: str = "invalid_request_error"
                   ) -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "code": status}},
                             status=status)


async def on_scheduler(engine: Engine, fn: Any) -> Any:
    """Run ``fn`` on the scheduler thread (between steps) and await its result."""
    return await asyncio.wrap_future(engine.scheduler.call(fn))
