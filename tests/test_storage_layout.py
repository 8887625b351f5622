"""The unified layout across TP/PP shapes, on every backend (memory, file, a real Mooncake Store).

Deployment shapes are simulated by the shard each rank's pool holds (``KVLayout.shard``): every
rank is an ``L3Store`` over its own shard of the same model, sharing one backend. The bytes a
reader assembles are compared with the whole-model reference page they came from.
"""

from __future__ import annotations

import uuid

import numpy as np
import pytest
import torch

from engine.cache.pool import HostPool
from engine.core.hashing import namespace_seed, page_hashes
from engine.core.layout import KVLayout, pp_layer_range, tp_head_range
from engine.storage import L3Store
from engine.storage.keys import object_key
from engine.storage.placement import Grid, Placement, StorageLayout, describe_object

MODEL = KVLayout(num_layers=4, kv_heads=4, head_dim=8, page_size=4)
MLA = KVLayout(num_layers=4, kv_heads=1, head_dim=16, page_size=4, kv_kinds=1)
PAGES = 5
GRID_TP4_PP2 = Placement(grid="tp=4,pp=2")       # cells: 2 layers x 1 kv-head


def chain(model: KVLayout, n: int = PAGES):
    return page_hashes(np.arange(n * model.page_size), model.page_size,
                       seed=namespace_seed(uuid.uuid4().hex))


def reference(model: KVLayout, n: int = PAGES) -> torch.Tensor:
    """``[pages, layers, kv_kinds, page_size, kv_heads, head_dim]`` of the whole model."""
    g = torch.Generator().manual_seed(7)
    return torch.randn((n, model.num_layers, model.kv_kinds, model.page_size, model.kv_heads,
                        model.head_dim), generator=g)


def page_view(pool: HostPool, p: int) -> torch.Tensor:
    if pool.host_layout.value == "page_first":
        return pool.buf[p]
    P = pool.layout.page_size
    return pool.buf[:, :, p * P:(p + 1) * P]


def cut(ref: torch.Tensor, shard: KVLayout) -> torch.Tensor:
    l0, h0 = shard.layer_start, shard.head_start
    return ref[:, l0:l0 + shard.num_layers, :, :, h0:h0 + shard.kv_heads]


def writer_pool(ref: torch.Tensor, shard: KVLayout, host_layout="page_first") -> HostPool:
    pool = HostPool(shard, PAGES, host_layout=host_layout)
    part = cut(ref, shard)
    for p in range(PAGES):
        page_view(pool, p).copy_(part[p])
    return pool


def write_shape(backend, ref, model, placement, tp, pp, hs) -> None:
    for t in range(tp):
        for s in range(pp):
            shard = model.shard(tp, t, pp, s)
            st = L3Store(backend, shard, placement=placement)
            assert st.put_pages(hs, writer_pool(ref, shard), list(range(PAGES))) == PAGES
            st.close(close_backend=False)


def read_shape(backend, ref, model, placement, tp, pp, hs, host_layout="page_first") -> list:
    """Every rank of a (tp, pp) reader: (pages loaded, objects per page) per rank; asserts the
    loaded bytes equal the reference."""
    out = []
    for t in range(tp):
        for s in range(pp):
            shard = model.shard(tp, t, pp, s)
            st = L3Store(backend, shard, placement=placement, read_only=True)
            pool = HostPool(shard, PAGES, host_layout=host_layout)
            n = st.get_pages(hs, pool, list(range(PAGES)))
            want = cut(ref, shard)
            for p in range(n):
                assert torch.equal(page_view(pool, p), want[p]), (t, s, p)
            out.append((n, st.n_parts))
            st.close(close_backend=False)
    return out


def test_shards_of_the_whole_model():
    assert [pp_layer_range(7, 2, r) for r in range(2)] == [(0, 4), (4, 7)]
    assert [tp_head_range(4, 8, r) for r in range(8)] == [(h, h + 1) for h in range(4)
                                                         for _ in range(2)]
    s = MODEL.shard(tp=2, tp_rank=1, pp=2, pp_rank=1)
    assert (s.layer_start, s.num_layers, s.head_start, s.kv_heads) == (2, 2, 2, 2)
    assert (s.total_layers, s.total_kv_heads) == (4, 4)
    with pytest.raises(ValueError, match="cannot be split"):
        MODEL.shard(tp=3)


@pytest.mark.parametrize("host_layout", ["page_first", "layer_first"])
def test_tp4_pp2_writer_tp2_pp1_reader(backend, host_layout):
    ref, hs = reference(MODEL), chain(MODEL)
    write_shape(backend, ref, MODEL, GRID_TP4_PP2, 4, 2, hs)
    every = GRID_TP4_PP2.all_tiles(MODEL)
    assert len(every) == 8                                  # 8 objects per page
    assert all(backend.exists([object_key(h, t.suffix) for h in hs for t in every]))
    got = read_shape(backend, ref, MODEL, GRID_TP4_PP2, 2, 1, hs, host_layout)
    assert got == [(PAGES, 4), (PAGES, 4)]                  # each assembled from 4 objects


def test_tp1_writer_tp4_pp2_readers_and_the_reverse(backend):
    ref, hs = reference(MODEL), chain(MODEL)
    write_shape(backend, ref, MODEL, GRID_TP4_PP2, 1, 1, hs)
    assert read_shape(backend, ref, MODEL, GRID_TP4_PP2, 4, 2, hs) == [(PAGES, 1)] * 8
    ref2, hs2 = reference(MODEL) * 2, chain(MODEL)
    write_shape(backend, ref2, MODEL, GRID_TP4_PP2, 2, 2, hs2)
    assert read_shape(backend, ref2, MODEL, GRID_TP4_PP2, 1, 1, hs2, "layer_first") == \
        [(PAGES, 8)]


def test_default_grid_serves_tp2_writer_and_tp1_reader(backend):
    ref, hs = reference(MODEL), chain(MODEL)
    write_shape(backend, ref, MODEL, Placement(), 2, 1, hs)
    assert read_shape(backend, ref, MODEL, Placement(), 1, 1, hs) == [(PAGES, 8)]


def test_reader_cutting_through_objects_reads_and_slices(backend):
    coarse = Placement(grid="layers=4,heads=2")            # one object per pair of heads
    ref, hs = reference(MODEL), chain(MODEL)
    write_shape(backend, ref, MODEL, coarse, 2, 1, hs)
    # TP4 ranks hold one head each: each reads the 2-head object covering it and keeps half.
    assert read_shape(backend, ref, MODEL, coarse, 4, 1, hs) == [(PAGES, 1)] * 4
    # ...but may not write it: it does not hold the other head.
    with pytest.raises(ValueError, match="cuts the storage grid"):
        L3Store(backend, MODEL.shard(tp=4, tp_rank=1), placement=coarse)


def test_a_page_needs_every_object_that_covers_the_shard(backend):
    ref, hs = reference(MODEL), chain(MODEL)
    write_shape(backend, ref, MODEL, GRID_TP4_PP2, 4, 2, hs)
    lost = GRID_TP4_PP2.all_tiles(MODEL)[5]                 # layers 2-4, head 1
    backend.delete([object_key(hs[2], lost.suffix)])
    st = L3Store(backend, MODEL, placement=GRID_TP4_PP2, read_only=True)
    assert st.exists_prefix(hs) == 2
    assert st.get_pages(hs, HostPool(MODEL, PAGES), list(range(PAGES))) == 2
    # A shard that does not need the lost object still reads everything.
    assert read_shape(backend, ref, MODEL, GRID_TP4_PP2, 2, 1, hs) == [(2, 4), (PAGES, 4)]


def test_other_grids_miss_instead_of_colliding(backend):
    ref, hs = reference(MODEL), chain(MODEL)
    write_shape(backend, ref, MODEL, GRID_TP4_PP2, 1, 1, hs)
    other = L3Store(backend, MODEL, placement=Placement(grid="layers=2,heads=2"))
    assert other.exists_prefix(hs) == 0
    assert GRID_TP4_PP2.namespace(MODEL) != Placement(grid="layers=2,heads=2").namespace(MODEL)
    assert GRID_TP4_PP2.namespace(MODEL) != GRID_TP4_PP2.namespace(MODEL, "another-model")


def test_mla_uses_the_layer_axis_only(backend):
    ref, hs = reference(MLA), chain(MLA)
    pl = Placement(grid="pp=2")
    tiles = pl.all_tiles(MLA)
    assert [t.layers for t in tiles] == [(0, 2), (2, 4)]
    assert all(".h" not in t.suffix for t in tiles)
    write_shape(backend, ref, MLA, pl, 1, 2, hs)
    assert read_shape(backend, ref, MLA, pl, 1, 1, hs) == [(PAGES, 2)]
    assert read_shape(backend, ref, MLA, pl, 2, 1, hs) == [(PAGES, 2), (PAGES, 2)]


def test_legacy_layout_keys_carry_the_rank(backend):
    ref, hs = reference(MODEL), chain(MODEL)
    legacy = [Placement(StorageLayout.LEGACY, tp=(r, 2)) for r in range(2)]
    for r, pl in enumerate(legacy):
        shard = MODEL.shard(tp=2, tp_rank=r)
        st = L3Store(backend, shard, placement=pl)
        assert st.keys(hs[:1])[0].endswith(".tp%dof2.pp0of1" % r)
        assert st.put_pages(hs, writer_pool(ref, shard), list(range(PAGES))) == PAGES
    # The same rank reads its shard back; a unified reader of any shape misses.
    shard1 = MODEL.shard(tp=2, tp_rank=1)
    st = L3Store(backend, shard1, placement=legacy[1])
    pool = HostPool(shard1, PAGES)
    assert st.get_pages(hs, pool, list(range(PAGES))) == PAGES
    assert torch.equal(page_view(pool, 3), cut(ref, shard1)[3])
    assert L3Store(backend, MODEL, read_only=True).exists_prefix(hs) == 0
    with pytest.raises(ValueError, match="legacy layout: rank tp 0/2"):
        L3Store(backend, shard1, placement=legacy[0])


def test_headers_describe_where_the_object_sits():
    t = GRID_TP4_PP2.all_tiles(MODEL, "m")[3]
    region, placement, tag = describe_object(t.description)
    assert (region.layer_start, region.num_layers, region.head_start, region.kv_heads) == \
        (0, 2, 3, 1)
    assert placement.namespace(MODEL, tag) == GRID_TP4_PP2.namespace(MODEL, "m")
    assert Grid.parse("tp=4,pp=2", MODEL) == Grid(2, 1)
    for bad in ("layers=0", "rows=2", "tp=2,layers=2", "layers=x"):
        with pytest.raises(ValueError):
            Grid.parse(bad, MODEL)
