"""``HiCache.stats()``: what the cache reports about itself (pools, counters, policy, L3)."""

from __future__ import annotations

from typing import Any, Iterable


def policy_stats(policy) -> dict[str, Any]:
    """The policy's name and, for a policy that learns (``bip``, ``density``), its decisions."""
    describe = getattr(policy, "describe", None)
    return {"name": getattr(policy, "name", type(policy).__name__),
            **(describe() if describe is not None else {})}


def cache_stats(cache, counters: Iterable[str]) -> dict[str, Any]:
    p = cache.page_size
    c = cache.counters
    locked = sum(len(n.tokens) for n in cache.tree.iter_nodes()
                 if n.lock_ref > 0 and n.l1 is not None)
    l2 = cache.l2_alloc
    return {
        "page_size": p,
        "nodes": cache.tree.num_nodes,
        "l1_capacity_tokens": cache.l1_alloc.num_pages * p,
        "l1_used_tokens": cache.l1_alloc.used_pages * p,
        "l1_locked_tokens": locked,
        "l2_capacity_tokens": l2.num_pages * p if l2 else 0,
        "l2_used_tokens": l2.used_pages * p if l2 else 0,
        **{k: c[k] for k in counters},
        "inflight_ops": sum(len(q) for q in cache._inflight.values()),
        "l3": cache.l3.stats() if cache.l3 is not None else None,
        "policy": policy_stats(cache.policy),
        **({} if cache.hints is None else {"hints": cache.hints.stats()}),
    }
