"""KV pools: the bytes and layout of one tier.

* :class:`DevicePool` (L1): ``[layers][K,V][slots, kv_heads, head_dim]`` on the chosen device
  (``cuda`` when present, else ``cpu``), stored as one tensor ``buf`` of shape
  ``[layers, kv_kinds, slots, kv_heads, head_dim]``.
* :class:`HostPool` (L2): pinned host memory on CUDA; two layouts —
  ``layer_first`` (same shape as the device pool) and ``page_first``
  (``[pages, layers, kv_kinds, page_size, kv_heads, head_dim]``: one page is contiguous, the
  shape L3 objects want).

Pools hold bytes only; which pages are free is the allocator's business, what they mean is the
tree's. Every accessor works on page ids.
"""

from __future__ import annotations

import ctypes
import logging
import os

import numpy as np
import torch

from engine.cache.allocator import PageAllocator
from engine.cache.types import HostLayout  # noqa: F401 (re-exported; defined without torch)
from engine.core.layout import KVLayout


def _index(pages: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.as_tensor(np.asarray(pages, dtype=np.int64), device=device)


_HUGE = 2 << 20
_MADV_HUGEPAGE = 14


def _host_buffer(shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """A zeroed host tensor on 2 MiB-aligned memory advised for transparent huge pages
    (Linux ``madvise``; a hint the kernel may ignore). Scattered page copies touch a new 4 KiB
    page every few KiB; with huge pages they stop paying a TLB miss for each."""
    elem = torch.tensor([], dtype=dtype).element_size()
    nbytes = elem * int(np.prod(shape))
    if nbytes < _HUGE:
        return torch.zeros(shape, dtype=dtype)
    raw = torch.empty(nbytes + _HUGE, dtype=torch.uint8)
    off = (-raw.data_ptr()) % _HUGE
    mem = raw[off:off + nbytes]
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise(ctypes.c_void_p(mem.data_ptr()), ctypes.c_size_t(nbytes),
                     _MADV_HUGEPAGE)                # failure only loses the hint
    except (OSError, AttributeError):
        pass
    mem.zero_()
    return mem.view(dtype).view(shape)


def _word_dtype(chunk_bytes: int) -> torch.dtype:
    """The widest integer type a (page, layer, kind) chunk is a whole number of: copies move
    words of it (fewer, wider accesses; the bytes are the same whatever the KV dtype)."""
    for nbytes, dtype in ((8, torch.int64), (4, torch.int32), (2, torch.int16)):
        if chunk_bytes % nbytes == 0:
            return dtype
    return torch.uint8


def _words(buf: torch.Tensor, lay: KVLayout, shape: tuple) -> torch.Tensor:
    """``buf``'s bytes as ``shape`` (its last axis: the words of one chunk)."""
    chunk = _chunk_bytes(lay, buf.element_size())
    return buf.reshape(-1).view(torch.uint8).view(_word_dtype(chunk)).view(shape)


class _CudaArray:
    """Describes pinned host memory to torch as CUDA memory (``__cuda_array_interface__``):
    with unified addressing a kernel reads and writes it in place over the bus."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1",
                                         "data": (ptr, False), "strides": None, "version": 2}


def _chunk_bytes(layout: KVLayout, elem: int) -> int:
    """Bytes of one (page, layer, kind) chunk: ``page_size`` tokens of one K or V."""
    return layout.page_size * layout.kv_heads * layout.head_dim * elem



class DevicePool:
    """L1: KV the attention kernels read directly, through a page table."""

    def __init__(self, layout: KVLayout, num_pages: int, device: str = "cpu"):
        self.layout = layout
        self.num_pages = num_pages
        self.device = torch.device(device)
        self.allocator = PageAllocator(num_pages, layout.page_size, name="L1")
        shape = (layout.num_layers, layout.kv_kinds, num_pages * layout.page_size,
                 layout.kv_heads, layout.head_dim)
        self.buf = (_host_buffer(shape, layout.torch_dtype) if self.device.type == "cpu"
                    else torch.zeros(shape, dtype=layout.torch_dtype, device=self.device))

    # Views the model uses ---------------------------------------------------------------
    def k(self, layer: int) -> torch.Tensor:
        return self.buf[layer, 0]

    def v(self, layer: int) -> torch.Tensor:
        return self.buf[layer, 1 if self.layout.kv_kinds == 2 else 0]

    def slots(self, pages: np.ndarray) -> np.ndarray:
        return self.allocator.slots(pages)

    def copy_slots(self, src_page: int, dst_page: int, n: int) -> None:
        """Copy the KV of the first ``n`` token slots of page ``src_page`` into the first ``n``
        slots of page ``dst_page``: slots ``src_page * page_size + [0, n)`` to
        ``dst_page * page_size + [0, n)`` of ``buf``, in every layer (a packed draft's layers
        included: they are layers of this buffer), every kv kind and every head.

        This is the copy of admission's partial last-page reuse (``HiCache.admit``): a request
        whose next ``n`` tokens are the first ``n`` tokens of a cached page starts its first own
        page with their KV instead of computing it. ``0 <= n <= page_size`` (``n == 0`` copies
        nothing); the pages must be two different pages of this pool. The copy runs on the
        pool's device at once — on CUDA in the current stream, so a later forward on that stream
        and any transfer submitted later (its stream waits on the current one) are ordered after
        it; on CPU it is done when this returns."""
        ps = self.layout.page_size
        src_page, dst_page, n = int(src_page), int(dst_page), int(n)
        if not 0 <= n <= ps:
            raise ValueError(f"copy_slots: n must be in [0, {ps}], got {n}")
        for name, page in (("src_page", src_page), ("dst_page", dst_page)):
            if not 0 <= page < self.num_pages:
                raise ValueError(f"copy_slots: {name} {page} outside [0, {self.num_pages})")
        if n == 0:
            return
        if src_page == dst_page:
            raise ValueError(f"copy_slots: source and destination are the same page {src_page}")
        s, d = src_page * ps, dst_page * ps
        self.buf[:, :, d:d + n].copy_(self.buf[:, :, s:s + n])

    # Page-granular access for transfers ------------------------------------------------
    def get_layer(self, layer: int, pages: np.ndarray) -> torch.Tensor:
        """``[kv_kinds, n_pages * page_size, kv_heads, head_dim]`` of ``pages`` in one layer."""
        idx = _index(self.slots(pages), self.device)
        return self.buf[layer].index_select(1, idx)

    def set_layer(self, layer: int, pages: np.ndarray, data: torch.Tensor) -> None:
        idx = _index(self.slots(pages), self.device)
        self.buf[layer].index_copy_(1, idx, data.to(self.device, non_blocking=True))

    @property
    def chunk_bytes(self) -> int:
        """Bytes of one (page, layer, kind) chunk, the unit :meth:`chunk_offsets` locates."""
        return _chunk_bytes(self.layout, self.buf.element_size())

    def layer_words(self, layer: int) -> torch.Tensor:
        """One layer as ``[kv_kinds, pages, words of a chunk]`` (a view of ``buf``): page ids
        index axis 1."""
        lay = self.layout
        return _words(self.buf, lay, (lay.num_layers, lay.kv_kinds, self.num_pages, -1))[layer]

    def chunk_offsets(self, layer: int, pages: np.ndarray) -> np.ndarray:
        """Byte offsets in ``buf`` of each (kind, page) chunk of one layer: ``[kinds, n]``."""
        return _layer_major_offsets(self.layout, self.num_pages, self.buf.element_size(),
                                    layer, pages)


def _layer_major_offsets(lay: KVLayout, num_pages: int, elem: int, layer: int,
                         pages: np.ndarray) -> np.ndarray:
    """``[layers, kinds, pages * page_size, heads, dim]``: a page of one (layer, kind) is one
    chunk, and consecutive pages are adjacent."""
    chunk = _chunk_bytes(lay, elem)
    kinds = np.arange(lay.kv_kinds, dtype=np.int64)[:, None]
    pages = np.asarray(pages, dtype=np.int64)[None, :]
    return ((layer * lay.kv_kinds + kinds) * num_pages + pages) * chunk


class HostPool:
    """L2: a host-memory copy of pages, pinned when CUDA is in use."""

    def __init__(self, layout: KVLayout, num_pages: int,
                 host_layout: "HostLayout | str" = HostLayout.LAYER_FIRST, pin: bool = False):
        self.layout = layout
        self.num_pages = num_pages
        self.host_layout = HostLayout.parse(host_layout)
        self.allocator = PageAllocator(num_pages, layout.page_size, name="L2")
        L, K, P, H, D = (layout.num_layers, layout.kv_kinds, layout.page_size,
                         layout.kv_heads, layout.head_dim)
        shape: tuple[int, ...]
        if self.host_layout is HostLayout.LAYER_FIRST:
            shape = (L, K, num_pages * P, H, D)
        else:
            shape = (num_pages, L, K, P, H, D)
        self.buf = (torch.zeros(shape, dtype=layout.torch_dtype, pin_memory=True) if pin
                    else _host_buffer(shape, layout.torch_dtype))
        # Bumped whenever a page is (about to be) overwritten: whatever was derived from its
        # bytes (an L3 object checksum) is valid only for the generation it was computed at.
        self.write_gen = np.zeros(num_pages, dtype=np.int64)
        self._write_listeners: list = []
        self._alias: torch.Tensor | None = None
        self._alias_tried = False

    # Write tracking -----------------------------------------------------------------------
    def mark_written(self, pages: np.ndarray) -> None:
        """``pages`` are being overwritten: derived data of their old bytes is stale."""
        self.write_gen[np.asarray(pages, dtype=np.int64)] += 1

    def add_write_listener(self, fn) -> None:
        """``fn(pages)`` is called once new bytes have landed in ``pages`` (CPU transfers)."""
        if fn not in self._write_listeners:
            self._write_listeners.append(fn)

    def pages_written(self, pages: np.ndarray) -> None:
        for fn in list(self._write_listeners):
            fn(pages)

    def device_alias(self) -> torch.Tensor | None:
        """``buf`` as a CUDA tensor over the same (pinned) bytes, so GPU kernels copy pages
        between it and L1 directly, none staged; ``None`` where that is not possible (not
        pinned, no CUDA, the driver refuses the pointer, or ``HICACHE_UVA_COPY=0``)."""
        if not self._alias_tried:
            self._alias_tried = True
            self._alias = _pinned_alias(self.buf)
        return self._alias

    def layer_words(self, layer: int, base: torch.Tensor | None = None) -> torch.Tensor:
        """One layer as ``[kv_kinds, pages, words of a chunk]``, like
        :meth:`DevicePool.layer_words`, over ``base`` (default ``buf``; or its
        :meth:`device_alias`). A strided view in ``page_first``."""
        lay = self.layout
        base = self.buf if base is None else base
        if self.host_layout is HostLayout.LAYER_FIRST:
            return _words(base, lay, (lay.num_layers, lay.kv_kinds, self.num_pages, -1))[layer]
        words = _words(base, lay, (self.num_pages, lay.num_layers, lay.kv_kinds, -1))
        return words[:, layer].transpose(0, 1)

    def get_layer(self, layer: int, pages: np.ndarray) -> torch.Tensor:
        """Same shape as :meth:`DevicePool.get_layer`, whatever the host layout."""
        lay = self.layout
        if self.host_layout is HostLayout.LAYER_FIRST:
            idx = _index(self.allocator.slots(pages), torch.device("cpu"))
            return self.buf[layer].index_select(1, idx)
        idx = _index(pages, torch.device("cpu"))
        sel = self.buf.index_select(0, idx)[:, layer]          # [n, K, P, H, D]
        return sel.permute(1, 0, 2, 3, 4).reshape(lay.kv_kinds, -1, lay.kv_heads, lay.head_dim)

    def set_layer(self, layer: int, pages: np.ndarray, data: torch.Tensor) -> None:
        lay = self.layout
        self.mark_written(pages)
        data = data.to("cpu")
        if self.host_layout is HostLayout.LAYER_FIRST:
            idx = _index(self.allocator.slots(pages), torch.device("cpu"))
            self.buf[layer].index_copy_(1, idx, data)
            return
        n = len(pages)
        view = data.reshape(lay.kv_kinds, n, lay.page_size, lay.kv_heads, lay.head_dim)
        self.buf[torch.as_tensor(np.asarray(pages, dtype=np.int64)), layer] = \
            view.permute(1, 0, 2, 3, 4)

    @property
    def chunk_bytes(self) -> int:
        """Bytes of one (page, layer, kind) chunk, the unit :meth:`chunk_offsets` locates."""
        return _chunk_bytes(self.layout, self.buf.element_size())

    def chunk_offsets(self, layer: int, pages: np.ndarray) -> np.ndarray:
        """Byte offsets in ``buf`` of each (kind, page) chunk of one layer: ``[kinds, n]``."""
        lay = self.layout
        elem = self.buf.element_size()
        if self.host_layout is HostLayout.LAYER_FIRST:
            return _layer_major_offsets(lay, self.num_pages, elem, layer, pages)
        chunk = _chunk_bytes(lay, elem)
        kinds = np.arange(lay.kv_kinds, dtype=np.int64)[:, None]
        pages = np.asarray(pages, dtype=np.int64)[None, :]
        return ((pages * lay.num_layers + layer) * lay.kv_kinds + kinds) * chunk

    # Whole pages (all layers) for L3 objects ---------------------------------------------
    def get_page(self, page: int) -> torch.Tensor:
        """One page as ``[layers, kv_kinds, page_size, kv_heads, head_dim]`` (contiguous)."""
        lay = self.layout
        if self.host_layout is HostLayout.PAGE_FIRST:
            return self.buf[page]
        s = page * lay.page_size
        return self.buf[:, :, s:s + lay.page_size].contiguous()

    def set_page(self, page: int, data: torch.Tensor) -> None:
        lay = self.layout
        self.mark_written(np.array([page]))
        data = data.reshape(lay.num_layers, lay.kv_kinds, lay.page_size, lay.kv_heads,
                            lay.head_dim)
        if self.host_layout is HostLayout.PAGE_FIRST:
            self.buf[page].copy_(data)
        else:
            s = page * lay.page_size
            self.buf[:, :, s:s + lay.page_size].copy_(data)


def _pinned_alias(buf: torch.Tensor) -> torch.Tensor | None:
    """A CUDA tensor (uint8, flat) over pinned ``buf``'s bytes, checked by reading it back
    once; ``None`` where not possible. See :class:`_CudaArray`."""
    log = logging.getLogger("hicache.transfer")
    if os.environ.get("HICACHE_UVA_COPY", "1") == "0":
        return None
    if buf.device.type != "cpu" or not buf.is_contiguous() or not torch.cuda.is_available() \
            or not buf.is_pinned():
        return None
    nbytes = buf.numel() * buf.element_size()
    try:
        alias = torch.as_tensor(_CudaArray(buf.data_ptr(), nbytes), device="cuda")
        probe = min(nbytes, 4096)
        # through a kernel (not a copy engine), the way the transfers will touch it
        ok = torch.equal(alias[:probe].bitwise_xor(0).cpu(),
                         buf.reshape(-1).view(torch.uint8)[:probe])
    except (RuntimeError, TypeError, ValueError) as exc:
        log.warning("L2 pages copy through staging buffers: pinned memory not mappable (%s)",
                    str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        return None
    if not ok:
        log.warning("L2 pages copy through staging buffers: mapped pinned memory read back "
                    "wrong bytes")
        return None
    return alias
