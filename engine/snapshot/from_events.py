"""The tree a recorded KV-event stream implies (``hicache inspect RECORDING``).

A recording (:mod:`formats.kv_events`, written by ``hicache bench record-events``) is replayed
into the blocks each medium holds; the blocks become snapshot nodes (one per run of blocks that
a parent has as its only child, with the same media), so every snapshot view — summary, tree,
hot prefixes, prompt hits, diff — reads it like a snapshot. Media map to tiers: ``GPU`` L1,
``CPU_PINNED`` L2, ``DISK``/``EXTERNAL`` L3. Page ids are not on the wire: the nodes get
numbered placeholders; hit counts, locks and access times are 0. Blocks whose parent links
never reach a root (a cycle in a hostile stream) are left out.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from engine.core.namespace import Namespace
from formats import kv_events as kv
from formats import snapshot as fmt

TIER_OF = {kv.GPU: 1, kv.CPU_PINNED: 2, kv.DISK: 4, kv.EXTERNAL: 4}


def _namespace_text(salt: str | None, lora: str | None) -> str | None:
    if salt is None and lora is None:
        return None
    return Namespace(cache_salt=salt, lora_path=lora).text()


def records_of_state(state: kv.BlockState) -> tuple[int, list[fmt.NodeRecord]]:
    """``(page_size, nodes)``: the blocks of ``state`` as snapshot records, parents first."""
    blocks: dict[int, Any] = {}
    bits: dict[int, int] = {}
    for medium, tier in state.blocks.items():
        b = TIER_OF.get(medium)
        if b is None:
            raise kv.EventsError(f"unknown medium {medium!r}")
        for h, blk in tier.items():
            blocks.setdefault(h, blk)
            bits[h] = bits.get(h, 0) | b
    sizes = {len(b.tokens) for b in blocks.values()}
    if len(sizes) > 1:
        raise kv.EventsError(f"blocks of several sizes {sorted(sizes)}")
    page = sizes.pop() if sizes else 1
    kids: dict[Any, list[int]] = {}
    for h, blk in blocks.items():
        ns = _namespace_text(blk.cache_salt, blk.lora_name)
        # a parent no medium holds: the block hangs from its namespace's root
        key = blk.parent if blk.parent in blocks else ("root", ns)
        kids.setdefault(key, []).append(h)
    roots = sorted({k[1] for k in kids if isinstance(k, tuple)},
                   key=lambda s: (s is not None, s or ""))
    out: list[fmt.NodeRecord] = []
    seen: set[int] = set()
    next_id = 0
    counters = {1: 0, 2: 0}

    def pages(tier: int, n: int) -> np.ndarray:
        start = counters[tier]
        counters[tier] += n
        return np.arange(start, start + n, dtype=np.int64)

    for ns in roots:
        root_id = next_id
        next_id += 1
        out.append(fmt.NodeRecord(root_id, None, b"", ns))
        stack = [(h, root_id) for h in sorted(kids.get(("root", ns), []), reverse=True)]
        while stack:
            h, parent_id = stack.pop()
            if h in seen:                   # a hostile stream's parent cycle
                continue
            seen.add(h)
            run = [h]
            while len(kids.get(run[-1], ())) == 1 and bits[kids[run[-1]][0]] == bits[h] \
                    and kids[run[-1]][0] not in seen:
                run.append(kids[run[-1]][0])
                seen.add(run[-1])
            b = bits[h]
            toks = np.array([t for x in run for t in blocks[x].tokens], dtype="<u4")
            node_id = next_id
            next_id += 1
            out.append(fmt.NodeRecord(
                node_id, parent_id, toks.tobytes(), ns,
                pages(1, len(run)).tobytes() if b & 1 else None,
                pages(2, len(run)).tobytes() if b & 2 else None,
                len(run) if b & 4 else 0))
            stack.extend((c, node_id) for c in sorted(kids.get(run[-1], []), reverse=True)
                         if c not in seen)
    return page, out


def load_recording(path: str | os.PathLike) -> tuple[bytes, dict]:
    """A recording as snapshot bytes, and what the header said (``EventsError`` when bad)."""
    header, state = kv.state_of_recording(path)
    page, nodes = records_of_state(state)
    created = header.get("started_at")
    meta = {"source": "kv-events recording", "batches": state.batches, "events": state.events}
    for key in ("endpoint", "topic"):
        if isinstance(header.get(key), str):
            meta[key] = header[key][:200]
    hdr = fmt.make_header(page, created_at=created if type(created) in (int, float)
                          and 0 <= created < fmt.MAX_CREATED_AT else None, meta=meta)
    return fmt.encode_snapshot(hdr, nodes), header
