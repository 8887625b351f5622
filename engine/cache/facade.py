"""The HiCache facade: one object the scheduler, the replay and the CLI talk to.

``admit`` (= ``match`` → ``lock`` → ``alloc`` → ``load_back``, all or nothing, then the partial
last-page copy) → (compute) → ``insert`` → ``unlock``, with ``poll`` once per scheduler step to
commit finished transfers.
Callers never see tree nodes; they get :class:`Admission`, :class:`MatchResult` and
:class:`LockReceipt` values back (node ids only). Every decision is an explicit step that emits
one event on :class:`~engine.cache.events.EventLog` (kinds: :mod:`formats.ranklog_events`).

Tiers: L1 device pool, L2 host pool (each a :class:`~engine.cache.tiers.Tier` record for
eviction), L3 external store (an :class:`~engine.cache.l3.L3Tier` the facade holds). L1
residency is prefix-closed; a node evicted from L1 that is backed up in L2 stays in the tree
and is loaded back on a hit; L2 eviction removes leaves that are not on L1.
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from engine.cache.allocator import PageAllocator
from engine.cache.events import EV, EventLog
from engine.cache.facade_complete import CompletionMethods
from engine.cache.facade_hints import HintMethods
from engine.cache.hints import CacheHint, HintBook
from engine.cache.l3 import L3Tier
from engine.cache.policy import EvictionPolicy, make_policy
from engine.cache.radix_tree import Node, RadixTree, common_len
from engine.cache.tiers import Tier, l1_candidate, l2_candidate
from engine.cache.transfer import OpKind, TransferEngine, TransferOp, op_id_sequence
from engine.cache.types import (  # noqa: F401 (CacheConfig, as_tokens re-exported)
    Admission,
    CacheConfig,
    FlushScope,
    LoadHandle,
    LockReceipt,
    MatchResult,
    WritePolicy,
    as_tokens,
)
from engine.core.device import resolve_device
from engine.core.errors import OutOfCapacity
from engine.core.namespace import Namespace, as_namespace

if TYPE_CHECKING:  # torch: the pools are imported only where they are built
    from engine.cache.pool import DevicePool, HostPool
    from engine.cache.sidecar import PairedPool

_STAT_COUNTERS = ("match_tokens", "hit_l1_tokens", "hit_l2_tokens", "hit_l3_tokens",
                  "hit_l1_partial_tokens", "loadback_pages", "loadback_ops", "backup_pages",
                  "evicted_l1_pages", "evicted_l2_pages", "prefetch_pages")


class HiCache(CompletionMethods, HintMethods):
    """The cache stack of one rank (see the module docstring and docs/engine-api.md)."""

    def __init__(self, config: CacheConfig, events: EventLog | None = None,
                 policy: EvictionPolicy | None = None, allocator=None):
        """``allocator(name, num_pages, page_size)``: builds the page allocators (default: a
        :class:`PageAllocator`, the pool's own when there are pools). A CP rank passes
        owner-aware ones (``engine.parallel.cp``) and wraps the pools it owns rows of."""
        self.config = config
        self.page_size = p = config.page_size
        self.write_policy = WritePolicy.parse(config.write_policy)
        self.events = events if events is not None else EventLog(enabled=config.events)
        self.policy = policy or make_policy(config.eviction_policy, **config.policy_kwargs)
        self.tree = RadixTree(p)
        self.device = resolve_device(config.device) if config.layout is not None else "cpu"
        if config.layout is not None:
            from engine.cache.pool import DevicePool, HostPool  # torch: only when pools exist

            self.l1: DevicePool | PairedPool | None = DevicePool(config.layout, config.l1_pages, self.device)
            self.l1_alloc = allocator("L1", config.l1_pages, p) if allocator else self.l1.allocator
            pin = self.device.startswith("cuda")
            self.l2: HostPool | PairedPool | None = (
                HostPool(config.layout, config.l2_pages, config.host_layout, pin=pin)
                if config.l2_pages else None)
            self.l2_alloc = (None if self.l2 is None else allocator("L2", config.l2_pages, p)
                             if allocator else self.l2.allocator)
            self.num_layers = config.layout.num_layers
            if config.sidecar is not None:      # draft KV: own pools, the target's page ids
                from engine.cache.sidecar import PairedPool

                self.l1 = PairedPool(self.l1, DevicePool(config.sidecar, config.l1_pages,
                                                         self.device))
                if self.l2 is not None:
                    self.l2 = PairedPool(self.l2, HostPool(config.sidecar, config.l2_pages,
                                                           config.host_layout, pin=pin))
                self.num_layers = self.l1.num_layers
        else:
            self.l1 = None
            self.l2 = None
            make = allocator or (lambda name, n, ps: PageAllocator(n, ps, name=name,
                                                                   strict=False))
            self.l1_alloc = make("L1", config.l1_pages, p)
            self.l2_alloc = make("L2", config.l2_pages, p) if config.l2_pages else None
            self.num_layers = 1
        self._op_ids = op_id_sequence()    # one op-id sequence: transfers and L3 jobs
        self.transfers = TransferEngine(self.device, op_ids=self._op_ids)
        self.l3: L3Tier | None = None      # set by attach_l3
        # A load that finished but is not committed yet counts as an L2 hit, not L1: set where
        # several ranks must classify a match alike (each rank's copy finishes at its own time;
        # the commit is the step they agree on).
        self.hit_on_commit = False
        # A backup's L2 allocation as the ranks of a group agree on it: ``agree_backup([ok])``
        # is the minimum over the ranks (set by TPCache), so a backup one rank cannot place is
        # skipped on every rank. ``backup_fault()``: a debug injector's failure on one rank.
        self.agree_backup: Any = None
        self.backup_fault: Any = None
        self._inflight: dict[OpKind, collections.deque[TransferOp]] = {
            k: collections.deque() for k in OpKind}
        self._t1 = Tier("l1", self.l1_alloc, l1_candidate, self._evict_l1_node)
        self._t2 = (Tier("l2", self.l2_alloc, l2_candidate, self._evict_l2_node)
                    if self.l2_alloc is not None else None)
        self.counters: collections.Counter = collections.Counter()
        # client hints (engine.cache.hints): made by the first set_clock or hinted request
        self.hints: HintBook | None = None
        attach = getattr(self.policy, "attach", None)
        if attach is not None:             # a policy that needs the tier size (``bip``)
            attach(self)

    def attach_l3(self, impl, prefetch_policy: str = "wait_complete",
                  prefetch_timeout: float = 1.0, agree: Any = None, place: Any = None,
                  adopt: Any = None, ordered: bool = False) -> None:
        """Add the L3 tier (``engine.cache.l3.StoreTier`` or ``SimulatedTier``); needs an L2.
        ``agree``: the ranks' minimum of a list of counts, when several ranks hold shards of
        the same pages; ``place``/``adopt``: where prefetched pages go when each rank holds some
        of the pages (see :class:`~engine.cache.l3.L3Tier`); ``ordered``: a pipeline stage's
        (results land at the step pp_sync names)."""
        if self.l2_alloc is None:
            raise ValueError("an L3 store needs an L2 host pool (set l2_tokens > 0)")
        self.l3 = L3Tier(impl, self.page_size, tree=self.tree, l2_alloc=self.l2_alloc,
                         events=self.events, counters=self.counters, pin=self._pin,
                         touch=self._push_candidate, evict_l2=self.evict_l2,
                         op_ids=self._op_ids, prefetch_policy=prefetch_policy,
                         prefetch_timeout=prefetch_timeout, agree=agree, place=place,
                         adopt=adopt)
        self.l3.ordered = ordered

    # ------------------------------------------------------------------ admission
    def admit(self, tokens: Sequence[int] | np.ndarray,
              namespace: Namespace | str | None = None, *, rid: Any = None, priority: int = 0,
              extra_pages: int = 0, reuse: bool = True, place: Any = None,
              partial: bool = True) -> Admission | None:
        """Admit a request in one all-or-nothing step: match → lock → alloc → load-back, then
        partial last-page reuse.

        Reserves the request's L1 page table: one page per page of ``tokens`` (the last one may
        be partial) plus ``extra_pages`` (decode room, lookahead pages). The matched prefix's
        pages come from the cache (the L2 part and what L3 prefetched are loaded back into L1);
        the rest are allocated (evicting unlocked KV). The request's own pages are allocated
        *before* the load-back, so a request that cannot be admitted yet starts no load-back.

        **Partial last-page reuse** (``partial``, on by default): the tree matches whole pages
        only, so the tokens after the prefix would all be computed although a cached page may
        start with some of them (a repeated prompt: every token but the last is cached, the
        last page up to its last token). Once the page table is complete (nothing can be
        evicted any more), the children of the prefix's last node (the namespace's root when
        nothing matched) are searched for the edge whose first page shares the longest prefix,
        ``c >= 1`` tokens, with the next tokens of ``tokens`` (so ``c`` never passes
        ``len(tokens)``, and is below ``page_size``: a whole page would have matched). When that
        page is on L1 and committed there (no load in flight), the KV of its first ``c`` slots
        is copied into slots ``0 … c-1`` of the request's first own page
        (``l1.copy_slots``: every layer and kind, and a draft sidecar's pool), and the
        admission reports ``partial_len = c`` (counted in ``device_len``; counter
        ``hit_l1_partial_tokens``; event ``partial``): the caller's KV is valid up to
        ``n_prefix_pages * page_size + partial_len``. The copied page stays the request's own
        (a duplicate of a tree page is freed by :meth:`insert`). Never from L2 or L3, never
        across namespaces (the search stays in the namespace's tree, as :meth:`match` does).
        Off (``partial_len == 0``) with ``partial=False``, without ``reuse``, with ``place``
        (a CP group: the source and destination pages may sit on different ranks), without
        KV pools, and when the load-back found no room (the prefix then ends before the match).

        Returns ``None`` when L1 has no room even after eviction; then nothing is held (one
        rollback path: the own pages are freed and the prefix unlocked). ``reuse=False``
        allocates the page table without looking at the cache (no match, no lock).
        ``place(m)`` (``m`` the locked match, ``None`` without reuse) returns ``alloc(n, at)``,
        which allocates the ``n`` pages from page ``at`` of the table on (a CP group keeps its
        owner rotation, ``engine.parallel.cp_cache``); default: plain :meth:`alloc`.
        """
        p = self.page_size
        namespace = as_namespace(namespace)
        total = -(-len(tokens) // p) + extra_pages
        if not reuse:
            try:
                own = place(None)(total, 0) if place else self.alloc(total)
            except OutOfCapacity:
                return None
            return Admission(rid, namespace, own, 0, None, None)
        toks = as_tokens(tokens)
        m = self.match(toks, namespace, rid=rid, priority=priority)
        receipt = self.lock(m)
        alloc_at = place(m) if place else (lambda n, at: self.alloc(n))
        resident = m.l1_len // p + (m.l2_len + m.l3_len) // p   # L1 hit, then L2 (+ L3 prefetched)
        own = None
        try:
            own = alloc_at(total - resident, resident)
            load = self.load_back(m)
            missing = resident - (m.l1_len + m.loaded_len) // p   # no room to load back: computed
            if missing:
                own = np.concatenate([alloc_at(missing, resident - missing), own])
        except OutOfCapacity:
            if own is not None:
                self.free(own)
            self.unlock(receipt)
            return None
        a = Admission.of_match(m, receipt, own, load, p)
        if partial and place is None and not missing and self.l1 is not None:
            self._reuse_partial_page(m, toks, a)
        return a

    def _reuse_partial_page(self, m: MatchResult, toks: np.ndarray, a: Admission) -> None:
        """Partial last-page reuse (see :meth:`admit`): copy the KV of the longest cached start
        of the request's next page into its first own page; records it on ``a``."""
        p = self.page_size
        pos = a.n_prefix_pages * p
        path = m._path
        if pos >= len(toks) or sum(len(n.tokens) for n in path) != pos:
            return                          # nothing left to compute, or the prefix was cut
        parent = path[-1] if path else self.tree.roots.get(m.namespace)
        if parent is None or not parent.children:
            return
        want = toks[pos:pos + p]
        # Children are keyed by the bytes of their first page: one C-level prefix test per child
        # says whether it beats the best so far, so a root with many children (prompts that
        # share only their first token) costs a dict scan, not a comparison per child.
        wb = want.tobytes()
        tb = want.itemsize
        src, c = None, 0
        for key, child in parent.children.items():
            # committed on L1 only: a load in flight (or finished, not yet committed: it may
            # have failed, and the commit is the step the ranks of a group agree on) is not
            if key.startswith(wb[:tb * (c + 1)]) and child.l1 is not None \
                    and child.loading is None:
                src, c = child, common_len(child.tokens[:p], want)
                if c == len(want):
                    break
        if src is None:
            return
        assert c < p, f"a whole page of {src!r} after the match was not matched"
        assert src.l1 is not None and self.l1 is not None   # tested above / by admit
        self.l1.copy_slots(int(src.l1[0]), int(a.pages[a.n_prefix_pages]), c)
        self.tree.clock += 1                # the source served this request: recently used
        src.last_access = self.tree.clock
        src.hit_count += 1
        self._push_candidate(src)
        a.partial_len = c
        a.device_len += c
        self.counters["hit_l1_partial_tokens"] += c
        self.events.emit(EV.PARTIAL, rid=m.rid, node=src.id, tokens=int(c))

    # ------------------------------------------------------------------ match / lock
    def match(self, tokens: Sequence[int] | np.ndarray, namespace: Namespace | str | None = None,
              rid: Any = None, priority: int = 0) -> MatchResult:
        """``namespace``: a :class:`~engine.core.namespace.Namespace`, a string (its
        ``namespace`` field) or ``None`` (the default one); namespaces never share a node."""
        toks = as_tokens(tokens)
        namespace = as_namespace(namespace)
        tree = self.tree
        path, _ = tree.walk(toks, namespace)
        push = self._push_candidate
        n1 = -1                            # path[:n1] is the L1 hit (set at the first non-L1)
        l1_len = l2_len = 0
        for i, node in enumerate(path):
            tree.clock += 1
            node.last_access = tree.clock
            node.hit_count += 1
            if priority > node.priority:
                node.priority = priority
            if not node.lock_ref and (node.l2 is not None or not node.n_l1_children):
                push(node)                 # only nodes that can be eviction candidates
            if n1 < 0 and (node.l1 is None or (node.loading is not None and (
                    self.hit_on_commit or not node.loading.done()))):
                n1 = i
            if n1 < 0:
                l1_len += len(node.tokens)
            else:
                assert node.l2 is not None, f"{node!r} past the L1 prefix is not in L2"
                l2_len += len(node.tokens)
        if n1 < 0:
            n1 = len(path)
        if tree.split_lower is not None:
            tree.clock += 1
            tree.split_lower.last_access = tree.clock
            push(tree.split_lower)
            if tree.split_lower.hint_until is not None:
                self._hinted_split(tree.split_lower)
        l3_len = 0
        hashes: list = []
        if self.l3 is not None:
            hashes = self.l3.hashes(toks, namespace)
            start = (l1_len + l2_len) // self.page_size
            if start < len(hashes):
                l3_len = self.l3.prefetch(path, toks, namespace, hashes, start, rid) \
                    * self.page_size
        l1_pages = (np.concatenate([n.l1 for n in path[:n1]]) if n1
                    else np.empty(0, dtype=np.int64))
        m = MatchResult(rid, namespace, l1_len, l2_len, l3_len, l1_pages, hashes=hashes,
                        _path=path, _n_l1=n1)
        c = self.counters
        c["match_tokens"] += len(toks)
        c["hit_l1_tokens"] += l1_len
        c["hit_l2_tokens"] += l2_len
        c["hit_l3_tokens"] += l3_len
        self.events.emit(EV.MATCH, rid=rid, l1_len=l1_len, l2_len=l2_len, l3_len=l3_len)
        if self.write_policy is WritePolicy.WRITE_THROUGH_SELECTIVE and self.l2_alloc:
            hot = [n for n in path[:n1] if n.l2 is None and n.backing_up is None
                   and n.hit_count >= self.config.write_through_threshold]
            if hot:
                self._backup(hot)
        return m

    def lock(self, m: MatchResult) -> LockReceipt:
        """Pin the matched path (every tier) until :meth:`unlock`."""
        node = m._path[-1] if m._path else None
        self._pin(node, +1)
        node_id = node.id if node else None
        self.events.emit(EV.LOCK, rid=m.rid, node=node_id)
        return LockReceipt(m.rid, node_id, node)

    def unlock(self, receipt: LockReceipt) -> None:
        self.events.emit(EV.UNLOCK, rid=receipt.rid, node=receipt.node_id)
        self._pin(receipt._node, -1)

    def _pin(self, node: Node | None, delta: int) -> None:
        """The one lock walk: add ``delta`` to the lock count of ``node`` and its ancestors; a
        node whose count drops to zero becomes an eviction candidate again."""
        push = self._push_candidate
        n = node
        while n is not None and n.parent is not None:
            n.lock_ref += delta
            assert n.lock_ref >= 0, f"unlock of {n!r} below zero"
            if n.lock_ref == 0:
                push(n)
            n = n.parent

    # ------------------------------------------------------------------ load-back L2 -> L1
    def load_back(self, m: MatchResult) -> LoadHandle | None:
        """Make the L2 part of ``m`` L1-resident. ``m`` must be locked by the caller."""
        todo = m._path[m._n_l1:]
        if not todo:
            return None
        assert todo[-1].lock_ref > 0, "load_back of an unlocked match"
        ops: list[TransferOp] = []
        fresh: list[Node] = []
        pages_parts = [m.l1_pages]
        loaded = 0
        for node in todo:
            if node.l1 is not None:            # being loaded by another request
                assert node.loading is not None
                if node.loading not in ops:
                    ops.append(node.loading)
            else:
                fresh.append(node)
        need = sum(len(n.tokens) for n in fresh) // self.page_size
        if need:
            src = np.concatenate([n.l2 for n in fresh])
            try:
                new_pages = self.alloc(need, like=src)
            except OutOfCapacity:
                # No room even after eviction: nothing is loaded, the caller recomputes.
                self.counters["loadback_no_room"] += 1
                m.load = LoadHandle([])
                return m.load
            op = self.transfers.new_op(OpKind.LOAD, self.l2, src, self.l1, new_pages,
                                       self.num_layers, payload=list(fresh))
            off = 0
            for node in fresh:
                k = len(node.tokens) // self.page_size
                node.l1 = new_pages[off:off + k]
                node.loading = op
                assert node.parent is not None   # a path node, never a root
                node.parent.n_l1_children += 1
                off += k
            self.events.emit(EV.RESTORE, op=op.op_id, rid=m.rid, pages=int(need))
            self.counters["loadback_pages"] += need
            self.counters["loadback_ops"] += 1
            self._inflight[OpKind.LOAD].append(op)
            self.transfers.submit(op)
            ops.append(op)
        for node in todo:
            pages_parts.append(node.l1)
            loaded += len(node.tokens)
        m.l1_pages = np.concatenate(pages_parts)
        m.loaded_len = loaded
        m.load = LoadHandle(ops)
        return m.load

    # ------------------------------------------------------------------ L1 allocation
    def alloc(self, n_pages: int, like: np.ndarray | None = None) -> np.ndarray:
        """``n_pages`` L1 pages, evicting first if needed; ``like``: see ``PageAllocator.alloc``."""
        short = self.l1_alloc.shortfall(n_pages, like)
        while short > 0 and self.evict_l1(short):
            short = self.l1_alloc.shortfall(n_pages, like)
        return self.l1_alloc.alloc(n_pages, like)

    def alloc_for(self, m: MatchResult, n_pages: int) -> np.ndarray:
        """L1 pages that extend the prefix ``m`` matched (a CP wrapper continues its owner
        rotation here; a single rank needs no more than :meth:`alloc`)."""
        return self.alloc(n_pages)

    def free(self, pages: np.ndarray) -> None:
        self.l1_alloc.free(pages)

    def release(self, tokens: np.ndarray, pages: np.ndarray, *, insert: bool,
                n_prefix_pages: int = 0, namespace: Namespace | str | None = None,
                rid: Any = None, priority: int = 0, prefix_hashes: Sequence = (),
                receipt: "LockReceipt | None" = None, hint: CacheHint | None = None) -> None:
        """The end of one request — the one path the scheduler and the P/D prefill worker
        take. ``insert``: the full pages of ``tokens`` (whose KV ``pages`` hold) go into the
        tree, which owns them from now on, and the pages past them are freed; else only the
        request's own pages (after the ``n_prefix_pages`` its match locked) are freed. Then
        its lock (``receipt``) is released. A wrapper (CP) that has its own :meth:`insert`
        gets it through this same method. ``hint``: what the client said of the request's
        session (:class:`~engine.cache.hints.CacheHint`), applied to its path."""
        last = receipt._node if receipt is not None else None
        if insert:
            n_full = len(tokens) // self.page_size
            last = self.insert(tokens[:n_full * self.page_size], pages[:n_full], namespace,
                               rid=rid, priority=priority, prefix_hashes=prefix_hashes,
                               after=receipt) or last
            self.free(pages[n_full:])
        else:
            self.free(pages[n_prefix_pages:])
        if hint is not None or self.hints is not None:
            self.hint(last, namespace, hint, rid=rid)
        if receipt is not None:
            self.unlock(receipt)

    # ------------------------------------------------------------------ insert
    def insert(self, tokens: Sequence[int] | np.ndarray, pages: np.ndarray,
               namespace: Namespace | str | None = None, rid: Any = None, priority: int = 0,
               prefix_hashes: Sequence = (), after: "LockReceipt | None" = None
               ) -> Node | None:
        """Take ownership of ``pages`` (one L1 page per full page of ``tokens``).

        The tree may keep a view of ``tokens`` (a uint32 array is not copied): do not modify
        the array afterwards.

        ``prefix_hashes`` (``MatchResult.hashes``) saves rehashing the matched prefix when an
        L3 tier needs page hashes. ``after``: the still-held receipt of this request's match —
        its node is a prefix of ``tokens`` and cannot have left the tree, so the walk resumes
        there instead of at the root."""
        p = self.page_size
        namespace = as_namespace(namespace)
        toks = as_tokens(tokens)
        n_full = len(toks) // p
        pages = np.asarray(pages, dtype=np.int64)
        if len(pages) != n_full:
            raise ValueError(f"insert needs {n_full} pages for {len(toks)} tokens, "
                             f"got {len(pages)}")
        toks = toks[:n_full * p]
        start = after._node if after is not None else None
        if start is not None:
            assert start.lock_ref > 0 and start.namespace == namespace, "stale insert hint"
        path, pos = self.tree.walk(toks, namespace, start=start)
        if self.tree.split_lower is not None and self.tree.split_lower.hint_until is not None:
            self._hinted_split(self.tree.split_lower)
        tick = self.tree.tick
        off = 0
        revived: list[Node] = []
        dup_parts = []
        for node in path:
            k = len(node.tokens) // p
            mine = pages[off:off + k]
            if node.l1 is None:
                node.l1 = mine.copy()
                assert node.parent is not None   # a path node, never a root
                node.parent.n_l1_children += 1
                revived.append(node)
            else:
                dup_parts.append(mine[mine != node.l1])
            node.last_access = tick()
            if priority > node.priority:
                node.priority = priority
            self._push_candidate(node)
            off += k
        if dup_parts:
            dups = np.concatenate(dup_parts)
            if dups.size:
                self.l1_alloc.free(dups)
        last = path[-1] if path else self.tree.root(namespace)
        new_node = None
        if pos < len(toks):
            parent = last
            suffix = toks[pos:]
            if 2 * len(suffix) < len(toks):
                # A view would keep the whole (mostly cached) prompt alive: copy the new part.
                # Otherwise the view wastes less than the node's own size — no copy needed.
                suffix = suffix.copy()
            new_node = self.tree.add_child(parent, suffix)
            new_node.l1 = pages[off:].copy()
            new_node.last_access = tick()
            new_node.priority = priority
            parent.n_l1_children += 1
            self._push_candidate(new_node)
            last = new_node
        if self.l3 is not None:
            full_path = path + ([new_node] if new_node is not None else [])
            self.l3.assign_hashes(full_path, self.l3.hashes(toks, namespace, prefix_hashes))
        self.events.emit(EV.INSERT, rid=rid, node=last.id if last.parent else None,
                         tokens=int(len(toks)), new_tokens=int(len(toks) - pos))
        if self.l2_alloc is not None and self.write_policy is WritePolicy.WRITE_THROUGH \
                and new_node is not None:
            self._backup([new_node])
        return last if last.parent is not None else None

    # ------------------------------------------------------------------ backup L1 -> L2
    def _backup(self, nodes: list[Node], sync: bool = False) -> bool:
        """Issue L1->L2 copies for ``nodes`` (all L1-resident, not in L2). False if no room."""
        p = self.page_size
        l2_alloc = self.l2_alloc
        assert l2_alloc is not None, "a backup needs an L2 tier"
        need = sum(len(n.tokens) for n in nodes) // p
        src = np.concatenate([n.l1 for n in nodes])
        short = l2_alloc.shortfall(need, src)
        while short > 0 and self.evict_l2(short):
            short = l2_alloc.shortfall(need, src)
        ok = short <= 0 and not (self.backup_fault is not None and self.backup_fault())
        if self.agree_backup is not None:   # the same outcome on every rank of the group
            ok = bool(self.agree_backup([int(ok)])[0])
        if not ok:
            self.counters["backup_no_room"] += 1
            return False
        dst = l2_alloc.alloc(need, like=src)
        op = self.transfers.new_op(OpKind.BACKUP, self.l1, src, self.l2, dst, self.num_layers,
                                   payload=list(nodes))
        off = 0
        for node in nodes:
            node.backing_up = (op, off)
            off += len(node.tokens) // p
        self.events.emit(EV.BACKUP, op=op.op_id, pages=int(need))
        self.counters["backup_pages"] += need
        self._inflight[OpKind.BACKUP].append(op)
        self.transfers.submit(op)
        if sync:
            op.wait()
            self._drain(OpKind.BACKUP, until=op)
        return True

    # ------------------------------------------------------------------ completion
    # (poll, wait_all, ready_count and each op's commit: engine/cache/facade_complete.py)

    # ------------------------------------------------------------------ eviction
    # (the passes and the candidates: engine/cache/facade_evict.py)
    def flush(self, scope: "FlushScope | str" = "cache") -> None:
        """Empty tiers (:class:`FlushScope`): ``cache`` drops every unlocked page of L1 and L2
        (locked KV stays), as SGLang's ``/flush_cache`` does; ``storage`` removes every object
        of the L3 store; ``all`` both."""
        scope = FlushScope.parse(scope)
        self.wait_all()
        if scope is not FlushScope.STORAGE:
            self.evict_l1(1 << 62)
            if self.l2_alloc is not None:
                self.evict_l2(1 << 62)
        if scope is not FlushScope.CACHE and self.l3 is not None:
            self.l3.clear()
        if scope is not FlushScope.STORAGE:
            self.events.emit(EV.FLUSH)

    # ------------------------------------------------------------------ reporting
    def stats(self) -> dict[str, Any]:
        """Pool use, counters and the eviction policy's own account (engine/cache/report.py)."""
        from engine.cache.report import cache_stats

        return cache_stats(self, _STAT_COUNTERS)

    def close(self) -> None:
        if self.l3 is not None:
            self.l3.agree_stages = None       # stopping: the other stages may be gone
        self.wait_all()
        self.transfers.close()
        if self.l3 is not None:
            self.l3.close()
