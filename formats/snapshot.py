"""Radix-tree snapshots on disk (``docs/tree-snapshot-format.md``).

A snapshot is a stream of msgpack objects: one header map, one array per node (parents before
children), one end-marker map. Token ids travel as raw uint32 little-endian bytes and page ids
as raw int64 little-endian bytes, so a million-node file loads in a couple of seconds: the
reader decodes node arrays in chunks and turns each chunk into numpy columns
(:class:`NodeColumns`) instead of building one Python object per node.

Nothing is executed while reading (no pickle, no ext types); every msgpack object is bounded in
size, the node count is bounded, and any malformation raises :class:`SnapshotError` (a
``formats.errors.FormatError``) with one line naming the file and what is wrong. This module
imports nothing from ``engine``.
"""

from __future__ import annotations

import dataclasses
import gc
import io
import math
import os
import time
from typing import IO, Any, Iterable, Iterator, NamedTuple

import msgpack
import numpy as np

from formats import snapshot_hints as hints
from formats.errors import FormatError
from formats.snapshot_hints import MAX_SESSION_KEY_CHARS, SHARED  # noqa: F401  (re-exported)


class SnapshotError(FormatError):
    """A file that is not a readable tree snapshot; the one-line message names the file."""


FORMAT_NAME = "hicache-tree-snapshot"
VERSION = 2

NODE_FIELDS_V1: tuple[str, ...] = (
    "id", "parent", "tokens", "namespace", "l1", "l2", "l3",
    "lock_ref", "hit_count", "last_access", "priority", "cp_owner", "inflight",
)
NODE_FIELDS: tuple[str, ...] = NODE_FIELDS_V1 + ("session", "hint_until")
"""Node array columns in order (the header's ``node_fields``); version 1 has the first 13."""

HEADER_FIELDS_V1 = frozenset({"format", "version", "page_size", "created_at", "model", "rank",
                              "capacity", "node_fields", "meta"})
HEADER_FIELDS = HEADER_FIELDS_V1 | {"hint_clock"}
REQUIRED_HEADER_FIELDS = HEADER_FIELDS_V1 - {"meta"}
MODEL_FIELDS = frozenset({"name", "layout"})
TIERS = ("l1", "l2", "l3")

INFLIGHT_LOAD = 1      # an L2 -> L1 load-back of this node is in flight (its L1 is not a hit)
INFLIGHT_BACKUP = 2    # an L1 -> L2 backup of this node is in flight (its L2 is not set yet)

# Limits (a snapshot is untrusted input).
MAX_OBJECT_BYTES = 64 << 20          # one header or node object (an edge of 16M tokens)
MAX_NODES = 100_000_000
MAX_STR_BYTES = 64 << 10             # namespace, model name, meta strings
MAX_CREATED_AT = 253402300799        # 9999-12-31 23:59:59 UTC, the last second datetime shows
MAX_CONTAINER_LEN = 4096             # header maps/lists; a node array has len(NODE_FIELDS)
_CHUNK = 1 << 16                     # node arrays decoded per columnar conversion
_FIELDS_OF = {1: NODE_FIELDS_V1, 2: NODE_FIELDS}
_HEADER_OF = {1: HEADER_FIELDS_V1, 2: HEADER_FIELDS}


class NodeRecord(NamedTuple):
    """One node as plain values: what writers hand in and :meth:`SnapshotData.records` yields.

    ``tokens`` is the edge (uint32 ids); ``l1``/``l2`` are the page ids holding the edge in
    that tier, or ``None`` when the node is not resident there; ``l3`` is the number of the
    edge's pages known stored in L3; ``cp_owner`` the owner rank of the first page when
    CP-sharded (page ``k`` is owned by ``(cp_owner + k) % cp_size``); ``inflight`` is a bit set
    of :data:`INFLIGHT_LOAD` / :data:`INFLIGHT_BACKUP`. Client hints (version 2): ``session``
    is ``None`` (no session), :data:`SHARED` (``True``: several sessions) or the owning
    session's client key (str or int); ``hint_until`` the predicted next use in hint-clock
    seconds (``inf``: its session closed) or ``None``.
    """

    id: int
    parent: int | None
    tokens: Any
    namespace: str | None = None
    l1: Any = None
    l2: Any = None
    l3: int = 0
    lock_ref: int = 0
    hit_count: int = 0
    last_access: int = 0
    priority: int = 0
    cp_owner: int | None = None
    inflight: int = 0
    session: str | int | bool | None = None
    hint_until: float | None = None


def make_header(page_size: int, *, created_at: float | None = None, model: str | None = None,
                layout: dict | None = None, rank: dict | None = None,
                capacity: dict | None = None, meta: dict | None = None,
                hint_clock: float | None = None) -> dict:
    """A header of the current version. ``capacity`` maps ``l1``/``l2``/``l3`` to tokens
    (None: absent); ``hint_clock`` is the cache's hint clock in seconds (None: no hints)."""
    cap = {t: None for t in TIERS}
    for k, v in (capacity or {}).items():
        if k not in cap:
            raise ValueError(f"unknown capacity tier {k!r}; choose from {list(TIERS)}")
        cap[k] = None if v is None else int(v)
    header = {
        "format": FORMAT_NAME,
        "version": VERSION,
        "page_size": int(page_size),
        "created_at": float(time.time() if created_at is None else created_at),
        "model": {"name": model, "layout": dict(layout) if layout is not None else None},
        "rank": {k: int(v) for k, v in (rank or {}).items()},
        "capacity": cap,
        "node_fields": list(NODE_FIELDS),
    }
    if hint_clock is not None:
        header["hint_clock"] = float(hint_clock)
    if meta:
        header["meta"] = dict(meta)
    _check_header(header, "<header>")
    return header


# --------------------------------------------------------------------------------- writing
def _bytes_of(arr: Any, dtype: str) -> bytes:
    if isinstance(arr, (bytes, bytearray, memoryview)):
        return bytes(arr)
    return np.ascontiguousarray(arr, dtype=dtype).tobytes()


class SnapshotWriter:
    """Stream a snapshot into a binary file object: header now, :meth:`add` per node, then
    :meth:`close` (writes the end marker; does not close the file). Parents before children."""

    def __init__(self, fileobj: IO[bytes], header: dict):
        _check_header(header, "<header>")
        self._f = fileobj
        self._pack = msgpack.Packer(use_bin_type=True).pack
        self._f.write(self._pack(header))
        self.count = 0
        self._closed = False

    def add(self, rec: NodeRecord | tuple) -> None:
        """One node; a 13-field tuple (version 1's fields) has no session and no hint."""
        (nid, parent, tokens, ns, l1, l2, l3, lock, hits, last, prio, cp, infl) = rec[:13]
        sess, until = (rec[13], hints.check_record(nid, *rec[13:15])) if len(rec) > 13 \
            else (None, None)
        self._f.write(self._pack([
            int(nid), None if parent is None else int(parent), _bytes_of(tokens, "<u4"), ns,
            None if l1 is None else _bytes_of(l1, "<i8"),
            None if l2 is None else _bytes_of(l2, "<i8"),
            int(l3), int(lock), int(hits), int(last), int(prio),
            None if cp is None else int(cp), int(infl),
            sess, until,
        ]))
        self.count += 1

    def close(self) -> None:
        if not self._closed:
            self._f.write(self._pack({"end": FORMAT_NAME, "nodes": self.count}))
            self._closed = True

    def __enter__(self) -> "SnapshotWriter":
        return self

    def __exit__(self, exc_type, *_: Any) -> None:
        if exc_type is None:
            self.close()


def write_snapshot(dest: str | os.PathLike | IO[bytes], header: dict,
                   nodes: Iterable[NodeRecord | tuple]) -> int:
    """Write a whole snapshot; returns the node count. A path is written atomically
    (temporary file in the same directory, then rename)."""
    if hasattr(dest, "write"):
        with SnapshotWriter(dest, header) as w:  # type: ignore[arg-type]
            for rec in nodes:
                w.add(rec)
        return w.count
    from formats.outpath import atomic_output

    # never replaces a device, FIFO or directory; writes through a symlink (formats.outpath)
    with atomic_output(dest) as f:
        n = write_snapshot(f, header, nodes)
    return n


def encode_snapshot(header: dict, nodes: Iterable[NodeRecord | tuple]) -> bytes:
    """The snapshot as bytes (for an HTTP response body)."""
    buf = io.BytesIO()
    write_snapshot(buf, header, nodes)
    return buf.getvalue()


# --------------------------------------------------------------------------------- reading
@dataclasses.dataclass
class NodeColumns:
    """Every node as numpy columns, in file order (parents before children).

    ``-1`` stands for ``None`` in ``parent``, ``cp_owner`` and the ``l1_len``/``l2_len``
    columns (not resident), ``NaN`` for ``None`` in ``hint_until``. Ragged values (tokens, page
    ids) are one flat array each plus offsets: node ``i``'s edge is ``tokens[tok_off[i]:…]``.
    """

    id: np.ndarray
    parent: np.ndarray
    tok_off: np.ndarray
    tokens: np.ndarray
    ns_code: np.ndarray
    namespaces: list
    l1_len: np.ndarray
    l1_off: np.ndarray
    l1_ids: np.ndarray
    l2_len: np.ndarray
    l2_off: np.ndarray
    l2_ids: np.ndarray
    l3: np.ndarray
    lock_ref: np.ndarray
    hit_count: np.ndarray
    last_access: np.ndarray
    priority: np.ndarray
    cp_owner: np.ndarray
    inflight: np.ndarray
    session_code: np.ndarray      # -1: no session, -2: shared, k >= 0: ``sessions[k]``
    sessions: list                # the distinct client session keys (str or int)
    hint_until: np.ndarray        # float64 hint-clock seconds, NaN: no hint, inf: closed
    parent_index: np.ndarray | None = None   # row of the parent (-1 for roots), set on read

    def __len__(self) -> int:
        return len(self.id)


@dataclasses.dataclass
class SnapshotData:
    header: dict
    nodes: NodeColumns

    @property
    def page_size(self) -> int:
        return self.header["page_size"]

    def records(self) -> Iterator[NodeRecord]:
        """The nodes as :class:`NodeRecord` values (arrays are views into the columns)."""
        c = self.nodes
        to, o1, o2 = c.tok_off, c.l1_off, c.l2_off
        codes = c.session_code.tolist()
        untils = [None if u != u else u for u in c.hint_until.tolist()]   # NaN: nil
        for i in range(len(c)):
            yield NodeRecord(
                int(c.id[i]), None if c.parent[i] < 0 else int(c.parent[i]),
                c.tokens[to[i]:to[i + 1]], c.namespaces[c.ns_code[i]],
                None if c.l1_len[i] < 0 else c.l1_ids[o1[i]:o1[i + 1]],
                None if c.l2_len[i] < 0 else c.l2_ids[o2[i]:o2[i + 1]],
                int(c.l3[i]), int(c.lock_ref[i]), int(c.hit_count[i]), int(c.last_access[i]),
                int(c.priority[i]), None if c.cp_owner[i] < 0 else int(c.cp_owner[i]),
                int(c.inflight[i]), hints.session_of(codes[i], c.sessions), untils[i])


def _unpacker(f: IO[bytes]) -> msgpack.Unpacker:
    return msgpack.Unpacker(
        f, raw=False, use_list=False, strict_map_key=True, max_buffer_size=MAX_OBJECT_BYTES,
        max_str_len=MAX_STR_BYTES, max_bin_len=MAX_OBJECT_BYTES,
        max_array_len=MAX_CONTAINER_LEN, max_map_len=MAX_CONTAINER_LEN, max_ext_len=0,
        read_size=1 << 20)


def read_snapshot(src: str | os.PathLike | IO[bytes], *, max_nodes: int = MAX_NODES
                  ) -> SnapshotData:
    """Read and validate a snapshot. Raises :class:`SnapshotError` (one line) on bad input."""
    if hasattr(src, "read"):
        name = getattr(src, "name", "<stream>")
        return _read(src, str(name), max_nodes)  # type: ignore[arg-type]
    path = os.fspath(src)
    with open(path, "rb") as f:
        return _read(f, path, max_nodes)


def _read(f: IO[bytes], name: str, max_nodes: int) -> SnapshotData:
    if hasattr(f, "peek"):
        head = f.peek(1)[:1]
    else:
        pos = f.tell()
        head = f.read(1)
        f.seek(pos)
    if not head:
        raise _err(name, f"empty file, not a {FORMAT_NAME}")
    unpacker = _unpacker(f)
    try:
        header = next(unpacker)
    except StopIteration:
        raise _err(name, "truncated snapshot (incomplete header)") from None
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise _err(name, f"not a {FORMAT_NAME} ({_why(exc)})") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT_NAME:
        raise _err(name, f"not a {FORMAT_NAME} (no snapshot header)")
    _check_header(header, name)
    version = header["version"]
    width = len(_FIELDS_OF[version])
    was_enabled = gc.isenabled()
    gc.disable()  # millions of short-lived tuples: generational GC would dominate the load
    try:
        chunks: list[_Chunk] = []
        rows: list[tuple] = []
        trailer = None
        count = 0
        try:
            for obj in unpacker:
                if type(obj) is tuple and len(obj) == width:
                    rows.append(obj)
                    if len(rows) == _CHUNK:
                        chunks.append(_Chunk.of(rows, name, count))
                        count += len(rows)
                        rows = []
                        if count > max_nodes:
                            raise _err(name, f"more than {max_nodes} nodes")
                    continue
                if isinstance(obj, dict) and "end" in obj:
                    trailer = obj
                    break
                where = f"node #{count + len(rows)}"
                if type(obj) is tuple:
                    raise _err(name, f"{where} has {len(obj)} fields, version "
                                     f"{version} nodes have {width}")
                raise _err(name, f"{where} is a {type(obj).__name__}, expected a "
                                 f"node array")
            if trailer is not None:
                try:
                    extra = next(unpacker)
                except StopIteration:
                    extra = None
                else:
                    raise _err(name, f"data after the end marker "
                                     f"({type(extra).__name__})")
        except SnapshotError:
            raise
        except Exception as exc:
            raise _err(name, f"corrupt snapshot at node #{count + len(rows)} "
                             f"({_why(exc)})") from None
        if rows:
            chunks.append(_Chunk.of(rows, name, count))
            count += len(rows)
            rows = []
        if count > max_nodes:
            raise _err(name, f"more than {max_nodes} nodes")
        if trailer is None:
            raise _err(name, f"truncated snapshot (no end marker; {count} complete "
                             f"node{'' if count == 1 else 's'} read)")
        if trailer.get("end") != FORMAT_NAME or set(trailer) != {"end", "nodes"}:
            raise _err(name, f"bad end marker {sorted(trailer)}")
        if trailer["nodes"] != count:
            raise _err(name, f"end marker says {trailer['nodes']} nodes, the file "
                             f"holds {count}")
        cols = _Chunk.join(chunks)
    finally:
        if was_enabled:
            gc.enable()
    cols.parent_index = _check_nodes(cols, name)
    return SnapshotData(header, cols)


def _err(name: str, problem: str, where: str | None = None) -> "SnapshotError":
    return SnapshotError(f"{name}: {where}: {problem}" if where else f"{name}: {problem}")


def _why(exc: BaseException) -> str:
    msg = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {msg}" if msg else type(exc).__name__


def _first_bad(values: tuple, ok) -> tuple[int, Any]:
    return next((k, v) for k, v in enumerate(values) if not ok(v))


def _ints(values: tuple, name: str, first: int, field: str, nullable: bool = False
          ) -> np.ndarray:
    """A column's Python values as a checked int64 array (nil → -1 when ``nullable``)."""
    n_none = values.count(None) if nullable else 0
    orig = values
    if n_none:
        values = tuple(-1 if v is None else v for v in values)
    try:
        arr = np.array(values)
    except (OverflowError, ValueError, TypeError):
        arr = np.array([None], dtype=object)
    if arr.dtype.kind not in "iu" or (arr.dtype.kind == "u"
                                       and arr.max() > np.iinfo(np.int64).max):
        k, bad = _first_bad(values, lambda v: type(v) is int and -2**63 <= v < 2**63)
        what = f"{type(bad).__name__} {bad!r}"[:60] if type(bad) is not int else "out of range"
        raise _err(name, f"field {field!r} must be an integer{' or nil' if nullable else ''}, "
                         f"found {what}", where=f"node #{first + k}")
    arr = arr.astype(np.int64, copy=False)
    if nullable and int(np.count_nonzero(arr < 0)) != n_none:
        k, _ = _first_bad(orig, lambda v: v is None or v >= 0)
        raise _err(name, f"field {field!r} must be >= 0 or nil", where=f"node #{first + k}")
    return arr


def _blobs(values: tuple, name: str, first: int, field: str, itemsize: int, nullable: bool
           ) -> tuple[np.ndarray, bytes]:
    """Lengths (in items; -1 for nil) and the joined bytes of a bytes column."""
    try:
        if nullable:
            lens = np.fromiter((-1 if v is None else len(v) for v in values), dtype=np.int64,
                               count=len(values))
            joined = b"".join(v for v in values if v is not None)
        else:
            lens = np.fromiter(map(len, values), dtype=np.int64, count=len(values))
            joined = b"".join(values)
    except TypeError:
        k, bad = _first_bad(values, lambda v: type(v) is bytes or (nullable and v is None))
        raise _err(name, f"field {field!r} must be raw bytes{' or nil' if nullable else ''}, "
                         f"found {type(bad).__name__}", where=f"node #{first + k}") from None
    ragged = (lens > 0) & (lens % itemsize != 0)
    if ragged.any():
        raise _err(name, f"field {field!r} length is not a multiple of {itemsize} bytes",
                   where=f"node #{first + int(np.argmax(ragged))}")
    return np.where(lens < 0, -1, lens // itemsize), joined


class _Chunk:
    """Columns of up to ``_CHUNK`` nodes."""

    @staticmethod
    def of(rows: list[tuple], name: str, first: int) -> dict:
        cols = tuple(zip(*rows))
        (ids, parents, toks, nss, l1s, l2s, l3s, locks, hits, lasts, prios, cps,
         infls) = cols[:13]
        tok_len, tok_bytes = _blobs(toks, name, first, "tokens", 4, False)
        l1_len, l1_bytes = _blobs(l1s, name, first, "l1", 8, True)
        l2_len, l2_bytes = _blobs(l2s, name, first, "l2", 8, True)
        if set(map(type, nss)) - {str, type(None)}:
            k, bad = _first_bad(nss, lambda v: v is None or type(v) is str)
            raise _err(name, f"field 'namespace' must be a string or nil, found "
                             f"{type(bad).__name__}", where=f"node #{first + k}")

        def ints(values: tuple, field: str, nullable: bool = False) -> np.ndarray:
            return _ints(values, name, first, field, nullable)

        try:
            sess = hints.session_column(cols[13]) if len(cols) > 13 else (None,) * len(rows)
            until = hints.hint_column(cols[14] if len(cols) > 13 else (None,) * len(rows))
        except hints.BadValue as bad:
            raise _err(name, bad.problem, where=f"node #{first + bad.k}") from None

        return {
            "id": ints(ids, "id"), "parent": ints(parents, "parent", True),
            "tok_len": tok_len, "tokens": tok_bytes, "ns": nss,
            "l1_len": l1_len, "l1_ids": l1_bytes, "l2_len": l2_len, "l2_ids": l2_bytes,
            "l3": ints(l3s, "l3"), "lock_ref": ints(locks, "lock_ref"),
            "hit_count": ints(hits, "hit_count"), "last_access": ints(lasts, "last_access"),
            "priority": ints(prios, "priority"), "cp_owner": ints(cps, "cp_owner", True),
            "inflight": ints(infls, "inflight"),
            "session": sess, "hint_until": until,
        }

    @staticmethod
    def join(chunks: list[dict]) -> NodeColumns:
        def cat(key: str) -> np.ndarray:
            if not chunks:
                return np.empty(0, dtype=np.int64)
            return np.concatenate([c[key] for c in chunks])

        def offsets(lens: np.ndarray) -> np.ndarray:
            off = np.zeros(len(lens) + 1, dtype=np.int64)
            np.cumsum(np.maximum(lens, 0), out=off[1:])
            return off

        def flat(key: str, dtype: str, native: type) -> np.ndarray:
            raw = b"".join(c[key] for c in chunks)
            return np.frombuffer(raw, dtype=dtype).astype(native, copy=False)

        namespaces: dict = {}
        codes = []
        for c in chunks:
            for v in sorted(set(c["ns"]), key=lambda x: (x is not None, x or "")):
                namespaces.setdefault(v, len(namespaces))
            if len(namespaces) == 1:  # the common case: every node in one namespace
                codes.append(np.zeros(len(c["ns"]), dtype=np.int32))
            else:
                codes.append(np.fromiter(map(namespaces.__getitem__, c["ns"]), dtype=np.int32,
                                         count=len(c["ns"])))
        session_code, sessions = hints.session_codes([c["session"] for c in chunks])
        l1_len, l2_len = cat("l1_len"), cat("l2_len")
        tok_len = cat("tok_len")
        return NodeColumns(
            id=cat("id"), parent=cat("parent"), tok_off=offsets(tok_len),
            tokens=flat("tokens", "<u4", np.uint32),
            ns_code=np.concatenate(codes) if codes else np.empty(0, dtype=np.int32),
            namespaces=list(namespaces),
            l1_len=l1_len, l1_off=offsets(l1_len), l1_ids=flat("l1_ids", "<i8", np.int64),
            l2_len=l2_len, l2_off=offsets(l2_len), l2_ids=flat("l2_ids", "<i8", np.int64),
            l3=cat("l3"), lock_ref=cat("lock_ref"), hit_count=cat("hit_count"),
            last_access=cat("last_access"), priority=cat("priority"),
            cp_owner=cat("cp_owner"), inflight=cat("inflight"),
            session_code=session_code, sessions=sessions,
            hint_until=cat("hint_until").astype(np.float64))


# --------------------------------------------------------------------------------- checks
def _check_header(h: dict, name: str) -> None:
    if not isinstance(h, dict):
        raise _err(name, "header is not a map")
    if h.get("format") != FORMAT_NAME:
        raise _err(name, f"not a {FORMAT_NAME} (format {h.get('format')!r})")
    v = h.get("version")
    if type(v) is not int:
        raise _err(name, "header version is missing or not an integer")
    if v > VERSION:
        raise _err(name, f"snapshot version {v} is newer than this reader "
                         f"(supports up to {VERSION}); upgrade hicache")
    if v < 1:
        raise _err(name, f"bad snapshot version {v}")
    unknown = sorted(set(h) - _HEADER_OF[v])
    if unknown:
        raise _err(name, f"unknown header field(s) {unknown} in a version {v} "
                         f"snapshot")
    missing = sorted(REQUIRED_HEADER_FIELDS - set(h))
    if missing:
        raise _err(name, f"header lacks field(s) {missing}")
    ps = h["page_size"]
    if type(ps) is not int or not 1 <= ps <= 1 << 20:
        raise _err(name, f"header page_size must be an integer in [1, 2**20], "
                         f"got {ps!r}")
    ts = h["created_at"]
    if type(ts) not in (int, float) or not (math.isfinite(ts) and 0 <= ts <= MAX_CREATED_AT):
        raise _err(name, f"header created_at must be unix seconds in [0, {MAX_CREATED_AT}], "
                         f"got {ts!r}"[:120])
    model = h["model"]
    if not isinstance(model, dict) or set(model) - MODEL_FIELDS:
        raise _err(name, f"header model must be a map with keys "
                         f"{sorted(MODEL_FIELDS)}")
    if not isinstance(model.get("name"), (str, type(None))) or \
            not isinstance(model.get("layout"), (dict, type(None))):
        raise _err(name, "header model.name must be a string, model.layout a map")
    rank = h["rank"]
    if not isinstance(rank, dict) or any(type(x) is not int or x < 0 for x in rank.values()):
        raise _err(name, "header rank must map coordinates to non-negative "
                         "integers")
    cap = h["capacity"]
    if not isinstance(cap, dict) or set(cap) - set(TIERS) or any(
            x is not None and (type(x) is not int or x < 0) for x in cap.values()):
        raise _err(name, f"header capacity must map {list(TIERS)} to token counts "
                         f"or nil")
    fields, want = h["node_fields"], _FIELDS_OF[v]
    if not isinstance(fields, (list, tuple)) or tuple(fields) != want:
        got = list(fields) if isinstance(fields, (list, tuple)) else fields
        extra = [x for x in got if x not in want] if isinstance(got, list) else got
        missing = [x for x in want if not isinstance(got, list) or x not in got]
        what = (f"unknown node field(s) {extra}" if extra else
                f"missing node field(s) {missing}" if missing else "node fields out of order")
        raise _err(name, f"{what} for a version {v} snapshot")
    if "meta" in h and not isinstance(h["meta"], dict):
        raise _err(name, "header meta must be a map")
    problem = hints.clock_problem(h.get("hint_clock"))
    if problem:
        raise _err(name, problem)


def _check_nodes(c: NodeColumns, name: str) -> np.ndarray:
    """Structure the reader relies on: unique non-negative ids, known parents that come first,
    one root per namespace. Everything else (page alignment, residency, locks) is the
    invariant checker's business, so a broken tree still loads and can be diagnosed."""
    n = len(c)
    if n == 0:
        return np.empty(0, dtype=np.int64)
    if c.id.min() < 0:
        raise _err(name, f"negative node id {int(c.id.min())}")
    order = np.argsort(c.id, kind="stable")
    sid = c.id[order]
    dup = np.flatnonzero(sid[1:] == sid[:-1])
    if dup.size:
        raise _err(name, f"node id {int(sid[dup[0]])} appears twice")
    has_parent = c.parent >= 0
    pos = np.searchsorted(sid, c.parent[has_parent])
    pos = np.minimum(pos, n - 1)
    found = sid[pos] == c.parent[has_parent]
    if not found.all():
        i = np.flatnonzero(has_parent)[np.flatnonzero(~found)[0]]
        raise _err(name, f"node {int(c.id[i])} has unknown parent "
                         f"{int(c.parent[i])}")
    par_idx = order[pos]
    child_idx = np.flatnonzero(has_parent)
    late = par_idx >= child_idx
    if late.any():
        i = child_idx[np.flatnonzero(late)[0]]
        raise _err(name, f"node {int(c.id[i])} comes before its parent "
                         f"{int(c.parent[i])} (parents must come first)")
    roots_ns = c.ns_code[~has_parent]
    if len(np.unique(roots_ns)) != len(roots_ns):
        vals, counts = np.unique(roots_ns, return_counts=True)
        ns = c.namespaces[int(vals[np.argmax(counts > 1)])]
        raise _err(name, f"two roots for namespace {ns!r}")
    if np.any((c.l3 < 0)) or np.any(c.inflight < 0):
        raise _err(name, "node field 'l3'/'inflight' must be >= 0")
    parent_index = np.full(n, -1, dtype=np.int64)
    parent_index[child_idx] = par_idx
    return parent_index
