"""Package names imported on first use (a package ``__init__`` exports them without loading
torch, a backend's native library or the HTTP client until something asks)."""

from __future__ import annotations

import importlib
from typing import Any, Callable


def lazy_exports(package: str, exports: dict[str, str]) -> tuple[Callable[[str], Any], list[str]]:
    """``(__getattr__, __all__)`` for ``package``: ``exports`` maps a name to its module."""

    def __getattr__(name: str) -> Any:
        mod = exports.get(name)
        if mod is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(mod), name)

    return __getattr__, sorted(exports)
