"""L3 object checksums computed once, when pages land in L2, and still verified on read."""

from __future__ import annotations

import uuid

import numpy as np
import torch

from engine.cache.pool import DevicePool, HostPool
from engine.cache.transfer import OpKind, TransferEngine
from engine.core.hashing import namespace_seed, page_hashes
from engine.core.layout import KVLayout
from engine.storage import L3Store
from engine.storage.backends.memory import MemoryBackend
from engine.storage.placement import Placement

LAYOUT = KVLayout(num_layers=2, kv_heads=2, head_dim=8, page_size=4)
ONE_OBJECT = Placement(grid="layers=2,heads=2")


def setup(n=4):
    store = L3Store(MemoryBackend(), LAYOUT, placement=ONE_OBJECT)
    l2 = HostPool(LAYOUT, n, host_layout="page_first")
    store.bind(l2)
    l1 = DevicePool(LAYOUT, n)
    l1.buf.copy_(torch.randn(l1.buf.shape, generator=torch.Generator().manual_seed(1)))
    eng = TransferEngine("cpu")
    op = eng.submit(eng.new_op(OpKind.BACKUP, l1, np.arange(n), l2, np.arange(n), 2))
    op.wait()
    eng.close()
    hashes = page_hashes(np.arange(n * 4), 4, seed=namespace_seed(uuid.uuid4().hex))
    return store, l2, hashes


def roundtrip(store, l2, hashes):
    n = len(hashes)
    assert store.put_pages(hashes, l2, list(range(n))) == n
    back = HostPool(LAYOUT, n, host_layout="page_first")
    return store.get_pages(hashes, back, list(range(n))), back


def test_backup_into_l2_precomputes_the_checksums_a_put_uses():
    store, l2, hashes = setup()
    assert all(store._known_checksum(p, 0) is not None for p in range(4))
    ok, back = roundtrip(store, l2, hashes)
    assert ok == 4 and torch.equal(back.buf, l2.buf)
    # Pages loaded from L3 were overwritten: their old checksums are gone.
    assert all(store._known_checksum(p, 0) is None for p in range(4))


def test_an_overwritten_page_is_checksummed_again():
    store, l2, hashes = setup()
    l2.set_page(2, torch.ones(l2.buf[2].shape))          # bumps the page's write generation
    assert store._known_checksum(2, 0) is None
    ok, back = roundtrip(store, l2, hashes)
    assert ok == 4 and torch.equal(back.buf[2], torch.ones(l2.buf[2].shape))


def test_bytes_changed_behind_the_pools_back_are_caught_on_read():
    store, l2, hashes = setup()
    l2.buf[1].fill_(3.0)                                  # no set_page: the checksum is stale
    ok, _ = roundtrip(store, l2, hashes)
    assert ok == 1                                        # page 1 fails verification: a miss
    assert store.counters.as_dict()["corrupt"] == 1
