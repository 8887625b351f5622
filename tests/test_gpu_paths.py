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
