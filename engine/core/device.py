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


def available_memory(device: str = "cpu") -> int:
    """Bytes that could be allocated now on ``device``: free CUDA memory, or the host's
    ``MemAvailable`` (what the kernel could hand out without swapping)."""
    if device.startswith("cuda"):
        import torch

        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return int(free)
    try:
        with open("/proc/meminfo", "rb") as f:
            for line in f:
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    import os

    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def bytes_text(n: float) -> str:
    """``1.5 GiB``-style size for messages."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} PiB"   # pragma: no cover


RANK_PROCESS_BYTES = 400 << 20   # one rank process (interpreter, torch, gloo): measured ~300 MiB
RANKS_PER_CPU = 4
MAX_LOCAL_RANKS = 256


def max_local_ranks() -> tuple[int, str]:
    """How many rank processes this machine can run at once, and why that many."""
    import os

    cpus = os.cpu_count() or 1
    mem = available_memory("cpu")
    n = max(1, min(MAX_LOCAL_RANKS, RANKS_PER_CPU * cpus, mem // RANK_PROCESS_BYTES))
    why = (f"{cpus} CPUs, {bytes_text(mem)} of memory available, about "
           f"{bytes_text(RANK_PROCESS_BYTES)} per rank process")
    return int(n), why
