"""The cache facade of a CP group: one logical tree, KV pages sharded by owner rank.

:class:`CPCache` wraps a :class:`~engine.cache.facade.HiCache` (it never changes the facade's
decisions) and adds what page sharding needs (docs/parallelism.md §1):

* the facade's L1 and L2 allocators become :class:`~engine.parallel.cp.OwnerAllocator`\\ s of
  ``N x`` the per-rank budget, so a page id says which rank holds it; restores and backups ask
  for pages *like* their source, so ownership survives every tier move;
* :meth:`alloc_for` continues the owner rotation of the matched prefix (A, B, C owned 0, 1, 0
  ⇒ D goes to 1); a prompt with no cached prefix starts where most pages are free;
* :meth:`insert` records each new segment's rotation in ``node.cp_owner`` and never joins a
  segment to a prefix whose rotation it does not continue: pages past the first break are not
  cached (a ``cp_cut`` event), so every cached path keeps one rotation and each rank owns
  ``floor(n/N)`` or ``ceil(n/N)`` of any ``n``-page prefix.

Every CP rank runs the same wrapper over the same logical state and so makes the same choices;
each then moves only the pages it owns (:meth:`OwnerAllocator.local_rows`).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from engine.cache.events import EventLog
from engine.cache.facade import HiCache
from engine.cache.policy import EvictionPolicy
from engine.cache.radix_tree import Node
from engine.cache.types import Admission, CacheConfig, LockReceipt, MatchResult, as_tokens
from engine.core.namespace import Namespace, as_namespace
from engine.parallel.cp import CPShape, OwnerAllocator
from formats.ranklog_events import CP_ALLOC, CP_CUT


class CPCache:
    """Rank ``rank`` of a CP group of ``cp_size``: one logical :class:`HiCache`.

    The configured tier sizes are per-rank budgets: each rank has that many pages, the logical
    pools ``cp_size`` times more. With a KV layout the pools hold this rank's rows only
    (:class:`~engine.parallel.cp_pool.OwnedPool`), so restores and backups move this rank's
    pages; without one (the replay) there are no bytes and ``rank`` does not matter.
    """

    def __init__(self, config: CacheConfig, cp_size: int, events: EventLog | None = None,
                 policy: EvictionPolicy | None = None, rank: int = 0, group: Any = None):
        self.shape = shape = CPShape(cp_size, config.page_size)
        self.rank = rank
        self.group = group          # the CP process group when the ranks run (poll agrees)
        strict = config.layout is not None
        self.cache = HiCache(config, events=events, policy=policy,
                             allocator=lambda name, n, _p: OwnerAllocator(shape, n, name,
                                                                          strict=strict))
        if config.layout is not None:
            from engine.parallel.cp_pool import OwnedPool

            self.cache.l1 = OwnedPool(self.cache.l1, shape, rank)
            if self.cache.l2 is not None:
                self.cache.l2 = OwnedPool(self.cache.l2, shape, rank)
        self.cache.hit_on_commit = True     # ranks classify matches alike (facade)
        self.cut_pages = 0
        self.cuts = 0
        self.agreeing = True        # off once the group stops (wait_all, close)

    def __getattr__(self, name: str) -> Any:
        # match, lock, unlock, load_back, poll, flush, wait_all, close, tree, events, ...
        return getattr(self.cache, name)

    # the facade's request release, through this wrapper's insert (pages keep their owners)
    release = HiCache.release

    # ------------------------------------------------------------------ rotation
    def path_start_owner(self, path: Sequence[Node]) -> int | None:
        """Owner of the first page of a (rotation-consistent) path, or None for an empty path."""
        if not path:
            return None
        return int(path[0].cp_owner) % self.shape.size

    def _start(self, m: MatchResult) -> int:
        """Owner of page 0 of ``m``'s prompt: the matched prefix's rotation (the matched nodes
        are the facade's own part of the result), or a fresh start."""
        start = self.path_start_owner(m._path)
        return self.cache.l1_alloc.fresh_owner() if start is None else start

    def _alloc_rotation(self, n_pages: int, first: int, rid: Any) -> np.ndarray:
        """``n_pages`` L1 pages owned ``first, first+1, …`` (mod N), evicting for the ranks that
        lack room. Raises ``OutOfCapacity`` when eviction cannot make it."""
        cache = self.cache
        alloc: OwnerAllocator = cache.l1_alloc
        short = alloc.shortfall(n_pages, first_owner=first)
        while short > 0 and cache.evict_l1(short):
            short = alloc.shortfall(n_pages, first_owner=first)
        pages = alloc.alloc_rotation(n_pages, first)
        cache.events.emit(CP_ALLOC, rid=rid, first_owner=first, pages=int(n_pages))
        return pages

    def alloc_for(self, m: MatchResult, n_pages: int) -> np.ndarray:
        """L1 pages for pages ``len(m.l1_pages) …`` of ``m``'s prompt, continuing its rotation."""
        first = self.shape.next_owner(self._start(m), len(m.l1_pages))
        return self._alloc_rotation(n_pages, first, m.rid)

    def admit(self, tokens, namespace: Namespace | str | None = None, *, rid: Any = None, priority: int = 0,
              extra_pages: int = 0, reuse: bool = True, partial: bool = True) -> Admission | None:
        """:meth:`HiCache.admit` (all or nothing: match, lock, allocate, load back) with every
        page the request allocates continuing the owner rotation of its prefix.

        No partial last-page reuse, whatever ``partial`` says: the cached page and the
        request's first own page may be owned by different ranks, and each rank holds only
        its own pages' rows (``HiCache.admit`` is off whenever ``place`` is given)."""
        def place(m: MatchResult | None):
            start = self.cache.l1_alloc.fresh_owner() if m is None else self._start(m)
            return lambda n, at: self._alloc_rotation(n, self.shape.next_owner(start, at), rid)

        return self.cache.admit(tokens, namespace, rid=rid, priority=priority,
                                extra_pages=extra_pages, reuse=reuse, place=place)

    def wait_all(self) -> None:
        """Finish every transfer; the group is stopping, so from now on this rank decides its
        L3 results alone (a peer may already be gone)."""
        self.agreeing = False
        self.cache.wait_all()

    def close(self) -> None:
        self.agreeing = False
        self.cache.close()

    def poll(self, limits: dict | None = None) -> dict[str, int]:
        """Commit finished transfers. With a process group, the ranks first agree on how many
        of each queue to commit — the fewest any rank has finished (``all_reduce(MIN)``) — so
        every rank's tree changes at the same step whatever its copy speed."""
        if self.group is None or limits is not None:
            return self.cache.poll(limits)
        import torch
        import torch.distributed as dist

        queues = ("load", "backup")
        ready = torch.tensor([self.cache.ready_count(q) for q in queues], dtype=torch.int64)
        dist.all_reduce(ready, op=dist.ReduceOp.MIN, group=self.group)
        return self.cache.poll(limits=dict(zip(queues, ready.tolist())))

    # ------------------------------------------------------------------ L3
    def agree(self, values: list[int]) -> list[int]:
        """The element-wise minimum of ``values`` over the CP group (alone: unchanged)."""
        if self.group is None or not self.agreeing:
            return list(values)
        import torch
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return [int(v) for v in t.tolist()]

    def attach_l3(self, impl: Any, prefetch_policy: str = "wait_complete",
                  prefetch_timeout: float = 1.0, agree: Any = None, ordered: bool = False) -> None:
        """The facade's L3 tier, with the CP rules: the ranks agree on every L3 result (each
        moves only its own pages, :class:`~engine.parallel.cp_store.OwnedStore`), and pages
        prefetched after a path continue its owner rotation. ``agree``: over a larger group
        than this one (TP x CP: the whole world, ``TPCache``); default :meth:`agree`."""
        self.cache.attach_l3(impl, prefetch_policy=prefetch_policy,
                             prefetch_timeout=prefetch_timeout, agree=agree or self.agree,
                             place=self._l3_place, adopt=self._l3_adopt, ordered=ordered)

    def _l3_place(self, path: Sequence[Node], n: int) -> np.ndarray:
        """L2 pages for up to ``n`` pages fetched after ``path``: its rotation continued (a
        fresh one at the root), evicting L2 for the ranks short of room; fewer when even
        eviction leaves a rank short."""
        cache, p = self.cache, self.cache.page_size
        alloc: OwnerAllocator = cache.l2_alloc
        start = self.path_start_owner(path)
        first = alloc.fresh_owner() if start is None else self.shape.next_owner(
            start, sum(len(node.tokens) // p for node in path))
        short = alloc.shortfall(n, first_owner=first)
        while short > 0 and cache.evict_l2(short):
            short = alloc.shortfall(n, first_owner=first)
        while n > 0 and alloc.shortfall(n, first_owner=first) > 0:
            n -= 1
        return alloc.alloc_rotation(n, first) if n else np.empty(0, dtype=np.int64)

    def _l3_adopt(self, node: Node) -> None:
        node.cp_owner = int(node.l2[0]) % self.shape.size

    # ------------------------------------------------------------------ insert
    def insert(self, tokens, pages: np.ndarray, namespace: Namespace | str | None = None, rid: Any = None,
               priority: int = 0, prefix_hashes: Sequence = (),
               after: LockReceipt | None = None) -> Node | None:
        """:meth:`HiCache.insert`, cut at the first page whose owner breaks the rotation of
        the path it would join (those pages go back to the allocator)."""
        cache, p, n = self.cache, self.cache.page_size, self.shape.size
        toks = as_tokens(tokens)
        n_full = len(toks) // p
        pages = np.asarray(pages, dtype=np.int64)
        if len(pages) != n_full:
            raise ValueError(f"insert needs {n_full} pages for {len(toks)} tokens, "
                             f"got {len(pages)}")
        namespace = as_namespace(namespace)
        cut = self._first_break(toks[:n_full * p], pages, namespace, after)
        if cut < n_full:
            self.cuts += 1
            self.cut_pages += n_full - cut
            cache.events.emit(CP_CUT, rid=rid, at_page=int(cut), pages=int(n_full - cut))
            cache.l1_alloc.free(pages[cut:])
            toks, pages = toks[:cut * p], pages[:cut]
        if cut == 0:
            return after._node if after is not None else None
        last = cache.insert(toks, pages, namespace=namespace, rid=rid, priority=priority,
                            prefix_hashes=prefix_hashes, after=after)
        if last is not None and last.cp_owner is None:     # the segment this insert added
            last.cp_owner = int(last.l1[0]) % n
        return last

    def _first_break(self, toks: np.ndarray, pages: np.ndarray, namespace: Namespace | str | None,
                     after: LockReceipt | None) -> int:
        """Index of the first page the tree could not take without breaking a rotation."""
        p, n = self.cache.page_size, self.shape.size
        start = after._node if after is not None else None   # the locked match, if any
        path, pos = self.cache.tree.walk(toks, namespace, split=False, start=start)
        owners = pages % n
        off = k = 0
        for node in path:
            k = min(len(node.tokens), pos - off * p) // p    # the last edge may match partly
            if node.l1 is None:          # the insert would adopt our pages: same owners?
                want = self.shape.rotation(int(node.cp_owner), k)
                bad = np.flatnonzero(owners[off:off + k] != want)
                if bad.size:
                    return off + int(bad[0])
            off += k
        if off < len(pages):
            # a new segment: below path[-1] (split after its k-th page) it must continue the
            # rotation; under the root it starts anywhere but must be one rotation
            first = self.shape.next_owner(int(path[-1].cp_owner), k) if path \
                else int(owners[off])
            bad = np.flatnonzero(owners[off:] != self.shape.rotation(first, len(pages) - off))
            if bad.size:
                return off + int(bad[0])
        return len(pages)

    # ------------------------------------------------------------------ checking
    def check_rotations(self) -> list[str]:
        """Problems with ownership: a node without an owner, a page on the wrong rank, a child
        that does not continue its parent's rotation. Empty when all is well."""
        n, p = self.shape.size, self.cache.page_size
        out = []
        for node in self.cache.tree.iter_nodes():
            if node.cp_owner is None:
                out.append(f"node {node.id}: no owner recorded")
                continue
            k = len(node.tokens) // p
            want = self.shape.rotation(int(node.cp_owner), k)
            for tier in ("l1", "l2"):
                pages = getattr(node, tier)
                if pages is not None and not np.array_equal(pages % n, want):
                    out.append(f"node {node.id}: {tier.upper()} pages owned by "
                               f"{(pages % n).tolist()}, rotation says {want.tolist()}")
            par = node.parent
            if par.parent is not None and par.cp_owner is not None and \
                    self.shape.next_owner(int(par.cp_owner), len(par.tokens) // p) \
                    != int(node.cp_owner) % n:
                out.append(f"node {node.id}: starts at owner {int(node.cp_owner) % n}, its "
                           f"parent {par.id} continues at "
                           f"{self.shape.next_owner(int(par.cp_owner), len(par.tokens) // p)}")
        return out

    # ------------------------------------------------------------------ reporting
    def stats(self) -> dict[str, Any]:
        out = self.cache.stats()
        l1: OwnerAllocator = self.cache.l1_alloc
        p = self.cache.page_size
        layout = self.cache.config.layout
        out["cp"] = {
            "cp_size": self.shape.size,
            "l1_used_tokens_per_rank": (l1.used_per_rank() * p).tolist(),
            "l2_used_tokens_per_rank": (self.cache.l2_alloc.used_per_rank() * p).tolist()
            if self.cache.l2_alloc is not None else None,
            "l1_kv_bytes_per_rank": None if layout is None
            else (l1.used_per_rank() * layout.page_bytes).tolist(),
            "l2_kv_bytes_per_rank": None if layout is None or self.cache.l2_alloc is None
            else (self.cache.l2_alloc.used_per_rank() * layout.page_bytes).tolist(),
            "rotation_cuts": self.cuts,
            "rotation_cut_pages": self.cut_pages,
        }
        return out
