"""Convert a store at rest between layouts: legacy per-rank → unified, one unified grid to
another, ``layer_first`` ↔ ``page_first`` payloads (docs/storage.md, "convert-layout").

Two steps, both pure with respect to the source (it is only read):

* :func:`plan` (:mod:`engine.storage.convert_plan`): every source header read and checked,
  the target objects each page can produce, the destination checked for conflicts and room;
* :func:`run` converts page by page: reads each source object once (a file store's is mapped)
  and checks it (a corrupt one is skipped and counted, never copied), cuts the target
  rectangles (a view of one source payload when one holds the whole rectangle in the target's
  byte order, else assembled), and writes them. Into a file store, worker threads
  (:data:`WORKERS`) each take a page: its objects are written to unnamed files and linked into
  place under one lock (the file backend's ``put``; payload bytes that are whole runs of source
  files are copied by the kernel); into Mooncake, objects go in
  batches of about 8 MiB. With ``verify`` every written object is read back and compared byte
  for byte. Objects already in the destination are read back and compared instead of
  rewritten, so a run is resumable. A ``KeyboardInterrupt`` stops the run: pages not started
  are dropped, pages being written finish, every object visible in the destination is whole,
  the result says ``interrupted``, and a second run carries on.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

from engine.core.errors import InputError, StorageError
from engine.storage.backend import FileRange
from engine.storage.convert_io import (
    Assembly,
    Buffers,
    Recipe,
    Source,
    apply_cut,
    fresh,
    holds,
    meaning_problem,
    read_source,
    recipes,
)
from engine.storage.convert_plan import (  # noqa: F401 (plan, check_shape: the two steps' API)
    HEAD_BYTES,
    WORKERS,
    Plan,
    SourceObject,
    check_shape,
    plan,
)
from engine.storage.endpoints import Endpoint, FileEndpoint
from formats.kvobject import checksum, checksum_parts

BATCH_BYTES = 8 << 20

_COUNTS = ("written", "bytes_written", "skipped_present", "verified", "verify_failed",
           "read_corrupt", "not_produced", "kernel_copied_bytes")
MAX_PROBLEMS = 8
"""Objects ``--verify`` found wrong are counted; the first few are named."""


@dataclasses.dataclass
class Result:
    counts: dict[str, int]
    seconds: float = 0.0
    interrupted: bool = False
    problems: list[str] = dataclasses.field(default_factory=list)   # verify: the first few


@dataclasses.dataclass
class _Out:
    key: str
    parts: list                 # as written: the header, then buffers or FileRanges
    header: bytes
    pieces: list                # the payload as bytes in memory (to compare with)
    size: int
    index: int = 0              # the tile's index in the plan
    srcs: list = dataclasses.field(default_factory=list)    # the page's sound sources


@dataclasses.dataclass
class _Page:
    """One page's work: its target objects, what it counted, the files it keeps open."""

    counts: dict[str, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(_COUNTS, 0))
    outs: list[_Out] = dataclasses.field(default_factory=list)
    fds: list[int] = dataclasses.field(default_factory=list)
    nbytes: int = 0
    error: BaseException | None = None
    problems: list[str] = dataclasses.field(default_factory=list)


def run(p: Plan, src: Endpoint, dst: Endpoint, *, verify: bool = False,
        progress: Callable[[int], None] | None = None, workers: int | None = None) -> Result:
    """Convert; the counters say what happened (``written``, ``skipped_present``, ``corrupt``,
    ``verified``, ``bytes_written``). Raises StorageError when the destination refuses a write
    (disk full, I/O error) — every object written before that is whole. ``workers``: threads
    converting pages at once (default :data:`WORKERS` between file stores, else 0: inline)."""
    conv = _Converter(p, src, dst, verify)
    if workers is None:
        workers = WORKERS if conv.ranges else 0
    t0 = time.perf_counter()
    try:
        if conv.file_dst and workers > 0:
            conv.threaded(workers, progress)
        else:
            conv.inline(progress)
    except KeyboardInterrupt:
        conv.res.interrupted = True
    conv.res.seconds = time.perf_counter() - t0
    return conv.res


class _Converter:
    """One run: reads, checks and cuts pages, and writes their target objects.

    A file destination is written page by page (each page's objects staged, then made visible
    under one lock: the file backend's ``put``), from worker threads when ``threaded``; another
    destination is written in batches of about :data:`BATCH_BYTES` from this thread."""

    def __init__(self, p: Plan, src: Endpoint, dst: Endpoint, verify: bool):
        self.p, self.src, self.dst, self.verify = p, src, dst, verify
        self.res = Result({**p.counts, **dict.fromkeys(_COUNTS, 0)})
        self.file_dst = isinstance(dst, FileEndpoint)
        # Between file stores, payload bytes that are whole runs of a source file are copied in
        # the kernel (copy_file_range) instead of written from user memory.
        self.ranges = isinstance(src, FileEndpoint) and self.file_dst
        self._local = threading.local()
        self._geometry: dict[tuple, list[Recipe | None]] = {}
        self._suffixes = [t.suffix for t in p.tiles]
        self._header_lens = [c.header_len for c in p.codecs]

    # -- driving -------------------------------------------------------------------------------
    def threaded(self, workers: int, progress) -> None:
        self.dst.backend()                  # created here, once, before any thread writes
        pending: collections.deque[Future] = collections.deque()
        ex = ThreadPoolExecutor(workers, thread_name_prefix="hicache-convert")
        try:
            for ph, objs in self.p.pages.items():
                pending.append(ex.submit(self._direct, ph, objs))
                if len(pending) >= 2 * workers:
                    self._collect_first(pending, progress)
            while pending:
                self._collect_first(pending, progress)
        finally:
            # Stopped early (Ctrl-C, an error): pages not started are dropped, those running
            # finish — each of their objects is published whole — and are counted.
            for f in pending:
                f.cancel()
            ex.shutdown(wait=True)
            for f in pending:
                if not f.cancelled() and f.exception() is None:
                    self._merge(f.result())

    def inline(self, progress) -> None:
        batch: list[_Page] = []
        size = 0
        for ph, objs in self.p.pages.items():
            if self.file_dst:
                self._collect(self._direct(ph, objs), progress)
                continue
            w = _Page()
            try:
                self._cut_page(ph, objs, w, fresh)
            finally:
                self._close(w)
            batch.append(w)
            size += sum(o.size for o in w.outs)
            if size >= BATCH_BYTES:
                self._flush(batch)
                batch, size = [], 0
            if progress is not None:
                progress(w.nbytes)
        self._flush(batch)

    def _collect_first(self, pending: collections.deque, progress) -> None:
        w = pending[0].result()     # (left in ``pending`` until here: Ctrl-C while waiting)
        pending.popleft()
        self._collect(w, progress)

    def _collect(self, w: _Page, progress) -> None:
        self._merge(w)
        if w.error is not None:
            raise w.error
        if progress is not None:
            progress(w.nbytes)

    def _merge(self, w: _Page) -> None:
        for k, v in w.counts.items():
            self.res.counts[k] += v
        self.res.problems.extend(w.problems[:MAX_PROBLEMS - len(self.res.problems)])

    # -- one page ------------------------------------------------------------------------------
    def _direct(self, ph: bytes, objs: list[SourceObject]) -> _Page:
        """Read, cut, write, publish (and verify) one page into a file destination, with
        this thread's reused buffers; errors travel in the result, with its counts."""
        bufs = getattr(self._local, "bufs", None)
        if bufs is None:
            bufs = self._local.bufs = Buffers()
            self._local.assemblies = {}
        w = _Page()
        try:
            self._cut_page(ph, objs, w, bufs.take, self._local.assemblies)
            if w.outs:
                oks = self.dst.put([o.key for o in w.outs], [o.parts for o in w.outs])
                self._written(w, w.outs, oks)
        except (InputError, StorageError) as e:
            w.error = e
        finally:
            w.outs = []             # views of the sources' mappings and of ``bufs``: gone now
            self._close(w)
            bufs.release()
        return w

    def _cut_page(self, ph: bytes, objs: list[SourceObject], w: _Page, take,
                  assemblies: dict | None = None) -> None:
        """Read and check the page's sources, cut its target objects into ``w.outs`` (those
        the destination holds already are compared, not written). ``assemblies``: this
        thread's :class:`Assembly` per recipe list, reused page after page (only where the
        page is written and compared before the next one is cut)."""
        p, counts = self.p, w.counts
        srcs: list[Source] = []
        for o in objs:
            s, n, fd = read_source(self.src, o, self.ranges)
            w.nbytes += n
            if fd is not None:
                w.fds.append(fd)
            if s is None:
                counts["read_corrupt"] += 1
            else:
                srcs.append(s)
        hexph = ph.hex()
        rs = self._recipes(srcs, p.out[ph])
        asm = self._assembly(rs, assemblies) if assemblies is not None else None
        for r in rs:
            if r is None:
                counts["not_produced"] += 1
                continue
            key = f"{hexph}.{self._suffixes[r.index]}"
            if asm is not None and r.copies:    # header and payload in one kept buffer
                whole, head, payload, copies = asm.slots[r.index]
                Assembly.fill(copies, srcs)
                p.codecs[r.index].encode_header_into(head, ph, payload, checksum(payload))
                if key in p.present:
                    self._present(w, key, head, [payload], r.index, ph, srcs)
                else:
                    w.outs.append(_Out(key, [whole], head, [payload], len(whole), r.index,
                                       srcs))
                continue
            t = p.tiles[r.index]
            if r.runs:
                pieces = [srcs[i].payload[a:a + n] for i, a, n in r.runs]
                psum = srcs[r.runs[0][0]].checksum if r.whole else checksum_parts(pieces)
                body = [FileRange(srcs[i].fd, srcs[i].header_len + a, n) for i, a, n in r.runs]
            elif r.copies:              # header and payload in one buffer: one write
                codec = p.codecs[r.index]
                payload = apply_cut(r, t, srcs, p.target_order, take, codec.header_len)
                pieces, whole = [payload], payload.base
                head = memoryview(whole)[:codec.header_len]
                codec.encode_header_into(head, ph, payload, checksum_parts(pieces))
                if key in p.present:
                    self._present(w, key, head, pieces, r.index, ph, srcs)
                else:
                    w.outs.append(_Out(key, [whole], head, pieces, len(whole), r.index, srcs))
                continue
            else:
                pieces = body = [apply_cut(r, t, srcs, p.target_order, take)]
                psum = checksum_parts(pieces)
            header = p.codecs[r.index].header_for(ph, t.payload_len, psum)
            if key in p.present:
                self._present(w, key, header, pieces, r.index, ph, srcs)
                continue
            if r.runs:
                counts["kernel_copied_bytes"] += t.payload_len
            w.outs.append(_Out(key, [header, *body], header, pieces,
                               len(header) + t.payload_len, r.index, srcs))

    def _recipes(self, srcs: list[Source], wanted: list[int]) -> list[Recipe | None]:
        """The page's recipes: worked out once per (source rectangles, wanted tiles)."""
        sig = (tuple((s.obj.region, s.obj.order) for s in srcs), tuple(wanted))
        got = self._geometry.get(sig)
        if got is None:
            got = self._geometry[sig] = recipes(self.p.tiles, wanted, srcs,
                                                self.p.target_order, self.ranges)
        return got

    def _assembly(self, rs: list[Recipe | None], assemblies: dict) -> Assembly | None:
        got = assemblies.get(id(rs))
        if got is None or got[0] is not rs:
            if not any(r is not None and r.copies for r in rs):
                return None
            if len(assemblies) >= 8:        # many source shapes: keep the memory bounded
                assemblies.clear()
            got = assemblies[id(rs)] = (rs, Assembly(rs, self.p.tiles, self._header_lens,
                                                     self.p.target_order))
        return got[1]

    def _written(self, w: _Page, outs: list[_Out], oks: list[bool]) -> None:
        """Count what the destination took; verify it; a refusal becomes ``w.error``."""
        for o, ok in zip(outs, oks):
            if ok:
                w.counts["written"] += 1
                w.counts["bytes_written"] += o.size
        if not all(oks):
            failed = next(o.key for o, ok in zip(outs, oks) if not ok)
            w.error = StorageError(
                f"the destination refused {oks.count(False)} object(s) (e.g. {failed}): disk "
                "full or an I/O error; every object written so far is whole: free space and "
                "run again to resume")
            return
        if self.verify:
            for o in outs:
                raw = self.dst.read(o.key)
                problem = "differs from what was written" if not holds(
                    raw, o.header, o.pieces) else self._meaning(raw, o.key, o.index, o.srcs)
                self._verdict(w, o.key, problem)

    def _present(self, w: _Page, key: str, header, pieces: list, index: int, ph: bytes,
                 srcs: list) -> None:
        """A target object the destination holds already: it must be what this conversion
        produces (else the run stops: a conflicting or damaged object); with ``verify`` its
        meaning is checked too."""
        raw = self.dst.read(key)
        if not holds(raw, header, pieces):
            raise InputError(f"the destination's object {key} differs from what this "
                             "conversion produces (a conflicting or damaged object); remove it "
                             "and run again")
        w.counts["skipped_present"] += 1
        if self.verify:
            self._verdict(w, key, self._meaning(raw, key, index, srcs))

    def _meaning(self, raw, key: str, index: int, srcs: list) -> str | None:
        return meaning_problem(raw, self.p.tiles[index].description, bytes.fromhex(key[:64]),
                               srcs)

    @staticmethod
    def _verdict(w: _Page, key: str, problem: str | None) -> None:
        if problem is None:
            w.counts["verified"] += 1
        else:
            w.counts["verify_failed"] += 1
            if len(w.problems) < MAX_PROBLEMS:
                w.problems.append(f"{key}: {problem}")

    def _flush(self, batch: list[_Page]) -> None:
        """Write a batch of pages' objects to a destination that is not a file store."""
        outs = [o for w in batch for o in w.outs]
        total = _Page()
        for w in batch:
            self._merge(w)
        if outs:
            self._written(total, outs, self.dst.put([o.key for o in outs],
                                                    [o.parts for o in outs]))
        self._merge(total)
        if total.error is not None:
            raise total.error

    @staticmethod
    def _close(w: _Page) -> None:
        for fd in w.fds:
            os.close(fd)
        w.fds = []
