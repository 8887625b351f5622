"""``hicache inspect --prefix``: token ids and id ranges, refused elisions, and text encoded the
way the server encoded it (the snapshot's model: bytes for presets, smollm2-135m's own
tokenizer; a checkpoint path needs ``--tokenizer``)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from engine.core.errors import UsageError
from engine.snapshot.take import write_snapshot
from hicache_cli.app import app
from hicache_cli.cmd_inspect import parse_prompt
from tests.factories import make_cache, serve

runner = CliRunner()
TEXT = "Hierarchical caches keep long shared contexts near the model, page by page."


def test_ids_and_inclusive_ranges():
    assert parse_prompt("0-3,10, 12-13") == [0, 1, 2, 3, 10, 12, 13]
    assert parse_prompt("7") == [7]


@pytest.mark.parametrize("text, says", [
    ("0,1,…,511", "looks like token ids"),
    ("0,1,...,511", "looks like token ids"),
    ("5-2", "runs backwards"),
    ("0-99999999999", "[0, 2**32)"),
    ("0-5000000", "more than"),
])
def test_malformed_ids_are_refused(text, says):
    with pytest.raises(UsageError, match=None) as e:
        parse_prompt(text)
    assert says in str(e.value)


def _snapshot(tmp_path, tokens, model_path: str | None):
    cache = make_cache(page_size=4, l1_pages=64)
    serve(cache, tokens)
    path = tmp_path / "tree.snapshot"
    meta = {"model": "m", "source": "bench serve"}
    if model_path is not None:
        meta["model_path"] = model_path
    write_snapshot(path, cache, meta)
    return path


def _hit(path, *args) -> int:
    r = runner.invoke(app, ["inspect", str(path), "--format", "json", *args])
    assert r.exit_code == 0, r.output
    return json.loads(r.output)["prefix"]["hit_tokens"]


def test_text_uses_the_smollm2_tokenizer_of_the_snapshot(tmp_path):
    from engine.runtime.tokenizer_export import tokenizer_for_model

    tok, _, _ = tokenizer_for_model("smollm2-135m")
    ids = tok.encode(TEXT)
    path = _snapshot(tmp_path, ids, "smollm2-135m")
    full = len(ids) // 4 * 4
    assert full >= 8
    assert _hit(path, "--prefix", TEXT) == full          # the byte tokenizer would miss
    assert _hit(path, "--prefix", TEXT, "--tokenizer", "tiny") == 0


def test_text_on_a_preset_snapshot_is_bytes(tmp_path):
    from engine.runtime.tokenizer import ByteTokenizer

    ids = ByteTokenizer().encode(TEXT)
    path = _snapshot(tmp_path, ids, "tiny")
    assert _hit(path, "--prefix", TEXT) == len(ids) // 4 * 4
    assert _hit(path, "--prefix", f"0-{len(ids)}") == 0


def test_text_on_a_checkpoint_snapshot_needs_tokenizer(tmp_path):
    path = _snapshot(tmp_path, list(range(300, 340)), "/models/some-checkpoint")
    r = runner.invoke(app, ["inspect", str(path), "--prefix", TEXT])
    assert r.exit_code == 2 and "--tokenizer" in r.output
    assert _hit(path, "--prefix", "300-339") == 40         # ids need no tokenizer
