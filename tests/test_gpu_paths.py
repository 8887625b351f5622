"""The CUDA paths of the cache stack (dedicated copy stream, pinned L2, per-layer events).

The same code runs on CPU in the other tests; these check the CUDA specifics where a GPU exists.
"""

import pytest
import torch

from checkers.invariants import assert_healthy
from engine.cache.facade import CacheConfig, HiCache
from tests.factories import serve, tiny_layout

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("host_layout", ["layer_first", "page_first"])
def test_load_back_on_cuda_restores_bytes(host_layout):
    cfg = CacheConfig(page_size=4, l1_tokens=12, l2_tokens=64, layout=tiny_layout(4),
                      host_layout=host_layout, device="cuda")
    c = HiCache(cfg)
    assert c.l1.buf.is_cuda and c.l2.buf.is_pinned()
    a, b = list(range(100, 108)), list(range(200, 208))
    serve(c, a)
    c.wait_all()
    serve(c, b)
    c.wait_all()
    m = serve(c, a + [1, 2, 3, 4])
    assert m.l2_len == 8 and m.loaded_len == 8
    torch.cuda.synchronize()
    c.wait_all()
    assert_healthy(c, idle=True)


def test_copies_run_on_a_side_stream():
    cfg = CacheConfig(page_size=4, l1_tokens=32, l2_tokens=32, layout=tiny_layout(4),
                      device="cuda")
    c = HiCache(cfg)
    serve(c, list(range(16)))
    c.wait_all()
    assert c.transfers._stream is not None
    assert c.transfers._stream != torch.cuda.current_stream()


@pytest.mark.parametrize("mapped", [True, False])
@pytest.mark.parametrize("host_layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("page_size", [4, 16])
def test_transfer_engine_moves_scattered_pages_on_cuda(monkeypatch, mapped, host_layout,
                                                        page_size):
    """Backup then load-back through the engine on CUDA, with L2 mapped into the device's
    address space (kernels move the bytes) and with the mapping refused (staged copies)."""
    import numpy as np

    from engine.cache.pool import DevicePool, HostPool
    from engine.cache.transfer import OpKind, TransferEngine

    if not mapped:
        monkeypatch.setenv("HICACHE_UVA_COPY", "0")
    lay = tiny_layout(page_size)
    l1 = DevicePool(lay, 16, "cuda")
    l2 = HostPool(lay, 24, host_layout, pin=True)
    assert (l2.device_alias() is not None) is mapped
    l1.buf.copy_(torch.randn(l1.buf.shape))
    l2.buf.zero_()
    eng = TransferEngine("cuda")
    src, dst = np.array([15, 2, 7, 3, 11]), np.array([20, 0, 9, 10, 1])
    eng.submit(eng.new_op(OpKind.BACKUP, l1, src, l2, dst, lay.num_layers)).wait()
    for layer in range(lay.num_layers):
        assert torch.equal(l2.get_layer(layer, dst), l1.get_layer(layer, src).cpu())
    assert not l2.get_layer(0, np.array([2, 3, 23])).any()
    back = np.array([4, 5, 6, 12, 13])
    op = eng.submit(eng.new_op(OpKind.LOAD, l2, dst, l1, back, lay.num_layers))
    for layer in range(lay.num_layers):
        op.wait_layer(layer)
        assert torch.equal(l1.get_layer(layer, back), l1.get_layer(layer, src))
    assert eng.bytes_moved["backup"] == eng.bytes_moved["load"] > 0
    eng.close()
