"""``density``: admission by measured hit density per class of prefix.

The problem (docs/eviction.md): on conversation traffic a new prefix comes back, if at all,
after a reuse distance several times the cache. LRU keeps every new prefix a little, nearly all
of them too short to be hit. Keeping only *some* new prefixes, for longer, turns the same space
into hits — and which ones to keep can be learnt per class, because classes differ: a later turn
of a conversation is continued far more often than a first turn, and a long new message less
often than a short one.

From the past only, the policy keeps:

* a token clock (tokens of newly inserted nodes);
* per node, the *interval* since its last touch (insertion or hit) and its class then. The
  interval ends in a reuse when the node is hit, or when the edge it would re-create is
  inserted again after it was evicted — a *ghost*, remembered by ``(parent id, first page)``
  with the page ends (so the tokens really shared are counted) for 64 × L1 of insertions;
* per class, a log-binned histogram of reuse distances (tokens reused) and the tokens whose
  interval started in the class, both halved every 16 × L1 of insertions.

A class is three facts known at the touch: the node's *turn* (its depth in the tree, counting an
evicted edge it continues as one level: a ghost hit continues the ghost's turn), the tokens the
touch added (for a continuation, beyond what it shares with the evicted edge), and whether the
node was hit before. Nodes that were hit before are always admitted; everything admitted shares
one LRU order.

Every L1/8 of insertions it solves "which fresh classes to admit": admitted nodes all live about
``T``; for each ``T`` on the histogram grid, the reused classes take their cache-time first,
then fresh classes in order of hit density at ``T`` (``F_c(T) / E[min(d, T)]``), the marginal
one in part (a hashed share of its nodes), until the L1 is full; the ``T`` with the most
expected hits wins. When everything fits, or nothing beats admitting all, the policy is LRU.
Switching is not free (an LRU phase admits everything and flushes the sample kept so far), so
once it filters it goes back to LRU only when LRU is predicted 20% better.
Sparse classes borrow from the pooled histogram (8 × L1 pseudo-tokens), so no decision rests on
a handful of nodes. Until 4 × L1 tokens were inserted it is exactly LRU.

A node's key is fixed at its touch: ``(last_access + 2**60,)`` if admitted, ``(last_access,)``
if not (the LRU end, evicted first) — admitting all is LRU exactly. The cache's heap, leaf-first
order and locks are unchanged, and every rank that sees the same operations computes the same
keys (the admission draw is a hash of the node id). A split's lower half (the part a request did
not reuse) keeps its key while classes are filtered; LRU would refresh it.
"""

from __future__ import annotations

import array
import collections
import math
from typing import Any

import numpy as np

from engine.cache.policy_measured import GhostTable, MeasuringPolicy, drawn, edge_key

_BPO = 2                          # histogram buckets per octave of distance
_NB = 48 * _BPO
_ADMIT = 1 << 60                 # key offset of admitted nodes (above every unadmitted key)
_PRIOR = 8.0                      # pseudo-tokens, in L1 sizes, a class borrows from the pool
_DECAY = 16                       # histograms halve every this many L1s of insertions
_GHOST_HORIZON = 64               # ghosts are kept for this many L1s of insertions
_HYST = 0.2                       # while filtering, LRU must be predicted this much better
_WARMUP = 4                       # LRU until this many L1s were inserted
_MAX_TURN = 8
_SIZE_BUCKETS = 4                 # added-token classes, a factor 4 apart (in pages)

_EDGES = np.array([2.0 ** ((b + 1) / _BPO) - 1.0 for b in range(_NB)])   # bucket upper ends
_MIDS = 0.5 * (_EDGES + np.concatenate(([0.0], _EDGES[:-1])))
_COLS = np.arange(_NB)


def _bucket(distance: float) -> int:
    return min(int(_BPO * math.log2(distance + 1.0)), _NB - 1)


# the added-token class of 0 … 4**(_SIZE_BUCKETS - 1) pages (every larger count is the last)
_SIZE_OF = tuple(min(int(math.log(max(n, 1), 4)), _SIZE_BUCKETS - 1)
                 for n in range(4 ** (_SIZE_BUCKETS - 1) + 1))


class _Class:
    __slots__ = ("hist", "touched")

    def __init__(self):
        # reused tokens by reuse-distance bucket (pages): doubles in one buffer, so the solve
        # reads every class's histogram as a matrix without converting a float at a time
        self.hist = array.array("d", bytes(8 * _NB))
        self.touched = 0.0            # tokens whose interval started in this class


# per-node state, a list indexed by these
_SEEN, _KEY, _START, _CLS, _TURN, _HITS, _ADDED = range(7)


class DensityPolicy(MeasuringPolicy):
    """See the module docstring. ``capacity_tokens`` is learnt from :meth:`attach`."""

    name = "density"

    def __init__(self, capacity_tokens: int = 0, page_size: int = 1):
        super().__init__(capacity_tokens, page_size)
        self.clock = 0                        # tokens of newly inserted nodes so far
        self.inserted = 0.0                   # decayed copy of the same (the time span)
        self.classes: dict[tuple, _Class] = collections.defaultdict(_Class)
        self.ghosts = GhostTable()            # (parent id, first page) -> (class, ends, turn)
        self.shares: dict[tuple, float] = {}  # fresh class -> admitted share; empty: LRU
        self._next_choice = 0
        self._next_decay = 0
        self.decisions = 0                    # solves after the warm-up
        self.filtering_decisions = 0          # ... that filtered some class
        self.not_admitted = 0                 # touches placed at the LRU end

    # -- ordering --------------------------------------------------------------------------
    def key(self, node) -> tuple:
        # (the steps are written out here: a replay calls this a few times per request)
        nid = node.id
        st = self._state.get(nid)
        now = node.last_access
        gk = None
        if st is None:
            st, gk = self._first_sight(node)
        elif st[_SEEN] == now:
            return st[_KEY]
        elif node.hit_count > st[_HITS]:
            # a hit: the open interval ends in a reuse and a new one starts
            self._record(st[_CLS], self.clock - st[_START], len(node.tokens))
        else:
            # touched without a hit (a split's lower half, the part not reused): LRU refreshes
            # it; while classes are filtered it keeps its key
            st[_SEEN] = now
            if not self.shares:
                st[_KEY] = self._key_for(nid, st[_CLS], now)
            return st[_KEY]
        hits = st[_HITS] = node.hit_count
        p = self.page_size
        turn = st[_TURN]
        cls = self._class_of(st[_ADDED], turn, hits)
        clock = st[_START] = self.clock
        st[_CLS] = cls
        tokens = node.tokens
        self.classes[cls].touched += len(tokens)
        parent = node.parent
        if parent is not None:
            # the open interval, findable after eviction by the edge it would re-create; the
            # page ends copied: a view would keep the node's whole token array alive
            ends = tokens.copy() if p == 1 else tokens[p - 1::p].copy()
            self.ghosts.put(gk or (parent.id, tokens[:p].tobytes()), clock, (cls, ends, turn),
                            clock - _GHOST_HORIZON * max(self.capacity, 1))
        share = self.shares.get(cls, 1.0)
        if share >= 1.0 or drawn(nid, share):
            key = (now + _ADMIT,)
        else:
            key = (now,)
            self.not_admitted += 1
        st[_SEEN] = now
        st[_KEY] = key
        return key

    def _key_for(self, node_id: int, cls, now: int) -> tuple:
        """Recency as the cache's own clock (``last_access``), so admitting all is LRU exactly;
        not admitted: below every admitted key."""
        share = self.shares.get(cls, 1.0)
        if share >= 1.0 or drawn(node_id, share):
            return (now + _ADMIT,)
        return (now,)

    def _class_of(self, added: int, turn: int, hits: int) -> tuple:
        pages = max(added // max(self.page_size, 1), 1)
        size = _SIZE_OF[pages] if pages < len(_SIZE_OF) else _SIZE_BUCKETS - 1
        return (min(turn, _MAX_TURN), size, hits > 0)

    def _first_sight(self, node) -> tuple[list, tuple | None]:
        """The node's new record, and for a newly inserted leaf the edge it hangs on (the
        ghost table's key, :func:`~engine.cache.policy_measured.edge_key`)."""
        parent = node.parent
        pst = self._state.get(parent.id) if parent is not None else None
        turn = (pst[_TURN] + 1) if pst is not None else self._depth(node)
        n = len(node.tokens)
        # mixed record (ints; _KEY and _CLS are tuples once set): see the indices above
        st: list[Any] = [-1, None, -1, None, turn, -1, n]
        gk = None
        if parent is not None and node.hit_count == 0 and not node.children:
            # a newly inserted leaf: advance the clock; a ghost hit is a reuse after eviction
            gk = edge_key(parent.id, node, self.page_size)
            ghost = self.ghosts.pop(gk)
            if ghost is not None:
                born, (cls, ends, ghost_turn) = ghost
                shared = self._shared(ends, node)
                self._record(cls, self.clock - born, shared)
                st[_TURN], st[_ADDED] = ghost_turn + 1, max(n - shared, 1)
            self.clock += n
            self.inserted += n
            if self.clock >= self._next_choice:
                self._choose()
        else:
            # the upper half of a split (or a node first seen by a heap rebuild): the lower
            # half's open interval was this node's, so a hit on it is that interval's reuse
            lower = next(iter(node.children.values()), None) if node.children else None
            lst = self._state.get(lower.id) if lower is not None else None
            if lst is not None and lst[_START] >= 0 and node.hit_count > lst[_HITS]:
                self._record(lst[_CLS], self.clock - lst[_START], n)
        self._keep_state(node.id, st)
        return st, gk

    def _shared(self, ends, node) -> int:
        """Tokens a re-inserted edge shares with the evicted one (whole pages, by page ends)."""
        p = self.page_size
        new = node.tokens[p - 1::p]
        n = min(len(new), len(ends))
        same = new[:n] == ends[:n]
        return (n if same.all() else int(same.argmin())) * p

    @staticmethod
    def _depth(node) -> int:
        d = 0
        while node.parent is not None:
            d += 1
            node = node.parent
        return d

    # -- measurement -----------------------------------------------------------------------
    def _record(self, cls, distance: int, tokens: int) -> None:
        if cls is not None:
            self.classes[cls].hist[_bucket(distance / self.page_size)] += tokens

    def _choose(self) -> None:
        cap = max(self.capacity, 1)
        self._next_choice = self.clock + cap // 2 + 1
        if self.clock >= self._next_decay:
            if self._next_decay:
                for c in self.classes.values():
                    np.frombuffer(c.hist, dtype=np.float64)[:] *= 0.5
                    c.touched *= 0.5
                self.inserted *= 0.5
            self._next_decay = self.clock + _DECAY * cap
        if self.clock < _WARMUP * cap or self.inserted <= 0:
            self.shares = {}
            return
        hyst = 1.0 - _HYST if self.shares else 1.0
        self.shares = solve_admission(self.classes, self.inserted, cap / self.page_size,
                                      prior_tokens=_PRIOR * cap, lru_weight=hyst)
        self.decisions += 1
        self.filtering_decisions += bool(self.shares)

    def describe(self) -> dict:
        """For ``HiCache.stats()``: is it filtering now, how often it did, what it left out."""
        return {"filtering": bool(self.shares), "decisions": self.decisions,
                "filtering_decisions": self.filtering_decisions,
                "not_admitted": self.not_admitted,
                "admitted_share": {"/".join(map(str, k)): round(v, 3)
                                   for k, v in sorted(self.shares.items())}}


def solve_admission(classes: dict, span: float, budget: float,
                    prior_tokens: float = 0.0, lru_weight: float = 1.0) -> dict:
    """Admitted share per fresh class (``class[-1]`` false); ``{}`` means admit all (LRU).

    ``span``: inserted tokens (decayed) over which ``touched`` and the histograms were counted,
    so class ``c`` kept for ``T`` occupies ``touched_c / span · E[min(d, T)]`` pages of the
    ``budget``; it earns ``touched_c / span · F_c(T)`` hits per clock token.
    """
    names = [c for c in classes if classes[c].touched > 0]
    if not names:
        return {}
    hists = np.frombuffer(b"".join([classes[c].hist.tobytes() for c in names]),
                          dtype=np.float64).reshape(len(names), _NB)
    touched = np.array([classes[c].touched for c in names])
    shrunk = hists + (prior_tokens / touched.sum()) * hists.sum(axis=0)
    t = touched[:, None] + prior_tokens
    cum = np.cumsum(shrunk, axis=1)
    held = np.cumsum(shrunk * _MIDS, axis=1) + np.maximum(t - cum, 0.0) * _EDGES
    w = (touched / span)[:, None]
    cost = w * held / t                      # pages class c occupies when kept for edge b
    hits = w * cum / t                       # hits per clock token it then earns
    fresh = np.array([not c[-1] for c in names])
    total = cost.sum(axis=0)
    b_lru = int(np.searchsorted(total, budget))
    if b_lru >= len(total):
        return {}                            # everything fits
    fi = np.nonzero(fresh)[0]
    if not len(fi):
        return {}
    # for every T (column) at once: reused classes first, then fresh ones by density
    reused = ~fresh
    left = budget - cost[reused].sum(axis=0)
    base = hits[reused].sum(axis=0)
    fc, fh = cost[fi], hits[fi]
    order = np.argsort(-fh / np.maximum(fc, 1e-300), axis=0, kind="stable")
    cols = _COLS
    sc = fc[order, cols]                               # each column in its own order
    sh = fh[order, cols]
    cc = np.cumsum(sc, axis=0)
    k = (cc < left[None, :]).sum(axis=0)               # fresh classes admitted whole
    full = k < len(fi)                                  # columns where the cache fills up
    ok = full & (left > 0)
    if not ok.any():
        return {}
    kk = np.minimum(k, len(fi) - 1)
    some = k > 0
    k1 = np.maximum(k - 1, 0)
    before_c = np.where(some, cc[k1, cols], 0.0)
    before_h = np.where(some, np.cumsum(sh, axis=0)[k1, cols], 0.0)
    frac = np.clip((left - before_c) / np.maximum(sc[kk, cols], 1e-300), 0.0, 1.0)
    gain = np.where(ok, base + before_h + frac * sh[kk, cols], -1.0)
    b = int(np.argmax(gain))
    if gain[b] <= lru_weight * hits[:, b_lru].sum():
        return {}                            # no gain over admitting everything
    shares = {names[i]: 0.0 for i in fi}
    for r in range(k[b]):
        shares[names[fi[order[r, b]]]] = 1.0
    shares[names[fi[order[k[b], b]]]] = float(frac[b])
    return shares
