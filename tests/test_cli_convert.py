"""``hicache convert-layout`` through typer's CliRunner, on real file stores and a real Mooncake
Store. Sources are written by L3Stores of simulated TP/PP shapes (each rank's pool holds its
shard); converted stores are read back by L3Stores of other shapes and compared byte for byte
with the whole-model reference."""

from __future__ import annotations

import hashlib
import json
import os
import uuid

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from engine.cache.pool import HostPool
from engine.core.hashing import namespace_seed, page_hashes
from engine.core.layout import KVLayout
from engine.storage import L3Store
from engine.storage.backends.file import FileBackend
from engine.storage.backends.mooncake import MooncakeBackend
from engine.storage.config import FileStoreConfig
from engine.storage.convert import plan, run
from engine.storage.endpoints import open_endpoint
from engine.storage.placement import Placement
from formats.kvobject import parse_header, verify_payload
from hicache_cli.app import app
from tests.mooncake_master import MooncakeMaster

MODEL = KVLayout(num_layers=4, kv_heads=4, head_dim=8, page_size=4)
PAGES = 6
LEGACY2 = [Placement("legacy", tp=(r, 2)) for r in range(2)]
runner = CliRunner()


def chain():
    return page_hashes(np.arange(PAGES * MODEL.page_size), MODEL.page_size,
                       seed=namespace_seed(uuid.uuid4().hex))


REF = torch.randn((PAGES, 4, 2, 4, 4, 8), generator=torch.Generator().manual_seed(3))


def cut(shard: KVLayout) -> torch.Tensor:
    l0, h0 = shard.layer_start, shard.head_start
    return REF[:, l0:l0 + shard.num_layers, :, :, h0:h0 + shard.kv_heads]


def write(backend, hs, placement: Placement, tp: int = 1, pp: int = 1, pages=PAGES) -> None:
    for t in range(tp):
        for s in range(pp):
            shard = MODEL.shard(tp, t, pp, s)
            pl = placement if placement.scheme.value == "unified" else \
                Placement("legacy", tp=(t, tp), pp=(s, pp))
            st = L3Store(backend, shard, placement=pl)
            pool = HostPool(shard, PAGES, host_layout="page_first")
            pool.buf.copy_(cut(shard))
            assert st.put_pages(hs[:pages], pool, list(range(pages))) == pages
            st.close(close_backend=False)


def read(backend, hs, placement: Placement, tp: int = 1, rank: int = 0) -> int:
    """Pages a (tp, rank) reader loads; asserts they equal the reference."""
    shard = MODEL.shard(tp, rank)
    st = L3Store(backend, shard, placement=placement, read_only=True)
    pool = HostPool(shard, PAGES, host_layout="page_first")
    n = st.get_pages(hs, pool, list(range(PAGES)))
    assert torch.equal(pool.buf[:n], cut(shard)[:n])
    st.close(close_backend=False)
    return n


def legacy_source(tmp_path, tp: int = 2):
    src = tmp_path / "src"
    b = FileBackend(FileStoreConfig(dir=str(src)))
    hs = chain()
    write(b, hs, Placement("legacy"), tp=tp)
    b.close()
    return src, hs


def files(root) -> dict[str, tuple[int, int, str]]:
    """Every file of a store with size, mtime and digest (to show a source is untouched)."""
    out = {}
    for d, _, fs in os.walk(root):
        for f in fs:
            p = os.path.join(d, f)
            st = os.stat(p)
            out[p] = (st.st_size, st.st_mtime_ns, hashlib.sha256(open(p, "rb").read())
                      .hexdigest())
    return out


def objects(root) -> list[str]:
    return sorted(f for _, _, fs in os.walk(os.path.join(root, "objects")) for f in fs)


def convert(*args: str):
    return runner.invoke(app, ["convert-layout", *map(str, args)])


def summary(res) -> dict:
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def test_legacy_tp2_to_unified_is_read_by_tp1_and_tp2(tmp_path):
    src, hs = legacy_source(tmp_path)
    before = files(src)
    dst = tmp_path / "dst"
    s = summary(convert(src, dst, "--to", "unified", "--verify", "--format", "json"))
    assert (s["source_layout"], s["target_layout"]) == ("legacy:tp=2,pp=1",
                                                         "unified:layers=2,heads=1")
    assert (s["objects_in"], s["objects_out"], s["written"], s["verified"]) == \
        (12, 48, 48, 48)
    assert s["bytes_written"] == s["bytes_out"] and s["corrupt"] == 0
    assert files(src) == before                         # the source is untouched
    b = FileBackend(FileStoreConfig(dir=str(dst)))
    assert read(b, hs, Placement()) == PAGES            # TP1 reader, default grid
    assert read(b, hs, Placement(), tp=2, rank=1) == PAGES
    b.close()
    again = summary(convert(src, dst, "--format", "json"))       # resumable: nothing to do
    assert (again["written"], again["skipped_present"], again["present"]) == (0, 48, 48)
    gone = objects(dst)[:5]
    for name in gone:
        os.unlink(os.path.join(dst, "objects", name[:2], name))
    third = summary(convert(src, dst, "--format", "json"))
    assert (third["written"], third["skipped_present"]) == (5, 43)


def test_grids_and_payload_orders_round_trip(tmp_path):
    src, hs = legacy_source(tmp_path)
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    summary(convert(src, a, "--to", "unified:layers=4,heads=4", "--format", "json"))
    s = summary(convert(a, b, "--to", "unified:tp=4,pp=2+page_first", "--verify", "--format",
                        "json"))
    assert (s["objects_in"], s["objects_out"]) == (6, 48)
    t = summary(convert(b, c, "--to", "unified:tp=2,pp=1", "--format", "json"))
    assert t["source_layout"] == "unified:layers=2,heads=1+page_first"
    assert t["objects_out"] == 12
    back = FileBackend(FileStoreConfig(dir=str(c)))
    assert read(back, hs, Placement(grid="tp=2,pp=1"), tp=2, rank=0) == PAGES
    assert read(back, hs, Placement(grid="tp=2,pp=1")) == PAGES
    back.close()


def test_unified_to_legacy_and_human_output(tmp_path):
    src = tmp_path / "src"
    b = FileBackend(FileStoreConfig(dir=str(src)))
    hs = chain()
    write(b, hs, Placement(), tp=1)
    b.close()
    res = convert(src, tmp_path / "leg", "--to", "legacy:tp=2,pp=1")
    assert res.exit_code == 0, res.output
    assert "converted: unified:layers=2,heads=1 -> legacy:tp=2,pp=1" in res.stdout
    leg = FileBackend(FileStoreConfig(dir=str(tmp_path / "leg")))
    assert read(leg, hs, LEGACY2[1], tp=2, rank=1) == PAGES
    leg.close()


def test_dry_run_writes_nothing(tmp_path):
    src, _ = legacy_source(tmp_path)
    dst = tmp_path / "never"
    s = summary(convert(src, dst, "--dry-run", "--format", "json"))
    assert s["dry_run"] and (s["objects_in"], s["objects_out"]) == (12, 48)
    assert s["bytes_out"] > s["bytes_in"] > 0          # more, smaller objects: more headers
    assert not dst.exists()
    res = convert(src, dst, "--dry-run")
    assert res.exit_code == 0 and "plan: legacy:tp=2,pp=1 -> unified" in res.stdout


def test_missing_store_and_unknown_shapes(tmp_path):
    res = convert(tmp_path / "nope", tmp_path / "dst")
    assert res.exit_code == 1 and "does not exist" in res.output
    (tmp_path / "plain").mkdir()
    res = convert(tmp_path / "plain", tmp_path / "dst")
    assert res.exit_code == 1 and "not a hicache file store" in res.output
    src, _ = legacy_source(tmp_path)
    for bad in ("diagonal", "unified:rows=2", "legacy:tp=0", "unified+sideways"):
        res = convert(src, tmp_path / "dst", "--to", bad)
        assert res.exit_code == 2, (bad, res.output)
        assert "Traceback" not in res.output
    res = convert(src, "mooncake://nohost", "--dry-run")
    assert res.exit_code == 2 and "mooncake://HOST:PORT" in res.output
    res = convert(src, src)
    assert res.exit_code == 1 and "same store" in res.output


def test_mixed_layouts_need_from(tmp_path):
    src, hs = legacy_source(tmp_path)
    b = FileBackend(FileStoreConfig(dir=str(src)))
    write(b, chain(), Placement(), tp=1, pages=2)        # a second layout in the same store
    b.close()
    res = convert(src, tmp_path / "dst")
    assert res.exit_code == 1 and "mixes 2 layouts" in res.output
    assert not (tmp_path / "dst").exists()
    s = summary(convert(src, tmp_path / "dst", "--from", "legacy:tp=2,pp=1", "--format",
                        "json"))
    assert (s["objects_in"], s["other_layout"], s["written"]) == (12, 16, 48)


def test_conflicting_destination_is_refused(tmp_path):
    src, hs = legacy_source(tmp_path)
    dst = tmp_path / "dst"
    summary(convert(src, dst, "--format", "json"))
    victim = os.path.join(dst, "objects", objects(dst)[7][:2], objects(dst)[7])
    raw = bytearray(open(victim, "rb").read())
    raw[100] ^= 0xFF                                    # a header that is not ours any more
    open(victim, "wb").write(bytes(raw))
    before = files(dst)
    res = convert(src, dst)
    assert res.exit_code == 1 and "conflicting" in res.output
    assert files(dst) == before                          # nothing written


def test_corrupt_source_objects_are_skipped_and_counted(tmp_path):
    src, hs = legacy_source(tmp_path)
    names = objects(src)
    bad_payload = os.path.join(src, "objects", names[0][:2], names[0])
    bad_header = os.path.join(src, "objects", names[3][:2], names[3])
    for path, at in ((bad_payload, -10), (bad_header, 40)):
        raw = bytearray(open(path, "rb").read())
        raw[at] ^= 0x01
        open(path, "wb").write(bytes(raw))
    before = files(src)
    s = summary(convert(src, tmp_path / "dst", "--verify", "--format", "json"))
    assert s["corrupt"] == 1 and s["read_corrupt"] == 1   # header at scan, payload at read
    assert s["incomplete_pages"] == 1                     # the header-damaged page
    assert s["written"] == 48 - 4 - 4                     # each lost shard: 4 cells of its page
    assert files(src) == before
    b = FileBackend(FileStoreConfig(dir=str(tmp_path / "dst")))
    for name in objects(tmp_path / "dst"):               # everything written is sound
        raw = open(os.path.join(tmp_path, "dst", "objects", name[:2], name), "rb").read()
        h = parse_header(raw)
        verify_payload(h, memoryview(raw)[h.header_len:])
    b.close()


@pytest.mark.parametrize("workers", [0, 2])
def test_sources_that_change_size_after_planning_are_skipped(tmp_path, workers):
    """Source objects are mapped, not read: one cut short and one grown since the plan read
    their headers are skipped and counted (never mapped past the end of a file)."""
    src, hs = legacy_source(tmp_path)
    fds = len(os.listdir("/proc/self/fd"))
    s_ep = open_endpoint(str(src), source=True)
    d_ep = open_endpoint(str(tmp_path / "dst"), source=False)
    p = plan(s_ep, d_ep, "unified")
    names = objects(src)
    short, longer, empty = (os.path.join(src, "objects", n[:2], n) for n in names[:3])
    os.truncate(short, os.path.getsize(short) - 100)
    with open(longer, "ab") as f:
        f.write(b"more")
    os.truncate(empty, 0)
    res = run(p, s_ep, d_ep, verify=True, workers=workers)
    s_ep.close()
    d_ep.close()
    assert len(os.listdir("/proc/self/fd")) == fds       # every mapping and file let go
    assert res.counts["read_corrupt"] == 3 and res.counts["not_produced"] == 3 * 4
    assert res.counts["written"] == res.counts["verified"] == 48 - 3 * 4
    assert len(objects(tmp_path / "dst")) == 48 - 3 * 4


def test_no_room_is_refused_up_front(tmp_path):
    src, _ = legacy_source(tmp_path)
    before = files(src)
    res = convert(src, tmp_path / "dst", "--max-bytes", "10k")
    assert res.exit_code == 1 and "room for 10,240 bytes" in res.output
    assert not objects(tmp_path / "dst") and files(src) == before
    assert convert(src, tmp_path / "dst", "--max-bytes", "lots").exit_code == 2


@pytest.mark.parametrize("workers", [0, 2])
def test_interrupted_run_loses_nothing_and_resumes(tmp_path, workers):
    src, hs = legacy_source(tmp_path)
    s_ep = open_endpoint(str(src), source=True)
    d_ep = open_endpoint(str(tmp_path / "dst"), source=False)
    p = plan(s_ep, d_ep, "unified")
    seen = []

    def stop_after_two_pages(n: int) -> None:
        seen.append(n)
        if len(seen) == 2:
            raise KeyboardInterrupt

    res = run(p, s_ep, d_ep, progress=stop_after_two_pages, workers=workers)
    s_ep.close()
    d_ep.close()
    written = res.counts["written"]
    assert res.interrupted
    if workers == 0:                  # page by page: the two pages reported, nothing after
        assert written == 16
    else:                             # pages already running when it stopped finish too
        assert 16 <= written < 48 and written % 8 == 0
    assert len(objects(tmp_path / "dst")) == written      # only whole objects are visible
    for name in objects(tmp_path / "dst"):
        raw = open(os.path.join(tmp_path, "dst", "objects", name[:2], name), "rb").read()
        h = parse_header(raw)
        verify_payload(h, memoryview(raw)[h.header_len:])
    s = summary(convert(src, tmp_path / "dst", "--format", "json"))
    assert (s["skipped_present"], s["written"]) == (written, 48 - written)
    b = FileBackend(FileStoreConfig(dir=str(tmp_path / "dst")))
    assert read(b, hs, Placement()) == PAGES
    b.close()


def test_headers_read_by_threads_come_in_order(tmp_path):
    from engine.storage.convert_plan import HEAD_BYTES, _heads

    src, _ = legacy_source(tmp_path)
    ep = open_endpoint(str(src), source=True)
    keys = ep.list_keys() + ["f" * 64 + ".gone"]            # one vanished since the listing
    got = list(_heads(ep, keys, chunk=2))                  # 7 chunks over the worker threads
    assert [k for k, _ in got] == keys
    assert [h for _, h in got] == [ep.read_head(k, HEAD_BYTES) for k in keys]
    assert all(size == os.path.getsize(os.path.join(src, "objects", k[:2], k))
               for k, (_, size) in got[:-1])
    assert got[-1][1] is None and all(h for _, h in got[:-1])
    ep.close()


@pytest.fixture(scope="module")
def master(tmp_path_factory):
    m = MooncakeMaster(tmp_path_factory.mktemp("mooncake")).start()
    yield m
    m.stop()


def test_file_to_mooncake_and_back(tmp_path, master):
    fleet = MooncakeBackend(master.config())             # a serving client holds the memory
    src, hs = legacy_source(tmp_path)
    url = (f"mooncake://127.0.0.1:{master.rpc_port}?metadata=http://127.0.0.1:"
           f"{master.http_port}/metadata&admin={master.metrics_port}")
    s = summary(convert(src, url, "--verify", "--format", "json"))
    assert s["written"] == 48 and s["verified"] == 48
    assert read(fleet, hs, Placement()) == PAGES
    back = summary(convert(url, tmp_path / "back", "--to", "unified:layers=4,heads=4",
                           "--format", "json"))
    assert back["objects_in"] == 48 and back["written"] == 6
    b = FileBackend(FileStoreConfig(dir=str(tmp_path / "back")))
    assert read(b, hs, Placement(grid="layers=4,heads=4")) == PAGES
    b.close()
    bad_admin = url.replace(f"admin={master.metrics_port}", f"admin={master.rpc_port + 7}")
    res = convert(bad_admin, tmp_path / "never")
    assert res.exit_code == 1 and "cannot list keys" in res.output
    assert not (tmp_path / "never").exists()               # a refused run creates nothing
    res = convert(f"mooncake://127.0.0.1:{master.rpc_port}?color=red", tmp_path / "never")
    assert res.exit_code == 2 and "unknown parameters" in res.output
    fleet.close()


def test_whole_runs_of_source_files_are_copied_in_the_kernel(tmp_path):
    src, hs = legacy_source(tmp_path)
    split = summary(convert(src, tmp_path / "split", "--to", "unified:tp=2,pp=2", "--verify",
                            "--format", "json"))
    assert split["objects_out"] == 24 and split["verified"] == 24
    assert split["kernel_copied_bytes"] == 24 * MODEL.shard(2, 0, 2, 0).page_bytes
    b = FileBackend(FileStoreConfig(dir=str(tmp_path / "split")))
    assert read(b, hs, Placement(grid="tp=2,pp=2"), tp=2, rank=1) == PAGES
    b.close()
    # Two layer chunks of the same heads join into one legacy object: two ranges each.
    back = summary(convert(tmp_path / "split", tmp_path / "back", "--to", "legacy:tp=2,pp=1",
                           "--verify", "--format", "json"))
    assert back["written"] == 12 and back["kernel_copied_bytes"] == \
        12 * MODEL.shard(2, 0).page_bytes
    b = FileBackend(FileStoreConfig(dir=str(tmp_path / "back")))
    assert read(b, hs, LEGACY2[0], tp=2, rank=0) == PAGES
    b.close()
