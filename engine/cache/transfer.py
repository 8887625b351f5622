"""Moving pages between tiers: asynchronous, two-phase, with per-layer completion.

A :class:`TransferOp` copies a list of pages from one pool to another, layer by layer. The
caller *prepares* (allocates destination pages, builds the op), *submits*, and later *completes*
it (the cache commits the destination tier when :meth:`TransferOp.done` is true). In-flight data
is never a hit.

* On CUDA, copies run on a dedicated stream; each layer records an event and
  :meth:`TransferOp.wait_layer` makes the current stream wait on it. Pinned L2 is mapped into
  the device's address space (:meth:`HostPool.device_alias`), so a layer is one gather kernel
  and one scatter kernel that move the scattered pages over the bus themselves, with nothing
  staged and the caller never blocked (:func:`copy_layer_words`); wrapped pools, or a driver
  that refuses the mapping, go through ``get_layer``/``set_layer`` instead.
* On CPU, a worker thread performs the same per-layer copies and sets one ``threading.Event``
  per layer: the same code path, the same ordering guarantees. Between two host pools a layer
  is one list of chunks copied pool to pool (:class:`HostCopy`, :mod:`.hostcopy`); otherwise
  a gather and a scatter of plain tensor copies.
* Without pools (metadata-only replay) an op is complete as soon as it is submitted.
"""

from __future__ import annotations

import collections
import enum
import itertools
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Iterator

import numpy as np

from engine.cache.hostcopy import copy_chunks
from formats.ranklog_events import OpId

if TYPE_CHECKING:
    import torch


class HostCopy:
    """One op's copy between two pools in host memory, planned once for all its layers.

    A layer is a list of (page, kind) chunks copied straight from pool to pool — no gathered
    temporary, no per-token index — by :func:`~engine.cache.hostcopy.copy_chunks` (one native
    call per list, or the Python fallback; chunks adjacent on both sides form one run). The
    list is sorted by source address (the reads then stream forward and the hardware
    prefetchers follow; an op's destination pages are distinct, so the order is free) and cut
    by chunk count into one part per copy thread, as many as torch uses. In both pools a layer's
    chunks sit at the same offsets plus a per-layer stride, so the list is built once per op.
    """

    def __init__(self, src, src_pages: np.ndarray, dst, dst_pages: np.ndarray):
        self.src, self.dst = src, dst
        self.chunk = src.chunk_bytes
        so = src.chunk_offsets(0, src_pages).reshape(-1)
        do = dst.chunk_offsets(0, dst_pages).reshape(-1)
        order = np.argsort(so)
        self.so, self.do = so[order], do[order]
        self.strides = (_layer_stride(src, src_pages, so), _layer_stride(dst, dst_pages, do))
        n = int(so.size)
        self.layer_bytes = n * self.chunk
        self.stream = self.layer_bytes >= _STREAM_MIN_BYTES
        workers = max(1, min(_threads(), n, self.layer_bytes // _PARALLEL_MIN_BYTES))
        step = max(1, -(-n // workers))
        self.parts = [(i, min(i + step, n)) for i in range(0, n, step)] or [(0, 0)]

    def copy_part(self, layer: int, part: tuple[int, int]) -> None:
        a, b = part
        s_stride, d_stride = self.strides
        copy_chunks(self.dst.buf.data_ptr() + layer * d_stride,
                    self.src.buf.data_ptr() + layer * s_stride, self.do[a:b], self.so[a:b],
                    self.chunk, self.stream)

    def copy_layer(self, layer: int) -> int:
        """One layer, all parts (the caller's thread and the copy threads). Returns its bytes."""
        first, *rest = self.parts
        futs = [_copy_threads(len(rest)).submit(self.copy_part, layer, part) for part in rest]
        self.copy_part(layer, first)
        for f in futs:
            f.result()
        return self.layer_bytes

    def run(self, num_layers: int, layer_done) -> None:
        """Copy every layer; ``layer_done(layer)`` is called in layer order, each once all of
        that layer's bytes are in place. The copy threads go through their parts of all the
        layers without waiting; this thread copies its part of a layer, then waits for theirs:
        no thread idles at the end of each layer."""
        first, *rest = self.parts
        if not rest:
            for layer in range(num_layers):
                self.copy_part(layer, first)
                layer_done(layer)
            return
        ready = [[threading.Event() for _ in range(num_layers)] for _ in rest]
        errors: list[BaseException] = []

        def helper(k: int, part: tuple[int, int]) -> None:
            try:
                for layer in range(num_layers):
                    self.copy_part(layer, part)
                    ready[k][layer].set()
            except BaseException as exc:  # re-raised by the caller's thread
                errors.append(exc)
            finally:
                for ev in ready[k]:      # never leave the caller waiting
                    ev.set()

        futs = [_copy_threads(len(rest)).submit(helper, k, part) for k, part in enumerate(rest)]
        try:
            for layer in range(num_layers):
                self.copy_part(layer, first)
                for k in range(len(rest)):
                    ready[k][layer].wait()
                if errors:
                    raise errors[0]
                layer_done(layer)
        finally:
            for f in futs:               # the copy threads are done before anything returns
                f.result()


def _layer_stride(pool, pages: np.ndarray, off0: np.ndarray) -> int:
    """Bytes between a chunk of layer 0 and the same chunk of layer 1: the same for every
    chunk in both pool layouts (their offsets are affine in the layer)."""
    d = pool.chunk_offsets(1, pages).reshape(-1) - off0
    assert not d.size or (d == d[0]).all(), "pool chunk offsets are not a per-layer stride"
    return int(d[0]) if d.size else 0


def copy_pages_host(src, src_pages: np.ndarray, dst, dst_pages: np.ndarray, layer: int) -> int:
    """Copy one layer of ``src_pages`` of ``src`` into ``dst_pages`` of ``dst`` (both pools in
    host memory; see :class:`HostCopy`). Returns the bytes copied."""
    return HostCopy(src, src_pages, dst, dst_pages).copy_layer(layer)


_PARALLEL_MIN_BYTES = 1 << 20
# A layer this large is copied with streaming stores (native path): it outgrows a core's L2
# (0.5-2 MiB on current x86), so ordinary stores would mostly spend memory bandwidth reading
# destination lines they then overwrite, and push the program's working set out of L3.
_STREAM_MIN_BYTES = 4 << 20
_pool_threads: "ThreadPoolExecutor | None" = None


def _copy_threads(n: int) -> "ThreadPoolExecutor":
    global _pool_threads
    if _pool_threads is None or _pool_threads._max_workers < n:
        _pool_threads = ThreadPoolExecutor(max_workers=n, thread_name_prefix="hicache-copy")
    return _pool_threads


def _threads() -> int:
    import torch

    return torch.get_num_threads()


def _host_to_host(src, dst) -> bool:
    """Both pools in host memory, contiguous, same layout and dtype: chunks can be copied
    pool to pool (:func:`copy_pages_host`)."""
    sb, db = getattr(src, "buf", None), getattr(dst, "buf", None)
    return (sb is not None and db is not None and sb.device.type == "cpu"
            and db.device.type == "cpu" and sb.dtype == db.dtype and sb.is_contiguous()
            and db.is_contiguous() and hasattr(src, "chunk_offsets")
            and hasattr(dst, "chunk_offsets") and src.layout == dst.layout)


def copy_layer_words(src: "torch.Tensor", src_idx: "torch.Tensor", dst: "torch.Tensor",
                     dst_idx: "torch.Tensor") -> "torch.Tensor":
    """Pages ``src_idx`` of one layer's ``[kinds, pages, words]`` view into pages ``dst_idx``
    of another: one gather, one scatter, on whatever device the views live (on CUDA, one of
    them may be pinned host memory seen through :meth:`HostPool.device_alias`, so the kernel
    itself moves the bytes over the bus). Returns the gathered words (their size is the bytes
    moved)."""
    data = src.index_select(1, src_idx)
    dst.index_copy_(1, dst_idx, data)
    return data


def _mapped_views(src, dst):
    """``(src_view, dst_view)`` (each ``layer -> [kinds, pages, words]``) for an L1 <-> L2 op
    on CUDA whose host side maps into the device's address space; ``None`` where the op must
    go through ``get_layer``/``set_layer`` (wrapped pools, unpinned L2, mapping refused)."""
    def view(pool):
        if not hasattr(pool, "device_alias"):                   # L1
            return pool.layer_words if pool.buf.is_cuda else None
        alias = pool.device_alias()                             # L2
        return None if alias is None else (lambda layer: pool.layer_words(layer, alias))

    if not (hasattr(src, "layer_words") and hasattr(dst, "layer_words")):
        return None
    sv, dv = view(src), view(dst)
    return None if sv is None or dv is None else (sv, dv)


class OpKind(str, enum.Enum):
    LOAD = "load"        # L2 -> L1 (load-back)
    BACKUP = "backup"    # L1 -> L2
    PREFETCH = "prefetch"  # L3 -> L2


class TransferOp:
    __slots__ = ("op_id", "kind", "src", "src_pages", "dst", "dst_pages", "num_layers",
                 "_layer_events", "_cuda_events", "_error", "payload")

    def __init__(self, op_id: OpId, kind: OpKind, src: Any, src_pages: np.ndarray, dst: Any,
                 dst_pages: np.ndarray, num_layers: int, payload: Any = None):
        self.op_id = op_id
        self.kind = kind
        self.src, self.src_pages = src, src_pages
        self.dst, self.dst_pages = dst, dst_pages
        self.num_layers = num_layers
        self._layer_events = [threading.Event() for _ in range(num_layers)]
        self._cuda_events: list | None = None
        self._error: BaseException | None = None
        self.payload = payload  # what the cache needs to commit it (nodes, ...)

    # -- completion -------------------------------------------------------------------------
    def _finish_layer(self, layer: int) -> None:
        self._layer_events[layer].set()

    def _fail(self, exc: BaseException) -> None:
        self._error = exc
        for ev in self._layer_events:
            ev.set()

    def layer_done(self, layer: int) -> bool:
        if not self._layer_events[layer].is_set():
            return False
        if self._cuda_events is not None:
            return bool(self._cuda_events[layer].query())
        return True

    def done(self) -> bool:
        return self.num_layers == 0 or self.layer_done(self.num_layers - 1)

    def wait_layer(self, layer: int) -> None:
        """Return when layer ``layer`` is usable by the caller (on CUDA: ordered on its stream)."""
        self._layer_events[layer].wait()
        if self._error is not None:
            raise RuntimeError(f"transfer {self.kind.value}#{self.op_id} failed") from self._error
        if self._cuda_events is not None:
            import torch

            torch.cuda.current_stream().wait_event(self._cuda_events[layer])

    def wait(self) -> None:
        for layer in range(self.num_layers):
            self.wait_layer(layer)
        if self._cuda_events is not None and self.num_layers:
            self._cuda_events[-1].synchronize()

    @property
    def failed(self) -> bool:
        return self._error is not None


def op_id_sequence(start: int = 0) -> Iterator[OpId]:
    """A rank's op-id counter: 0, 1, 2, ... typed as :data:`OpId` (the ids are plain ints)."""
    return map(OpId, itertools.count(start))


class TransferEngine:
    """Executes ops in submission order per queue, loads before backups."""

    def __init__(self, device: str = "cpu", op_ids: Iterator[OpId] | None = None):
        self.device = device
        # Op ids (formats.ranklog_events.OpId): the facade shares one sequence with its L3 tier.
        self._op_ids = op_ids if op_ids is not None else op_id_sequence()
        self._work: "queue.PriorityQueue[tuple[int, int, TransferOp | None]]" = queue.PriorityQueue()
        self._thread: threading.Thread | None = None
        self._stream: torch.cuda.Stream | None = None
        self._lock = threading.Lock()
        self._running = threading.Event()
        self._running.set()
        self.bytes_moved: collections.Counter[str] = collections.Counter()
        self.debug_delay_s = 0.0   # debug: hold each CPU copy this long (stage-delay demos/tests)

    def pause(self) -> None:
        """Hold queued CPU copies (debugging and tests: observe in-flight state)."""
        self._running.clear()

    def resume(self) -> None:
        self._running.set()

    def new_op(self, kind: OpKind, src, src_pages, dst, dst_pages, num_layers: int,
               payload: Any = None) -> TransferOp:
        return TransferOp(next(self._op_ids), kind, src, np.asarray(src_pages, dtype=np.int64),
                          dst, np.asarray(dst_pages, dtype=np.int64), num_layers, payload)

    def submit(self, op: TransferOp) -> TransferOp:
        if op.src is None or op.dst is None or len(op.src_pages) == 0:
            for layer in range(op.num_layers):
                op._finish_layer(layer)
            return op
        mark = getattr(op.dst, "mark_written", None)
        if mark is not None:
            mark(op.dst_pages)
        if self.device.startswith("cuda"):
            self._run_cuda(op)
            return op
        self._ensure_thread()
        prio = 0 if op.kind is OpKind.LOAD else 1
        self._work.put((prio, op.op_id, op))
        return op

    # -- CPU: a worker thread ------------------------------------------------------------------
    def _ensure_thread(self) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._worker, name="hicache-transfer",
                                                daemon=True)
                self._thread.start()

    def _worker(self) -> None:
        while True:
            _, _, op = self._work.get()
            if op is None:
                return
            self._running.wait()
            if self.debug_delay_s:
                time.sleep(self.debug_delay_s)
            try:
                self._copy_cpu(op)
            except BaseException as exc:  # surfaced by wait_layer; never swallowed
                op._fail(exc)

    def _copy_cpu(self, op: TransferOp) -> None:
        last = op.num_layers - 1

        def layer_done(layer: int, n: int) -> None:
            self.bytes_moved[op.kind.value] += n
            if layer == last and hasattr(op.dst, "pages_written"):
                # Before completion: whoever reads the pages after it (an L3 put) finds what
                # listeners derived (checksums) ready.
                op.dst.pages_written(op.dst_pages)
            op._finish_layer(layer)

        if _host_to_host(op.src, op.dst):
            plan = HostCopy(op.src, op.src_pages, op.dst, op.dst_pages)
            plan.run(op.num_layers, lambda layer: layer_done(layer, plan.layer_bytes))
            return
        for layer in range(op.num_layers):
            data = op.src.get_layer(layer, op.src_pages)
            op.dst.set_layer(layer, op.dst_pages, data)
            layer_done(layer, data.numel() * data.element_size())

    # -- CUDA: a dedicated stream ------------------------------------------------------------
    def _run_cuda(self, op: TransferOp) -> None:
        import torch

        if self._stream is None:
            self._stream = torch.cuda.Stream()
        op._cuda_events = []
        self._stream.wait_stream(torch.cuda.current_stream())
        views = _mapped_views(op.src, op.dst)
        with torch.cuda.stream(self._stream):
            if views is not None:
                src_idx = torch.as_tensor(op.src_pages).to(self.device, non_blocking=True)
                dst_idx = torch.as_tensor(op.dst_pages).to(self.device, non_blocking=True)
            for layer in range(op.num_layers):
                if views is not None:
                    data = copy_layer_words(views[0](layer), src_idx, views[1](layer), dst_idx)
                else:
                    data = op.src.get_layer(layer, op.src_pages)
                    op.dst.set_layer(layer, op.dst_pages, data)
                ev = torch.cuda.Event()
                ev.record(self._stream)
                op._cuda_events.append(ev)
                self.bytes_moved[op.kind.value] += data.numel() * data.element_size()
                op._finish_layer(layer)

    def close(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            self._work.put((2, 1 << 62, None))
            self._thread.join(timeout=5)
        self._thread = None
