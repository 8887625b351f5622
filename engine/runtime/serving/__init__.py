"""The benchmark server's HTTP side: an aiohttp app (SGLang- and OpenAI-compatible endpoints)
over one :class:`Engine` — rank 0's model, cache and scheduler.

Starting it (the rank processes first, then the engine, then the HTTP site) is the launcher's
job: ``engine.runtime.launch.start_server`` (in-process) and ``serve`` (foreground).
Endpoints and their formats: docs/model-and-server.md.
"""

from __future__ import annotations

from engine.runtime.config import ServerConfig
from engine.runtime.serving.app import make_app
from engine.runtime.serving.runtime import Engine

__all__ = ["Engine", "ServerConfig", "make_app"]
