"""The word views and the gather/scatter the CUDA transfer path runs (engine/cache/transfer.py
``copy_layer_words``), checked here on host tensors: the same views and kernels, only the
device differs (tests/test_gpu_paths.py runs them on a GPU with L2 mapped into its address
space)."""

import numpy as np
import pytest
import torch

from engine.cache.pool import DevicePool, HostPool, _word_dtype
from engine.cache.transfer import _mapped_views, copy_layer_words
from engine.core.layout import KVLayout


def _pools(host_layout, page_size, head_dim, kv_kinds=2, dtype="bfloat16"):
    lay = KVLayout(num_layers=3, kv_heads=2, head_dim=head_dim, page_size=page_size,
                   kv_kinds=kv_kinds, dtype=dtype)
    l1, l2 = DevicePool(lay, 10), HostPool(lay, 12, host_layout)
    g = torch.Generator().manual_seed(0)
    l1.buf.copy_(torch.randn(l1.buf.shape, generator=g))
    l2.buf.copy_(torch.randn(l2.buf.shape, generator=g))
    return lay, l1, l2


@pytest.mark.parametrize("chunk, want", [(64, torch.int64), (12, torch.int32), (6, torch.int16),
                                         (3, torch.uint8), (4096, torch.int64)])
def test_word_type_divides_a_chunk(chunk, want):
    assert _word_dtype(chunk) is want


@pytest.mark.parametrize("host_layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("page_size, head_dim", [(4, 8), (16, 3), (1, 1)])
def test_layer_words_are_views_of_the_pages(host_layout, page_size, head_dim):
    lay, l1, l2 = _pools(host_layout, page_size, head_dim)
    pages = np.array([7, 0, 11, 3])
    for layer in range(lay.num_layers):
        for pool in (l1, l2):
            if pool is l1 and pages.max() >= l1.num_pages:
                continue
            w = pool.layer_words(layer)
            assert w.shape[:2] == (lay.kv_kinds, pool.num_pages)
            got = w[:, torch.as_tensor(pages)].reshape(-1).view(torch.uint8)
            ref = pool.get_layer(layer, pages).reshape(-1).view(torch.uint8)
            assert torch.equal(got, ref)
            assert w.untyped_storage().data_ptr() == pool.buf.untyped_storage().data_ptr()


@pytest.mark.parametrize("host_layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("page_size, head_dim, kinds", [(4, 8, 2), (16, 3, 2), (2, 5, 1)])
def test_gather_scatter_moves_the_pages_both_ways(host_layout, page_size, head_dim, kinds):
    lay, l1, l2 = _pools(host_layout, page_size, head_dim, kv_kinds=kinds)
    l1_pages, l2_pages = np.array([9, 2, 5, 0]), np.array([1, 11, 6, 8])
    before_l1, before_l2 = l1.buf.clone(), l2.buf.clone()
    for layer in range(lay.num_layers):         # backup: L1 -> L2
        data = copy_layer_words(l1.layer_words(layer), torch.as_tensor(l1_pages),
                                l2.layer_words(layer), torch.as_tensor(l2_pages))
        assert data.numel() * data.element_size() == \
            lay.kv_kinds * len(l1_pages) * page_size * lay.kv_heads * head_dim * 2
    assert torch.equal(l1.buf, before_l1)
    for layer in range(lay.num_layers):
        assert torch.equal(l2.get_layer(layer, l2_pages), l1.get_layer(layer, l1_pages))
    untouched = np.setdiff1d(np.arange(l2.num_pages), l2_pages)
    for layer in range(lay.num_layers):
        ref = HostPool.get_layer(l2, layer, untouched)
        l2.buf, saved = before_l2, l2.buf
        assert torch.equal(ref, l2.get_layer(layer, untouched))
        l2.buf = saved
    l1.buf.zero_()
    for layer in range(lay.num_layers):         # load: L2 -> L1, other pages
        copy_layer_words(l2.layer_words(layer), torch.as_tensor(l2_pages[::-1].copy()),
                         l1.layer_words(layer), torch.as_tensor(np.array([3, 4, 7, 1])))
    for layer in range(lay.num_layers):
        assert torch.equal(l1.get_layer(layer, np.array([3, 4, 7, 1])),
                           l2.get_layer(layer, l2_pages[::-1].copy()))
        assert not l1.get_layer(layer, np.array([0, 2])).any()


def test_host_only_pools_do_not_take_the_mapped_path():
    _, l1, l2 = _pools("layer_first", 4, 8)
    assert l2.device_alias() is None            # not pinned, no CUDA: nothing to map
    assert _mapped_views(l1, l2) is None and _mapped_views(l2, l1) is None
