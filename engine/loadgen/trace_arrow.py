"""Traces as columns on disk: Parquet (``.parquet``) or Arrow IPC (``.arrow`` / ``.feather``).

The schema is the JSONL trace's, one row per request: ``timestamp`` (float64, ms),
``input_length`` and ``output_length`` (int64) and ``hash_ids`` (list<int64>, cut to the blocks
that cover the input), and optionally ``session_id`` (int64, null: no key; the JSONL reader's
session key, a string as its hash; ``conversation_id`` / ``chat_id`` are read too, integers or
strings) and the client hints ``session_end`` (bool, null: false), ``ttl_s`` (float64 seconds
in [0, 1e7], null: no hint) and ``priority`` (int64, null: 0). Reading one skips JSON parsing
entirely: the list column's offsets and values become :class:`~engine.loadgen.trace.Trace`'s
``offsets`` and ``blocks`` without a copy. A columnar file is untrusted input like any trace:
its size is bounded before it is read and every column is checked (types, nulls, ranges,
coverage) with the first bad row named.
"""

from __future__ import annotations

import os

import numpy as np

from engine.core.errors import InputError
from engine.loadgen.trace import (
    HINT_FIELDS,
    MAX_BLOCK_ID,
    MAX_INPUT_LENGTH,
    MAX_TIMESTAMP_MS,
    MAX_TTL_S,
    NO_SESSION,
    SESSION_FIELDS,
    TRACE_BLOCK,
    Trace,
    over_limit,
    session_key,
    trace_limit,
)

COLUMNS = ("timestamp", "input_length", "output_length", "hash_ids")
SUFFIXES = {".parquet": "parquet", ".arrow": "arrow", ".feather": "arrow"}


def columnar_kind(path: str) -> str | None:
    """``parquet`` / ``arrow`` for a path whose suffix names a columnar format, else None."""
    return SUFFIXES.get(os.path.splitext(path)[1].lower())


def _columns(names: list[str]) -> list[str]:
    """The columns read: :data:`COLUMNS`, the first session field present and the hint
    fields present."""
    return (list(COLUMNS) + [k for k in SESSION_FIELDS if k in names][:1]
            + [k for k in HINT_FIELDS if k in names])


def _parquet_plan(pf, name: str, cap: int) -> list[int]:
    """The row groups holding the first ``cap`` rows, after checking from the footer alone
    (before any page is decompressed) that their decoded columns and stored hash ids fit the
    limits: a few KB of run-length or dictionary encoded pages can decode to gigabytes."""
    meta = pf.metadata
    max_blocks, max_bytes = trace_limit("MAX_TRACE_BLOCKS"), trace_limit("MAX_TRACE_BYTES")
    wanted = _columns(pf.schema_arrow.names)
    leaf = [i for i in range(meta.num_columns)
            if meta.schema.column(i).path.split(".")[0] == "hash_ids"]
    groups: list[int] = []
    rows = ids = size = 0
    for g in range(meta.num_row_groups):
        if rows >= cap:
            break
        rg = meta.row_group(g)
        groups.append(g)
        rows += rg.num_rows
        ids += sum(rg.column(i).num_values for i in leaf)
        size += sum(rg.column(i).total_uncompressed_size for i in range(rg.num_columns)
                    if meta.schema.column(i).path.split(".")[0] in wanted)
        if ids > max_blocks:
            raise over_limit(name, f"{ids:,} stored hash ids", "MAX_TRACE_BLOCKS")
        if size > max_bytes:
            raise over_limit(name, f"{size:,} bytes of decoded columns", "MAX_TRACE_BYTES")
    return groups


def _u32(b: bytes, at: int) -> int:
    return int.from_bytes(b[at:at + 4], "little")


def _fb_field(b: bytes, table: int, i: int) -> int | None:
    """Where field ``i`` of the flatbuffer table at ``table`` lies (None: absent)."""
    vt = table - int.from_bytes(b[table:table + 4], "little", signed=True)
    if not 0 <= vt < len(b) - 4:
        raise ValueError("bad vtable")
    at = 4 + 2 * i
    if at >= int.from_bytes(b[vt:vt + 2], "little"):
        return None
    off = int.from_bytes(b[vt + at:vt + at + 2], "little")
    return table + off if off else None


def _ipc_batch_bytes(meta: bytes, body) -> tuple[int, int]:
    """(rows, decoded bytes) of one Arrow IPC record batch, from its message metadata (the
    flatbuffer ``Message`` → ``RecordBatch``) and the 8-byte length that leads each compressed
    buffer, without decoding it."""
    msg = _u32(meta, 0)
    hdr = _fb_field(meta, msg, 2)
    if hdr is None:
        raise ValueError("no header")
    rb = hdr + _u32(meta, hdr)
    length = _fb_field(meta, rb, 0)
    rows = 0 if length is None else int.from_bytes(meta[length:length + 8], "little",
                                                   signed=True)
    bufs = _fb_field(meta, rb, 2)
    compressed = _fb_field(meta, rb, 3) is not None
    total = 0
    if bufs is not None:
        vec = bufs + _u32(meta, bufs)
        for k in range(_u32(meta, vec)):
            at = vec + 4 + 16 * k
            off = int.from_bytes(meta[at:at + 8], "little", signed=True)
            n = int.from_bytes(meta[at + 8:at + 16], "little", signed=True)
            if off < 0 or n < 0 or off + n > body.size:
                raise ValueError("buffer outside the body")
            if compressed and n >= 8:
                raw = int.from_bytes(body.slice(off, 8).to_pybytes(), "little", signed=True)
                n = n - 8 if raw == -1 else raw
            total += max(n, 0)
    return rows, total


def _ipc_plan(path: str, name: str, cap: int) -> None:
    """Check the decoded size of the record batches holding the first ``cap`` rows of an
    Arrow IPC file before any is decompressed (a compressed batch of a few KB can decode to
    gigabytes)."""
    import pyarrow as pa

    max_bytes = trace_limit("MAX_TRACE_BYTES")
    buf = pa.memory_map(path).read_buffer()
    reader = pa.ipc.MessageReader.open_stream(pa.BufferReader(buf.slice(8)))
    rows = total = 0
    try:
        while rows < cap:
            try:
                m = reader.read_next_message()
            except StopIteration:
                break
            if m.type != "record batch":
                continue
            n, size = _ipc_batch_bytes(m.metadata.to_pybytes(), m.body)
            rows += n
            total += size
            if total > max_bytes:
                raise over_limit(name, f"{total:,} bytes of decoded columns", "MAX_TRACE_BYTES")
    except (ValueError, IndexError) as exc:
        if isinstance(exc, InputError):
            raise
        raise InputError(f"{name}: not an Arrow IPC file this reader accepts ({exc})") from None


def _batches(path: str, cap: int, parquet: bool):
    """Record batches of the file's first ``cap`` rows, after a size check."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    name = os.path.basename(path)
    max_blocks, max_bytes = trace_limit("MAX_TRACE_BLOCKS"), trace_limit("MAX_TRACE_BYTES")
    if parquet:
        pf = pq.ParquetFile(path)
        missing = [c for c in COLUMNS if c not in pf.schema_arrow.names]
        if missing:
            raise InputError(f"{name}: missing column {missing[0]!r}")
        groups = _parquet_plan(pf, name, cap)
        batches = pf.iter_batches(batch_size=65_536, columns=_columns(pf.schema_arrow.names),
                                  row_groups=groups)
    else:
        _ipc_plan(path, name, cap)
        reader = pa.ipc.open_file(pa.memory_map(path))
        missing = [c for c in COLUMNS if c not in reader.schema.names]
        if missing:
            raise InputError(f"{name}: missing column {missing[0]!r}")
        cols = _columns(reader.schema.names)
        batches = (reader.get_batch(i).select(cols) for i in range(reader.num_record_batches))
    rows = 0
    nbytes = 0
    ids = 0
    for batch in batches:
        nbytes += batch.nbytes
        if nbytes > max_bytes:
            raise over_limit(name, f"{nbytes:,} bytes of decoded columns", "MAX_TRACE_BYTES")
        batch = batch.slice(0, cap - rows)
        col = batch.column("hash_ids")
        if hasattr(col, "offsets") and len(col):
            offs = col.offsets
            ids += int(offs[len(offs) - 1].as_py()) - int(offs[0].as_py())
            if ids > max_blocks:
                raise over_limit(name, f"{ids:,} stored hash ids", "MAX_TRACE_BLOCKS")
        yield batch
        rows += batch.num_rows
        if rows >= cap:
            return


def _first_bad(name: str, mask: np.ndarray, what: str) -> None:
    if mask.any():
        raise InputError(f"{name}: row {int(np.flatnonzero(mask)[0]) + 1}: {what}")


def _numeric(name: str, col, key: str, integer: bool) -> np.ndarray:
    import pyarrow as pa

    if col.null_count:
        raise InputError(f"{name}: column {key!r} has empty (null) values")
    ok = pa.types.is_integer(col.type) or (not integer and pa.types.is_floating(col.type))
    if not ok:
        kind = "integers" if integer else "numbers"
        raise InputError(f"{name}: column {key!r} must hold {kind}, not {col.type}")
    return col.to_numpy(zero_copy_only=False).astype(np.int64 if integer else np.float64)


def read_columnar(path: str, cap: int, parquet: bool) -> Trace:
    """A Parquet (``parquet=True``) or Arrow IPC file as a checked :class:`Trace`."""
    import pyarrow as pa

    name = os.path.basename(path)
    try:
        batches = list(_batches(path, cap, parquet))
        table = pa.Table.from_batches(batches) if batches else None
    except (pa.ArrowException, ValueError) as exc:
        raise InputError(f"{name}: cannot read trace ({exc})") from None
    if table is None or table.num_rows == 0:
        raise InputError(f"{name}: the trace holds no requests")
    ts = _numeric(name, table.column("timestamp").combine_chunks(), "timestamp", False)
    n_in = _numeric(name, table.column("input_length").combine_chunks(), "input_length", True)
    n_out = _numeric(name, table.column("output_length").combine_chunks(), "output_length", True)
    ids = table.column("hash_ids").combine_chunks()
    if not (pa.types.is_list(ids.type) or pa.types.is_large_list(ids.type)) \
            or not pa.types.is_integer(ids.type.value_type):
        raise InputError(f"{name}: column 'hash_ids' must be a list of integers, not {ids.type}")
    if ids.null_count or ids.values.null_count:
        raise InputError(f"{name}: column 'hash_ids' has empty (null) values")
    _first_bad(name, ~np.isfinite(ts) | (ts < 0) | (ts >= MAX_TIMESTAMP_MS),
               "timestamp must be a number of ms in [0, 2**53)")
    _first_bad(name, n_in < 1, "input_length must be an integer >= 1")
    _first_bad(name, n_in > MAX_INPUT_LENGTH, f"input_length exceeds the limit {MAX_INPUT_LENGTH}")
    _first_bad(name, n_out < 0, "output_length must be an integer >= 0")
    offsets = ids.offsets.to_numpy().astype(np.int64)
    values = ids.flatten().to_numpy(zero_copy_only=False).astype(np.int64)
    if offsets[0]:
        offsets = offsets - offsets[0]
    lens = np.diff(offsets)
    need = -(-n_in // TRACE_BLOCK)
    total = int(need.sum())
    if total > trace_limit("MAX_TRACE_BLOCKS"):
        raise over_limit(name, f"{total:,} blocks", "MAX_TRACE_BLOCKS")
    _first_bad(name, lens < need, f"hash_ids cannot cover input_length (blocks of {TRACE_BLOCK})")
    bad = (values < 0) | (values >= MAX_BLOCK_ID)
    if bad.any():
        row = int(np.searchsorted(offsets, int(np.flatnonzero(bad)[0]), side="right"))
        raise InputError(f"{name}: row {row}: hash_ids must be integers in [0, 2**48)")
    if (lens > need).any():                           # keep only the blocks the input covers
        pos = np.arange(len(values)) - np.repeat(offsets[:-1], lens)
        values = values[pos < np.repeat(need, lens)]
        offsets = np.zeros(len(need) + 1, dtype=np.int64)
        np.cumsum(need, out=offsets[1:])
    return Trace(name, ts, n_in, n_out, offsets, values, _sessions(name, table),
                 *_hints(name, table))


def _hints(name: str, table) -> tuple:
    """``(session_ends, ttl_s, priorities)`` from the hint columns (each ``None`` when the
    column is absent or holds only defaults)."""
    import pyarrow as pa

    names = table.column_names
    ends = ttl = prio = None
    if "session_end" in names:
        col = table.column("session_end").combine_chunks()
        if not pa.types.is_boolean(col.type):
            raise InputError(f"{name}: column 'session_end' must hold booleans, not {col.type}")
        ends = np.asarray(col.fill_null(False).to_numpy(zero_copy_only=False), dtype=bool)
        ends = ends if ends.any() else None
    if "ttl_s" in names:
        col = table.column("ttl_s").combine_chunks()
        if not (pa.types.is_floating(col.type) or pa.types.is_integer(col.type)):
            raise InputError(f"{name}: column 'ttl_s' must hold numbers, not {col.type}")
        valid = np.asarray(col.is_valid().to_numpy(zero_copy_only=False), dtype=bool)
        vals = col.cast(pa.float64()).fill_null(0.0).to_numpy(zero_copy_only=False)
        _first_bad(name, valid & ~((vals >= 0) & (vals <= MAX_TTL_S)),
                   "ttl_s must be a number of seconds in [0, 1e7] or null")
        ttl = np.where(valid, vals, np.nan)
        ttl = None if np.isnan(ttl).all() else ttl
    if "priority" in names:
        col = table.column("priority").combine_chunks()
        if not pa.types.is_integer(col.type):
            raise InputError(f"{name}: column 'priority' must hold integers, not {col.type}")
        vals = col.fill_null(0).to_numpy(zero_copy_only=False)
        if pa.types.is_unsigned_integer(col.type):
            _first_bad(name, vals >= np.uint64(1 << 63),
                       "priority must be an integer in [-2**63, 2**63) or null")
        prio = vals.astype(np.int64)
        prio = prio if prio.any() else None
    return ends, ttl, prio


def _sessions(name: str, table) -> np.ndarray | None:
    """The session key column (see :data:`SESSION_FIELDS`), or ``None`` without one."""
    import pyarrow as pa

    key = next((k for k in SESSION_FIELDS if k in table.column_names), None)
    if key is None:
        return None
    col = table.column(key).combine_chunks()
    if pa.types.is_integer(col.type):
        vals = col.to_numpy(zero_copy_only=False) if not col.null_count else \
            col.fill_null(NO_SESSION).to_numpy(zero_copy_only=False)
        out = vals.astype(np.int64)
        valid = np.asarray(col.is_valid())
        if pa.types.is_unsigned_integer(col.type):
            _first_bad(name, valid & (vals >= np.uint64(1 << 63)),
                       f"column {key!r}: a session key must be in [0, 2**63)")
        _first_bad(name, valid & (out < 0), f"column {key!r}: a session key must be in "
                                            f"[0, 2**63)")
    elif pa.types.is_string(col.type) or pa.types.is_large_string(col.type):
        out = np.fromiter((session_key(v, f"{name}: row {i + 1}")
                           for i, v in enumerate(col.to_pylist())),
                          dtype=np.int64, count=len(col))
    else:
        raise InputError(f"{name}: column {key!r} must hold integers or strings, not {col.type}")
    return out if (out != NO_SESSION).any() else None


def write_columnar(trace: Trace, path: str) -> None:
    """Write ``trace`` as Parquet (zstd) or Arrow IPC, chosen by the suffix of ``path``, by the
    output-path rule of :mod:`formats.outpath` (atomic: a failure leaves no partial file)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    kind = columnar_kind(path)
    if kind is None:
        raise ValueError(f"{path}: the name must end in one of {sorted(SUFFIXES)}")
    small = int(trace.offsets[-1]) < (1 << 31)
    lists, offset_type = (pa.ListArray, np.int32) if small else (pa.LargeListArray, np.int64)
    table = pa.table({
        "timestamp": pa.array(trace.timestamps_ms, type=pa.float64()),
        "input_length": pa.array(trace.input_lengths, type=pa.int64()),
        "output_length": pa.array(trace.output_lengths, type=pa.int64()),
        "hash_ids": lists.from_arrays(pa.array(trace.offsets.astype(offset_type)),
                                      pa.array(trace.blocks, type=pa.int64())),
    })
    if trace.sessions is not None:
        table = table.append_column("session_id", pa.array(
            trace.sessions, type=pa.int64(), mask=trace.sessions == NO_SESSION))
    if trace.session_ends is not None:
        table = table.append_column("session_end", pa.array(trace.session_ends,
                                                            type=pa.bool_()))
    if trace.ttl_s is not None:
        table = table.append_column("ttl_s", pa.array(trace.ttl_s, type=pa.float64(),
                                                      mask=np.isnan(trace.ttl_s)))
    if trace.priorities is not None:
        table = table.append_column("priority", pa.array(trace.priorities, type=pa.int64()))
    from formats.outpath import atomic_output

    with atomic_output(path) as f:
        if kind == "parquet":
            pq.write_table(table, f, compression="zstd")
        else:
            with pa.ipc.new_file(f, table.schema) as w:
                w.write_table(table)
