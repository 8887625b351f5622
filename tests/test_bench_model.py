"""benchmarks/bench_model.py end to end on small shapes: the JSON it prints carries the limits,
the second decode limit for the bytes the step reads, and (a GGUF model) the float32-panels
side with the same greedy tokens; a model without GGUF blocks says why that side is skipped."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*args: str) -> dict:
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_model.py"),
                           "--prompts", "40", "--decode", "3", "--repeat", "1", "--chunk", "16",
                           "--threads", "2", "--no-hf", "--no-torch-kernels", "--no-bf16",
                           "--json", *args],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


def test_a_float32_model_reports_both_limits_and_skips_the_panels_side():
    out = _run("--model", "tiny")
    row = out["rows"][0]
    assert out["float32_panels"].startswith("skipped")
    assert row["limit_decode_read_tok_s"] == pytest.approx(row["limit_decode_tok_s"])
    assert row["hicache_decode_tok_s"] > 0 and "float32_panels_decode_tok_s" not in row


def test_the_gguf_model_reads_its_blocks_and_the_panels_side_agrees():
    pytest.importorskip("gguf")
    try:
        from engine.runtime.model.gguf_loader import smollm2_path
        smollm2_path()
    except Exception as exc:                      # weights not installed: said so
        pytest.skip(f"smollm2-135m: {exc}")
    out = _run("--model", "smollm2-135m")
    row = out["rows"][0]
    assert out["float32_panels"] == "run" and out["decode_weight_mb"] < 200
    assert row["float32_panels_same_tokens"] is True
    assert row["limit_decode_read_tok_s"] > 2 * row["limit_decode_tok_s"]
