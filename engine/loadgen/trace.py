"""Mooncake trace replay (FAST'25 JSONL, plain or ``.gz``).

Each line is ``{"timestamp": ms, "input_length": n, "output_length": m, "hash_ids": [...]}``,
where ``hash_ids`` are *prefix* hashes of 512-token blocks: equal ids mean an identical prefix up
to and including that block. No tokens are released, so we invent them: block ``b`` holds the
token positions ``b*512 … b*512+511``, each mixed (splitmix64) into the server's vocabulary.
Equal block ids give equal tokens; different ids give different tokens (a collision of a whole
block is astronomically unlikely even in a 256-token vocabulary), so the server's prefix cache
sees exactly the reuse the trace records.

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

import numpy as np

from engine.core.errors import InputError
from engine.loadgen.workloads import DEFAULT_VOCAB, RequestSpec, Workload

TRACE_BLOCK = 512
MAX_LINE_BYTES = 4 << 20
MAX_INPUT_LENGTH = 4_000_000
MAX_REQUESTS = 1_000_000

_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        z = x + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return (z ^ (z >> np.uint64(31))) & _M64


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


def _open_text(path: str) -> io.TextIOBase:
    if not os.path.exists(path):
        raise FileNotFoundError(2, "No such file or directory", path)
    if os.path.isdir(path):
        raise IsADirectoryError(21, "Is a directory", path)
    with open(path, "rb") as f:
        magic = f.read(2)
    raw = gzip.open(path, "rb") if magic == b"\x1f\x8b" else open(path, "rb")
    return io.TextIOWrapper(raw, encoding="utf-8", errors="strict")


def _parse(line: str, where: str) -> TraceRecord:
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
    for key in ("timestamp", "input_length", "output_length", "hash_ids"):
        if key not in obj:
            raise InputError(f"{where}: missing field {key!r}")
    ts, n_in, n_out, ids = (obj["timestamp"], obj["input_length"], obj["output_length"],
                            obj["hash_ids"])
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts) or ts < 0:
        raise InputError(f"{where}: timestamp must be a number >= 0, got {ts!r}")
    for key, v, lo in (("input_length", n_in, 1), ("output_length", n_out, 0)):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise InputError(f"{where}: {key} must be an integer >= {lo}, got {v!r}")
    if n_in > MAX_INPUT_LENGTH:
        raise InputError(f"{where}: input_length {n_in} exceeds the limit {MAX_INPUT_LENGTH}")
    if not isinstance(ids, list) or not all(
            isinstance(b, int) and not isinstance(b, bool) and 0 <= b < 2**48 for b in ids):
        raise InputError(f"{where}: hash_ids must be a list of integers in [0, 2**48)")
    need = -(-n_in // TRACE_BLOCK)
    if len(ids) < need:
        raise InputError(f"{where}: {len(ids)} hash_ids cannot cover input_length {n_in} "
                         f"(need {need} blocks of {TRACE_BLOCK})")
    return TraceRecord(float(ts), n_in, n_out, tuple(ids[:need]))


def read_trace(path: str, limit: int | None = None) -> list[TraceRecord]:
    """Parse a Mooncake trace; the first bad line raises ``InputError`` naming file and line."""
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    cap = MAX_REQUESTS if limit is None else min(limit, MAX_REQUESTS)
    out: list[TraceRecord] = []
    name = os.path.basename(path)
    try:
        with _open_text(path) as f:
            for lineno, line in enumerate(iter(lambda: f.readline(MAX_LINE_BYTES + 1), ""), 1):
                if len(line) > MAX_LINE_BYTES:
                    raise InputError(f"{name}:{lineno}: line longer than {MAX_LINE_BYTES} bytes")
                if lineno > MAX_REQUESTS:    # blank lines count against the limit too
                    break
                if not line.strip():
                    continue
                out.append(_parse(line, f"{name}:{lineno}"))
                if len(out) >= cap:
                    break
    except (gzip.BadGzipFile, EOFError, UnicodeDecodeError, OSError) as exc:
        if isinstance(exc, (FileNotFoundError, IsADirectoryError, PermissionError)):
            raise
        raise InputError(f"{name}: cannot read trace ({exc})") from None
    if not out:
        raise InputError(f"{name}: the trace holds no requests (in its first "
                         f"{MAX_REQUESTS:,} lines)")
    return out


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
    after the start, asks for ``output_length`` tokens (capped by ``max_tokens``)."""
    if not (speedup > 0 and math.isfinite(speedup)):
        raise ValueError(f"speedup must be a finite number > 0, got {speedup}")
    if not 1 <= block_tokens_n <= TRACE_BLOCK:
        raise ValueError(f"block tokens must be in 1..{TRACE_BLOCK}, got {block_tokens_n}")
    recs = sorted(read_trace(path, limit), key=lambda r: r.timestamp_ms)
    t0 = recs[0].timestamp_ms
    sessions = []
    for i, rec in enumerate(recs):
        out = rec.output_length if max_tokens is None else min(rec.output_length, max_tokens)
        toks = request_tokens(rec, block_tokens_n, vocab_size)
        spec = RequestSpec(i, 0, tuple(int(t) for t in toks), max(out, 1),
                           arrival=(rec.timestamp_ms - t0) / 1000.0 / speedup)
        sessions.append(_OneShot(spec))
    return Workload(f"trace:{os.path.basename(path)}", tuple(sessions), len(sessions))

