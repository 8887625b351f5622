import numpy as np
import pytest
import torch

from engine.cache.allocator import PageAllocator
from engine.cache.pool import DevicePool, HostPool
from engine.core.errors import OutOfCapacity
from engine.core.layout import KVLayout


def test_allocator_exact_accounting():
    a = PageAllocator(5, page_size=4)
    p1 = a.alloc(2)
    assert p1.tolist() == [0, 1] and a.free_pages == 3 and a.used_pages == 2
    p2 = a.alloc(3)
    assert sorted(p2.tolist()) == [2, 3, 4]
    with pytest.raises(OutOfCapacity):
        a.alloc(1)
    a.free(p1)
    assert a.free_pages == 2
    assert sorted(a.alloc(2).tolist()) == [0, 1]
    assert a.slots(np.array([1, 3])).tolist() == [4, 5, 6, 7, 12, 13, 14, 15]


def test_allocator_rejects_double_and_foreign_free():
    a = PageAllocator(4, page_size=1)
    p = a.alloc(2)
    a.free(p[:1])
    with pytest.raises(AssertionError):
        a.free(p[:1])
    with pytest.raises(AssertionError):
        a.free(np.array([3]))
    with pytest.raises(AssertionError):
        a.free(np.array([p[1], p[1]]))


@pytest.mark.parametrize("host_layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("kv_kinds", [1, 2])
def test_device_host_round_trip(host_layout, kv_kinds):
    lay = KVLayout(num_layers=3, kv_heads=2, head_dim=5, page_size=4, kv_kinds=kv_kinds)
    dev = DevicePool(lay, 6)
    dev.buf.normal_()
    host = HostPool(lay, 6, host_layout)
    src, dst = np.array([4, 1, 2]), np.array([0, 5, 3])
    for layer in range(3):
        host.set_layer(layer, dst, dev.get_layer(layer, src))
    back = DevicePool(lay, 6)
    for layer in range(3):
        back.set_layer(layer, src, host.get_layer(layer, dst))
    slots = torch.as_tensor(dev.slots(src))
    assert torch.equal(back.buf[:, :, slots], dev.buf[:, :, slots])
    page = host.get_page(5)
    assert page.shape == (3, kv_kinds, 4, 2, 5)
    assert torch.equal(page, dev.buf[:, :, torch.as_tensor(dev.slots(np.array([1])))])


def test_layout_validation_and_sizes():
    lay = KVLayout(num_layers=2, kv_heads=4, head_dim=8, page_size=16, dtype="float16")
    assert lay.page_bytes == 16 * 2 * 2 * 4 * 8 * 2
    assert KVLayout.from_dict(lay.to_dict()) == lay
    with pytest.raises(ValueError):
        KVLayout(num_layers=0, kv_heads=1, head_dim=1, page_size=1)
    with pytest.raises(ValueError):
        KVLayout(num_layers=1, kv_heads=1, head_dim=1, page_size=1, dtype="int3")
