"""`bench serve --pp 2`: stage processes with their own layers and KV, kept consistent by pp_sync
(docs/parallelism.md §2). Outputs equal one stage's; the stages' rank logs agree — and without
pp_sync they do not, with the ACK mismatch first."""

from __future__ import annotations

import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import requests
import torch
from typer.testing import CliRunner

from engine.cache.pool import DevicePool
from engine.runtime.config import parse_delay
from engine.runtime.launch import ServerConfig, start_server
from engine.runtime.model import Chunk, load_model
from engine.runtime.ranks.pipeline import micro_batches, stage_layers, stage_model
from formats.ranklog import read_ranklog
from hicache_cli.app import app
from tests.serve_client import generate

PROMPTS = [np.random.default_rng(i).integers(0, 256, 200).tolist() for i in range(3)]


def workload(url: str) -> list:
    """A fresh prompt, again (an L1 hit), two others that push it out of the small L1, and the
    first once more (an L2 restore)."""
    a, b, c = PROMPTS
    return [generate(url, p) for p in (a, a, b, c, a)]


def serve(**kw):
    return start_server(ServerConfig(port=0, l1_tokens=512, l2_tokens=4096, **kw))


@pytest.fixture(scope="module")
def one_stage():
    h = serve()
    try:
        return workload(h.url)
    finally:
        h.stop()


def check(path) -> tuple[int, dict]:
    r = CliRunner().invoke(app, ["consensus-check", str(path), "--format", "json"])
    return r.exit_code, json.loads(r.stdout)


def test_stage_split_and_delay_parsing():
    assert [stage_layers(4, 2, s) for s in range(2)] == [(0, 2), (2, 4)]
    assert [stage_layers(5, 3, s) for s in range(3)] == [(0, 2), (2, 4), (4, 5)]
    with pytest.raises(ValueError, match="1..4 stages"):
        stage_layers(4, 5, 0)
    assert parse_delay("1:20", 2) == {1: 0.02}
    for bad in ("2:10", "x", "1:-3"):
        with pytest.raises(ValueError, match="debug-transfer-delay"):
            parse_delay(bad, 2)
    with pytest.raises(ValueError, match="needs --pp"):
        ServerConfig(debug_transfer_delay="1:5")


def test_two_stages_equal_one_with_a_delayed_stage(one_stage, tmp_path):
    h = serve(pp=2, debug_transfer_delay="1:20", rank_log_dir=str(tmp_path))
    try:
        got = workload(h.url)
        flushed = requests.post(h.url + "/flush_cache", timeout=60).json()
    finally:
        h.stop()
    assert [g[0] for g in got] == [o[0] for o in one_stage]
    assert flushed["l1_used_tokens"] == 0 and flushed["l2_used_tokens"] == 0, flushed
    assert got[1][1]["device"] > 0                    # L1 hit
    assert got[4][1]["host"] > 0                      # restored from L2
    code, report = check(tmp_path)
    assert code == 0, report
    assert report["ranks"] == 2


def test_without_pp_sync_the_ack_mismatch_shows_first(tmp_path):
    h = serve(pp=2, pp_sync=False, debug_transfer_delay="1:60", rank_log_dir=str(tmp_path))
    try:
        workload(h.url)
    finally:
        h.stop()
    code, report = check(tmp_path)
    assert code == 3
    assert report["divergences"][0]["category"] == "pp_ack_consumption_mismatch", report


def test_l3_hits_across_pipeline_servers(one_stage, tmp_path):
    store = dict(hicache_storage_backend="file", hicache_storage_dir=str(tmp_path / "l3"),
                 hicache_storage_prefetch_policy="wait_complete")
    for _ in range(2):         # the second pipeline starts cold: prefixes come from L3
        h = serve(pp=2, **store)
        try:
            out, details = generate(h.url, PROMPTS[0])
        finally:
            h.stop()
        assert out == one_stage[0][0]
    assert details["storage"] > 0


@pytest.mark.parametrize("policy,delay,timeout,waited", [
    ("best_effort", "1:40", 2.0, False),
    ("timeout", "1:40", 2.0, True),          # stage 0 fast: the fetch lands in time
    ("timeout", "0:400", 0.05, False),       # stage 0 slow: released at the timeout
])
def test_l3_prefetches_land_at_the_same_step_on_every_stage(one_stage, tmp_path, policy,
                                                            delay, timeout, waited):
    """best_effort / timeout prefetches are not committed at admission; their results are
    consumed through pp_sync (queue ``storage``), so a delayed stage 1 commits them at the
    step stage 0 does: outputs equal, logs consistent, L3 pages reached the tree. Under timeout
    the request waits (in the queue) for its fetch and counts the pages as L3 hits, unless the
    timeout passes first (stage 0 releases it: the same step on every stage)."""
    store = dict(hicache_storage_backend="file", hicache_storage_dir=str(tmp_path / "l3"))
    h = serve(pp=2, hicache_storage_prefetch_policy="wait_complete", **store)
    try:                                 # write the store, then start cold
        generate(h.url, PROMPTS[0])
    finally:
        h.stop()
    logs = tmp_path / "logs"
    h = serve(pp=2, hicache_storage_prefetch_policy=policy, debug_transfer_delay=delay,
              hicache_storage_prefetch_timeout=timeout, rank_log_dir=str(logs), **store)
    try:
        got = [generate(h.url, p) for p in (PROMPTS[0], PROMPTS[1], PROMPTS[0])]
        time.sleep(1.0)                  # idle steps consume what a slow stage 0 finishes late
        issued = h.engine.cache.counters["prefetch_pages_issued"]
    finally:
        h.stop()
    assert [g[0] for g in got] == [one_stage[i][0] for i in (0, 2, 0)]
    assert issued > 0
    # whether the first request waited for its fetch and used it
    assert (got[0][1]["storage"] > 0) == waited, got[0][1]
    code, report = check(logs)
    assert code == 0, report
    for rank in (0, 1):
        acks = [e for e in read_ranklog(logs / f"rank{rank}.ranklog")[1]
                if e["kind"] == "pp_ack" and e["queue"] == "storage"]
        assert sum(e["consumed"] for e in acks) > 0


def test_a_dead_stage_stops_the_server_cleanly():
    h = serve(pp=2, collective_timeout_s=10)
    try:
        generate(h.url, PROMPTS[0])
        os.kill(h.engine.group.pids()[1], signal.SIGKILL)
        deadline = time.monotonic() + 30
        while True:
            r = requests.get(h.url + "/health", timeout=10)
            if r.status_code == 503:
                break
            assert time.monotonic() < deadline, "health stayed ok after a stage died"
            time.sleep(0.2)
        assert "stage 1" in r.text
        t0 = time.monotonic()
        resp = requests.post(h.url + "/generate", json={"input_ids": PROMPTS[1],
                             "sampling_params": {"max_new_tokens": 4}}, timeout=60)
        assert resp.status_code >= 500 or "error" in resp.text
        assert time.monotonic() - t0 < 30
    finally:
        h.stop()


@pytest.mark.parametrize("writer,reader", [(2, 1), (1, 2)])
def test_a_store_written_by_one_pipeline_shape_serves_another(one_stage, tmp_path, writer, reader):
    """The unified L3 layout names objects by layer range, not by stage: a store written by
    --pp 2 is hit by --pp 1 and the reverse (docs/storage.md, docs/parallelism.md §4)."""
    store = dict(hicache_storage_backend="file", hicache_storage_dir=str(tmp_path / "l3"),
                 hicache_storage_prefetch_policy="wait_complete")
    h = serve(pp=writer, **store)
    try:
        assert generate(h.url, PROMPTS[0])[0] == one_stage[0][0]
    finally:
        h.stop()
    h = serve(pp=reader, **store)
    try:
        out, details = generate(h.url, PROMPTS[0])
    finally:
        h.stop()
    assert out == one_stage[0][0] and details["storage"] > 0, details


def test_micro_batches_cut_the_batch_in_order():
    pages = np.arange(8)
    chunks = [Chunk([5], 9, pages), Chunk(np.arange(10), 0, pages, all_logits=True),
              Chunk(np.arange(7) + 20, 3, pages), Chunk([6], 4, pages)]
    for n in (1, 2, 3, 5, 40):
        mbs = micro_batches(chunks, n, min_tokens=1)
        assert 1 <= len(mbs) <= min(n, 19) and all(mbs)
        pieces = iter(c for mb in mbs for c in mb)
        for c in chunks:              # each chunk comes back as consecutive pieces, in order
            toks, start = [], c.start
            while len(toks) < len(c):
                piece = next(pieces)
                assert piece.start == start and piece.all_logits == c.all_logits
                toks += list(piece.tokens)
                start += len(piece)
                assert piece.logits == (len(toks) == len(c))   # only the last piece's logits
            assert toks == list(c.tokens)
        assert next(pieces, None) is None
    assert len(micro_batches(chunks, 2, min_tokens=1)) == 2
    assert [len(mb) for mb in micro_batches([Chunk([1], 0, pages)] * 4, 2, 1)] == [2, 2]
    assert len(micro_batches(chunks, 4, min_tokens=8)) == 2      # 19 tokens: two of >= 8
    assert len(micro_batches([Chunk([1], 0, pages)] * 4, 2, 8)) == 1   # a small decode step


def test_two_stages_over_micro_batches_compute_what_one_model_does():
    """The two stage models over cut micro-batches, stage by stage (each with its own KV),
    give the whole model's logits over the uncut batch, bit for bit."""
    model = load_model("tiny")
    s0, s1 = stage_model(model, 0, 2), stage_model(model, 1, 2)
    pools = [DevicePool(m.kv_layout(16), 64) for m in (model, s0, s1)]
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 256, n) for n in (70, 33, 5)]
    tables = [[p.allocator.alloc(-(-len(t) // 16)) for t in prompts] for p in pools]

    def batch(k):
        return [Chunk(t, 0, tables[k][i], all_logits=i == 1) for i, t in enumerate(prompts)]

    whole = model.forward(batch(0), pools[0].buf, 16)
    outs = []
    for mb0, mb1 in zip(micro_batches(batch(1), 3), micro_batches(batch(2), 3)):   # 108 tokens
        hidden = s0.forward(mb0, pools[1].buf, 16, hidden_out=True)
        outs.append(s1.forward(mb1, pools[2].buf, 16, hidden_in=hidden))
    assert len(outs) == 3 and torch.equal(torch.cat(outs), whole)


def test_concurrent_requests_interleave_as_micro_batches(tmp_path):
    """Several requests at once: the pipeline cuts its steps into micro-batches (stage 1
    delayed); outputs equal one stage's, the stages' logs agree."""
    prompts = [np.random.default_rng(10 + i).integers(0, 256, n).tolist()
               for i, n in enumerate((150, 40, 90, 60))]

    def run(**kw):
        h = serve(**kw)
        try:
            with ThreadPoolExecutor(len(prompts)) as pool:
                outs = list(pool.map(lambda p: generate(h.url, p)[0], prompts + prompts))
            return outs, getattr(h.engine.scheduler, "mb_stats", None)
        finally:
            h.stop()

    want, _ = run()
    got, stats = run(pp=2, debug_transfer_delay="1:20", rank_log_dir=str(tmp_path))
    assert got == want
    assert stats["split_steps"] > 0 and stats["micro_batches"] > stats["steps"], stats
    code, report = check(tmp_path)
    assert code == 0, report
