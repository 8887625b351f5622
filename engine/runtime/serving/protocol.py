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
from engine.core.namespace import FIELDS as NS_FIELDS
from engine.core.namespace import MAX_FIELD_CHARS as MAX_NS_CHARS
from engine.core.namespace import Namespace
from engine.runtime.scheduler import SamplingParams
from engine.runtime.serving.hints import RequestHints, SessionUse, parse_hints
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
    namespace: Namespace | None = None
    priority: int = 0
    include_usage: bool = False       # OpenAI stream_options.include_usage
    model: str | None = None
    n: int = 1                        # choices per prompt
    batched: bool = False             # /generate got a list of prompts: answer with a list
    stop: tuple[str, ...] = ()        # stop strings (not in the output)
    echo: bool = False                # OpenAI completions: the prompt text leads the output
    cached_details: bool = False      # SGLang's return_cached_tokens_details -> sglext
    logprobs: int | None = None       # OpenAI: top-k alternatives per token (0: none); None: off
    return_logprob: bool = False      # SGLang /generate
    top_logprobs_num: int = 0
    logprob_start_len: int = -1       # SGLang: first prompt position with input logprobs
    text_in_logprobs: bool = False    # SGLang return_text_in_logprobs
    stream_interval: int = 1
    hint: Any = None                  # CacheHint | None: the client's cache hint (serving.hints)
    session: SessionUse | None = None  # what it asks of the session registry

    def with_hints(self, h: RequestHints) -> "ParsedRequest":
        return dataclasses.replace(self, hint=h.hint, session=h.session)


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
    """SGLang's ``priority`` (larger: more important), else Dynamo's
    ``nvext.agent_hints.priority`` (the same direction)."""
    v = _field(body, "priority", "int", None)
    if v is None:
        nv = body.get("nvext")
        ah = nv.get("agent_hints") if isinstance(nv, dict) else None
        if ah is not None and not isinstance(ah, dict):
            raise InputError("field 'nvext.agent_hints' must be an object")
        v = _field(ah or {}, "priority", "int", 0, "nvext.agent_hints.")
    if not _INT64[0] <= v < _INT64[1]:
        raise InputError(f"field 'priority' must fit in 64 bits, got {v}")
    return v


REFUSED_NAMESPACE_FIELDS = ("lora_name", "lora_int_id", "lora_request")
"""Fields other servers select an adapter with that this one does not honour: refused (400)
rather than ignored, which would share the base model's cache."""


def _namespace(body: dict) -> Namespace | None:
    """The cache namespace: every field of :data:`engine.core.namespace.FIELDS` the request
    sets (a non-empty string each), all of them together; ``None`` when none is set."""
    for key in REFUSED_NAMESPACE_FIELDS:
        if body.get(key) is not None:
            raise InputError(f"field {key!r} is not supported by this server: it names "
                             f"adapters and cache namespaces with {', '.join(NS_FIELDS)}")
    values = {}
    for key in NS_FIELDS:
        v = _field(body, key, "str", None)
        if v is None:
            continue
        if not v:
            raise InputError(f"field {key!r} must be a non-empty string (or left out)")
        if len(v) > MAX_NS_CHARS:
            raise InputError(f"field {key!r} is longer than {MAX_NS_CHARS} characters")
        values[key] = v
    return Namespace(**values) if values else None


def _require_object(body: Any) -> dict:
    if not isinstance(body, dict):
        raise InputError(f"the request body must be a JSON object, got {_tname(body)}")
    return body


# -- shared option groups -------------------------------------------------------------------
MAX_STOP = 16                      # stop strings per request
MAX_STOP_LEN = 256                 # characters per stop string
MAX_N = 16                         # choices per prompt
MAX_TOP_LOGPROBS = 20


def _stop_strings(obj: dict, where: str = "") -> tuple[str, ...]:
    v = obj.get("stop")
    if v is None or v == "" or v == []:
        return ()
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not all(isinstance(x, str) for x in items):
        raise InputError(f"field {where}stop must be a string or a list of strings")
    items = [x for x in items if x]
    if len(items) > MAX_STOP:
        raise InputError(f"at most {MAX_STOP} stop strings per request")
    if any(len(x) > MAX_STOP_LEN for x in items):
        raise InputError(f"a stop string is longer than {MAX_STOP_LEN} characters")
    return tuple(items)


def _refuse(obj: dict, where: str = "") -> None:
    """Options this server cannot honour: 400 with the reason rather than a silent ignore."""
    for key in ("regex", "json_schema", "ebnf", "structural_tag"):
        if obj.get(key):
            raise InputError(f"field {where}{key!r}: constrained decoding is not supported by "
                             "this server")
    if obj.get("logit_bias"):
        raise InputError("field 'logit_bias' is not supported by this server")
    min_p = obj.get("min_p")
    if min_p not in (None, 0, 0.0):
        raise InputError(f"field {where}'min_p' is not supported by this server (only 0)")


def _n(obj: dict, where: str = "") -> int:
    n = _field(obj, "n", "int", 1, where)
    if not 1 <= n <= MAX_N:
        raise InputError(f"field {where}n must be in [1, {MAX_N}], got {n}")
    return n


def _penalty(obj: dict, key: str, where: str, lo: float, hi: float, default: float) -> float:
    v = _field(obj, key, "number", default, where)
    if not lo <= v <= hi:
        raise InputError(f"field {where}{key} must be in [{lo:g}, {hi:g}], got {v:g}")
    return v


def _sampling(obj: dict, where: str, max_key: str | tuple[str, ...], max_default: int,
              temperature_default: float) -> SamplingParams:
    """Sampling options under SGLang's names (``sampling_params``) or OpenAI's (the body)."""
    keys = (max_key,) if isinstance(max_key, str) else max_key
    max_new = max_default
    for k in keys:
        if obj.get(k) is not None:
            max_new = _field(obj, k, "int", max_default, where)
            break
    if max_new < 0:
        raise InputError(f"max_new_tokens must be >= 0, got {max_new}")
    _refuse(obj, where)
    min_new = _field(obj, "min_new_tokens", "int", _field(obj, "min_tokens", "int", 0, where),
                     where)
    return SamplingParams(
        max_new_tokens=max_new, min_new_tokens=max(0, min_new),
        temperature=_field(obj, "temperature", "number", temperature_default, where),
        top_p=_field(obj, "top_p", "number", 1.0, where),
        top_k=_field(obj, "top_k", "int", -1, where),
        seed=_field(obj, "seed", "int", _field(obj, "sampling_seed", "int", None, where), where),
        ignore_eos=_field(obj, "ignore_eos", "bool", False, where),
        stop_token_ids=tuple(_field(obj, "stop_token_ids", "int_list", [], where)),
        presence_penalty=_penalty(obj, "presence_penalty", where, -2, 2, 0.0),
        frequency_penalty=_penalty(obj, "frequency_penalty", where, -2, 2, 0.0),
        repetition_penalty=_penalty(obj, "repetition_penalty", where, 1e-3, 100, 1.0))


# -- POST /generate ------------------------------------------------------------------------
def _generate_prompts(body: dict, tok: Tokenizer | None) -> tuple[list[np.ndarray], bool]:
    has_text = body.get("text") is not None
    has_ids = body.get("input_ids") is not None
    if has_text == has_ids:
        raise InputError("give exactly one of 'text' and 'input_ids'")
    if has_text:
        t = body["text"]
        if isinstance(t, list):
            if not t or not all(isinstance(x, str) for x in t):
                raise InputError("field 'text' must be a string or a non-empty list of strings")
            return [_encode(x, tok, "text") for x in t], True
        return [_encode(_field(body, "text", "str"), tok, "text")], False
    v = body["input_ids"]
    if isinstance(v, list) and v and isinstance(v[0], list):
        return [_ids(_field({"input_ids": x}, "input_ids", "int_list"), "input_ids")
                for x in v], True
    return [_ids(_field(body, "input_ids", "int_list"), "input_ids")], False


def parse_generate(body: Any, tok: Tokenizer | None) -> ParsedRequest:
    body = _require_object(body)
    prompts, batched = _generate_prompts(body, tok)
    if len(prompts) > MAX_PROMPTS:
        raise InputError(f"at most {MAX_PROMPTS} prompts per request")
    sp = _field(body, "sampling_params", "object", {})
    w = "sampling_params."
    n = _n(sp, w)
    top = _field(body, "top_logprobs_num", "int", 0)
    if not 0 <= top <= MAX_TOP_LOGPROBS:
        raise InputError(f"field 'top_logprobs_num' must be in [0, {MAX_TOP_LOGPROBS}]")
    rid = body.get("rid")
    sampling = _sampling(sp, w, "max_new_tokens", 128, 1.0)
    start = _field(body, "logprob_start_len", "int", -1)
    if _field(body, "return_logprob", "bool", False):
        sampling = dataclasses.replace(sampling, logprobs=True, top_logprobs=top,
                                       input_logprobs_from=start if start >= 0 else None)
    return ParsedRequest(
        prompts=prompts, sampling=sampling,
        stream=_field(body, "stream", "bool", False),
        rid=rid if isinstance(rid, str) and rid else None, namespace=_namespace(body),
        priority=_priority(body), n=n, batched=batched or n > 1, stop=_stop_strings(sp, w),
        return_logprob=_field(body, "return_logprob", "bool", False),
        top_logprobs_num=top,
        logprob_start_len=start,
        text_in_logprobs=_field(body, "return_text_in_logprobs", "bool", False),
        stream_interval=max(1, _field(sp, "stream_interval", "int", 1, w)),
        cached_details=True).with_hints(parse_hints(body, "generate"))


# -- POST /v1/completions ------------------------------------------------------------------
def _openai_common(body: dict) -> dict[str, Any]:
    if body.get("suffix"):
        raise InputError("field 'suffix' is not supported by this server")
    n = _n(body)
    best_of = _field(body, "best_of", "int", n)
    if best_of != n:
        raise InputError("field 'best_of' must equal n (no server-side ranking)")
    temperature = _field(body, "temperature", "number", 1.0)
    if temperature > 2:
        raise InputError(f"temperature must be in [0, 2], got {temperature}")
    so = _field(body, "stream_options", "object", {})
    return dict(
        stream=_field(body, "stream", "bool", False), namespace=_namespace(body),
        include_usage=_field(so, "include_usage", "bool", False, "stream_options."),
        model=_field(body, "model", "str", None), priority=_priority(body), n=n,
        stop=_stop_strings(body),
        cached_details=_field(body, "return_cached_tokens_details", "bool", False))


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
    common = _openai_common(body)
    if len(prompts) * common["n"] > MAX_PROMPTS:
        raise InputError(f"at most {MAX_PROMPTS} choices (prompts x n) per request")
    lp = _field(body, "logprobs", "int", None)
    if lp is not None and not 0 <= lp <= MAX_TOP_LOGPROBS:
        raise InputError(f"field 'logprobs' must be in [0, {MAX_TOP_LOGPROBS}], got {lp}")
    echo = _field(body, "echo", "bool", False)
    sampling = _sampling(body, "", "max_tokens", 16, 1.0)
    if lp is not None:
        sampling = dataclasses.replace(sampling, logprobs=True, top_logprobs=lp,
                                       input_logprobs_from=0 if echo else None)
    return ParsedRequest(prompts=prompts, sampling=sampling, echo=echo, logprobs=lp,
                         **common).with_hints(parse_hints(body, "completions"))


# -- POST /v1/chat/completions -------------------------------------------------------------
def parse_chat(body: Any, tok: Tokenizer | None) -> ParsedRequest:
    """The chat prompt is the tokenizer's chat template over ``messages``
    (:mod:`engine.runtime.chat_template`)."""
    from engine.runtime.chat_template import normalize_messages, render

    body = _require_object(body)
    if tok is None:
        raise InputError("this model has no tokenizer; chat needs one")
    if body.get("tools") and body.get("tool_choice") != "none":
        raise InputError("field 'tools': tool calling is not supported by this server")
    rf = body.get("response_format")
    if rf is not None and (not isinstance(rf, dict) or rf.get("type") != "text"):
        raise InputError("field 'response_format': only {\"type\": \"text\"} is supported")
    messages = normalize_messages(body.get("messages"))
    kwargs = _field(body, "chat_template_kwargs", "object", {})
    text = render(tok.chat_template, tok.special_tokens, messages,
                  add_generation_prompt=_field(body, "add_generation_prompt", "bool", True),
                  extra=kwargs)
    ids = np.asarray(tok.encode(text, add_bos=False), dtype=np.int64)
    if ids.size == 0:
        raise InputError("the chat template rendered an empty prompt")
    want_lp = _field(body, "logprobs", "bool", False)
    top = _field(body, "top_logprobs", "int", 0)
    if not 0 <= top <= MAX_TOP_LOGPROBS:
        raise InputError(f"field 'top_logprobs' must be in [0, {MAX_TOP_LOGPROBS}], got {top}")
    sampling = _sampling(body, "", ("max_completion_tokens", "max_tokens"), 128, 1.0)
    if want_lp:
        sampling = dataclasses.replace(sampling, logprobs=True, top_logprobs=top)
    return ParsedRequest(prompts=[ids], sampling=sampling, logprobs=top if want_lp else None,
                         **_openai_common(body)).with_hints(parse_hints(body, "chat"))


# -- responses -----------------------------------------------------------------------------
def sglang_finish_reason(reason: str | None, out_ids: list[int], error: str | None,
                         matched: int | str | None = None) -> dict | None:
    if reason is None:
        return None
    if reason == "length":
        return {"type": "length", "length": len(out_ids)}
    if reason == "stop":
        return {"type": "stop", "matched": matched if matched is not None else
                (out_ids[-1] if out_ids else None)}
    return {"type": reason, "message": error or reason}


def openai_finish_reason(reason: str | None) -> str | None:
    return None if reason is None else ("stop" if reason == "stop" else
                                        "length" if reason == "length" else reason)
