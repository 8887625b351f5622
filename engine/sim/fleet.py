"""Fleet replay: a trace routed over N replicas, each its own cache stack, over one shared L3.

``hicache bench replay TRACE --replicas N --router POLICY`` runs this. Each replica is a
metadata-only :class:`~engine.cache.facade.HiCache` with the L1/L2 budgets of one server; when
an L3 tier is configured, every replica's L3 is the *same* simulated store (one external store
shared by the fleet: what one replica backs up, another can prefetch). A router decides, per
request and in arrival order, from what a real router can know:

* ``round-robin``: request ``i`` goes to replica ``i mod N``.
* ``least-load``: the replica with the fewest requests in flight (ties: fewest routed so far,
  then lowest index).
* ``session``: the request's session key on a consistent-hash ring (sticky sessions): the
  trace's own (``session_id`` and the other :data:`~engine.loadgen.trace.SESSION_FIELDS`, as
  :attr:`~engine.loadgen.trace.Trace.sessions` holds them) or ``sessions=``; for a request
  without one, its first block past the prefix *every* request of the trace shares (a system
  prompt common to all would otherwise put the whole trace in one session). An integer key and
  a block id are hashed alike: key ``k`` goes where a request whose first own block is ``k``
  goes.
* ``consistent-hash``: its first ``hash_blocks`` trace blocks on the ring (prefix-hash
  routing; on a trace whose requests share a first block, one replica takes everything).
* ``cache-aware``: SGLang's router algorithm over an approximate prefix tree per replica,
  filled with what the router sent there (not the replicas' real cache): when the load is
  imbalanced (max - min in flight > ``balance_abs_threshold`` and max > min x
  ``balance_rel_threshold``) the least-loaded replica; else the replica with the longest
  matched prefix when match / input > ``cache_threshold``, else the replica whose tree is
  smallest. Each tree keeps at most ``max_tree_tokens``, least recently routed leaves first.

"In flight" is the router's own count: a request is in flight on its replica from its
arrival until arrival + (tokens computed / ``prefill_tokens_per_s`` + output tokens /
``decode_tokens_per_s``) — no queueing is modelled.

Replays are page-level (one token per page, the same hits as a token-level replay; see
:func:`~engine.sim.replay.replay`), and the L3 key of a page is its last token, which names the
page's whole prefix in a trace (prefix-hash block ids) — the same keys, one to one, as the
chained page hashes a server computes, without hashing. The pooled bound is the same replay
with one replica of N x the L1 and L2 budgets.

Cost: one cache step per request on the replica it is routed to (the fleet does the work of
one plain replay, whatever N), plus the router: O(blocks) for the ring policies, O(N) for the
load policies, and for cache-aware O(N + blocks matched x replicas still matching).
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import hashlib
import heapq
import time
from typing import Any, Callable, Sequence

import numpy as np

from engine.cache.facade import CacheConfig, HiCache
from engine.cache.l3 import SimulatedTier
from engine.core.errors import OutOfCapacity
from engine.loadgen.trace import NO_SESSION
from engine.sim.replay import TRACE_BLOCK, ReplayConfig, ReplayInput

ROUTERS = ("round-robin", "least-load", "session", "consistent-hash", "cache-aware")
MAX_REPLICAS = 4096


@dataclasses.dataclass
class RouterConfig:
    """The router's knobs (SGLang router option names, without ``--``), and the service model
    behind its in-flight count."""

    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    max_tree_tokens: int = 1 << 26
    hash_blocks: int = 1            # consistent-hash: leading trace blocks hashed
    virtual_nodes: int = 160        # ring points per replica
    prefill_tokens_per_s: float = 10_000.0
    decode_tokens_per_s: float = 50.0

    def check(self) -> None:
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError(f"cache threshold must be in [0, 1], got {self.cache_threshold}")
        if self.balance_abs_threshold < 0 or self.balance_rel_threshold < 1.0:
            raise ValueError("balance thresholds: absolute >= 0 and relative >= 1")
        if self.max_tree_tokens < 1 or self.hash_blocks < 1 or self.virtual_nodes < 1:
            raise ValueError("max tree tokens, hash blocks and virtual nodes must be >= 1")
        if self.prefill_tokens_per_s <= 0 or self.decode_tokens_per_s <= 0:
            raise ValueError("service rates must be > 0")


@dataclasses.dataclass
class FleetResult:
    router: str
    replicas: int
    requests: int
    input_tokens: int
    l1_hit_tokens: int
    l2_hit_tokens: int
    l3_hit_tokens: int
    computed_tokens: list[int]          # per replica
    routed: list[int]                   # requests per replica
    uncacheable_requests: int
    cache_seconds: float
    router_seconds: float
    replica_of: list[int] = dataclasses.field(default_factory=list, repr=False)  # per request

    @property
    def hit_tokens(self) -> int:
        return self.l1_hit_tokens + self.l2_hit_tokens + self.l3_hit_tokens

    @property
    def token_hit_rate(self) -> float:
        return self.hit_tokens / self.input_tokens if self.input_tokens else 0.0

    @property
    def load_spread(self) -> float:
        """max / mean of tokens computed over the replicas (1.0: perfectly even)."""
        mean = sum(self.computed_tokens) / len(self.computed_tokens)
        return max(self.computed_tokens) / mean if mean else 1.0

    def to_dict(self) -> dict[str, Any]:
        t = self.input_tokens or 1
        return {
            "router": self.router, "replicas": self.replicas, "requests": self.requests,
            "input_tokens": self.input_tokens,
            "token_hit_rate": round(self.token_hit_rate, 6),
            "l1_hit_rate": round(self.l1_hit_tokens / t, 6),
            "l2_hit_rate": round(self.l2_hit_tokens / t, 6),
            "l3_hit_rate": round(self.l3_hit_tokens / t, 6),
            "load_spread": round(self.load_spread, 4),
            "max_replica_share": round(max(self.computed_tokens)
                                       / max(1, sum(self.computed_tokens)), 4),
            "computed_tokens": self.computed_tokens, "routed": self.routed,
            "uncacheable_requests": self.uncacheable_requests,
            "cache_seconds": round(self.cache_seconds, 4),
            "router_seconds": round(self.router_seconds, 4),
        }


# --------------------------------------------------------------------------- the replicas

def _page_keys(tokens: np.ndarray, namespace: Any, prefix: Sequence = ()) -> list:
    """L3 keys of a page-level request: each page's last token (see the module docstring)."""
    return tokens.tolist()


class _Replica:
    """One replica's cache stack, stepped one request at a time (the plain replay's loop)."""

    def __init__(self, cfg: ReplayConfig, l1_tokens: int, l2_tokens: int,
                 shared_l3: SimulatedTier | None):
        p = cfg.page_size
        self.cache = HiCache(CacheConfig(page_size=1, l1_tokens=l1_tokens // p,
                                         l2_tokens=l2_tokens // p,
                                         eviction_policy=cfg.policy,
                                         write_policy=cfg.write_policy, layout=None,
                                         events=False))
        if shared_l3 is not None:
            self.cache.attach_l3(shared_l3)
            self.cache.l3.hashes = _page_keys          # type: ignore[union-attr,method-assign]
        self.empty = np.empty(0, dtype=np.int64)

    def step(self, toks: np.ndarray, rid: int) -> tuple[int, int, int, bool]:
        """Match → lock → load-back → alloc → insert → unlock → poll; (l1, l2, l3) hit pages
        and whether the request could be cached."""
        cache = self.cache
        m = cache.match(toks, rid=rid)
        receipt = cache.lock(m)
        if m.l2_len or m.l3_len:
            cache.load_back(m)
        n, have = len(toks), len(m.l1_pages)
        ok = True
        try:
            new = cache.alloc_for(m, n - have) if n > have else self.empty
            pages = np.concatenate([m.l1_pages, new]) if have else new
            cache.insert(toks, pages, rid=rid, prefix_hashes=m.hashes, after=receipt)
        except OutOfCapacity:
            ok = False
        cache.unlock(receipt)
        cache.poll()
        return m.l1_len, m.l2_len, m.l3_len, ok


# --------------------------------------------------------------------------- the routers

def _h64(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


class _Ring:
    """A consistent-hash ring: ``virtual_nodes`` points per replica."""

    def __init__(self, n: int, virtual_nodes: int):
        pts = sorted((_h64(f"replica-{r}-{v}".encode()), r)
                     for r in range(n) for v in range(virtual_nodes))
        self.keys = [k for k, _ in pts]
        self.owner = [r for _, r in pts]

    def pick(self, key: "int | str | bytes") -> int:
        raw = (key.encode() if isinstance(key, str) else key if isinstance(key, bytes)
               else int(key).to_bytes(16, "little", signed=True))
        i = bisect.bisect(self.keys, _h64(raw))
        return self.owner[i % len(self.owner)]


class _ApproxTree:
    """The cache-aware router's view of one replica: trace blocks it sent there, LRU-ordered
    with the leaves oldest (a request's blocks are touched leaf first, root last)."""

    __slots__ = ("blocks", "tokens")

    def __init__(self) -> None:
        self.blocks: "collections.OrderedDict[int, int]" = collections.OrderedDict()
        self.tokens = 0

    def insert(self, ids: list[int], input_length: int, limit: int) -> None:
        blocks = self.blocks
        last = len(ids) - 1
        for k in range(last, -1, -1):
            b = ids[k]
            if b in blocks:
                blocks.move_to_end(b)
            else:
                size = input_length - k * TRACE_BLOCK if k == last else TRACE_BLOCK
                blocks[b] = size
                self.tokens += size
        while self.tokens > limit and blocks:
            self.tokens -= blocks.popitem(last=False)[1]


class _Router:
    def __init__(self, name: str, n: int, rc: RouterConfig, inp: ReplayInput,
                 sessions: Sequence | None):
        if name not in ROUTERS:
            raise ValueError(f"unknown router {name!r}; choose from {list(ROUTERS)}")
        self.name, self.n, self.rc = name, n, rc
        self.load = [0] * n                  # in flight, as the router counts
        self.routed = [0] * n
        self._done: list[tuple[float, int]] = []   # (finish time, replica)
        self.trees = [_ApproxTree() for _ in range(n)] if name == "cache-aware" else []
        self.ring = _Ring(n, rc.virtual_nodes) if name in ("session", "consistent-hash") \
            else None
        self.sessions = sessions
        self.skip = _common_prefix(inp) if name == "session" else 0

    def advance(self, now_ms: float) -> None:
        done = self._done
        while done and done[0][0] <= now_ms:
            self.load[heapq.heappop(done)[1]] -= 1

    def _least_loaded(self) -> int:
        load, routed = self.load, self.routed
        return min(range(self.n), key=lambda r: (load[r], routed[r], r))

    def pick(self, i: int, ids: list[int], input_length: int) -> int:
        name = self.name
        if name == "round-robin":
            return i % self.n
        if name == "least-load":
            return self._least_loaded()
        if name == "session":
            key = self.sessions[i] if self.sessions is not None else None
            if key is None or (isinstance(key, (int, np.integer)) and key == NO_SESSION):
                key = ids[min(self.skip, len(ids) - 1)]
            return self.ring.pick(key)  # type: ignore[union-attr]
        if name == "consistent-hash":
            key = _h64(np.asarray(ids[:self.rc.hash_blocks], dtype=np.int64).tobytes())
            return self.ring.pick(key)  # type: ignore[union-attr]
        return self._cache_aware(ids, input_length)

    def _cache_aware(self, ids: list[int], input_length: int) -> int:
        rc, load = self.rc, self.load
        hi, lo = max(load), min(load)
        if hi - lo > rc.balance_abs_threshold and hi > lo * rc.balance_rel_threshold:
            r = self._least_loaded()
        else:
            cand = list(range(self.n))
            depth = 0
            for b in ids:
                nxt = [r for r in cand if b in self.trees[r].blocks]
                if not nxt:
                    break
                cand, depth = nxt, depth + 1
            matched = min(depth * TRACE_BLOCK, input_length)
            if depth and matched / input_length > rc.cache_threshold:
                r = min(cand, key=lambda c: (load[c], c))
            else:
                trees = self.trees
                r = min(range(self.n), key=lambda c: (trees[c].tokens, load[c], c))
        self.trees[r].insert(ids, input_length, rc.max_tree_tokens)
        return r

    def sent(self, r: int, now_ms: float, computed: int, output_length: int) -> None:
        self.routed[r] += 1
        self.load[r] += 1
        rc = self.rc
        busy_ms = 1000.0 * (computed / rc.prefill_tokens_per_s
                            + output_length / rc.decode_tokens_per_s)
        heapq.heappush(self._done, (now_ms + busy_ms, r))


def _common_prefix(inp: ReplayInput) -> int:
    """Blocks every request of the trace starts with."""
    tr = inp.trace
    if not len(tr):
        return 0
    first = tr.hash_ids(0).tolist()
    k = len(first)
    for i in range(1, len(tr)):
        ids = tr.hash_ids(i)
        k = min(k, len(ids))
        j = 0
        while j < k and ids[j] == first[j]:
            j += 1
        k = j
        if not k:
            break
    return k


# --------------------------------------------------------------------------- the fleet

def fleet_replay(inp: ReplayInput, cfg: ReplayConfig, replicas: int, router: str,
                 rc: RouterConfig | None = None, *, sessions: Sequence | None = None,
                 capacity_factor: int = 1,
                 progress: Callable[[int], None] | None = None) -> FleetResult:
    """Route ``inp`` (up to ``cfg.limit`` requests) over ``replicas`` cache stacks of
    ``cfg``'s L1/L2 budgets (x ``capacity_factor``) sharing one L3 of ``cfg.l3_tokens``
    (0: none, -1: unbounded). ``sessions``: a session key per request (ints, strings or
    bytes; ``None`` or ``-1``: none, route by the first block); default: the trace's own
    (``inp.trace.sessions``), if it has any."""
    rc = rc or RouterConfig()
    rc.check()
    if not 1 <= replicas <= MAX_REPLICAS:
        raise ValueError(f"replicas must be 1..{MAX_REPLICAS}, got {replicas}")
    if cfg.policy == "opt" or cfg.cp_size != 1:
        raise ValueError("a fleet replay runs online policies (not opt) on one rank per "
                         "replica")
    if cfg.l3_tokens and not cfg.l2_tokens:
        raise ValueError("an L3 tier needs an L2 tier (L3 pages are staged through L2)")
    p = cfg.page_size
    n_req = len(inp) if cfg.limit is None else min(cfg.limit, len(inp))
    if sessions is None and inp.trace.sessions is not None:
        sessions = inp.trace.sessions.tolist()
    if sessions is not None and len(sessions) < n_req:
        raise ValueError(f"{len(sessions)} session keys for {n_req} requests")
    shared = (SimulatedTier(-1 if cfg.l3_tokens < 0 else cfg.l3_tokens // p)
              if cfg.l3_tokens else None)
    fleet = [_Replica(cfg, cfg.l1_tokens * capacity_factor, cfg.l2_tokens * capacity_factor,
                      shared) for _ in range(replicas)]
    route = _Router(router, replicas, rc, inp, sessions)
    tr = inp.trace
    ts = tr.timestamps_ms.tolist()
    lens = tr.input_lengths.tolist()
    outs = tr.output_lengths.tolist()
    offs = tr.offsets.tolist()
    blocks = tr.blocks
    need_ids = router in ("session", "consistent-hash", "cache-aware")
    computed = [0] * replicas
    replica_of: list[int] = []
    l1 = l2 = l3 = uncacheable = 0
    t_cache = t_route = 0.0
    perf = time.perf_counter
    for i, toks in enumerate(inp.page_requests(p, n_req)):
        t0 = perf()
        route.advance(ts[i])
        ids = blocks[offs[i]:offs[i + 1]].tolist() if need_ids else []
        r = route.pick(i, ids, lens[i])
        t1 = perf()
        h1, h2, h3, ok = fleet[r].step(toks, i)
        t2 = perf()
        hit = (h1 + h2 + h3) * p
        route.sent(r, ts[i], lens[i] - hit, outs[i])
        t_route += t1 - t0 + perf() - t2
        t_cache += t2 - t1
        computed[r] += lens[i] - hit
        replica_of.append(r)
        l1 += h1
        l2 += h2
        l3 += h3
        uncacheable += not ok
        if progress is not None:
            progress(i + 1)
    return FleetResult(router, replicas, n_req, int(sum(lens[:n_req])), l1 * p, l2 * p,
                       l3 * p, computed, route.routed, uncacheable, t_cache, t_route, replica_of)


def pooled_bound(inp: ReplayInput, cfg: ReplayConfig, replicas: int) -> FleetResult:
    """One replica with ``replicas`` x the L1 and L2 budgets over the same L3."""
    return fleet_replay(inp, cfg, 1, "round-robin", capacity_factor=replicas)


def compare(inp: ReplayInput, cfg: ReplayConfig, replicas: int, routers: Sequence[str],
            rc: RouterConfig | None = None, *, sessions: Sequence[int] | None = None,
            on_row: Callable[[dict], None] | None = None) -> dict[str, Any]:
    """Every router at one replica count, and the pooled bound: ``{"replicas", "pooled",
    "rows"}`` (dicts)."""
    t0 = time.perf_counter()
    pooled = pooled_bound(inp, cfg, replicas).to_dict()
    rows = []
    for name in routers:
        row = fleet_replay(inp, cfg, replicas, name, rc, sessions=sessions).to_dict()
        row["pooled_hit_rate"] = pooled["token_hit_rate"]
        rows.append(row)
        if on_row is not None:
            on_row(row)
    return {"replicas": replicas, "pooled": pooled, "rows": rows,
            "wall_seconds": round(time.perf_counter() - t0, 3)}


def sweep(inp: ReplayInput, cfg: ReplayConfig, replica_counts: Sequence[int],
          routers: Sequence[str], rc: RouterConfig | None = None, *,
          sessions: Sequence[int] | None = None,
          on_row: Callable[[dict], None] | None = None) -> list[dict]:
    """:func:`compare` at every replica count; one dict per count."""
    return [compare(inp, cfg, n, routers, rc, sessions=sessions, on_row=on_row)
            for n in replica_counts]
