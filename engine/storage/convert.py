"""Convert a store at rest between layouts: legacy per-rank → unified, one unified grid to
another, ``layer_first`` ↔ ``page_first`` payloads (docs/storage.md, "convert-layout").

Two steps, both pure with respect to the source (it is only read):

* :func:`plan` reads every source object's header (self-describing: region, scheme, grid or
  legacy shape, payload order, model tag), refuses a source mixing layouts (unless ``from_``
  picks one), works out which target objects every page can produce (a target object needs
  every byte of its rectangle in sound source objects), and checks the destination: objects it
  already holds under a target key must carry exactly the header we would write (else it holds
  *conflicting* objects and nothing is written), and it must have room for the rest.
* :func:`run` converts page by page: reads and verifies the page's source objects (a corrupt one
  is skipped and counted, never copied), cuts the target rectangles (a view of one source
  payload when one holds the whole rectangle, else assembled), writes them in batches of about
  8 MiB (the file store publishes each object with an atomic rename), and with ``verify`` reads
  every written object back and compares it byte for byte. Objects already in the destination
  are read back and compared instead of rewritten, so a run is resumable. A ``KeyboardInterrupt``
  stops between batches' objects: every object already written is whole, the result says
  ``interrupted``, and a second run carries on.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import time
from typing import Callable

import numpy as np

from engine.core.errors import InputError, StorageError
from engine.core.layout import KVLayout
from engine.storage.backend import FileRange
from engine.storage.endpoints import Endpoint, FileEndpoint
from engine.storage.keys import object_key
from engine.storage.placement import KVOrder, Placement, Tile, describe_object, span
from formats.kvobject import (
    MAX_LAYOUT_BYTES,
    KVObjectCodec,
    KVObjectError,
    header_len_for,
    parse_header,
    verify_payload,
)

HEAD_BYTES = header_len_for(MAX_LAYOUT_BYTES)
BATCH_BYTES = 8 << 20


@dataclasses.dataclass(frozen=True)
class SourceObject:
    key: str
    page_hash: bytes
    region: KVLayout
    order: KVOrder
    size: int


@dataclasses.dataclass
class Plan:
    source: str                    # layout label of the source, e.g. legacy:tp=2,pp=1
    target: str
    model: KVLayout                # the whole model
    tag: str
    tiles: list[Tile]              # the target objects of one page
    codecs: list[KVObjectCodec]
    target_order: KVOrder
    pages: dict[bytes, list[SourceObject]]
    out: dict[bytes, list[int]]    # page -> indexes of the target tiles it can produce
    present: set[str]              # target keys the destination already holds
    counts: dict[str, int]

    def summary(self) -> dict:
        return {"source_layout": self.source, "target_layout": self.target,
                "model_tag": self.tag, "pages": len(self.pages), **self.counts}


def _group_label(region: KVLayout, placement: Placement, tag: str) -> tuple[str, str, str]:
    model = json.dumps(region.whole().to_dict(), sort_keys=True)
    return model, tag, placement.label(region)


def _interpret(description: dict) -> tuple:
    """(region, placement, tag, key suffix, layout group) of a header's description;
    ValueError when it is not one this tool knows or does not describe itself faithfully."""
    region, placement, tag = describe_object(description)
    (l0, l1), (h0, h1) = span(region)
    tile = placement.tile_at(region, placement.namespace(region, tag), (l0, l1), (h0, h1), tag)
    if tile.description != description:
        raise ValueError("the description does not round-trip")
    return region, placement, tag, tile.suffix, _group_label(region, placement, tag)


def _scan(src: Endpoint, counts: dict[str, int]):
    """Headers of every source object: {layout group: [SourceObject]}."""
    groups: dict[tuple[str, str, str], list[SourceObject]] = {}
    placements: dict[tuple[str, str, str], tuple[KVLayout, str]] = {}
    known: dict[bytes, tuple] = {}     # layout description -> what it says (parsed once)
    for key in src.list_keys():
        head = src.read(key, HEAD_BYTES)
        if head is None:            # vanished or too large since the listing
            counts["corrupt"] += 1
            continue
        try:
            h = parse_header(head)
            if h.layout_json not in known:
                known[h.layout_json] = _interpret(h.layout)
        except KVObjectError:
            counts["corrupt"] += 1
            continue
        except ValueError:
            counts["foreign"] += 1      # sound, but not a layout this tool knows
            continue
        region, placement, tag, suffix, g = known[h.layout_json]
        if object_key(h.page_hash, suffix) != key:
            counts["corrupt"] += 1      # filed under a key that is not its own
            continue
        groups.setdefault(g, []).append(SourceObject(key, h.page_hash, region,
                                                     placement.kv_order,
                                                     h.header_len + h.payload_len))
        placements[g] = (region.whole(), tag)
    return groups, placements


def plan(src: Endpoint, dst: Endpoint, to: str = "unified", from_: str | None = None,
         max_bytes: int | None = None) -> Plan:
    """Read the source's headers and decide everything; raises InputError / StorageError /
    ValueError (bad shape strings) before anything is written."""
    target = Placement.parse_target(to)
    chosen = Placement.parse_target(from_) if from_ else None
    if src.same_as(dst):
        raise InputError("source and destination are the same store")
    counts = dict.fromkeys(("objects_in", "bytes_in", "objects_out", "bytes_out", "present",
                            "corrupt", "foreign", "other_layout", "incomplete_pages"), 0)
    groups, models = _scan(src, counts)
    if chosen is not None:
        keep = {g for g in groups if g[2] == chosen.label(models[g][0])}
        counts["other_layout"] = sum(len(groups[g]) for g in groups if g not in keep)
        groups = {g: groups[g] for g in keep}
    if not groups:
        raise InputError("the source holds no convertible objects" +
                         (f" of layout {from_}" if from_ else "") +
                         f" ({counts['corrupt']} corrupt, {counts['foreign']} foreign, "
                         f"{counts['other_layout']} of other layouts)")
    if len(groups) > 1:
        desc = "; ".join(f"{g[2]} (tag {g[1]!r}): {len(v)} objects" for g, v in groups.items())
        raise InputError(f"the source mixes {len(groups)} layouts: {desc}. Convert one at a "
                         "time with --from LAYOUT")
    (g, objects), = groups.items()
    model, tag = models[g]
    tiles = target.all_tiles(model, tag)
    p = Plan(g[2], target.label(model), model, tag, tiles,
             [KVObjectCodec(t.description) for t in tiles], target.kv_order, {}, {}, set(),
             counts)
    for o in objects:
        p.pages.setdefault(o.page_hash, []).append(o)
    counts["objects_in"] = len(objects)
    _plan_outputs(p)
    _check_destination(p, dst, max_bytes)
    return p


def _covered(objs: list[SourceObject], model: KVLayout) -> np.ndarray:
    mask = np.zeros((model.num_layers, model.kv_heads), dtype=bool)
    for o in objs:
        (l0, l1), (h0, h1) = span(o.region)
        mask[l0:l1, h0:h1] = True
    return mask


def _plan_outputs(p: Plan) -> None:
    sizes = [c.object_size(t.payload_len) for t, c in zip(p.tiles, p.codecs)]
    for ph, objs in p.pages.items():
        p.counts["bytes_in"] += sum(o.size for o in objs)
        mask = _covered(objs, p.model)
        can = [i for i, t in enumerate(p.tiles)
               if mask[t.layers[0]:t.layers[1], t.heads[0]:t.heads[1]].all()]
        if len(can) < len(p.tiles):
            p.counts["incomplete_pages"] += 1
        p.out[ph] = can
        p.counts["objects_out"] += len(can)
        p.counts["bytes_out"] += sum(sizes[i] for i in can)


def _check_destination(p: Plan, dst: Endpoint, max_bytes: int | None) -> None:
    keys = [(object_key(ph, p.tiles[i].suffix), ph, i) for ph, idx in p.out.items()
            for i in idx]
    conflicts: list[str] = []
    need = 0
    listed = set(dst.list_keys()) if isinstance(dst, FileEndpoint) else None  # one scan
    for s in range(0, len(keys), 512):
        chunk = keys[s:s + 512]
        found = [c[0] in listed for c in chunk] if listed is not None else \
            dst.exists([c[0] for c in chunk])
        for (k, ph, i), there in zip(chunk, found):
            if not there:
                need += p.codecs[i].object_size(p.tiles[i].payload_len)
                continue
            head = dst.read(k, HEAD_BYTES)
            try:
                h = parse_header(head or b"")
                ok = h.layout_json == p.codecs[i].layout_json and h.page_hash == ph
            except KVObjectError:
                ok = False
            if ok:
                p.present.add(k)
            else:
                conflicts.append(k)
    p.counts["present"] = len(p.present)
    if conflicts:
        raise InputError(f"the destination holds {len(conflicts)} conflicting object(s) under "
                         f"target keys (e.g. {conflicts[0]}); nothing was written. Remove them "
                         "or choose another destination")
    room = dst.free_bytes()
    if max_bytes is not None:
        room = max_bytes if room is None else min(room, max_bytes)
    if room is not None and need > room:
        raise StorageError(f"the destination has room for {room:,} bytes but the conversion "
                           f"writes {need:,}; nothing was written")


# -- running -----------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _itemsize(dtype: str) -> int:
    return KVLayout(1, 1, 1, 1, dtype=dtype).itemsize


def _tensor(payload: memoryview, region: KVLayout, order: KVOrder) -> np.ndarray:
    """``[layers, kv_kinds, page_size, heads, head_dim bytes]`` uint8 view of a payload."""
    L, K, P, H = region.num_layers, region.kv_kinds, region.page_size, region.kv_heads
    row = region.head_dim * _itemsize(region.dtype)
    a = np.frombuffer(payload, dtype=np.uint8)
    if order is KVOrder.LAYER_FIRST:
        return a.reshape(L, K, P, H, row)
    return a.reshape(P, L, K, H, row).transpose(1, 2, 0, 3, 4)


def _cut(tile: Tile, srcs: list[tuple[SourceObject, np.ndarray]], model: KVLayout,
         order: KVOrder) -> np.ndarray:
    """The payload of ``tile``: a view of one source when one holds it, else assembled."""
    (tl0, tl1), (th0, th1) = tile.layers, tile.heads
    for o, arr in srcs:
        (l0, l1), (h0, h1) = span(o.region)
        if l0 <= tl0 and tl1 <= l1 and h0 <= th0 and th1 <= h1:
            part = arr[tl0 - l0:tl1 - l0, :, :, th0 - h0:th1 - h0]
            break
    else:
        lay = tile.layout
        part = np.empty((lay.num_layers, lay.kv_kinds, lay.page_size, lay.kv_heads,
                         lay.head_dim * lay.itemsize), dtype=np.uint8)
        for o, arr in srcs:
            (l0, l1), (h0, h1) = span(o.region)
            a0, a1, b0, b1 = max(l0, tl0), min(l1, tl1), max(h0, th0), min(h1, th1)
            if a0 < a1 and b0 < b1:
                part[a0 - tl0:a1 - tl0, :, :, b0 - th0:b1 - th0] = \
                    arr[a0 - l0:a1 - l0, :, :, b0 - h0:b1 - h0]
    if order is KVOrder.PAGE_FIRST:
        part = part.transpose(2, 0, 1, 3, 4)
    return np.ascontiguousarray(part).reshape(-1)


@dataclasses.dataclass
class Result:
    counts: dict[str, int]
    seconds: float = 0.0
    interrupted: bool = False


def run(p: Plan, src: Endpoint, dst: Endpoint, *, verify: bool = False,
        progress: Callable[[int], None] | None = None) -> Result:
    """Convert; the counters say what happened (``written``, ``skipped_present``, ``corrupt``,
    ``verified``, ``bytes_written``). Raises StorageError when the destination refuses a write
    (disk full, I/O error) — every object written before that is whole."""
    conv = _Converter(p, src, dst, verify)
    t0 = time.perf_counter()
    try:
        for ph, objs in p.pages.items():
            nbytes = conv.page(ph, objs)
            if conv.size >= BATCH_BYTES:
                conv.flush()
            if progress is not None:
                progress(nbytes)
        conv.flush()
    except KeyboardInterrupt:
        conv.res.interrupted = True
    finally:
        conv.release()
    conv.res.seconds = time.perf_counter() - t0
    return conv.res


class _Converter:
    """One run's state: the batch being gathered and the source files it still copies from."""

    def __init__(self, p: Plan, src: Endpoint, dst: Endpoint, verify: bool):
        self.p, self.src, self.dst, self.verify = p, src, dst, verify
        c = dict.fromkeys(("written", "bytes_written", "skipped_present", "verified",
                           "read_corrupt", "not_produced", "kernel_copied_bytes"), 0)
        self.res = Result({**p.counts, **c})
        # Between file stores, payload bytes that are whole runs of a source file are copied in
        # the kernel (copy_file_range) instead of written from user memory.
        self.ranges = isinstance(src, FileEndpoint) and isinstance(dst, FileEndpoint)
        self.batch: list[tuple[str, list, bytes, np.ndarray]] = []
        self.fds: list[int] = []
        self.size = 0

    def page(self, ph: bytes, objs: list[SourceObject]) -> int:
        """Cut one page's target objects into the batch; returns the source bytes read."""
        p, counts = self.p, self.res.counts
        srcs, nbytes = [], 0
        for o in objs:
            arr, n, fd = _read_source(self.src, o, self.ranges)
            nbytes += n
            if fd is not None:
                self.fds.append(fd)
            if arr is None:
                counts["read_corrupt"] += 1
            else:
                srcs.append((o, arr, fd, n - o.region.page_bytes))
        mask = _covered([s[0] for s in srcs], p.model)
        for i in p.out[ph]:
            t = p.tiles[i]
            if not mask[t.layers[0]:t.layers[1], t.heads[0]:t.heads[1]].all():
                counts["not_produced"] += 1
                continue
            payload = _cut(t, [(o, a) for o, a, _, _ in srcs], p.model, p.target_order)
            header = p.codecs[i].encode_header(ph, payload)
            key = object_key(ph, t.suffix)
            if key in p.present:
                _same(self.dst, key, header, payload)
                counts["skipped_present"] += 1
                continue
            runs = _runs(t, srcs, p.target_order) if self.ranges else None
            if runs:
                counts["kernel_copied_bytes"] += payload.nbytes
            self.batch.append((key, [header, *(runs or [payload])], header, payload))
            self.size += len(header) + payload.nbytes
        return nbytes

    def flush(self) -> None:
        batch, counts = self.batch, self.res.counts
        self.batch, self.size = [], 0
        if batch:
            oks = self.dst.put([b[0] for b in batch], [b[1] for b in batch])
            for (_, _, h, pl), ok in zip(batch, oks):
                if ok:
                    counts["written"] += 1
                    counts["bytes_written"] += len(h) + pl.nbytes
            if not all(oks):
                failed = next(b[0] for b, ok in zip(batch, oks) if not ok)
                raise StorageError(
                    f"the destination refused {oks.count(False)} object(s) (e.g. {failed}): "
                    "disk full or an I/O error; every object written so far is whole: free "
                    "space and run again to resume")
            if self.verify:
                for k, _, h, pl in batch:
                    _same(self.dst, k, h, pl)
                    counts["verified"] += 1
        self.release()

    def release(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []


def _runs(tile: Tile, srcs: list, order: KVOrder) -> list[FileRange] | None:
    """The tile's payload as byte ranges of source files, when it is one: every source piece
    holds exactly the tile's kv-heads, both payloads are layer_first, the sources are files."""
    if order is not KVOrder.LAYER_FIRST:
        return None
    (tl0, tl1), heads = tile.layers, tile.heads
    out, at = [], tl0
    while at < tl1:
        for o, _, fd, hlen in srcs:
            (l0, l1), hs = span(o.region)
            if fd is not None and o.order is KVOrder.LAYER_FIRST and hs == heads and \
                    l0 <= at < l1:
                end = min(l1, tl1)
                per_layer = o.region.page_bytes // o.region.num_layers
                out.append(FileRange(fd, hlen + (at - l0) * per_layer, (end - at) * per_layer))
                at = end
                break
        else:
            return None
    return out


def _read_source(src: Endpoint, o: SourceObject,
                 keep_fd: bool) -> tuple[np.ndarray | None, int, int | None]:
    """(the verified payload as a tensor or None, bytes read, the open file when kept)."""
    fd = None
    if keep_fd and isinstance(src, FileEndpoint):
        # Mapped, not read: the checksum and the cuts read the page cache directly, and the
        # bytes copied in the kernel never pass through user memory.
        fd = src.open_fd(o.key)
        raw = src.map_fd(fd) if fd is not None else None
    else:
        raw = src.read(o.key)
    if raw is None:
        return None, 0, fd
    try:
        h = parse_header(raw)
        payload = memoryview(raw)[h.header_len:]
        verify_payload(h, payload)
        if h.payload_len != o.region.page_bytes or h.page_hash != o.page_hash:
            return None, len(raw), fd
    except KVObjectError:
        return None, len(raw), fd
    return _tensor(payload, o.region, o.order), len(raw), fd


def _same(dst: Endpoint, key: str, header: bytes, payload: np.ndarray) -> None:
    got = dst.read(key)
    if got is None or got[:len(header)] != header or \
            memoryview(got)[len(header):] != memoryview(payload).cast("B"):
        raise InputError(f"the destination's object {key} differs from what this conversion "
                         "produces (a conflicting or damaged object); remove it and run again")
