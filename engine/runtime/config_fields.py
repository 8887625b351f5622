"""Which concern each :class:`~engine.runtime.config.ServerConfig` field belongs to, and the
choices of the server's enum options — light (no torch): the CLI builds ``bench serve``'s help
panels from it at start-up, before anything heavy is imported."""

from __future__ import annotations

import enum

from engine.core.choices import Choice

# Every field of ServerConfig under the concern it belongs to: ``bench serve --help`` shows one
# panel per group; tests/test_config_groups.py holds the table complete.
GROUPS: dict[str, tuple[str, ...]] = {
    "server": ("host", "port", "device", "model", "seed", "exact", "gemm_dtype", "threads", "record_events",
               "tokenizer_dir", "served_model_name", "weight_version", "context_length",
               "max_running_requests", "max_sessions", "hint_trust", "chunked_prefill_size",
               "flush_cache_scope",
               "hicache_model_fingerprint", "rank_log_dir", "inject_divergence",
               "snapshot_dir"),
    "cache": ("page_size", "l1_tokens", "l2_tokens", "hicache_ratio", "hicache_size_gb",
              "write_policy", "write_through_threshold", "host_layout", "eviction_policy",
              "disable_radix_cache", "disable_partial_page_reuse"),
    "storage": ("hicache_storage_backend", "hicache_storage_dir",
                "hicache_storage_backend_config", "hicache_storage_size_limit",
                "hicache_storage_prefetch_policy", "hicache_storage_prefetch_timeout",
                "hicache_storage_layout", "hicache_storage_grid"),
    "speculative": ("speculative_num_draft_tokens", "speculative_draft_preset",
                    "hicache_draft_layout", "debug_skip_draft_restore"),
    "pd": ("disaggregation", "pd_addr", "pd_decode_reuse", "pd_transfer_timeout",
           "pd_inject_fault", "pd_link_timeout"),
    "parallel": ("pp", "tp", "cp", "nnodes", "node_rank", "dist_init_addr", "pp_sync",
                 "pp_micro_batches", "debug_transfer_delay", "collective_timeout_s",
                 "rank_heartbeat_timeout_s", "consensus_check", "consensus_every",
                 "debug_diverge"),
}
GROUP_TITLES = {"server": "Server and model", "cache": "Cache (L1 device, L2 host)",
                "storage": "Storage (L3)", "speculative": "Speculative decoding",
                "pd": "Prefill-decode disaggregation", "parallel": "Parallelism (TP, CP, PP, nodes)"}
FIELD_GROUP = {f: g for g, names in GROUPS.items() for f in names}


class Disaggregation(str, enum.Enum):
    """``--disaggregation``'s roles (docs/pd.md)."""

    pd = "pd"
    prefill = "prefill"
    decode = "decode"


class DraftLayout(Choice):
    """Where a speculative draft's KV lives: ``packed`` (extra layers of the target's pools)
    or ``sidecar`` (pools of its own, the same page ids)."""

    PACKED = "packed"
    SIDECAR = "sidecar"
