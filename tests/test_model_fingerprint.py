"""The store's model identity covers the weights actually loaded (docs/storage.md, "Model
fingerprint"): two checkpoints with one ``config.json`` and different weights never read each
other's L3 objects; ``--hicache-model-fingerprint`` declares two builds identical.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import requests

from engine.runtime.launch import ServerConfig, start_server
from engine.runtime.model import load_model, preset, random_weights, save_hf
from engine.runtime.model.fingerprint import arch_identity, weights_digest
from engine.runtime.model_id import model_tag

PROMPT = [256] + [(7 * i + 3) % 256 for i in range(191)]       # 12 pages of 16


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory):
    """Model directories A/model and B/model (one name): the same config.json, weights from
    seeds 1 and 2 — two builds of one checkpoint, as an operator would lay them out."""
    root = tmp_path_factory.mktemp("ckpt")
    cfg = preset("tiny")
    dirs = []
    for name, seed in (("A", 1), ("B", 2)):
        d = root / name / "model"
        save_hf(str(d), cfg, random_weights(cfg, seed=seed))
        dirs.append(str(d))
    assert (root / "A" / "model" / "config.json").read_bytes() == \
        (root / "B" / "model" / "config.json").read_bytes()
    return dirs


def gen(url: str) -> dict:
    r = requests.post(url + "/generate", json={"input_ids": PROMPT, "sampling_params": {
        "max_new_tokens": 6, "temperature": 0}}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def served(model: str, store=None, **kw) -> dict:
    opts = {} if store is None else dict(
        hicache_storage_backend="file", hicache_storage_dir=str(store),
        hicache_storage_prefetch_policy="wait_complete")
    with start_server(ServerConfig(port=0, model=model, l1_tokens=1024, l2_tokens=2048,
                                   page_size=16, **opts, **kw)) as s:
        out = gen(s.url)
        out["info"] = requests.get(s.url + "/server_info", timeout=30).json()
        return out


def storage_hits(out: dict) -> int:
    return out["meta_info"]["cached_tokens_details"]["storage"]


def test_digest_follows_the_weights_and_the_tag_the_kv_shaping_config():
    cfg = preset("tiny")
    a, a2, b = (random_weights(cfg, seed=s) for s in (1, 1, 2))
    assert weights_digest(a) == weights_digest(a2) != weights_digest(b)
    assert weights_digest(a.to("cpu", load_model("tiny").dtype)) == weights_digest(a)
    d = weights_digest(a)
    assert model_tag(cfg, d) != model_tag(cfg, weights_digest(b))
    for change in (dict(rope_theta=5e5), dict(dtype="bfloat16"), dict(rms_eps=1e-6),
                   dict(rope_linear_factor=2.0)):
        other = dataclasses.replace(cfg, **change)
        assert arch_identity(other) != arch_identity(cfg)
        assert model_tag(other, d) != model_tag(cfg, d)
        assert model_tag(other, d, "build-7") != model_tag(cfg, d, "build-7")
    # what does not change the KV bytes does not change the tag
    assert model_tag(dataclasses.replace(cfg, max_context=999, eos_ids=(1,)), d) == \
        model_tag(cfg, d)
    # the override: the weights and the name no longer count, the architecture still does
    assert model_tag(cfg, d, "build-7") == model_tag(dataclasses.replace(cfg, name="x"),
                                                      weights_digest(b), "build-7")
    assert model_tag(cfg, d, "build-7") != model_tag(cfg, d, "build-8")
    with pytest.raises(ValueError, match="fingerprint"):
        ServerConfig(hicache_model_fingerprint="")
    with pytest.raises(ValueError, match="fingerprint"):
        ServerConfig(hicache_model_fingerprint="a\nb")


def test_two_checkpoints_of_one_config_never_share_l3(two_checkpoints, tmp_path):
    a_dir, b_dir = two_checkpoints
    a = served(a_dir, tmp_path)
    b_alone = served(b_dir)
    assert a["output_ids"] != b_alone["output_ids"]          # the weights do differ
    b = served(b_dir, tmp_path)                            # B on the store A wrote
    assert storage_hits(b) == 0
    assert b["output_ids"] == b_alone["output_ids"]
    assert a["info"]["model_tag"] != b["info"]["model_tag"]
    again = served(a_dir, tmp_path)                        # A still finds its own objects
    assert storage_hits(again) > 0 and again["output_ids"] == a["output_ids"]


def test_bf16_products_never_share_l3_with_float32(tmp_path):
    """--gemm-dtype bfloat16 computes other KV bytes from the same weights: its own tag, no
    L3 hit on what a float32 server stored (and the float32 server still finds its own)."""
    from engine.runtime.model import native_gemm

    if not native_gemm.bf16_available():
        pytest.skip(f"bf16 products: {native_gemm._state.get('bf16_what')}")
    a = served("tiny", tmp_path)
    b = served("tiny", tmp_path, gemm_dtype="bfloat16")
    assert storage_hits(b) == 0 and a["info"]["model_tag"] != b["info"]["model_tag"], b["info"]
    assert (a["info"]["gemm_dtype"], b["info"]["gemm_dtype"]) == ("float32", "bfloat16")
    assert served("tiny", tmp_path, gemm_dtype="bfloat16")["meta_info"][
        "cached_tokens_details"]["storage"] > 0                 # its own objects it finds
    assert storage_hits(served("tiny", tmp_path)) > 0


def test_declared_fingerprint_shares_across_builds(two_checkpoints, tmp_path):
    """The operator's override: equal values share objects (here, wrongly: the weights differ,
    which is exactly the risk the documentation names)."""
    a_dir, b_dir = two_checkpoints
    served(a_dir, tmp_path, hicache_model_fingerprint="build-7")
    b = served(b_dir, tmp_path, hicache_model_fingerprint="build-7")
    assert storage_hits(b) > 0
    other = served(b_dir, tmp_path, hicache_model_fingerprint="build-8")
    assert storage_hits(other) == 0
    assert json.dumps(b["info"]["model_tag"]).startswith('"declared-')


def test_convert_layout_keeps_the_fingerprint_and_picks_one_model(two_checkpoints, tmp_path):
    """A store both builds wrote (legacy layout) mixes two model tags: convert-layout refuses
    naming both and the flag that picks; --model-tag converts one build's objects, which that
    build then hits (and the other does not)."""
    from typer.testing import CliRunner

    from hicache_cli.app import app

    a_dir, b_dir = two_checkpoints
    src, dst = tmp_path / "legacy", tmp_path / "unified"
    a = served(a_dir, src, hicache_storage_layout="legacy")
    b = served(b_dir, src, hicache_storage_layout="legacy")
    tag_a, tag_b = a["info"]["model_tag"], b["info"]["model_tag"]
    res = CliRunner().invoke(app, ["convert-layout", str(src), str(dst), "--to", "unified"])
    assert res.exit_code == 1, res.output
    assert tag_a in res.output and tag_b in res.output and "--model-tag" in res.output
    res = CliRunner().invoke(app, ["convert-layout", str(src), str(dst), "--model-tag", "x"])
    assert res.exit_code == 1 and tag_a in res.output, res.output
    res = CliRunner().invoke(app, ["convert-layout", str(src), str(dst), "--to", "unified",
                                   "--model-tag", tag_a, "--format", "json"])
    assert res.exit_code == 0, res.output
    s = json.loads(res.stdout)
    assert s["model_tag"] == tag_a and s["other_layout"] > 0 and s["written"] > 0
    got_b = served(b_dir, dst)
    assert storage_hits(got_b) == 0 and got_b["output_ids"] == b["output_ids"]
    got_a = served(a_dir, dst)
    assert storage_hits(got_a) > 0 and got_a["output_ids"] == a["output_ids"]
