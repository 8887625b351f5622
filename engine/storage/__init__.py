"""L3 external storage: one backend protocol (memory, file, mooncake), self-describing page
objects, and :class:`L3Store`, the page-level helper the cache facade calls.

See docs/storage.md. Names are imported on first use, so ``import engine.storage`` loads neither
torch nor any backend's native library (worker processes of the file store start fast).
"""

from __future__ import annotations

from engine.core.lazy import lazy_exports

_EXPORTS = {
    "GetStatus": "engine.storage.backend",
    "StorageBackend": "engine.storage.backend",
    "backend_class": "engine.storage.backend",
    "make_backend": "engine.storage.backend",
    "BackendKind": "engine.storage.config",
    "FileStoreConfig": "engine.storage.config",
    "MemoryStoreConfig": "engine.storage.config",
    "MooncakeStoreConfig": "engine.storage.config",
    "StorageConfig": "engine.storage.config",
    "parse_size": "engine.storage.config",
    "check_key": "engine.storage.keys",
    "coordinate": "engine.storage.keys",
    "model_id": "engine.storage.keys",
    "object_key": "engine.storage.keys",
    "L3Store": "engine.storage.l3store",
}
__getattr__, __all__ = lazy_exports("engine.storage", _EXPORTS)
