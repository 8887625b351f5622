"""SGLang's own L3 file store (its ``HiCacheFile`` backend, as of SGLang 0.5.23) at rest, for
``hicache convert-layout`` (docs/sglang-stores.md): what a directory holds (:func:`list_store`,
:func:`shapes`: the models and shapes its file names show) and a stated geometry
(:mod:`engine.storage.sglang_geometry`) checked against it (:func:`check`): file names and their
rank suffixes, object sizes, which ranks hold each page. The bytes carry no header — the host
layout, dtype, page size and head count are written nowhere — so a mismatch is refused naming
the field that explains it, and what cannot be seen is the user's word.
"""
from __future__ import annotations

import collections
import dataclasses
import os
import re

from engine.core.errors import InputError, UsageError
from engine.storage.sglang_geometry import (
    DTYPES,
    Geometry,
    Rank,
    check_unified,
)

MAX_FILES = 10_000_000
"""Page files listed at most (the listing keeps about 250 bytes per file: 2.5 GB at most)."""

_FILE = re.compile(r"^([0-9a-f]{64})(_.*)\.bin$")


# -- what a directory holds ------------------------------------------------------------------
@dataclasses.dataclass
class Listing:
    """Page files of a directory, by suffix: ``{suffix: {page hash: size}}``, plus what is not
    a page file."""

    root: str
    by_suffix: dict[str, dict[str, int]]
    other_files: int = 0
    not_regular: int = 0             # links, FIFOs, directories named like page files


def list_store(root: str) -> Listing:
    """Every ``{hash}{suffix}.bin`` regular file of ``root`` (symbolic links and temporary
    files are never read; InputError when ``root`` is not a readable directory)."""
    if not os.path.isdir(root):
        what = "does not exist" if not os.path.exists(root) else "is not a directory"
        raise InputError(f"SGLang store {root} {what}")
    out = Listing(root, collections.defaultdict(dict))
    n = 0
    try:
        with os.scandir(root) as it:
            for e in it:
                m = _FILE.match(e.name)
                if m is None:
                    if not e.name.startswith("."):
                        out.other_files += 1
                    continue
                if not e.is_file(follow_symlinks=False):
                    out.not_regular += 1
                    continue
                n += 1
                if n > MAX_FILES:
                    raise InputError(f"SGLang store {root} holds more than {MAX_FILES:,} page "
                                     "files")
                try:
                    size = e.stat(follow_symlinks=False).st_size
                except OSError:
                    continue
                out.by_suffix[m.group(2)][m.group(1)] = size
    except PermissionError:
        raise InputError(f"SGLang store {root} cannot be read (permission denied)") from None
    out.by_suffix = dict(out.by_suffix)
    return out


_TAIL2 = re.compile(r"^_(.*)_(\d+)_(\d+)$")
_TAIL4 = re.compile(r"^_(.*)_(\d+)_(\d+)_(\d+)_(\d+)$")


_UNIFIED = re.compile(r"^_(ukv\d+-[0-9a-f]{16})_L(\d+)-(\d+)(?:_H(\d+))?$")


def read_suffix(suffix: str) -> dict:
    """What a file-name suffix says on its own (no geometry): model, tp rank/size, pp size/rank,
    or MLA; or a unified-scheme namespace digest. A model name ending in ``_<digits>`` makes
    this a guess; :func:`check` decides."""
    m = _UNIFIED.match(suffix)
    if m:
        return {"model": None, "namespace": m.group(1), "tp": None, "pp": 1, "pp_rank": 0,
                "tp_rank": None, "mla": m.group(4) is None, "scheme": "unified"}
    m = _TAIL4.match(suffix)
    if m and int(m.group(2)) < int(m.group(3)) and int(m.group(5)) < int(m.group(4)):
        return {"model": m.group(1), "tp_rank": int(m.group(2)), "tp": int(m.group(3)),
                "pp": int(m.group(4)), "pp_rank": int(m.group(5)), "mla": False}
    m = _TAIL2.match(suffix)
    if m and int(m.group(2)) < int(m.group(3)):
        return {"model": m.group(1), "tp_rank": int(m.group(2)), "tp": int(m.group(3)),
                "pp": 1, "pp_rank": 0, "mla": False}
    if m and int(m.group(3)) < int(m.group(2)):
        return {"model": m.group(1), "tp_rank": None, "tp": None, "pp": int(m.group(2)),
                "pp_rank": int(m.group(3)), "mla": True}
    return {"model": suffix[1:], "tp_rank": None, "tp": None, "pp": 1, "pp_rank": 0,
            "mla": True}


def shapes(listing: Listing) -> list[dict]:
    """The (model, tp, pp, MLA) shapes the file names show, with files, bytes and object sizes
    per rank suffix: what ``--scan`` prints without a geometry."""
    groups: dict[tuple, dict] = {}
    for suffix, files in sorted(listing.by_suffix.items()):
        s = read_suffix(suffix)
        ns = s.get("namespace")
        g = groups.setdefault((s["model"], s["tp"], s["pp"], s["mla"], ns), {
            "model": s["model"], "tp": s["tp"], "pp": s["pp"], "mla": s["mla"],
            "scheme": s.get("scheme", "legacy"), "namespace": ns, "ranks": {}})
        sizes = collections.Counter(files.values())
        g["ranks"][suffix] = {"files": len(files), "bytes": sum(files.values()),
                              "object_sizes": {str(k): v for k, v in sizes.most_common(4)}}
    for g in groups.values():
        g["files"] = sum(r["files"] for r in g["ranks"].values())
        g["bytes"] = sum(r["bytes"] for r in g["ranks"].values())
    return list(groups.values())


@dataclasses.dataclass
class Check:
    """A stated geometry checked against a listing: the complete pages (every rank's file there,
    at the right size), and what was left out."""

    geometry: Geometry
    pages: list[str]                                # complete pages, sorted
    per_rank: dict[str, int]                        # suffix -> files of the right size
    incomplete: list[str]                           # pages some ranks lack (or mis-sized)
    mis_sized: int
    other_files: int                                # page files of other models or shapes
    bytes_in: int

    def summary(self) -> dict:
        return {"geometry": self.geometry.to_dict(), "pages": len(self.pages),
                "files_per_rank": self.per_rank, "incomplete_pages": len(self.incomplete),
                "incomplete_examples": self.incomplete[:4], "mis_sized": self.mis_sized,
                "other_files": self.other_files, "bytes_in": self.bytes_in}


def _size_hint(g: Geometry, r: Rank, seen: int) -> str:
    """Which one stated field, changed, would give files of ``seen`` bytes."""
    hints = []
    for name in ("dtype", "head_dim", "kv_heads", "layers", "page_size", "tp", "mla"):
        for alt in _alternatives(g, name):
            try:
                g2 = dataclasses.replace(g, **{name: alt})
                if name == "mla" and alt:
                    g2 = dataclasses.replace(g2, kv_heads=1)
                sizes = {x.nbytes for x in g2.ranks()}
            except (ZeroDivisionError, ValueError, IndexError):
                continue
            if sizes == {seen}:
                hints.append(f"{name}={int(alt) if isinstance(alt, bool) else alt}")
    return f" (files of that size fit {' or '.join(hints[:4])})" if hints else ""


def _alternatives(g: Geometry, name: str) -> list:
    if name == "dtype":
        return sorted({k for k, v in DTYPES.items() if v[1] != g.itemsize and len(k) <= 4})
    if name == "mla":
        return [not g.mla]
    v = getattr(g, name)
    out = [v * 2, v // 2, v * 4, v // 4, v * 8] + list(range(1, 9))
    return sorted({x for x in out if x >= 1 and x != v and
                   (name != "tp" or not (g.kv_heads % x and x % g.kv_heads)) and
                   (name != "layers" or x >= g.pp) and
                   (name != "kv_heads" or not (x % g.tp and g.tp % x))})


def check(listing: Listing, g: Geometry, what: str) -> Check:
    """The complete pages of geometry ``g`` in ``listing``; InputError naming the field when the
    store contradicts the stated geometry (no file of any of its ranks, files of another TP/PP
    shape or model only, or every file of a rank the wrong size)."""
    ranks = g.ranks()
    mine = {r.suffix: r for r in ranks}
    present = [s for s in mine if listing.by_suffix.get(s)]
    if not present:
        raise InputError(f"{what}: {_why_absent(listing, g)}")
    for s in present:
        r, files = mine[s], listing.by_suffix[s]
        if not any(size == r.nbytes for size in files.values()):
            seen = collections.Counter(files.values()).most_common(1)[0][0]
            raise InputError(
                f"{what}: every file *{s}.bin is {seen:,} bytes but the stated geometry gives "
                f"{r.nbytes:,} ({g.kinds} x layers {r.layers[1] - r.layers[0]} x page_size "
                f"{g.page_size} x kv_heads {r.heads[1] - r.heads[0]} x head_dim {g.head_dim} x "
                f"{g.itemsize}-byte {g.dtype}){_size_hint(g, r, seen)}; check layers, "
                "kv_heads, head_dim, dtype, page_size, tp and mla")
    good: dict[str, set] = {}
    mis = 0
    for r in ranks:
        files = listing.by_suffix.get(r.suffix, {})
        ok = {h for h, size in files.items() if size == r.nbytes}
        mis += len(files) - len(ok)
        good[r.suffix] = ok
    every = set().union(*(listing.by_suffix.get(r.suffix, {}).keys() for r in ranks))
    complete = set.intersection(*good.values()) if good else set()
    other = sum(len(f) for s, f in listing.by_suffix.items() if s not in mine)
    return Check(g, sorted(complete), {s: len(v) for s, v in good.items()},
                 sorted(every - complete), mis, other,
                 sum(size for r in ranks for size in listing.by_suffix.get(r.suffix, {}).values()))


def _why_unified(seen: list[dict], g: Geometry) -> str:
    """Which one stated field, changed, gives a namespace the store holds."""
    have = {s["namespace"] for s in seen if s["namespace"]}
    if not have:
        return (f"scheme: it holds no unified-scheme objects (*_{g.digest()}_L…); its files "
                "are rank-suffixed (scheme=legacy)")
    for name in ("head_group", "layer_partition", "dtype", "page_size", "kv_heads", "model",
                 "tp", "pp"):
        alts = list(range(1, 65)) + [None] if name in ("head_group", "layer_partition") else \
            [g.model.replace("-", "/"), g.file_model] if name == "model" else \
            [k for k in ("bf16", "fp16", "fp32", "fp8_e4m3", "fp8_e5m2") if k != g.dtype] \
            if name == "dtype" else _alternatives(g, name)
        for alt in alts:
            try:
                g2 = dataclasses.replace(g, **{name: alt})
                check_unified(g2, "")
                if g2.digest() in have:
                    return (f"{name}: it holds no objects of namespace {g.digest()}, but "
                            f"{g2.digest()}, which is this geometry with {name}={alt}")
            except (UsageError, KeyError, ZeroDivisionError, ValueError):
                continue
    return (f"it holds no objects of namespace {g.digest()} (model, dtype, page_size, "
            "kv_heads, head_group, layer_partition and mla all enter it); its namespaces: "
            f"{', '.join(sorted(have)[:4])}")


def _why_absent(listing: Listing, g: Geometry) -> str:
    want = g.ranks()[0].suffix
    if not listing.by_suffix:
        return f"holds no SGLang page files ({{page_hash}}{want}.bin)"
    seen = shapes(listing)
    if g.scheme == "unified":
        return _why_unified(seen, g)
    same = [s for s in seen if s["model"] == g.file_model]
    if same:
        s = same[0]
        if s["mla"] != g.mla:
            return ("mla: its files of model " + repr(g.file_model) + (
                " carry no TP rank (an MLA store: state mla=1)" if s["mla"] else
                " carry TP ranks (not an MLA store: state mla=0)"))
        if s["tp"] != g.tp and not g.mla:
            return (f"tp: it holds no files of tp={g.tp} for model {g.file_model!r} (*{want}.bin); "
                    f"its files are of tp={s['tp']}" + (f", pp={s['pp']}" if s["pp"] > 1 else ""))
        return (f"pp: it holds no files of pp={g.pp} for model {g.file_model!r} (*{want}.bin); its "
                f"files are of pp={s['pp']}")
    if not [s for s in seen if s["model"] is not None]:
        return ("scheme: its files are unified-scheme objects (*_ukv1-…), not rank-suffixed "
                "ones: give scheme=unified")
    models = sorted({s["model"] for s in seen if s["model"] is not None})
    return (f"model: it holds no files of model {g.file_model!r} (*{want}.bin); the models its file "
            f"names show: {', '.join(map(repr, models[:6]))}")
