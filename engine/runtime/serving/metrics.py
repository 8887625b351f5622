"""``GET /metrics``: the scheduler's and the cache's counters in Prometheus text format 0.0.4."""

from __future__ import annotations

import math
from typing import Any

from engine.runtime.scheduler import Histogram, SchedulerMetrics

PREFIX = "hicache"


class _Writer:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def family(self, name: str, kind: str, help_: str) -> str:
        full = f"{PREFIX}_{name}"
        self.lines.append(f"# HELP {full} {help_}")
        self.lines.append(f"# TYPE {full} {kind}")
        return full

    def sample(self, name: str, value: float, labels: dict[str, str] | None = None) -> None:
        lab = ""
        if labels:
            lab = "{" + ",".join(f'{k}="{_esc(v)}"' for k, v in labels.items()) + "}"
        self.lines.append(f"{name}{lab} {_num(value)}")

    def scalar(self, name: str, kind: str, help_: str, value: float) -> None:
        self.sample(self.family(name, kind, help_), value)

    def histogram(self, name: str, help_: str, h: Histogram) -> None:
        full = self.family(name, "histogram", help_)
        for le, c in h.cumulative():
            self.sample(full + "_bucket", c, {"le": "+Inf" if math.isinf(le) else _num(le)})
        self.sample(full + "_sum", h.sum)
        self.sample(full + "_count", h.count)

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


def _esc(v: str) -> str:
    return str(v).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _num(v: float) -> str:
    if isinstance(v, bool):
        return str(int(v))
    if isinstance(v, int):
        return str(v)
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v))


def render(m: SchedulerMetrics, cache_stats: dict[str, Any], running: int, waiting: int,
           info: dict[str, Any]) -> str:
    """The exposition text. ``cache_stats`` is ``HiCache.stats()`` (read on the scheduler
    thread)."""
    w = _Writer()
    fam = w.family("info", "gauge", "Served model and cache configuration.")
    w.sample(fam, 1, {k: str(v) for k, v in info.items()})
    fam = w.family("requests_total", "counter", "Finished requests by finish reason.")
    for reason in ("length", "stop", "abort", "error"):
        w.sample(fam, m.requests.get(reason, 0), {"reason": reason})
    w.scalar("prompt_tokens_total", "counter", "Prompt tokens of admitted requests.",
             m.prompt_tokens)
    w.scalar("generation_tokens_total", "counter", "Generated tokens.", m.generation_tokens)
    w.scalar("computed_prompt_tokens_total", "counter",
             "Prompt tokens the model computed (not served from the cache).",
             m.computed_prompt_tokens)
    w.scalar("spec_proposed_tokens_total", "counter",
             "Speculative decoding: draft tokens proposed.", m.spec_proposed)
    w.scalar("spec_accepted_tokens_total", "counter",
             "Speculative decoding: draft tokens the target accepted.", m.spec_accepted)
    w.scalar("spec_verify_steps_total", "counter",
             "Speculative decoding: target verify passes (one per request per round).",
             m.spec_verify_steps)
    w.scalar("spec_emitted_tokens_total", "counter",
             "Speculative decoding: tokens emitted by verify passes (accepted + the target's).",
             m.spec_emitted)
    fam = w.family("cache_hit_tokens_total", "counter",
                   "Prompt tokens served from the cache, by tier the KV came from.")
    for tier in ("device", "host", "storage"):
        w.sample(fam, m.cached_tokens.get(tier, 0), {"tier": tier})
    fam = w.family("cache_match_hit_tokens_total", "counter",
                   "Tokens matched in the radix tree per tier at admission (facade counters).")
    for tier, key in (("device", "hit_l1_tokens"), ("host", "hit_l2_tokens"),
                      ("storage", "hit_l3_tokens")):
        w.sample(fam, cache_stats.get(key, 0), {"tier": tier})
    w.scalar("cache_match_tokens_total", "counter", "Tokens looked up in the radix tree.",
             cache_stats.get("match_tokens", 0))
    w.scalar("cache_partial_hit_tokens_total", "counter",
             "Tokens after the matched whole pages whose KV admission copied from a cached L1 "
             "page that starts with them (partial last-page reuse; in the device hits).",
             cache_stats.get("hit_l1_partial_tokens", 0))
    fam = w.family("evicted_pages_total", "counter", "Pages evicted, by tier.")
    w.sample(fam, cache_stats.get("evicted_l1_pages", 0), {"tier": "device"})
    w.sample(fam, cache_stats.get("evicted_l2_pages", 0), {"tier": "host"})
    pol = cache_stats.get("policy") or {}
    w.scalar("eviction_not_admitted_total", "counter",
             "Nodes the eviction policy placed at the LRU end on their touch (bip, density).",
             pol.get("not_admitted", 0))
    w.scalar("load_back_ops_total", "counter", "L2 -> L1 load-back operations.",
             cache_stats.get("loadback_ops", 0))
    w.scalar("load_back_pages_total", "counter", "Pages loaded back from L2 to L1.",
             cache_stats.get("loadback_pages", 0))
    w.scalar("backup_pages_total", "counter", "Pages backed up from L1 to L2.",
             cache_stats.get("backup_pages", 0))
    fam = w.family("pool_used_tokens", "gauge", "Tokens of KV held per pool.")
    w.sample(fam, cache_stats.get("l1_used_tokens", 0), {"tier": "device"})
    w.sample(fam, cache_stats.get("l2_used_tokens", 0), {"tier": "host"})
    fam = w.family("pool_capacity_tokens", "gauge", "Capacity of each pool in tokens.")
    w.sample(fam, cache_stats.get("l1_capacity_tokens", 0), {"tier": "device"})
    w.sample(fam, cache_stats.get("l2_capacity_tokens", 0), {"tier": "host"})
    cp = cache_stats.get("tp") or cache_stats.get("cp") or {}     # tp: every rank of TP x CP
    if cp.get("l1_kv_bytes_per_rank") is not None:
        fam = w.family("kv_bytes", "gauge", "KV bytes held per rank and tier (a CP rank holds "
                       "only the pages it owns, a TP rank only its kv-heads).")
        for tier, key in (("device", "l1_kv_bytes_per_rank"), ("host", "l2_kv_bytes_per_rank")):
            for r, b in enumerate(cp.get(key) or []):
                w.sample(fam, b, {"rank": str(r), "tier": tier})
    w.scalar("pool_locked_tokens", "gauge", "L1 tokens pinned by running requests.",
             cache_stats.get("l1_locked_tokens", 0))
    w.scalar("tree_nodes", "gauge", "Radix tree nodes.", cache_stats.get("nodes", 0))
    w.scalar("inflight_transfers", "gauge", "Transfers issued and not yet committed.",
             cache_stats.get("inflight_ops", 0))
    l3 = cache_stats.get("l3")
    fam = w.family("l3_enabled", "gauge", "1 when the L3 store is attached and serving; the "
                   "status label says why not otherwise.")
    w.sample(fam, 1 if l3 is not None else 0, {"status": str(info.get("l3", "off"))})
    if l3 is not None:
        fam = w.family("l3_pages_total", "counter", "L3 page operations by outcome.")
        for key in ("hits", "misses", "corrupt", "layout_mismatch", "errors", "puts",
                    "put_skipped", "put_failed"):
            if key in l3:
                w.sample(fam, l3[key], {"outcome": key})
        fam = w.family("l3_bytes_total", "counter", "Bytes moved to and from L3.")
        w.sample(fam, l3.get("bytes_read", 0), {"direction": "read"})
        w.sample(fam, l3.get("bytes_written", 0), {"direction": "written"})
        fam = w.family("l3_degraded", "gauge", "1 while an L3 store call is stuck past its "
                       "deadline (L3 calls fail fast meanwhile); the reason label says which.")
        w.sample(fam, 1 if l3.get("degraded") else 0,
                 {"reason": str(l3.get("degraded_reason", ""))})
        w.scalar("l3_abandoned_calls_total", "counter", "L3 store calls abandoned at their "
                 "deadline.", l3.get("abandoned", 0))
        backend = l3.get("backend") or {}
        if isinstance(backend, dict):
            w.scalar("l3_backend_healthy", "gauge", "1 while the L3 backend answers.",
                     1 if backend.get("healthy", True) else 0)
            w.scalar("l3_backend_errors_total", "counter", "Errors the L3 backend counted.",
                     backend.get("errors", 0))
    w.scalar("prefetch_pages_total", "counter", "Pages prefetched from L3 into L2.",
             cache_stats.get("prefetch_pages", 0))
    w.scalar("running_requests", "gauge", "Requests admitted and not finished.", running)
    w.scalar("waiting_requests", "gauge", "Requests queued for admission.", waiting)
    w.scalar("scheduler_steps_total", "counter", "Scheduler steps that ran a batch.", m.steps)
    w.scalar("forward_seconds_total", "counter", "Time spent in model forwards.",
             m.forward_seconds)
    w.histogram("queue_time_seconds", "Arrival to admission.", m.queue_time)
    w.histogram("ttft_seconds", "Arrival to first output token.", m.ttft)
    w.histogram("e2e_latency_seconds", "Arrival to finish.", m.e2e_latency)
    return w.text()


SESSION_HELP = {
    "sessions": ("gauge", "Client sessions the server's registry holds (opened or seen)."),
    "opened_sessions": ("gauge", "Sessions opened (/open_session, nvext open) and not closed."),
    "max_sessions": ("gauge", "The registry's bound (--max-sessions)."),
}


HINT_GAUGES = frozenset({"sessions", "namespaces_judged"})
"""``hint_stats()`` keys that are levels (with every ``trusted_*`` one); every other key counts
events (``…_total``)."""


def render_hints(hint_stats: dict[str, Any], session_stats: dict[str, Any]) -> str:
    """Client cache hints: the cache's figures (``HiCache.hint_stats()`` as
    ``hicache_hint_<key>``: a gauge for :data:`HINT_GAUGES` and ``trusted_*``, else a counter
    ``…_total``) and
    the session registry's (``hicache_sessions*``)."""
    w = _Writer()
    for key, v in sorted(hint_stats.items()):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        base = key[len("hint_"):] if key.startswith("hint_") else key
        if key in HINT_GAUGES or key.startswith("trusted_"):
            w.scalar(f"hint_{base}", "gauge", f"Cache hints: {key.replace('_', ' ')}.", v)
        else:
            name = base if base.endswith("_total") else f"{base}_total"
            w.scalar(f"hint_{name}", "counter",
                     f"Cache hints: {key.replace('_', ' ')} (events).", v)
    for key, v in sorted(session_stats.items()):
        kind, help_ = SESSION_HELP.get(key, ("counter" if key.endswith("_total") else "gauge",
                                             f"Session registry: {key.replace('_', ' ')}."))
        name = key if key.endswith("sessions") else f"sessions_{key}"
        w.scalar(name, kind, help_, v)
    return w.text()
