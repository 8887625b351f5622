"""Request parsing for ``POST /generate`` (SGLang) and ``POST /v1/completions`` (OpenAI).

Every malformed request becomes an :class:`~engine.core.errors.InputError` whose message names the
field; the app turns it into HTTP 400 with a JSON error body. Unknown fields are ignored;
known fields of the wrong type are errors. Range checks that need the model (vocabulary,
context, KV capacity) are the scheduler's :meth:`~engine.runtime.scheduler.Scheduler.validate`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from engine.core.errors import InputError
from engine.runtime.scheduler import SamplingParams
from engine.runtime.tokenizer import Tokenizer

MAX_BODY_BYTES = 64 << 20          # a request body larger than this is refused (413)
MAX_PROMPTS = 64                   # prompts in one /v1/completions call
_INT64 = (-(1 << 63), 1 << 63)     # priorities are stored in the tree and its snapshots


@dataclasses.dataclass
class ParsedRequest:
    prompts: list[np.ndarray]
    sampling: SamplingParams
    stream: bool = False
    rid: str | None = None
    namespace: str | None = None
    priority: int = 0
    include_usage: bool = False       # OpenAI stream_options.include_usage
    model: str | None = None


# -- typed field access --------------------------------------------------------------------
_MISSING = object()


def _field(obj: dict, key: str, kind: str, default: Any = _MISSING, where: str = "") -> Any:
    name = f"{where}{key}"
    v = obj.get(key, _MISSING)
    if v is _MISSING or v is None:
        if default is _MISSING:
            raise InputError(f"missing required field {name!r}")
        return default
    if kind == "int":
        if isinstance(v, bool) or not isinstance(v, int):
            raise InputError(f"field {name!r} must be an integer, got {_tname(v)}")
    elif kind == "number":
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise InputError(f"field {name!r} must be a finite number, got {_tname(v)}")
        v = float(v)
    elif kind == "bool":
        if not isinstance(v, bool):
            raise InputError(f"field {name!r} must be true or false, got {_tname(v)}")
    elif kind == "str":
        if not isinstance(v, str):
            raise InputError(f"field {name!r} must be a string, got {_tname(v)}")
    elif kind == "object":
        if not isinstance(v, dict):
            raise InputError(f"field {name!r} must be an object, got {_tname(v)}")
    elif kind == "int_list":
        if not isinstance(v, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                               for t in v):
            raise InputError(f"field {name!r} must be a list of integers")
    else:  # pragma: no cover - programming error
        raise AssertionError(kind)
    return v


def _tname(v: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean",
            int: "an integer", float: "a number"}.get(type(v), type(v).__name__)


def _ids(v: list[int], name: str) -> np.ndarray:
    if not v:
        raise InputError(f"field {name!r} is empty")
    arr = np.asarray(v, dtype=np.int64) if all(abs(t) < 1 << 62 for t in v) else None
    if arr is None:
        raise InputError(f"field {name!r} holds a token id outside the vocabulary")
    return arr


def _encode(text: str, tok: Tokenizer | None, name: str) -> np.ndarray:
    if tok is None:
        raise InputError(f"this model has no tokenizer; send token ids instead of {name!r}")
    if not text:
        raise InputError(f"field {name!r} is empty")
    return np.asarray(tok.encode(text), dtype=np.int64)


def _priority(body: dict) -> int:
    v = _field(body, "priority", "int", 0)
    if not _INT64[0] <= v < _INT64[1]:
        raise InputError(f"field 'priority' must fit in 64 bits, got {v}")
    return v


def _namespace(body: dict) -> str | None:
    for key in ("namespace", "cache_salt", "extra_key", "lora_path"):
        v = _field(body, key, "str", None)
        if v:
            return v
    return None


def _require_object(body: Any) -> dict:
    if not isinstance(body, dict):
        raise InputError(f"the request body must be a JSON object, got {_tname(body)}")
    return body


# -- POST /generate ------------------------------------------------------------------------
def parse_generate(body: Any, tok: Tokenizer | None) -> ParsedRequest:
    body = _require_object(body)
    has_text = body.get("text") is not None
    has_ids = body.get("input_ids") is not None
    if has_text == has_ids:
        raise InputError("give exactly one of 'text' and 'input_ids'")
    if has_text:
        if isinstance(body["text"], list):
            raise InputError("batched 'text' lists are not supported; send one request each")
        prompt = _encode(_field(body, "text", "str"), tok, "text")
    else:
        if isinstance(body["input_ids"], list) and body["input_ids"] and \
                isinstance(body["input_ids"][0], list):
            raise InputError("batched 'input_ids' lists are not supported; send one request "
                             "each")
        prompt = _ids(_field(body, "input_ids", "int_list"), "input_ids")
    sp = _field(body, "sampling_params", "object", {})
    w = "sampling_params."
    sampling = _sampling(
        max_new_tokens=_field(sp, "max_new_tokens", "int", 128, w),
        temperature=_field(sp, "temperature", "number", 1.0, w),
        top_p=_field(sp, "top_p", "number", 1.0, w),
        top_k=_field(sp, "top_k", "int", -1, w),
        seed=_field(sp, "seed", "int", _field(sp, "sampling_seed", "int", None, w), w),
        ignore_eos=_field(sp, "ignore_eos", "bool", False, w),
        stop_token_ids=tuple(_field(sp, "stop_token_ids", "int_list", [], w)))
    return ParsedRequest(
        prompts=[prompt], sampling=sampling, stream=_field(body, "stream", "bool", False),
        rid=_field(body, "rid", "str", None) or None, namespace=_namespace(body),
        priority=_priority(body))


def _sampling(**kw: Any) -> SamplingParams:
    if kw["max_new_tokens"] < 0:
        raise InputError(f"max_new_tokens must be >= 0, got {kw['max_new_tokens']}")
    return SamplingParams(**kw)


# -- POST /v1/completions ------------------------------------------------------------------
# OpenAI fields we accept only at their "off" value.
_UNSUPPORTED = {"echo": (False,), "logprobs": (None, 0), "best_of": (None, 1),
                "suffix": (None, ""), "logit_bias": (None, {}),
                "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0)}


def parse_completions(body: Any, tok: Tokenizer | None) -> ParsedRequest:
    body = _require_object(body)
    if "prompt" not in body or body["prompt"] is None:
        raise InputError("missing required field 'prompt'")
    p = body["prompt"]
    prompts: list[np.ndarray]
    if isinstance(p, str):
        prompts = [_encode(p, tok, "prompt")]
    elif isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool)
                                           for t in p):
        prompts = [_ids(p, "prompt")]
    elif isinstance(p, list) and p and all(isinstance(x, str) for x in p):
        prompts = [_encode(x, tok, "prompt") for x in p]
    elif isinstance(p, list) and p and all(isinstance(x, list) for x in p):
        prompts = [_ids(_field({"prompt": x}, "prompt", "int_list"), "prompt") for x in p]
    else:
        raise InputError("field 'prompt' must be a string, a list of token ids, or a list of "
                         "either")
    if len(prompts) > MAX_PROMPTS:
        raise InputError(f"at most {MAX_PROMPTS} prompts per request")
    for key, ok in _UNSUPPORTED.items():
        if key in body and body[key] not in ok:
            raise InputError(f"field {key!r} is not supported by this server")
    n = _field(body, "n", "int", 1)
    if n != 1:
        raise InputError("only n = 1 is supported")
    stop = body.get("stop")
    if stop not in (None, [], ""):
        raise InputError("stop strings are not supported; use 'stop_token_ids'")
    so = _field(body, "stream_options", "object", {})
    temperature = _field(body, "temperature", "number", 1.0)
    if temperature > 2:
        raise InputError(f"temperature must be in [0, 2], got {temperature}")
    sampling = _sampling(
        max_new_tokens=_field(body, "max_tokens", "int", 16),
        temperature=temperature,
        top_p=_field(body, "top_p", "number", 1.0),
        top_k=_field(body, "top_k", "int", -1),
        seed=_field(body, "seed", "int", None),
        ignore_eos=_field(body, "ignore_eos", "bool", False),
        stop_token_ids=tuple(_field(body, "stop_token_ids", "int_list", [])))
    return ParsedRequest(
        prompts=prompts, sampling=sampling, stream=_field(body, "stream", "bool", False),
        namespace=_namespace(body), include_usage=_field(so, "include_usage", "bool", False,
                                                         "stream_options."),
        model=_field(body, "model", "str", None), priority=_priority(body))


# -- responses -----------------------------------------------------------------------------
def sglang_finish_reason(reason: str | None, out_ids: list[int], error: str | None
                         ) -> dict | None:
    if reason is None:
        return None
    if reason == "length":
        return {"type": "length", "length": len(out_ids)}
    if reason == "stop":
        return {"type": "stop", "matched": out_ids[-1] if out_ids else None}
    return {"type": reason, "message": error or reason}


def openai_finish_reason(reason: str | None) -> str | None:
    return None if reason is None else ("stop" if reason == "stop" else
                                        "length" if reason == "length" else reason)
