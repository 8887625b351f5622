"""Invariant checks of a loaded tree snapshot (``hicache inspect --check``).

The tree invariants are :func:`checkers.invariants.check_tree`, run on the snapshot's node
view; on top of those, what only a snapshot can tell: tier usage against the capacities in its
header, page ids within capacity and owned by one node, and CP owners present when sharded.
Each message starts with the invariant's name, as ``check_tree``'s do.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from checkers.invariants import check_tree, tier_pages


def check_snapshot(snap: Any) -> list[str]:
    out = check_tree(snap)
    p = snap.page_size
    for tier in ("l1", "l2"):
        pages, dup = tier_pages(snap, tier)
        out += dup
        cap = snap.capacity.get(tier)
        if cap is None or not pages.size:
            continue
        cap_pages = cap // p
        if pages.size > cap_pages:
            out.append(f"capacity: {tier.upper()} holds {pages.size * p} tokens, the snapshot's "
                       f"capacity is {cap}")
        bad = pages[(pages < 0) | (pages >= cap_pages)]
        if bad.size:
            out.append(f"slots: {tier.upper()} page ids {np.unique(bad)[:8].tolist()} are "
                       f"outside the {cap_pages} pages of capacity")
    cp_size = int(snap.rank.get("cp_size", 1))
    if cp_size > 1:
        missing = [n.id for n in snap.iter_nodes() if n.cp_owner is None]
        if missing:
            out.append(f"cp owner: {len(missing)} node(s) of a CP-sharded snapshot (cp_size "
                       f"{cp_size}) have no owner, e.g. node {missing[0]}")
    return out
