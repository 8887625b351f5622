"""The CP per-layer gather on 2 real gloo ranks: owner-grouped scratch, logical order through the
page table, two alternating buffers, and a planted late restore the gather must wait for."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from engine.parallel.cp import CPShape
from engine.parallel.cp_gather import GatherPlan, LayerGather
from engine.parallel.launch import RankFailed, run_ranks

N, P, LAYERS, KINDS, HEADS, DIM = 2, 4, 3, 2, 2, 3
ROWS = 8                                           # pages in each rank's local pool
# five logical pages on the rotation 1, 0, 1, 0, 1: (local page, owner) -> q = local * N + owner
LOGICAL = np.array([2 * 2 + 1, 3 * 2 + 0, 5 * 2 + 1, 0 * 2 + 0, 1 * 2 + 1])
TOKENS = 18                                        # the last page is half full
LATE = 0.4                                         # seconds rank 1's layer-1 restore is late


def value(layer: int, kind: int, pos) -> torch.Tensor:
    """What the KV of a position is (any injective function will do)."""
    v = torch.as_tensor(pos, dtype=torch.float32) + 1000 * layer + 100000 * kind + 1
    return v.view(-1, 1, 1).expand(-1, HEADS, DIM)


def expected(layer: int, kind: int) -> torch.Tensor:
    return value(layer, kind, np.arange(TOKENS))


def _rank(rank: int, world: int) -> dict:
    shape = CPShape(world, P)
    pool = torch.zeros((LAYERS, KINDS, ROWS * P, HEADS, DIM))
    restored = threading.Event()
    restored_at = [0.0]

    def write(layer):
        for i, q in enumerate(LOGICAL.tolist()):
            if q % world == rank:
                rows = torch.arange(P) + (q // world) * P
                for kind in range(KINDS):
                    pool[layer, kind, rows] = value(layer, kind, np.arange(i * P, i * P + P))

    for layer in range(LAYERS):
        if not (rank == 1 and layer == 1):
            write(layer)

    def restore_late():                           # rank 1's layer 1 arrives late
        time.sleep(LATE)
        write(1)
        restored_at[0] = time.monotonic()
        restored.set()

    ready = None
    if rank == 1:
        threading.Thread(target=restore_late, daemon=True).start()

        def ready(layer):
            if layer == 1:
                restored.wait()

    plan = GatherPlan.build(shape, LOGICAL)
    g = LayerGather(plan, rank, pool, [plan.slots(TOKENS)], ready=ready)
    ok = []
    for layer in range(LAYERS):
        got, = g.wait(layer)
        ok.append(all(torch.equal(got[k], expected(layer, k)) for k in range(KINDS)))
        g.release(layer)
    g.close()
    return {"ok": ok, "gathered_at": g.gathered_at, "restored_at": restored_at[0],
            "peak": g.peak_scratch_bytes, "per_rank": plan.per_rank,
            "table": plan.table.tolist()}


def test_gather_reads_logical_order_and_waits_for_a_late_restore():
    r0, r1 = run_ranks(_rank, N, timeout_s=60)
    assert r0["ok"] == [True] * LAYERS and r1["ok"] == [True] * LAYERS
    # grouped by owner: rank 0's pages 1, 3 then rank 1's pages 0, 2, 4, in blocks of 3
    assert r0["per_rank"] == 3 and r0["table"] == [3, 0, 4, 1, 5]
    # layer 1's gather finished after rank 1's late restore, on both ranks (one collective)
    assert r0["gathered_at"][1] >= r1["restored_at"] and r1["gathered_at"][1] >= r1["restored_at"]
    # two alternating buffers: 2 x (ranks x kinds x 3 pages x P tokens x heads x dim) floats
    assert r0["peak"] == 2 * N * KINDS * 3 * P * HEADS * DIM * 4


def test_plan_pads_and_inverts():
    shape = CPShape(3, 2)
    plan = GatherPlan.build(shape, np.array([4, 8, 3, 10, 5]))    # owners 1, 2, 0, 1, 2
    assert plan.per_rank == 2
    assert [r.tolist() for r in plan.rows] == [[1], [1, 3], [2, 1]]
    assert plan.table.tolist() == [2, 4, 0, 3, 5]
    assert plan.slots(5).tolist() == [4, 5, 8, 9, 0]


def _dies(rank: int, world: int) -> None:
    import os

    import torch.distributed as dist

    if rank == 1:
        os._exit(7)
    dist.barrier()


def test_a_dead_rank_is_named():
    with pytest.raises(RankFailed, match="rank 1"):
        run_ranks(_dies, 2, timeout_s=30, collective_timeout_s=5)
