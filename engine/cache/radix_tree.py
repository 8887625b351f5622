"""The prefix index: a radix tree over token *pages*.

Nodes hold page ids per tier (never tensors). Each namespace (a frozen
:class:`~engine.core.namespace.Namespace`: adapter, cache salt, extra key, ...; ``None`` for the
default) has its own root, so different namespaces never share a node (the facade normalises
what callers pass; a snapshot's tree keys its roots by the namespaces' text). Children are found by the bytes of their
first page (page-granular lookup, no per-token Python loops); edges are numpy arrays compared
vectorised.

The tree does not decide anything about tiers or eviction; the facade (:mod:`engine.cache.facade`)
does, and keeps the per-node bookkeeping fields (``n_l1_children``, ``loading``, ...) current.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterator

import numpy as np

if TYPE_CHECKING:
    from engine.cache.transfer import TransferOp
    from engine.core.hashing import PageHash

TOKEN_DTYPE = np.uint32


class Node:
    __slots__ = (
        "id", "parent", "children", "tokens", "namespace",
        "l1", "l2", "l3", "l3_hashes",
        "lock_ref", "hit_count", "last_access", "priority", "cp_owner",
        "n_l1_children", "loading", "backing_up",
        "session", "hint_until", "hint_expiry",
    )

    def __init__(self, node_id: int, parent: "Node | None", tokens: np.ndarray,
                 namespace: str | None):
        self.id = node_id
        self.parent = parent
        self.children: dict[bytes, Node] = {}
        self.tokens = tokens
        self.namespace = namespace
        self.l1: np.ndarray | None = None      # L1 page ids, one per page of the edge
        self.l2: np.ndarray | None = None      # L2 page ids
        self.l3 = 0                            # pages known to be stored in L3
        self.l3_hashes: list[PageHash] | None = None  # page hashes, computed when L3 needs them
        self.lock_ref = 0
        self.hit_count = 0
        self.last_access = 0
        self.priority = 0
        self.cp_owner: int | None = None       # owner rank of the first page when CP-sharded
        self.n_l1_children = 0                 # children whose l1 is set
        self.loading: TransferOp | None = None  # in-flight L2->L1 load op or None
        # (in-flight L1->L2 op, first page of this edge in the op) or None
        self.backing_up: tuple[TransferOp, int] | None = None
        # client hints (engine.cache.hints): the owning session's id (-1: shared by several),
        # the predicted next use in seconds (inf: its session closed; None: no hint) and when
        # that declaration expires
        self.session: int | None = None
        self.hint_until: float | None = None
        self.hint_expiry = float("inf")

    @property
    def is_root(self) -> bool:
        return self.parent is None

    def __len__(self) -> int:
        return len(self.tokens)

    def __repr__(self) -> str:
        tiers = "".join(t for t, v in (("1", self.l1), ("2", self.l2)) if v is not None)
        return f"Node(id={self.id}, len={len(self.tokens)}, tiers={tiers or '-'}, lock={self.lock_ref})"


def common_len(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    a, b = a[:n], b[:n]
    if a.dtype == b.dtype and a.tobytes() == b.tobytes():   # the usual case: a whole edge
        return n
    eq = a == b
    if eq.all():
        return n
    return int(eq.argmin())


class RadixTree:
    def __init__(self, page_size: int):
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self.roots: dict[str | None, Node] = {}
        self._next_id = 0
        self.clock = 0
        self.num_nodes = 0
        # The lower half of the edge the last walk() split, if any: it was compared by that
        # walk, so match() counts it as accessed (SGLang's RadixCache does the same).
        self.split_lower: Node | None = None

    # -- structure ------------------------------------------------------------------------
    def _new_node(self, parent: Node | None, tokens: np.ndarray, namespace: str | None) -> Node:
        node = Node(self._next_id, parent, tokens, namespace)
        self._next_id += 1
        self.num_nodes += 1
        return node

    def root(self, namespace: Any) -> Node:
        r = self.roots.get(namespace)
        if r is None:
            r = self._new_node(None, np.empty(0, dtype=TOKEN_DTYPE), namespace)
            self.num_nodes -= 1  # roots are not counted as cache nodes
            self.roots[namespace] = r
        return r

    def key_of(self, tokens: np.ndarray, pos: int = 0) -> bytes:
        return tokens[pos:pos + self.page_size].tobytes()

    def tick(self) -> int:
        self.clock += 1
        return self.clock

    def split(self, node: Node, n_tokens: int) -> Node:
        """Cut ``node``'s edge after ``n_tokens`` (page-aligned); returns the new upper node."""
        p = self.page_size
        assert 0 < n_tokens < len(node.tokens) and n_tokens % p == 0, (n_tokens, len(node))
        k = n_tokens // p
        parent = node.parent
        assert parent is not None, "a root has no edge to split"
        upper = self._new_node(parent, node.tokens[:n_tokens], node.namespace)
        upper.l1 = None if node.l1 is None else node.l1[:k]
        upper.l2 = None if node.l2 is None else node.l2[:k]
        upper.l3 = min(node.l3, k)
        if node.l3_hashes is not None:
            upper.l3_hashes = node.l3_hashes[:k]
            node.l3_hashes = node.l3_hashes[k:]
        upper.lock_ref = node.lock_ref
        upper.hit_count = node.hit_count
        upper.last_access = node.last_access
        upper.priority = node.priority
        upper.cp_owner = node.cp_owner
        upper.session = node.session
        upper.hint_until = node.hint_until
        upper.hint_expiry = node.hint_expiry
        upper.loading = node.loading
        if node.loading is not None:
            node.loading.payload.append(upper)
        if node.backing_up is not None:
            op, start = node.backing_up
            upper.backing_up = (op, start)
            node.backing_up = (op, start + k)
            op.payload.append(upper)
        upper.n_l1_children = 1 if node.l1 is not None else 0
        parent.children[self.key_of(node.tokens)] = upper
        node.tokens = node.tokens[n_tokens:]
        node.l1 = None if node.l1 is None else node.l1[k:]
        node.l2 = None if node.l2 is None else node.l2[k:]
        node.l3 = max(node.l3 - k, 0)
        if node.cp_owner is not None:
            node.cp_owner = node.cp_owner + k  # the owner rotation continues (mod cp_size)
        node.parent = upper
        upper.children[self.key_of(node.tokens)] = node
        return upper

    def add_child(self, parent: Node, tokens: np.ndarray) -> Node:
        assert len(tokens) and len(tokens) % self.page_size == 0
        child = self._new_node(parent, tokens, parent.namespace)
        key = self.key_of(tokens)
        assert key not in parent.children, "add_child over an existing edge"
        parent.children[key] = child
        return child

    def remove_leaf(self, node: Node) -> None:
        assert not node.children and node.parent is not None, f"remove_leaf on {node!r}"
        del node.parent.children[self.key_of(node.tokens)]
        node.parent = None
        self.num_nodes -= 1

    # -- lookup -----------------------------------------------------------------------------
    def walk(self, tokens: np.ndarray, namespace: Any, split: bool = True,
             start: Node | None = None) -> tuple[list[Node], int]:
        """Longest page-aligned prefix of ``tokens`` present in the tree.

        Returns the path (root excluded) and the matched length. With ``split`` a partially
        matched edge is split so that the path ends exactly at the matched length. ``start``:
        a node known to hold a prefix of ``tokens`` (a locked node of an earlier match) — the
        walk resumes below it instead of from the root.
        """
        p = self.page_size
        path: list[Node] = []
        self.split_lower = None
        if start is not None and start.parent is not None:
            node = start
            while node.parent is not None:
                path.append(node)
                node = node.parent
            path.reverse()
            node = start
            pos = sum(len(x.tokens) for x in path)
        else:
            root = self.roots.get(namespace)
            if root is None:
                return path, 0
            node, pos = root, 0
        n = len(tokens) - len(tokens) % p
        dtype = tokens.dtype
        while pos < n:
            child = node.children.get(tokens[pos:pos + p].tobytes())
            if child is None:
                break
            edge = child.tokens
            k = len(edge)
            if pos + k <= n and edge.dtype == dtype and \
                    edge.tobytes() == tokens[pos:pos + k].tobytes():
                path.append(child)         # the whole edge (the usual case)
                pos += k
                node = child
                continue
            m = common_len(edge, tokens[pos:pos + k])
            m -= m % p
            if m < k:
                if m == 0:
                    break
                if not split:
                    path.append(child)
                    pos += m
                    break
                self.split_lower = child
                child = self.split(child, m)
            path.append(child)
            pos += m
            node = child
        return path, pos

    def iter_nodes(self) -> Iterator[Node]:
        """Every non-root node, parents before children."""
        stack = list(self.roots.values())
        while stack:
            node = stack.pop()
            if node.parent is not None:
                yield node
            stack.extend(node.children.values())

    def prefix_tokens(self, node: Node) -> np.ndarray:
        parts = []
        while node is not None and node.parent is not None:
            parts.append(node.tokens)
            node = node.parent
        return np.concatenate(parts[::-1]) if parts else np.empty(0, dtype=TOKEN_DTYPE)
