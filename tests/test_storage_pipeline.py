"""L3Store's fast paths keep the guarantees: pipelined gets (next batch fetched while this one is
verified) stop at the first bad page and leave the store usable; one existence query per
put_pages call; headers encoded in place equal the reference encoding."""

from __future__ import annotations

import uuid

import numpy as np
import pytest
import torch

from engine.cache.pool import HostPool
from engine.core.hashing import namespace_seed, page_hashes
from engine.core.layout import KVLayout
from engine.storage import L3Store
from engine.storage.backends.memory import MemoryBackend
from engine.storage.placement import Placement
from formats.kvobject import CorruptKVObject, KVObjectCodec

LAYOUT = KVLayout(num_layers=2, kv_heads=2, head_dim=8, page_size=4)   # 1 KiB pages
ONE_OBJECT = Placement(grid="layers=2,heads=2")   # a page is one object (a 1×1 grid)
N = 20


class BatchedMemory(MemoryBackend):
    """The memory store, driven in batches as a network store is; counts existence queries."""

    prefers_batches = True

    def __init__(self):
        super().__init__()
        self.exists_calls = 0

    def exists(self, keys):
        self.exists_calls += 1
        return super().exists(keys)


def pool(fill: bool) -> HostPool:
    p = HostPool(LAYOUT, N, host_layout="page_first")
    if fill:
        p.buf.copy_(torch.randn(p.buf.shape, generator=torch.Generator().manual_seed(1)))
    return p


def chain(n: int):
    return page_hashes(np.arange(n * LAYOUT.page_size), LAYOUT.page_size,
                       seed=namespace_seed(uuid.uuid4().hex))


@pytest.fixture
def setup():
    b = BatchedMemory()
    st = L3Store(b, LAYOUT, placement=ONE_OBJECT, batch_pages=3, get_pipeline=True)
    src, dst = pool(True), pool(False)
    hs = chain(N)
    assert st.put_pages(hs, src, list(range(N))) == N
    yield b, st, src, dst, hs
    st.close()


def test_one_existence_query_per_put(setup):
    b, st, src, _, _ = setup
    assert st.io_batch == 3 and b.exists_calls == 1      # 20 pages in 7 batches, one query
    hs = chain(N)
    assert st.put_pages(hs[:10], src, list(range(10))) == 10
    assert st.put_pages(hs, src, list(range(N))) == N     # 10 skipped, 10 written
    assert b.exists_calls == 3
    assert (st.counters["put_skipped"], st.counters["puts"]) == (10, 2 * N)


@pytest.mark.parametrize("bad", [0, 10, 11, 19])
def test_pipelined_get_stops_at_a_corrupt_page(setup, bad):
    b, st, src, dst, hs = setup
    key = st.keys(hs)[bad]
    obj = bytearray(st.object_size)
    assert b.get([key], [[obj]]) == [st.object_size]
    obj[-3] ^= 0x01                                       # one bit of the payload
    b.delete([key])
    b.put([key], [[bytes(obj)]])
    assert st.get_pages(hs, dst, list(range(N))) == bad
    assert st.counters["corrupt"] == 1 and st.counters["hits"] == bad
    assert torch.equal(src.buf[:bad], dst.buf[:bad])
    assert st.exists_prefix(hs) == bad                    # quarantined
    st.put_pages(hs, src, list(range(N)))                 # healed; the arena is free again
    assert st.get_pages(hs, dst, list(range(N))) == N
    assert torch.equal(src.buf, dst.buf)


def test_pipelined_get_stops_at_a_miss(setup):
    b, st, _, dst, hs = setup
    b.delete([st.keys(hs)[7]])
    assert st.get_pages(hs, dst, list(range(N))) == 7
    assert st.counters["misses"] == 1


def test_header_encoded_in_place_equals_reference():
    codec = KVObjectCodec(LAYOUT.to_dict())
    payload = np.random.default_rng(0).integers(0, 256, LAYOUT.page_bytes, dtype=np.uint8)
    h = bytes(range(32))
    row = np.full(codec.header_len, 0xAB, dtype=np.uint8)     # a dirty arena row
    codec.encode_header_into(row, h, payload)
    assert row.tobytes() == codec.encode_header(h, payload)
    codec.verify(row, payload, h)
    with pytest.raises(ValueError):
        codec.encode_header_into(np.zeros(codec.header_len - 1, np.uint8), h, payload)
    payload[5] ^= 1
    with pytest.raises(CorruptKVObject):
        codec.verify(row, payload, h)
