"""The facade's eviction, as a base of :class:`~engine.cache.facade.HiCache`: the candidate
heaps a node enters when it may go, one eviction pass over a tier (recorded as one ``evict``
event), and what leaving a tier does to a node — an L1 page backed up to L2 first where the
write policy or its children need it, an L2 page written to L3 first where L3 lacks it, a leaf
leaving the tree. The order itself is the policy's (engine/cache/policy.py) and the tiers'
(engine/cache/tiers.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from engine.cache.events import EV
from engine.cache.transfer import OpKind
from engine.cache.types import WritePolicy

if TYPE_CHECKING:
    from engine.cache.radix_tree import Node
    from engine.cache.tiers import Tier


class EvictionMethods:
    """Needs of the host class: ``_t1``/``_t2``, ``policy``, ``hints``, ``events``,
    ``counters``, ``page_size``, ``tree``, ``l1_alloc``/``l2_alloc``, ``write_policy``,
    ``l3``, ``_drain`` and ``_backup``."""

    _t1: Any
    _t2: Any
    policy: Any
    hints: Any
    events: Any
    counters: Any
    page_size: int
    tree: Any
    l1_alloc: Any
    l2_alloc: Any
    write_policy: WritePolicy
    l3: Any

    def _drain(self, kind: OpKind, until: Any) -> None:  # the host's
        raise NotImplementedError

    def _backup(self, nodes: "list[Node]", sync: bool = False) -> bool:  # the host's
        raise NotImplementedError

    def _push_candidate(self, node: "Node") -> None:
        if node.parent is None or node.lock_ref:
            return
        hinted = node.hint_until is not None
        if node.l1 is not None and node.n_l1_children == 0:
            if hinted:
                self._t1.push_hinted(node)
            else:
                self._t1.push(self.policy.key(node), node)
        if node.l2 is not None and (node.l1 is not None or not node.children):
            t2 = self._t2
            assert t2 is not None            # L2 pages imply an L2 tier
            if hinted:
                t2.push_hinted(node)
            else:
                t2.push(self.policy.key(node), node)

    def _evict(self, tier: "Tier", n_pages: int) -> int:
        """One eviction pass over ``tier`` (:meth:`Tier.evict`), recorded as one ``evict``."""
        if tier.hheap and self.hints is not None:
            freed, eligible, evicted = tier.evict_hinted(n_pages, self.policy.key,
                                                         self.page_size, self.tree, self.hints)
        else:
            freed, eligible, evicted = tier.evict(n_pages, self.policy.key, self.page_size,
                                                  self.tree)
        if eligible:
            self.events.emit(EV.EVICT, tier=tier.name, eligible=eligible, evicted=evicted)
            self.counters[f"evicted_{tier.name}_pages"] += freed
        return freed

    def evict_l1(self, n_pages: int) -> int:
        """Free at least ``n_pages`` L1 pages if possible (leaf-first, policy order)."""
        return self._evict(self._t1, n_pages)

    def _evict_l1_node(self, node: "Node") -> bool:
        if node.l2 is None and node.backing_up is not None:
            self._drain(OpKind.BACKUP, until=node.backing_up[0])
        if node.l2 is None and self.l2_alloc is not None and (
                self.write_policy is WritePolicy.WRITE_BACK or node.children):
            self._backup([node], sync=True)
        parent, pages = node.parent, node.l1
        assert parent is not None and pages is not None  # an L1 candidate: a tree node on L1
        if node.l2 is not None:            # backed up: the node stays, L2-only
            self.l1_alloc.free(pages)
            node.l1 = None
            self._push_candidate(node)
        elif not node.children:            # nowhere else: the node leaves the tree
            self.l1_alloc.free(pages)
            node.l1 = None
            if self.hints is not None:
                self.hints.on_remove(node)
            self.tree.remove_leaf(node)
        else:
            return False
        parent.n_l1_children -= 1
        self._push_candidate(parent)
        return True

    def evict_l2(self, n_pages: int) -> int:
        assert self._t2 is not None, "evict_l2 without an L2 tier"
        return self._evict(self._t2, n_pages)

    def _evict_l2_node(self, node: "Node") -> bool:
        if self.l3 is not None and node.l3 < len(node.tokens) // self.page_size:
            self._l3_put(node, sync=True)
        parent, pages = node.parent, node.l2
        # an L2 candidate: a tree node on L2 (so there is an L2 tier)
        assert parent is not None and pages is not None and self.l2_alloc is not None
        self.l2_alloc.free(pages)
        node.l2 = None
        if node.l1 is None:                # an L2-only leaf leaves the tree
            if self.hints is not None:
                self.hints.on_remove(node)
            self.tree.remove_leaf(node)
            self._push_candidate(parent)
        return True

    def _l3_put(self, node: "Node", sync: bool = False) -> None:
        """Store ``node``'s pages in L3 — unless its session closed (never needed again)."""
        assert self.l3 is not None
        if node.hint_until == float("inf"):
            assert self.hints is not None
            self.hints.counters["l3_writebacks_skipped"] += 1
        else:
            self.l3.put(node, sync=sync)
