"""How much of the LRU → Belady gap can an *online* eviction policy close on a trace?

A fluid bound (docs/eviction.md, "What an online policy can know"). Every request is an item:
it occupies its prompt's tokens while kept, and earns a hit of the tokens its first
continuation shares with it (the next request that extends its prefix), if it is still kept
then. A policy that sees only features of the item (its class) can choose, per class, a share
of items to keep and for how long; the best such choice for a cache of ``C`` tokens is a
fractional knapsack over each class's concave hull of (token-time, hit tokens). Classes:

* ``one class``: nothing known but the past distribution (what bimodal insertion can reach);
* ``turn``, ``turn x added``, ``rich`` (turn, gap since the previous turn, prompt length,
  added tokens): what a policy that learns per class could reach at best;
* ``perfect``: each item alone — it knows the future, close to Belady.

``common T`` restricts every kept item to one retention (one LRU order), as ``density`` does.
The bound counts the shared system prompt (the first block) as always hit. It ignores that an
item is only one request's prefix among a tree's nodes, so it is an estimate, not a guarantee;
the script prints LRU and Belady replays of the same trace alongside.

    python benchmarks/eviction_bound.py TRACE [--capacities 320k,640k,1.28m,2.56m,5.12m] [--json]
"""

from __future__ import annotations

import argparse
import collections
import json
import sys

import numpy as np

BLOCK = 512


def _sessions(records):
    """For each request: the earlier request it continues (longest shared prefix of more than
    one block, most recent on ties) and the blocks they share."""
    last: dict[tuple, int] = {}
    parent = np.full(len(records), -1)
    shared = np.zeros(len(records), dtype=np.int64)
    for i, r in enumerate(records):
        h = tuple(r["hash_ids"])
        for k in range(len(h), 1, -1):
            j = last.get(h[:k])
            if j is not None:
                parent[i], shared[i] = j, k
                break
        for k in range(1, len(h) + 1):
            last[h[:k]] = i
    return parent, shared


def _items(records):
    n = len(records)
    ts = np.array([r.get("timestamp", 0) for r in records], dtype=float)
    size = np.array([r["input_length"] for r in records], dtype=float)
    if ts.max() <= ts.min():
        ts = np.cumsum(size)                           # no clock in the trace: tokens
    parent, shared = _sessions(records)
    turn = np.zeros(n, dtype=np.int64)
    kids = collections.defaultdict(list)
    for i in range(n):
        if parent[i] >= 0:
            turn[i] = turn[parent[i]] + 1
            kids[parent[i]].append(i)
    gap = np.full(n, np.inf)
    hit = np.zeros(n)
    for i in range(n):
        if kids[i]:
            c = kids[i][0]
            gap[i] = ts[c] - ts[i]
            hit[i] = max(min(shared[c] * BLOCK, size[c]) - BLOCK, 0)
    prev_gap = np.array([ts[i] - ts[parent[i]] if parent[i] >= 0 else -1 for i in range(n)])
    added = np.array([size[i] - (shared[i] * BLOCK if parent[i] >= 0 else 0) for i in range(n)])
    span = ts.max() - ts.min()
    return dict(size=size, gap=gap, hit=hit, turn=turn, prev_gap=prev_gap, added=added,
                span=span, base=float(np.minimum(size, BLOCK).sum()), total=float(size.sum()))


def _grid(items):
    g = items["gap"][np.isfinite(items["gap"])]
    hi = max(float(g.max()) if g.size else 1.0, 1.0)
    return np.concatenate(([0.0], np.geomspace(hi / 1e4, hi, 160)))


def _tables(items, classes):
    a = _grid(items)
    out = []
    for c in np.unique(classes):
        m = classes == c
        g, h, s = items["gap"][m], items["hit"][m], items["size"][m]
        order = np.argsort(g)
        gs, hs = g[order], np.cumsum(h[order])
        k = np.searchsorted(gs, a, side="right")
        hits = np.where(k > 0, hs[np.maximum(k - 1, 0)], 0.0)
        cost = np.array([(s * np.minimum(g, x)).sum() for x in a])
        out.append((cost, hits))
    return a, out


def per_class(items, classes, caps):
    """Each class its own retention (and share): fractional knapsack over hull segments."""
    _, tabs = _tables(items, classes)
    segs = []
    for cost, hits in tabs:
        hull = [(0.0, 0.0)]
        for x, y in zip(cost, hits):
            if x <= hull[-1][0] + 1e-9:
                continue
            while len(hull) >= 2 and (hull[-1][1] - hull[-2][1]) * (x - hull[-2][0]) \
                    <= (y - hull[-2][1]) * (hull[-1][0] - hull[-2][0]):
                hull.pop()
            hull.append((x, y))
        for (x0, y0), (x1, y1) in zip(hull, hull[1:]):
            if y1 > y0:
                segs.append(((y1 - y0) / (x1 - x0), x1 - x0, y1 - y0))
    segs.sort(key=lambda t: -t[0])
    res = []
    for cap in caps:
        left, got = cap * items["span"], 0.0
        for _, dx, dy in segs:
            if left <= 0:
                break
            f = min(1.0, left / dx)
            got += f * dy
            left -= f * dx
        res.append((items["base"] + got) / items["total"])
    return res


def common_t(items, classes, caps):
    """All kept items share one retention T; classes are admitted by hit density at T."""
    a, tabs = _tables(items, classes)
    cost = np.array([c for c, _ in tabs])
    hits = np.array([h for _, h in tabs])
    res = []
    for cap in caps:
        best = 0.0
        for b in range(1, len(a)):
            left, got = cap * items["span"], 0.0
            dens = hits[:, b] / np.maximum(cost[:, b], 1e-9)
            for i in np.argsort(-dens):
                f = min(1.0, left / max(cost[i, b], 1e-9))
                got += f * hits[i, b]
                left -= f * cost[i, b]
                if left <= 0:
                    break
            if left <= 0:
                best = max(best, got)
        res.append((items["base"] + best) / items["total"])
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--capacities", default="320k,640k,1.28m,2.56m,5.12m")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    sys.path.insert(0, ".")
    from engine.loadgen.trace import load_trace, read_trace
    from engine.sim.replay import ReplayConfig, ReplayInput, replay
    from hicache_cli.options import token_counts

    caps = token_counts("--capacities", args.capacities)
    records = [{"timestamp": r.timestamp_ms, "input_length": r.input_length,
                "hash_ids": list(r.hash_ids)} for r in read_trace(args.trace)]
    items = _items(records)
    turn = np.minimum(items["turn"], 3)
    added = np.digitize(items["added"], [500, 2000])
    pg = np.digitize(items["prev_gap"], [0, np.median(items["prev_gap"][items["prev_gap"] >= 0])
                                         if (items["prev_gap"] >= 0).any() else 1])
    length = np.digitize(items["size"], [1000, 4000, 16000])
    one = np.zeros(len(records), dtype=np.int64)
    rows = {
        "one class": per_class(items, one, caps),
        "turn": per_class(items, turn, caps),
        "turn x added": per_class(items, turn * 10 + added, caps),
        "turn x added, common T": common_t(items, turn * 10 + added, caps),
        "rich": per_class(items, ((turn * 10 + pg) * 10 + length) * 10 + added, caps),
        "perfect": per_class(items, np.arange(len(records)), caps),
    }
    inp = ReplayInput(load_trace(args.trace))
    for pol in ("lru", "opt"):
        rows[pol] = [replay(inp, ReplayConfig(page_size=args.page_size, l1_tokens=c, policy=pol,
                                              events=False), page_level=True)[0].token_hit_rate
                     for c in caps]
    lru, opt = np.array(rows["lru"]), np.array(rows["opt"])
    share = {k: ((np.array(v) - lru) / np.maximum(opt - lru, 1e-12)).tolist()
             for k, v in rows.items()}
    if args.json:
        print(json.dumps({"capacities": caps, "hit_rate": rows, "gap_share": share}, indent=1))
        return 0
    print(f"{'':26s}" + "".join(f"{c:>16,d}" for c in caps))
    for k, v in rows.items():
        cells = "".join(f"{x:9.4f} ({s:+4.0%})" for x, s in zip(v, share[k]))
        print(f"{k:26s}{cells}")
    print("(share of the LRU→Belady gap in brackets; rows other than lru/opt are fluid bounds)")
    return 0


if __name__ == "__main__":
    from _errors import run
    raise SystemExit(run("eviction_bound", main))
