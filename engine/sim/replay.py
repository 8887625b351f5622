"""Offline, trace-driven simulation of the cache stack (metadata only: no KV bytes).

Requests of a Mooncake trace are replayed in order through the same :class:`HiCache` the server
uses, in metadata-only mode: match → lock → load-back → alloc → insert → unlock → poll. Tokens
of trace block ``b`` are ``b*512 … b*512+511`` cut at ``input_length`` — the mapping other tools
use, so hit rates are comparable. Only cache operations are timed (``cache_seconds``).
"""

from __future__ import annotations

import array
import bisect
import dataclasses
import math
import time
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Sequence

import numpy as np

from engine.cache.events import EventLog
from engine.cache.facade import CacheConfig, HiCache
from engine.cache.policy import Belady
from engine.core.errors import InputError, OutOfCapacity

if TYPE_CHECKING:
    from engine.loadgen.trace import Trace

TRACE_BLOCK = 512
CP_KV = ("sharded", "replicated")
_BLOCK_TOKENS = np.arange(TRACE_BLOCK, dtype=np.uint32)
_MAX_BLOCKS = (1 << 32) // TRACE_BLOCK          # block ids whose tokens fit in 32 bits


def trace_tokens(hash_ids: Sequence[int], input_length: int) -> np.ndarray:
    """Tokens of one trace request: block ``b`` → ``b*512 … b*512+511``, cut at the length."""
    ids = np.asarray(hash_ids, dtype=np.int64)
    if ids.size and int(ids.max()) >= _MAX_BLOCKS:
        raise InputError(f"hash id {int(ids.max())} is too large: the replay maps block b to "
                         f"tokens b*{TRACE_BLOCK}…, which must fit in 32 bits (hash ids below "
                         f"{_MAX_BLOCKS})")
    return _tokens(ids.astype(np.uint32) * np.uint32(TRACE_BLOCK), input_length)


def _tokens(bases: np.ndarray, input_length: int) -> np.ndarray:
    return (bases[:, None] + _BLOCK_TOKENS).reshape(-1)[:input_length]


class ReplayInput:
    """A trace made ready to replay, once per command and shared by every run over it: block
    ids as 32-bit token bases (renumbered when too large) and, on demand, the future index
    Belady's ``opt`` policy needs for one page size. Token arrays are made per request while
    replaying, so memory stays at the trace's size."""

    def __init__(self, trace: "Trace | Iterable"):
        from engine.loadgen.trace import Trace

        self.trace = trace if isinstance(trace, Trace) else Trace.from_records(trace)
        blocks = self.trace.blocks
        if blocks.size and int(blocks.max()) >= _MAX_BLOCKS:
            # Block ids too large for 32-bit tokens: renumber them densely by first appearance.
            # Only equality of blocks matters to a prefix cache, so hit rates are unchanged.
            uniq, first, inverse = np.unique(blocks, return_index=True, return_inverse=True)
            if len(uniq) >= _MAX_BLOCKS:
                raise InputError(f"the trace has {len(uniq)} distinct blocks; at most "
                                 f"{_MAX_BLOCKS} fit in 32-bit token ids")
            rank = np.empty(len(uniq), dtype=np.int64)
            rank[np.argsort(first, kind="stable")] = np.arange(len(uniq))
            blocks = rank[inverse.reshape(-1)]
        self.bases = blocks.astype(np.uint32) * np.uint32(TRACE_BLOCK)
        self._futures: dict[int, tuple] = {}
        self._hints: dict[str, TraceHints] = {}
        self._page_ends: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._page_rows: dict[int, tuple[list[np.ndarray], list[bytes]]] = {}

    def __len__(self) -> int:
        return len(self.trace)

    def requests(self, limit: int | None = None) -> Iterator[np.ndarray]:
        """Each request's tokens, made as it is reached."""
        offs = self.trace.offsets.tolist()
        lens = self.trace.input_lengths.tolist()
        bases = self.bases
        for i in range(len(lens) if limit is None else min(limit, len(lens))):
            yield _tokens(bases[offs[i]:offs[i + 1]], lens[i])

    def page_ends(self, page_size: int) -> tuple[np.ndarray, np.ndarray]:
        """The last token of every full page of every request, flat, and where each request's
        pages start (``starts[i]:starts[i + 1]``). A page's last token names the page: with
        prefix-hash block ids it fixes the block, the offset and so every token of the page."""
        if page_size not in self._page_ends:
            offsets, lens = self.trace.offsets, self.trace.input_lengths
            n_full = lens // page_size
            starts = np.zeros(len(lens) + 1, dtype=np.int64)
            np.cumsum(n_full, out=starts[1:])
            req = np.repeat(np.arange(len(lens), dtype=np.int64), n_full)
            pos = (np.arange(len(req), dtype=np.int64) - starts[req] + 1) * page_size - 1
            tok = self.bases[offsets[req] + pos // TRACE_BLOCK] \
                + (pos % TRACE_BLOCK).astype(np.uint32)
            self._page_ends[page_size] = (tok, starts)
        return self._page_ends[page_size]

    def page_rows(self, page_size: int) -> tuple[list[np.ndarray], list[bytes]]:
        """Every request of :meth:`page_requests` kept in a list, and each one's bytes (the
        radix walk's child keys are slices of them): made once for all the points of a
        sweep, not once per point."""
        if page_size not in self._page_rows:
            rows = list(self.page_requests(page_size))
            self._page_rows[page_size] = rows, [r.tobytes() for r in rows]
        return self._page_rows[page_size]

    def page_requests(self, page_size: int, limit: int | None = None) -> Iterator[np.ndarray]:
        """Each request as one token per full page (its last token): the page-level replay."""
        tok, starts = self.page_ends(page_size)
        st = starts.tolist()
        for i in range(len(self) if limit is None else min(limit, len(self))):
            yield tok[st[i]:st[i + 1]]

    def hints(self, signals: str) -> "TraceHints":
        """The trace's client hints (:class:`TraceHints`), kept per signal choice."""
        if signals not in self._hints:
            self._hints[signals] = TraceHints(self.trace, signals)
        return self._hints[signals]

    def future(self, page_size: int) -> tuple:
        """For each page (named by its last token): the sorted requests that hold it
        (:func:`_future_index`). Built with array operations, kept per page size."""
        if page_size not in self._futures:
            self._futures[page_size] = _future_index(self, page_size)
        return self._futures[page_size]


_MAX_SLOTS = 1 << 24      # a dense page index up to this many slots; a dict beyond


def _future_index(inp: ReplayInput, p: int) -> tuple:
    """``(slots, starts, reqs)``: page ``t``'s requests are ``reqs[starts[s]:starts[s + 1]]``
    for ``s = slots(t)``. When the page size divides a block, a page-end token ``b*512 + o``
    has a slot by arithmetic (block ``b``, page ``o // p`` of it): arrays, no hashing. Otherwise
    ``slots`` is a dict from token to slot (``per`` = 0)."""
    tok, starts = inp.page_ends(p)
    req = np.repeat(np.arange(len(inp), dtype=np.int32), np.diff(starts))   # < MAX_REQUESTS
    per = TRACE_BLOCK // p if TRACE_BLOCK % p == 0 else 0
    n_blocks = int(inp.bases.max()) // TRACE_BLOCK + 1 if len(inp.bases) else 0
    if per and n_blocks * per <= _MAX_SLOTS:
        key = (tok // TRACE_BLOCK) * per + (tok % TRACE_BLOCK) // p       # uint32: < 2**24
    else:
        per = 0
        key = tok.astype(np.int64)
    order = np.argsort(key, kind="stable")                  # by page, requests stay sorted
    key, req = key[order], req[order]
    keep = np.ones(len(key), dtype=bool)
    keep[1:] = (key[1:] != key[:-1]) | (req[1:] != req[:-1])
    key, req = key[keep], req[keep]
    if per:
        bounds = np.zeros(n_blocks * per + 1, dtype=np.int64)
        np.cumsum(np.bincount(key, minlength=n_blocks * per), out=bounds[1:])
        return per, _int_array(bounds, "q"), _int_array(req, "i")
    head = np.flatnonzero(np.r_[True, key[1:] != key[:-1]]) if len(key) else np.empty(0, int)
    return dict(zip(key[head].tolist(), range(len(head)))), \
        _int_array(np.append(head, len(key)), "q"), _int_array(req, "i")


def _int_array(a: np.ndarray, code: str) -> array.array:
    """``a`` as a flat ``array(code)`` (``q``: int64, ``i``: int32): what ``bisect`` and
    indexing read as Python ints, made by one copy — no list of millions of int objects to
    build, nor for a forked sweep worker to copy on write as it touches their reference
    counts."""
    out = array.array(code)
    out.frombytes(np.ascontiguousarray(a, dtype=np.int64 if code == "q" else np.int32).tobytes())
    return out


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
    hints: str = "off"          # the trace's client hints: off | on | session-end | ttl (HINTS)


HINTS = ("off", "on", "session-end", "ttl")
"""What ``bench replay --hints`` sends of a trace's hints: nothing, everything it carries, or
one signal alone (``session-end``: closes only; ``ttl``: retention hints only)."""


class TraceHints:
    """The client hints a trace carries, one :class:`~engine.cache.hints.CacheHint` per request
    (``None`` for a request of no session), and the trace's clock (seconds from its first
    timestamp) — made once per command."""

    def __init__(self, trace: "Trace", signals: str = "on"):
        from engine.cache.hints import MAX_TTL_S, CacheHint

        if signals not in HINTS or signals == "off":
            raise ValueError(f"hints must be one of {HINTS[1:]}, got {signals!r}")
        n = len(trace)
        ts = trace.timestamps_ms
        self.times = ((ts - ts[0]) / 1000.0).tolist() if n else []
        sessions = getattr(trace, "sessions", None)
        ends = getattr(trace, "session_ends", None)
        ttls = getattr(trace, "ttl_s", None)
        if signals == "ttl":
            ends = None
        if signals == "session-end":
            ttls = None
        hints: list = [None] * n
        if sessions is not None:
            sess = sessions.tolist()
            end = ends.tolist() if ends is not None else [False] * n
            ttl = ttls.tolist() if ttls is not None else [math.nan] * n
            for i in range(n):
                if sess[i] < 0:
                    continue
                t = ttl[i]
                hints[i] = CacheHint(sess[i], None if math.isnan(t) else min(t, MAX_TTL_S),
                                     bool(end[i]))
        self.hint = hints.__getitem__
        self.sessions = sum(h is not None for h in hints)


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


def _opt_policy(inp: ReplayInput, page_size: int, clock: list[int], name_at: int) -> Belady:
    """Belady over the trace's future: a page is named by its last token, which — with the
    trace's prefix-hash block ids — identifies the whole prefix up to that page. A node is
    named by its first page, whose last token is ``node.tokens[name_at]``."""
    slots, starts, reqs = inp.future(page_size)
    right = bisect.bisect_right
    if isinstance(slots, int):                              # dense: a slot by arithmetic
        per, p, blk = slots, page_size, TRACE_BLOCK

        def next_use(node) -> int | None:
            t = node.tokens.item(name_at)
            s = t // blk * per + t % blk // p
            hi = starts[s + 1]
            i = right(reqs, clock[0], starts[s], hi)
            return reqs[i] if i < hi else None
    else:
        get = slots.get

        def next_use(node) -> int | None:
            s = get(node.tokens.item(name_at))
            if s is None:
                return None
            hi = starts[s + 1]
            i = right(reqs, clock[0], starts[s], hi)
            return reqs[i] if i < hi else None

    return Belady(next_use)


def _make_cache(cfg: ReplayConfig, events: EventLog, policy, unit: int = 1) -> HiCache:
    """The cache stack a replay drives. With ``cp_size`` N > 1 the tier budgets are per rank:
    ``sharded`` wraps the facade in :class:`~engine.parallel.cp_cache.CPCache` (each page on one
    owner rank: N x the device and host pages); ``replicated`` keeps every device page on every
    rank (device capacity = one rank's budget) over a host pool deduplicated across the ranks
    (N x the host budget) — the baseline of docs/parallelism.md §1. ``unit``: tokens per
    replayed token (the page size in a page-level replay)."""
    from engine.parallel.cp_cache import CPCache

    n = cfg.cp_size
    if n < 1 or cfg.cp_kv not in CP_KV:
        raise ValueError(f"cp_size must be >= 1 and cp_kv one of {CP_KV}, got "
                         f"{n}, {cfg.cp_kv!r}")
    replicated = n > 1 and cfg.cp_kv == "replicated"
    if n > 1 and not replicated and cfg.l3_tokens:
        raise ValueError("an L3 tier with CP-sharded KV is not simulated (drop --l3-tokens)")
    l2_tokens = cfg.l2_tokens * n if replicated else cfg.l2_tokens
    cache_cfg = CacheConfig(page_size=cfg.page_size // unit, l1_tokens=cfg.l1_tokens // unit,
                            l2_tokens=l2_tokens // unit,
                            eviction_policy="lru" if cfg.policy == "opt" else cfg.policy,
                            write_policy=cfg.write_policy, layout=None, events=cfg.events)
    if n > 1 and not replicated:
        return CPCache(cache_cfg, n, events=events, policy=policy)
    return HiCache(cache_cfg, events=events, policy=policy)


def replay(records: "ReplayInput | Trace | Iterable", cfg: ReplayConfig, *,
           events: EventLog | None = None,
           progress: Callable[[int], None] | None = None,
           keep_cache: bool = False,
           page_level: bool = False,
           facade: bool = False) -> "tuple[ReplayResult, HiCache | None]":
    """Replay a trace (a :class:`ReplayInput`, a :class:`~engine.loadgen.trace.Trace`, or
    records with ``hash_ids`` and ``input_length``) through a metadata-only cache.

    ``page_level``: replay one token per page (the page's last token) through a cache of page
    size 1 with the same number of pages. The tree, every eviction and so every hit are the
    same as the token-level replay's (only full pages are ever cached, and a page's last token
    names its content), at a fraction of the work; hits and stats are reported in tokens. It
    records no events and keeps no cache: a sweep's mode. With L1 only (no L2/L3) it runs on
    :class:`~engine.sim.lean.LeanReplay` — the facade's tree, eviction loop and policy without
    the rest of the facade, the same results — unless ``facade`` asks for the full stack."""
    inp = records if isinstance(records, ReplayInput) else ReplayInput(records)
    n_req = len(inp) if cfg.limit is None else min(cfg.limit, len(inp))
    p = cfg.page_size
    if page_level and (cfg.events or events is not None or keep_cache or cfg.cp_size != 1):
        raise ValueError("a page-level replay records no events, keeps no cache and has one "
                         "rank")
    unit = p if page_level else 1                          # tokens per replayed token
    clock = [0]
    policy = (_opt_policy(inp, p, clock, 0 if page_level else p - 1)
              if cfg.policy == "opt" else None)
    if events is None:
        events = EventLog(enabled=cfg.events)
    requests = inp.page_requests(p, n_req) if page_level else inp.requests(n_req)
    hints = None if cfg.hints == "off" else inp.hints(cfg.hints)
    if page_level and not facade and not cfg.l2_tokens and not cfg.l3_tokens:
        from engine.cache.hints import HintBook
        from engine.cache.policy import make_policy
        from engine.sim.lean import LeanReplay, drive_lean

        lean = LeanReplay(cfg.l1_tokens // p, policy or make_policy(cfg.policy),
                          hints=None if hints is None else HintBook())
        raws = None
        if hints is None:
            rows, raws = inp.page_rows(p)
            requests, raws = rows[:n_req], raws[:n_req]
        (l1, l2, l3, uncacheable), elapsed = drive_lean(lean, requests, clock, progress,
                                                        hints, raws)
        cache = None
        stats = lean.stats(int(inp.page_ends(p)[1][n_req]), l1)
        lean.close()
    else:
        cache = _make_cache(cfg, events, policy, unit)
        if cfg.l3_tokens:
            from engine.cache.l3 import SimulatedTier

            cache.attach_l3(SimulatedTier(-1 if cfg.l3_tokens < 0 else cfg.l3_tokens // p))
        (l1, l2, l3, uncacheable), elapsed = _drive(cache, requests, events, clock, progress,
                                                    hints)
        stats = cache.stats()
    l1, l2, l3 = l1 * unit, l2 * unit, l3 * unit
    total = int(inp.trace.input_lengths[:n_req].sum())
    if page_level:
        stats = {k: v * unit if k.endswith("_tokens") and isinstance(v, int) else v
                 for k, v in stats.items()}
        stats["page_size"] = p
        stats["match_tokens"] = total              # the partial last pages were matched too
    result = ReplayResult(
        requests=n_req, input_tokens=total, hit_tokens=l1 + l2 + l3, l1_hit_tokens=l1,
        l2_hit_tokens=l2, l3_hit_tokens=l3, uncacheable_requests=uncacheable,
        cache_seconds=elapsed, config=dataclasses.asdict(cfg), stats=stats,
        events=len(events))
    return result, (cache if keep_cache else None)


def _drive(cache: HiCache, requests: Iterable[np.ndarray], events: EventLog, clock: list[int],
           progress: Callable[[int], None] | None, hints: TraceHints | None = None
           ) -> tuple[tuple[int, int, int, int], float]:
    """The request loop: match → lock → load-back → alloc → insert → (hint) → unlock → poll.
    Returns the L1/L2/L3 hit lengths and uncacheable requests, and the seconds spent in the
    cache. ``hints``: each request's client hint, on the trace's clock."""
    p = cache.page_size
    l1 = l2 = l3 = uncacheable = 0
    perf = time.perf_counter
    elapsed = 0.0
    empty = np.empty(0, dtype=np.int64)
    for i, toks in enumerate(requests):
        t0 = perf()
        clock[0] = i
        events.set_step(i)
        if hints is not None:
            cache.set_clock(hints.times[i])
        m = cache.match(toks, rid=i)
        receipt = cache.lock(m)
        if m.l2_len or m.l3_len:
            cache.load_back(m)
        n_full = len(toks) // p
        have = len(m.l1_pages)
        try:
            new = cache.alloc_for(m, n_full - have) if n_full > have else empty
            pages = np.concatenate([m.l1_pages, new]) if have else new
            last = cache.insert(toks[:n_full * p], pages, rid=i, prefix_hashes=m.hashes,
                                after=receipt)
        except OutOfCapacity:
            uncacheable += 1
            last = None
        if hints is not None:
            cache.hint(last or receipt._node, None, hints.hint(i), rid=i)
        cache.unlock(receipt)
        cache.poll()
        elapsed += perf() - t0
        l1 += m.l1_len
        l2 += m.l2_len
        l3 += m.l3_len
        if progress is not None:
            progress(i + 1)
    return (l1, l2, l3, uncacheable), elapsed
