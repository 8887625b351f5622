"""What the policies that learn from the traffic (``bip``, ``density``) share.

Both need the tier they order (L1 size, page size, the tree to prune their per-node state), a
deterministic admission draw (a hash of the node id, so every rank that performs the same
operations decides alike), and a *ghost table*: edges evicted from the cache remembered by
``(parent id, first page)`` for a bounded horizon of inserted tokens, so that re-inserting one
counts as a reuse after eviction.
"""

from __future__ import annotations

import collections

_HASH_MUL = 0x9E3779B97F4A7C15
_MASK = (1 << 64) - 1


def drawn(node_id: int, share: float) -> bool:
    """True for a fixed, hashed ``share`` of node ids."""
    h = ((node_id + 1) * _HASH_MUL) & _MASK
    return (h >> 11) * (1.0 / (1 << 53)) < share


def edge_key(parent_id: int, node, page_size: int) -> tuple:
    """The edge a node hangs on: its parent and its first page."""
    return (parent_id, node.tokens[:page_size].tobytes())


class GhostTable:
    """``key -> (clock, value)``, entries older than the horizon dropped as the clock moves."""

    def __init__(self) -> None:
        self._entries: dict = {}
        self._fifo: collections.deque = collections.deque()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, key, clock: int, value, horizon: int) -> None:
        self._entries[key] = (clock, value)
        fifo = self._fifo
        fifo.append((clock, key))
        while fifo and fifo[0][0] < horizon:
            _, old = fifo.popleft()
            entry = self._entries.get(old)
            if entry is not None and entry[0] < horizon:
                del self._entries[old]

    def pop(self, key):
        """``(clock, value)`` of a remembered edge (forgotten now), or None."""
        return self._entries.pop(key, None)


class MeasuringPolicy:
    """Base of the learning policies: the tier's size, and per-node state kept in step with
    the tree (pruned when it outgrows the tree fourfold)."""

    def __init__(self, capacity_tokens: int = 0, page_size: int = 1):
        self.capacity = capacity_tokens
        self.page_size = page_size
        self._tree = None
        self._state: dict[int, list] = {}

    def attach(self, cache) -> None:
        """Called by the cache that owns the policy: learn the L1 size and the page size."""
        self.page_size = cache.page_size
        self.capacity = cache.l1_alloc.num_pages * cache.page_size
        self._tree = cache.tree

    def _keep_state(self, node_id: int, st: list) -> None:
        tree = self._tree
        if tree is not None and len(self._state) > 4 * max(tree.num_nodes, 1024):
            live = {n.id for n in tree.iter_nodes()}
            self._state = {i: s for i, s in self._state.items() if i in live}
        self._state[node_id] = st
