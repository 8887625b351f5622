"""Sessions inferred from a trace's hash-id chains, and the oracle hints they give.

Mooncake ``hash_ids`` are *prefix* hashes of 512-token blocks, so two requests that share an id
at position ``k`` share their whole prefix up to block ``k``. A conversation's next turn sends
the previous prompt, the answer and a new message: it starts with every *full* block of the
previous prompt (the partial last block changes, the answer completes it). Inference follows
that, request by request in timestamp order (ties: file order):

* **Candidates.** Request ``p``'s *chain* is its full blocks, ``input_length // 512`` of them.
  Request ``r``'s predecessor is the latest earlier request whose chain is a proper prefix of
  ``r``'s blocks, the longest such chain first. A dict from a chain's last block id to the
  latest request ending there finds it with one look-up per block of ``r`` (``O(total
  blocks)``); with prefix hashes an equal last id means an equal chain.
* **Shared prefixes are not turns.** A chain that ends where several different conversations
  continue (a system prompt, a shared tool preamble: its last block is followed, as a full
  block, by more than ``max_branches`` distinct ids anywhere in the trace) is not a
  predecessor: the longest candidate is then refused (``r`` may still branch, below). A request
  whose whole chain is a shared system prompt therefore never chains unrelated sessions. An
  empty chain (input < 512 tokens) is never a predecessor.
* **Branches from inside a prompt.** A request that extends no earlier chain (or only a
  refused one) but starts with blocks an earlier request already held (an edited earlier
  message; a turn the sampled trace lacks) joins the session of the request that first held the
  last of those blocks, unless that block is a shared prefix by the rule above (found for all
  requests at once from one sort of the trace's block ids).
* **Branches.** A predecessor that is extended again later (a regenerated or edited turn) keeps
  both extensions in its session, as long as its chain end has at most ``max_branches``
  distinct full continuations (default 2: one regeneration); a session is then a tree of turns
  and its requests are ordered by time.
* **Time.** A predecessor may be any earlier request, however long ago (a conversation resumed
  after an hour is the same conversation); ``max_gap_s`` bounds it when set.

The oracle hints: ``session_end`` on each session's last request (in time), ``ttl_s`` on every
other request = seconds until the session's next request (timestamps are ms). With a factor
``F > 1`` each ttl is multiplied by a seeded log-uniform factor in ``[1/F, F]`` (hints "accurate
to a factor of F").

Pure numpy/Python on :class:`~engine.loadgen.trace.Trace` columns.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from engine.loadgen.trace import MAX_TTL_S, NO_SESSION, TRACE_BLOCK, Trace, TraceRecord

DEFAULT_MAX_BRANCHES = 2


@dataclasses.dataclass(frozen=True, eq=False)
class Inferred:
    """Inference result, one entry per request of the trace (file order)."""

    predecessor: np.ndarray    # int64: index of the request this one extends, -1 for none
    session: np.ndarray        # int64: session number 0.. (the index of its first request)
    session_end: np.ndarray    # bool
    gap_s: np.ndarray          # float64: seconds to the session's next request, NaN on the last
    branch: np.ndarray         # bool: the link is a branch from inside the predecessor's prompt

    @property
    def sessions(self) -> int:
        return int(np.unique(self.session).size)

    def stats(self) -> dict:
        """Sessions found, turns per session (mean, max), share of requests with a
        predecessor."""
        n = len(self.session)
        _, counts = np.unique(self.session, return_counts=True)
        return {"requests": n, "sessions": int(counts.size),
                "turns_mean": round(float(counts.mean()), 3) if n else 0.0,
                "turns_max": int(counts.max()) if n else 0,
                "with_predecessor": round(float((self.predecessor >= 0).mean()), 4) if n else 0.0,
                "branches": round(float(self.branch.mean()), 4) if n else 0.0}


def _forks(trace: Trace) -> dict[int, int]:
    """For each block id followed by a full block somewhere: how many distinct full blocks
    follow it (over the whole trace)."""
    full = trace.input_lengths // TRACE_BLOCK
    lens = np.diff(trace.offsets)
    starts = trace.offsets[:-1]
    pos = np.arange(int(trace.offsets[-1]), dtype=np.int64) - np.repeat(starts, lens)
    keep = (pos >= 1) & (pos < np.repeat(full, lens))
    idx = np.flatnonzero(keep)
    if not idx.size:
        return {}
    pairs = np.unique(np.stack([trace.blocks[idx - 1], trace.blocks[idx]], axis=1), axis=0)
    parents, counts = np.unique(pairs[:, 0], return_counts=True)
    many = counts > 1
    return dict(zip(parents[many].tolist(), counts[many].tolist()))


def infer_sessions(trace: Trace, *, max_branches: int = DEFAULT_MAX_BRANCHES,
                   max_gap_s: float | None = None) -> Inferred:
    """Sessions of ``trace`` from its hash-id chains (the rules in the module docstring)."""
    if max_branches < 1:
        raise ValueError(f"max_branches must be >= 1, got {max_branches}")
    n = len(trace)
    order = np.argsort(trace.timestamps_ms, kind="stable").tolist()
    forks = _forks(trace)
    full = (trace.input_lengths // TRACE_BLOCK).tolist()
    ts = trace.timestamps_ms.tolist()
    offs = trace.offsets.tolist()
    blocks = trace.blocks.tolist()
    max_gap_ms = math.inf if max_gap_s is None else max_gap_s * 1000.0
    shared, owner = _shared_prefix(trace, order)
    latest: dict[int, int] = {}       # chain's last block id -> latest request ending there
    pred = [-1] * n
    branch = [False] * n
    for r in order:
        lo, hi = offs[r], offs[r + 1]
        for k in range(hi - 1, lo, -1):       # chain lengths len(r) - 1 .. 1: proper prefixes
            p = latest.get(blocks[k - 1])
            if p is None or full[p] != k - lo:     # (!=: ids that are not prefix hashes)
                continue
            if forks.get(blocks[k - 1], 1) <= max_branches and ts[r] - ts[p] <= max_gap_ms:
                pred[r] = p
            break
        k = shared[r]
        if pred[r] < 0 and k:                 # a branch from inside an earlier prompt
            p = owner[r]
            if forks.get(blocks[lo + k - 1], 1) <= max_branches and ts[r] - ts[p] <= max_gap_ms:
                pred[r] = p
                branch[r] = True
        f = full[r]
        if f:
            latest[blocks[lo + f - 1]] = r
    # sessions: follow predecessors (a predecessor is earlier in ``order``)
    session = [-1] * n
    for r in order:
        p = pred[r]
        session[r] = r if p < 0 else session[p]
    sess = np.array(session, dtype=np.int64)
    end, gap = session_hints(trace, sess, order)
    return Inferred(np.array(pred, dtype=np.int64), sess, end, gap, np.array(branch, dtype=bool))


def _shared_prefix(trace: Trace, order: list[int]) -> tuple[list[int], list[int]]:
    """Per request: how many of its leading blocks an earlier request (in ``order``) already
    held, and the request that first held the last of them (-1 when none). Array operations:
    the first holder of every block id from one sort of all the trace's block ids."""
    n = len(trace)
    rank = np.empty(n, dtype=np.int64)
    rank[np.asarray(order, dtype=np.int64)] = np.arange(n)
    lens = np.diff(trace.offsets)
    row = np.repeat(np.arange(n, dtype=np.int64), lens)
    brank = rank[row]
    idx = np.lexsort((brank, trace.blocks))
    ids = trace.blocks[idx]
    start = np.ones(len(ids), dtype=bool)
    start[1:] = ids[1:] != ids[:-1]
    group = np.cumsum(start) - 1
    first = np.empty(len(ids), dtype=np.int64)
    first[idx] = brank[idx][start][group]          # rank of the first holder of each block
    old = first < brank
    pos = np.arange(len(ids), dtype=np.int64) - np.repeat(trace.offsets[:-1], lens)
    cut = np.where(old, np.iinfo(np.int64).max, pos)
    nonempty = lens > 0
    k = np.zeros(n, dtype=np.int64)
    if nonempty.any():
        k[nonempty] = np.minimum(np.minimum.reduceat(cut, trace.offsets[:-1][nonempty]),
                                 lens[nonempty])
    holder = np.full(n, -1, dtype=np.int64)
    has = k > 0
    by_rank = np.asarray(order, dtype=np.int64)
    holder[has] = by_rank[first[trace.offsets[:-1][has] + k[has] - 1]]
    return k.tolist(), holder.tolist()


def session_hints(trace: Trace, keys: np.ndarray,
                  order: list[int] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``(session_end, gap_s)`` for sessions ``keys`` (one key per request; ``NO_SESSION``:
    a session of its own): the last request of each session in time, and every other
    request's seconds to the next request of its session (NaN on the last)."""
    n = len(trace)
    if order is None:
        order = np.argsort(trace.timestamps_ms, kind="stable").tolist()
    ts = trace.timestamps_ms.tolist()
    ks = keys.tolist()
    gap = np.full(n, np.nan)
    end = np.zeros(n, dtype=bool)
    last: dict[int, int] = {}
    for r in order:
        k = ks[r]
        if k == NO_SESSION:
            end[r] = True
            continue
        q = last.get(k)
        if q is not None:
            gap[q] = (ts[r] - ts[q]) / 1000.0
        last[k] = r
    for q in last.values():
        end[q] = True
    return end, gap


def noisy_ttl(gap_s: np.ndarray, factor: float, seed: int = 0) -> np.ndarray:
    """``gap_s`` with every value multiplied by a log-uniform factor in ``[1/factor, factor]``
    drawn from ``seed`` (``factor`` 1: unchanged), at most :data:`MAX_TTL_S` (what a trace
    may carry). NaN stays NaN."""
    if not (math.isfinite(factor) and factor >= 1):
        raise ValueError(f"ttl factor must be a finite number >= 1, got {factor}")
    if factor == 1:
        return np.minimum(gap_s, MAX_TTL_S)
    rng = np.random.default_rng(seed)
    u = rng.uniform(-1.0, 1.0, size=gap_s.shape)
    return np.minimum(gap_s * np.exp(u * math.log(factor)), MAX_TTL_S)


def link_quality(truth: np.ndarray, inferred: Inferred, trace: Trace) -> dict:
    """How well ``inferred`` recovers known sessions ``truth`` (a session key per request).

    The true predecessor of a request is the previous request (in time) of its session. Link
    precision: share of inferred links that are true; recall: share of true links inferred;
    ``sessions_exact``: share of true sessions whose requests form exactly one inferred
    session."""
    order = np.argsort(trace.timestamps_ms, kind="stable").tolist()
    tru = truth.tolist()
    true_pred = [-1] * len(tru)
    last: dict[int, int] = {}
    for r in order:
        k = tru[r]
        if k == NO_SESSION:
            continue
        if k in last:
            true_pred[r] = last[k]
        last[k] = r
    inf_pred = inferred.predecessor.tolist()
    true_links = {(p, r) for r, p in enumerate(true_pred) if p >= 0}
    inf_links = {(p, r) for r, p in enumerate(inf_pred) if p >= 0}
    hit = len(true_links & inf_links)
    groups: dict[int, set[int]] = {}
    for r, k in enumerate(tru):
        if k != NO_SESSION:
            groups.setdefault(k, set()).add(r)
    members: dict[int, set[int]] = {}
    for r, s in enumerate(inferred.session.tolist()):
        members.setdefault(s, set()).add(r)
    sess = inferred.session.tolist()
    exact = sum(1 for rs in groups.values()
                if len({sess[r] for r in rs}) == 1 and members[sess[next(iter(rs))]] == rs)
    return {"link_precision": round(hit / len(inf_links), 4) if inf_links else 1.0,
            "link_recall": round(hit / len(true_links), 4) if true_links else 1.0,
            "sessions_exact": round(exact / len(groups), 4) if groups else 1.0,
            "true_sessions": len(groups)}


def known_sessions_trace(n_sessions: int = 300, *, seed: int = 0, max_turns: int = 12,
                         system_tokens: int = 700, tiny_first: float = 0.1,
                         duration_s: float = 1800.0, mean_gap_s: float = 60.0) -> Trace:
    """A Mooncake-like trace whose sessions are known (``Trace.sessions``), to measure
    :func:`infer_sessions` against: ``n_sessions`` chats of 1..``max_turns`` turns starting at
    random times, all behind one ``system_tokens`` system prompt (its full blocks are shared by
    every session, its partial block is not). Each turn sends the previous prompt, a 20..800
    token answer and a 20..3000 token message, after an exponential gap (mean ``mean_gap_s``).
    A share ``tiny_first`` of the sessions open with a message so short that the first prompt's
    full blocks are only the system prompt (inference cannot tell those apart). Block ids are
    prefix hashes: block ``k`` of a turn keeps the id it had in the earliest turn where it was
    full; a partial block's id is new every turn."""
    rng = np.random.default_rng(seed)
    sys_full = system_tokens // TRACE_BLOCK
    reqs: list[tuple[float, int, int, int, list]] = []   # ts, session, input, output, keys
    for sid in range(n_sessions):
        turns = int(rng.integers(1, max_turns + 1))
        t = float(rng.uniform(0, duration_s * 1000.0))
        if rng.random() < tiny_first:
            first = int(rng.integers(1, (sys_full + 1) * TRACE_BLOCK - system_tokens + 1))
        else:
            first = int(rng.integers(200, 6000))
        length = system_tokens + first
        lengths = []
        for _ in range(turns):
            lengths.append(length)
            length += int(rng.integers(20, 801)) + int(rng.integers(20, 3001))
        for ti, n_in in enumerate(lengths):
            keys = []
            for k in range(-(-n_in // TRACE_BLOCK)):
                if (k + 1) * TRACE_BLOCK <= sys_full * TRACE_BLOCK:
                    keys.append(("sys", k))
                    continue
                t0 = next((j for j in range(ti + 1) if (k + 1) * TRACE_BLOCK <= lengths[j]),
                          None)
                keys.append((sid, k, t0) if t0 is not None else (sid, k, ti, "partial"))
            reqs.append((round(t), sid, n_in, int(rng.integers(20, 801)), keys))
            t += float(rng.exponential(mean_gap_s * 1000.0)) + 1000.0
    reqs.sort(key=lambda q: q[0])
    ids: dict = {}
    recs = [TraceRecord(float(ts), n_in, n_out,
                        tuple(ids.setdefault(k, len(ids)) for k in keys), sid)
            for ts, sid, n_in, n_out, keys in reqs]
    return Trace.from_records(recs, name=f"known-sessions-{seed}")
