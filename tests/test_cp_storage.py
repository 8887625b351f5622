"""L3 with ``--cp``: each CP rank moves only the pages it owns, under the key a single rank
would use, so a store written at ``--cp 2`` serves ``--cp 1`` and the reverse
(docs/parallelism.md, "L3 with --cp")."""

from __future__ import annotations

import json
import os
import shutil
import time

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from engine.cache.pool import HostPool
from engine.parallel.cp import CPShape
from engine.parallel.cp_pool import OwnedPool
from engine.parallel.cp_store import OwnedStore
from engine.runtime.launch import ServerConfig, start_server
from engine.storage.backends.memory import MemoryBackend
from engine.storage.l3store import L3Store
from formats.ranklog import read_ranklog
from hicache_cli.app import app
from tests.factories import STORE_LAYOUT, page_chain
from tests.serve_client import generate

SHAPE = CPShape(2, STORE_LAYOUT.page_size)


def _rank(backend, rank: int, seed: int | None) -> tuple[OwnedStore, OwnedPool]:
    """Rank ``rank``'s store view and its pool of 4 local pages (random bytes from ``seed``)."""
    pool = HostPool(STORE_LAYOUT, 4, host_layout="page_first")
    if seed is not None:
        pool.buf.copy_(torch.randn(pool.buf.shape, generator=torch.Generator().manual_seed(seed)))
    return OwnedStore(L3Store(backend, STORE_LAYOUT), SHAPE, rank), OwnedPool(pool, SHAPE, rank)


def test_each_rank_moves_its_own_pages_under_single_rank_keys():
    backend = MemoryBackend()
    hashes = page_chain(6)
    pages = np.array([4, 1, 2, 7, 0, 5])          # logical pages; owners 0,1,0,1,0,1
    writers = [_rank(backend, r, seed=10 + r) for r in (0, 1)]
    (w0, p0), (w1, p1) = writers
    assert w0.put_pages(hashes, p0, pages) == 6
    assert w0.exists_prefix(hashes) == 1           # rank 0 wrote pages 0, 2, 4 only
    assert w0.stats()["puts"] == 3
    assert w1.put_pages(hashes, p1, pages) == 6
    assert w1.exists_prefix(hashes) == 6           # one object per page, no collisions
    plain = L3Store(backend, STORE_LAYOUT)         # the objects a single rank reads
    whole = HostPool(STORE_LAYOUT, 6, host_layout="page_first")
    assert plain.get_pages(hashes, whole, np.arange(6)) == 6
    for i, page in enumerate(pages.tolist()):      # page i holds its owner's rows
        assert torch.equal(whole.buf[i], writers[page % 2][1].pool.buf[page // 2])
    readers = [_rank(backend, r, seed=None) for r in (0, 1)]
    for r, (reader, pool) in enumerate(readers):
        assert reader.get_pages(hashes, pool, pages) == 6
        mine = pages[pages % 2 == r] // 2
        assert torch.equal(pool.pool.buf[mine], writers[r][1].pool.buf[mine])
        assert reader.stats()["hits"] == 3          # its three pages, nothing else
    # a page of rank 1 missing: rank 1 vouches for the pages before it, rank 0 for all
    backend.delete(plain.keys([hashes[3]]))
    got = [reader.get_pages(hashes, pool, pages) for reader, pool in readers]
    assert got == [6, 3] and min(got) == 3


PROMPTS = [np.random.default_rng(i).integers(0, 256, 200).tolist() for i in range(3)]


def serve(cp: int, store: str | None = None, **kw):
    l3 = {} if store is None else dict(hicache_storage_backend="file", hicache_storage_dir=store)
    kw.setdefault("hicache_storage_prefetch_policy", "wait_complete")
    return start_server(ServerConfig(port=0, l1_tokens=256, l2_tokens=1024, cp=cp, **l3, **kw))


def workload(url: str) -> list:
    """Fresh prompts that cycle the small L1 and L2, then the first again."""
    a, b, c = PROMPTS
    return [generate(url, p) for p in (a, b, c, a)]


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """``--cp 1`` on a fresh store: its outputs, and the store it wrote."""
    store = str(tmp_path_factory.mktemp("cp1-store"))
    h = serve(1, store)
    try:
        return workload(h.url), store
    finally:
        h.stop()


def test_cp2_with_a_store_equals_cp1_and_a_cold_cp2_server_hits_it(one_rank, tmp_path):
    want, cp1_store = one_rank
    store = str(tmp_path / "l3")
    h = serve(2, store)
    try:
        assert [o for o, _ in workload(h.url)] == [o for o, _ in want]
    finally:
        h.stop()
    objects = sorted(os.listdir(store))
    assert objects and objects == sorted(os.listdir(cp1_store))   # the same keys, once each
    logs = tmp_path / "logs"
    h = serve(2, store, rank_log_dir=str(logs))     # cold: the prefix comes from L3
    try:
        out, details = generate(h.url, PROMPTS[0])
    finally:
        h.stop()
    assert out == want[0][0] and details["storage"] > 0, details
    _consistent(logs)


def _consistent(logs) -> None:
    res = CliRunner().invoke(app, ["consensus-check", str(logs), "--format", "json"])
    assert res.exit_code == 0 and json.loads(res.stdout)["consistent"] is True, res.output


@pytest.mark.parametrize("policy", ["best_effort", "timeout"])
def test_prefetches_that_do_not_wait_land_alike_on_every_rank(one_rank, tmp_path, policy):
    """Whether a prefetch is complete when admission looks is a per-rank race; the ranks
    agree on it (and on every count it commits), so their logs match."""
    want, cp1_store = one_rank
    store, logs = str(tmp_path / "l3"), tmp_path / "logs"
    shutil.copytree(cp1_store, store)
    h = serve(2, store, rank_log_dir=str(logs), hicache_storage_prefetch_policy=policy,
              hicache_storage_prefetch_timeout=0.001)
    try:
        got = [generate(h.url, PROMPTS[0]) for _ in range(3)]
    finally:
        h.stop()
    assert all(o == want[0][0] for o, _ in got)
    _consistent(logs)
    for r in (0, 1):          # the L3 path ran: a prefetch issued (and committed) on each rank
        kinds = [(e["kind"], e.get("src")) for e in read_ranklog(logs / f"rank{r}.ranklog")[1]]
        assert ("restore", "l3") in kinds and ("restore_done", None) in kinds


def test_a_memory_store_is_refused():
    res = CliRunner().invoke(app, ["bench", "serve", "--cp", "2", "--hicache-storage-backend",
                                   "memory"])
    assert res.exit_code == 2 and "memory store" in res.output, res.output


@pytest.mark.parametrize("writer", ["tp2xcp2", "cp1"])
def test_tp2xcp2_shares_a_store_with_one_rank(one_rank, tmp_path, writer):
    """``--tp 2 --cp 2``: each rank moves its kv-heads of the pages its CP rank owns; the
    objects are the unified layout's, so one rank reads what the four wrote and the reverse."""
    want, cp1_store = one_rank
    store = str(tmp_path / "l3")
    logs = tmp_path / "logs"
    if writer == "cp1":
        shutil.copytree(cp1_store, store)
        reader = dict(cp=2, tp=2, rank_log_dir=str(logs))
    else:
        h = serve(2, store, tp=2)
        try:
            assert generate(h.url, PROMPTS[0])[0] == want[0][0]
        finally:
            h.stop()
        reader = dict(cp=1)
    h = serve(store=store, **reader)
    try:
        out, details = generate(h.url, PROMPTS[0])
    finally:
        h.stop()
    assert out == want[0][0] and details["storage"] > 0, details
    if writer == "cp1":                 # the four ranks took the same L3 decisions
        assert len(os.listdir(logs)) == 4
        _consistent(logs)


@pytest.mark.parametrize("writer,reader", [(1, 2), (2, 1)])
def test_a_store_written_at_one_cp_size_serves_another(one_rank, tmp_path, writer, reader):
    want, cp1_store = one_rank
    store = str(tmp_path / "l3")
    if writer == 1:
        shutil.copytree(cp1_store, store)
    else:
        h = serve(2, store)
        try:
            generate(h.url, PROMPTS[0])
        finally:
            h.stop()
    h = serve(reader, store)
    try:
        out, details = generate(h.url, PROMPTS[0])
    finally:
        h.stop()
    assert out == want[0][0] and details["storage"] > 0, details


@pytest.mark.mooncake
def test_cp2_and_cp1_share_a_mooncake_store(one_rank, tmp_path):
    """A network store: the CP ranks of a ``--cp 2`` server (two Mooncake clients) write the
    pages they own; a cold ``--cp 1`` server beside it hits them."""
    from tests.mooncake_master import MooncakeMaster

    want, _ = one_rank
    master = MooncakeMaster(tmp_path / "master").start()
    conf = tmp_path / "mooncake.json"
    conf.write_text(json.dumps({"backend": "mooncake", "mooncake": {
        **{k: v for k, v in master.config_dict().items() if k != "device_name"},
        "global_segment_size": "32mb", "local_buffer_size": "16mb"}}))
    common = dict(hicache_storage_backend_config=str(conf))
    try:
        a = serve(2, **common)
        try:
            assert generate(a.url, PROMPTS[0])[0] == want[0][0]
            time.sleep(0.5)                     # write-through reaches the store
            b = serve(1, **common)              # cold L1/L2, same store
            try:
                out, details = generate(b.url, PROMPTS[0])
            finally:
                b.stop()
        finally:
            a.stop()
    finally:
        master.stop()
    assert out == want[0][0] and details["storage"] > 0, details
