"""Moving bytes for ``convert-layout`` (:mod:`engine.storage.convert`): reused buffers, a source
object read and checked whole, the cuts of target rectangles, and comparing what a destination
holds with what a conversion produces.

Where the time of a conversion goes (docs/storage.md, "convert-layout", throughput): creating
files, and the kernel's page-cache work for every byte written. Here, that shapes three things:

* **No fresh memory per object.** A worker thread reads sources into, and cuts targets into,
  buffers it keeps (:class:`Buffers`); fresh pages for every object cost more than the copy.
* **Source bytes are not copied**: a file store's source object is mapped (the page cache
  itself) and checked there (header and payload checksum); every cut, checksum and comparison
  works on those bytes. Between file stores, target payloads
  that are whole byte runs of source files are copied by the kernel from the same (immutable,
  content-addressed) files; their checksums are computed from the checked bytes.
* **Rows, not bytes.** Cuts move ``head_dim × itemsize`` byte rows as one numpy element each.
"""

from __future__ import annotations

import dataclasses
import mmap
import os

import numpy as np

from engine.core.layout import KVLayout
from engine.storage.endpoints import Endpoint, FileEndpoint
from engine.storage.placement import KVOrder, Tile, span
from formats.kvobject import KVObjectError, parse_header, verify_payload


class Buffers:
    """Reusable byte buffers by size, for one thread: ``take`` during a page, ``release`` after
    (when every write and comparison that uses them is done)."""

    def __init__(self) -> None:
        self._free: dict[int, list[np.ndarray]] = {}
        self._used: list[np.ndarray] = []

    def take(self, nbytes: int) -> np.ndarray:
        free = self._free.get(nbytes)
        buf = free.pop() if free else np.empty(nbytes, dtype=np.uint8)
        self._used.append(buf)
        return buf

    def release(self) -> None:
        for buf in self._used:
            self._free.setdefault(buf.nbytes, []).append(buf)
        self._used = []


def fresh(nbytes: int) -> np.ndarray:
    return np.empty(nbytes, dtype=np.uint8)


@dataclasses.dataclass
class Source:
    """A checked source object: its payload (bytes in memory), the rectangle as a
    ``[layers, kv_kinds, page_size, heads]`` array of rows, and the open file when kept."""

    obj: object                 # the plan's SourceObject
    payload: memoryview
    rows: np.ndarray
    checksum: int
    fd: int | None
    header_len: int


_ROW_DTYPES: dict[int, np.dtype] = {}


def row_dtype(layout: KVLayout) -> np.dtype:
    n = layout.head_dim * layout.itemsize
    dt = _ROW_DTYPES.get(n)
    if dt is None:
        dt = _ROW_DTYPES[n] = np.dtype((np.void, n))
    return dt


def rows_of(payload, region: KVLayout, order: KVOrder) -> np.ndarray:
    """``[layers, kv_kinds, page_size, heads]`` rows of a payload (a view)."""
    L, K, P, H = region.num_layers, region.kv_kinds, region.page_size, region.kv_heads
    a = np.frombuffer(payload, dtype=row_dtype(region))
    if order is KVOrder.LAYER_FIRST:
        return a.reshape(L, K, P, H)
    return a.reshape(P, L, K, H).transpose(1, 2, 0, 3)


def read_source(src: Endpoint, o, keep_fd: bool) -> tuple[Source | None, int, int | None]:
    """Read ``o`` whole and check it: (the source or None when missing or corrupt, bytes read,
    the open file descriptor, kept open when ``keep_fd`` — the caller closes it).

    A file store's object is mapped, not copied (:func:`map_source`); another store's is read."""
    if not isinstance(src, FileEndpoint):
        raw = src.read(o.key)
        return (_check(memoryview(raw), o, None) if raw is not None else None), \
            len(raw or b""), None
    fd = src.open_fd(o.key)
    if fd is None:
        return None, 0, None
    m = map_source(fd, o.size)
    if not keep_fd:
        os.close(fd)
        fd = None
    if m is None:                          # changed size since the scan, or unreadable
        return None, 0, fd
    return _check(memoryview(m), o, fd), o.size, fd


_MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)


def map_source(fd: int, size: int) -> mmap.mmap | None:
    """The file's ``size`` bytes mapped read-only (the page cache itself: no copy into user
    memory), or None when the file is not exactly ``size`` bytes long or cannot be mapped.

    Source objects are at rest: a store never rewrites or truncates an object file in place
    (it links or renames whole new files into place), so the file keeps the size checked here
    while it is mapped
    (reading past a truncated file's end would be a SIGBUS, not an error). The mapping is
    released when the last view of it goes (a page's sources, cuts and comparisons)."""
    try:
        if os.fstat(fd).st_size != size or size == 0:
            return None
        return mmap.mmap(fd, size, _MAP_FLAGS, mmap.PROT_READ)
    except (OSError, ValueError):
        return None


_LAYOUTS: dict[bytes, dict] = {}      # layout JSON seen in sources, parsed once (shared)


def _check(raw: memoryview, o, fd: int | None) -> Source | None:
    try:
        h = parse_header(raw, layouts=_LAYOUTS)
        payload = raw[h.header_len:]
        verify_payload(h, payload)
    except KVObjectError:
        return None
    if h.payload_len != o.region.page_bytes or h.page_hash != o.page_hash:
        return None
    return Source(o, payload, rows_of(payload, o.region, o.order), h.payload_checksum, fd,
                  h.header_len)


def byte_runs(tile: Tile, srcs: list[Source], order: KVOrder) -> list[tuple[Source, int, int]] | None:
    """The tile's payload as ``(source, offset in its payload, length)`` runs, when it is
    that in the target's byte order ``order``: ``layer_first`` on both sides, and each piece
    from a source with exactly the tile's kv-heads (cuts and joins along the layer axis); or a
    source holding exactly the tile's rectangle in the target's order (its whole payload).

    Nothing else is a byte run: a ``page_first`` payload is token-major, so a part of one (or
    of a ``layer_first`` one) is never a run of the other order's bytes."""
    (tl0, tl1), heads = tile.layers, tile.heads
    if order is not KVOrder.LAYER_FIRST:
        for s in srcs:
            if s.obj.order is order and span(s.obj.region) == (tile.layers, heads):
                return [(s, 0, len(s.payload))]
        return None
    out, at = [], tl0
    while at < tl1:
        for s in srcs:
            o = s.obj
            (l0, l1), hs = span(o.region)
            if o.order is KVOrder.LAYER_FIRST and hs == heads and l0 <= at < l1:
                end = min(l1, tl1)
                per_layer = o.region.page_bytes // o.region.num_layers
                out.append((s, (at - l0) * per_layer, (end - at) * per_layer))
                at = end
                break
        else:
            return None
    return out


@dataclasses.dataclass(frozen=True)
class Recipe:
    """How one target object is made from a page's sound sources, named by their position in
    the page's list: worked out once per (source rectangles, target grid), applied per page.

    ``runs``: ``(position, offset, length)`` byte runs of source payloads, copied by the kernel
    (``whole``: one run that is a source's whole payload, whose checksum is reused). Else
    ``view``: ``(position, row slices)`` of one source that already holds the payload in the
    target's byte order. Else ``copies``: ``(position, source row slices, target row slices)``
    assembled into a buffer."""

    index: int                     # the tile's index in the plan
    runs: tuple = ()
    whole: bool = False
    view: tuple | None = None
    copies: tuple = ()


def recipes(tiles: list[Tile], wanted: list[int], srcs: list[Source], order: KVOrder,
            ranges: bool) -> list[Recipe | None]:
    """A recipe per wanted tile, None for a tile the sources do not cover whole."""
    model = tiles[0].layout.whole()
    mask = np.zeros((model.num_layers, model.kv_heads), dtype=bool)
    for s in srcs:
        (l0, l1), (h0, h1) = span(s.obj.region)
        mask[l0:l1, h0:h1] = True
    pos = {id(s): i for i, s in enumerate(srcs)}
    out: list[Recipe | None] = []
    for i in wanted:
        t = tiles[i]
        if not mask[t.layers[0]:t.layers[1], t.heads[0]:t.heads[1]].all():
            out.append(None)
            continue
        runs = byte_runs(t, srcs, order) if ranges else None
        if runs:
            whole = len(runs) == 1 and runs[0][2] == len(runs[0][0].payload)
            out.append(Recipe(i, tuple((pos[id(s)], a, n) for s, a, n in runs), whole))
            continue
        out.append(_cut_recipe(i, t, srcs, order))
    return out


def _cut_recipe(i: int, tile: Tile, srcs: list[Source], order: KVOrder) -> Recipe:
    (tl0, tl1), (th0, th1) = tile.layers, tile.heads
    for p, s in enumerate(srcs):
        (l0, l1), (h0, h1) = span(s.obj.region)
        if l0 <= tl0 and tl1 <= l1 and h0 <= th0 and th1 <= h1:
            sl = (slice(tl0 - l0, tl1 - l0), slice(None), slice(None), slice(th0 - h0, th1 - h0))
            v = s.rows[sl]
            phys = v if order is KVOrder.LAYER_FIRST else v.transpose(2, 0, 1, 3)
            if phys.flags.c_contiguous:
                return Recipe(i, view=(p, sl))
            break
    copies = []
    for p, s in enumerate(srcs):
        (l0, l1), (h0, h1) = span(s.obj.region)
        a0, a1, b0, b1 = max(l0, tl0), min(l1, tl1), max(h0, th0), min(h1, th1)
        if a0 < a1 and b0 < b1:
            copies.append((p, (slice(a0 - l0, a1 - l0), slice(None), slice(None),
                               slice(b0 - h0, b1 - h0)),
                           (slice(a0 - tl0, a1 - tl0), slice(None), slice(None),
                            slice(b0 - th0, b1 - th0))))
    return Recipe(i, copies=tuple(copies))


def apply_cut(r: Recipe, tile: Tile, srcs: list[Source], order: KVOrder, take,
              room: int = 0) -> np.ndarray:
    """The payload (flat bytes) of a ``view`` or ``copies`` recipe: a view of one source, or
    assembled into a buffer from ``take`` after ``room`` free bytes (for a header in front:
    ``out.base[:room]``, so header and payload go out as one contiguous write)."""
    if r.view is not None:
        p, sl = r.view
        v = srcs[p].rows[sl]
        phys = v if order is KVOrder.LAYER_FIRST else v.transpose(2, 0, 1, 3)
        return phys.reshape(-1).view(np.uint8)
    buf = take(room + tile.payload_len)
    out = buf[room:] if room else buf
    dest = rows_of(out, tile.layout, order)
    for p, ssl, dsl in r.copies:
        dest[dsl] = srcs[p].rows[ssl]
    return out


class Assembly:
    """Where a page's assembled target objects (``copies`` recipes) are built, one thread's, kept
    across pages with the same recipes: header then payload, contiguous per object, all in one
    buffer; the row views each copy writes into are worked out once, here.

    ``slots[recipe index]``: (the whole object, its header, its payload as flat bytes, the
    copies as ``(source position, source row slices, target rows view)``)."""

    def __init__(self, recipes: list, tiles: list[Tile], header_lens: list[int], order: KVOrder):
        todo = [r for r in recipes if r is not None and not r.runs and r.view is None]
        sizes = [header_lens[r.index] + tiles[r.index].payload_len for r in todo]
        self.buf = np.empty(sum(sizes), dtype=np.uint8)
        self.slots: dict[int, tuple] = {}
        at = 0
        for r, size in zip(todo, sizes):
            whole = self.buf[at:at + size]
            hl, tile = header_lens[r.index], tiles[r.index]
            dest = rows_of(whole[hl:], tile.layout, order)
            self.slots[r.index] = (memoryview(whole), memoryview(whole)[:hl], whole[hl:],
                                   tuple((p, ssl, dest[dsl]) for p, ssl, dsl in r.copies))
            at += size

    @staticmethod
    def fill(copies: tuple, srcs: list[Source]) -> None:
        for p, ssl, dest in copies:
            dest[...] = srcs[p].rows[ssl]


def cut(tile: Tile, srcs: list[Source], order: KVOrder, take) -> np.ndarray:
    """The tile's payload (flat bytes): a view of one source when that one holds it in the
    target's byte order already, else assembled into a buffer from ``take``."""
    return apply_cut(_cut_recipe(0, tile, srcs, order), tile, srcs, order, take)


def holds(got: bytes | None, header: bytes, pieces: list) -> bool:
    """Whether ``got`` (an object read back) is ``header`` followed by the ``pieces``."""
    size = len(header) + sum(len(p) for p in pieces)
    if got is None or len(got) != size or got[:len(header)] != header:
        return False
    at = len(header)
    for p in pieces:
        n = len(p)
        if not np.array_equal(np.frombuffer(got, np.uint8, n, at), np.frombuffer(p, np.uint8)):
            return False
        at += n
    return True


# -- what --verify checks: the meaning of the bytes ------------------------------------------
_BITS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def kv_elements(payload, region: KVLayout, order: KVOrder) -> np.ndarray:
    """The payload's KV as ``[layers, kv_kinds, page_size, heads, head_dim]`` elements (their
    bits, as unsigned integers of the dtype's size: exact, NaN-safe), decoded from ``order``
    alone: ``layer_first`` is ``[L, K, P, H, D]``, ``page_first`` is ``[P, L, K, H, D]``."""
    L, K, P, H, D = (region.num_layers, region.kv_kinds, region.page_size, region.kv_heads,
                     region.head_dim)
    a = np.frombuffer(payload, dtype=_BITS[region.itemsize])
    if order is KVOrder.LAYER_FIRST:
        return a.reshape(L, K, P, H, D)
    return a.reshape(P, L, K, H, D).transpose(1, 2, 0, 3, 4)


def meaning_problem(raw: bytes | None, description: dict, page_hash: bytes,
                    srcs: list[Source]) -> str | None:
    """Why the object ``raw`` (read back from a destination) does not hold the sources' KV for
    its rectangle, or None when it does: it must be sound (header and payload checksums), carry
    ``description`` and ``page_hash``, and — decoded through its own header's layout and byte
    order — every element ``(layer, kv, token, head, dim)`` must equal the one the source that
    covers it holds (decoded through the source's own layout)."""
    from engine.storage.placement import describe_object

    if raw is None:
        return "missing after the write"
    try:
        h = parse_header(raw)
        payload = memoryview(raw)[h.header_len:]
        verify_payload(h, payload)
    except KVObjectError as e:
        return str(e)
    if h.page_hash != page_hash:
        return f"holds page {h.page_hash.hex()[:16]}…"
    if h.layout != description:
        return "its header describes another layout than the target's"
    try:
        region, placement, _ = describe_object(h.layout)
    except (ValueError, TypeError) as e:
        return f"its header does not describe a layout ({e})"
    if h.payload_len != region.page_bytes:
        return f"payload of {h.payload_len} bytes for a layout of {region.page_bytes}"
    got = kv_elements(payload, region, placement.kv_order)
    (tl0, tl1), (th0, th1) = span(region)
    seen = np.zeros((tl1 - tl0, th1 - th0), dtype=bool)
    for s in srcs:
        (l0, l1), (h0, h1) = span(s.obj.region)
        a0, a1, b0, b1 = max(l0, tl0), min(l1, tl1), max(h0, th0), min(h1, th1)
        if not (a0 < a1 and b0 < b1):
            continue
        want = kv_elements(s.payload, s.obj.region, s.obj.order)[
            a0 - l0:a1 - l0, :, :, b0 - h0:b1 - h0]
        mine = got[a0 - tl0:a1 - tl0, :, :, b0 - th0:b1 - th0]
        if not np.array_equal(mine, want):
            la, k, t, hd, d = (int(x) for x in np.argwhere(mine != want)[0])
            return (f"element (layer {a0 + la}, {'KV'[k] if region.kv_kinds == 2 else 'latent'}"
                    f", token {t} of the page, head {b0 + hd}, dim {d}) is not the source's")
        seen[a0 - tl0:a1 - tl0, b0 - th0:b1 - th0] = True
    if not seen.all():
        return "part of its rectangle is in no sound source object"
    return None
