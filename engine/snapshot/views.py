"""Views of a loaded snapshot (:class:`engine.snapshot.take.SnapshotTree`), what ``hicache inspect``
shows: header info, summary, the top of the trie, hot prefixes, where a prompt would hit, CP
owners, and the diff of two snapshots.

Each view is a function of the snapshot returning plain dicts (JSON-ready); it works on the
snapshot's numpy columns (``match`` walks the node objects through the tree's own ``walk``).
"""

from __future__ import annotations

import numpy as np

from engine.cache.radix_tree import TOKEN_DTYPE
from engine.core.errors import InputError
from engine.core.namespace import parse_text, text_of
from engine.snapshot.take import TIER_NAMES, SnapshotTree, tiers_label
from formats import snapshot as fmt
from formats import snapshot_hints as fmt_hints


def info(snap: SnapshotTree) -> dict:
    h = snap.header
    return {"file": snap.path, "format": h["format"], "version": h["version"],
            "page_size": snap.page_size, "created_at": snap.created_at,
            "model": h["model"], "rank": snap.rank, "capacity": snap.capacity,
            "hint_clock": h.get("hint_clock"), "meta": h.get("meta", {})}


def hint_of(until: float, clock: float | None) -> dict | None:
    """A node's client hint as the views show it: None (no hint), or whether its session
    closed (first to go), its predicted next use on the hint clock and how far that is from the
    snapshot's hint clock (negative: past; None without a clock)."""
    if until != until:
        return None
    if until == float("inf"):
        return {"closed": True, "next_use": None, "in_s": None}
    return {"closed": False, "next_use": round(until, 3),
            "in_s": None if clock is None else round(until - clock, 3)}


def _hints_of(snap: SnapshotTree, i: int) -> dict:
    """``session``: None, True (shared by several sessions) or the client's session key."""
    c = snap.cols
    return {"session": fmt_hints.session_of(int(c.session_code[i]), c.sessions),
            "hint": hint_of(float(c.hint_until[i]), snap.header.get("hint_clock"))}


def hints_summary(snap: SnapshotTree) -> dict:
    """Nodes and tokens private to a session, shared, under a retention hint, closed; the
    sessions owning nodes; the snapshot's hint clock."""
    c, nonroot = snap.cols, ~snap.is_root
    code, until = c.session_code, c.hint_until
    hinted = nonroot & ~np.isnan(until)
    closed = hinted & np.isinf(until)
    ttl = hinted & ~closed
    private = nonroot & (code >= 0)

    def part(mask: np.ndarray) -> dict:
        return {"nodes": int(np.count_nonzero(mask)), "tokens": int(snap.n_tok[mask].sum())}

    clock = snap.header.get("hint_clock")
    soon = until[ttl] - (clock or 0.0)
    return {"hint_clock": clock, "sessions": int(np.unique(code[private]).size),
            "private": part(private), "shared": part(nonroot & (code == fmt_hints.SHARED_CODE)),
            "ttl": {**part(ttl), "next_use_in_s": None if clock is None or not soon.size
                    else [round(float(soon.min()), 3), round(float(soon.max()), 3)]},
            "closed": part(closed),
            "dropped_session": part(hinted & (code == fmt_hints.NO_SESSION))}


def summary(snap: SnapshotTree) -> dict:
    c, nonroot = snap.cols, ~snap.is_root
    tt = snap.tier_tokens
    tokens = int(snap.n_tok[nonroot].sum())
    tiers = {}
    for t in TIER_NAMES:
        used = int(tt[t][nonroot].sum())
        cap = snap.capacity.get(t.lower())
        tiers[t] = {"tokens": used, "capacity": cap,
                    "used": round(used / cap, 4) if cap else None}
    locked = nonroot & (c.lock_ref > 0)
    evictable = nonroot & (c.lock_ref <= 0) & (tt["L1"] > 0)
    leaves = nonroot & (snap.n_children == 0)
    internal = nonroot & (snap.n_children > 0)
    kids = snap.n_children
    return {
        "nodes": snap.num_nodes,
        "namespaces": len(snap.root_rows()),
        "leaves": int(np.count_nonzero(leaves)),
        "tokens": tokens,
        "pages": tokens // snap.page_size,
        "tiers": tiers,
        "locked_tokens": int(snap.n_tok[locked].sum()),
        "evictable_tokens": int(tt["L1"][evictable].sum()),
        "loading_tokens": int(snap.n_tok[nonroot & ((c.inflight & fmt.INFLIGHT_LOAD)
                                                    != 0)].sum()),
        "depth": {"max_nodes": int(snap.depth.max()) if len(c) else 0,
                  "max_tokens": int(snap.prefix_len.max()) if len(c) else 0,
                  "mean_leaf_tokens": round(float(snap.prefix_len[leaves].mean()), 1)
                  if leaves.any() else 0.0},
        "fanout": {"root": int(kids[snap.is_root].sum()),
                   "mean": round(float(kids[internal].mean()), 2) if internal.any()
                   else 0.0,
                   "max": int(kids.max()) if len(c) else 0},
        "hints": hints_summary(snap),
    }


def _node_view(snap: SnapshotTree, i: int, preview: int) -> dict:
    c = snap.cols
    sub = snap.subtree[i]
    return {"id": int(c.id[i]), "tokens": int(snap.n_tok[i]),
            "preview": snap.edge(i)[:preview].tolist(),
            "prefix_len": int(snap.prefix_len[i]), "tiers": snap.tier_label(i),
            "hits": int(c.hit_count[i]), "lock": int(c.lock_ref[i]), **_hints_of(snap, i),
            "subtree": {"nodes": int(sub[0]), "tokens": int(sub[1]),
                        "L1": int(sub[2]), "L2": int(sub[3]), "L3": int(sub[4])}}


def top(snap: SnapshotTree, depth: int = 3, max_children: int = 8,
        preview: int = 4) -> list[dict]:
    """The top of the trie, one entry per namespace root: nested node views down to
    ``depth`` levels; children by subtree size (largest first), at most ``max_children``
    each; what is cut is summarised in ``hidden``."""

    def build(i: int, level: int) -> dict:
        view = _node_view(snap, i, preview)
        kids = snap.children_of(i)
        view["children"] = []
        view["hidden"] = None
        if not kids.size:
            return view
        kids = kids[np.lexsort((snap.cols.id[kids], -snap.subtree[kids, 1]))]
        shown = kids[:max_children] if level < depth else kids[:0]
        view["children"] = [build(int(k), level + 1) for k in shown]
        rest = kids[len(shown):]
        if rest.size:
            view["hidden"] = {"children": int(rest.size),
                              "nodes": int(snap.subtree[rest, 0].sum()),
                              "tokens": int(snap.subtree[rest, 1].sum())}
        return view

    out = []
    for r in snap.root_rows():
        view = build(r, 0)
        view["namespace"] = snap.namespace_of(r)
        out.append(view)
    return out


def hot(snap: SnapshotTree, n: int = 10, preview: int = 4) -> list[dict]:
    """The ``n`` prefixes with the most reuse, scored hits × prefix length (nodes never
    hit are not listed)."""
    c = snap.cols
    rows = np.flatnonzero(~snap.is_root & (c.hit_count > 0))
    score = c.hit_count[rows] * snap.prefix_len[rows]
    if n < rows.size:
        keep = np.argpartition(-score, n - 1)[:n]
        cut = score[keep].min()
        keep = np.flatnonzero(score >= cut)          # ties at the cut stay candidates
        rows, score = rows[keep], score[keep]
    order = np.lexsort((c.id[rows], -score))[:n]
    out = []
    for i, s in zip(rows[order].tolist(), score[order].tolist()):
        out.append({"id": int(c.id[i]), "namespace": snap.namespace_of(i),
                    "prefix_len": int(snap.prefix_len[i]), "hits": int(c.hit_count[i]),
                    "score": int(s), "tiers": snap.tier_label(i),
                    "depth": int(snap.depth[i]),
                    "tokens": int(snap.n_tok[i]),
                    "preview": snap.prefix(i)[:preview].tolist(),
                    "edge_preview": snap.edge(i)[:preview].tolist(), **_hints_of(snap, i)})
    return out


def _namespace_key(snap: SnapshotTree, namespace: str | None) -> str | None:
    """The root key of a namespace given as text (``hicache inspect --namespace``): the
    snapshot keys roots by the canonical text (engine.core.namespace), so ``cache_salt="A"``
    and ``namespace="x"``-style spellings find theirs."""
    try:
        return text_of(parse_text(namespace))
    except ValueError as exc:
        if namespace in snap.roots:      # a snapshot written before namespaces were typed
            return namespace
        raise InputError(str(exc)) from None


def match(snap: SnapshotTree, tokens: np.ndarray, namespace: str | None = None) -> dict:
    """Where a prompt would hit, as :meth:`HiCache.match` decides: the page-aligned path
    through the tree (the tree's own ``walk``), L1 while nodes are on L1 (and not still
    loading), then L2, then the pages the snapshot records as stored in L3."""
    p = snap.page_size
    toks = np.asarray(tokens, dtype=TOKEN_DTYPE)
    namespace = _namespace_key(snap, namespace)
    path, matched = snap.tree.walk(toks, namespace, split=False)
    lens = dict.fromkeys(TIER_NAMES, 0)
    steps = []
    pos = 0
    stage = "L1"  # the hit is an L1 run, then an L2 run, then an L3 run, then stops
    for node in path:
        take = min(len(node.tokens), matched - pos)
        got, tier = 0, None
        if stage == "L1" and node.l1 is not None and not node.inflight & fmt.INFLIGHT_LOAD:
            got, tier = take, "L1"
        else:
            if stage == "L1":
                stage = "L2"
            if stage == "L2" and node.l2 is not None:
                got, tier = take, "L2"
            elif stage in ("L2", "L3"):
                stage = "L3"
                got = min(node.l3 * p, take)
                tier = "L3" if got else None
                if got < take:
                    stage = "stop"
        if tier is not None:
            lens[tier] += got
        steps.append({"id": node.id, "matched": int(take), "edge": len(node.tokens),
                      "hit": tier or "-", "hit_tokens": int(got),
                      "resident": tiers_label((node.l1 is not None) | (node.l2 is not None)
                                              << 1 | bool(node.l3) << 2),
                      "session": getattr(node, "session_key", None),
                      "hint": hint_of(float("nan") if node.hint_until is None
                                      else node.hint_until, snap.header.get("hint_clock"))})
        pos += take
    aligned = len(toks) - len(toks) % p
    hit = lens["L1"] + lens["L2"] + lens["L3"]
    return {"namespace": namespace, "prompt_tokens": int(len(toks)),
            "aligned_tokens": int(aligned), "tree_tokens": int(matched),
            "l1_len": lens["L1"], "l2_len": lens["L2"], "l3_len": lens["L3"],
            "hit_tokens": hit, "miss_tokens": int(len(toks) - hit), "path": steps}


def owners(snap: SnapshotTree, examples: int = 8) -> dict:
    """CP owner distribution (pages per owner rank, per tier) and rotation segments."""
    c, p = snap.cols, snap.page_size
    cp_size = int(snap.rank.get("cp_size", 1))
    nonroot = ~snap.is_root
    owned = nonroot & (c.cp_owner >= 0)
    if cp_size <= 1 or not owned.any():
        return {"sharded": False, "cp_size": cp_size,
                "nodes_with_owner": int(np.count_nonzero(owned))}
    rows = np.flatnonzero(owned)
    pages = snap.n_tok[rows] // p
    start = c.cp_owner[rows] % cp_size
    full, rem = pages // cp_size, pages % cp_size
    tt = snap.tier_tokens
    per_owner = []
    for r in range(cp_size):
        k = full + (((r - start) % cp_size) < rem)
        per_owner.append({"rank": r, "pages": int(k.sum()),
                          "L1": int(k[tt["L1"][rows] > 0].sum()),
                          "L2": int(k[tt["L2"][rows] > 0].sum())})
    totals = [o["pages"] for o in per_owner]
    mean = sum(totals) / cp_size
    # a node continues its parent's rotation when its first page follows the parent's last
    par = snap.parent[rows]
    par_owner = np.where(par >= 0, c.cp_owner[np.maximum(par, 0)], -1)
    par_pages = snap.n_tok[np.maximum(par, 0)] // p
    under_root = snap.is_root[np.maximum(par, 0)]
    cont = (~under_root) & (par_owner >= 0) & \
        ((par_owner + par_pages - c.cp_owner[rows]) % cp_size == 0)
    starts = rows[~cont]
    restarts = starts[~snap.is_root[snap.parent[starts]]]
    start_hist = np.bincount(c.cp_owner[starts] % cp_size, minlength=cp_size)
    ex = []
    for i in restarts[:examples].tolist():
        q = int(snap.parent[i])
        expect = None if c.cp_owner[q] < 0 else int(
            (c.cp_owner[q] + snap.n_tok[q] // p) % cp_size)
        ex.append({"id": int(c.id[i]), "parent": int(c.id[q]),
                   "expected_owner": expect, "owner": int(c.cp_owner[i] % cp_size),
                   "prefix_len": int(snap.prefix_len[i])})
    return {"sharded": True, "cp_size": cp_size, "owners": per_owner,
            "imbalance": round(max(totals) / mean, 3) if mean else None,
            "nodes_without_owner": int(np.count_nonzero(nonroot & (c.cp_owner < 0))),
            "segments": int(starts.size), "restarts": int(restarts.size),
            "segment_start_owners": start_hist.tolist(), "restart_examples": ex}


def diff(snap: SnapshotTree, other: SnapshotTree, examples: int = 8) -> dict:
    """Pages in one snapshot and not the other, and tier changes. Pages are the same when
    their whole token path (namespace included) is, however the two trees split edges."""
    if other.page_size != snap.page_size:
        raise InputError(f"cannot diff snapshots with page sizes {snap.page_size} "
                         f"({snap.path}) and {other.page_size} ({other.path})")
    p = snap.page_size
    ka, kb = _page_keys(snap, other)
    pa, pb = snap.pages, other.pages

    def side(keys: np.ndarray, theirs: np.ndarray, pg: dict, s: SnapshotTree) -> dict:
        only = ~np.isin(keys, theirs)
        per_node = np.bincount(pg["node"][only], minlength=len(s.cols))
        rows = np.flatnonzero(per_node)
        most = rows[np.lexsort((rows, -per_node[rows]))][:examples]
        ex = [{"id": int(s.cols.id[i]), "pages": int(per_node[i]),
               "prefix_len": int(s.prefix_len[i]), "tiers": s.tier_label(i)}
              for i in most.tolist()]
        n = int(only.sum())
        return {"pages": n, "tokens": n * p, "nodes": int(rows.size), "examples": ex}

    order = np.argsort(kb)
    pos = np.minimum(np.searchsorted(kb[order], ka), len(kb) - 1) if len(kb) else ka * 0
    common = (kb[order][pos] == ka) if len(kb) else np.zeros(len(ka), dtype=bool)
    ia = np.flatnonzero(common)
    ib = order[pos[common]]
    bits_a, bits_b = pa["bits"][ia], pb["bits"][ib]
    changed = bits_a != bits_b
    pairs, counts = np.unique(bits_a[changed] * 8 + bits_b[changed], return_counts=True)
    tier_changes = [{"from": tiers_label(int(x) // 8), "to": tiers_label(int(x) % 8),
                     "pages": int(n), "tokens": int(n) * p}
                    for x, n in sorted(zip(pairs.tolist(), counts.tolist()),
                                       key=lambda xn: (-xn[1], xn[0]))]
    change_ex, seen = [], set()
    for x, y in zip(ia[changed].tolist(), ib[changed].tolist()):
        i, j = int(pa["node"][x]), int(pb["node"][y])
        if i in seen:
            continue
        seen.add(i)
        change_ex.append({"id_a": int(snap.cols.id[i]), "id_b": int(other.cols.id[j]),
                          "from": tiers_label(int(pa["bits"][x])),
                          "to": tiers_label(int(pb["bits"][y])),
                          "prefix_len": int(snap.prefix_len[i])})
        if len(change_ex) == examples:
            break
    only_a, only_b = side(ka, kb, pa, snap), side(kb, ka, pb, other)
    return {"a": snap.path, "b": other.path, "page_size": p,
            "common": {"pages": int(ia.size), "tokens": int(ia.size) * p},
            "only_a": only_a, "only_b": only_b, "tier_changes": tier_changes,
            "tier_change_examples": change_ex,
            "same": not (only_a["pages"] or only_b["pages"] or tier_changes)}


def _group(cols: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Group ids (0…g-1, in sorted order of the key columns) of equal rows, and one member row
    of each group."""
    o = np.lexsort(cols[::-1])
    new = np.zeros(len(o), dtype=bool)
    new[:1] = True
    for c in cols:
        sc = c[o]
        new[1:] |= sc[1:] != sc[:-1]
    gid = np.empty(len(o), dtype=np.int64)
    gid[o] = np.cumsum(new) - 1
    return gid, o[new]


def _page_keys(*snaps: SnapshotTree) -> list[np.ndarray]:
    """One integer per page of each snapshot, equal exactly when two pages have the same token
    path from the same namespace root: pages are numbered level by level (page depth), a page
    being (number of the page before it, its tokens)."""
    names = sorted({n for s in snaps for n in s.cols.namespaces}, key=lambda x: (x is not None,
                                                                                 x or ""))
    code = {n: k for k, n in enumerate(names)}
    parts, offset = [], 0
    for s in snaps:
        pg = s.pages
        ns_map = np.array([code[n] for n in s.cols.namespaces], dtype=np.int64)
        ns = ns_map[s.cols.ns_code[pg["node"]]] if len(pg["node"]) else np.empty(0, np.int64)
        prev = np.where(pg["prev"] >= 0, pg["prev"] + offset, -1 - ns)
        parts.append((pg["depth"], prev, pg["tokens"], pg["hash"]))
        offset += len(pg["node"])
    depth = np.concatenate([x[0] for x in parts])
    prev = np.concatenate([x[1] for x in parts])
    toks = np.concatenate([x[2] for x in parts])
    hashes = np.concatenate([x[3] for x in parts])
    key = np.full(len(depth), -1, dtype=np.int64)
    order = np.argsort(depth, kind="stable")
    bounds = np.flatnonzero(np.diff(depth[order])) + 1
    next_id = 0
    for level in np.split(order, bounds):
        if not level.size:
            continue
        q = prev[level]
        before = np.where(q >= 0, key[np.maximum(q, 0)], q)   # roots: -1 - namespace code
        inv, rep = _group([before, hashes[level]])
        if not np.array_equal(toks[level], toks[level][rep][inv]):  # a hash collision
            _, inv = np.unique(np.column_stack([before, toks[level].astype(np.int64)]), axis=0,
                               return_inverse=True)
            inv = inv.reshape(-1)
        key[level] = inv + next_id
        next_id += int(inv.max()) + 1
    out, start = [], 0
    for s in snaps:
        n = len(s.pages["node"])
        out.append(key[start:start + n])
        start += n
    return out
