"""The sweep's replay: one L1 tier, no events, through the cache's own tree and eviction loop.

A sweep point replays page-level (:func:`~engine.sim.replay.replay` with ``page_level``): one
token per page, L1 only, one rank, no events, nothing kept. On that configuration most of what
the :class:`~engine.cache.facade.HiCache` facade does per request is fixed: every node is on
L1, nothing is in flight, page ids are never read, the matched path is locked for the request
only. :class:`LeanReplay` does the rest with the facade's own parts — the
:class:`~engine.cache.radix_tree.RadixTree` (walk, split, add, remove), the
:class:`~engine.cache.tiers.Tier` eviction loop and candidate test, the eviction policy object —
and takes the same steps in the same order (touches, lock counts, candidate pushes, policy key
calls: the learning policies keep state per key call), so every point's hits, evictions and
policy decisions are the facade's (tests/test_sweep.py compares them, every policy).

What it drops: page ids (a node's ``l1`` is its token array — one entry per page, page size 1 —
and the free pages are a count), match/lock/insert result objects, event calls, the second walk
of ``insert`` (it ends where the match's walk did: eviction removes nodes, it never adds one).
"""

from __future__ import annotations

import time
from typing import Callable, Iterable

import numpy as np

from engine.cache.radix_tree import Node, RadixTree
from engine.cache.tiers import Tier, l1_candidate


class _Pages:
    """What a policy's ``attach`` reads of the L1 allocator: its size."""

    __slots__ = ("num_pages",)

    def __init__(self, num_pages: int):
        self.num_pages = num_pages


class LeanReplay:
    """One L1 tier of ``num_pages`` pages of one token (the page-level replay's cache)."""

    page_size = 1

    def __init__(self, num_pages: int, policy):
        self.tree = RadixTree(1)
        self.l1_alloc = _Pages(num_pages)
        self.free_pages = num_pages
        self.policy = policy
        self.evicted_pages = 0
        self.uncacheable = 0
        self._t1 = Tier("l1", self.l1_alloc, l1_candidate, self._evict_one)
        attach = getattr(policy, "attach", None)
        if attach is not None:             # bip, density: the tier's size and the tree
            attach(self)

    def _push(self, node: Node) -> None:
        """The facade's ``_push_candidate`` on an L1-only cache."""
        if node.parent is None or node.lock_ref or node.n_l1_children:
            return
        self._t1.push(self.policy.key(node), node)

    def _evict_one(self, node: Node) -> bool:
        """The facade's ``_evict_l1_node`` with no L2: a leaf leaves the tree."""
        if node.children:
            return False
        parent = node.parent
        self.free_pages += len(node.tokens)
        node.l1 = None
        self.tree.remove_leaf(node)
        parent.n_l1_children -= 1
        self._push(parent)
        return True

    def _evict(self, n_pages: int) -> int:
        freed, _, _ = self._t1.evict(n_pages, self.policy.key, 1, self.tree)
        self.evicted_pages += freed
        return freed

    def stats(self, match_tokens: int, hit_tokens: int) -> dict:
        """The facade's ``stats()`` for this cache (the parts a sweep fixes are zero)."""
        from engine.cache.facade import _STAT_COUNTERS
        from engine.cache.report import policy_stats

        counters = dict.fromkeys(_STAT_COUNTERS, 0)
        counters.update(match_tokens=match_tokens, hit_l1_tokens=hit_tokens,
                        evicted_l1_pages=self.evicted_pages)
        n = self.l1_alloc.num_pages
        return {"page_size": 1, "nodes": self.tree.num_nodes, "l1_capacity_tokens": n,
                "l1_used_tokens": n - self.free_pages, "l1_locked_tokens": 0,
                "l2_capacity_tokens": 0, "l2_used_tokens": 0, **counters, "inflight_ops": 0,
                "l3": None, "policy": policy_stats(self.policy)}

    def request(self, toks: np.ndarray) -> int:
        """One request (match → lock → alloc → insert → unlock); returns the matched length.
        A request whose new pages do not fit even after eviction is not inserted
        (``uncacheable``)."""
        tree = self.tree
        push = self._push
        path, pos = tree.walk(toks, None)
        for node in path:                  # match: touch, count the hit, push the candidates
            tree.clock += 1
            node.last_access = tree.clock
            node.hit_count += 1
            if not node.lock_ref and not node.n_l1_children:
                push(node)
        lower = tree.split_lower
        if lower is not None:              # compared by the walk: counted as accessed
            tree.clock += 1
            lower.last_access = tree.clock
            push(lower)
        for node in path:                  # lock the path (no push: counts only go up)
            node.lock_ref += 1
        need = len(toks) - pos
        if need > 0:
            while need > self.free_pages and self._evict(need - self.free_pages):
                pass
        if need <= self.free_pages:
            for node in path:              # insert: the path is touched again (locked)
                tree.clock += 1
                node.last_access = tree.clock
            if need > 0:
                parent = path[-1] if path else tree.root(None)
                suffix = toks[pos:]
                if 2 * len(suffix) < len(toks):
                    suffix = suffix.copy()  # a view would keep the whole request alive
                node = tree.add_child(parent, suffix)
                node.l1 = suffix
                self.free_pages -= need
                tree.clock += 1
                node.last_access = tree.clock
                parent.n_l1_children += 1
                push(node)
        else:
            self.uncacheable += 1
        for node in reversed(path):        # unlock, deepest first: candidates again
            node.lock_ref -= 1
            if not node.lock_ref and not node.n_l1_children:
                push(node)
        return pos


def drive_lean(cache: LeanReplay, requests: Iterable[np.ndarray], clock: list[int],
               progress: Callable[[int], None] | None = None
               ) -> tuple[tuple[int, int, int, int], float]:
    """:func:`~engine.sim.replay._drive` for a :class:`LeanReplay`, the same return value
    (``clock[0]``: the request index, which ``opt``'s future index reads)."""
    hits = 0
    perf = time.perf_counter
    step = cache.request
    t0 = perf()
    for i, toks in enumerate(requests):
        clock[0] = i
        hits += step(toks)
        if progress is not None:
            progress(i + 1)
    return (hits, 0, 0, cache.uncacheable), perf() - t0
