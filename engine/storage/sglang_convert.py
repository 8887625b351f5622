"""``convert-layout`` with SGLang's own file stores on either side (docs/sglang-stores.md).

Three directions, one mechanism:

* SGLang → SGLang: another TP size, PP stage set, host layout or model name;
* SGLang → a hicache store (unified grid or legacy per-rank, file store or Mooncake), so a
  hicache fleet starts warm from an SGLang deployment's store;
* a hicache store → SGLang (the reverse).

A page is read from every source object that holds part of it (SGLang: one file per rank, its
size checked; hicache: a self-describing object, header and checksum checked), each seen as
``[layers, kinds, tokens, heads]`` rows of ``head_dim`` elements; every target object is
assembled straight into its own byte order from those views (one copy per byte) and written
whole: SGLang files through a temporary file renamed into place (what SGLang's own writer does,
so an SGLang reader never sees part of a file), hicache objects through the store's atomic put.
Page hashes are kept as they are (SGLang's chain is hicache's, and a namespaced chain — SGLang's
extra key or cache salt — stays that namespace's). The source is only read. A target already
in the destination is compared instead of rewritten, so an interrupted run resumes; one that
differs stops the run. ``verify`` reads every written object back and compares it byte for
byte and, decoded through the target's geometry, element by element with the sources.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import stat
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import numpy as np

from engine.core.errors import InputError, StorageError, UsageError
from engine.storage.sglang_files import map_exact, read_exact, write_atomic
from engine.storage.sglang_geometry import Geometry, Rank, geometry, parse_spec
from engine.storage.sglang_store import Check, check, list_store

COUNTS = ("written", "bytes_written", "skipped_present", "verified", "verify_failed",
          "read_failed")


@dataclasses.dataclass
class Piece:
    """Part of a page in memory: the layers × heads it covers and its rows (a view)."""

    layers: tuple[int, int]
    heads: tuple[int, int]
    rows: np.ndarray


@dataclasses.dataclass
class Target:
    """One object a page becomes: its name, rectangle and how its bytes are laid out."""

    layers: tuple[int, int]
    heads: tuple[int, int]
    nbytes: int
    rows: Callable                  # buf -> writable [layers, kinds, tokens, heads] view
    name: str                       # file-name suffix (SGLang) or key suffix (hicache)
    codec: object = None            # hicache: the header codec
    head_len: int = 0


@dataclasses.dataclass
class Result:
    summary: dict
    counts: dict
    seconds: float = 0.0
    interrupted: bool = False
    problems: list = dataclasses.field(default_factory=list)


# -- reading --------------------------------------------------------------------------------------
class SGLangSide:
    """An SGLang store directory with its geometry (checked against the files as a source)."""

    def __init__(self, root: str, g: Geometry):
        self.root, self.g = os.path.realpath(os.path.expanduser(root)), g
        self.ranks = g.ranks()
        self.label = f"{g.label()} ({g.file_model})"

    def pieces(self, page: str, take=None) -> list[Piece] | None:
        out = []
        for r in self.ranks:
            raw = map_exact(os.path.join(self.root, f"{page}{r.suffix}.bin"), r.nbytes)
            if raw is None:
                return None
            out.append(Piece(r.layers, r.heads, self.g.rows(raw, r)))
        return out

    def targets(self) -> list[Target]:
        def rows_of(r: Rank):
            return lambda buf: self.g.rows(buf, r)
        return [Target(r.layers, r.heads, r.nbytes, rows_of(r), r.suffix) for r in self.ranks]


class HicacheSource:
    """One layout group of a hicache store (its objects' headers read and checked)."""

    def __init__(self, ep, objects: dict, model, tag: str, label: str):
        self.ep, self.objects, self.model, self.tag, self.label = ep, objects, model, tag, label

    def pieces(self, page: str, take=None) -> list[Piece] | None:
        from engine.storage.convert_io import read_source
        from engine.storage.placement import span

        out = []
        for o in self.objects[page]:
            s, _, _ = read_source(self.ep, o, False)
            if s is None:
                continue                    # corrupt: the coverage check decides
            (l0, l1), (h0, h1) = span(o.region)
            out.append(Piece((l0, l1), (h0, h1), s.rows))
        return out


def _hicache_targets(model, to: str, tag: str):
    from engine.storage.convert_io import rows_of
    from engine.storage.convert_plan import check_target
    from engine.storage.placement import Placement
    from formats.kvobject import KVObjectCodec

    target = Placement.parse_target(to)
    check_target(target, model, f"--to {to}")
    out = []
    for t in target.all_tiles(model, tag):
        codec = KVObjectCodec(t.description)
        out.append(Target(t.layers, t.heads, t.payload_len,
                          (lambda lay: lambda buf: rows_of(buf, lay, target.kv_order))(t.layout),
                          t.suffix, codec, codec.header_len))
    return target.label(model), out


def _hicache_model(g: Geometry):
    from engine.core.layout import KVLayout

    if g.itemsize == 1:
        raise UsageError(f"dtype={g.dtype}: hicache stores hold float32, float16 or bfloat16 KV; "
                         "an fp8 SGLang store converts only to another SGLang store")
    return KVLayout(num_layers=g.layers, kv_heads=1 if g.mla else g.kv_heads,
                    head_dim=g.head_dim, page_size=g.page_size, dtype=g.dtype_name,
                    kv_kinds=g.kinds).whole()


def _check_against_model(fields: dict, model, what: str) -> dict:
    """SGLang geometry fields for a destination made from a hicache model: the model's own
    where not given, and a stated one that differs is refused (naming it)."""
    from engine.storage.sglang_geometry import DTYPES

    own = {"layers": model.model_layers, "kv_heads": model.model_kv_heads,
           "head_dim": model.head_dim, "page_size": model.page_size,
           "mla": model.kv_kinds == 1}
    for k, v in own.items():
        if k in fields and fields[k] != v:
            raise UsageError(f"{what}: {k}={int(fields[k]) if k == 'mla' else fields[k]} but "
                             f"the source's model has {k}={int(v) if k == 'mla' else v}")
    if "dtype" in fields and DTYPES[fields["dtype"]][0] != model.dtype:
        raise UsageError(f"{what}: dtype={fields['dtype']} but the source's model holds "
                         f"{model.dtype}")
    short = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}[model.dtype]
    return {**own, "dtype": short, **fields}


# -- the plan ---------------------------------------------------------------------------------
@dataclasses.dataclass
class Plan:
    source: object                  # SGLangSide or HicacheSource
    dest_kind: str                  # "sglang" or "hicache"
    dest: object                    # SGLangSide or an Endpoint
    targets: list[Target]
    pages: list[str]
    summary: dict


def plan(src_spec: str, dst_spec: str, *, to: str = "unified", model_tag: str | None = None,
         dry_run: bool = False, verbose: bool = False) -> Plan:
    """Check both sides and decide everything before anything is written."""
    from engine.storage.endpoints import open_endpoint
    from engine.storage.sglang_geometry import is_sglang

    counts: dict = {}
    if is_sglang(src_spec):
        root, fields = parse_spec(src_spec)
        g = geometry(fields, "SRC " + src_spec.split("?")[0])
        listing = list_store(os.path.expanduser(root))
        chk = check(listing, g, f"SRC {root}")
        source = SGLangSide(root, g)
        pages = chk.pages
        counts.update(_check_counts(chk))
        src_label, src_model = source.label, None
    else:
        source, pages, src_model = _hicache_source(src_spec, model_tag, counts, verbose)
        src_label = source.label
    if is_sglang(dst_spec):
        root, fields = parse_spec(dst_spec)
        what = "DST " + dst_spec.split("?")[0]
        if isinstance(source, SGLangSide):
            dg = geometry(fields, what, base=source.g,
                          fixed=("layers", "kv_heads", "head_dim", "dtype", "page_size", "mla"))
        else:
            dg = geometry(_check_against_model(fields, src_model, what), what)
        _check_dst_dir(root, source)
        dest = SGLangSide(root, dg)
        targets, kind, dst_label = dest.targets(), "sglang", dest.label
    else:
        if not isinstance(source, SGLangSide):
            raise UsageError("neither side is an SGLang store (sglang-file:DIR?…): use "
                             "convert-layout without sglang-file: for hicache stores")
        if model_tag is None:
            raise UsageError("--model-tag TAG is required to write a hicache store from an "
                             "SGLang one: the model tag its servers use (their "
                             "/get_server_info 'model_tag')")
        model = _hicache_model(source.g)
        with _usage():
            dst_label, targets = _hicache_targets(model, to, model_tag)
        if "://" not in dst_spec:
            _check_dst_dir(dst_spec, source, hicache=True)
        dest = open_endpoint(dst_spec, source=False, dry_run=dry_run, verbose=verbose)
        kind = "hicache"
    out_bytes = sum(t.nbytes + t.head_len for t in targets)
    summary = {"source_layout": src_label, "target_layout": dst_label,
               "pages": len(pages), "objects_out": len(pages) * len(targets),
               "bytes_out": len(pages) * out_bytes,
               "present": _present(kind, dest, targets, pages), **counts}
    if model_tag is not None:
        summary["model_tag"] = model_tag
    return Plan(source, kind, dest, targets, pages, summary)


def _present(kind: str, dest, targets: list[Target], pages: list[str]) -> int:
    """Target files or objects the destination holds already (by name: a run compares them)."""
    if kind == "sglang":
        try:
            there = set(os.listdir(dest.root))
        except OSError:
            return 0
        found = [(f"{p}{t.name}.bin", t) for p in pages for t in targets
                 if f"{p}{t.name}.bin" in there]
        for name, t in found:           # a file of another size cannot be this conversion's
            try:
                st = os.lstat(os.path.join(dest.root, name))
            except OSError:
                continue
            if not stat.S_ISREG(st.st_mode) or st.st_size != t.nbytes:
                raise InputError(f"the destination holds {name} of {st.st_size:,} bytes, not "
                                 f"the {t.nbytes:,} this conversion writes (a conflicting "
                                 "file); nothing was written. Remove it or choose another "
                                 "destination")
        return len(found)
    from engine.storage.keys import object_key

    keys = [object_key(bytes.fromhex(p), t.name) for p in pages for t in targets]
    return sum(sum(dest.exists(keys[i:i + 512])) for i in range(0, len(keys), 512))


class _usage:
    """ValueError from a layout string -> UsageError (exit 2)."""

    def __enter__(self):
        return self

    def __exit__(self, et, e, tb):
        if et is not None and issubclass(et, ValueError) and not issubclass(et, UsageError):
            raise UsageError(str(e)) from None
        return False


def _check_counts(chk: Check) -> dict:
    return {"objects_in": sum(chk.per_rank.values()), "bytes_in": chk.bytes_in,
            "incomplete_pages": len(chk.incomplete), "mis_sized": chk.mis_sized,
            "other_files": chk.other_files}


def _check_dst_dir(root: str, source, hicache: bool = False) -> None:
    real = os.path.realpath(os.path.expanduser(root))
    if os.path.exists(real) and not os.path.isdir(real):
        raise InputError(f"destination {root} exists and is not a directory")
    if not hicache and os.path.isfile(os.path.join(real, "store.json")):
        raise InputError(f"destination {root} is a hicache file store, not an SGLang one")
    src_root = getattr(source, "root", None) or getattr(getattr(source, "ep", None), "root",
                                                        None)
    if src_root is not None:
        a = os.path.realpath(src_root)
        if a == real:
            raise InputError("source and destination are the same store")
        if real.startswith(a.rstrip(os.sep) + os.sep) or a.startswith(real.rstrip(os.sep) + os.sep):
            raise InputError(f"the destination {root} and the source {src_root} lie one inside "
                             "the other; nothing was written")


def _hicache_source(spec: str, model_tag: str | None, counts: dict, verbose: bool):
    from engine.storage.convert_plan import _scan
    from engine.storage.endpoints import open_endpoint

    ep = open_endpoint(spec, source=True, verbose=verbose)
    c = dict.fromkeys(("corrupt", "foreign"), 0)
    groups, models = _scan(ep, c)
    if model_tag is not None:
        groups = {g: v for g, v in groups.items() if g[1] == model_tag}
    if not groups:
        raise InputError(f"the source holds no convertible objects ({c['corrupt']} corrupt, "
                         f"{c['foreign']} foreign)" +
                         (f" of model tag {model_tag!r}" if model_tag else ""))
    if len(groups) > 1:
        desc = "; ".join(f"{g[2]} (model tag {g[1]!r})" for g in groups)
        raise InputError(f"the source mixes {len(groups)} layouts or models ({desc}): give "
                         "--model-tag (and convert the other layouts first)")
    (g, objs), = groups.items()
    model, tag = models[g]
    by_page: dict[str, list] = collections.defaultdict(list)
    for o in objs:
        by_page[o.page_hash.hex()].append(o)
    counts.update({"objects_in": len(objs), "bytes_in": sum(o.size for o in objs), **c})
    return HicacheSource(ep, dict(by_page), model, tag, f"{g[2]} (model tag {tag!r})"), \
        sorted(by_page), model


# -- running ------------------------------------------------------------------------------------
def _cuts(pieces: list[Piece], t: Target) -> list[tuple] | None:
    """(piece index, source slices, target slices) filling ``t`` whole, or None."""
    L, H = t.layers[1] - t.layers[0], t.heads[1] - t.heads[0]
    seen = np.zeros((L, H), dtype=bool)
    out = []
    for i, p in enumerate(pieces):
        a0, a1 = max(p.layers[0], t.layers[0]), min(p.layers[1], t.layers[1])
        b0, b1 = max(p.heads[0], t.heads[0]), min(p.heads[1], t.heads[1])
        if a0 >= a1 or b0 >= b1:
            continue
        if seen[a0 - t.layers[0]:a1 - t.layers[0], b0 - t.heads[0]:b1 - t.heads[0]].all():
            continue                        # replicated heads: held already
        seen[a0 - t.layers[0]:a1 - t.layers[0], b0 - t.heads[0]:b1 - t.heads[0]] = True
        out.append((i, (slice(a0 - p.layers[0], a1 - p.layers[0]), slice(None), slice(None),
                         slice(b0 - p.heads[0], b1 - p.heads[0])),
                    (slice(a0 - t.layers[0], a1 - t.layers[0]), slice(None), slice(None),
                     slice(b0 - t.heads[0], b1 - t.heads[0]))))
    return out if seen.all() else None


def _bytes_of(rows: np.ndarray) -> np.ndarray:
    """The same rows as a uint8 view with a trailing byte axis: numpy copies those with its
    contiguous inner loop (about twice as fast as row-sized void elements)."""
    return rows[..., None].view(np.uint8)


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint8)


class _Runner:
    def __init__(self, p: Plan, verify: bool):
        self.p, self.verify = p, verify
        self.lock = threading.Lock()
        self.counts = dict.fromkeys(COUNTS, 0)
        self.counts["not_produced"] = 0
        self.problems: list[str] = []
        self._cut_cache: dict = {}
        self._local = threading.local()

    def cuts(self, pieces: list[Piece]) -> list:
        sig = tuple((p.layers, p.heads) for p in pieces)
        got = self._cut_cache.get(sig)
        if got is None:
            got = self._cut_cache[sig] = [_cuts(pieces, t) for t in self.p.targets]
        return got

    def page(self, page: str) -> dict:
        """Convert one page with this thread's buffers (reused page after page: fresh memory
        for every file costs more than the copy)."""
        from engine.storage.convert_io import Buffers

        bufs = getattr(self._local, "bufs", None)
        if bufs is None:
            bufs = self._local.bufs = Buffers()
        try:
            return self._page(page, bufs.take)
        finally:
            bufs.release()

    def _page(self, page: str, take) -> dict:
        c = collections.Counter()
        outs: list[tuple] = []                  # hicache objects: put together, per page
        pieces = self.p.source.pieces(page, take)
        if not pieces:
            c["read_failed"] += 1
            return c
        for t, cuts in zip(self.p.targets, self.cuts(pieces)):
            if cuts is None:
                c["not_produced"] += 1
                continue
            buf = take(t.head_len + t.nbytes)
            payload = buf[t.head_len:]
            view = _bytes_of(t.rows(payload))
            for i, ss, ds in cuts:
                view[ds] = _bytes_of(pieces[i].rows[ss])
            if t.codec is not None:
                from formats.kvobject import checksum

                t.codec.encode_header_into(memoryview(buf)[:t.head_len], bytes.fromhex(page),
                                           payload, checksum(payload))
            if self.p.dest_kind == "sglang":
                self._put_file(page, t, buf, pieces, cuts, c)
            else:
                outs.append((t, buf, cuts))
        if outs:
            self._put_objects(page, outs, pieces, c)
        return c

    def _put_file(self, page: str, t: Target, buf: np.ndarray, pieces, cuts, c) -> None:
        root = self.p.dest.root
        name = f"{page}{t.name}.bin"
        path = os.path.join(root, name)
        if os.path.lexists(path):
            got = read_exact(path, len(buf))
            if got is None or not np.array_equal(got, buf):
                raise InputError(f"the destination's file {name} differs from what this "
                                 "conversion produces (a conflicting or damaged file); remove "
                                 "it and run again")
            c["skipped_present"] += 1
        else:
            write_atomic(root, name, buf)
            c["written"] += 1
            c["bytes_written"] += len(buf)
        if self.verify:
            self._verdict(c, name, read_exact(path, len(buf)), buf, t, pieces, cuts)

    def _put_objects(self, page: str, outs: list[tuple], pieces, c) -> None:
        """A page's hicache objects: those present compared, the others put in one batch."""
        from engine.storage.keys import object_key

        dest = self.p.dest
        keys = [object_key(bytes.fromhex(page), t.name) for t, _, _ in outs]
        todo = []
        for key, there, (t, buf, cuts) in zip(keys, dest.exists(keys), outs):
            if not there:
                todo.append((key, t, buf, cuts))
                continue
            got = dest.read(key)
            if got is None or not np.array_equal(np.frombuffer(got, np.uint8), buf):
                raise InputError(f"the destination's object {key} differs from what this "
                                 "conversion produces (a conflicting or damaged object); remove "
                                 "it and run again")
            c["skipped_present"] += 1
        if todo:
            oks = dest.put([k for k, *_ in todo], [[buf] for _, _, buf, _ in todo])
            for (_, _, buf, _), ok in zip(todo, oks):
                if ok:
                    c["written"] += 1
                    c["bytes_written"] += len(buf)
            if not all(oks):
                raise StorageError(f"the destination refused {oks.count(False)} object(s) "
                                   f"(e.g. {todo[oks.index(False)][0]}): disk full or an I/O "
                                   "error; every object written so far is whole: free space "
                                   "and run again to resume")
        if self.verify:
            for key, (t, buf, cuts) in zip(keys, outs):
                raw = dest.read(key)
                self._verdict(c, key, None if raw is None else np.frombuffer(raw, np.uint8),
                              buf, t, pieces, cuts)

    def _verdict(self, c, name: str, got, buf, t: Target, pieces, cuts) -> None:
        problem = None
        if got is None or len(got) != len(buf) or not np.array_equal(got, buf):
            problem = "differs from what was written"
        else:
            if t.codec is not None:
                from formats.kvobject import KVObjectError, parse_header, verify_payload

                try:
                    h = parse_header(got.tobytes())
                    verify_payload(h, memoryview(got)[h.header_len:])
                    if h.layout != t.codec.layout:
                        problem = "its header describes another layout"
                except KVObjectError as e:
                    problem = str(e)
            if problem is None:
                mine = t.rows(np.array(got[t.head_len:]))
                for i, ss, ds in cuts:
                    if not np.array_equal(_bits(mine[ds]), _bits(pieces[i].rows[ss])):
                        problem = "an element is not the source's"
                        break
        if problem is None:
            c["verified"] += 1
        else:
            c["verify_failed"] += 1
            with self.lock:
                if len(self.problems) < 8:
                    self.problems.append(f"{name}: {problem}")


def run(p: Plan, *, verify: bool = False, progress: Callable[[int], None] | None = None,
        workers: int | None = None) -> Result:
    """Convert every page of the plan (threads: ``workers``, default one per CPU, at most 4).
    A KeyboardInterrupt stops it: pages not started are dropped, every file or object
    written is whole, ``interrupted`` is set and a second run carries on."""
    from engine.storage.convert_plan import WORKERS

    if p.dest_kind == "sglang":
        try:
            os.makedirs(p.dest.root, exist_ok=True)
        except OSError as e:
            raise StorageError(f"cannot create {p.dest.root}: {e.strerror or e}") from None
    r = _Runner(p, verify)
    res = Result(p.summary, r.counts)
    per_page = p.summary["bytes_in"] / max(1, p.summary["pages"] + p.summary.get(
        "incomplete_pages", 0)) if p.summary.get("bytes_in") else 0
    t0 = time.perf_counter()
    n = WORKERS if workers is None else workers
    pending: collections.deque = collections.deque()

    def merge(cnt) -> None:
        for k, v in cnt.items():
            r.counts[k] = r.counts.get(k, 0) + v
        if progress is not None:
            progress(int(per_page))

    try:
        if n <= 1:
            for page in p.pages:
                merge(r.page(page))
        else:
            with ThreadPoolExecutor(n, thread_name_prefix="hicache-sgconvert") as ex:
                try:
                    for page in p.pages:
                        pending.append(ex.submit(r.page, page))
                        if len(pending) >= 4 * n:
                            merge(pending.popleft().result())
                    while pending:
                        merge(pending.popleft().result())
                finally:
                    for f in pending:
                        f.cancel()
                    for f in pending:       # finished before the stop: count them
                        if f.done() and not f.cancelled() and f.exception() is None:
                            merge(f.result())
    except KeyboardInterrupt:
        res.interrupted = True
    res.seconds = time.perf_counter() - t0
    res.problems = r.problems
    return res


def close(p: Plan) -> None:
    for side in (p.source, p.dest):
        ep = getattr(side, "ep", side)
        if hasattr(ep, "close"):
            ep.close()
