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

Without hints (every point of a plain sweep) a request is :meth:`LeanReplay.plain`: the same
steps with the walk, the split, the candidate push and the eviction loop written out in one
body, over a heap of its own with flat entries — a sweep spends its time there
(docs/benchmarking.md, "The sweep at ≤ 6 CPU-s").
"""

from __future__ import annotations

import itertools
import time
from heapq import heapify, heappop, heappush
from typing import TYPE_CHECKING, Callable, Iterable, Sequence

import numpy as np

from engine.cache.hints import CacheHint, HintBook, apply_hint
from engine.cache.radix_tree import Node, RadixTree
from engine.cache.tiers import Tier, l1_candidate

if TYPE_CHECKING:
    from engine.sim.replay import TraceHints


class _Pages:
    """What a policy's ``attach`` reads of the L1 allocator: its size."""

    __slots__ = ("num_pages",)

    def __init__(self, num_pages: int):
        self.num_pages = num_pages


class LeanReplay:
    """One L1 tier of ``num_pages`` pages of one token (the page-level replay's cache)."""

    page_size = 1

    def __init__(self, num_pages: int, policy, hints: HintBook | None = None):
        """``hints``: replay the trace's client hints through this book (engine.cache.hints)."""
        self.tree = RadixTree(1)
        self.hints = hints
        self.l1_alloc = _Pages(num_pages)
        self.free_pages = num_pages
        self.policy = policy
        self.evicted_pages = 0
        self.uncacheable = 0
        self._t1 = Tier("l1", self.l1_alloc, l1_candidate, self._evict_one)
        # the candidate heap of a cache without hints (plain): flat entries
        self._heap: list[tuple] = []
        self._count = itertools.count(1)
        attach = getattr(policy, "attach", None)
        if attach is not None:             # bip, density: the tier's size and the tree
            attach(self)

    def _push(self, node: Node) -> None:
        """The facade's ``_push_candidate`` on an L1-only cache."""
        if node.parent is None or node.lock_ref or node.n_l1_children:
            return
        if node.hint_until is not None:
            self._t1.push_hinted(node)
        else:
            self._t1.push(self.policy.key(node), node)

    def _evict_one(self, node: Node) -> bool:
        """The facade's ``_evict_l1_node`` with no L2: a leaf leaves the tree."""
        if node.children:
            return False
        parent = node.parent
        self.free_pages += len(node.tokens)
        node.l1 = None
        if self.hints is not None:
            self.hints.on_remove(node)
        self.tree.remove_leaf(node)
        parent.n_l1_children -= 1
        self._push(parent)
        return True

    def _evict(self, n_pages: int) -> int:
        t1 = self._t1
        if t1.hheap and self.hints is not None:
            freed, _, _ = t1.evict_hinted(n_pages, self.policy.key, 1, self.tree, self.hints)
        else:
            freed, _, _ = t1.evict(n_pages, self.policy.key, 1, self.tree)
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
                "l3": None, "policy": policy_stats(self.policy),
                **({} if self.hints is None else {"hints": self.hints.stats()})}

    def close(self) -> None:
        """Break the cache's reference cycles (each node and its parent, the tier and this
        cache), so that reference counting frees it as soon as it is dropped: otherwise it
        waits for the cycle collector, whose next pass walks every node, heap entry and policy
        record it holds (a sweep point's garbage). The cache is unusable afterwards."""
        for node in self.tree.iter_nodes():
            node.parent = None
        del self._t1

    def set_clock(self, t: float) -> None:
        """The facade's ``set_clock`` (the trace's timestamp of the next request)."""
        book = self.hints
        assert book is not None
        book.set_clock(t, self.tree.clock)
        book.judge_due()
        book.expire_due(self._push)

    def request(self, toks: np.ndarray, hint: CacheHint | None = None) -> int:
        """One request (match → lock → alloc → insert → unlock); returns the matched length.
        A request whose new pages do not fit even after eviction is not inserted
        (``uncacheable``)."""
        if self.hints is None:
            return self.plain(toks)
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
            if lower.hint_until is not None:
                assert self.hints is not None and lower.parent is not None
                assert lower.hint_until is not None
                self.hints.mark([lower.parent], lower.hint_until, lower.hint_expiry)
        for node in path:                  # lock the path (no push: counts only go up)
            node.lock_ref += 1
        need = len(toks) - pos
        last = path[-1] if path else None
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
                last = node
        else:
            self.uncacheable += 1
        if self.hints is not None:
            apply_hint(self.hints, last, None, hint, push)
        for node in reversed(path):        # unlock, deepest first: candidates again
            node.lock_ref -= 1
            if not node.lock_ref and not node.n_l1_children:
                push(node)
        return pos

    def plain(self, toks: np.ndarray, raw: bytes | None = None) -> int:
        """:meth:`request` without hints, in one body: the same steps, touches, pushes and
        policy key calls in the same order, with the tree walk (page size 1, the default
        namespace), the candidate push and the eviction loop (:meth:`Tier.evict
        <engine.cache.tiers.Tier.evict>`) written out — a sweep point spends its time here.
        Its heap entries are flat, ``key + (node id, push number, node)``: the order of the
        tier's ``(key, (node id, push number), node)`` (a policy's keys all have one length),
        compared without a nested tuple. ``raw``: ``toks.tobytes()``, when the caller has it."""
        tree = self.tree
        key = self.policy.key
        count = self._count
        path: list[Node] = []
        pos = 0
        lower = None
        n = len(toks)
        if raw is None:
            raw = toks.tobytes()
        w = toks.itemsize
        root = tree.roots.get(None)
        if root is not None:               # the walk (RadixTree.walk, page size 1)
            node = root
            while pos < n:
                b = w * pos
                first = raw[b:b + w]
                child = node.children.get(first)
                if child is None:
                    break
                edge = child.tokens
                k = len(edge)
                eb = edge.tobytes()
                if pos + k <= n:
                    if eb == raw[b:b + w * k]:
                        path.append(child)     # the whole edge (the usual case)
                        pos += k
                        node = child
                        continue
                    m = int((edge != toks[pos:pos + k]).argmax())   # the first difference
                elif eb[:len(raw) - b] == raw[b:]:
                    m = n - pos                # the request ends inside the edge
                else:
                    m = int((edge[:n - pos] != toks[pos:]).argmax())
                # 0 < m < k (the first token matched): split the edge after m
                # (RadixTree.split on a cache without hints, L2, L3 or loads)
                lower = child
                upper = Node(tree._next_id, node, edge[:m], child.namespace)
                tree._next_id += 1
                tree.num_nodes += 1
                upper.l1 = upper.tokens
                upper.lock_ref = child.lock_ref
                upper.hit_count = child.hit_count
                upper.last_access = child.last_access
                upper.priority = child.priority
                upper.n_l1_children = 1
                node.children[first] = upper
                child.tokens = child.l1 = edge[m:]
                child.parent = upper
                upper.children[eb[w * m:w * m + w]] = child
                path.append(upper)
                pos += m
                break                          # the path ends at the split
        tree.split_lower = lower
        clock = tree.clock
        heap = self._heap
        for node in path:                  # match: touch, count the hit, push the candidates
            clock += 1
            node.last_access = clock
            node.hit_count += 1
            if not node.lock_ref and not node.n_l1_children:
                tree.clock = clock
                heappush(heap, key(node) + (node.id, next(count), node))
        if lower is not None:              # compared by the walk: counted as accessed
            clock += 1
            lower.last_access = clock
            if not lower.lock_ref and not lower.n_l1_children:
                tree.clock = clock
                heappush(heap, key(lower) + (lower.id, next(count), lower))
        tree.clock = clock
        for node in path:                  # lock the path (no push: counts only go up)
            node.lock_ref += 1
        need = n - pos
        if need > self.free_pages:
            while need > self.free_pages and self._evict_plain(need - self.free_pages):
                pass
            heap = self._heap              # (rebuilt, perhaps)
        if need <= self.free_pages:
            clock = tree.clock
            for node in path:              # insert: the path is touched again (locked)
                clock += 1
                node.last_access = clock
            if need > 0:                   # RadixTree.add_child, written out
                parent = path[-1] if path else tree.root(None)
                suffix = toks[pos:] if pos else toks
                if 2 * need < n:
                    suffix = suffix.copy()  # a view would keep the whole request alive
                node = Node(tree._next_id, parent, suffix, parent.namespace)
                tree._next_id += 1
                tree.num_nodes += 1
                parent.children[raw[w * pos:w * pos + w]] = node
                node.l1 = suffix
                self.free_pages -= need
                clock += 1
                node.last_access = clock
                parent.n_l1_children += 1
                tree.clock = clock
                heappush(heap, key(node) + (node.id, next(count), node))
            tree.clock = clock
        else:
            self.uncacheable += 1
        for node in reversed(path):        # unlock, deepest first: candidates again
            node.lock_ref -= 1
            if not node.lock_ref and not node.n_l1_children:
                heappush(heap, key(node) + (node.id, next(count), node))
        return pos

    def _rebuild_plain(self) -> list[tuple]:
        """:meth:`Tier.rebuild <engine.cache.tiers.Tier.rebuild>` for :meth:`plain`'s heap:
        exactly the current candidates, in the tree's order (so the same key calls)."""
        key = self.policy.key
        count = self._count
        heap = [key(node) + (node.id, next(count), node) for node in self.tree.iter_nodes()
                if l1_candidate(node)]
        heapify(heap)
        self._heap = heap
        return heap

    def _evict_plain(self, n_pages: int) -> int:
        """:meth:`_evict` without hints: :meth:`Tier.evict <engine.cache.tiers.Tier.evict>`'s
        loop with :meth:`_evict_one` and the parent's push written out (a node of this cache
        is never loading, and each one is on L1 until it leaves the tree)."""
        tree = self.tree
        key = self.policy.key
        count = self._count
        heap = self._heap
        freed = 0
        rebuilt = False
        while freed < n_pages:
            if not heap:
                if rebuilt:
                    break
                heap = self._rebuild_plain()
                rebuilt = True
                continue
            entry = heappop(heap)
            node = entry[-1]
            parent = node.parent
            if parent is None or node.l1 is None or node.lock_ref or node.n_l1_children \
                    or key(node) != entry[:-3]:
                continue
            if node.children:
                continue
            tokens = node.tokens
            pages = len(tokens)
            self.free_pages += pages
            node.l1 = None
            del parent.children[tokens[:1].tobytes()]     # RadixTree.remove_leaf
            node.parent = None
            tree.num_nodes -= 1
            parent.n_l1_children -= 1
            freed += pages
            if parent.parent is not None and not parent.lock_ref and not parent.n_l1_children:
                heappush(heap, key(parent) + (parent.id, next(count), parent))
        if len(heap) > 4 * tree.num_nodes + 4096:
            self._rebuild_plain()
        self.evicted_pages += freed
        return freed


def drive_lean(cache: LeanReplay, requests: Iterable[np.ndarray], clock: list[int],
               progress: Callable[[int], None] | None = None, hints: "TraceHints | None" = None,
               raws: Sequence[bytes] | None = None) -> tuple[tuple[int, int, int, int], float]:
    """:func:`~engine.sim.replay._drive` for a :class:`LeanReplay`, the same return value
    (``clock[0]``: the request index, which ``opt``'s future index reads). ``hints``: the
    trace's client hints (each request's, and the trace's clock), sent with the requests.
    ``raws``: each request's ``tobytes()``, made once for many replays (no hints)."""
    hits = 0
    perf = time.perf_counter
    step = cache.request
    t0 = perf()
    if hints is not None:
        set_clock, times, hint_of = cache.set_clock, hints.times, hints.hint
        for i, toks in enumerate(requests):
            clock[0] = i
            set_clock(times[i])
            hits += step(toks, hint_of(i))
            if progress is not None:
                progress(i + 1)
        return (hits, 0, 0, cache.uncacheable), perf() - t0
    if raws is not None and cache.hints is None:
        plain = cache.plain
        for i, (toks, raw) in enumerate(zip(requests, raws)):
            clock[0] = i
            hits += plain(toks, raw)
            if progress is not None:
                progress(i + 1)
        return (hits, 0, 0, cache.uncacheable), perf() - t0
    step = cache.plain if cache.hints is None else cache.request
    for i, toks in enumerate(requests):
        clock[0] = i
        hits += step(toks)
        if progress is not None:
            progress(i + 1)
    return (hits, 0, 0, cache.uncacheable), perf() - t0
