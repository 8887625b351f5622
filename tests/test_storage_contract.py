"""One contract, every backend: memory, file, and a real Mooncake Store (a mooncake_master
started on free 127.0.0.1 ports). Then the page-level L3Store on each, with corruption and
layout-mismatch faults injected through the backend itself."""

from __future__ import annotations

import uuid

import numpy as np
import pytest
import torch

from engine.cache.pool import HostPool
from engine.core.hashing import namespace_seed, page_hashes
from engine.core.layout import KVLayout
from engine.storage import GetStatus, L3Store
from engine.storage.placement import Placement
from formats.kvobject import KVObjectCodec

LAYOUT = KVLayout(num_layers=2, kv_heads=2, head_dim=8, page_size=4)   # 1 KiB pages
ONE_OBJECT = Placement(grid="layers=2,heads=2")   # a page is one object (a 1×1 grid)


def new_key(tag: str = "") -> str:
    return uuid.uuid4().hex + tag


def blob(n: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


# -- the backend protocol ---------------------------------------------------------------------
def test_put_then_get_any_split_of_parts(backend):
    k = new_key()
    data = blob(10_000, 1)
    assert backend.exists([k]) == [False]
    assert backend.put([k], [[data[:100], memoryview(data)[100:]]]) == [True]
    assert backend.exists([k]) == [True]
    a, b, c = bytearray(7), bytearray(3000), np.zeros(6993, dtype=np.uint8)
    assert backend.get([k], [[a, b, c]]) == [10_000]
    assert bytes(a) + bytes(b) + c.tobytes() == data


def test_missing_key_is_a_miss(backend):
    buf = bytearray(16)
    assert backend.get([new_key()], [[buf]]) == [GetStatus.MISS]
    assert backend.exists([new_key(), new_key()]) == [False, False]


def test_sizes_must_match_exactly(backend):
    k = new_key()
    assert backend.put([k], [[blob(100)]]) == [True]
    assert backend.get([k], [[bytearray(99)]]) == [GetStatus.SIZE_MISMATCH]
    assert backend.get([k], [[bytearray(101)]]) == [GetStatus.SIZE_MISMATCH]
    assert backend.get([k], [[bytearray(100)]]) == [100]


def test_clear_removes_every_object(backend):
    keys = [new_key() for _ in range(5)]
    assert backend.put(keys, [[blob(300, i)] for i in range(5)]) == [True] * 5
    assert backend.clear() >= 5
    assert backend.exists(keys) == [False] * 5
    assert backend.get([keys[0]], [[bytearray(300)]]) == [GetStatus.MISS]
    k = new_key()                          # still usable afterwards
    assert backend.put([k], [[blob(50)]]) == [True] and backend.exists([k]) == [True]


def test_existing_key_is_not_rewritten(backend):
    k = new_key()
    assert backend.put([k], [[b"first-version"]]) == [True]
    assert backend.put([k], [[b"other-version"]]) == [True]
    buf = bytearray(13)
    assert backend.get([k], [[buf]]) == [13]
    assert bytes(buf) == b"first-version"


def test_batches_mix_hits_and_misses(backend):
    keys = [new_key() for _ in range(5)]
    assert backend.put(keys[::2], [[blob(64, i)] for i in range(3)]) == [True] * 3
    assert backend.exists(keys) == [True, False, True, False, True]
    bufs = [bytearray(64) for _ in keys]
    assert backend.get(keys, [[b] for b in bufs]) == [64, GetStatus.MISS, 64, GetStatus.MISS, 64]
    assert bytes(bufs[4]) == blob(64, 2)


def test_delete_and_quarantine_take_objects_out(backend):
    k1, k2 = new_key(), new_key()
    backend.put([k1, k2], [[b"aaaa"], [b"bbbb"]])
    assert backend.delete([k1, new_key()]) == 1
    backend.quarantine(k2)
    assert backend.exists([k1, k2]) == [False, False]
    assert backend.get([k2], [[bytearray(4)]]) == [GetStatus.MISS]


def test_registered_memory_round_trip(backend):
    arena = np.zeros(1 << 16, dtype=np.uint8)
    backend.register_memory(arena)
    try:
        k = new_key()
        arena[:4096] = np.frombuffer(blob(4096, 7), dtype=np.uint8)
        assert backend.put([k], [[arena[:96], arena[96:4096]]]) == [True]
        assert backend.get([k], [[arena[8192:12288]]]) == [4096]
        assert np.array_equal(arena[8192:12288], arena[:4096])
    finally:
        backend.unregister_memory(arena)


def test_object_larger_than_any_staging_buffer(backend):
    k = new_key()
    data = blob(9 << 20, 3)   # the mooncake test config stages 8 MiB
    assert backend.put([k], [[data]]) == [True]
    out = bytearray(len(data))
    assert backend.get([k], [[out]]) == [len(data)]
    assert out == data
    backend.delete([k])


@pytest.mark.parametrize("bad", ["../../etc/passwd", "/abs/path", "ab/../../x", "..", "",
                                 "a\x00bcd", "UPPER-case", ".hidden", "x" * 201, "ab\\cd"])
def test_unsafe_keys_are_refused(backend, bad):
    with pytest.raises(ValueError, match="unsafe storage key"):
        backend.put([bad], [[b"data"]])
    with pytest.raises(ValueError, match="unsafe storage key"):
        backend.get([bad], [[bytearray(4)]])
    with pytest.raises(ValueError, match="unsafe storage key"):
        backend.exists([bad])


def test_health_reports_the_backend(backend):
    h = backend.health()
    assert h["backend"] == backend.kind.value
    assert h["healthy"] is True


# -- L3Store on every backend -----------------------------------------------------------------
def make_pool(host_layout: str, pages: int = 8, fill: bool = True, layout=LAYOUT) -> HostPool:
    pool = HostPool(layout, pages, host_layout=host_layout)
    if fill:
        g = torch.Generator().manual_seed(pages)
        pool.buf.copy_(torch.randn(pool.buf.shape, generator=g).to(pool.buf.dtype))
    return pool


def chain(n: int):
    """n page hashes of a fresh chain (a fresh namespace per call, so tests never share)."""
    return page_hashes(np.arange(n * LAYOUT.page_size), LAYOUT.page_size,
                       seed=namespace_seed(uuid.uuid4().hex))


def same_page(a: HostPool, pa: int, b: HostPool, pb: int) -> bool:
    return torch.equal(a.get_page(pa), b.get_page(pb))


@pytest.mark.parametrize("pipeline", [False, True])
@pytest.mark.parametrize("host_layout", ["page_first", "layer_first"])
def test_pages_round_trip(backend, host_layout, pipeline):
    st = L3Store(backend, LAYOUT, batch_pages=3, pipeline=pipeline)     # several batches
    src, dst = make_pool(host_layout), make_pool(host_layout, fill=False)
    hs = chain(7)
    assert st.exists_prefix(hs) == 0
    assert st.put_pages(hs[:4], src, [0, 1, 2, 3]) == 4
    assert st.exists_prefix(hs) == 4
    assert st.put_pages(hs, src, [0, 1, 2, 3, 4, 5, 6]) == 7       # 4 skipped, 3 written
    c = st.counters
    assert (c["puts"], c["put_skipped"]) == (7, 4)
    assert st.get_pages(hs, dst, [7, 6, 5, 4, 3, 2, 1]) == 7
    assert all(same_page(src, i, dst, 7 - i) for i in range(7))
    assert c["hits"] == 7 and c["bytes_read"] == 7 * st.object_size
    st.close(close_backend=False)


def test_get_stops_at_the_first_missing_page(backend):
    st = L3Store(backend, LAYOUT)
    src, dst = make_pool("page_first"), make_pool("page_first", fill=False)
    hs = chain(5)
    st.put_pages([hs[0], hs[1], hs[3]], src, [0, 1, 3])
    assert st.exists_prefix(hs) == 2
    assert st.get_pages(hs, dst, [0, 1, 2, 3, 4]) == 2
    assert st.counters["misses"] == 1
    st.close(close_backend=False)


def test_other_models_never_hit(backend):
    half = KVLayout(num_layers=2, kv_heads=2, head_dim=8, page_size=4, dtype="float16")
    a, b = L3Store(backend, LAYOUT), L3Store(backend, half)
    tagged = L3Store(backend, LAYOUT, model_tag="other-model")
    hs = chain(2)
    a.put_pages(hs, make_pool("page_first"), [0, 1])
    assert b.exists_prefix(hs) == 0 and tagged.exists_prefix(hs) == 0
    assert b.get_pages(hs, make_pool("page_first", layout=half, fill=False), [0, 1]) == 0
    for st in (a, b, tagged):
        st.close(close_backend=False)


def rewrite(backend, key: str, size: int, mutate) -> None:
    """Replace a stored object by a mutated copy of itself, through the backend."""
    buf = bytearray(size)
    assert backend.get([key], [[buf]]) == [size]
    assert backend.delete([key]) == 1
    assert backend.put([key], [[mutate(bytes(buf))]]) == [True]


def flip(at: int):
    return lambda b: b[:at] + bytes([b[at] ^ 0x40]) + b[at + 1:]


@pytest.mark.parametrize("host_layout", ["page_first", "layer_first"])
@pytest.mark.parametrize("where", ["payload", "header", "truncated", "misplaced"])
def test_corrupt_objects_are_counted_and_quarantined(backend, host_layout, where):
    st = L3Store(backend, LAYOUT, placement=ONE_OBJECT)
    src, dst = make_pool(host_layout), make_pool(host_layout, fill=False)
    hs = chain(3)
    assert st.put_pages(hs, src, [0, 1, 2]) == 3
    key = st.keys(hs)[1]
    if where == "payload":
        rewrite(backend, key, st.object_size, flip(st.object_size - 5))
    elif where == "header":
        rewrite(backend, key, st.object_size, flip(30))
    elif where == "truncated":
        rewrite(backend, key, st.object_size, lambda b: b[:-100])
    else:   # page 2's object stored under page 1's key
        other = bytearray(st.object_size)
        backend.get([st.keys(hs)[2]], [[other]])
        rewrite(backend, key, st.object_size, lambda b: bytes(other))
    assert st.get_pages(hs, dst, [0, 1, 2]) == 1
    assert same_page(src, 0, dst, 0)
    assert st.counters["corrupt"] == 1
    assert st.exists_prefix(hs) == 1               # quarantined: out of the store
    st.put_pages(hs, src, [0, 1, 2])               # a fresh backup heals it
    assert st.get_pages(hs, dst, [0, 1, 2]) == 3 and same_page(src, 1, dst, 1)
    st.close(close_backend=False)


def test_layout_mismatch_is_a_warned_miss_never_reinterpreted(backend, caplog):
    st = L3Store(backend, LAYOUT, placement=ONE_OBJECT)
    src = make_pool("page_first")
    dst = make_pool("page_first", fill=False)
    hs = chain(2)
    st.put_pages(hs[:1], src, [0])
    # Same byte size, other dims: only the header can tell them apart.
    foreign = KVLayout(num_layers=2, kv_heads=4, head_dim=4, page_size=4, total_layers=2,
                       total_kv_heads=4)
    codec = KVObjectCodec({**st.codec.layout, **foreign.to_dict()})
    assert codec.header_len == st.codec.header_len
    payload = blob(foreign.page_bytes, 9)
    backend.put([st.keys(hs)[1]], [[codec.encode(hs[1], payload)]])
    with caplog.at_level("WARNING", logger="hicache.storage"):
        assert st.get_pages(hs, dst, [0, 1]) == 1
    assert st.counters["layout_mismatch"] == 1 and st.counters["corrupt"] == 0
    assert "layout mismatch" in caplog.text
    assert st.exists_prefix(hs) == 2               # kept: it is sound, just not ours
    st.close(close_backend=False)


def test_bfloat16_pages_round_trip(backend):
    bf = KVLayout(num_layers=2, kv_heads=2, head_dim=8, page_size=4, dtype="bfloat16")
    st = L3Store(backend, bf)
    src, dst = make_pool("page_first", layout=bf), make_pool("layer_first", layout=bf,
                                                             fill=False)
    hs = page_hashes(np.arange(8), 4, seed=namespace_seed(uuid.uuid4().hex))
    assert st.put_pages(hs, src, [0, 1]) == 2
    assert st.get_pages(hs, dst, [1, 0]) == 2
    assert torch.equal(src.get_page(0), dst.get_page(1))
    st.close(close_backend=False)


def test_page_first_pools_need_no_bounce_copy(backend):
    """Pool pages and headers live in registered memory: nothing goes through staging."""
    st = L3Store(backend, LAYOUT, placement=ONE_OBJECT)
    src, dst = make_pool("page_first"), make_pool("page_first", fill=False)
    before = backend.health().get("staged_bytes", 0)
    hs = chain(4)
    assert st.put_pages(hs, src, [0, 1, 2, 3]) == 4
    assert st.get_pages(hs, dst, [0, 1, 2, 3]) == 4
    assert backend.health().get("staged_bytes", 0) == before
    st.close(close_backend=False)
