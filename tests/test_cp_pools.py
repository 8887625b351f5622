"""The cache facade with KV bytes on 2 CP ranks: each rank's pools hold its own rows, write-through
backup and load-back move only the pages a rank owns, the gather after a (late) restore gives
every rank the whole prefix in logical order, and the ranks' event logs agree."""

from __future__ import annotations

import threading
import time

import numpy as np
import torch

from engine.cache.events import EventLog, RankInfo
from engine.cache.facade import CacheConfig
from engine.parallel.cp_cache import CPCache
from engine.parallel.cp_gather import GatherPlan, LayerGather
from engine.parallel.launch import run_ranks
from tests.factories import LAYERS, kv_value, tiny_layout

P = 4
A = np.arange(100, 100 + 5 * P, dtype=np.uint32)          # 5 pages
B = np.arange(500, 500 + 3 * P, dtype=np.uint32)          # 3 pages


def write_owned(cp: CPCache, toks: np.ndarray, pages: np.ndarray, first: int) -> None:
    """What the model does on this rank: store the KV of the new pages it owns."""
    rows = torch.as_tensor(cp.l1.local_slots(pages[first:]))
    idx = np.arange(first, len(pages))
    mine = idx[pages[first:] % cp.shape.size == cp.rank]
    pos = (mine[:, None] * P + np.arange(P)).reshape(-1)
    for layer in range(LAYERS):
        for kind in range(2):
            cp.l1.buf[layer, kind, rows] = kv_value(toks[pos], pos, layer, kind)


def serve(cp: CPCache, toks: np.ndarray, rid: str) -> None:
    m = cp.match(toks, rid=rid)
    receipt = cp.lock(m)
    have = len(m.l1_pages)
    pages = np.concatenate([m.l1_pages, cp.alloc_for(m, len(toks) // P - have)])
    write_owned(cp, toks, pages, have)
    cp.insert(toks, pages, rid=rid, after=receipt)
    cp.unlock(receipt)
    cp.wait_all()


def _rank(rank: int, world: int, log_dir: str) -> dict:
    from checkers.invariants import check_cache

    cfg = CacheConfig(page_size=P, l1_tokens=6 * P, l2_tokens=16 * P, layout=tiny_layout(P),
                      write_policy="write_through")
    log = EventLog(RankInfo(rank=rank, world_size=world, cp_rank=rank, cp_size=world),
                   keep=True)
    cp = CPCache(cfg, world, events=log, rank=rank)
    serve(cp, A, "a")
    serve(cp, B, "b")
    cp.evict_l1(1 << 20)                                   # A and B now live in L2 only
    backed_up = cp.transfers.bytes_moved["backup"]
    # A again: restored from L2, the copy held back (a planted late restore)
    m = cp.match(A, rid="a2")
    receipt = cp.lock(m)
    cp.transfers.pause()
    handle = cp.load_back(m)
    resumed = [0.0]

    def late():
        time.sleep(0.3)
        resumed[0] = time.monotonic()
        cp.transfers.resume()

    threading.Thread(target=late, daemon=True).start()
    plan = GatherPlan.build(cp.shape, m.l1_pages)
    g = LayerGather(plan, rank, cp.l1.buf, [plan.slots(len(A))], ready=handle.wait_layer)
    ok = []
    pos = np.arange(len(A))
    for layer in range(LAYERS):
        (k, v), = g.wait(layer)
        ok.append(torch.equal(k, kv_value(A, pos, layer, 0))
                  and torch.equal(v, kv_value(A, pos, layer, 1)))
        g.release(layer)
    g.close()
    cp.unlock(receipt)
    cp.poll()
    problems = check_cache(cp.cache, idle=True) + cp.check_rotations()
    log.write(f"{log_dir}/rank{rank}.ranklog")
    page_bytes = P * 2 * 2 * 3 * 4 * LAYERS                # tokens x K,V x heads x dim x fp32
    return {"ok": ok, "problems": problems, "l2_hit": m.l2_len,
            "owners": (m.l1_pages % world).tolist(),
            "mine_of_a": int((m.l1_pages % world == rank).sum()),
            "loaded_bytes": cp.transfers.bytes_moved["load"], "backed_up": backed_up,
            "page_bytes": page_bytes, "first_gather": g.gathered_at[0], "resumed": resumed[0],
            "local_rows": cp.l1.buf.shape[2]}


def test_two_cp_ranks_move_only_their_pages_and_agree(tmp_path):
    from typer.testing import CliRunner

    from hicache_cli.app import app

    r0, r1 = run_ranks(_rank, 2, str(tmp_path), timeout_s=120)
    for r in (r0, r1):
        assert r["ok"] == [True] * LAYERS and r["problems"] == []
        assert r["l2_hit"] == len(A) and r["owners"] == [0, 1, 0, 1, 0]
        assert r["local_rows"] == 6 * P                    # each rank: its own budget only
        # each rank restored exactly the pages of A it owns (3 on rank 0, 2 on rank 1) …
        assert r["loaded_bytes"] == r["mine_of_a"] * r["page_bytes"]
        # … and the gather of layer 0 waited for that restore
        assert r["first_gather"] >= max(r0["resumed"], r1["resumed"])
    assert (r0["mine_of_a"], r1["mine_of_a"]) == (3, 2)
    # write-through backed up A (ranks 0, 1, 0, 1, 0) and B (started on rank 1, which had more
    # free pages: 1, 0, 1): 4 pages each
    assert r0["backed_up"] == r1["backed_up"] == 4 * r0["page_bytes"]
    res = CliRunner().invoke(app, ["consensus-check", str(tmp_path), "--format", "json"])
    assert res.exit_code == 0, res.output
    assert '"consistent": true' in res.output
