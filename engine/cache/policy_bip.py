"""``bip``: bimodal insertion whose admission rate is chosen from measured reuse distances.

The problem it answers (docs/eviction.md): on chat traffic most newly inserted prefixes are
never read again, and those that are come back after a *reuse distance* (tokens inserted in
between) several times the cache. LRU then keeps every prefix a little and each one too short to
be hit. Keeping a *sample* of new prefixes for longer (bimodal insertion, BIP) turns the same
space into hits, but only when the distances are long; when they are short, LRU is right.

The policy therefore measures, online and from the past only:

* a token clock (tokens of newly inserted nodes);
* for every new node its insertion time, and the distance to its first reuse — a hit on it
  while cached, or the re-insertion of the same edge after it was evicted (a *ghost*: a
  bounded table of ``(parent id, first page)`` → insertion time);

and from that histogram ``F(T)`` (share of inserted tokens reused within distance ``T``) picks
the admission rate ``e`` in {1, 1/2, …, 1/64} that maximises the expected hits ``e · F(C / e)``
of a cache of ``C`` tokens that keeps a fraction ``e`` of new prefixes for ``C / e``. ``e = 1``
is LRU exactly. A new node is admitted (placed at the MRU end) with probability ``e``
(a hash of its id, so every rank decides alike); the others are placed at the LRU end and go
first. Any hit moves a node to the MRU end. Keys are fixed when a node is touched, so the
facade's heap, leaf-first order and locks are untouched.
"""

from __future__ import annotations

import itertools
import math

from engine.cache.policy_measured import GhostTable, MeasuringPolicy, drawn, edge_key

_LIP = float(1 << 53)          # "LRU end": below every MRU key that the tree clock can reach
_BUCKETS_PER_OCTAVE = 4
_N_BUCKETS = 40 * _BUCKETS_PER_OCTAVE
_RATES = tuple(2.0 ** -j for j in range(7))   # 1 … 1/64
_MARGIN = 1.5                  # the model counts first reuses only: it flatters small rates


def _bucket(distance: float) -> int:
    b = int(_BUCKETS_PER_OCTAVE * math.log2(distance + 1.0))
    return min(b, _N_BUCKETS - 1)


class AdaptiveBIP(MeasuringPolicy):
    """See the module docstring. ``capacity_tokens`` is learnt from :meth:`attach`."""

    name = "bip"

    def __init__(self, capacity_tokens: int = 0, page_size: int = 1):
        super().__init__(capacity_tokens, page_size)
        self.clock = 0                       # tokens of newly inserted nodes so far
        self.inserted = 0.0                  # decayed copy of the same, the F denominator
        self.hist = [0.0] * _N_BUCKETS       # reused tokens by distance bucket (decayed)
        self.ghosts = GhostTable()           # (parent id, first page) -> insertion clock
        self.rate = 1.0                      # current admission rate e
        self.not_admitted = 0                # touches placed at the LRU end
        self._next_choice = 0
        self._next_decay = 0
        # per node (self._state): [last_access seen, key, insertion clock or -1 once reused]

    # -- ordering --------------------------------------------------------------------------
    def key(self, node) -> tuple:
        st = self._state.get(node.id)
        now = node.last_access
        if st is not None and st[0] == now:
            return st[1]
        if st is None:
            st = self._first_sight(node)
        hits = node.hit_count
        if hits and st[2] >= 0:
            self._record(self.clock - st[2], len(node.tokens))
            st[2] = -1
        rate = self.rate
        if hits or rate >= 1.0 or drawn(node.id, rate):      # admitted: a hit, or drawn
            k = (float(now),)
        else:
            k = (now - _LIP,)
            self.not_admitted += 1
        st[0], st[1] = now, k
        return k

    def _first_sight(self, node) -> list:
        parent = node.parent
        st = None
        if parent is not None and node.hit_count == 0 and not node.children:
            # A newly inserted leaf: advance the clock; a ghost hit is a reuse after eviction.
            clock = self.clock
            n = len(node.tokens)
            gk = edge_key(parent.id, node, self.page_size)
            ghosts = self.ghosts
            ghost = ghosts.pop(gk)
            if ghost is not None:
                self._record(clock - ghost[0], n)
            ghosts.put(gk, clock, None, clock - 64 * max(self.capacity, 1))
            st = [-1, None, clock]
            self.clock = clock = clock + n
            self.inserted += n
            if clock >= self._next_choice:
                self._choose_rate()
        else:
            # The upper half of a split (or a node seen first by a heap rebuild): it shares
            # the lower half's history.
            lower = next(iter(node.children.values()), None) if node.children else None
            born = self._state.get(lower.id) if lower is not None else None
            st = [-1, None, born[2] if born is not None else -1]
        self._keep_state(node.id, st)
        return st

    # -- measurement -----------------------------------------------------------------------
    def _record(self, distance: int, tokens: int) -> None:
        self.hist[_bucket(distance / self.page_size)] += tokens

    def _choose_rate(self) -> None:
        """Pick e maximising e * F(C / e) from the histogram (LRU until there is data)."""
        cap = max(self.capacity, 1)
        self._next_choice = self.clock + cap // 8 + 1
        if self.clock >= self._next_decay:
            if self._next_decay:
                self.hist = [h * 0.5 for h in self.hist]
                self.inserted *= 0.5
            self._next_decay = self.clock + 16 * cap
        if self.clock < 4 * cap or self.inserted <= 0:
            self.rate = 1.0
            return
        cum = list(itertools.accumulate(self.hist))   # the same sums, in the same order
        best, best_score = 1.0, -1.0
        for e in _RATES:
            score = e * cum[_bucket(cap / e / self.page_size)]
            if score > best_score * _MARGIN:   # a smaller rate must win clearly
                best, best_score = e, score
        self.rate = best

    def describe(self) -> dict:
        """For ``HiCache.stats()``: the admission rate now and what it left out."""
        return {"admission_rate": self.rate, "not_admitted": self.not_admitted}
