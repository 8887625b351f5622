"""Drop-in for SGLang users: the flush routes each client calls and what each empties, SGLang's
launch-line options, and one-line usage errors.

Flush semantics (docs/model-and-server.md): ``/flush_cache`` (SGLang) and ``/reset_prefix_cache``
(vLLM; what ``bench_serving --backend vllm --flush-cache`` calls) empty L1 and L2, as SGLang's
``/flush_cache`` does; ``/clear_hicache_storage_backend`` empties L3 alone; ``?storage=true`` or
``--flush-cache-scope all`` makes a flush empty every tier. Each check reads where the cached
tokens of the next request came from, and compares the output with an uncached run.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import requests

from engine.runtime.launch import ServerConfig, start_server
from hicache_cli.bench.sglang_args import TABLE, apply_extra
from tests.serve_client import ROOT, spawn

PROMPT = "A hierarchical cache keeps long shared contexts close to the model. " * 4
BASE = dict(port=0, l1_tokens=1024, l2_tokens=2048, page_size=16)


def generate(url: str, text: str = PROMPT) -> dict:
    r = requests.post(url + "/generate", timeout=120, json={
        "text": text, "sampling_params": {"max_new_tokens": 8, "temperature": 0}})
    assert r.status_code == 200, r.text
    return r.json()


def tiers(out: dict) -> dict:
    return out["meta_info"]["cached_tokens_details"]


@pytest.fixture(scope="module")
def uncached():
    with start_server(ServerConfig(port=0, l1_tokens=2048, l2_tokens=0,
                                   disable_radix_cache=True)) as s:
        return generate(s.url)["output_ids"]


def _store(tmp_path, **kw) -> ServerConfig:
    return ServerConfig(**BASE, hicache_storage_backend="file", hicache_storage_dir=str(tmp_path),
                        hicache_storage_prefetch_policy="wait_complete", **kw)


def test_flush_cache_empties_l1_l2_and_keeps_l3_as_sglang_does(tmp_path, uncached):
    with start_server(_store(tmp_path)) as s:
        assert generate(s.url)["output_ids"] == uncached
        body = requests.post(s.url + "/flush_cache", timeout=60).json()
        assert body["tiers"] == ["l1", "l2"] and body["l1_used_tokens"] == 0
        again = generate(s.url)
        assert tiers(again)["storage"] > 0 and tiers(again)["device"] == 0
        assert again["output_ids"] == uncached
        body = requests.post(s.url + "/flush_cache?storage=true", timeout=60).json()
        assert body["tiers"] == ["l1", "l2", "l3"]
        fresh = generate(s.url)
    assert fresh["meta_info"]["cached_tokens"] == 0, tiers(fresh)
    assert fresh["output_ids"] == uncached


def test_vllm_reset_prefix_cache_with_scope_all_empties_every_tier(tmp_path, uncached):
    """What ``bench_serving --backend vllm --flush-cache`` does: a bare POST, no parameters."""
    with start_server(_store(tmp_path, flush_cache_scope="all")) as s:
        generate(s.url)
        r = requests.post(s.url + "/reset_prefix_cache", timeout=60)
        assert r.status_code == 200, r.text
        fresh = generate(s.url)
    assert fresh["meta_info"]["cached_tokens"] == 0, tiers(fresh)
    assert fresh["output_ids"] == uncached


def test_vllm_reset_prefix_cache_default_keeps_l3(tmp_path, uncached):
    with start_server(_store(tmp_path)) as s:
        generate(s.url)
        assert requests.post(s.url + "/reset_prefix_cache", timeout=60).status_code == 200
        again = generate(s.url)
    assert tiers(again)["storage"] > 0 and tiers(again)["device"] == 0
    assert again["output_ids"] == uncached


def test_clear_storage_backend_empties_l3_alone(tmp_path, uncached):
    with start_server(_store(tmp_path)) as s:
        generate(s.url)
        r = requests.get(s.url + "/clear_hicache_storage_backend", timeout=60)
        assert r.status_code == 200 and r.json() == "Hierarchical cache storage backend cleared."
        objects = [p for p in (tmp_path / "objects").rglob("*") if p.is_file()]
        assert objects == []
        hot = generate(s.url)                 # L1 kept its copy
        assert tiers(hot)["device"] > 0
        requests.post(s.url + "/flush_cache", timeout=60)
        cold = generate(s.url)                # L1, L2 flushed and L3 empty: nothing cached
        assert requests.post(s.url + "/hicache/storage-backend/clear",
                             timeout=60).status_code == 200
    assert cold["meta_info"]["cached_tokens"] == 0, tiers(cold)
    assert hot["output_ids"] == cold["output_ids"] == uncached


def test_clear_storage_without_l3_is_a_400():
    with start_server(ServerConfig(port=0, l1_tokens=1024, l2_tokens=0)) as s:
        r = requests.post(s.url + "/clear_hicache_storage_backend", timeout=30)
    assert r.status_code == 400 and "storage backend" in r.json()["error"]["message"]


# ---------------------------------------------------------------- SGLang's launch line


def test_an_sglang_launch_line_starts_and_maps_its_options():
    proc, url = spawn("--model-path", "tiny", "--tp-size", "1", "--enable-hierarchical-cache",
                      "--context-length", "512", "--mem-fraction-static", "0.8",
                      "--trust-remote-code", "--enable-metrics", "--l1-tokens", "1024",
                      base=["--format", "json"])
    try:
        info = requests.get(url + "/get_model_info", timeout=30).json()
        too_long = requests.post(url + "/generate", timeout=60, json={
            "input_ids": [1] * 500, "sampling_params": {"max_new_tokens": 20}})
        ok = requests.post(url + "/generate", timeout=60, json={
            "input_ids": [1] * 100, "sampling_params": {"max_new_tokens": 4}})
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=60)
    assert info["max_context"] == 512
    assert too_long.status_code == 400 and "512" in too_long.text
    assert ok.status_code == 200
    assert "--mem-fraction-static (SGLang) accepted" in err


def _serve_fails(*args: str) -> tuple[int, list[str]]:
    r = subprocess.run([sys.executable, "-m", "hicache_cli.app", "bench", "serve", *args],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    return r.returncode, r.stderr.strip().splitlines()


@pytest.mark.parametrize("args, says", [
    (["--random-seed", "3"], "sampling_params.seed"),
    (["--dp-size", "2"], "router"),
    (["--quantization", "fp8"], "quantized"),
    (["--dtype", "float16"], "only auto"),
    (["--context-length", "0"], ">= 1"),
    (["--context-length", "99999999"], "exceeds the model's context"),
    (["--mem-fraction-static", "1.5"], "(0, 1]"),
    (["--disaggregation-mode", "both"], "choose null, prefill or decode"),
    (["--l1-token", "5"], "did you mean --l1-tokens"),
    (["--enable-metrics=1"], "takes no value"),
    (["--context-length"], "needs a value"),
])
def test_unmappable_or_wrong_options_are_one_line_usage_errors(args, says):
    code, lines = _serve_fails("--port", "0", *args)
    assert code == 2, lines
    assert len(lines) <= 2 and says in lines[0], lines


def test_sglang_table_entries_are_well_formed():
    for flag, spec in TABLE.items():
        assert flag.startswith("--") and spec.action in ("set", "noop", "note", "refuse")
        assert spec.action != "refuse" or spec.say, flag
        assert spec.action != "set" or spec.apply is not None, flag
    opts: dict = {"disaggregation": None}
    apply_extra(["--context-length=64", "--disaggregation-mode", "decode", "--enable-metrics"],
                opts, [], print)
    assert opts == {"disaggregation": "decode", "context_length": 64}


@pytest.mark.parametrize("argv", [
    ["inspect", "--bogus"],
    ["bench", "replay"],
    ["bench", "serve", "--page-size", "abc"],
    ["consensus-check", "--format", "yaml", "x"],
    ["convert-layout"],
])
def test_usage_errors_are_one_line_and_a_hint(argv):
    r = subprocess.run([sys.executable, "-m", "hicache_cli.app", *argv], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2, r.stderr
    assert len(lines) == 2 and lines[0].startswith("error: ") and "--help" in lines[1], lines
    assert "╭" not in r.stderr and "Traceback" not in r.stderr
