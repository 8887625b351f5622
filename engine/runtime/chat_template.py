"""Chat templates: a tokenizer's Jinja template rendered in a sandbox, as Hugging Face's
``apply_chat_template`` renders it (``trim_blocks``, ``lstrip_blocks``, ``raise_exception``).

The rendered text already holds the template's BOS, so the server encodes it with
``add_bos=False`` — the ids ``tokenizer.apply_chat_template(messages, tokenize=True)`` gives a
client that loaded the same template.
"""

from __future__ import annotations

import functools
from typing import Any

from engine.core.errors import InputError

MAX_MESSAGES = 4096


class _TemplateError(Exception):
    pass


def _raise(message: str) -> None:
    raise _TemplateError(message)


@functools.lru_cache(maxsize=8)
def _compile(source: str) -> Any:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise
    return env.from_string(source)


def normalize_messages(messages: Any) -> list[dict[str, str]]:
    """OpenAI ``messages`` as ``[{"role", "content"}]`` with string content (text parts of a
    list content are joined). :class:`InputError` names what is wrong."""
    if not isinstance(messages, list) or not messages:
        raise InputError("field 'messages' must be a non-empty list")
    if len(messages) > MAX_MESSAGES:
        raise InputError(f"at most {MAX_MESSAGES} messages per request")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise InputError(f"{where} must be an object")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise InputError(f"{where}.role must be a non-empty string")
        content = m.get("content")
        if content is None:
            content = ""
        elif isinstance(content, list):
            parts = []
            for p in content:
                if not isinstance(p, dict) or p.get("type") != "text" or \
                        not isinstance(p.get("text"), str):
                    raise InputError(f"{where}.content: only text parts are supported "
                                     "(this server has no image or audio input)")
                parts.append(p["text"])
            content = "".join(parts)
        elif not isinstance(content, str):
            raise InputError(f"{where}.content must be a string or a list of text parts")
        out.append({"role": role, "content": content})
    return out


def render(template: str | None, specials: dict[str, str], messages: list[dict[str, str]],
           add_generation_prompt: bool = True, extra: dict[str, Any] | None = None) -> str:
    """The prompt text for ``messages`` (already :func:`normalize_messages`-ed)."""
    if not template:
        raise InputError("this model has no chat template; use /v1/completions or /generate")
    try:
        return _compile(template).render(messages=messages,
                                         add_generation_prompt=add_generation_prompt,
                                         **specials, **(extra or {}))
    except _TemplateError as exc:
        raise InputError(f"chat template: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - a template error is the request's problem
        raise InputError(f"chat template failed: {type(exc).__name__}: {exc}") from None
