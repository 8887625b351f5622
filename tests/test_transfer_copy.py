"""The direct host-memory page copy (pool to pool, merged runs) moves exactly the right bytes."""

import numpy as np
import pytest
import torch

from engine.cache.pool import DevicePool, HostPool
from engine.cache.transfer import OpKind, TransferEngine, copy_pages_host
from engine.core.layout import KVLayout


def pools(host_layout, kv_kinds, num_pages=12):
    lay = KVLayout(num_layers=3, kv_heads=2, head_dim=4, page_size=4, kv_kinds=kv_kinds,
                   dtype="bfloat16")
    l1 = DevicePool(lay, num_pages)
    l2 = HostPool(lay, num_pages, host_layout)
    torch.manual_seed(0)
    l1.buf.copy_(torch.randn(l1.buf.shape))
    l2.buf.copy_(torch.randn(l2.buf.shape))
    return l1, l2


# Scattered, adjacent on both sides (merged into runs), adjacent on one side only, reversed.
PAGES = [([7, 2, 9], [0, 5, 3]), ([3, 4, 5, 6], [8, 9, 10, 11]), ([1, 2, 3], [9, 4, 6]),
         ([5, 4, 3], [0, 1, 2])]


@pytest.mark.parametrize("host_layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("kv_kinds", [1, 2])
@pytest.mark.parametrize("src_pages,dst_pages", PAGES)
def test_direct_copy_matches_the_gather_scatter_path(host_layout, kv_kinds, src_pages,
                                                     dst_pages):
    l1, l2 = pools(host_layout, kv_kinds)
    src, dst = np.array(src_pages), np.array(dst_pages)
    for a, b in ((l2, l1), (l1, l2)):                  # load-back, then backup
        want = b.buf.clone()
        for layer in range(3):
            before = b.buf.clone()
            b.set_layer(layer, dst, a.get_layer(layer, src))
            want_layer = b.buf.clone()
            b.buf.copy_(before)
            n = copy_pages_host(a, src, b, dst, layer)
            assert torch.equal(b.buf, want_layer), f"layer {layer} differs"
            assert n == len(src) * kv_kinds * 4 * 2 * 4 * 2
        assert not torch.equal(b.buf, want)             # something was copied


def test_engine_uses_the_direct_path_and_counts_bytes():
    l1, l2 = pools("page_first", 2)
    eng = TransferEngine("cpu")
    op = eng.submit(eng.new_op(OpKind.LOAD, l2, np.array([1, 6]), l1, np.array([0, 11]), 3))
    op.wait()
    for layer in range(3):
        assert torch.equal(l1.get_layer(layer, np.array([0, 11])),
                           l2.get_layer(layer, np.array([1, 6])))
    assert eng.bytes_moved["load"] == 3 * 2 * 2 * 4 * 2 * 4 * 2
    eng.close()
