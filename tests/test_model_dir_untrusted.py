"""``--model DIR`` reads untrusted files: config.json is bounded JSON with every field typed and
in range, each safetensors header is checked from its bytes before the reader maps the file.
Each crafted directory is one line on stderr and exit 1, never a traceback."""

from __future__ import annotations

import json
import struct

import pytest
from typer.testing import CliRunner

from engine.core.errors import InputError
from engine.runtime.model import ModelConfig, from_hf_config, load_model, random_weights, save_hf
from hicache_cli.app import app

runner = CliRunner()
SMALL = ModelConfig(name="small-ckpt", num_layers=2, hidden=64, num_heads=2, num_kv_heads=1,
                    head_dim=32, intermediate=128, max_context=512)


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpt") / "m"
    save_hf(str(d), SMALL, random_weights(SMALL, 3))
    return d


def clone(good, tmp_path, config=None, safetensors=None):
    d = tmp_path / "m"
    d.mkdir()
    cfg = json.loads((good / "config.json").read_text())
    if callable(config):
        config(cfg)
    (d / "config.json").write_text(config if isinstance(config, str) else json.dumps(cfg))
    (d / "model.safetensors").write_bytes((good / "model.safetensors").read_bytes()
                                          if safetensors is None else safetensors)
    return d


def serve_fails(d, msg):
    r = runner.invoke(app, ["bench", "serve", "--port", "0", "--model", str(d)])
    assert r.exit_code == 1, r.output
    assert "Traceback" not in r.output and r.exception is None or isinstance(r.exception,
                                                                             SystemExit)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and msg in lines[0], r.stderr
    return lines[0]


def test_a_good_checkpoint_still_loads(good):
    m = load_model(str(good))
    assert m.cfg.num_layers == 2 and m.cfg.max_context == 512


def set_(key, value):
    def edit(c):
        c[key] = value
    return edit


@pytest.mark.parametrize("edit, msg", [
    (set_("num_hidden_layers", "2"), "num_hidden_layers must be an integer in [1, 1,024], got '2'"),
    (set_("num_hidden_layers", 2.0), "num_hidden_layers must be an integer"),
    (set_("hidden_size", True), "hidden_size must be an integer"),
    (set_("max_position_embeddings", 10 ** 18), "max_position_embeddings must be an integer in "
                                                "[1, 1,048,576]"),
    (set_("vocab_size", -1), "vocab_size must be an integer"),
    (set_("rope_theta", "1e4"), "rope_theta must be a number"),
    (set_("rms_norm_eps", 0), "rms_norm_eps must be a number in (0, 1]"),
    (set_("tie_word_embeddings", "no"), "tie_word_embeddings must be true or false"),
    (set_("eos_token_id", [1, "2"]), "eos_token_id must be an integer"),
    (set_("rope_scaling", [1]), "rope_scaling must be an object or null"),
    (set_("rope_scaling", {"rope_type": "linear", "factor": "2"}), "factor must be a number"),
    (set_("num_key_value_heads", 3), "num_key_value_heads must be an integer in [1, 2]"),
])
def test_config_fields_are_strictly_typed(good, tmp_path, edit, msg):
    d = clone(good, tmp_path, edit)
    with pytest.raises(InputError, match=None) as e:
        from_hf_config(str(d))
    assert msg in str(e.value) and "config.json" in str(e.value)
    serve_fails(d, msg)


def test_deeply_nested_config_is_one_line(good, tmp_path):
    d = clone(good, tmp_path, config='{"x": ' + "[" * 200_000 + "]" * 200_000 + "}")
    serve_fails(d, "config.json: not a JSON config (nested deeper than")


def header_file(header: bytes, claim: int | None = None, tail: bytes = b"") -> bytes:
    return struct.pack("<Q", len(header) if claim is None else claim) + header + tail


@pytest.mark.parametrize("data, msg", [
    (b"", "0 bytes, too short for a safetensors file"),
    (b"\x00garbage-not-a-safetensors-file" * 10, "not a safetensors file"),
    (header_file(b"{}", claim=100 << 30), "its header claims 107,374,182,400 bytes"),
    (header_file(b'{"a": ' * 1000), "not a safetensors file (header"),
    (header_file(json.dumps({"model.norm.weight": {"dtype": "F32", "shape": [1 << 30],
                                                   "data_offsets": [0, 4 << 30]}}).encode()),
     "bad header entry"),
    (header_file(json.dumps({"model.norm.weight": {"dtype": "F32", "shape": [64],
                                                   "data_offsets": [0, 256]}}).encode(),
                 tail=b"\x00" * 255), "bad header entry"),
])
def test_bad_safetensors_are_one_line(good, tmp_path, data, msg):
    d = clone(good, tmp_path, safetensors=data)
    line = serve_fails(d, msg)
    assert "model.safetensors" in line


def test_a_tensor_of_the_wrong_shape_is_named_before_it_is_read(good, tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    t = load_file(str(good / "model.safetensors"))
    t["model.norm.weight"] = torch.ones(65)
    d = clone(good, tmp_path)
    save_file(t, str(d / "model.safetensors"))
    serve_fails(d, "model.norm has shape (65,), config implies (64,)")
