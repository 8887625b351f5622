"""The one protocol every L3 backend implements, its status codes, and the backend registry.

All operations are batched and work on raw objects by key (:func:`engine.storage.keys.check_key`
keys). An object is written from, and read into, a list of *parts* — buffers whose
concatenation is the object — so a caller can put a header and a page of pool memory as one
object without joining them, and read them back into the same places (zero-copy where the
backend allows it; Mooncake needs the memory registered with :meth:`register_memory`).

Data-path failures never raise: ``exists`` answers ``False``, ``get`` a negative
:class:`GetStatus`, ``put`` ``False``, and the backend counts them (``health()``). Caller misuse
(unsafe key, mismatched lengths) is a ``ValueError``; a backend that cannot start raises
:class:`engine.core.errors.StorageError` from its constructor.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import threading
import time
from typing import Any, Callable, Protocol, Sequence, runtime_checkable

from engine.storage.config import BackendKind, StorageConfig

Buffer = Any
"""A bytes-like object (bytes, bytearray, memoryview, numpy array); writable for ``get``."""


class GetStatus(enum.IntEnum):
    """What ``get`` answers for a key it could not deliver (a delivered key: its size, >= 0)."""

    MISS = -1           # no such object
    ERROR = -2          # the backend failed (I/O error, store unreachable)
    SIZE_MISMATCH = -3  # an object exists but its size is not the sum of the given parts


@runtime_checkable
class StorageBackend(Protocol):
    kind: BackendKind
    prefers_batches: bool
    """True when one call for many objects is much cheaper than many calls (a network store);
    False when objects are moved one by one anyway (then a caller that also reads each object
    back, e.g. to verify it, does best to go one object at a time, while it is still in cache)."""

    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key names a stored object."""

    def get(self, keys: Sequence[str], parts: Sequence[Sequence[Buffer]]) -> list[int]:
        """Read object ``keys[i]`` into ``parts[i]`` (sizes known up front: the object must be
        exactly ``sum(len(p) for p in parts[i])`` bytes). Per key: the size read, or a
        :class:`GetStatus`. Parts of a key that was not delivered may hold partial data."""

    def put(self, keys: Sequence[str], parts: Sequence[Sequence[Buffer]]) -> list[bool]:
        """Store the concatenation of ``parts[i]`` under ``keys[i]``; ``True`` when stored (or
        already present: objects are content-addressed, an existing key is not rewritten)."""

    def delete(self, keys: Sequence[str]) -> int:
        """Remove objects; returns how many existed."""

    def clear(self) -> int:
        """Remove every object of the store (``/clear_hicache_storage_backend``); returns how
        many were removed (best effort where the store cannot count)."""

    def quarantine(self, key: str) -> None:
        """Take a bad object out of service (kept aside for inspection where possible)."""

    def register_memory(self, buf: Buffer) -> bool:
        """Hint that ``buf`` will be read into / written from repeatedly; ``True`` when the
        backend will now transfer it without a bounce copy. The buffer must outlive the
        backend or be unregistered first."""

    def unregister_memory(self, buf: Buffer) -> None:
        ...

    def health(self) -> dict[str, Any]:
        """``{"backend", "healthy", …counters}``: JSON-ready."""

    def close(self) -> None:
        ...


@dataclasses.dataclass(frozen=True)
class FileRange:
    """A part of an object to ``put`` that lies in an open file: ``length`` bytes of ``fd`` at
    ``offset``. Only the file backend takes it (it copies the range inside the kernel with
    ``copy_file_range``: no pass through user memory); ``convert-layout`` uses it between file
    stores."""

    fd: int
    offset: int
    length: int

    def __len__(self) -> int:
        return self.length


def byte_view(buf: Buffer) -> memoryview:
    """A flat unsigned-byte view of any buffer (no copy)."""
    mv = buf if isinstance(buf, memoryview) else memoryview(buf)
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")


def check_batch(keys: Sequence[str], parts: Sequence[Sequence[Buffer]]) -> None:
    if len(keys) != len(parts):
        raise ValueError(f"{len(keys)} keys but {len(parts)} part lists")


class Backoff:
    """Exponential backoff after failures: ``ready()`` is False until the next retry time."""

    def __init__(self, initial_s: float = 0.05, max_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic):
        self.initial_s, self.max_s, self.clock = initial_s, max_s, clock
        self.failures = 0
        self.next_try = 0.0

    def ready(self) -> bool:
        return self.clock() >= self.next_try

    @property
    def down(self) -> bool:
        return self.failures > 0

    def failure(self) -> float:
        self.failures += 1
        delay = min(self.max_s, self.initial_s * (2 ** min(self.failures - 1, 30)))
        self.next_try = self.clock() + delay
        return delay

    def success(self) -> None:
        self.failures = 0
        self.next_try = 0.0


class Counters:
    """Thread-safe named counters, exported as a dict."""

    def __init__(self, *names: str):
        self._lock = threading.Lock()
        self._c = dict.fromkeys(names, 0)

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._c[name] = self._c.get(name, 0) + n

    def __getitem__(self, name: str) -> int:
        return self._c.get(name, 0)

    def as_dict(self) -> dict[str, int]:
        with self._lock:
            return dict(self._c)


# -- registry ---------------------------------------------------------------------------------
# kind -> "module:Class"; the class has ``from_config(StorageConfig)``. Modules are imported on
# use, so importing engine.storage never loads a backend's native libraries.
_REGISTRY: dict[BackendKind, str] = {
    BackendKind.MEMORY: "engine.storage.backends.memory:MemoryBackend",
    BackendKind.FILE: "engine.storage.backends.file:FileBackend",
    BackendKind.MOONCAKE: "engine.storage.backends.mooncake:MooncakeBackend",
}


def backend_class(kind: "BackendKind | str") -> type:
    mod, _, cls = _REGISTRY[BackendKind.parse(kind)].partition(":")
    return getattr(importlib.import_module(mod), cls)


def make_backend(config: StorageConfig) -> StorageBackend:
    """Construct the configured backend; raises :class:`engine.core.errors.StorageError` when it
    cannot start (the caller then runs with L3 off)."""
    return backend_class(config.backend).from_config(config)
