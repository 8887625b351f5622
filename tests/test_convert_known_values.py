"""``convert-layout`` on stores of known values: every element of the KV is a function of its
coordinates (layer, K/V, token position, head, dim), so each converted object can be decoded on
its own — here, by a decoder written from the object format, not by the converter's code — and
checked element by element. Every conversion the command offers (legacy and unified, grids, both
payload orders), then the round trip back to the source layout (byte-identical objects)."""

from __future__ import annotations

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
from engine.storage.config import FileStoreConfig
from engine.storage.convert_io import byte_runs
from engine.storage.placement import KVOrder, Placement
from formats.kvobject import parse_header, verify_payload
from hicache_cli.app import app

MODEL = KVLayout(num_layers=4, kv_heads=4, head_dim=8, page_size=4)
MLA = KVLayout(num_layers=4, kv_heads=1, head_dim=8, page_size=4, kv_kinds=1)
PAGES = 3
runner = CliRunner()


def known(model: KVLayout) -> torch.Tensor:
    """``[pages, layers, kv, page_size, heads, dim]``: element = its coordinates as one number
    (layer, kv, token position, head, dim), exact in float32."""
    L, K, P, H, D = (model.num_layers, model.kv_kinds, model.page_size, model.kv_heads,
                     model.head_dim)
    layer, kv, tok, head, dim = np.meshgrid(np.arange(L), np.arange(K), np.arange(PAGES * P),
                                            np.arange(H), np.arange(D), indexing="ij")
    code = (((layer * K + kv) * PAGES * P + tok) * H + head) * D + dim + 1
    # [L, K, T, H, D] -> [pages, L, K, P, H, D]
    code = code.reshape(L, K, PAGES, P, H, D).transpose(2, 0, 1, 3, 4, 5)
    return torch.from_numpy(np.ascontiguousarray(code).astype(np.float32))


def write_store(root, model: KVLayout, placement: Placement, tp: int = 1, pp: int = 1):
    """The store a TP×PP deployment with ``placement`` writes (L3Store, real pools)."""
    ref, hs = known(model), page_hashes(np.arange(PAGES * model.page_size), model.page_size,
                                        seed=namespace_seed(uuid.uuid4().hex))
    b = FileBackend(FileStoreConfig(dir=str(root)))
    for t in range(tp):
        for s in range(pp):
            shard = model.shard(tp, t, pp, s)
            pl = placement if placement.scheme.value == "unified" else \
                Placement("legacy", tp=(t, tp), pp=(s, pp))
            st = L3Store(b, shard, placement=pl)
            pool = HostPool(shard, PAGES, host_layout="page_first")
            l0, h0 = shard.layer_start, shard.head_start
            pool.buf.copy_(ref[:, l0:l0 + shard.num_layers, :, :, h0:h0 + shard.kv_heads])
            assert st.put_pages(hs, pool, list(range(PAGES))) == PAGES
            st.close(close_backend=False)
    b.close()
    return hs


def object_files(root) -> dict[str, bytes]:
    out = {}
    for d, _, fs in os.walk(os.path.join(root, "objects")):
        for f in fs:
            out[f] = open(os.path.join(d, f), "rb").read()
    return out


def decode(raw: bytes) -> tuple[dict, np.ndarray]:
    """(description, ``[layers, kv, page_size, heads, dim]``) of one object, from its header
    alone: ``layer_first`` payloads are ``[L, K, P, H, D]``, ``page_first`` ``[P, L, K, H, D]``."""
    h = parse_header(raw)
    payload = memoryview(raw)[h.header_len:]
    verify_payload(h, payload)
    d = h.layout
    L, K, P, H, D = (d["num_layers"], d["kv_kinds"], d["page_size"], d["kv_heads"],
                     d["head_dim"])
    a = np.frombuffer(payload, dtype=np.float32)
    if d["store"]["kv_order"] == "layer_first":
        return d, a.reshape(L, K, P, H, D)
    assert d["store"]["kv_order"] == "page_first"
    return d, a.reshape(P, L, K, H, D).transpose(1, 2, 0, 3, 4)


def check_store(root, model: KVLayout, hs, order: str, n_objects: int) -> None:
    """Every object of ``root`` holds, element by element, the known values of its rectangle."""
    ref = known(model).numpy()
    page_of = {h.hex(): i for i, h in enumerate(hs)}
    objs = object_files(root)
    assert len(objs) == n_objects
    covered = np.zeros((PAGES, model.num_layers, model.kv_heads), dtype=int)
    for name, raw in objs.items():
        d, kv = decode(raw)
        assert d["store"]["kv_order"] == order, name
        p = page_of[name[:64]]
        l0, h0 = d["layer_start"], d["head_start"]
        want = ref[p, l0:l0 + d["num_layers"], :, :, h0:h0 + d["kv_heads"]]
        bad = np.argwhere(kv != want)
        assert bad.size == 0, (f"{name}: {len(bad)} of {kv.size} elements differ, first at "
                               f"[layer, kv, slot, head, dim] {bad[0].tolist()}: "
                               f"{kv[tuple(bad[0])]} != {want[tuple(bad[0])]}")
        covered[p, l0:l0 + d["num_layers"], h0:h0 + d["kv_heads"]] += 1
    # legacy shapes with more ranks than kv-heads hold a head more than once
    assert (covered >= 1).all()


def convert(src, dst, to: str, *extra: str) -> dict:
    res = runner.invoke(app, ["convert-layout", str(src), str(dst), "--to", to, "--verify",
                              "--format", "json", *extra])
    assert res.exit_code == 0, res.output
    s = json.loads(res.stdout)
    assert s["written"] == s["verified"] == s["objects_out"] > 0
    return s


SOURCES = {
    "legacy:tp=2,pp=1": (Placement("legacy"), 2, 1),
    "unified:layers=2,heads=1": (Placement(), 1, 1),
    "unified:layers=1,heads=2": (Placement(grid="layers=1,heads=2"), 2, 2),
}
GRIDS = ["unified", "unified:layers=1,heads=1", "unified:layers=4,heads=4",
         "unified:layers=3,heads=2", "unified:layers=2,heads=4", "unified:layers=4,heads=1",
         "unified:tp=2,pp=2",
         "legacy:tp=1,pp=1", "legacy:tp=2,pp=1", "legacy:tp=4,pp=2", "legacy:tp=8,pp=1",
         "legacy:tp=1,pp=3"]


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    out = {}
    for label, (pl, tp, pp) in SOURCES.items():
        root = tmp_path_factory.mktemp("src")
        out[label] = (root, write_store(root, MODEL, pl, tp, pp))
    return out


@pytest.mark.parametrize("order", ["layer_first", "page_first"])
@pytest.mark.parametrize("target", GRIDS)
@pytest.mark.parametrize("source", list(SOURCES))
def test_every_conversion_keeps_every_element(sources, tmp_path, source, target, order):
    root, hs = sources[source]
    before = object_files(root)
    dst = tmp_path / "dst"
    s = convert(root, dst, f"{target}+{order}")
    check_store(dst, MODEL, hs, order, s["objects_out"])
    # ... through a second page_first grid, and back to the source's own layout: the very
    # objects the deployment wrote.
    hop = tmp_path / "hop"
    s2 = convert(dst, hop, "unified:layers=3,heads=1+page_first")
    check_store(hop, MODEL, hs, "page_first", s2["objects_out"])
    back = tmp_path / "back"
    convert(hop, back, source)
    assert object_files(back) == before
    assert object_files(root) == before


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("target", ["unified:layers=1,heads=1+page_first",
                                    "legacy:tp=2,pp=2+page_first", "unified+layer_first"])
def test_in_process_runs_keep_every_element(sources, tmp_path, target, workers):
    from engine.storage.convert import plan, run
    from engine.storage.endpoints import open_endpoint

    root, hs = sources["unified:layers=2,heads=1"]
    src = open_endpoint(str(root), source=True)
    dst = open_endpoint(str(tmp_path / "dst"), source=False)
    p = plan(src, dst, target)
    res = run(p, src, dst, verify=True, workers=workers)
    src.close()
    dst.close()
    assert res.counts["written"] == res.counts["verified"] == p.counts["objects_out"]
    check_store(tmp_path / "dst", MODEL, hs, target.rpartition("+")[2], res.counts["written"])


@pytest.mark.parametrize("target", ["unified:layers=1+page_first", "unified:layers=4",
                                    "legacy:tp=2,pp=2+page_first"])
def test_mla_conversions_keep_every_element(tmp_path, target):
    hs = write_store(tmp_path / "src", MLA, Placement(), 1, 1)
    before = object_files(tmp_path / "src")
    s = convert(tmp_path / "src", tmp_path / "dst", target)
    check_store(tmp_path / "dst", MLA, hs, target.rpartition("+")[2] if "+" in target
                else "layer_first", s["objects_out"])
    convert(tmp_path / "dst", tmp_path / "back", "unified")
    assert object_files(tmp_path / "back") == before


def _old_byte_runs(tile, srcs, order):
    """The cut before the fix: layer_first byte runs whatever the target's order."""
    return byte_runs(tile, srcs, KVOrder.LAYER_FIRST)


def _swapped_fill(copies, srcs):
    """Assembles every object with its K and V swapped (checksums computed from those bytes)."""
    for p, ssl, dest in copies:
        got = srcs[p].rows[ssl]
        dest[...] = got[:, ::-1] if got.shape[1] == 2 else got[:, :, ::-1]


@pytest.mark.parametrize("wrong", ["byte_runs", "fill"])
def test_verify_catches_wrong_bytes_with_valid_checksums(sources, tmp_path, monkeypatch, wrong):
    import engine.storage.convert_io as cio

    if wrong == "byte_runs":
        monkeypatch.setattr(cio, "byte_runs", _old_byte_runs)
        to = "unified:layers=1,heads=1+page_first"
    else:
        monkeypatch.setattr(cio.Assembly, "fill", staticmethod(_swapped_fill))
        to = "unified:layers=4,heads=4"
    root, hs = sources["unified:layers=2,heads=1"]
    res = runner.invoke(app, ["convert-layout", str(root), str(tmp_path / "dst"), "--to", to,
                              "--verify", "--format", "json"])
    assert res.exit_code == 3, res.output
    s = json.loads(res.stdout)
    assert s["verify_failed"] == s["written"] > 0 and s["verified"] == 0
    err = res.stderr.strip().splitlines()
    assert len(err) == 1 and "do not hold the source's KV" in err[0], res.stderr
    assert "Traceback" not in res.output
    for raw in object_files(tmp_path / "dst").values():     # every checksum is valid ...
        h = parse_header(raw)
        verify_payload(h, memoryview(raw)[h.header_len:])
    with pytest.raises(AssertionError, match="elements differ"):   # ... the KV is not
        check_store(tmp_path / "dst", MODEL, hs, "page_first" if "+" in to else "layer_first",
                    s["written"])
    # A second run over the same destination with --verify checks what is there (present
    # objects are the conversion's own bytes, so only meaning can tell).
    again = runner.invoke(app, ["convert-layout", str(root), str(tmp_path / "dst"), "--to",
                                to, "--verify", "--format", "json"])
    assert again.exit_code == 3 and json.loads(again.stdout)["verify_failed"] == s["written"]
