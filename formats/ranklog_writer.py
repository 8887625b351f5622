"""Writing rank logs (format v1, ``docs/rank-log-format.md``): msgpack or JSON Lines by suffix.

The reader, the limits and the header rules are in :mod:`formats.ranklog`.
"""

from __future__ import annotations

import enum
import json
import os
from typing import Any, Iterable, Mapping

import msgpack

from formats.outpath import resolve_output
from formats.ranklog import Encoding, RankLogError, encoding_for, parse_header
from formats.ranklog_events import event_fields_problem


def _plain(o: Any) -> Any:
    """Encoder fallback: numpy scalars/arrays, enums, sets and bytes (JSON only) to plain values."""
    if isinstance(o, enum.Enum):
        return o.value
    if hasattr(o, "tolist"):  # numpy scalar or array
        return o.tolist()
    if isinstance(o, (set, frozenset)):
        return sorted(o)
    raise TypeError(f"cannot encode {type(o).__name__} in a rank log")


def _plain_json(o: Any) -> Any:
    if isinstance(o, (bytes, bytearray)):
        return bytes(o).hex()
    return _plain(o)


def event_packer() -> msgpack.Packer:
    """The msgpack packer rank logs are written with (also the online mode's canonical encoding)."""
    return msgpack.Packer(use_bin_type=True, default=_plain)


class RankLogWriter:
    """Streams one rank's log to ``path`` (``.ranklog``: msgpack, ``.jsonl``: JSON Lines).

    The file appears under its final name only on :meth:`close` (written to ``path + ".tmp"``
    and renamed), so a reader never sees a half-written log from a clean run. ``strict``: every
    event of a known kind must have exactly its kind's fields (``ValueError`` otherwise).
    """

    def __init__(self, path: str | os.PathLike, header: Mapping[str, Any], strict: bool = False):
        self.path = os.fspath(path)
        self.strict = strict
        self.encoding = encoding_for(self.path)
        try:
            parse_header(dict(header), self.path, None)
        except RankLogError as exc:  # caller misuse
            raise ValueError(exc.problem) from None
        # formats.outpath's rule: never replace a device or FIFO, write through a symlink
        self._target = resolve_output(self.path)
        self._tmp = os.path.join(os.path.dirname(self._target),
                                 f".{os.path.basename(self._target)}.tmp-{os.getpid()}")
        try:
            self._fh = open(self._tmp, "wb")
        except OSError as e:
            raise OSError(e.errno, e.strerror, self.path) from None
        if self.encoding is Encoding.msgpack:
            pack = event_packer().pack
            self._encode = pack
        else:
            dumps = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False,
                                     default=_plain_json).encode
            self._encode = lambda ev: (dumps(ev) + "\n").encode("utf-8")
        self._fh.write(self._encode(dict(header)))

    def write(self, event: Mapping[str, Any]) -> None:
        if self.strict:
            _check(event)
        self._fh.write(self._encode(event))

    def write_many(self, events: Iterable[Mapping[str, Any]]) -> None:
        if self.strict:
            events = map(_check, events)
        self._fh.writelines(map(self._encode, events))

    def close(self) -> None:
        if self._fh.closed:
            return
        self._fh.close()
        try:
            resolve_output(self.path)
            os.replace(self._tmp, self._target)
        except OSError:
            self.abort()
            raise

    def abort(self) -> None:
        """Drop the partial file (an exception while writing)."""
        if not self._fh.closed:
            self._fh.close()
        if os.path.exists(self._tmp):
            os.unlink(self._tmp)

    def __enter__(self) -> "RankLogWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def _check(event: Mapping[str, Any]) -> Mapping[str, Any]:
    problem = event_fields_problem(event)
    if problem is not None:
        raise ValueError(f"event seq {event.get('seq')}: {problem}")
    return event


def write_ranklog(path: str | os.PathLike, header: Mapping[str, Any],
                  events: Iterable[Mapping[str, Any]], strict: bool = False) -> None:
    """Write a whole rank log: ``header`` then ``events`` (encoding from the suffix)."""
    with RankLogWriter(path, header, strict=strict) as w:
        w.write_many(events)


