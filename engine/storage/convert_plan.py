"""Planning a store conversion (docs/storage.md, "convert-layout"): :func:`plan` reads every
source object's header (self-describing: region, scheme, grid or legacy shape, payload order,
model tag), refuses a source mixing layouts or models (unless ``from_`` / ``model_tag`` picks
one), works out which target objects every page can produce (a target object needs every byte
of its rectangle in sound source objects), and checks the destination: objects it already holds
under a target key must carry exactly the header we would write (else it holds *conflicting*
objects and nothing is written), and it must have room for the rest. Untrusted headers are
bounded here (:data:`MAX_MODEL_LAYERS`, :data:`MAX_TILES`, …). :mod:`engine.storage.convert`
runs the plan.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from engine.core.errors import InputError, StorageError, UsageError
from engine.core.layout import KVLayout
from engine.storage.endpoints import MAX_OBJECT_BYTES, Endpoint, FileEndpoint, nested_stores
from engine.storage.keys import object_key
from engine.storage.placement import (
    Grid,
    KVOrder,
    MalformedDescription,
    Placement,
    StorageLayout,
    Tile,
    describe_object,
    span,
)
from formats.kvobject import (
    MAX_LAYOUT_BYTES,
    KVObjectCodec,
    KVObjectError,
    header_len_for,
    parse_header,
)

HEAD_BYTES = header_len_for(MAX_LAYOUT_BYTES)
WORKERS = max(1, min(4, os.cpu_count() or 1))
"""Worker threads of a file-to-file conversion (and of reading a file store's headers): one per
CPU, at most 4. Opening, creating, reading, writing and linking files run without the GIL, so
pages overlap each other's file-system work; more threads than CPUs only add GIL handoffs
(measured on 2 CPUs: 4 threads took 25-60% more CPU time than 0-2 for the same wall time)."""
MAX_MODEL_LAYERS = 1024
MAX_MODEL_KV_HEADS = 1024
"""A source object claiming a model larger than this is corrupt: headers are untrusted, and
the model's size sets the work and memory of a plan (real models have at most a few hundred
layers and kv-heads)."""
MAX_TILES = 1 << 14
"""Target objects per page at most (``--to`` shapes beyond it are refused up front): a model of
128 layers x 128 kv-heads cut into single cells."""
MAX_LEGACY_RANKS = 1 << 10
"""Ranks (tp x pp) of a legacy shape at most."""


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
    ValueError when it is not one this tool knows or does not describe itself faithfully
    (:class:`MalformedDescription` when it claims to be ours but cannot be)."""
    region, placement, tag = describe_object(description)
    model = region.whole()
    if model.num_layers > MAX_MODEL_LAYERS or model.kv_heads > MAX_MODEL_KV_HEADS:
        raise MalformedDescription(
            f"the object claims a model of {model.num_layers} layers x {model.kv_heads} "
            f"kv-heads (at most {MAX_MODEL_LAYERS} x {MAX_MODEL_KV_HEADS})")
    if region.page_bytes > MAX_OBJECT_BYTES:
        raise MalformedDescription(f"the object claims a payload of {region.page_bytes:,} "
                                   f"bytes (at most {MAX_OBJECT_BYTES:,})")
    if placement.scheme is StorageLayout.LEGACY:
        try:
            check_target(placement, model, "the object's legacy shape")
        except UsageError as e:
            raise MalformedDescription(str(e)) from None
    (l0, l1), (h0, h1) = span(region)
    tile = placement.tile_at(region, placement.namespace(region, tag), (l0, l1), (h0, h1), tag)
    if tile.description != description:
        raise ValueError("the description does not round-trip")
    return region, placement, tag, tile.suffix, _group_label(region, placement, tag)


def _heads(src: Endpoint, keys: list[str], chunk: int = 256):
    """``(key, (its first HEAD_BYTES, its size) or None)`` for every key, in order; a file
    store's are read by worker threads (opening and reading files runs without the GIL), a few
    chunks ahead."""
    if not isinstance(src, FileEndpoint) or len(keys) <= chunk:
        yield from ((k, src.read_head(k, HEAD_BYTES)) for k in keys)
        return

    def read(ks: list[str]) -> list:
        return [src.read_head(k, HEAD_BYTES) for k in ks]

    with ThreadPoolExecutor(WORKERS, thread_name_prefix="hicache-scan") as ex:
        ahead: collections.deque = collections.deque()
        for start in range(0, len(keys), chunk):
            ks = keys[start:start + chunk]
            ahead.append((ks, ex.submit(read, ks)))
            if len(ahead) > 2 * WORKERS:
                done, f = ahead.popleft()
                yield from zip(done, f.result())
        while ahead:
            done, f = ahead.popleft()
            yield from zip(done, f.result())


def _scan(src: Endpoint, counts: dict[str, int]):
    """Headers of every source object: {layout group: [SourceObject]}."""
    groups: dict[tuple[str, str, str], list[SourceObject]] = {}
    placements: dict[tuple[str, str, str], tuple[KVLayout, str]] = {}
    known: dict[bytes, tuple] = {}     # layout description -> what it says (parsed once)
    layouts: dict[bytes, dict] = {}
    for key, got in _heads(src, src.list_keys()):
        if got is None:             # vanished or too large since the listing
            counts["corrupt"] += 1
            continue
        head, size = got
        try:
            h = parse_header(head, layouts=layouts)
            if h.layout_json not in known:
                known[h.layout_json] = _interpret(h.layout)
        except (KVObjectError, MalformedDescription):
            counts["corrupt"] += 1
            continue
        except ValueError:
            counts["foreign"] += 1      # sound, but not a layout this tool knows
            continue
        region, placement, tag, suffix, g = known[h.layout_json]
        if object_key(h.page_hash, suffix) != key or h.payload_len != region.page_bytes \
                or h.header_len + h.payload_len != size:
            counts["corrupt"] += 1      # filed under a key not its own, or the wrong size
            continue
        groups.setdefault(g, []).append(SourceObject(key, h.page_hash, region,
                                                     placement.kv_order,
                                                     h.header_len + h.payload_len))
        if g not in placements:
            placements[g] = (region.whole(), tag)
    return groups, placements


def plan(src: Endpoint, dst: Endpoint, to: str = "unified", from_: str | None = None,
         max_bytes: int | None = None, model_tag: str | None = None) -> Plan:
    """Read the source's headers and decide everything; raises InputError / StorageError /
    ValueError (bad shape strings) before anything is written. ``from_`` / ``model_tag``: only
    the source objects of this layout / of this model (the tag every header carries: the
    model's name and fingerprint)."""
    target = Placement.parse_target(to)
    chosen = Placement.parse_target(from_) if from_ else None
    if src.same_as(dst):
        raise InputError("source and destination are the same store")
    if isinstance(src, FileEndpoint) and isinstance(dst, FileEndpoint):
        nested = nested_stores(src.root, dst.root)
        if nested:
            raise InputError(f"{nested}; nothing was written")
    counts = dict.fromkeys(("objects_in", "bytes_in", "objects_out", "bytes_out", "present",
                            "corrupt", "foreign", "other_layout", "incomplete_pages"), 0)
    groups, models = _scan(src, counts)
    if chosen is not None:
        keep = {g for g in groups if g[2] == chosen.label(models[g][0])}
        counts["other_layout"] = sum(len(groups[g]) for g in groups if g not in keep)
        groups = {g: groups[g] for g in keep}
    if model_tag is not None:
        tags = sorted({g[1] for g in groups})
        keep = {g for g in groups if g[1] == model_tag}
        if not keep and tags:
            raise InputError(f"the source holds no objects of model tag {model_tag!r}; its "
                             f"model tags: {', '.join(map(repr, tags))}")
        counts["other_layout"] += sum(len(groups[g]) for g in groups if g not in keep)
        groups = {g: groups[g] for g in keep}
    if not groups:
        raise InputError("the source holds no convertible objects" +
                         (f" of layout {from_}" if from_ else "") +
                         f" ({counts['corrupt']} corrupt, {counts['foreign']} foreign, "
                         f"{counts['other_layout']} of other layouts)")
    if len(groups) > 1:
        desc = "; ".join(f"{g[2]} (model tag {g[1]!r}): {len(v)} objects"
                         for g, v in groups.items())
        how = [f"--from {x}" for x in sorted({g[2] for g in groups})] \
            if len({g[2] for g in groups}) > 1 else []
        how += [f"--model-tag {x!r}" for x in sorted({g[1] for g in groups})] \
            if len({g[1] for g in groups}) > 1 else []
        raise InputError(f"the source mixes {len(groups)} layouts or models: {desc}. Convert "
                         f"one at a time: {' or '.join(how) or '--from LAYOUT'}")
    (g, objects), = groups.items()
    model, tag = models[g]
    check_target(target, model, f"--to {to}")
    tiles = target.all_tiles(model, tag)
    too_big = [t for t in tiles if t.payload_len > MAX_OBJECT_BYTES]
    if too_big:
        raise UsageError(f"--to {to}: a target object of this model would hold "
                         f"{too_big[0].payload_len:,} bytes (at most {MAX_OBJECT_BYTES:,}); "
                         "choose a finer grid")
    p = Plan(g[2], target.label(model), model, tag, tiles,
             [KVObjectCodec(t.description) for t in tiles], target.kv_order, {}, {}, set(),
             counts)
    for o in objects:
        p.pages.setdefault(o.page_hash, []).append(o)
    counts["objects_in"] = len(objects)
    _plan_outputs(p)
    _check_destination(p, dst, max_bytes)
    return p


def check_shape(target: Placement, what: str) -> None:
    """``UsageError`` for a target too large for any model (checked before the source is
    read): a legacy shape with more than :data:`MAX_LEGACY_RANKS` ranks."""
    if target.scheme is StorageLayout.LEGACY and \
            target.tp[1] * target.pp[1] > MAX_LEGACY_RANKS:
        raise UsageError(f"{what}: tp x pp = {target.tp[1] * target.pp[1]:,} ranks (at most "
                         f"{MAX_LEGACY_RANKS:,})")


def check_target(target: Placement, model: KVLayout, what: str) -> None:
    """``UsageError`` unless ``target`` can lay out ``model``: a legacy shape must split the
    model's kv-heads over its TP ranks (``heads / tp`` each, or one head for ``tp / heads``
    ranks) and its layers over its PP stages (at most one stage per layer); at most
    :data:`MAX_TILES` objects per page. Cheap: nothing is enumerated before it passes."""
    check_shape(target, what)
    L, H = model.model_layers, model.model_kv_heads
    if target.scheme is StorageLayout.LEGACY:
        tp, pp = target.tp[1], target.pp[1]
        if pp > L:
            raise UsageError(f"{what}: pp={pp} is more pipeline stages than the model's {L} "
                             "layers")
        if model.kv_kinds == 2 and H % tp and tp % H:
            raise UsageError(f"{what}: the model's {H} kv-heads cannot be split over tp={tp} "
                             f"ranks (tp must divide {H} or be a multiple of it)")
        return
    try:
        g = Grid.parse(target.grid, model)
    except ValueError as e:
        raise UsageError(f"{what}: {e}") from None
    n = -(-L // g.layers) * (1 if model.kv_kinds == 1 else -(-H // g.heads))
    if n > MAX_TILES:
        raise UsageError(f"{what}: {n:,} objects per page (at most {MAX_TILES:,}); choose a "
                         "coarser grid")


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
