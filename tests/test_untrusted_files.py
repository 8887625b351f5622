"""Untrusted input files parsed with bounds: deep nesting in a trace line or a storage config,
huge integers, blank lines (they count against the line limit), and the bounded JSON reader."""

from __future__ import annotations

import gzip
import json

import pytest
from typer.testing import CliRunner

from engine.core.errors import InputError
from engine.loadgen import trace
from engine.storage import StorageConfig
from formats import boundedjson
from hicache_cli.app import app

runner = CliRunner()
RECORD = json.dumps({"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]})


@pytest.mark.parametrize("line, msg", [
    ("[" * 100_000, "not a trace record \\(JSON nested too deeply\\)"),
    ('{"timestamp": 0, "input_length": ' + "9" * 5000 + "}", "not JSON this reader accepts"),
])
def test_hostile_trace_line_is_a_named_error(tmp_path, line, msg):
    p = tmp_path / "t.jsonl"
    p.write_text(RECORD + "\n" + line + "\n")
    with pytest.raises(InputError, match=f"t.jsonl:2: {msg}"):
        trace.read_trace(str(p))
    r = runner.invoke(app, ["bench", "replay", str(p)])
    assert r.exit_code == 1 and "t.jsonl:2" in r.output and "Traceback" not in r.output
    r = runner.invoke(app, ["bench", "run", "-w", f"trace:{p}", "--url", "http://127.0.0.1:9"])
    assert r.exit_code in (1, 2) and "Traceback" not in r.output


def test_blank_lines_count_against_the_line_limit(tmp_path, monkeypatch):
    monkeypatch.setattr(trace, "MAX_REQUESTS", 1000)
    p = tmp_path / "blank.jsonl.gz"
    p.write_bytes(gzip.compress(b"\n" * 5000 + RECORD.encode() + b"\n"))
    with pytest.raises(InputError, match="no requests \\(in its first 1,000 lines\\)"):
        trace.read_trace(str(p))
    p.write_bytes(gzip.compress(b"\n" * 500 + RECORD.encode() + b"\n"))
    assert len(trace.read_trace(str(p))) == 1


def test_deeply_nested_storage_config_is_an_input_error(tmp_path):
    p = tmp_path / "l3.json"
    p.write_text('{"backend": "file", "file": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(InputError, match="nested deeper than"):
        StorageConfig.from_json_file(p)
    r = runner.invoke(app, ["bench", "serve", "--hicache-storage-backend-config", str(p),
                            "--port", "0"])
    assert r.exit_code in (1, 2) and "nested deeper than" in r.output
    assert "Traceback" not in r.output


@pytest.mark.parametrize("raw, msg", [
    ('{"a": "\\ud800"}', "lone surrogate"),
    ('{"\\udfff": 1}', "lone surrogate"),
    ("[" * 100_000 + "]" * 100_000, "nested deeper than 64"),
    ("[" * 65 + "]" * 65, "nested deeper than 64"),
    ("1" * 101, "101 digits"),
    ("[1e400]", "out of range"),
    ("[NaN]", "NaN is not a JSON number"),
    ("{", "line 1 column 2"),
    (b"\xff", "not UTF-8"),
])
def test_bounded_json_rejects(raw, msg):
    with pytest.raises(boundedjson.JSONLimitError, match=msg):
        boundedjson.loads(raw)


def test_bounded_json_accepts_ordinary_values():
    v = {"text": "héllo ✓", "ids": [1, 2 ** 70, -3], "t": 0.5, "n": None, "deep": [[[[1]]]]}
    assert boundedjson.loads(json.dumps(v)) == v
    assert boundedjson.loads("[" * 64 + "]" * 64)
