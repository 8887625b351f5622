"""hicache's engine: a hierarchical KV cache (GPU -> host -> external storage) and what runs on it.

Subsystems, each importing only the ones below it (docs/design.md; tests/test_layering.py):

* ``core/``     errors, enum choices, device probing, page hashing, the KV layout value
* ``cache/``    the rank-agnostic cache stack behind :class:`HiCache`
* ``storage/``  L3 backends (memory, file, mooncake) and the page-level :class:`L3Store`
* ``loadgen/``  HTTP load generation (workloads, traces, driver, report)
* ``snapshot/`` radix-tree snapshots and the views ``hicache inspect`` shows
* ``parallel/`` what knows about ranks (consensus, divergence injection, TP/CP/PP)
* ``runtime/``  model, tokenizer, scheduler and the benchmark server
* ``sim/``      offline trace replay behind ``hicache bench replay``

The public names below are imported on first use, so ``import engine`` loads neither torch nor a
storage backend.
"""

from __future__ import annotations

from engine.core.lazy import lazy_exports

_EXPORTS = {
    "HiCache": "engine.cache.facade",
    "CacheConfig": "engine.cache.types",
    "MatchResult": "engine.cache.types",
    "LockReceipt": "engine.cache.types",
    "LoadHandle": "engine.cache.types",
    "WritePolicy": "engine.cache.types",
    "EventLog": "engine.cache.events",
    "RankInfo": "engine.cache.events",
    "KVLayout": "engine.core.layout",
    "HiCacheError": "engine.core.errors",
    "InputError": "engine.core.errors",
    "OutOfCapacity": "engine.core.errors",
    "StorageError": "engine.core.errors",
    "L3Store": "engine.storage.l3store",
}
__getattr__, __all__ = lazy_exports("engine", _EXPORTS)
