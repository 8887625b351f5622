"""`bench serve --pp 2 --tp 2` (and `--pp 2 --cp 2`, `--pp 2 --tp 2 --cp 2`): two pipeline
stages, each a TP / CP group (engine.runtime.topology, docs/parallelism.md). Greedy outputs equal
one process's for a fresh prompt, an L1 hit and an L2 restore with a delayed stage; all rank logs
agree (stage 0's ranks agree on the ACK counts, every later rank consumes exactly those); a
killed rank stops the pipeline with a message naming it; L3 objects are the unified ones, so a
store written by the grid serves one process and the reverse."""

from __future__ import annotations

import json
import os
import signal

import pytest
import requests
from typer.testing import CliRunner

from engine.runtime.launch import ServerConfig, start_server
from engine.runtime.model import preset
from formats.ranklog import read_ranklog
from hicache_cli.app import app
from tests.test_pipeline_serve import PROMPTS, check, generate, serve, workload
from tests.test_tp_serve import _kv_bytes, _used

GRID = dict(pp=2, tp=2)
SHAPES = {"pp2xtp2": dict(pp=2, tp=2), "pp2xcp2": dict(pp=2, cp=2),
          "pp2xtp2xcp2": dict(pp=2, tp=2, cp=2)}


def serve_shape(**kw):
    """A server whose L1 holds 512 tokens in all (``--l1-tokens`` is per CP rank), as
    tests.test_pipeline_serve.serve's does."""
    cp = kw.get("cp", 1)
    return start_server(ServerConfig(port=0, l1_tokens=512 // cp, l2_tokens=4096, **kw))


@pytest.fixture(scope="module")
def one_process():
    h = serve()
    try:
        return workload(h.url)
    finally:
        h.stop()


def _acks(path) -> list:
    header, events = read_ranklog(path)
    return header, [(e["queue"], e["consumed"]) for e in events if e["kind"] == "pp_ack"]


@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
def test_the_grid_equals_one_process_and_its_logs_agree(one_process, tmp_path, shape):
    kw = SHAPES[shape]
    world = 2 * kw.get("tp", 1) * kw.get("cp", 1)
    h = serve_shape(**kw, debug_transfer_delay="1:20", rank_log_dir=str(tmp_path))
    try:
        got = workload(h.url)
        metrics = requests.get(h.url + "/metrics", timeout=10).text
    finally:
        h.stop()
    assert got == one_process                          # tokens and hits, tier by tier
    assert got[1][1]["device"] > 0 and got[4][1]["host"] > 0    # an L1 hit, an L2 restore
    code, report = check(tmp_path)
    assert code == 0, report
    assert report["ranks"] == world
    acks = {}
    for r in range(world):
        header, acks[r] = _acks(tmp_path / f"rank{r}.ranklog")
        assert header["pp_rank"] == r // (world // 2) and header["world_size"] == world
        assert (header["tp_size"], header["cp_size"]) == (kw.get("tp", 1), kw.get("cp", 1))
    assert sum(n for q, n in acks[0] if q == "backup") > 0     # pp_sync consumed backups
    assert all(acks[r] == acks[0] for r in range(world))
    if shape != "pp2xtp2":
        return
    # stage 0's ranks hold half the layers × half the kv-heads each
    whole = preset("tiny").kv_layout(16)
    kv = _kv_bytes(metrics)
    for tier in ("device", "host"):
        used = _used(metrics, tier)
        assert used > 0
        for r in (0, 1):
            assert kv[(str(r), tier)] == used // 16 * whole.shard(2, r, 2, 0).page_bytes
    assert whole.shard(2, 0, 2, 0).page_bytes * 4 == whole.page_bytes
    for r in range(4):
        header, _ = _acks(tmp_path / f"rank{r}.ranklog")
        assert (header["pp_rank"], header["tp_rank"]) == divmod(r, 2)


def test_stage_0_tp_ranks_agree_on_the_counts_they_pass_down(one_process, tmp_path):
    """Only stage 0's TP rank 1 is slow (``0.1:60``): its copies finish later than its TP
    peer's, so the two would pass different ACK counts down their columns; the minimum over
    stage 0's TP group keeps all four ranks consuming the same (without that agreement this
    run's logs diverge at ``pp_ack``)."""
    h = serve(**GRID, debug_transfer_delay="0.1:60", rank_log_dir=str(tmp_path))
    try:
        got = workload(h.url)
    finally:
        h.stop()
    assert got == one_process
    code, report = check(tmp_path)
    assert code == 0, report
    acks = [_acks(tmp_path / f"rank{r}.ranklog")[1] for r in range(4)]
    assert all(a == acks[0] for a in acks)




@pytest.mark.parametrize("writer,reader", [
    ((2, 2, 1), (1, 1, 1)), ((1, 1, 1), (2, 2, 1)), ((2, 1, 2), (1, 1, 1)),
    ((1, 1, 1), (2, 1, 2))], ids=["pp2xtp2-to-one", "one-to-pp2xtp2", "pp2xcp2-to-one",
                                  "one-to-pp2xcp2"])
def test_a_store_written_by_the_grid_serves_one_process_and_back(one_process, tmp_path, writer,
                                                                  reader):
    """Each rank's objects are its region (layers of its stage × kv-heads of its TP rank) of
    the unified layout: the grid's store is hit by one process and the reverse. The cold reader
    uses the default prefetch policy (timeout) with its stage 1 delayed; its logs agree."""
    store = dict(hicache_storage_backend="file", hicache_storage_dir=str(tmp_path / "l3"))
    shape = lambda pp, tp, cp: dict(pp=pp, tp=tp, cp=cp)               # noqa: E731
    h = serve_shape(**shape(*writer), hicache_storage_prefetch_policy="wait_complete", **store)
    try:
        assert generate(h.url, PROMPTS[0])[0] == one_process[0][0]
    finally:
        h.stop()
    logs = tmp_path / "logs"
    extra = dict(debug_transfer_delay="1:40", rank_log_dir=str(logs)) if reader[0] > 1 else {}
    h = serve_shape(**shape(*reader), **extra, **store)
    try:
        out, details = generate(h.url, PROMPTS[0])
    finally:
        h.stop()
    assert out == one_process[0][0] and details["storage"] > 0, details
    if reader[0] > 1:
        code, report = check(logs)
        assert code == 0 and report["ranks"] == 4, report


def test_rank_delays_parse():
    from engine.runtime.config import delay_for, parse_delay

    assert parse_delay("0.1:60,1:20", 2, 2) == {(0, 1): 0.06, 1: 0.02}
    assert [delay_for("0.1:60,1:20", 2, 2, s, t) for s in (0, 1) for t in (0, 1)] == \
        [0.0, 0.06, 0.02, 0.02]
    for bad, tp in (("0.2:5", 2), ("0.1:5", 1), ("0.1.1:5", 2)):
        with pytest.raises(ValueError, match="debug-transfer-delay"):
            parse_delay(bad, 2, tp)


def test_without_pp_sync_the_grid_logs_show_the_ack_mismatch_first(tmp_path):
    h = serve(**GRID, pp_sync=False, debug_transfer_delay="1:60", rank_log_dir=str(tmp_path))
    try:
        workload(h.url)
    finally:
        h.stop()
    code, report = check(tmp_path)
    assert code == 3
    assert report["divergences"][0]["category"] == "pp_ack_consumption_mismatch", report


def test_bench_serve_pp2_tp2_serves_the_shared_script_and_stops_cleanly(tmp_path):
    """The CLI: the same tokens and hits as one process on the shared request script (device
    hit, host restore); Ctrl-C stops all four processes, exit 0, no traceback."""
    from tests.serve_client import SCRIPT
    from tests.serve_client import spawn as _spawn

    one, url1 = _spawn()
    snaps = tmp_path / "snaps"
    grid, url2 = _spawn("--pp", "2", "--tp", "2", "--rank-log-dir", str(tmp_path),
                        "--dump-tree-on-exit", f"{snaps}/")
    try:
        got1 = [generate(url1, ids) for ids in SCRIPT]
        got2 = [generate(url2, ids) for ids in SCRIPT]
    finally:
        for p in (one, grid):
            p.send_signal(signal.SIGINT)
        errs = [p.communicate(timeout=90)[1] for p in (one, grid)]
    assert (one.returncode, grid.returncode) == (0, 0), errs
    assert "Traceback" not in errs[1], errs[1]
    assert got2 == got1
    assert got2[2][1]["device"] == 96 and got2[-1][1]["host"] > 0
    assert sorted(p for p in os.listdir(tmp_path) if p.endswith(".ranklog")) == \
        [f"rank{r}.ranklog" for r in range(4)]
    code, report = check(tmp_path)
    assert code == 0, report
    # every rank wrote its tree, and the four trees are the same logical tree
    trees = []
    for r in range(4):
        res = CliRunner().invoke(app, ["inspect", str(snaps / f"tree-rank{r}.snapshot"),
                                       "--format", "json"])
        assert res.exit_code == 0, res.output
        trees.append(json.loads(res.stdout))
    for r, t in enumerate(trees):
        assert (t["snapshot"]["rank"]["pp_rank"], t["snapshot"]["rank"]["tp_rank"]) == \
            divmod(r, 2)
        layout = t["snapshot"]["model"]["layout"]         # its layers × its kv-head
        assert (layout["layer_start"], layout["head_start"]) == (2 * (r // 2), r % 2)
        assert t["summary"] == trees[0]["summary"] and t["tree"] == trees[0]["tree"]
    assert trees[0]["summary"]["nodes"] > 1


def test_a_grid_with_cp_refuses_the_memory_store_in_one_line():
    res = CliRunner().invoke(app, ["bench", "serve", "--pp", "2", "--cp", "2",
                                   "--hicache-storage-backend", "memory"])
    assert res.exit_code == 2 and "memory L3 backend" in res.output, res.output
    assert "Traceback" not in res.output




