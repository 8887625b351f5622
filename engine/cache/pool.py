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

import numpy as np
import torch

from engine.cache.allocator import PageAllocator
from engine.cache.types import HostLayout  # noqa: F401 (re-exported; defined without torch)
from engine.core.layout import KVLayout


def _index(pages: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.as_tensor(np.asarray(pages, dtype=np.int64), device=device)


class DevicePool:
    """L1: KV the attention kernels read directly, through a page table."""

    def __init__(self, layout: KVLayout, num_pages: int, device: str = "cpu"):
        self.layout = layout
        self.num_pages = num_pages
        self.device = torch.device(device)
        self.allocator = PageAllocator(num_pages, layout.page_size, name="L1")
        self.buf = torch.zeros(
            (layout.num_layers, layout.kv_kinds, num_pages * layout.page_size,
             layout.kv_heads, layout.head_dim),
            dtype=layout.torch_dtype, device=self.device)

    # Views the model uses ---------------------------------------------------------------
    def k(self, layer: int) -> torch.Tensor:
        return self.buf[layer, 0]

    def v(self, layer: int) -> torch.Tensor:
        return self.buf[layer, 1 if self.layout.kv_kinds == 2 else 0]

    def slots(self, pages: np.ndarray) -> np.ndarray:
        return self.allocator.slots(pages)

    # Page-granular access for transfers ------------------------------------------------
    def get_layer(self, layer: int, pages: np.ndarray) -> torch.Tensor:
        """``[kv_kinds, n_pages * page_size, kv_heads, head_dim]`` of ``pages`` in one layer."""
        idx = _index(self.slots(pages), self.device)
        return self.buf[layer].index_select(1, idx)

    def set_layer(self, layer: int, pages: np.ndarray, data: torch.Tensor) -> None:
        idx = _index(self.slots(pages), self.device)
        self.buf[layer].index_copy_(1, idx, data.to(self.device, non_blocking=True))


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
        if self.host_layout is HostLayout.LAYER_FIRST:
            shape = (L, K, num_pages * P, H, D)
        else:
            shape = (num_pages, L, K, P, H, D)
        self.buf = torch.zeros(shape, dtype=layout.torch_dtype, pin_memory=pin)

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
        data = data.to("cpu")
        if self.host_layout is HostLayout.LAYER_FIRST:
            idx = _index(self.allocator.slots(pages), torch.device("cpu"))
            self.buf[layer].index_copy_(1, idx, data)
            return
        n = len(pages)
        view = data.reshape(lay.kv_kinds, n, lay.page_size, lay.kv_heads, lay.head_dim)
        self.buf[torch.as_tensor(np.asarray(pages, dtype=np.int64)), layer] = \
            view.permute(1, 0, 2, 3, 4)

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
        data = data.reshape(lay.num_layers, lay.kv_kinds, lay.page_size, lay.kv_heads,
                            lay.head_dim)
        if self.host_layout is HostLayout.PAGE_FIRST:
            self.buf[page].copy_(data)
        else:
            s = page * lay.page_size
            self.buf[:, :, s:s + lay.page_size].copy_(data)
