"""In-process backend (tests, single-process experiments): a dict of bytes with optional LRU."""

from __future__ import annotations

import collections
import threading
from typing import Any, Sequence

from engine.storage.backend import Buffer, Counters, GetStatus, byte_view, check_batch
from engine.storage.config import BackendKind, MemoryStoreConfig, StorageConfig
from engine.storage.keys import check_key

QUARANTINE_KEEP = 16


class MemoryBackend:
    kind = BackendKind.MEMORY
    prefers_batches = False

    def __init__(self, config: MemoryStoreConfig | None = None):
        self.config = config or MemoryStoreConfig()
        self._objects: "collections.OrderedDict[str, bytes]" = collections.OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.quarantined: "collections.OrderedDict[str, bytes]" = collections.OrderedDict()
        self.counters = Counters("puts", "gets", "evictions", "quarantined")

    @classmethod
    def from_config(cls, config: StorageConfig) -> "MemoryBackend":
        return cls(config.memory)

    def exists(self, keys: Sequence[str]) -> list[bool]:
        with self._lock:
            return [check_key(k) in self._objects for k in keys]

    def get(self, keys: Sequence[str], parts: Sequence[Sequence[Buffer]]) -> list[int]:
        check_batch(keys, parts)
        out: list[int] = []
        for key, ps in zip(keys, parts):
            check_key(key)
            with self._lock:
                data = self._objects.get(key)
                if data is not None:
                    self._objects.move_to_end(key)
            if data is None:
                out.append(GetStatus.MISS)
                continue
            views = [byte_view(p) for p in ps]
            if sum(len(v) for v in views) != len(data):
                out.append(GetStatus.SIZE_MISMATCH)
                continue
            src = memoryview(data)
            off = 0
            for v in views:
                v[:] = src[off:off + len(v)]
                off += len(v)
            out.append(len(data))
        self.counters.add("gets", len(keys))
        return out

    def put(self, keys: Sequence[str], parts: Sequence[Sequence[Buffer]]) -> list[bool]:
        check_batch(keys, parts)
        out: list[bool] = []
        limit = self.config.size_limit_bytes
        for key, ps in zip(keys, parts):
            check_key(key)
            data = b"".join([byte_view(p) for p in ps])   # one copy in, one copy out
            with self._lock:
                if key in self._objects:
                    out.append(True)
                    continue
                if limit and len(data) > limit:
                    out.append(False)
                    continue
                self._objects[key] = data
                self._bytes += len(data)
                while limit and self._bytes > limit:
                    _, old = self._objects.popitem(last=False)
                    self._bytes -= len(old)
                    self.counters.add("evictions")
            out.append(True)
        self.counters.add("puts", len(keys))
        return out

    def demote(self, keys: Sequence[str]) -> int:
        """Make these objects the first to be evicted (a closed session's KV); the number
        found. They stay readable: a read makes an object recent again."""
        n = 0
        with self._lock:
            for k in keys:
                if check_key(k) in self._objects:
                    self._objects.move_to_end(k, last=False)
                    n += 1
        if n:
            self.counters.add("demoted", n)
        return n

    def delete(self, keys: Sequence[str]) -> int:
        n = 0
        with self._lock:
            for k in keys:
                data = self._objects.pop(check_key(k), None)
                if data is not None:
                    self._bytes -= len(data)
                    n += 1
        return n

    def clear(self) -> int:
        with self._lock:
            n = len(self._objects)
            self._objects.clear()
            self._bytes = 0
        return n

    def quarantine(self, key: str) -> None:
        with self._lock:
            data = self._objects.pop(check_key(key), None)
            if data is None:
                return
            self._bytes -= len(data)
            self.quarantined[key] = data
            while len(self.quarantined) > QUARANTINE_KEEP:
                self.quarantined.popitem(last=False)
        self.counters.add("quarantined")

    def register_memory(self, buf: Buffer) -> bool:
        return False

    def unregister_memory(self, buf: Buffer) -> None:
        return None

    def health(self) -> dict[str, Any]:
        with self._lock:
            n, b = len(self._objects), self._bytes
        return {"backend": self.kind.value, "healthy": True, "objects": n, "bytes": b,
                **self.counters.as_dict()}

    def close(self) -> None:
        with self._lock:
            self._objects.clear()
            self._bytes = 0
