"""JSON from untrusted sources, with bounds: nesting depth, integer size, finite numbers, text
that is valid Unicode.

Python's ``json`` accepts what later code cannot use: 100k-deep nesting (a ``RecursionError``
in the parser or in whoever walks the result), integers of thousands of digits (a
``ValueError`` past 4,300 digits, slow arithmetic below that),
``NaN``/``Infinity``, and lone surrogates such as ``"\\ud800"`` (a ``UnicodeEncodeError`` at
the first encode). :func:`loads` turns every one of them into one :class:`JSONLimitError`
(a ``ValueError``) with a short message.
"""

from __future__ import annotations

import json
import math
from typing import Any

MAX_DEPTH = 64
MAX_INT_DIGITS = 100     # far past any count, id or seed (2**64 has 20 digits)


class JSONLimitError(ValueError):
    """Malformed JSON, or JSON past one of the bounds; the message says which."""


def _no_constant(name: str) -> Any:
    raise JSONLimitError(f"{name} is not a JSON number")


def _finite(text: str) -> float:
    v = float(text)
    if not math.isfinite(v):
        raise JSONLimitError(f"number {text[:20]}… is out of range")
    return v


def _int(text: str) -> int:
    if len(text) > MAX_INT_DIGITS:
        raise JSONLimitError(f"an integer of {len(text.lstrip('-')):,} digits (at most "
                             f"{MAX_INT_DIGITS})")
    return int(text)


def _check_text(s: str) -> None:
    if not s.isascii():
        try:
            s.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise JSONLimitError(f"string holds a lone surrogate (\\u{ord(s[exc.start]):04x}); "
                                 "text must be valid Unicode") from None


def check_value(obj: Any, max_depth: int = MAX_DEPTH) -> None:
    """Depth and text of an already parsed value, without recursion."""
    stack: list[tuple[Any, int]] = [(obj, 1)]
    while stack:
        v, depth = stack.pop()
        if type(v) is str:
            _check_text(v)
            continue
        if type(v) is dict:
            items = list(v.keys()) + list(v.values())
        elif type(v) is list:
            items = v
        else:
            continue
        if depth > max_depth:
            raise JSONLimitError(f"nested deeper than {max_depth} levels")
        for x in items:
            t = type(x)
            if t is str:
                _check_text(x)
            elif t is dict or t is list:
                stack.append((x, depth + 1))


def loads(data: "str | bytes | bytearray", max_depth: int = MAX_DEPTH) -> Any:
    """Parse ``data``; :class:`JSONLimitError` for anything malformed or out of bounds
    (a ``bytes`` input that is not UTF-8 included)."""
    try:
        obj = json.loads(data, parse_constant=_no_constant, parse_float=_finite,
                         parse_int=_int)
    except JSONLimitError:
        raise
    except json.JSONDecodeError as exc:
        raise JSONLimitError(f"{exc.msg} at line {exc.lineno} column {exc.colno}") from None
    except UnicodeDecodeError:
        raise JSONLimitError("not UTF-8") from None
    except RecursionError:
        raise JSONLimitError(f"nested deeper than {max_depth} levels") from None
    except ValueError as exc:       # e.g. Python's own integer-digits limit
        raise JSONLimitError(str(exc)[:120]) from None
    check_value(obj, max_depth)
    return obj
