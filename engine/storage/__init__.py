"""L3 external storage: one backend protocol (memory, file, mooncake), self-describing page
objects, and :class:`L3Store`, the page-level helper the cache facade calls.

See docs/storage.md. Names are imported on first use, so ``import engine.storage`` loads neither
torch nor any backend's native library (worker processes of the file store start fast).
"""

from __future__ import annotations

import importlib
from typing import Any

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
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    mod = _EXPORTS.get(name)
    if mod is None:
        raise AttributeError(f"module 'engine.storage' has no attribute {name!r}")
    return getattr(importlib.import_module(mod), name)
