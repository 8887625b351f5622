"""Radix-tree snapshots: take one from a live cache, write it, load it back as a tree view.

Writers (``bench replay --dump-tree``, the server's ``POST /dump_tree``, ``bench serve
--dump-tree-on-exit``) call :func:`write_snapshot` or :func:`snapshot_bytes`; ``hicache
inspect`` calls :func:`load_snapshot`. The on-disk format lives in :mod:`formats.snapshot`
(``docs/tree-snapshot-format.md``).

:func:`snapshot_of` copies what it needs (token and page-id bytes), so it must run where the
tree is not being changed (between scheduler steps); writing the copy can happen anywhere.

A loaded :class:`SnapshotTree` keeps the nodes as numpy columns: the summary, tree view, hot
prefixes, CP owners and diff are computed on them, so a million-node snapshot loads and
summarises in seconds. The node objects (``roots``, ``iter_nodes()``, real
:class:`engine.radix_tree.Node` instances with the same attributes as the live tree) are built
on first use, for the invariant checker and for prefix matching through the tree's own ``walk``.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any, Iterator, Mapping

import numpy as np

from engine.errors import InputError
from engine.radix_tree import TOKEN_DTYPE, Node, RadixTree
from formats import snapshot as fmt
from formats.errors import FormatError

TIER_NAMES = ("L1", "L2", "L3")
_BITS = {"L1": 1, "L2": 2, "L3": 4}
META_KEYS = ("model", "layout", "rank", "capacity", "created_at")
"""Keys of ``meta`` that fill header fields; every other key goes to the header's ``meta``."""


# ------------------------------------------------------------------------------------ writing
@dataclasses.dataclass
class TreeSnapshot:
    """A snapshot as plain records: the header and the nodes, parents before children."""

    header: dict
    nodes: list[fmt.NodeRecord]


def _tree_of(obj: Any) -> Any:
    if hasattr(obj, "roots") and hasattr(obj, "page_size"):
        return obj
    tree = getattr(obj, "tree", None)
    if tree is None or not hasattr(tree, "roots"):
        raise TypeError(f"expected a HiCache or a radix tree, got {type(obj).__name__}")
    return tree


def _header_for(obj: Any, tree: Any, meta: Mapping[str, Any] | None) -> dict:
    meta = dict(meta or {})
    cfg = getattr(obj, "config", None)
    layout = meta.pop("layout", getattr(cfg, "layout", None))
    if layout is not None and hasattr(layout, "to_dict"):
        layout = layout.to_dict()
    rank = meta.pop("rank", None)
    if rank is None and getattr(obj, "events", None) is not None:
        rank = obj.events.rank
    if rank is not None and dataclasses.is_dataclass(rank):
        rank = dataclasses.asdict(rank)
    capacity = meta.pop("capacity", None)
    if capacity is None and cfg is not None:
        l3 = getattr(obj, "l3", None)
        capacity = {"l1": cfg.l1_tokens, "l2": cfg.l2_tokens or None,
                    "l3": getattr(l3, "capacity_tokens", None)}
    if cfg is not None:
        for key in ("write_policy", "eviction_policy", "host_layout", "device"):
            meta.setdefault(key, str(getattr(cfg, key)))
    return fmt.make_header(tree.page_size, created_at=meta.pop("created_at", None),
                           model=meta.pop("model", None), layout=layout, rank=rank,
                           capacity=capacity, meta=meta)


def _inflight(node: Any) -> int:
    bits = 0
    loading = getattr(node, "loading", None)
    if loading is not None and not (hasattr(loading, "done") and loading.done()):
        bits |= fmt.INFLIGHT_LOAD
    if getattr(node, "backing_up", None) is not None:
        bits |= fmt.INFLIGHT_BACKUP
    return bits


def snapshot_of(cache_or_tree: Any, meta: Mapping[str, Any] | None = None) -> TreeSnapshot:
    """Copy the tree of a :class:`~engine.hicache.HiCache` (or a radix tree) into records.

    ``meta``: ``model`` (name), ``layout`` (KVLayout or dict), ``rank`` (RankInfo or dict),
    ``capacity`` ({"l1"/"l2"/"l3": tokens}), ``created_at`` (unix seconds) override what is
    derived from the cache; any other key (e.g. ``source``) is kept in the header's ``meta``.
    """
    tree = _tree_of(cache_or_tree)
    header = _header_for(cache_or_tree, tree, meta)

    def raw(arr: Any, dtype: str) -> bytes | None:
        return None if arr is None else np.ascontiguousarray(arr, dtype=dtype).tobytes()

    nodes: list[fmt.NodeRecord] = []
    stack = [r for _, r in sorted(tree.roots.items(), key=lambda kv: (kv[0] is not None,
                                                                      kv[0] or ""))]
    stack.reverse()
    while stack:  # pre-order: parents first, and each subtree contiguous
        n = stack.pop()
        nodes.append(fmt.NodeRecord(
            n.id, None if n.parent is None else n.parent.id, raw(n.tokens, "<u4"),
            n.namespace, raw(n.l1, "<i8"), raw(n.l2, "<i8"), int(n.l3 or 0), n.lock_ref,
            n.hit_count, n.last_access, getattr(n, "priority", 0),
            None if n.cp_owner is None else int(n.cp_owner), _inflight(n)))
        kids = n.children.values() if isinstance(n.children, dict) else n.children
        stack.extend(reversed(list(kids)))
    return TreeSnapshot(header, nodes)


def write_snapshot(path: str | os.PathLike, cache_or_tree: Any,
                   meta: Mapping[str, Any] | None = None) -> int:
    """Write a snapshot file (atomically); returns the number of nodes written (roots too)."""
    snap = snapshot_of(cache_or_tree, meta)
    return fmt.write_snapshot(path, snap.header, snap.nodes)


def snapshot_bytes(cache_or_tree: Any, meta: Mapping[str, Any] | None = None) -> bytes:
    """The snapshot as bytes (the body of ``POST /dump_tree``)."""
    snap = snapshot_of(cache_or_tree, meta)
    return fmt.encode_snapshot(snap.header, snap.nodes)


def snapshot_filename(rank: int) -> str:
    """File name of one rank's snapshot in a multi-rank dump directory."""
    return f"tree-rank{rank}.snapshot"


# ------------------------------------------------------------------------------------ loading
def load_snapshot(path: str | os.PathLike) -> "SnapshotTree":
    """Read a snapshot file. Bad input raises :class:`~engine.errors.InputError` (one line)."""
    try:
        data = fmt.read_snapshot(path)
    except FormatError as exc:
        raise InputError(str(exc)) from None
    return SnapshotTree(data, os.fspath(path))


class SnapshotNode(Node):
    """A node of a loaded snapshot: the live node's attributes plus the in-flight bits."""

    __slots__ = ("inflight",)


def _ancestor_sum(parent: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Sum of ``w`` over each node and all its ancestors (pointer jumping, O(n log depth))."""
    val = w.astype(np.int64, copy=True)
    jump = parent.copy()
    idx = np.flatnonzero(jump >= 0)
    while idx.size:
        j = jump[idx]
        val[idx] += val[j]
        jump[idx] = jump[j]
        idx = idx[jump[idx] >= 0]
    return val


def tiers_label(bits: int) -> str:
    return "+".join(t for t in TIER_NAMES if bits & _BITS[t]) or "none"


class SnapshotTree:
    """A loaded snapshot: header values, numpy node columns, lazily built node objects."""

    def __init__(self, data: fmt.SnapshotData, path: str = "<memory>"):
        self.path = path
        self.header = data.header
        self.page_size: int = data.header["page_size"]
        self.cols = c = data.nodes
        self.rank: dict = data.header["rank"]
        self.capacity: dict = data.header["capacity"]
        self.created_at: float = data.header["created_at"]
        self.parent = c.parent_index
        self.is_root = self.parent < 0
        self.n_tok = np.diff(c.tok_off)
        self.num_nodes = int(np.count_nonzero(~self.is_root))

    # -- the node-object view (same attributes as the live tree) -----------------------------
    @functools.cached_property
    def tree(self) -> RadixTree:
        c, p = self.cols, self.page_size
        tree = RadixTree(p)
        nodes: list[SnapshotNode] = []
        toks, to = c.tokens, c.tok_off.tolist()
        l1_ids, l1_off, l1_len = c.l1_ids, c.l1_off.tolist(), c.l1_len
        l2_ids, l2_off, l2_len = c.l2_ids, c.l2_off.tolist(), c.l2_len
        cols = (c.id.tolist(), self.parent.tolist(), c.ns_code.tolist(), l1_len.tolist(),
                l2_len.tolist(), c.l3.tolist(), c.lock_ref.tolist(), c.hit_count.tolist(),
                c.last_access.tolist(), c.priority.tolist(), c.cp_owner.tolist(),
                c.inflight.tolist())
        names = c.namespaces
        for i, (nid, par, ns, n1, n2, l3, lock, hits, last, prio, cp, infl) in \
                enumerate(zip(*cols)):
            parent = nodes[par] if par >= 0 else None
            node = SnapshotNode(nid, parent, toks[to[i]:to[i + 1]], names[ns])
            if n1 >= 0:
                node.l1 = l1_ids[l1_off[i]:l1_off[i + 1]]
            if n2 >= 0:
                node.l2 = l2_ids[l2_off[i]:l2_off[i + 1]]
            node.l3, node.lock_ref, node.hit_count = l3, lock, hits
            node.last_access, node.priority, node.inflight = last, prio, infl
            node.cp_owner = cp if cp >= 0 else None
            if parent is None:
                tree.roots[node.namespace] = node
            else:
                parent.children[node.tokens[:p].tobytes()] = node
                if n1 >= 0:
                    parent.n_l1_children += 1
            nodes.append(node)
        tree.num_nodes = self.num_nodes
        tree.clock = int(c.last_access.max()) if len(c) else 0
        tree._next_id = int(c.id.max()) + 1 if len(c) else 0
        return tree

    @property
    def roots(self) -> dict:
        return self.tree.roots

    def iter_nodes(self) -> Iterator[Node]:
        return self.tree.iter_nodes()

    # -- derived columns ---------------------------------------------------------------------
    @functools.cached_property
    def depth(self) -> np.ndarray:
        return _ancestor_sum(self.parent, np.ones(len(self.parent), dtype=np.int64)) - 1

    @functools.cached_property
    def prefix_len(self) -> np.ndarray:
        """Tokens from the namespace root to the end of each node's edge."""
        return _ancestor_sum(self.parent, self.n_tok)

    @functools.cached_property
    def n_children(self) -> np.ndarray:
        return np.bincount(self.parent[~self.is_root], minlength=len(self.parent))

    @functools.cached_property
    def tier_tokens(self) -> dict[str, np.ndarray]:
        """Tokens of each node's edge held in each tier (an L1 copy still loading is not)."""
        c, p = self.cols, self.page_size
        loading = (c.inflight & fmt.INFLIGHT_LOAD) != 0
        l1 = np.where((c.l1_len >= 0) & ~loading, np.maximum(c.l1_len, 0) * p, 0)
        return {"L1": l1, "L2": np.maximum(c.l2_len, 0) * p,
                "L3": np.minimum(c.l3 * p, self.n_tok)}

    def tier_label(self, i: int) -> str:
        """Where node ``i``'s edge lives: ``L1+L2``, ``L3 2/4`` (partial), ``none``."""
        parts = []
        for t in TIER_NAMES:
            have = int(self.tier_tokens[t][i])
            if have == 0:
                continue
            full = int(self.n_tok[i])
            parts.append(t if have >= full else f"{t} {have // self.page_size}/"
                                                f"{full // self.page_size}")
        return "+".join(parts) or "none"

    @functools.cached_property
    def subtree(self) -> np.ndarray:
        """Per node: [nodes, tokens, L1, L2, L3 tokens] of its subtree (itself included;
        roots count as 0 nodes)."""
        n = len(self.parent)
        acc = np.zeros((n, 5), dtype=np.int64)
        acc[:, 0] = ~self.is_root
        acc[:, 1] = self.n_tok
        for k, t in enumerate(TIER_NAMES):
            acc[:, 2 + k] = self.tier_tokens[t]
        depth = self.depth
        order = np.argsort(-depth, kind="stable")
        bounds = np.flatnonzero(np.diff(depth[order])) + 1
        for level in np.split(order, bounds):
            level = level[self.parent[level] >= 0]
            if level.size:
                np.add.at(acc, self.parent[level], acc[level])
        return acc

    @functools.cached_property
    def _child_index(self) -> tuple[np.ndarray, np.ndarray]:
        order = np.argsort(self.parent, kind="stable")
        starts = np.searchsorted(self.parent[order], np.arange(len(self.parent) + 1))
        return order, starts

    def children_of(self, i: int) -> np.ndarray:
        order, starts = self._child_index
        return order[starts[i]:starts[i + 1]]

    def edge(self, i: int) -> np.ndarray:
        to = self.cols.tok_off
        return self.cols.tokens[to[i]:to[i + 1]]

    def prefix(self, i: int) -> np.ndarray:
        parts = []
        while i >= 0:
            parts.append(self.edge(i))
            i = int(self.parent[i])
        return np.concatenate(parts[::-1]) if parts else np.empty(0, dtype=TOKEN_DTYPE)

    def namespace_of(self, i: int) -> str | None:
        return self.cols.namespaces[self.cols.ns_code[i]]

    def root_rows(self) -> list[int]:
        rows = np.flatnonzero(self.is_root).tolist()
        return sorted(rows, key=lambda i: (self.namespace_of(i) is not None,
                                           self.namespace_of(i) or ""))

    # -- views -------------------------------------------------------------------------------
    def info(self) -> dict:
        h = self.header
        return {"file": self.path, "format": h["format"], "version": h["version"],
                "page_size": self.page_size, "created_at": self.created_at,
                "model": h["model"], "rank": self.rank, "capacity": self.capacity,
                "meta": h.get("meta", {})}

    def summary(self) -> dict:
        c, nonroot = self.cols, ~self.is_root
        tt = self.tier_tokens
        tokens = int(self.n_tok[nonroot].sum())
        tiers = {}
        for t in TIER_NAMES:
            used = int(tt[t][nonroot].sum())
            cap = self.capacity.get(t.lower())
            tiers[t] = {"tokens": used, "capacity": cap,
                        "used": round(used / cap, 4) if cap else None}
        locked = nonroot & (c.lock_ref > 0)
        evictable = nonroot & (c.lock_ref <= 0) & (tt["L1"] > 0)
        leaves = nonroot & (self.n_children == 0)
        internal = nonroot & (self.n_children > 0)
        kids = self.n_children
        return {
            "nodes": self.num_nodes,
            "namespaces": len(self.root_rows()),
            "leaves": int(np.count_nonzero(leaves)),
            "tokens": tokens,
            "pages": tokens // self.page_size,
            "tiers": tiers,
            "locked_tokens": int(self.n_tok[locked].sum()),
            "evictable_tokens": int(tt["L1"][evictable].sum()),
            "loading_tokens": int(self.n_tok[nonroot & ((c.inflight & fmt.INFLIGHT_LOAD)
                                                        != 0)].sum()),
            "depth": {"max_nodes": int(self.depth.max()) if len(c) else 0,
                      "max_tokens": int(self.prefix_len.max()) if len(c) else 0,
                      "mean_leaf_tokens": round(float(self.prefix_len[leaves].mean()), 1)
                      if leaves.any() else 0.0},
            "fanout": {"root": int(kids[self.is_root].sum()),
                       "mean": round(float(kids[internal].mean()), 2) if internal.any()
                       else 0.0,
                       "max": int(kids.max()) if len(c) else 0},
        }

    def _node_view(self, i: int, preview: int) -> dict:
        c = self.cols
        sub = self.subtree[i]
        return {"id": int(c.id[i]), "tokens": int(self.n_tok[i]),
                "preview": self.edge(i)[:preview].tolist(),
                "prefix_len": int(self.prefix_len[i]), "tiers": self.tier_label(i),
                "hits": int(c.hit_count[i]), "lock": int(c.lock_ref[i]),
                "subtree": {"nodes": int(sub[0]), "tokens": int(sub[1]),
                            "L1": int(sub[2]), "L2": int(sub[3]), "L3": int(sub[4])}}

    def top(self, depth: int = 3, max_children: int = 8, preview: int = 4) -> list[dict]:
        """The top of the trie, one entry per namespace root: nested node views down to
        ``depth`` levels; children by subtree size (largest first), at most ``max_children``
        each; what is cut is summarised in ``hidden``."""

        def build(i: int, level: int) -> dict:
            view = self._node_view(i, preview)
            kids = self.children_of(i)
            view["children"] = []
            view["hidden"] = None
            if not kids.size:
                return view
            kids = kids[np.lexsort((self.cols.id[kids], -self.subtree[kids, 1]))]
            shown = kids[:max_children] if level < depth else kids[:0]
            view["children"] = [build(int(k), level + 1) for k in shown]
            rest = kids[len(shown):]
            if rest.size:
                view["hidden"] = {"children": int(rest.size),
                                  "nodes": int(self.subtree[rest, 0].sum()),
                                  "tokens": int(self.subtree[rest, 1].sum())}
            return view

        out = []
        for r in self.root_rows():
            view = build(r, 0)
            view["namespace"] = self.namespace_of(r)
            out.append(view)
        return out

    def hot(self, n: int = 10, preview: int = 4) -> list[dict]:
        """The ``n`` prefixes with the most reuse, scored hits × prefix length (nodes never
        hit are not listed)."""
        c = self.cols
        rows = np.flatnonzero(~self.is_root & (c.hit_count > 0))
        score = c.hit_count[rows] * self.prefix_len[rows]
        if n < rows.size:
            keep = np.argpartition(-score, n - 1)[:n]
            cut = score[keep].min()
            keep = np.flatnonzero(score >= cut)          # ties at the cut stay candidates
            rows, score = rows[keep], score[keep]
        order = np.lexsort((c.id[rows], -score))[:n]
        out = []
        for i, s in zip(rows[order].tolist(), score[order].tolist()):
            out.append({"id": int(c.id[i]), "namespace": self.namespace_of(i),
                        "prefix_len": int(self.prefix_len[i]), "hits": int(c.hit_count[i]),
                        "score": int(s), "tiers": self.tier_label(i),
                        "depth": int(self.depth[i]),
                        "tokens": int(self.n_tok[i]),
                        "preview": self.prefix(i)[:preview].tolist(),
                        "edge_preview": self.edge(i)[:preview].tolist()})
        return out

    def match(self, tokens: np.ndarray, namespace: str | None = None) -> dict:
        """Where a prompt would hit, as :meth:`HiCache.match` decides: the page-aligned path
        through the tree (the tree's own ``walk``), L1 while nodes are on L1 (and not still
        loading), then L2, then the pages the snapshot records as stored in L3."""
        p = self.page_size
        toks = np.asarray(tokens, dtype=TOKEN_DTYPE)
        path, matched = self.tree.walk(toks, namespace, split=False)
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
                                                  << 1 | bool(node.l3) << 2)})
            pos += take
        aligned = len(toks) - len(toks) % p
        hit = lens["L1"] + lens["L2"] + lens["L3"]
        return {"namespace": namespace, "prompt_tokens": int(len(toks)),
                "aligned_tokens": int(aligned), "tree_tokens": int(matched),
                "l1_len": lens["L1"], "l2_len": lens["L2"], "l3_len": lens["L3"],
                "hit_tokens": hit, "miss_tokens": int(len(toks) - hit), "path": steps}

    def owners(self, examples: int = 8) -> dict:
        """CP owner distribution (pages per owner rank, per tier) and rotation segments."""
        c, p = self.cols, self.page_size
        cp_size = int(self.rank.get("cp_size", 1))
        nonroot = ~self.is_root
        owned = nonroot & (c.cp_owner >= 0)
        if cp_size <= 1 or not owned.any():
            return {"sharded": False, "cp_size": cp_size,
                    "nodes_with_owner": int(np.count_nonzero(owned))}
        rows = np.flatnonzero(owned)
        pages = self.n_tok[rows] // p
        start = c.cp_owner[rows] % cp_size
        full, rem = pages // cp_size, pages % cp_size
        tt = self.tier_tokens
        per_owner = []
        for r in range(cp_size):
            k = full + (((r - start) % cp_size) < rem)
            per_owner.append({"rank": r, "pages": int(k.sum()),
                              "L1": int(k[tt["L1"][rows] > 0].sum()),
                              "L2": int(k[tt["L2"][rows] > 0].sum())})
        totals = [o["pages"] for o in per_owner]
        mean = sum(totals) / cp_size
        # a node continues its parent's rotation when its first page follows the parent's last
        par = self.parent[rows]
        par_owner = np.where(par >= 0, c.cp_owner[np.maximum(par, 0)], -1)
        par_pages = self.n_tok[np.maximum(par, 0)] // p
        under_root = self.is_root[np.maximum(par, 0)]
        cont = (~under_root) & (par_owner >= 0) & \
            ((par_owner + par_pages - c.cp_owner[rows]) % cp_size == 0)
        starts = rows[~cont]
        restarts = starts[~self.is_root[self.parent[starts]]]
        start_hist = np.bincount(c.cp_owner[starts] % cp_size, minlength=cp_size)
        ex = []
        for i in restarts[:examples].tolist():
            q = int(self.parent[i])
            expect = None if c.cp_owner[q] < 0 else int(
                (c.cp_owner[q] + self.n_tok[q] // p) % cp_size)
            ex.append({"id": int(c.id[i]), "parent": int(c.id[q]),
                       "expected_owner": expect, "owner": int(c.cp_owner[i] % cp_size),
                       "prefix_len": int(self.prefix_len[i])})
        return {"sharded": True, "cp_size": cp_size, "owners": per_owner,
                "imbalance": round(max(totals) / mean, 3) if mean else None,
                "nodes_without_owner": int(np.count_nonzero(nonroot & (c.cp_owner < 0))),
                "segments": int(starts.size), "restarts": int(restarts.size),
                "segment_start_owners": start_hist.tolist(), "restart_examples": ex}

    @functools.cached_property
    def pages(self) -> dict[str, np.ndarray]:
        """Every page of every edge (a trailing partial page is ignored): its node row, depth
        (page index from the root), tier bits, the page before it on its path (-1: the
        namespace root) and its tokens (a row of ``page_size`` ids)."""
        c, p = self.cols, self.page_size
        k = np.where(self.is_root, 0, self.n_tok // p)
        node = np.repeat(np.arange(len(c)), k)
        first = np.cumsum(k) - k
        j = np.arange(node.size) - first[node]
        depth = _ancestor_sum(self.parent, k)[node] - k[node] + j
        # the last page at or above each node (nodes without pages inherit their parent's)
        last = np.where(k > 0, first + k - 1, -1)
        for i in np.flatnonzero((k == 0) & ~self.is_root).tolist():  # broken trees only
            last[i] = last[self.parent[i]]
        prev = np.arange(node.size) - 1
        head = j == 0
        par = self.parent[node[head]]
        prev[head] = np.where(par >= 0, last[np.maximum(par, 0)], -1)
        base = (self.tier_tokens["L1"] > 0) * 1 + (self.tier_tokens["L2"] > 0) * 2
        bits = base[node] | np.where(j < c.l3[node], 4, 0)
        if not np.any(self.n_tok % p):          # page-aligned edges: pages are the token rows
            tokens = c.tokens.reshape(-1, p)
        else:
            start = c.tok_off[node] + j * p
            tokens = c.tokens[start[:, None] + np.arange(p)]
        return {"node": node, "depth": depth, "bits": bits, "prev": prev, "tokens": tokens,
                "hash": _row_hashes(tokens)}

    def diff(self, other: "SnapshotTree", examples: int = 8) -> dict:
        """Pages in one snapshot and not the other, and tier changes. Pages are the same when
        their whole token path (namespace included) is, however the two trees split edges."""
        if other.page_size != self.page_size:
            raise InputError(f"cannot diff snapshots with page sizes {self.page_size} "
                             f"({self.path}) and {other.page_size} ({other.path})")
        p = self.page_size
        ka, kb = _page_keys(self, other)
        pa, pb = self.pages, other.pages

        def side(keys: np.ndarray, theirs: np.ndarray, pg: dict, snap: "SnapshotTree") -> dict:
            only = ~np.isin(keys, theirs)
            per_node = np.bincount(pg["node"][only], minlength=len(snap.cols))
            rows = np.flatnonzero(per_node)
            top = rows[np.lexsort((rows, -per_node[rows]))][:examples]
            ex = [{"id": int(snap.cols.id[i]), "pages": int(per_node[i]),
                   "prefix_len": int(snap.prefix_len[i]), "tiers": snap.tier_label(i)}
                  for i in top.tolist()]
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
            change_ex.append({"id_a": int(self.cols.id[i]), "id_b": int(other.cols.id[j]),
                              "from": tiers_label(int(pa["bits"][x])),
                              "to": tiers_label(int(pb["bits"][y])),
                              "prefix_len": int(self.prefix_len[i])})
            if len(change_ex) == examples:
                break
        only_a, only_b = side(ka, kb, pa, self), side(kb, ka, pb, other)
        return {"a": self.path, "b": other.path, "page_size": p,
                "common": {"pages": int(ia.size), "tokens": int(ia.size) * p},
                "only_a": only_a, "only_b": only_b, "tier_changes": tier_changes,
                "tier_change_examples": change_ex,
                "same": not (only_a["pages"] or only_b["pages"] or tier_changes)}


_MIX = np.random.default_rng(0x5EED).integers(1, 2**63, size=1 << 12, dtype=np.uint64) | 1


def _row_hashes(rows: np.ndarray) -> np.ndarray:
    """A 64-bit hash of each row of token ids: a grouping aid, equality is then verified on the
    tokens themselves."""
    if rows.shape[1] % 2 == 0 and rows.flags.c_contiguous:
        words = rows.view(np.uint64)              # two token ids per word, no copy
    else:
        words = rows.astype(np.uint64)
    h = np.zeros(len(rows), dtype=np.uint64)
    for lo in range(0, words.shape[1], len(_MIX)):
        part = words[:, lo:lo + len(_MIX)]
        h += part @ _MIX[:part.shape[1]]          # integer matmul wraps modulo 2**64
    h ^= h >> np.uint64(29)
    h *= _MIX[-1]
    return h ^ (h >> np.uint64(32))


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
