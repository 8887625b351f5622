"""Run-time device probing. Nothing here runs at import time."""

from __future__ import annotations

import functools


@functools.lru_cache(maxsize=None)
def cuda_available() -> bool:
    import torch

    try:
        return bool(torch.cuda.is_available())
    except Exception:  # a broken driver is "no GPU", not a crash
        return False


def resolve_device(name: str = "auto") -> str:
    """``auto`` → ``cuda`` when a GPU is usable, else ``cpu``. Validates explicit names."""
    if name == "auto":
        return "cuda" if cuda_available() else "cpu"
    if name == "cpu":
        return "cpu"
    if name.startswith("cuda"):
        if not cuda_available():
            raise ValueError(f"device {name!r} requested but no CUDA device is available")
        return name
    raise ValueError(f"unknown device {name!r}; choose auto, cpu or cuda[:N]")
