"""Rank log format v1 (``docs/rank-log-format.md``): one file per rank, header then events.

Two encodings of the same records: a stream of msgpack maps (``*.ranklog``, native, what the
engine writes) and JSON Lines (``*.jsonl``, for hand-written cases). The first record is the
header ``{"format": "hicache-ranklog", "version": 1, "rank", "world_size", "dp_rank", "tp_rank",
"tp_size", "pp_rank", "pp_size", "cp_rank", "cp_size"}``; every later record is one event
``{"seq", "step", "kind", ...}`` (kinds and their fields: :mod:`formats.ranklog_events`). Fields
named ``local_*`` are rank-local and never compared.

Writing is :mod:`formats.ranklog_writer` (:func:`write_ranklog`, :class:`RankLogWriter`). This
module reads logs with size limits (:class:`RankLogFile`: single records, fast runs of records, plain iteration). The
v1 rules that say which difference between two ranks' events falls in which category live in
:mod:`formats.ranklog_compare`. Every problem with the input is a :class:`RankLogError` (a
``formats.errors.FormatError``) naming the file and the byte offset (msgpack) or line (JSON
Lines).
"""

from __future__ import annotations

import enum
import io
import json
import math
import mmap
import os
import re
from itertools import islice, repeat
from operator import itemgetter
from typing import Any, Iterator

import msgpack

from formats.errors import FormatError
from formats.ranklog_events import KIND, LOCAL_PREFIX, SEQ, STEP, event_fields_problem

FORMAT_NAME = "hicache-ranklog"
VERSION = 1
SUPPORTED_VERSIONS = (1,)
MSGPACK_SUFFIX = ".ranklog"
JSONL_SUFFIX = ".jsonl"
SUFFIXES = (MSGPACK_SUFFIX, JSONL_SUFFIX)

# Parallel coordinates of a rank and their defaults (rank 0 of size 1).
PARALLEL_DEFAULTS: dict[str, int] = {
    "dp_rank": 0, "tp_rank": 0, "tp_size": 1, "pp_rank": 0, "pp_size": 1,
    "cp_rank": 0, "cp_size": 1,
}

# Decoding limits: one record (header or event) is at most MAX_RECORD_BYTES; strings, arrays
# and maps inside it are bounded too, so a corrupt length prefix cannot allocate gigabytes.
MAX_RECORD_BYTES = 16 << 20
MAX_STR_BYTES = 1 << 20
MAX_ARRAY_LEN = 1 << 20
MAX_MAP_LEN = 1 << 12
_READ_SIZE = 1 << 20
_SINGLE_GUESS = 512


class RankLogError(FormatError):
    """An unreadable rank log; names the file and the byte offset (msgpack) or line (JSONL)."""

    def __init__(self, path: str, where: str | None, problem: str):
        self.path = path
        self.where = where
        self.problem = problem
        super().__init__(f"{path}: {where}: {problem}" if where else f"{path}: {problem}")


class Encoding(str, enum.Enum):
    msgpack = "msgpack"
    jsonl = "jsonl"


def encoding_for(path: str | os.PathLike) -> Encoding:
    """The encoding a rank log path is written in, from its suffix."""
    name = os.fspath(path)
    if name.endswith(MSGPACK_SUFFIX):
        return Encoding.msgpack
    if name.endswith(JSONL_SUFFIX):
        return Encoding.jsonl
    raise ValueError(f"rank log path must end in one of {', '.join(SUFFIXES)}: {name}")


# -- records -------------------------------------------------------------------------------------
def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


def _finite_float(text: str) -> float:
    """JSON numbers only: NaN and infinities (Python's extensions, or an overflowing 1e400)
    would compare unequal to themselves and could not be written back as JSON."""
    v = float(text)
    if not math.isfinite(v):
        raise ValueError(f"number {text[:40]} is out of range")
    return v


def _type_name(v: Any) -> str:
    return {dict: "map", list: "array", str: "string", bytes: "binary", int: "integer",
            float: "float", bool: "boolean", type(None): "nil"}.get(type(v), type(v).__name__)


def _a(v: Any) -> str:
    name = _type_name(v)
    return ("an " if name[0] in "aeiou" else "a ") + name


def _short(v: Any, limit: int = 60) -> str:
    s = repr(v)
    return s if len(s) <= limit else s[:limit - 3] + "..."


def parse_header(obj: Any, path: str, where: str | None) -> dict[str, Any]:
    """Validate a header record; return it with parallel fields defaulted (rank 0 of size 1).

    The version is checked for type only: callers decide what to do with versions they do not
    read (the checker reports mixed versions before unsupported ones).
    """
    def bad(problem: str) -> RankLogError:
        return RankLogError(path, where, problem)

    if type(obj) is not dict:
        raise bad(f"first record is {_a(obj)}, not a rank log header map")
    if obj.get("format") != FORMAT_NAME:
        if "seq" in obj or "kind" in obj:
            raise bad(f"no header: the first record is an event; a rank log starts with "
                      f'{{"format": "{FORMAT_NAME}", "version": {VERSION}, "rank": ..., ...}}')
        raise bad(f"wrong header: format is {_short(obj.get('format'))}, expected {FORMAT_NAME!r}")
    version = obj.get("version")
    if type(version) is not int or version < 1:
        raise bad(f"wrong header: version must be a positive integer, got {_short(version)}")
    out = dict(obj)
    for key in ("rank", "world_size"):
        if key not in obj:
            raise bad(f"wrong header: no {key!r} field")
    for key, default in PARALLEL_DEFAULTS.items():
        out.setdefault(key, default)
    for key in ("rank", "world_size", *PARALLEL_DEFAULTS):
        v = out[key]
        low = 1 if key.endswith("size") else 0
        if type(v) is not int or v < low:
            raise bad(f"wrong header: {key} must be an integer >= {low}, got {_short(v)}")
    for key in ("rank", "tp_rank", "pp_rank", "cp_rank"):
        size_key = "world_size" if key == "rank" else key.replace("_rank", "_size")
        if out[key] >= out[size_key]:
            raise bad(f"wrong header: {key} {out[key]} is not below {size_key} {out[size_key]}")
    return out


def event_problem(obj: Any) -> str | None:
    """Why ``obj`` is not a v1 event record, or ``None`` when it is one."""
    if type(obj) is not dict:
        return f"record is {_a(obj)}, not an event map"
    if "format" in obj and SEQ not in obj:
        return "a second header in the middle of the log (two logs concatenated?)"
    for key, typ in ((SEQ, int), (STEP, int), (KIND, str)):
        if key not in obj:
            return f"event has no {key!r} field"
        v = obj[key]
        if type(v) is not typ:
            want = "an integer" if typ is int else "a string"
            return f"event field {key!r} must be {want}, got {_type_name(v)} {_short(v)}"
        if typ is int and v < 0:
            return f"event field {key!r} must be >= 0, got {v}"
    return None


def is_local(key: Any) -> bool:
    return type(key) is str and key.startswith(LOCAL_PREFIX)


_ABSENT = object()
_NL = b"\n"
_BLANK = re.compile(rb"(?:[ \t\r]*\n)*")


class Run:
    """A run of decoded events, split for comparison (see :func:`split_run`).

    ``events[i]`` is the event without ``seq`` and ``local_*`` fields (the dicts are reused);
    ``seqs[i]`` / ``steps[i]`` its seq and step; the local fields are kept per key.
    """

    __slots__ = ("seqs", "steps", "events", "_locals")

    def __init__(self, seqs: list[int], steps: list[int], events: list[dict],
                 local_values: dict[str, list[Any]]):
        self.seqs = seqs
        self.steps = steps
        self.events = events
        self._locals = local_values

    def __len__(self) -> int:
        return len(self.events)

    def full(self, i: int) -> dict[str, Any]:
        """Event ``i`` as recorded: seq first, then its fields, then its local fields."""
        out = {"seq": self.seqs[i], **self.events[i]}
        for k, vals in self._locals.items():
            if vals[i] is not _ABSENT:
                out[k] = vals[i]
        return out

    def cut(self, n: int) -> "Run":
        return Run(self.seqs[:n], self.steps[:n], self.events[:n],
                   {k: v[:n] for k, v in self._locals.items()})


def split_run(objs: list[Any]) -> Run | None:
    """Validate decoded records as events and split off ``seq`` and ``local_*`` fields.

    Works on whole lists with C-level passes (no per-event Python code). Returns ``None`` when
    some record is not a valid event; the dicts may then be half-stripped, so the caller
    re-decodes the run to report the first bad record (:meth:`RankLogFile.raise_first_bad`).
    """
    if not objs:
        return Run([], [], [], {})
    if set(map(type, objs)) != {dict}:
        return None
    try:
        steps = list(map(itemgetter("step"), objs))
        kinds = list(map(itemgetter("kind"), objs))
        seqs = list(map(dict.pop, objs, repeat("seq")))
    except KeyError:
        return None
    if (set(map(type, seqs)) != {int} or set(map(type, steps)) != {int}
            or set(map(type, kinds)) != {str} or min(seqs) < 0 or min(steps) < 0):
        return None
    local_values: dict[str, list[Any]] = {}
    for key in set().union(*objs):
        if is_local(key):
            local_values[key] = list(map(dict.pop, objs, repeat(key), repeat(_ABSENT)))
    return Run(seqs, steps, objs, local_values)


# -- reading -------------------------------------------------------------------------------------
def _size_text(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 and not n & ((1 << 20) - 1) else f"{n:,} bytes"


def _no_ext(code: int, data: bytes) -> Any:
    raise ValueError(f"msgpack extension type {code} is not allowed in a rank log")


class RankLogFile:
    """One rank log opened for reading: header parsed, body decoded on demand with size limits.

    Positions are byte offsets into the file. :meth:`decode_at` decodes one record,
    :meth:`decode_run` many at once (the fast path), :meth:`events` iterates validated events.
    The file is memory-mapped, so the checker can also compare raw record bytes across ranks
    (:meth:`raw`). Use as a context manager or call :meth:`close`.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        try:
            self.encoding = encoding_for(self.path)
            sniff = False
        except ValueError:
            self.encoding, sniff = Encoding.msgpack, True
        with open(self.path, "rb") as fh:
            self.size = os.fstat(fh.fileno()).st_size
            self._mm: mmap.mmap | None = None
            if self.size:
                try:
                    self._mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
                except (ValueError, OSError):  # not mappable (pipe, special file): read it
                    self._mm = None
            if self._mm is not None:
                self._data: Any = self._mm
                self._src: Any = self._mm
            else:
                data = fh.read()
                self.size = len(data)
                self._data, self._src = data, io.BytesIO(data)
        if sniff and self.size:
            head = bytes(self._data[:64]).lstrip()
            if head.startswith(b"{"):
                self.encoding = Encoding.jsonl
        self._u: msgpack.Unpacker | None = None       # sequential runs (reads the file)
        self._u_base = 0
        self._single: msgpack.Unpacker | None = None  # random access (fed slices)
        try:
            first = self.decode_at(0)
            if first is None:
                raise RankLogError(self.path, None, "empty file: no rank log header")
            obj, self.body_offset = first
            self.header = parse_header(obj, self.path, self.where(0))
        except BaseException:
            self.close()
            raise
        self.version: int = self.header["version"]
        self.rank: int = self.header["rank"]

    # -- lifecycle -----------------------------------------------------------------------------
    def close(self) -> None:
        self._u = self._single = None
        if self._mm is not None:
            self._mm.close()
            self._mm = None

    def __enter__(self) -> "RankLogFile":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def require_supported(self) -> None:
        if self.version not in SUPPORTED_VERSIONS:
            raise RankLogError(self.path, self.where(0),
                              f"unsupported rank log version {self.version} (this hicache reads "
                              f"version {', '.join(map(str, SUPPORTED_VERSIONS))})")

    # -- positions -----------------------------------------------------------------------------
    def where(self, offset: int) -> str:
        """Human position of ``offset``: ``byte offset N`` or ``line N``."""
        if self.encoding is Encoding.jsonl:
            return f"line {bytes(self._data[:offset]).count(_NL) + 1}"
        return f"byte offset {offset}"

    def error(self, offset: int, problem: str) -> RankLogError:
        return RankLogError(self.path, self.where(offset), problem)

    def raw(self, start: int, end: int) -> bytes:
        """The file's bytes ``[start, end)`` (shorter at the end of the file)."""
        return self._data[start:end]

    # -- decoding ------------------------------------------------------------------------------
    def _unpacker_at(self, offset: int) -> msgpack.Unpacker:
        u = self._u
        if u is not None and self._u_base + u.tell() == offset:
            return u
        self._src.seek(offset)
        u = msgpack.Unpacker(
            self._src, read_size=min(_READ_SIZE, MAX_RECORD_BYTES),
            max_buffer_size=MAX_RECORD_BYTES, raw=False,
            use_list=True, strict_map_key=True, ext_hook=_no_ext, max_str_len=MAX_STR_BYTES,
            max_bin_len=MAX_RECORD_BYTES, max_array_len=MAX_ARRAY_LEN, max_map_len=MAX_MAP_LEN,
            max_ext_len=0)
        self._u, self._u_base = u, offset
        return u

    def _bad_msgpack(self, offset: int, exc: BaseException) -> RankLogError:
        self._u = None
        if isinstance(exc, msgpack.BufferFull):
            return self.error(offset,
                              f"record larger than the {_size_text(MAX_RECORD_BYTES)} limit")
        if "max_ext_len" in str(exc):
            return self.error(offset, "msgpack extension types (timestamps, ...) are not allowed "
                                      "in a rank log")
        return self.error(offset, f"undecodable msgpack ({type(exc).__name__}: {exc})")

    def _single_unpacker(self) -> msgpack.Unpacker:
        u = self._single
        if u is None:
            u = self._single = msgpack.Unpacker(
                read_size=_SINGLE_GUESS, max_buffer_size=MAX_RECORD_BYTES, raw=False,
                use_list=True, strict_map_key=True, ext_hook=_no_ext, max_str_len=MAX_STR_BYTES,
                max_bin_len=MAX_RECORD_BYTES, max_array_len=MAX_ARRAY_LEN,
                max_map_len=MAX_MAP_LEN, max_ext_len=0)
        return u

    def decode_at(self, offset: int) -> tuple[Any, int] | None:
        """The record starting at ``offset`` and the offset after it; ``None`` at end of file."""
        if offset >= self.size:
            return None
        if self.encoding is Encoding.jsonl:
            return self._jsonl_at(offset)
        u = self._u
        if u is not None and self._u_base + u.tell() == offset:   # sequential reading
            try:
                obj = u.unpack()
                end = self._u_base + u.tell()
                if end - offset > MAX_RECORD_BYTES:
                    self._u = None
                    raise self.error(offset, f"record larger than the "
                                             f"{_size_text(MAX_RECORD_BYTES)} limit")
                return obj, end
            except msgpack.OutOfData:
                self._u = None
                raise self.error(offset, f"truncated record: the file ends at byte {self.size} "
                                         f"inside it") from None
            except (ValueError, msgpack.UnpackException) as exc:
                raise self._bad_msgpack(offset, exc) from None
        # random access: a long-lived feed-mode unpacker, fed a guess of the record's size
        u = self._single_unpacker()
        data, t0, fed, want = self._data, u.tell(), offset, _SINGLE_GUESS
        try:
            while True:
                piece = data[fed:fed + want]
                u.feed(piece)
                fed += len(piece)
                try:
                    obj = u.unpack()
                    break
                except msgpack.OutOfData:
                    if fed >= self.size:
                        self._single = None
                        raise self.error(offset, f"truncated record: the file ends at byte "
                                                 f"{self.size} inside it") from None
                    want = min(2 * want, MAX_RECORD_BYTES)
        except (ValueError, msgpack.UnpackException) as exc:
            self._single = None
            raise self._bad_msgpack(offset, exc) from None
        end = offset + u.tell() - t0
        if fed > end:
            u.read_bytes(fed - end)   # drop what was fed past the record
        if end - offset > MAX_RECORD_BYTES:   # the feed buffer does not enforce it exactly
            self._single = None
            raise self.error(offset, f"record larger than the {_size_text(MAX_RECORD_BYTES)} "
                                     f"limit")
        return obj, end

    def _jsonl_at(self, offset: int) -> tuple[Any, int] | None:
        data, size = self._data, self.size
        # Blank lines are skipped in one C-level scan (a file of a billion newlines costs a
        # second, not a Python iteration per line).
        offset = _BLANK.match(data, offset).end()
        while offset < size:
            nl = data.find(b"\n", offset)
            end = size if nl < 0 else nl
            if end - offset > MAX_RECORD_BYTES:
                raise self.error(offset,
                                 f"line longer than the {_size_text(MAX_RECORD_BYTES)} limit")
            line = data[offset:end]
            nxt = end + 1 if nl >= 0 else size
            if line.strip():
                try:
                    return json.loads(line, parse_constant=_no_constant,
                                      parse_float=_finite_float), nxt
                except json.JSONDecodeError as exc:
                    raise self.error(offset, f"invalid JSON ({exc.msg} at column {exc.colno})") \
                        from None
                except (ValueError, RecursionError) as exc:
                    raise self.error(offset, f"invalid JSON ({type(exc).__name__}: {exc})") \
                        from None
            offset = nxt
        return None

    def decode_run(self, offset: int, max_records: int) -> tuple[list[Any], int]:
        """Up to ``max_records`` records from ``offset`` (fewer only at the end of the file)
        and the offset after the last one."""
        if self.encoding is Encoding.jsonl:
            objs: list[Any] = []
            while len(objs) < max_records:
                r = self._jsonl_at(offset)
                if r is None:
                    break
                objs.append(r[0])
                offset = r[1]
            return objs, offset
        if offset >= self.size:
            return [], offset
        u = self._unpacker_at(offset)
        try:
            objs = list(islice(u, max_records))
        except (ValueError, msgpack.UnpackException):
            self._u = None
            self.raise_first_bad(offset)
            raise AssertionError("unreachable") from None  # pragma: no cover
        ends = None
        if len(objs) == max_records:
            end = self._u_base + u.tell()
        else:
            # Short run: the end of the file. After a partial record the unpacker's position is
            # not a record boundary, so find the end of the last complete record by skipping.
            self._u = None
            ends = self.record_ends(offset, len(objs)) if objs else []
            end = ends[-1] if ends else offset
            if end < self.size:
                self._u = None
                raise self.error(end, f"truncated record: the file ends at byte {self.size} "
                                      f"inside it")
        if end - offset > MAX_RECORD_BYTES:   # the reader streams: check record sizes after
            ends = ends or self.record_ends(offset, len(objs))
            for start, stop in zip([offset, *ends], ends):
                if stop - start > MAX_RECORD_BYTES:
                    self._u = None
                    raise self.error(start, f"record larger than the "
                                            f"{_size_text(MAX_RECORD_BYTES)} limit")
        return objs, end

    def record_ends(self, offset: int, n: int) -> list[int]:
        """End offsets of the ``n`` records from ``offset`` (they were decoded before)."""
        ends: list[int] = []
        if self.encoding is Encoding.jsonl:
            for _ in range(n):
                r = self._jsonl_at(offset)
                assert r is not None, (self.path, offset)
                offset = r[1]
                ends.append(offset)
            return ends
        u = self._unpacker_at(offset)
        base, skip, tell = self._u_base, u.skip, u.tell
        for _ in range(n):
            skip()
            ends.append(base + tell())
        return ends

    def raise_first_bad(self, offset: int) -> None:
        """Decode record by record from ``offset`` and raise for the first bad one."""
        while True:
            r = self.decode_at(offset)
            if r is None:
                raise self.error(offset, "undecodable record")
            obj, end = r
            problem = event_problem(obj)
            if problem is not None:
                raise self.error(offset, problem)
            offset = end

    def read_run(self, offset: int, max_records: int) -> tuple[Run, int]:
        """:meth:`decode_run` + :func:`split_run`; raises for the first invalid event."""
        objs, end = self.decode_run(offset, max_records)
        run = split_run(objs)
        if run is None:
            self.raise_first_bad(offset)
        return run, end  # type: ignore[return-value]

    def events(self, chunk: int = 4096, strict: bool = False) -> Iterator[dict[str, Any]]:
        """Every event, validated, as recorded (a plain streaming reader). ``strict`` also
        checks each event of a known kind against its fields (formats.ranklog_events)."""
        offset = self.body_offset
        while True:
            run, end = self.read_run(offset, chunk)
            for i in range(len(run)):
                ev = run.full(i)
                if strict:
                    problem = event_fields_problem(ev)
                    if problem is not None:
                        at = self.record_ends(offset, i)[-1] if i else offset
                        raise self.error(at, problem)
                yield ev
            if len(run) < chunk:
                return
            offset = end


def read_ranklog(path: str | os.PathLike, strict: bool = False
                 ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Header and all events of a (small) rank log; large logs: use :class:`RankLogFile`.
    ``strict``: events of known kinds must have exactly their kind's fields."""
    with RankLogFile(path) as f:
        f.require_supported()
        return f.header, list(f.events(strict=strict))
