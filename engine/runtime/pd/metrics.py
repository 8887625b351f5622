"""The P/D link's part of ``GET /metrics`` (Prometheus text): where prompt KV came from, in
tokens, and the missing-only audit (bytes sent for tokens the decode side already had)."""

from __future__ import annotations

from typing import Any

from engine.runtime.serving.metrics import _Writer


def render_pd(stats: dict[str, Any]) -> str:
    w = _Writer()
    w.scalar("pd_link_up", "gauge", "1 while the prefill worker and the P/D link are usable.",
             int(bool(stats.get("up"))))
    w.scalar("pd_requests_total", "counter", "Requests admitted on the decode worker.",
             stats.get("requests", 0))
    fam = w.family("pd_prompt_tokens_total", "counter",
                   "Prompt tokens by where the decode worker got their KV: its own device, "
                   "host and storage tiers, or transferred from the prefill worker.")
    for part in ("decode_device", "decode_host", "decode_storage", "transferred"):
        w.sample(fam, stats.get(part, 0), {"source": part})
    w.scalar("pd_transfer_bytes_total", "counter", "KV bytes received over the P/D link.",
             stats.get("bytes", 0))
    w.scalar("pd_redundant_bytes_total", "counter",
             "KV bytes received for tokens the decode worker already had (missing-only audit: "
             "0).", stats.get("redundant_bytes", 0))
    w.scalar("pd_failed_transfers_total", "counter",
             "Transfers that failed (prefill worker down, timeout, prefill error).",
             stats.get("failed", 0))
    return w.text()
