"""The client-hint columns of a tree snapshot (version 2, ``docs/tree-snapshot-format.md``):
each node's ``session`` and ``hint_until``, and the header's ``hint_clock``. Checks of untrusted
values, and the columnar form :mod:`formats.snapshot` keeps them in. No engine imports."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

MAX_SESSION_KEY_CHARS = 256          # a client session key (engine.cache.hints)
SHARED = True
"""``NodeRecord.session`` of a node more than one session (or a sessionless request) touched."""
NO_SESSION, SHARED_CODE = -1, -2
"""``NodeColumns.session_code`` of a node no session touched, and of a shared one; a code
``k >= 0`` is the key ``NodeColumns.sessions[k]``."""


class BadValue(ValueError):
    """Row ``k`` of a column holds a bad value (the reader names the node and the file)."""

    def __init__(self, k: int, problem: str):
        super().__init__(problem)
        self.k, self.problem = k, problem


def is_key(v: Any) -> bool:
    """A client session key: a string of 1..256 characters or an integer in [0, 2**63)."""
    t = type(v)
    return (t is str and 0 < len(v) <= MAX_SESSION_KEY_CHARS) or (t is int and 0 <= v < 1 << 63)


def check_record(nid: Any, session: Any, until: Any) -> float | None:
    """A writer's values: ``ValueError`` unless they are ones the reader takes back."""
    if not (session is None or session is True or is_key(session)):
        raise ValueError(f"node {nid}: session must be None, True (shared) or a session key, "
                         f"got {session!r:.80}")
    if until is None:
        return None
    if isinstance(until, bool) or not isinstance(until, (int, float)) or math.isnan(until) \
            or until < 0:
        raise ValueError(f"node {nid}: hint_until must be seconds >= 0 (inf: closed) or None, "
                         f"got {until!r:.40}")
    return float(until)


def session_column(values: tuple) -> tuple:
    """The ``session`` column, checked: nil, true (shared) or a client session key."""
    if values.count(None) == len(values):
        return values
    for k, v in enumerate(values):
        if v is None or v is True or is_key(v):
            continue
        t = type(v)
        if t is str:
            what = ("an empty string" if not v else
                    f"{len(v)} characters long, at most {MAX_SESSION_KEY_CHARS}")
            raise BadValue(k, f"field 'session' key is {what}")
        if t is int:
            raise BadValue(k, f"field 'session' key must be an integer in [0, 2**63), "
                              f"found {v}"[:120])
        raise BadValue(k, f"field 'session' must be nil, true (shared) or a session key (a "
                          f"string or a non-negative integer), found {t.__name__} {v!r:.40}")
    return values


def hint_column(values: tuple) -> np.ndarray:
    """The ``hint_until`` column as float64 (NaN for nil), checked: seconds >= 0, inf allowed."""
    if values.count(None) == len(values):
        return np.full(len(values), np.nan)
    ok_types = {float, int, type(None)}
    if set(map(type, values)) - ok_types:
        k = next(k for k, v in enumerate(values) if type(v) not in ok_types)
    else:
        try:
            arr = np.array([np.nan if v is None else v for v in values], dtype=np.float64)
        except OverflowError:                  # an integer beyond float range
            k = next(k for k, v in enumerate(values) if v is not None and abs(v) > 1e308)
        else:
            given = np.fromiter((v is not None for v in values), dtype=bool, count=len(values))
            wrong = (arr < 0) | (np.isnan(arr) & given)
            if not wrong.any():
                return arr
            k = int(np.argmax(wrong))
    v = values[k]
    raise BadValue(k, f"field 'hint_until' must be seconds >= 0 on the hint clock (inf: "
                      f"closed) or nil, found {type(v).__name__} {v!r}"[:160])


def session_codes(columns: list[tuple]) -> tuple[np.ndarray, list]:
    """Session columns (one per chunk) as one int32 code column and the distinct keys."""
    keys: dict = {}
    codes = []
    for col in columns:
        if col.count(None) == len(col):
            codes.append(np.full(len(col), NO_SESSION, dtype=np.int32))
            continue
        codes.append(np.fromiter(
            (NO_SESSION if v is None else SHARED_CODE if v is True
             else keys.setdefault(v, len(keys)) for v in col), dtype=np.int32, count=len(col)))
    return (np.concatenate(codes) if codes else np.empty(0, dtype=np.int32)), list(keys)


def session_of(code: int, keys: list) -> Any:
    """The ``NodeRecord.session`` value of a code."""
    return None if code == NO_SESSION else SHARED if code == SHARED_CODE else keys[code]


def clock_problem(clock: Any) -> str | None:
    """What is wrong with a header's ``hint_clock`` (None: nothing)."""
    if clock is None or (type(clock) in (int, float) and math.isfinite(clock) and clock >= 0):
        return None
    return f"header hint_clock must be seconds >= 0 or nil, got {clock!r}"[:120]
