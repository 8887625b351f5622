"""``hicache bench`` (the main job) on a tiny configuration, both formats, and its failures."""

import json
import urllib.error
import urllib.request

import pytest
from typer.testing import CliRunner

from engine.runtime.serving import ServerConfig
from hicache_cli.app import app
from hicache_cli.bench.main_job import MainJobConfig, check_config, embedded_server

runner = CliRunner()
TINY = ["--num-clients", "3", "--num-rounds", "3", "--request-length", "48",
        "--output-length", "2", "--concurrency", "2", "--l1-tokens", "256", "--l2-tokens", "8192"]


def test_main_job_json():
    r = runner.invoke(app, ["bench", *TINY, "--format", "json"])
    assert r.exit_code == 0, r.output
    res = json.loads(r.stdout)
    a, b = res["runs"]["l1_only"], res["runs"]["hicache"]
    assert a["requests"] == b["requests"] == {"sent": 9, "ok": 9, "failed": 0}
    # same prompts in both runs; L1 alone thrashes, HiCache serves the histories from L2
    assert a["tokens"]["prompt"] == b["tokens"]["prompt"] == 3 * (48 + 98 + 148)
    assert a["tokens"]["host"] == 0 and b["tokens"]["host"] > 0
    assert b["hit_rate"]["total"] > a["hit_rate"]["total"] + 0.3
    assert res["config"]["l1_tokens"] == 256 and res["wall_s"] > 0


def test_main_job_human():
    r = runner.invoke(app, ["bench", *TINY, "--no-storage"])
    assert r.exit_code == 0, r.output
    assert "L1 only" in r.stdout and "HiCache L1+L2" in r.stdout
    assert "hit rate host" in r.stdout and "TTFT p90" in r.stdout
    assert "HiCache vs L1 only: hit rate" in r.stdout


@pytest.mark.parametrize("args", [["--num-clients", "0"], ["--l1-tokens", "4"],
                                  ["--format", "xml"], ["--device", "tpu"],
                                  ["--num-rounds", "30"],
                                  # 492 + 8 tokens fit 500 but not its 31 whole pages (496)
                                  ["--num-clients", "1", "--num-rounds", "2",
                                   "--request-length", "242", "--output-length", "8",
                                   "--l1-tokens", "500"]])
def test_bad_options_exit_2(args):
    r = runner.invoke(app, ["bench", *TINY, *args])
    assert r.exit_code == 2, r.output
    if "--num-rounds" in args:
        assert "raise --l1-tokens" in r.stderr and r.stderr.count("\n") == 1


def test_l1_check_counts_whole_pages_as_the_server_does():
    # the last round: prompt 488 + 8 output tokens = 495 positions with KV = 31 pages = 496
    check_config(MainJobConfig(num_clients=1, num_rounds=2, request_length=240,
                               output_length=8, l1_tokens=500, device="cpu"))
    with pytest.raises(ValueError, match="needs 512 tokens of KV"):
        check_config(MainJobConfig(num_clients=1, num_rounds=2, request_length=242,
                                   output_length=8, l1_tokens=500, device="cpu"))


def test_server_stopped_on_error():
    with pytest.raises(RuntimeError):
        with embedded_server(ServerConfig(port=0, l1_tokens=256, l2_tokens=0), "test") as url:
            assert urllib.request.urlopen(url + "/health", timeout=5).status == 200
            raise RuntimeError("boom")
    with pytest.raises((urllib.error.URLError, OSError)):
        urllib.request.urlopen(url + "/health", timeout=2)
