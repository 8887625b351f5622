"""Offline, trace-driven simulation of the cache stack (metadata only: no KV bytes).

Requests of a Mooncake trace are replayed in order through the same :class:`HiCache` the server
uses, in metadata-only mode: match → lock → load-back → alloc → insert → unlock → poll. Tokens
of trace block ``b`` are ``b*512 … b*512+511`` cut at ``input_length`` — the mapping other tools
use, so hit rates are comparable. Only cache operations are timed (``cache_seconds``).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from engine.cache.events import EventLog
from engine.cache.facade import CacheConfig, HiCache
from engine.cache.policy import Belady, next_occurrence
from engine.core.errors import InputError, OutOfCapacity

TRACE_BLOCK = 512
CP_KV = ("sharded", "replicated")


def trace_tokens(hash_ids: Sequence[int], input_length: int) -> np.ndarray:
    """Tokens of one trace request: block ``b`` → ``b*512 … b*512+511``, cut at the length."""
    ids = np.asarray(hash_ids, dtype=np.int64)
    if ids.size and int(ids.max()) >= (1 << 32) // TRACE_BLOCK:
        raise InputError(f"hash id {int(ids.max())} is too large: the replay maps block b to "
                         f"tokens b*{TRACE_BLOCK}…, which must fit in 32 bits (hash ids below "
                         f"{(1 << 32) // TRACE_BLOCK})")
    toks = (ids[:, None] * TRACE_BLOCK + np.arange(TRACE_BLOCK, dtype=np.int64)).reshape(-1)
    return toks[:input_length].astype(np.uint32)


@dataclasses.dataclass
class ReplayConfig:
    page_size: int = 64
    l1_tokens: int = 5_120_000
    l2_tokens: int = 0
    l3_tokens: int = 0          # 0: no L3, -1: unbounded
    policy: str = "lru"
    write_policy: str = "write_through"
    limit: int | None = None
    events: bool = True
    cp_size: int = 1            # context-parallel ranks the tier budgets are per-rank for
    cp_kv: str = "sharded"      # with cp_size > 1: sharded | replicated (docs/parallelism.md)


@dataclasses.dataclass
class ReplayResult:
    requests: int
    input_tokens: int
    hit_tokens: int
    l1_hit_tokens: int
    l2_hit_tokens: int
    l3_hit_tokens: int
    uncacheable_requests: int
    cache_seconds: float
    config: dict
    stats: dict
    events: int

    @property
    def token_hit_rate(self) -> float:
        return self.hit_tokens / self.input_tokens if self.input_tokens else 0.0

    def to_dict(self) -> dict[str, Any]:
        t = self.input_tokens or 1
        return {
            "requests": self.requests,
            "input_tokens": self.input_tokens,
            "token_hit_rate": round(self.token_hit_rate, 6),
            "l1_hit_rate": round(self.l1_hit_tokens / t, 6),
            "l2_hit_rate": round(self.l2_hit_tokens / t, 6),
            "l3_hit_rate": round(self.l3_hit_tokens / t, 6),
            "hit_tokens": self.hit_tokens,
            "l1_hit_tokens": self.l1_hit_tokens,
            "l2_hit_tokens": self.l2_hit_tokens,
            "l3_hit_tokens": self.l3_hit_tokens,
            "uncacheable_requests": self.uncacheable_requests,
            "cache_seconds": round(self.cache_seconds, 4),
            "requests_per_s": round(self.requests / self.cache_seconds, 1)
            if self.cache_seconds > 0 else None,
            "events": self.events,
            "config": self.config,
            "stats": self.stats,
        }


def _opt_policy(requests: list[np.ndarray], page_size: int, clock: list[int]) -> Belady:
    """Belady over the trace's future: a page is named by its last token, which — with the
    trace's prefix-hash block ids — identifies the whole prefix up to that page."""
    occ: dict[int, list[int]] = {}
    for i, toks in enumerate(requests):
        n = len(toks) // page_size
        if n == 0:
            continue
        for t in toks[page_size - 1:n * page_size:page_size].tolist():
            lst = occ.get(t)
            if lst is None:
                occ[t] = [i]
            elif lst[-1] != i:
                lst.append(i)
    empty: list[int] = []

    def next_use(node) -> int | None:
        return next_occurrence(occ.get(int(node.tokens[page_size - 1]), empty), clock[0])

    return Belady(next_use)


def _make_cache(cfg: ReplayConfig, events: EventLog, policy) -> HiCache:
    """The cache stack a replay drives. With ``cp_size`` N > 1 the tier budgets are per rank:
    ``sharded`` wraps the facade in :class:`~engine.parallel.cp_cache.CPCache` (each page on one
    owner rank: N x the device and host pages); ``replicated`` keeps every device page on every
    rank (device capacity = one rank's budget) over a host pool deduplicated across the ranks
    (N x the host budget) — the baseline of docs/parallelism.md §1."""
    from engine.parallel.cp_cache import CPCache

    n = cfg.cp_size
    if n < 1 or cfg.cp_kv not in CP_KV:
        raise ValueError(f"cp_size must be >= 1 and cp_kv one of {CP_KV}, got "
                         f"{n}, {cfg.cp_kv!r}")
    replicated = n > 1 and cfg.cp_kv == "replicated"
    if n > 1 and not replicated and cfg.l3_tokens:
        raise ValueError("an L3 tier with CP-sharded KV is not simulated (drop --l3-tokens)")
    cache_cfg = CacheConfig(page_size=cfg.page_size, l1_tokens=cfg.l1_tokens,
                            l2_tokens=cfg.l2_tokens * n if replicated else cfg.l2_tokens,
                            eviction_policy="lru" if cfg.policy == "opt" else cfg.policy,
                            write_policy=cfg.write_policy, layout=None, events=cfg.events)
    if n > 1 and not replicated:
        return CPCache(cache_cfg, n, events=events, policy=policy)
    return HiCache(cache_cfg, events=events, policy=policy)


def replay(records: Iterable, cfg: ReplayConfig, *,
           events: EventLog | None = None,
           progress: Callable[[int], None] | None = None,
           keep_cache: bool = False) -> "tuple[ReplayResult, HiCache | None]":
    """Replay trace ``records`` (objects with ``hash_ids`` and ``input_length``)."""
    recs = list(records)
    if cfg.limit is not None:
        recs = recs[:cfg.limit]
    limit = (1 << 32) // TRACE_BLOCK
    remap: dict[int, int] | None = None
    if any(r.hash_ids and max(r.hash_ids) >= limit for r in recs):
        # Block ids too large for 32-bit tokens: renumber them densely by first appearance.
        # Only equality of blocks matters to a prefix cache, so hit rates are unchanged.
        remap = {}
        for r in recs:
            for b in r.hash_ids:
                remap.setdefault(b, len(remap))
        if len(remap) >= limit:
            raise InputError(f"the trace has {len(remap)} distinct blocks; at most {limit} fit "
                             f"in 32-bit token ids")
    requests = []
    for r in recs:
        ids = r.hash_ids if remap is None else [remap[b] for b in r.hash_ids]
        requests.append(trace_tokens(ids, r.input_length))
    p = cfg.page_size
    clock = [0]
    policy = _opt_policy(requests, p, clock) if cfg.policy == "opt" else None
    if events is None:
        events = EventLog(enabled=cfg.events)
    cache = _make_cache(cfg, events, policy)
    if cfg.l3_tokens:
        from engine.cache.l3 import SimulatedTier

        cache.attach_l3(SimulatedTier(-1 if cfg.l3_tokens < 0 else cfg.l3_tokens // p))
    hit = l1 = l2 = l3 = total = uncacheable = 0
    perf = time.perf_counter
    elapsed = 0.0
    empty = np.empty(0, dtype=np.int64)
    for i, toks in enumerate(requests):
        t0 = perf()
        clock[0] = i
        events.set_step(i)
        m = cache.match(toks, rid=i)
        receipt = cache.lock(m)
        if m.l2_len or m.l3_len:
            cache.load_back(m)
        n_full = len(toks) // p
        have = len(m.l1_pages)
        try:
            new = cache.alloc_for(m, n_full - have) if n_full > have else empty
            pages = np.concatenate([m.l1_pages, new]) if have else new
            cache.insert(toks[:n_full * p], pages, rid=i, prefix_hashes=m.hashes,
                         after=receipt)
        except OutOfCapacity:
            uncacheable += 1
        cache.unlock(receipt)
        cache.poll()
        elapsed += perf() - t0
        total += len(toks)
        l1 += m.l1_len
        l2 += m.l2_len
        l3 += m.l3_len
        if progress is not None:
            progress(i + 1)
    hit = l1 + l2 + l3
    result = ReplayResult(
        requests=len(requests), input_tokens=total, hit_tokens=hit, l1_hit_tokens=l1,
        l2_hit_tokens=l2, l3_hit_tokens=l3, uncacheable_requests=uncacheable,
        cache_seconds=elapsed, config=dataclasses.asdict(cfg), stats=cache.stats(),
        events=len(events))
    return result, (cache if keep_cache else None)
