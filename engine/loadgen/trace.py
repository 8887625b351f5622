"""Mooncake traces (FAST'25 JSONL, plain or ``.gz``; or Parquet/Arrow columns) and their replay.

Each line is ``{"timestamp": ms, "input_length": n, "output_length": m, "hash_ids": [...]}``,
where ``hash_ids`` are *prefix* hashes of 512-token blocks: equal ids mean an identical prefix up
to and including that block. A line may also carry a session key (``session_id``, or
``conversation_id`` / ``chat_id``: :data:`SESSION_FIELDS`), an integer or a string, which the
fleet replay's ``session`` router routes by. No tokens are released, so we invent them: block ``b`` holds the
token positions ``b*512 … b*512+511``, each mixed (splitmix64) into the server's vocabulary.
Equal block ids give equal tokens; different ids give different tokens (a collision of a whole
block is astronomically unlikely even in a 256-token vocabulary), so the server's prefix cache
sees exactly the reuse the trace records.

Client hints (:data:`HINT_FIELDS`, optional on every line): ``session_end`` (``true`` on a
session's last request; absent or ``null``: false), ``ttl_s`` (the client's retention hint,
expected seconds until the session's next request: a finite number in [0, 1e7]; absent or
``null``: no hint) and ``priority`` (an integer in [-2**63, 2**63); absent or ``null``: 0).

``block_tokens`` < 512 scales the trace down for small models: each block becomes that many
tokens and every input length shrinks by the same factor, keeping the reuse structure.
"""

from __future__ import annotations

import dataclasses
import gzip
import io
import json
import math
import os
from collections.abc import Sequence
from typing import Iterable

import numpy as np

from engine.core.errors import InputError, UsageError
from engine.loadgen.workloads import DEFAULT_VOCAB, RequestSpec, Workload

TRACE_BLOCK = 512
MAX_LINE_BYTES = 4 << 20
MAX_INPUT_LENGTH = 4_000_000
MAX_REQUESTS = 1_000_000
MAX_BLOCK_ID = 1 << 48
MAX_TIMESTAMP_MS = float(1 << 53)      # integral milliseconds stay exact below this
SESSION_FIELDS = ("session_id", "conversation_id", "chat_id")
"""Where a request's session key may be, first found wins: an integer in [0, 2**63) is the key
itself, a string (at most :data:`MAX_SESSION_CHARS`) its 63-bit hash (:func:`session_key`);
``null`` or absent: no key (``-1`` in :attr:`Trace.sessions`)."""
MAX_SESSION_CHARS = 1024
NO_SESSION = -1
HINT_FIELDS = ("session_end", "ttl_s", "priority")
MAX_TTL_S = 1e7
"""Largest ``ttl_s`` a trace may carry (about 116 days)."""

# What a trace may make the reader hold, whatever its file size (a gzip or Parquet file of a
# few KB can describe gigabytes). Each can be raised through the environment variable named.
MAX_TRACE_BLOCKS = 1 << 24
"""Hash ids held for the whole trace (sum of ceil(input_length / 512)), and hash ids a columnar
file may store (before lists longer than their input are cut): 16 Mi blocks, 8 Gi tokens."""
MAX_TRACE_BYTES = 1 << 30
"""Bytes of JSONL text read (after gzip) or of columns decoded from a Parquet/Arrow file."""
LIMIT_ENV = {"MAX_TRACE_BLOCKS": "HICACHE_TRACE_MAX_BLOCKS",
             "MAX_TRACE_BYTES": "HICACHE_TRACE_MAX_BYTES"}


def trace_limit(name: str) -> int:
    """The limit ``name`` (``MAX_TRACE_BLOCKS`` / ``MAX_TRACE_BYTES``): its environment
    variable when set (an integer >= 1), else the default above."""
    env = LIMIT_ENV[name]
    raw = os.environ.get(env)
    if raw is None or not raw.strip():
        return int(globals()[name])
    try:
        val = int(raw.strip().replace("_", ""))
    except ValueError:
        val = 0
    if val < 1:
        raise UsageError(f"{env}={raw!r}: must be an integer >= 1")
    return val


def over_limit(where: str, what: str, name: str) -> InputError:
    """The one-line error for a trace past a named limit, saying how to raise it."""
    return InputError(f"{where}: {what} exceeds the limit {trace_limit(name):,} ({name}; "
                      f"raise it with {LIMIT_ENV[name]}=N)")

_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        z = x + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return (z ^ (z >> np.uint64(31))) & _M64


def session_key(value: object, where: str) -> int:
    """A session key as a non-negative int64 (:data:`SESSION_FIELDS`); ``NO_SESSION`` for
    ``None``."""
    if value is None:
        return NO_SESSION
    if type(value) is int:
        if not 0 <= value < 1 << 63:
            raise InputError(f"{where}: a session key must be an integer in [0, 2**63) or a "
                             f"string, got {str(value)[:40]}")
        return value
    if isinstance(value, str) and 0 < len(value) <= MAX_SESSION_CHARS:
        import hashlib

        digest = hashlib.blake2b(value.encode("utf-8", "surrogatepass"), digest_size=8).digest()
        return int.from_bytes(digest, "little") >> 1
    raise InputError(f"{where}: a session key must be an integer in [0, 2**63) or a string of "
                     f"1..{MAX_SESSION_CHARS} characters, got {type(value).__name__}")


def block_tokens(block_id: int, n: int = TRACE_BLOCK, vocab_size: int = DEFAULT_VOCAB) -> np.ndarray:
    """The first ``n`` tokens of trace block ``block_id`` (``n`` ≤ 512)."""
    pos = np.arange(n, dtype=np.uint64) + np.uint64(block_id) * np.uint64(TRACE_BLOCK)
    return (_splitmix64(pos) % np.uint64(vocab_size)).astype(np.int64)


@dataclasses.dataclass(frozen=True)
class TraceRecord:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    session: int = NO_SESSION
    session_end: bool = False
    ttl_s: float | None = None
    priority: int = 0


@dataclasses.dataclass(frozen=True, eq=False)
class Trace:
    """A parsed trace as columns: one row per request, the block ids of all requests in one
    flat array (request ``i`` owns ``blocks[offsets[i]:offsets[i + 1]]``, exactly the blocks that
    cover its input). Cheap to slice, to share with worker processes and to store as Parquet."""

    name: str
    timestamps_ms: np.ndarray      # float64
    input_lengths: np.ndarray      # int64
    output_lengths: np.ndarray     # int64
    offsets: np.ndarray            # int64, len(self) + 1
    blocks: np.ndarray             # int64
    sessions: np.ndarray | None = None
    """int64 session key per request (``NO_SESSION``: none), or ``None`` when the trace
    carries no key at all."""
    session_ends: np.ndarray | None = None
    """bool per request (true: the session's last request), or ``None`` when no request of
    the trace sets ``session_end``."""
    ttl_s: np.ndarray | None = None
    """float64 per request, the client's expected seconds to the session's next request (NaN:
    no hint), or ``None`` when no request carries ``ttl_s``."""
    priorities: np.ndarray | None = None
    """int64 per request, or ``None`` when every request's priority is the default 0."""

    def __len__(self) -> int:
        return len(self.input_lengths)

    @property
    def has_hints(self) -> bool:
        """Whether any request carries a session key, a session end or a ttl."""
        return bool((self.sessions is not None and (self.sessions != NO_SESSION).any())
                    or (self.session_ends is not None and self.session_ends.any())
                    or (self.ttl_s is not None and (~np.isnan(self.ttl_s)).any()))

    def hash_ids(self, i: int) -> np.ndarray:
        return self.blocks[self.offsets[i]:self.offsets[i + 1]]

    def head(self, n: int | None) -> "Trace":
        """The first ``n`` requests (all of them for ``None``)."""
        if n is None or n >= len(self):
            return self
        def cut(a: np.ndarray | None) -> np.ndarray | None:
            return None if a is None else a[:n]

        return Trace(self.name, self.timestamps_ms[:n], self.input_lengths[:n],
                     self.output_lengths[:n], self.offsets[:n + 1],
                     self.blocks[:int(self.offsets[n])], cut(self.sessions),
                     cut(self.session_ends), cut(self.ttl_s), cut(self.priorities))

    def records(self) -> list[TraceRecord]:
        ids = self.blocks.tolist()
        offs = self.offsets.tolist()
        n = len(self)
        sess = [NO_SESSION] * n if self.sessions is None else self.sessions.tolist()
        ends = [False] * n if self.session_ends is None else self.session_ends.tolist()
        ttls = [None] * n if self.ttl_s is None else \
            [None if math.isnan(t) else t for t in self.ttl_s.tolist()]
        prio = [0] * n if self.priorities is None else self.priorities.tolist()
        return [TraceRecord(ts, n_in, n_out, tuple(ids[offs[i]:offs[i + 1]]), sess[i],
                            bool(ends[i]), ttls[i], prio[i])
                for i, (ts, n_in, n_out) in enumerate(zip(self.timestamps_ms.tolist(),
                                                          self.input_lengths.tolist(),
                                                          self.output_lengths.tolist()))]

    @classmethod
    def from_records(cls, records: Iterable[TraceRecord], name: str = "records") -> "Trace":
        recs = list(records)
        lens = [len(r.hash_ids) for r in recs]
        offsets = np.zeros(len(recs) + 1, dtype=np.int64)
        np.cumsum(lens, out=offsets[1:])
        blocks = np.fromiter((b for r in recs for b in r.hash_ids), dtype=np.int64,
                             count=int(offsets[-1]))
        sess = np.array([r.session for r in recs], dtype=np.int64)
        return cls(name, np.array([r.timestamp_ms for r in recs], dtype=np.float64),
                   np.array([r.input_length for r in recs], dtype=np.int64),
                   np.array([r.output_length for r in recs], dtype=np.int64), offsets, blocks,
                   sess if (sess != NO_SESSION).any() else None,
                   *hint_columns([r.session_end for r in recs],
                                 [math.nan if r.ttl_s is None else r.ttl_s for r in recs],
                                 [r.priority for r in recs]))


def hint_columns(ends: list, ttls: list, prios: list) -> tuple:
    """``(session_ends, ttl_s, priorities)`` of :class:`Trace` from per-request lists (False /
    NaN / 0 for none), each ``None`` when no request sets it."""
    e = np.array(ends, dtype=bool)
    t = np.array(ttls, dtype=np.float64)
    p = np.array(prios, dtype=np.int64)
    return (e if e.any() else None, None if np.isnan(t).all() else t,
            p if p.any() else None)


def _open_text(path: str) -> io.TextIOBase:
    with open(path, "rb") as f:
        magic = f.read(2)
    raw = gzip.open(path, "rb") if magic == b"\x1f\x8b" else open(path, "rb")
    return io.TextIOWrapper(raw, encoding="utf-8", errors="strict")


def _check_path(path: str) -> None:
    if not os.path.exists(path):
        raise FileNotFoundError(2, "No such file or directory", path)
    if os.path.isdir(path):
        raise IsADirectoryError(21, "Is a directory", path)


def _hints(obj: dict, where: str) -> tuple[bool, float, int]:
    """The hint fields of one line: (session_end, ttl_s or NaN, priority)."""
    if "session_end" not in obj and "ttl_s" not in obj and "priority" not in obj:
        return _NO_HINTS
    end = obj.get("session_end")
    if end is None:
        end = False
    elif type(end) is not bool:
        raise InputError(f"{where}: session_end must be true, false or null, got "
                         f"{str(end)[:40]}")
    ttl = obj.get("ttl_s")
    if ttl is None:
        ttl = math.nan
    elif isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not math.isfinite(ttl) \
            or not 0 <= ttl <= MAX_TTL_S:
        raise InputError(f"{where}: ttl_s must be a number of seconds in [0, 1e7] or null, "
                         f"got {str(ttl)[:40]}")
    prio = obj.get("priority")
    if prio is None:
        prio = 0
    elif type(prio) is not int or not -(1 << 63) <= prio < 1 << 63:
        raise InputError(f"{where}: priority must be an integer in [-2**63, 2**63) or null, "
                         f"got {str(prio)[:40]}")
    return end, float(ttl), prio


def _parse(line: str, where: str) -> tuple[float, int, int, list[int], int, tuple]:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise InputError(f"{where}: not JSON ({exc.msg})") from None
    except RecursionError:
        raise InputError(f"{where}: not a trace record (JSON nested too deeply)") from None
    except ValueError as exc:       # e.g. an integer past Python's digit limit
        raise InputError(f"{where}: not JSON this reader accepts ({str(exc)[:80]})") from None
    if not isinstance(obj, dict):
        raise InputError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    try:
        ts, n_in, n_out, ids = (obj["timestamp"], obj["input_length"], obj["output_length"],
                                obj["hash_ids"])
    except KeyError as exc:
        raise InputError(f"{where}: missing field {exc.args[0]!r}") from None
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts) \
            or not 0 <= ts < MAX_TIMESTAMP_MS:
        raise InputError(f"{where}: timestamp must be a number of ms in [0, 2**53), "
                         f"got {str(ts)[:40]}")
    for key, v, lo in (("input_length", n_in, 1), ("output_length", n_out, 0)):
        if type(v) is not int or v < lo:
            raise InputError(f"{where}: {key} must be an integer >= {lo}, got {v!r}")
    if n_in > MAX_INPUT_LENGTH:
        raise InputError(f"{where}: input_length {n_in} exceeds the limit {MAX_INPUT_LENGTH}")
    need = -(-n_in // TRACE_BLOCK)
    if not isinstance(ids, list) or not _INT_ONLY.issuperset(map(type, ids)) or (
            ids and (min(ids) < 0 or max(ids) >= MAX_BLOCK_ID)):
        raise InputError(f"{where}: hash_ids must be a list of integers in [0, 2**48)")
    if len(ids) < need:
        raise InputError(f"{where}: {len(ids)} hash_ids cannot cover input_length {n_in} "
                         f"(need {need} blocks of {TRACE_BLOCK})")
    key = next((obj[k] for k in SESSION_FIELDS if k in obj), None)
    hints = _NO_HINTS if len(obj) == 4 else _hints(obj, where)
    return float(ts), n_in, n_out, ids[:need], session_key(key, where), hints


_NO_HINTS = (False, math.nan, 0)
_INT_ONLY = frozenset((int,))    # the types a list of block ids may hold (not bool, not float)


class _Blocks:
    """Block ids appended line by line into a growing int64 array (8 bytes a block, not a
    Python list's 8 + the int objects)."""

    def __init__(self) -> None:
        self.buf = np.empty(1 << 12, dtype=np.int64)
        self.n = 0

    def extend(self, ids: list[int]) -> None:
        end = self.n + len(ids)
        if end > len(self.buf):
            grown = np.empty(max(end, 2 * len(self.buf)), dtype=np.int64)
            grown[:self.n] = self.buf[:self.n]
            self.buf = grown
        self.buf[self.n:end] = ids
        self.n = end

    def array(self) -> np.ndarray:
        return self.buf[:self.n].copy()


def _load_jsonl(path: str, cap: int) -> Trace:
    name = os.path.basename(path)
    max_blocks, max_bytes = trace_limit("MAX_TRACE_BLOCKS"), trace_limit("MAX_TRACE_BYTES")
    ts: list[float] = []
    n_in: list[int] = []
    n_out: list[int] = []
    lens: list[int] = []
    sess: list[int] = []
    ends: list[bool] = []            # hints: filled from the first line that has one
    ttls: list[float] = []
    prios: list[int] = []
    hinted = False
    blocks = _Blocks()
    read = 0
    with _open_text(path) as f:
        for lineno, line in enumerate(iter(lambda: f.readline(MAX_LINE_BYTES + 1), ""), 1):
            if len(line) > MAX_LINE_BYTES:
                raise InputError(f"{name}:{lineno}: line longer than {MAX_LINE_BYTES} bytes")
            read += len(line)
            if read > max_bytes:
                raise over_limit(f"{name}:{lineno}", "the text read", "MAX_TRACE_BYTES")
            if lineno > MAX_REQUESTS:    # blank lines count against the limit too
                break
            if not line.strip():
                continue
            t, i, o, ids, key, hint = _parse(line, f"{name}:{lineno}")
            if blocks.n + len(ids) > max_blocks:
                raise over_limit(f"{name}:{lineno}", f"{blocks.n + len(ids):,} blocks",
                                 "MAX_TRACE_BLOCKS")
            ts.append(t)
            n_in.append(i)
            n_out.append(o)
            lens.append(len(ids))
            sess.append(key)
            if hint is not _NO_HINTS and not hinted:
                hinted = True
                back = len(ts) - 1
                ends, ttls, prios = [False] * back, [math.nan] * back, [0] * back
            if hinted:
                ends.append(hint[0])
                ttls.append(hint[1])
                prios.append(hint[2])
            blocks.extend(ids)
            if len(ts) >= cap:
                break
    offsets = np.zeros(len(lens) + 1, dtype=np.int64)
    np.cumsum(lens, out=offsets[1:])
    keys = np.array(sess, dtype=np.int64)
    cols = hint_columns(ends, ttls, prios) if hinted else (None, None, None)
    return Trace(name, np.array(ts, dtype=np.float64), np.array(n_in, dtype=np.int64),
                 np.array(n_out, dtype=np.int64), offsets, blocks.array(),
                 keys if (keys != NO_SESSION).any() else None, *cols)


def load_trace(path: str, limit: int | None = None) -> Trace:
    """Parse a trace into columns: Mooncake JSONL (plain or gzip), or the Parquet / Arrow file
    ``hicache bench convert-trace`` writes (told apart by their first bytes, not the name).
    The first bad line raises ``InputError`` naming file and line (row for columnar files)."""
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    cap = MAX_REQUESTS if limit is None else min(limit, MAX_REQUESTS)
    _check_path(path)
    name = os.path.basename(path)
    try:
        with open(path, "rb") as f:
            magic = f.read(6)
        if magic[:4] == b"PAR1" or magic == b"ARROW1":
            from engine.loadgen.trace_arrow import read_columnar

            trace = read_columnar(path, cap, parquet=magic[:4] == b"PAR1")
        else:
            trace = _load_jsonl(path, cap)
    except (gzip.BadGzipFile, EOFError, UnicodeDecodeError, OSError) as exc:
        if isinstance(exc, (FileNotFoundError, IsADirectoryError, PermissionError)):
            raise
        raise InputError(f"{name}: cannot read trace ({exc})") from None
    if not len(trace):
        raise InputError(f"{name}: the trace holds no requests (in its first "
                         f"{MAX_REQUESTS:,} lines)")
    return trace


JSONL_SUFFIXES = (".jsonl", ".jsonl.gz")


def write_jsonl(trace: Trace, path: str) -> None:
    """Write ``trace`` as Mooncake JSONL (gzip when ``path`` ends in ``.gz``), one request a
    line in the trace's order, with ``session_id`` / ``session_end`` / ``ttl_s`` /
    ``priority`` on the lines that carry them (session keys as integers: a string key was
    hashed when read). By the output-path rule of :mod:`formats.outpath` (atomic)."""
    from formats.outpath import atomic_output

    n = len(trace)
    ts = trace.timestamps_ms.tolist()
    n_in = trace.input_lengths.tolist()
    n_out = trace.output_lengths.tolist()
    offs = trace.offsets.tolist()
    ids = trace.blocks.tolist()
    sess = None if trace.sessions is None else trace.sessions.tolist()
    ends = None if trace.session_ends is None else trace.session_ends.tolist()
    ttls = None if trace.ttl_s is None else trace.ttl_s.tolist()
    prio = None if trace.priorities is None else trace.priorities.tolist()
    with atomic_output(path) as raw:
        out = gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=6, mtime=0) \
            if path.lower().endswith(".gz") else raw
        try:
            for i in range(n):
                t = ts[i]
                rec: dict = {"timestamp": int(t) if t.is_integer() else t,
                             "input_length": n_in[i], "output_length": n_out[i],
                             "hash_ids": ids[offs[i]:offs[i + 1]]}
                if sess is not None and sess[i] != NO_SESSION:
                    rec["session_id"] = sess[i]
                if ends is not None and ends[i]:
                    rec["session_end"] = True
                if ttls is not None and not math.isnan(ttls[i]):
                    rec["ttl_s"] = ttls[i]
                if prio is not None and prio[i]:
                    rec["priority"] = prio[i]
                out.write(json.dumps(rec).encode() + b"\n")
        finally:
            if out is not raw:
                out.close()


def read_trace(path: str, limit: int | None = None) -> list[TraceRecord]:
    """:func:`load_trace` as one :class:`TraceRecord` per request."""
    return load_trace(path, limit).records()


class TraceTokens(Sequence):
    """The prompt of one trace request, made when it is read: holds only the request's block
    ids, so a workload of many long requests costs its blocks, not its tokens, until each
    request is sent. Reads like a tuple of ints (``len``, index, slice → tuple, ``==``)."""

    __slots__ = ("_ids", "_n", "_per_block", "_vocab")

    def __init__(self, hash_ids: np.ndarray, n: int, per_block: int, vocab_size: int):
        self._ids, self._n, self._per_block, self._vocab = hash_ids, n, per_block, vocab_size

    def array(self) -> np.ndarray:
        parts = [block_tokens(int(b), self._per_block, self._vocab) for b in self._ids]
        return np.concatenate(parts)[:self._n] if parts else np.zeros(0, dtype=np.int64)

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i):
        if isinstance(i, slice):
            return tuple(self.array()[i].tolist())
        return int(self.array()[i])

    def __iter__(self):
        return iter(self.array().tolist())

    def __eq__(self, other) -> bool:
        if not isinstance(other, Sequence):
            return NotImplemented
        return len(self) == len(other) and tuple(self) == tuple(other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"TraceTokens({self._n} tokens of {len(self._ids)} blocks)"


class _OneShot:
    """A trace request is a session of one turn with a fixed arrival time."""

    def __init__(self, spec: RequestSpec):
        self._spec = spec

    def first(self) -> RequestSpec:
        return self._spec

    def after(self, spec: RequestSpec, output_ids) -> None:
        return None


def request_tokens(rec: TraceRecord, block_tokens_n: int = TRACE_BLOCK,
                   vocab_size: int = DEFAULT_VOCAB) -> np.ndarray:
    """The prompt of one trace request: its blocks' tokens, cut at the (scaled) input length."""
    n = -(-rec.input_length * block_tokens_n // TRACE_BLOCK)
    parts = [block_tokens(b, block_tokens_n, vocab_size) for b in rec.hash_ids]
    return np.concatenate(parts)[:n]


def trace_workload(path: str, *, speedup: float = 1.0, limit: int | None = None,
                   block_tokens_n: int = TRACE_BLOCK, vocab_size: int = DEFAULT_VOCAB,
                   max_tokens: int | None = None) -> Workload:
    """Replay a trace: request ``i`` is due ``(timestamp_i - timestamp_0) / 1000 / speedup`` s
    after the start, asks for ``output_length`` tokens (capped by ``max_tokens``). Prompts are
    :class:`TraceTokens`, made as each request is sent: memory stays at the trace's blocks."""
    if not (speedup > 0 and math.isfinite(speedup)):
        raise ValueError(f"speedup must be a finite number > 0, got {speedup}")
    if not 1 <= block_tokens_n <= TRACE_BLOCK:
        raise ValueError(f"block tokens must be in 1..{TRACE_BLOCK}, got {block_tokens_n}")
    if not 2 <= vocab_size <= 1 << 31:
        raise ValueError(f"vocab-size must be in 2..{1 << 31:,}, got {vocab_size:,}")
    trace = load_trace(path, limit)
    order = np.argsort(trace.timestamps_ms, kind="stable")
    t0 = float(trace.timestamps_ms[order[0]])
    sessions = []
    for i, r in enumerate(order.tolist()):
        n_out = int(trace.output_lengths[r])
        out = n_out if max_tokens is None else min(n_out, max_tokens)
        n = -(-int(trace.input_lengths[r]) * block_tokens_n // TRACE_BLOCK)
        toks = TraceTokens(trace.hash_ids(r), n, block_tokens_n, vocab_size)
        spec = RequestSpec(i, 0, toks, max(out, 1),  # type: ignore[arg-type]
                           arrival=(float(trace.timestamps_ms[r]) - t0) / 1000.0 / speedup)
        sessions.append(_OneShot(spec))
    return Workload(f"trace:{os.path.basename(path)}", tuple(sessions), len(sessions))
