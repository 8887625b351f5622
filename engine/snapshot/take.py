"""Radix-tree snapshots: take one from a live cache, write it, load it back as a tree view.

Writers (``bench replay --dump-tree``, the server's ``POST /dump_tree``, ``bench serve
--dump-tree-on-exit``) call :func:`write_snapshot` or :func:`snapshot_bytes`; ``hicache
inspect`` calls :func:`load_snapshot`. The on-disk format lives in :mod:`formats.snapshot`
(``docs/tree-snapshot-format.md``).

:func:`snapshot_of` copies what it needs (token and page-id bytes), so it must run where the
tree is not being changed (between scheduler steps); writing the copy can happen anywhere.

A loaded :class:`SnapshotTree` keeps the nodes as numpy columns: the views in
:mod:`engine.snapshot.views` (summary, tree view, hot prefixes, CP owners, diff) are computed on
them, so a million-node snapshot loads and summarises in seconds. The node objects (``roots``, ``iter_nodes()``, real
:class:`engine.cache.radix_tree.Node` instances with the same attributes as the live tree) are built
on first use, for the invariant checker and for prefix matching through the tree's own ``walk``.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any, Iterator, Mapping

import numpy as np

from engine.cache.hints import SHARED
from engine.cache.radix_tree import TOKEN_DTYPE, Node, RadixTree
from engine.core.errors import InputError
from engine.core.namespace import text_of
from formats import snapshot as fmt
from formats import snapshot_hints as fmt_hints
from formats.errors import FormatError

TIER_NAMES = ("L1", "L2", "L3")
_BITS = {"L1": 1, "L2": 2, "L3": 4}
META_KEYS = ("model", "layout", "rank", "capacity", "created_at", "hint_clock")
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
        # an L3 tier's backend knows its size in pages (SimulatedTier: -1 = unbounded)
        l3_pages = getattr(getattr(getattr(obj, "l3", None), "impl", None), "capacity", None)
        capacity = {"l1": cfg.l1_tokens, "l2": cfg.l2_tokens or None,
                    "l3": l3_pages * tree.page_size
                    if type(l3_pages) is int and l3_pages >= 0 else None}
    if cfg is not None:
        for key in ("write_policy", "eviction_policy", "host_layout", "device"):
            meta.setdefault(key, str(getattr(cfg, key)))
    book = getattr(obj, "hints", None)
    return fmt.make_header(tree.page_size, created_at=meta.pop("created_at", None),
                           model=meta.pop("model", None), layout=layout, rank=rank,
                           capacity=capacity, meta=meta,
                           hint_clock=meta.pop("hint_clock", None if book is None
                                               else book.now))


def _inflight(node: Any) -> int:
    bits = 0
    loading = getattr(node, "loading", None)
    if loading is not None and not (hasattr(loading, "done") and loading.done()):
        bits |= fmt.INFLIGHT_LOAD
    if getattr(node, "backing_up", None) is not None:
        bits |= fmt.INFLIGHT_BACKUP
    return bits


def _session_of(node: Any, book: Any) -> Any:
    """A node's ``session`` as the file writes it: None (no session), True (shared), or the
    owning session's client key — None when the cache's bounded session book has dropped that
    session (the node's ``hint_until`` is still written: it still orders eviction)."""
    sid = getattr(node, "session", None)
    if sid is None:
        return None
    if sid == SHARED:
        return fmt.SHARED
    return None if book is None else book.key_of(sid)


def snapshot_of(cache_or_tree: Any, meta: Mapping[str, Any] | None = None) -> TreeSnapshot:
    """Copy the tree of a :class:`~engine.cache.facade.HiCache` (or a radix tree) into records.

    ``meta``: ``model`` (name), ``layout`` (KVLayout or dict), ``rank`` (RankInfo or dict),
    ``capacity`` ({"l1"/"l2"/"l3": tokens}), ``created_at`` (unix seconds), ``hint_clock``
    (seconds) override what is derived from the cache; any other key (e.g. ``source``) is kept
    in the header's ``meta``. Each node's client session and hint come from the cache's hint
    book (a bare tree has no book: sessions other than shared are written as nil).
    """
    tree = _tree_of(cache_or_tree)
    header = _header_for(cache_or_tree, tree, meta)
    book = getattr(cache_or_tree, "hints", None)

    def raw(arr: Any, dtype: str) -> bytes | None:
        return None if arr is None else np.ascontiguousarray(arr, dtype=dtype).tobytes()

    nodes: list[fmt.NodeRecord] = []
    stack = [r for _, r in sorted(tree.roots.items(), key=lambda kv: (kv[0] is not None,
                                                                      text_of(kv[0]) or ""))]
    stack.reverse()
    while stack:  # pre-order: parents first, and each subtree contiguous
        n = stack.pop()
        nodes.append(fmt.NodeRecord(
            n.id, None if n.parent is None else n.parent.id, raw(n.tokens, "<u4"),
            text_of(n.namespace), raw(n.l1, "<i8"), raw(n.l2, "<i8"), int(n.l3 or 0), n.lock_ref,
            n.hit_count, n.last_access, getattr(n, "priority", 0),
            None if n.cp_owner is None else int(n.cp_owner), _inflight(n),
            _session_of(n, book), getattr(n, "hint_until", None)))
        kids = n.children.values() if isinstance(n.children, dict) else n.children
        stack.extend(reversed(list(kids)))
    return TreeSnapshot(header, nodes)


def write_snapshot(path: str | os.PathLike, cache_or_tree: Any,
                   meta: Mapping[str, Any] | None = None) -> int:
    """Write a snapshot file (atomically); returns the number of nodes written (roots too)."""
    snap = snapshot_of(cache_or_tree, meta)
    return fmt.write_snapshot(path, snap.header, snap.nodes)


def encode_snapshot(snap: TreeSnapshot) -> bytes:
    """Encode a copied tree (``snapshot_of``); safe to run off the scheduler thread."""
    return fmt.encode_snapshot(snap.header, snap.nodes)


def snapshot_bytes(cache_or_tree: Any, meta: Mapping[str, Any] | None = None) -> bytes:
    """The snapshot as bytes (the body of ``POST /dump_tree``)."""
    return encode_snapshot(snapshot_of(cache_or_tree, meta))


def snapshot_filename(rank: int) -> str:
    """File name of one rank's snapshot in a multi-rank dump directory."""
    return f"tree-rank{rank}.snapshot"


# ------------------------------------------------------------------------------------ loading
def load_snapshot(path: str | os.PathLike) -> "SnapshotTree":
    """Read a snapshot file — or a KV-event recording (``hicache bench record-events``), read
    as the tree its events imply (:mod:`engine.snapshot.from_events`). Bad input raises
    :class:`~engine.core.errors.InputError` (one line)."""
    from formats.kv_events import is_recording

    try:
        if is_recording(path):
            import io

            from engine.snapshot.from_events import load_recording

            body, _ = load_recording(path)
            data = fmt.read_snapshot(io.BytesIO(body))
        else:
            data = fmt.read_snapshot(path)
    except FormatError as exc:
        raise InputError(str(exc)) from None
    return SnapshotTree(data, os.fspath(path))


class SnapshotNode(Node):
    """A node of a loaded snapshot: the live node's attributes plus the in-flight bits and the
    client's session key. ``session`` is as in the live tree — None, ``hints.SHARED``, or a
    session number (here: the key's index in the file, so equal numbers mean one session);
    ``hint_until`` as written; ``hint_expiry`` is not in the file (inf)."""

    __slots__ = ("inflight", "session_key")


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
                c.inflight.tolist(), c.session_code.tolist(), c.hint_until.tolist())
        names = c.namespaces
        for i, (nid, par, ns, n1, n2, l3, lock, hits, last, prio, cp, infl, sc, until) in \
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
            node.session = sc if sc >= 0 else SHARED if sc == fmt_hints.SHARED_CODE else None
            node.session_key = fmt_hints.session_of(sc, c.sessions)
            node.hint_until = None if until != until else until
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
