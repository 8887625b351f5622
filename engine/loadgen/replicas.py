"""The replicas behind a router, as a load generator sees them: the router's worker list
(``GET /workers``, as SGLang's router answers it) and each replica's own counters (``GET
/metrics`` of a hicache server), so a run through a router can report per-replica figures.
Standard library only; every call is bounded by a timeout and answers ``None`` or ``[]`` on any
failure (a router that lists no workers, a replica that is not hicache)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

MAX_BYTES = 8 << 20
COUNTERS = {"hicache_prompt_tokens_total": "prompt_tokens",
            "hicache_computed_prompt_tokens_total": "computed_tokens"}


def _fetch(url: str, timeout: float) -> bytes | str:
    """The body of a 200 answer, else why not: ``"HTTP 404"``, ``"no answer: …"``."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:       # noqa: S310 (http only)
            return r.read(MAX_BYTES) if r.status == 200 else f"HTTP {r.status}"
    except urllib.error.HTTPError as exc:
        return f"HTTP {exc.code}"
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", None) or exc
        return f"no answer: {str(reason)[:120] or type(exc).__name__}"


def _get(url: str, timeout: float) -> bytes | None:
    raw = _fetch(url, timeout)
    return raw if isinstance(raw, bytes) else None


def router_workers(url: str, timeout: float = 5.0) -> list[dict[str, Any]]:
    """The router's workers (``[{"url", "is_healthy", "load", …}]``); ``[]`` when ``url`` is no
    router that lists them."""
    raw = _get(url.rstrip("/") + "/workers", timeout)
    try:
        ws = json.loads(raw)["workers"] if raw else []
    except (ValueError, KeyError, TypeError):
        return []
    return [w for w in ws if isinstance(w, dict) and isinstance(w.get("url"), str)] \
        if isinstance(ws, list) else []


def replica_counters(url: str, timeout: float = 10.0) -> dict[str, float] | None:
    """A hicache replica's prompt-token counters and finished requests; ``None`` when it does
    not answer them."""
    got = probe(url, timeout)
    return got if isinstance(got, dict) else None


def probe(url: str, timeout: float = 10.0) -> dict[str, float] | str:
    """:func:`replica_counters`, or why there are none: ``"no answer: …"`` (down, refused,
    timed out), ``"HTTP 404"``, ``"no hicache counters"``."""
    raw = _fetch(url.rstrip("/") + "/metrics", timeout)
    if isinstance(raw, str):
        return raw
    out: dict[str, float] = {}
    for line in raw.decode("utf-8", "replace").splitlines():
        if not line or line.startswith("#") or " " not in line:
            continue
        key, val = line.rsplit(" ", 1)
        try:
            v = float(val)
        except ValueError:
            continue
        if key in COUNTERS:
            out[COUNTERS[key]] = v
        elif key.startswith("hicache_requests_total"):
            out["requests"] = out.get("requests", 0.0) + v
    return out if "computed_tokens" in out else "no hicache counters"


def snapshot(urls: list[str]) -> dict[str, dict[str, float] | str]:
    """Each replica's counters, or why it has none (:func:`probe`)."""
    return {u: probe(u) for u in urls}


def per_replica(before: dict, after: dict) -> dict[str, Any] | None:
    """What each replica did between two :func:`snapshot`\\ s: requests, prompt tokens,
    computed tokens, hit rate; and the load spread (max / mean computed tokens over the replicas
    that answered). A replica that did not answer both times (killed during the run, not a
    hicache server) is a row ``{"url", "answered": False, "reason"}``. ``None`` when no replica
    answered both times."""
    rows = []
    for u, b in before.items():
        a = after.get(u)
        if not isinstance(a, dict) or not isinstance(b, dict):
            why = b if not isinstance(b, dict) else a
            when = "before the run" if not isinstance(b, dict) else "after the run"
            rows.append({"url": u, "answered": False,
                         "reason": f"{why or 'no answer'} ({when})"})
            continue
        d = {k: a.get(k, 0.0) - b.get(k, 0.0) for k in ("requests", "prompt_tokens",
                                                       "computed_tokens")}
        hit = 1 - d["computed_tokens"] / d["prompt_tokens"] if d["prompt_tokens"] else 0.0
        rows.append({"url": u, "answered": True, "requests": int(d["requests"]),
                     "prompt_tokens": int(d["prompt_tokens"]),
                     "computed_tokens": int(d["computed_tokens"]), "hit_rate": round(hit, 4)})
    done = [r["computed_tokens"] for r in rows if r["answered"]]
    if not done:
        return None
    mean = sum(done) / len(done)
    return {"replicas": rows, "load_spread": round(max(done) / mean, 4) if mean else 1.0}
