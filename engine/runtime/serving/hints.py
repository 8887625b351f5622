"""Client cache hints in a request body, in every spelling the ecosystem uses, as one
:class:`~engine.cache.hints.CacheHint` (docs/cache-hints.md).

* SGLang ``/generate``: ``session_id`` (a stable identity, the prompt unchanged) and
  ``session_params`` ``{"id", "rid", "offset", "replace", "drop_previous_output"}``.
* OpenAI routes: ``prompt_cache_key`` (the session), ``prompt_cache_retention``
  (``in_memory`` | ``24h``), ``prompt_cache_options.ttl``, and Anthropic-style
  ``cache_control`` ``{"type": "ephemeral", "ttl": "5m"}`` on chat messages and content parts.
* Dynamo, any route: ``nvext.cache_control`` (the same object) and ``nvext.session_control``
  ``{"session_id", "action": "open" | "close", "timeout"}``.

A hint is soft: it orders eviction, never pins. Anything malformed is an
:class:`~engine.core.errors.InputError` (HTTP 400) naming the field and the reason.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

from engine.cache.hints import MAX_TTL_S, CacheHint
from engine.core.errors import InputError

MAX_SESSION_ID_CHARS = 256          # OpenAI bounds prompt_cache_key the same way
DEFAULT_EPHEMERAL_TTL_S = 300.0     # Anthropic: an ephemeral entry without "ttl" lives 5 minutes
RETENTION_TTL_S = {"in_memory": 600.0, "24h": 86400.0}
"""OpenAI's ``prompt_cache_retention`` values as hint TTLs: in-memory retention lasts
5-10 minutes of inactivity (the upper end), extended retention 24 hours."""
DEFAULT_SESSION_TIMEOUT_S = 300     # Dynamo's session_control.timeout default
CACHE_CONTROL_KEYS = frozenset({"type", "ttl"})
SESSION_CONTROL_KEYS = frozenset({"session_id", "action", "timeout"})
SESSION_PARAMS_KEYS = frozenset({"id", "rid", "offset", "replace", "drop_previous_output"})

_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")
MAX_DURATION_CHARS = 32


def parse_duration(v: Any, name: str) -> float:
    """Seconds of a duration string (``"300s"``, ``"5m"``, ``"1h"``, ``"1h30m"``, ``"1.5d"``);
    positive and at most :data:`MAX_TTL_S`. A JSON number is seconds."""
    if isinstance(v, bool) or not isinstance(v, (str, int, float)):
        raise InputError(f"field {name!r} must be a duration string such as \"5m\" or \"1h\"")
    if isinstance(v, str):
        text = v.strip()
        if len(text) > MAX_DURATION_CHARS:
            raise InputError(f"field {name!r} is longer than {MAX_DURATION_CHARS} characters")
        if text.startswith("-"):
            raise InputError(f"field {name!r} is negative ({v!r}); a TTL must be positive")
        parts = _DURATION.findall(text)
        if not text or "".join(n + u for n, u in parts) != text:
            raise InputError(f"field {name!r}: {v!r} is not a duration (a number and a unit "
                             "of ms, s, m, h or d, e.g. \"300s\", \"5m\", \"1h\")")
        seconds = sum(float(n) * _UNIT_S[u] for n, u in parts)
    else:
        seconds = float(v)
        if not math.isfinite(seconds):
            raise InputError(f"field {name!r} must be finite")
    if seconds < 0:
        raise InputError(f"field {name!r} is negative ({v!r}); a TTL must be positive")
    if seconds == 0:
        raise InputError(f"field {name!r} is zero; a TTL must be positive")
    if seconds > MAX_TTL_S:
        raise InputError(f"field {name!r}: {v!r} is longer than the longest TTL accepted "
                         f"({MAX_TTL_S / 86400:g} days)")
    return seconds


def _session_id(v: Any, name: str) -> str:
    if not isinstance(v, str) or not v:
        raise InputError(f"field {name!r} must be a non-empty string")
    if len(v) > MAX_SESSION_ID_CHARS:
        raise InputError(f"field {name!r} is longer than {MAX_SESSION_ID_CHARS} characters")
    return v


def cache_control_ttl(cc: Any, name: str) -> float:
    """The TTL an Anthropic-style ``cache_control`` object asks for."""
    if not isinstance(cc, dict):
        raise InputError(f"field {name!r} must be an object like {{\"type\": \"ephemeral\"}}")
    unknown = sorted(set(cc) - CACHE_CONTROL_KEYS)
    if unknown:
        raise InputError(f"field {name!r}: unknown key {unknown[0]!r} (accepted: type, ttl)")
    if cc.get("type") != "ephemeral":
        raise InputError(f"field {name}.type must be \"ephemeral\", got {cc.get('type')!r}")
    if cc.get("ttl") is None:
        return DEFAULT_EPHEMERAL_TTL_S
    return parse_duration(cc["ttl"], f"{name}.ttl")


def messages_ttl(messages: Any) -> float | None:
    """The TTL of the last ``cache_control`` in chat ``messages`` (on a message or one of its
    content parts; the last breakpoint in the prompt wins), or None."""
    ttl = None
    if not isinstance(messages, list):
        return None                      # normalize_messages names that error
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            continue
        if m.get("cache_control") is not None:
            ttl = cache_control_ttl(m["cache_control"], f"messages[{i}].cache_control")
        content = m.get("content")
        if isinstance(content, list):
            for j, p in enumerate(content):
                if isinstance(p, dict) and p.get("cache_control") is not None:
                    ttl = cache_control_ttl(p["cache_control"],
                                            f"messages[{i}].content[{j}].cache_control")
    return ttl


@dataclasses.dataclass(frozen=True)
class SessionUse:
    """What a request asks of the server's session registry (serving.sessions)."""

    session: str
    must_exist: bool = False       # SGLang session_params: the session was opened
    open: bool = False             # nvext.session_control action "open"
    close: bool = False            # nvext.session_control action "close"
    timeout_s: float | None = None


@dataclasses.dataclass(frozen=True)
class RequestHints:
    hint: CacheHint | None
    session: SessionUse | None


def _session_control(nv: dict) -> SessionUse | None:
    sc = nv.get("session_control")
    if sc is None:
        return None
    if not isinstance(sc, dict):
        raise InputError("field 'nvext.session_control' must be an object")
    unknown = sorted(set(sc) - SESSION_CONTROL_KEYS)
    if unknown:
        raise InputError(f"field 'nvext.session_control': unknown key {unknown[0]!r} "
                         "(accepted: session_id, action, timeout)")
    sid = _session_id(sc.get("session_id"), "nvext.session_control.session_id")
    action = sc.get("action")
    if action not in (None, "open", "close"):
        raise InputError("field 'nvext.session_control.action' must be \"open\" or \"close\", "
                         f"got {action!r}")
    timeout = sc.get("timeout", DEFAULT_SESSION_TIMEOUT_S)
    if isinstance(timeout, bool) or not isinstance(timeout, int) or timeout <= 0:
        raise InputError("field 'nvext.session_control.timeout' must be a positive integer "
                         "(seconds)")
    if timeout > MAX_TTL_S:
        raise InputError("field 'nvext.session_control.timeout' is longer than "
                         f"{MAX_TTL_S / 86400:g} days")
    return SessionUse(sid, open=action == "open", close=action == "close",
                      timeout_s=float(timeout))


def _nvext(body: dict) -> tuple[float | None, SessionUse | None]:
    nv = body.get("nvext")
    if nv is None:
        return None, None
    if not isinstance(nv, dict):
        raise InputError("field 'nvext' must be an object")
    ttl = None
    if nv.get("cache_control") is not None:
        ttl = cache_control_ttl(nv["cache_control"], "nvext.cache_control")
    return ttl, _session_control(nv)


def _session_params(body: dict) -> SessionUse | None:
    """SGLang's ``session_params``. A non-streaming SGLang session request without ``rid``
    uses its prompt as sent (no history is spliced in), which this server does exactly; the
    options that rebuild the prompt from an earlier request of the session (``rid``, a
    non-zero ``offset``, ``replace``, ``drop_previous_output``) are refused."""
    sp = body.get("session_params")
    if sp is None:
        return None
    if not isinstance(sp, dict):
        raise InputError("field 'session_params' must be an object")
    unknown = sorted(set(sp) - SESSION_PARAMS_KEYS)
    if unknown:
        raise InputError(f"field 'session_params': unknown key {unknown[0]!r}")
    if body.get("session_id") is not None:
        raise InputError("session_id and session_params cannot both be set")
    for key in ("rid", "replace", "drop_previous_output"):
        if sp.get(key) not in (None, False):
            raise InputError(f"field 'session_params.{key}' is not supported by this server: "
                             "it does not rebuild a prompt from a session's earlier requests; "
                             "send the whole prompt (its cached prefix is reused)")
    if sp.get("offset") not in (None, 0):
        raise InputError("field 'session_params.offset' is not supported by this server "
                         "(only 0): send the whole prompt")
    return SessionUse(_session_id(sp.get("id"), "session_params.id"), must_exist=True)


def _ttl_openai(body: dict) -> float | None:
    ttl = None
    r = body.get("prompt_cache_retention")
    if r is not None:
        if r not in RETENTION_TTL_S:
            raise InputError("field 'prompt_cache_retention' must be \"in_memory\" or \"24h\", "
                             f"got {r!r}")
        ttl = RETENTION_TTL_S[r]
    opts = body.get("prompt_cache_options")
    if opts is not None:
        if not isinstance(opts, dict):
            raise InputError("field 'prompt_cache_options' must be an object")
        unknown = sorted(set(opts) - {"ttl"})
        if unknown:
            raise InputError(f"field 'prompt_cache_options.{unknown[0]}' is not supported by "
                             "this server (only ttl)")
        if opts.get("ttl") is not None:
            ttl = parse_duration(opts["ttl"], "prompt_cache_options.ttl")
    return ttl


def parse_hints(body: dict, route: str) -> RequestHints:
    """The hints of one request body; ``route``: ``generate``, ``completions`` or ``chat``.
    Several session ids must agree; of several TTLs the most specific wins:
    ``nvext.cache_control``, then the last ``cache_control`` in ``messages``, then
    ``prompt_cache_options.ttl``, then ``prompt_cache_retention``."""
    nv_ttl, use = _nvext(body)
    ids: list[tuple[str, str]] = []
    if use is not None:
        ids.append(("nvext.session_control.session_id", use.session))
    if route == "generate":
        sp = _session_params(body)
        if sp is not None:
            ids.append(("session_params.id", sp.session))
            use = use or sp
            use = dataclasses.replace(use, must_exist=True)
        if body.get("session_id") is not None:
            ids.append(("session_id", _session_id(body["session_id"], "session_id")))
        ttl = nv_ttl
    else:
        if body.get("prompt_cache_key") is not None:
            ids.append(("prompt_cache_key",
                        _session_id(body["prompt_cache_key"], "prompt_cache_key")))
        msg_ttl = messages_ttl(body.get("messages")) if route == "chat" else None
        ttl = next((t for t in (nv_ttl, msg_ttl, _ttl_openai(body)) if t is not None), None)
    if len({sid for _, sid in ids}) > 1:
        raise InputError(f"fields {ids[0][0]!r} and {ids[1][0]!r} name different sessions "
                         f"({ids[0][1]!r}, {ids[1][1]!r})")
    session = ids[0][1] if ids else None
    if use is None and session is not None:
        use = SessionUse(session)
    if session is None and ttl is None:
        return RequestHints(None, None)
    return RequestHints(CacheHint(session=session, ttl_s=ttl,
                                  close=use is not None and use.close), use)
