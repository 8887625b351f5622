"""The evictable tiers of the facade (L1, L2) as small records.

A :class:`Tier` holds what the facade's one eviction loop needs to know about a tier: its page
allocator, its heap of eviction candidates, which nodes may leave it and the step that frees one
node's pages there. The facade builds one per tier it has (:class:`engine.cache.facade.HiCache`)
and hands it to :meth:`Tier.evict`; no tier is named by a string looked up with ``getattr``.
"""

from __future__ import annotations

import heapq
from typing import Any, Callable, Iterable

from engine.cache.radix_tree import Node, RadixTree


def l1_candidate(node: Node) -> bool:
    """An L1 copy that may go: an unlocked node with no L1 child, not being loaded."""
    return (node.parent is not None and node.l1 is not None and node.lock_ref == 0
            and node.n_l1_children == 0 and node.loading is None)


def l2_candidate(node: Node) -> bool:
    """An L2 copy that may go: a leaf living only in L2 (the node goes with it), or the backup
    copy of a node that stays on L1."""
    return (node.parent is not None and node.l2 is not None and node.lock_ref == 0
            and node.backing_up is None and node.loading is None
            and (node.l1 is not None or not node.children))


def agreed_tie(node: Node, seq: int) -> tuple:
    """What orders candidates of equal policy key: the node's id (its creation order, the same
    on every rank of a group), then the push sequence (only ever between entries of one node).
    So the eviction order is total on data every rank agrees on (docs/parallelism.md, "Rank
    divergence classes", ``evict-order``)."""
    return (node.id, seq)


class Tier:
    """One tier: ``heap`` entries are ``(policy key, tie, node)`` (``tie(node, seq)``, by
    default :func:`agreed_tie`); stale entries (the node is no candidate any more, or its key
    changed) are skipped when popped, so pushing is cheap."""

    __slots__ = ("name", "alloc", "heap", "hheap", "seq", "is_candidate", "evict_one", "tie")

    def __init__(self, name: str, alloc: Any, is_candidate: Callable[[Node], bool],
                 evict_one: Callable[[Node], bool]):
        self.name = name
        self.alloc = alloc
        self.heap: list = []
        self.hheap: list = []      # hinted candidates (engine.cache.hints), latest next use first
        self.seq = 0
        self.is_candidate = is_candidate
        self.evict_one = evict_one
        self.tie: Callable[[Node, int], Any] = agreed_tie

    def push(self, key: Any, node: Node) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (key, self.tie(node, self.seq), node))

    def push_hinted(self, node: Node) -> None:
        assert node.hint_until is not None
        self.seq += 1
        heapq.heappush(self.hheap, ((-node.hint_until, node.last_access),
                                    self.tie(node, self.seq), node))

    def rebuild_hinted(self, tree: RadixTree) -> None:
        """A fresh hinted heap of exactly the current hinted candidates."""
        self.hheap = []
        for n in tree.iter_nodes():
            if n.hint_until is not None and self.is_candidate(n):
                self.push_hinted(n)

    def rebuild(self, nodes: Iterable[Node], key: Callable[[Node], Any]) -> None:
        """A fresh heap of exactly the current candidates (drops every stale entry)."""
        heap = []
        check, tie = self.is_candidate, self.tie
        for node in nodes:
            if check(node):
                self.seq += 1
                heap.append((key(node), tie(node, self.seq), node))
        heapq.heapify(heap)
        self.heap = heap

    def evict(self, n_pages: int, key: Callable[[Node], Any], page_size: int,
              tree: RadixTree) -> tuple[int, list[int], list[int]]:
        """The leaf-first loop every tier shares: pop candidates in policy order, skip stale
        entries, let ``evict_one`` free a node's pages (False: it could not). Returns the pages
        freed, the ids of the eligible nodes seen and of those evicted."""
        is_candidate, evict_one = self.is_candidate, self.evict_one
        freed = 0
        eligible: list[int] = []
        evicted: list[int] = []
        rebuilt = False
        while freed < n_pages:
            if not self.heap:
                if rebuilt:
                    break
                self.rebuild(tree.iter_nodes(), key)
                rebuilt = True
                continue
            k, _, node = heapq.heappop(self.heap)
            if not is_candidate(node) or key(node) != k:
                continue
            eligible.append(node.id)
            pages = len(node.tokens) // page_size
            if not evict_one(node):
                continue
            evicted.append(node.id)
            freed += pages
        if len(self.heap) > 4 * tree.num_nodes + 4096:
            self.rebuild(tree.iter_nodes(), key)
        return freed, eligible, evicted

    def evict_hinted(self, n_pages: int, key: Callable[[Node], Any], page_size: int,
                     tree: RadixTree, book: Any) -> tuple[int, list[int], list[int]]:
        """:meth:`evict` with client hints (engine.cache.hints): the unhinted candidates stay in
        the policy's order (``heap``), the hinted ones in order of predicted next use
        (``hheap``), and each step evicts the one predicted to be needed last — a hinted
        candidate when its predicted use is no sooner than the policy's candidate's age
        estimate (last used ``a`` seconds ago: back in ``a`` seconds)."""
        is_candidate, evict_one = self.is_candidate, self.evict_one
        heap, hheap = self.heap, self.hheap
        now = book.now
        counters = book.counters
        freed = 0
        eligible: list[int] = []
        evicted: list[int] = []
        rebuilt = False
        top = None                            # the base heap's top entry, validated
        while freed < n_pages:
            while heap and heap[0] is not top:
                k, _, node = heap[0]
                if is_candidate(node) and node.hint_until is None and key(node) == k:
                    top = heap[0]
                    break
                heapq.heappop(heap)
            while hheap:
                (neg, last), _, node = hheap[0]
                if is_candidate(node) and node.hint_until == -neg and node.last_access == last:
                    break
                heapq.heappop(hheap)
            if not heap and not hheap:
                if rebuilt:
                    break
                self.rebuild((n for n in tree.iter_nodes() if n.hint_until is None), key)
                self.rebuild_hinted(tree)
                heap, hheap = self.heap, self.hheap
                top = None
                rebuilt = True
                continue
            if hheap and (not heap or -hheap[0][0][0] >= 2 * now - book.time_of(
                    heap[0][2].last_access)):
                _, _, node = heapq.heappop(hheap)
                counters["hint_evictions"] += 1
                if node.hint_until == float("inf"):
                    counters["closed_evictions"] += 1
            else:
                _, _, node = heapq.heappop(heap)
                top = None
                if hheap:
                    counters["kept_by_hint"] += 1
            eligible.append(node.id)
            pages = len(node.tokens) // page_size
            if not evict_one(node):
                continue
            evicted.append(node.id)
            freed += pages
        if len(self.heap) > 4 * tree.num_nodes + 4096:
            self.rebuild((n for n in tree.iter_nodes() if n.hint_until is None), key)
        if len(self.hheap) > 2 * tree.num_nodes + 256:
            # every request re-marks its session's path: stale entries pile up (and would
            # keep removed nodes alive)
            self.rebuild_hinted(tree)
        return freed, eligible, evicted
