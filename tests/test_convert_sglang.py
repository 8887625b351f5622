"""``convert-layout`` on SGLang's own file stores (docs/sglang-stores.md).

The fixtures under tests/data/sglang_stores/ were written by SGLang 0.5.23's own classes on CPU
(write_fixtures.py, which needs SGLang; these tests do not): every host layout at TP1 and TP2,
bf16 and fp16, PP2 stage sets, a namespaced chain, and a store of hicache's ``tiny`` geometry.
A conversion to a shape is right when it produces exactly the files — names and bytes — SGLang's
own writer produced for that shape.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import pytest
from typer.testing import CliRunner

from engine.core.errors import InputError, UsageError
from engine.storage import sglang_convert as sc
from engine.storage import sglang_geometry as sg
from engine.storage import sglang_store as ss
from hicache_cli.app import app

DATA = os.path.join(os.path.dirname(__file__), "data", "sglang_stores")
LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
runner = CliRunner()


def meta(name: str) -> dict:
    with open(os.path.join(DATA, name, "fixture.json")) as f:
        return json.load(f)


def spec(name: str, root: str | None = None, **over) -> str:
    m = meta(name)
    g = {"model": m["model"], "layers": m["layers"], "kv_heads": m["kv_heads"],
         "head_dim": m["head_dim"], "dtype": m["dtype"], "page_size": m["page_size"],
         "layout": m["layout"], "tp": m["tp"], "pp": m.get("pp", 1),
         "mla": int(m.get("mla", False)), **over}
    q = "&".join(f"{k}={v}" for k, v in g.items() if v is not None)
    return f"sglang-file:{root or os.path.join(DATA, name)}?{q}"


def files(root) -> dict[str, str]:
    return {f: hashlib.sha256(open(os.path.join(root, f), "rb").read()).hexdigest()
            for f in sorted(os.listdir(root)) if f.endswith(".bin")}


def convert_api(src: str, dst: str, **kw) -> dict:
    p = sc.plan(src, dst, **{k: v for k, v in kw.items() if k in ("to", "model_tag")})
    try:
        res = sc.run(p, verify=kw.get("verify", True), workers=kw.get("workers"))
    finally:
        sc.close(p)
    return {**p.summary, **res.counts}


def cli(*args: str):
    return runner.invoke(app, ["convert-layout", *map(str, args)])


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("src_layout", LAYOUTS)
def test_every_layout_and_tp_converts_to_exactly_what_sglang_writes(tmp_path, dtype,
                                                                      src_layout):
    for src_tp in (1, 2):
        src = f"{src_layout}-tp{src_tp}-{dtype}"
        before = files(os.path.join(DATA, src))
        for dst_layout in LAYOUTS:
            for dst_tp in (1, 2):
                want = f"{dst_layout}-tp{dst_tp}-{dtype}"
                out = tmp_path / f"{src}--{want}"
                s = convert_api(spec(src), f"sglang-file:{out}?layout={dst_layout}&tp={dst_tp}")
                assert s["written"] == 3 * dst_tp and s["verified"] == 3 * dst_tp, s
                assert files(out) == files(os.path.join(DATA, want)), (src, want)
        assert files(os.path.join(DATA, src)) == before       # the source is only read


def test_pp_stage_sets_and_namespaced_chains_match_sglang(tmp_path):
    cases = [("page_first-tp1-pp2-bf16", "layout=layer_first&tp=2&pp=2",
              "layer_first-tp2-pp2-bf16"),
             ("layer_first-tp2-pp2-bf16", "layout=page_first&tp=1&pp=1", "page_first-tp1-bf16"),
             ("page_first-tp1-bf16", "pp=2", "page_first-tp1-pp2-bf16"),
             ("page_first-tp2-bf16-ns", "tp=1", "page_first-tp1-bf16-ns")]
    for src, q, want in cases:
        out = tmp_path / want
        convert_api(spec(src), f"sglang-file:{out}?{q}")
        assert files(out) == files(os.path.join(DATA, want)), (src, q)
    # the namespaced chain is kept: its keys are not the plain chain's
    assert not set(files(tmp_path / "page_first-tp1-bf16-ns")) & \
        set(files(os.path.join(DATA, "page_first-tp1-bf16")))


def test_mla_stores_convert_to_what_sglang_writes(tmp_path):
    """MLA: one file per page (per PP stage) shared by every TP rank, ``[layers, tokens, 1,
    latent]`` or ``[tokens, layers, 1, latent]``."""
    mla = ("layer_first", "page_first", "page_first_direct")
    for a in mla:
        for b in mla:
            out = tmp_path / f"{a}-{b}"
            s = convert_api(spec(f"mla-{a}-bf16"), f"sglang-file:{out}?layout={b}&tp=1")
            assert s["written"] == 3
            assert files(out) == files(os.path.join(DATA, f"mla-{b}-bf16")), (a, b)
    out = tmp_path / "pp2"
    convert_api(spec("mla-layer_first-bf16"), f"sglang-file:{out}?layout=page_first&pp=2")
    assert files(out) == files(os.path.join(DATA, "mla-page_first-pp2-bf16"))
    mid, back = tmp_path / "hicache", tmp_path / "back"
    convert_api(spec("mla-page_first-pp2-bf16"), str(mid), model_tag="m")
    convert_api(str(mid), f"sglang-file:{back}?model=fixture/small&layout=page_first_direct")
    assert files(back) == files(os.path.join(DATA, "mla-page_first_direct-bf16"))
    with pytest.raises(InputError, match="mla: its files of model 'fixture-small' carry no TP"):
        sc.plan(spec("mla-page_first-bf16", mla=0, kv_heads=2), f"sglang-file:{out}2")
    with pytest.raises(UsageError, match="layout=page_head does not exist for MLA"):
        sc.plan(spec("mla-page_first-bf16", layout="page_head"), f"sglang-file:{out}2")


@pytest.mark.parametrize("to", ["unified", "unified:layers=1,heads=1+page_first",
                                "legacy:tp=2,pp=1"])
def test_sglang_to_hicache_and_back_gives_sglang_bytes(tmp_path, to):
    mid, back = tmp_path / "hicache", tmp_path / "back"
    s = convert_api(spec("page_head-tp2-bf16"), str(mid), to=to, model_tag="fixture-small")
    assert s["written"] == s["objects_out"] > 0 and s["verify_failed"] == 0
    assert os.path.isfile(mid / "store.json")
    s2 = convert_api(str(mid), f"sglang-file:{back}?model=fixture/small&layout=page_first&tp=1")
    assert s2["written"] == 3 and s2["verified"] == 3
    assert files(back) == files(os.path.join(DATA, "page_first-tp1-bf16"))


def test_hicache_store_converts_with_its_own_tools_after_import(tmp_path):
    """An SGLang store brought into hicache is an ordinary hicache store: its own converter
    reads it (legacy -> unified) and the result converts back to SGLang's bytes."""
    legacy, uni, back = tmp_path / "legacy", tmp_path / "uni", tmp_path / "back"
    convert_api(spec("layer_first-tp2-fp16"), str(legacy), to="legacy:tp=2,pp=1",
                model_tag="m")
    r = cli(legacy, uni, "--to", "unified", "--verify", "--format", "json")
    assert r.exit_code == 0, r.output
    convert_api(str(uni), f"sglang-file:{back}?model=fixture/small&layout=page_head&tp=2")
    assert files(back) == files(os.path.join(DATA, "page_head-tp2-fp16"))


def test_wrong_geometry_is_refused_naming_the_field(tmp_path):
    name = "page_first-tp2-bf16"
    out = f"sglang-file:{tmp_path / 'o'}?tp=1"
    cases = [({"tp": 1}, "tp: it holds no files of tp=1"),
             ({"dtype": "fp32"}, "dtype=fp16"),      # 2x the size: the hint names dtype
             ({"head_dim": 4}, "head_dim="),
             ({"model": "other"}, "model: it holds no files of model 'other'"),
             ({"layers": 4}, "layers=2"),
             ({"kv_heads": 3}, "tp=2 cannot split kv_heads=3")]
    for over, words in cases:
        with pytest.raises((InputError, UsageError)) as e:
            sc.plan(spec(name, **over), out)
        assert words in str(e.value), (over, str(e.value))
        assert "\n" not in str(e.value)
    with pytest.raises(UsageError, match="geometry field layout is missing"):
        sc.plan(spec(name, layout=None), out)
    with pytest.raises(UsageError, match="dtype=fp16 differs from the source's dtype=bf16"):
        sc.plan(spec(name), f"sglang-file:{tmp_path / 'o'}?dtype=fp16")
    with pytest.raises(UsageError, match="one page of this geometry is 8,589,934,592 bytes"):
        sc.plan(spec(name, layers=1024, head_dim=65536, page_size=16), out)
    with pytest.raises(UsageError, match="unknown geometry field 'heads'"):
        sc.plan(spec(name) + "&heads=2", out)
    with pytest.raises(UsageError, match="layout='page_last' is not one of"):
        sc.plan(spec(name, layout="page_last"), out)
    with pytest.raises(UsageError, match="--model-tag TAG is required"):
        sc.plan(spec(name), str(tmp_path / "h"))
    assert not os.path.exists(tmp_path / "o") and not os.path.exists(tmp_path / "h")
    # through the CLI: one line on stderr, exit 1 (store contradicts) / 2 (bad field)
    r = cli(spec(name, tp=1), out)
    assert r.exit_code == 1 and "tp: it holds no files of tp=1" in r.output
    assert len(r.output.strip().splitlines()) == 1 and "Traceback" not in r.output
    r = cli(spec(name, page_size="x"), out)
    assert r.exit_code == 2 and "page_size='x' is not a whole number" in r.output
    r = cli(spec(name), out, "--to", "unified")
    assert r.exit_code == 2 and "--to (into an SGLang store)" in r.output
    r = cli("--scan", spec(name), out)
    assert r.exit_code == 2 and "--scan takes SRC only" in r.output


def test_incomplete_and_mis_sized_pages_are_skipped_and_counted(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(os.path.join(DATA, "layer_first-tp2-bf16"), src)
    hs = meta("layer_first-tp2-bf16")["page_hashes"]
    os.remove(src / f"{hs[0]}_fixture-small_1_2.bin")              # rank 1 lacks page 0
    with open(src / f"{hs[1]}_fixture-small_0_2.bin", "r+b") as f:
        f.truncate(100)                                             # page 1 of rank 0 cut
    (src / f".{'0' * 32}.tmp").write_bytes(b"partial")             # SGLang's own temp file
    out = tmp_path / "out"
    s = convert_api(spec("layer_first-tp2-bf16", str(src)), f"sglang-file:{out}?tp=1")
    assert (s["pages"], s["incomplete_pages"], s["mis_sized"], s["written"]) == (1, 2, 1, 1)
    want = files(os.path.join(DATA, "layer_first-tp1-bf16"))
    assert files(out) == {k: v for k, v in want.items() if k.startswith(hs[2])}


def test_resume_dry_run_atomic_and_conflicts(tmp_path):
    out = tmp_path / "out"
    dst = f"sglang-file:{out}?layout=page_head&tp=1"
    r = cli(spec("page_first-tp2-fp16"), dst, "--dry-run", "--format", "json")
    assert r.exit_code == 0, r.output
    plan = json.loads(r.stdout)
    assert plan["dry_run"] and plan["pages"] == 3 and plan["objects_out"] == 3
    assert not out.exists()
    first = convert_api(spec("page_first-tp2-fp16"), dst)
    victim = sorted(files(out))[1]
    os.remove(out / victim)
    again = convert_api(spec("page_first-tp2-fp16"), dst)
    assert (first["written"], again["written"], again["skipped_present"]) == (3, 1, 2)
    assert files(out) == files(os.path.join(DATA, "page_head-tp1-fp16"))
    assert [f for f in os.listdir(out) if f.startswith(".")] == []    # no temp files left
    (out / victim).write_bytes(b"\0" * os.path.getsize(out / victim))
    with pytest.raises(InputError, match="differs from what this conversion produces"):
        convert_api(spec("page_first-tp2-fp16"), dst)
    (out / victim).write_bytes(b"\0" * 10)
    with pytest.raises(InputError, match="of 10 bytes, not the 512 this conversion writes"):
        sc.plan(spec("page_first-tp2-fp16"), dst)


def test_verify_catches_a_file_that_is_not_the_sources(tmp_path, monkeypatch):
    real = sc.write_atomic

    def damaging(root, name, buf):
        b = bytearray(bytes(buf))
        b[len(b) // 2] ^= 0x40
        real(root, name, b)

    monkeypatch.setattr(sc, "write_atomic", damaging)
    r = cli(spec("layer_first-tp1-bf16"), f"sglang-file:{tmp_path / 'o'}?tp=2", "--verify",
            "--format", "json")
    assert r.exit_code == 3, r.output
    assert "do not hold the source's KV" in r.output


def test_scan_reports_shapes_pages_and_the_geometry_check(tmp_path):
    src = tmp_path / "mixed"
    shutil.copytree(os.path.join(DATA, "page_first-tp2-bf16"), src)
    for f in os.listdir(os.path.join(DATA, "page_first-tp1-pp2-bf16")):
        if f.endswith(".bin"):
            shutil.copy(os.path.join(DATA, "page_first-tp1-pp2-bf16", f), src / f)
    os.remove(src / f"{meta('page_first-tp2-bf16')['page_hashes'][2]}_fixture-small_1_2.bin")
    r = cli("--scan", f"sglang-file:{src}", "--format", "json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    shapes = {(s["model"], s["tp"], s["pp"]): s for s in out["shapes"]}
    assert set(shapes) == {("fixture-small", 2, 1), ("fixture-small", 1, 2)}
    assert out["not_regular_skipped"] == 0
    assert shapes[("fixture-small", 2, 1)]["ranks"]["_fixture-small_1_2"]["files"] == 2
    r = cli("--scan", spec("page_first-tp2-bf16", str(src)), "--format", "json")
    gc = json.loads(r.stdout)["geometry_check"]
    assert r.exit_code == 0 and gc["ok"]
    assert (gc["pages"], gc["incomplete_pages"], gc["other_files"]) == (2, 1, 6)
    assert gc["files_per_rank"] == {"_fixture-small_0_2": 3, "_fixture-small_1_2": 2}
    r = cli("--scan", spec("page_first-tp2-bf16", str(src), dtype="fp32"))
    assert r.exit_code == 3 and "every file *_fixture-small_0_2.bin is 256 bytes" in r.output


def test_hicache_server_hits_a_store_converted_from_sglang(tmp_path):
    """hicache's tiny model, served with a declared fingerprint, reads the pages an SGLang TP2
    page_head store held: the converted objects are found in the storage tier for the
    fixture's token ids."""
    import requests

    from engine.runtime.launch import ServerConfig, start_server
    from engine.runtime.model import preset
    from engine.runtime.model_id import model_tag

    m = meta("tiny-page_head-tp2-fp32")
    tag = model_tag(preset("tiny"), "", override="from-sglang")
    store = tmp_path / "store"
    s = convert_api(spec("tiny-page_head-tp2-fp32"), str(store), model_tag=tag)
    assert s["written"] == s["objects_out"] and s["pages"] == 3
    cfg = ServerConfig(port=0, page_size=4, l1_tokens=256, l2_tokens=512,
                       hicache_storage_backend="file", hicache_storage_dir=str(store),
                       hicache_storage_prefetch_policy="wait_complete",
                       hicache_model_fingerprint="from-sglang")
    with start_server(cfg) as srv:
        info = requests.get(srv.url + "/get_server_info", timeout=30).json()
        assert info.get("model_tag", tag) == tag
        r = requests.post(srv.url + "/generate", json={
            "input_ids": m["token_ids"] + [7], "sampling_params": {
                "max_new_tokens": 1, "temperature": 0}}, timeout=120)
    assert r.status_code == 200, r.text
    details = r.json()["meta_info"]["cached_tokens_details"]
    assert details["storage"] == len(m["token_ids"]) and details["device"] == 0


def test_file_names_and_stage_split_follow_sglang():
    # SGLang gives the extra layers of an uneven split to the last stages (hicache: the first)
    assert [sg.sg_pp_range(5, 2, r) for r in range(2)] == [(0, 2), (2, 5)]
    assert [sg.sg_pp_range(7, 3, r) for r in range(3)] == [(0, 2), (2, 4), (4, 7)]
    _, f = sg.parse_spec("sglang-file:/x?model=Qwen/Qwen3-8B&layers=4&kv_heads=2&head_dim=8"
                         "&dtype=bf16&page_size=4&layout=page_first&tp=4&pp=2")
    g = sg.geometry(f, "x")
    assert [r.suffix for r in g.ranks()][:2] == ["_Qwen-Qwen3-8B_0_4_2_0",
                                                 "_Qwen-Qwen3-8B_1_4_2_0"]
    assert [r.heads for r in g.ranks()[:4]] == [(0, 1), (0, 1), (1, 2), (1, 2)]   # replicated
    mla = sg.geometry({**f, "mla": True, "kv_heads": 1}, "x")
    assert [r.suffix for r in mla.ranks()] == ["_Qwen-Qwen3-8B_2_0", "_Qwen-Qwen3-8B_2_1"]
    assert ss.read_suffix("_Qwen-Qwen3-8B_1_4_2_0")["tp"] == 4
    assert ss.read_suffix("_Qwen-Qwen3-8B_2_1")["mla"] is True
    _, again = sg.parse_spec("sglang-file:/x?" + g.query())
    assert sg.geometry(again, "x") == g


def test_links_fifos_and_directories_named_like_pages_are_never_read(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(os.path.join(DATA, "page_first-tp1-fp16"), src)
    hs = meta("page_first-tp1-fp16")["page_hashes"]
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"\x01" * 512)                              # the right size, even
    for h in hs[:2]:
        os.remove(src / f"{h}_fixture-small_0_1.bin")
    os.symlink(outside, src / f"{hs[0]}_fixture-small_0_1.bin")
    os.mkfifo(src / f"{hs[1]}_fixture-small_0_1.bin")
    os.mkdir(src / f"{'ab' * 32}_fixture-small_0_1.bin")
    r = cli("--scan", spec("page_first-tp1-fp16", str(src)), "--format", "json")
    out = json.loads(r.stdout)
    assert r.exit_code == 0 and out["not_regular_skipped"] == 3
    assert out["geometry_check"]["pages"] == 1
    dst = tmp_path / "dst"
    s = convert_api(spec("page_first-tp1-fp16", str(src)), f"sglang-file:{dst}?tp=2")
    assert s["pages"] == 1 and s["written"] == 2
    want = files(os.path.join(DATA, "page_first-tp2-fp16"))
    assert files(dst) == {k: v for k, v in want.items() if k.startswith(hs[2])}


def test_an_interrupted_run_leaves_whole_files_and_resumes(tmp_path, monkeypatch):
    real, calls = sc.write_atomic, []

    def stopping(root, name, buf):
        calls.append(name)
        if len(calls) == 3:
            raise KeyboardInterrupt
        real(root, name, buf)

    out = tmp_path / "out"
    dst = f"sglang-file:{out}?layout=layer_first&tp=2"
    monkeypatch.setattr(sc, "write_atomic", stopping)
    r = cli(spec("page_head-tp1-bf16"), dst, "--format", "json")
    assert r.exit_code == 1 and "interrupted" in r.output and "resume" in r.output
    monkeypatch.setattr(sc, "write_atomic", real)
    done = files(out)
    want = files(os.path.join(DATA, "layer_first-tp2-bf16"))
    assert 0 < len(done) < 6 and all(want[k] == v for k, v in done.items())   # each whole
    again = convert_api(spec("page_head-tp1-bf16"), dst)
    assert again["skipped_present"] == len(done) and files(out) == want


def test_a_hicache_servers_store_goes_to_sglang_and_back_unchanged(tmp_path):
    """The reverse direction on a store a hicache server wrote: to an SGLang TP2 page_head
    store and back, every object (key and bytes) is the server's own."""
    import requests

    from engine.runtime.launch import ServerConfig, start_server

    store = tmp_path / "store"
    cfg = ServerConfig(port=0, page_size=4, l1_tokens=256, l2_tokens=512,
                       hicache_storage_backend="file", hicache_storage_dir=str(store),
                       hicache_storage_prefetch_policy="wait_complete")
    with start_server(cfg) as srv:
        tag = requests.get(srv.url + "/get_server_info", timeout=30).json()["model_tag"]
        r = requests.post(srv.url + "/generate", json={"input_ids": list(range(5, 45)),
                          "sampling_params": {"max_new_tokens": 1}}, timeout=120)
        assert r.status_code == 200, r.text

    def objects(root) -> dict[str, bytes]:
        return {f: open(os.path.join(d, f), "rb").read()
                for d, _, fs in os.walk(os.path.join(root, "objects")) for f in fs}

    before = objects(store)
    assert len(before) >= 9
    sg, back = tmp_path / "sg", tmp_path / "back"
    s = convert_api(str(store), f"sglang-file:{sg}?model=tiny&layout=page_head&tp=2")
    assert s["written"] == 2 * s["pages"] and s["pages"] >= 9
    assert all(f.endswith(("_tiny_0_2.bin", "_tiny_1_2.bin")) for f in files(sg))
    convert_api(spec_of(sg), str(back), model_tag=tag)
    assert objects(back) == before


def spec_of(root) -> str:
    from engine.runtime.model import preset

    mc = preset("tiny")
    return (f"sglang-file:{root}?model=tiny&layers={mc.num_layers}&kv_heads={mc.num_kv_heads}"
            f"&head_dim={mc.head_dim}&dtype=fp32&page_size=4&layout=page_head&tp=2")


def uspec(name: str, root: str | None = None, **over) -> str:
    """A unified-scheme fixture's address (SGLang 0.5.23's key scheme)."""
    m = meta(name)
    g = {"model": m["model"], "layers": m["layers"], "kv_heads": m["kv_heads"],
         "head_dim": m["head_dim"], "dtype": m["dtype"], "page_size": m["page_size"],
         "scheme": "unified", "tp": m["tp"], "head_group": m.get("head_group"),
         "layer_partition": m.get("layer_partition"), **over}
    q = "&".join(f"{k}={v}" for k, v in g.items() if v is not None)
    return f"sglang-file:{root or os.path.join(DATA, name)}?{q}"


def test_sglang_unified_key_scheme_matches_sglangs_own_keys_and_chunks(tmp_path):
    """SGLang 0.5.23's unified scheme (namespace digest, absolute layer range, head group; one
    page_unified chunk per object), from and to the rank-suffixed layouts and regridded."""
    # the grid, not the writer, names the objects: TP1 and TP2 writers agree
    assert files(os.path.join(DATA, "unified-hg1-tp1-bf16")) == \
        files(os.path.join(DATA, "unified-hg1-tp2-bf16"))
    cases = [(spec("page_first-tp2-bf16"), "scheme=unified&head_group=1",
              "unified-hg1-tp1-bf16"),
             (spec("page_head-tp1-fp16"), "scheme=unified", "unified-tp1-fp16"),
             (spec("layer_first-tp1-fp16"), "scheme=unified&tp=2&head_group=1&layer_partition=1",
              "unified-hg1-lp1-tp2-fp16"),
             (uspec("unified-tp1-fp16"), "tp=2&head_group=1&layer_partition=1",
              "unified-hg1-lp1-tp2-fp16"),
             (uspec("unified-hg1-lp1-tp2-fp16"), "tp=1&head_group=2&layer_partition=0",
              "unified-tp1-fp16"),
             (uspec("unified-hg1-tp2-bf16"), "scheme=legacy&layout=page_head&tp=2",
              "page_head-tp2-bf16"),
             (uspec("unified-hg1-lp1-tp2-fp16"), "scheme=legacy&layout=page_first_direct&tp=1",
              "page_first_direct-tp1-fp16")]
    for src, q, want in cases:
        out = tmp_path / f"{want}-{len(os.listdir(tmp_path))}"
        s = convert_api(src, f"sglang-file:{out}?{q}")
        assert s["verified"] == s["written"] > 0, (src, q)
        assert files(out) == files(os.path.join(DATA, want)), (src, q, want)
    mid, back = tmp_path / "mid", tmp_path / "back"
    convert_api(uspec("unified-hg1-tp2-bf16"), str(mid), model_tag="t")
    convert_api(str(mid), f"sglang-file:{back}?model=fixture/small&scheme=unified&head_group=1")
    assert files(back) == files(os.path.join(DATA, "unified-hg1-tp1-bf16"))


def test_unified_scheme_wrong_geometry_names_the_field(tmp_path):
    out = f"sglang-file:{tmp_path / 'o'}?scheme=legacy&layout=page_first"
    for over, words in [({"head_group": 2, "tp": 1}, "head_group: it holds no objects of"),
                        ({"dtype": "fp16"}, "dtype: .* which is this geometry with dtype=bf16"),
                        ({"model": "fixture-small"}, "this geometry with model=fixture/small"),
                        ({"layer_partition": 1}, "with layer_partition=None")]:
        with pytest.raises(InputError, match=words):
            sc.plan(uspec("unified-hg1-tp2-bf16", **over), out)
    with pytest.raises(InputError, match="scheme: its files are unified-scheme objects"):
        sc.plan(spec("page_first-tp2-bf16", root=os.path.join(DATA, "unified-hg1-tp2-bf16")),
                out)
    with pytest.raises(UsageError, match="head_group is missing"):
        sc.plan(uspec("unified-hg1-tp2-bf16", head_group=None), out)
    with pytest.raises(UsageError, match="layout=page_first with scheme=unified"):
        sc.plan(uspec("unified-hg1-tp2-bf16") + "&layout=page_first", out)
    r = cli("--scan", f"sglang-file:{os.path.join(DATA, 'unified-hg1-lp1-tp2-fp16')}",
            "--format", "json")
    (shape,) = json.loads(r.stdout)["shapes"]
    assert shape["scheme"] == "unified" and shape["namespace"].startswith("ukv1-")
    assert shape["files"] == 12 and len(shape["ranks"]) == 4
