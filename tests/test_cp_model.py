"""CP on 2 real gloo ranks with the tiny model (GQA and MLA): KV pages sharded by owner, the
per-layer gather, and greedy outputs equal to a single rank for a fresh prompt, an L1 prefix hit
and a prefix restored from L2 (each rank restoring only its pages, one layer arriving late)."""

from __future__ import annotations

import threading
import time

import numpy as np
import torch

from engine.parallel.cp import CPShape, OwnerAllocator
from engine.parallel.launch import run_ranks
from engine.runtime.model import Chunk, load_model
from engine.runtime.ranks.cp_kv import ShardedKV

PS = 16
NEW = 5                         # greedy tokens per request
ROWS = 16                       # pages in each rank's pool


def _prompt(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 256, n).tolist()


def greedy(model, kv_for, toks: list[int], start: int, pages: np.ndarray) -> list:
    """Prefill ``toks[start:]`` over a cached ``toks[:start]``, then decode NEW tokens greedily;
    returns the tokens and every step's logits. ``kv_for(chunk, first)`` is what the forward
    reads and writes KV through."""
    seq = list(toks)
    chunk = Chunk(seq[start:], start, pages)
    out, rows = [], []
    first = True
    while True:
        io = kv_for(chunk, first)
        try:
            logits = model.forward([chunk], io, PS)
        finally:
            if hasattr(io, "close"):
                io.close()
        first = False
        out.append(int(logits[0].argmax()))
        rows.append(logits[0])
        if len(out) == NEW:
            return [out, torch.stack(rows)]
        seq.append(out[-1])
        chunk = Chunk([out[-1]], len(seq) - 1, pages)


def _rank(rank: int, world: int) -> dict:
    return {spec: _one_model(spec, rank, world) for spec in ("tiny", "tiny-mla")}


def _one_model(spec: str, rank: int, world: int) -> dict:
    shape = CPShape(world, PS)
    model = load_model(spec, "cpu")              # bit for bit: the exact (CPU) kernels
    lay = model.kv_layout(PS)
    a = _prompt(45, 1)
    b = a[:32] + _prompt(13, 2)                   # shares A's first two pages
    n_pages = -(-(45 + NEW) // PS)
    # the single-rank reference: one full pool, every prompt computed from scratch
    full = torch.zeros((lay.num_layers, lay.kv_kinds, 2 * n_pages * PS, lay.kv_heads,
                        lay.head_dim), dtype=lay.torch_dtype)
    ref_a = greedy(model, lambda c, f: full, a, 0, np.arange(n_pages))
    ref_b = greedy(model, lambda c, f: full, b, 0, np.arange(n_pages, 2 * n_pages))
    # bit for bit: the same tokens and the same logits at every step
    same = (lambda x, y: x[0] == y[0] and torch.equal(x[1], y[1]))

    # CP: this rank's pool holds only its pages; page ids are logical
    alloc = OwnerAllocator(shape, ROWS, "L1")
    pool = torch.zeros((lay.num_layers, lay.kv_kinds, ROWS * PS, lay.kv_heads,
                        lay.head_dim), dtype=lay.torch_dtype)
    peak = []

    def sharded(ready=None):
        def make(chunk, first):
            io = ShardedKV([chunk], pool, shape, rank, ready=ready if first else None)
            peak.append(io.peak_scratch_bytes)
            return io
        return make

    pa = alloc.alloc_rotation(n_pages, first_owner=0)
    got_a = greedy(model, sharded(), a, 0, pa)
    # an L1 hit: B reuses A's first two pages and continues their rotation
    pb = np.concatenate([pa[:2], alloc.alloc_rotation(n_pages - 2, shape.next_owner(0, 2))])
    got_b = greedy(model, sharded(), b, 32, pb)

    # L2: each rank backs up the rows of A's prefix it owns, they leave L1, come back into
    # new L1 pages of the same owners, layer by layer, layer 1 late
    prefix = pa[:2]
    mine = alloc.local_rows(prefix, rank)
    host = pool[:, :, torch.as_tensor(mine)].clone()
    alloc.free(prefix)
    pool[:, :, torch.as_tensor(mine)] = 0
    alloc.alloc(4)                                      # the freed rows get reused
    back = alloc.alloc(2, like=prefix)
    rows = torch.as_tensor(alloc.local_rows(back, rank))
    layer_done = [threading.Event() for _ in range(lay.num_layers)]

    def restore():
        for layer in range(lay.num_layers):
            if layer == 1:
                time.sleep(0.3)
            pool[layer, :, rows] = host[layer]
            layer_done[layer].set()

    threading.Thread(target=restore, daemon=True).start()
    pc = np.concatenate([back, alloc.alloc_rotation(n_pages - 2, shape.next_owner(0, 2))])
    got_c = greedy(model, sharded(lambda layer: layer_done[layer].wait()), b, 32, pc)
    # two buffers x (ranks x 2 pages (49 positions = 4 pages, 2 per rank) x one layer)
    two_layers = 2 * world * 2 * PS * lay.kv_kinds * lay.kv_heads * lay.head_dim * 4
    return {
        "fresh": same(got_a, ref_a), "l1_hit": same(got_b, ref_b),
        "l2_restore": same(got_c, ref_b), "tokens": got_a[0],
        "owners_kept": (back % world).tolist() == (prefix % world).tolist(),
        "rows_moved": len(mine) // PS, "peak_ok": max(peak) == two_layers,
    }


def test_cp2_outputs_equal_a_single_rank():
    r0, r1 = run_ranks(_rank, 2, timeout_s=240, collective_timeout_s=60)
    for spec in ("tiny", "tiny-mla"):
        for r in (r0, r1):
            got = r[spec]
            assert (got["fresh"], got["l1_hit"], got["l2_restore"]) == (True, True, True), spec
            assert got["owners_kept"] and got["peak_ok"]
        assert r0[spec]["tokens"] == r1[spec]["tokens"]
        # the two-page prefix has one page on each rank: each restored exactly its own
        assert (r0[spec]["rows_moved"], r1[spec]["rows_moved"]) == (1, 1)
