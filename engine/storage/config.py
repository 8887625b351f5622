"""Configuration of the L3 store: one small frozen dataclass per backend, one for the choice.

Parseable from a dict or a JSON file (size-limited, no eval)::

    {"backend": "file", "file": {"dir": "/var/cache/hicache", "size_limit": "20GiB"}}
    {"backend": "mooncake", "mooncake": {"master_server_address": "10.0.0.1:50051",
                                         "metadata_server": "http://10.0.0.1:8080/metadata",
                                         "global_segment_size": "4gb"}}

Top-level ``deadline_s`` (default 5; 0 = none) bounds every store call
(:mod:`engine.storage.guard`); ``start_deadline_s`` (default 20) bounds starting the backend.

A Mooncake config file in Mooncake's own format (top-level ``master_server_address``,
``metadata_server``, ``global_segment_size``, …, no ``backend`` key) is accepted as is.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any

from engine.core.choices import Choice
from engine.core.errors import InputError
from formats import boundedjson


class StorageLayout(Choice):
    """How L3 objects are cut and named (engine.storage.placement): ``unified`` (page x layer
    range x kv-head range, shared by every TP/PP shape) or ``legacy`` (one object per rank)."""

    __what__ = "storage layout"

    UNIFIED = "unified"
    LEGACY = "legacy"

MAX_CONFIG_BYTES = 1 << 20


class BackendKind(Choice):
    __what__ = "storage backend"

    MEMORY = "memory"     # in-process, for tests
    FILE = "file"         # a directory, the embedded default
    MOONCAKE = "mooncake"  # a Mooncake Store cluster


_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20,
          "mb": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30,
          "t": 1 << 40, "tb": 1 << 40, "tib": 1 << 40}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*$")


def parse_size(value: "int | str") -> int:
    """``1048576``, ``"512mb"``, ``"1.5GiB"`` → bytes (binary units: 1 KB = 1024 B)."""
    if isinstance(value, bool):
        raise ValueError(f"not a size: {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"size must be >= 0, got {value}")
        return value
    m = _SIZE_RE.match(str(value).lower())
    if not m or m.group(2) not in _UNITS:
        raise ValueError(f"not a size: {value!r} (e.g. 1048576, 512mb, 2GiB)")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


@dataclasses.dataclass(frozen=True)
class MemoryStoreConfig:
    size_limit_bytes: int = 0        # 0: unlimited; else LRU eviction


@dataclasses.dataclass(frozen=True)
class FileStoreConfig:
    dir: str | None = None           # None: a fresh temp dir, removed on close
    size_limit_bytes: int = 0        # 0: unlimited; else LRU eviction across processes
    evict_to: float = 0.9            # evict down to this fraction of the limit
    fsync: bool = False              # fsync each object before it becomes visible

    def __post_init__(self) -> None:
        if not 0.0 < self.evict_to <= 1.0:
            raise ValueError(f"evict_to must be in (0, 1], got {self.evict_to}")


@dataclasses.dataclass(frozen=True)
class MooncakeStoreConfig:
    """A Mooncake Store client (``MooncakeDistributedStore.setup`` arguments and our own)."""

    master_server_address: str = "127.0.0.1:50051"
    metadata_server: str = "http://127.0.0.1:8080/metadata"
    local_hostname: str = "127.0.0.1"
    protocol: str = "tcp"
    device_name: str = ""
    global_segment_size: int = 512 << 20   # memory this client contributes to the store
    local_buffer_size: int = 128 << 20
    replica_num: int = 1
    staging_bytes: int = 64 << 20          # registered bounce buffer for unregistered memory
    connect_timeout_s: float = 2.0         # reachability probe before setup()
    backoff_initial_s: float = 0.05        # after a failure: retry after 0.05, 0.1, 0.2, … s
    backoff_max_s: float = 5.0

    def __post_init__(self) -> None:
        if ":" not in self.master_server_address:
            raise ValueError(f"master_server_address must be host:port, "
                             f"got {self.master_server_address!r}")
        if self.replica_num < 1:
            raise ValueError(f"replica_num must be >= 1, got {self.replica_num}")


_SIZE_FIELDS = {"size_limit_bytes", "global_segment_size", "local_buffer_size", "staging_bytes"}
_ALIASES = {"size_limit": "size_limit_bytes", "master_address": "master_server_address",
            "master": "master_server_address"}


def _sub_config(cls: type, d: Any, where: str):
    if d is None:
        return cls()
    if not isinstance(d, dict):
        raise InputError(f"{where}: expected an object, got {type(d).__name__}")
    names = {f.name for f in dataclasses.fields(cls)}
    kw: dict[str, Any] = {}
    for k, v in d.items():
        k = _ALIASES.get(k, k)
        if k not in names:
            raise InputError(f"{where}: unknown key {k!r}; valid keys: {sorted(names)}")
        if k in _SIZE_FIELDS:
            try:
                v = parse_size(v)
            except ValueError as e:
                raise InputError(f"{where}.{k}: {e}") from None
        kw[k] = v
    try:
        return cls(**kw)
    except (TypeError, ValueError) as e:
        raise InputError(f"{where}: {e}") from None


@dataclasses.dataclass(frozen=True)
class StorageConfig:
    backend: BackendKind = BackendKind.FILE
    file: FileStoreConfig = FileStoreConfig()
    mooncake: MooncakeStoreConfig = MooncakeStoreConfig()
    memory: MemoryStoreConfig = MemoryStoreConfig()
    deadline_s: float = 5.0          # a store call past this is abandoned (store degraded)
    start_deadline_s: float = 20.0   # starting the backend (connect, setup)

    def __post_init__(self) -> None:
        object.__setattr__(self, "backend", BackendKind.parse(self.backend))
        for name in ("deadline_s", "start_deadline_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 86400:
                raise ValueError(f"{name} must be a number of seconds in [0, 86400], got {v!r}")

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "storage config") -> "StorageConfig":
        if not isinstance(d, dict):
            raise InputError(f"{where}: expected a JSON object")
        if "backend" not in d and ("master_server_address" in d or "metadata_server" in d):
            return cls(BackendKind.MOONCAKE, mooncake=_sub_config(MooncakeStoreConfig, d, where))
        unknown = set(d) - {"backend", "file", "mooncake", "memory", "deadline_s",
                            "start_deadline_s"}
        if unknown:
            raise InputError(f"{where}: unknown keys {sorted(unknown)}; valid: backend, file, "
                             "mooncake, memory, deadline_s, start_deadline_s")
        timing = {k: d[k] for k in ("deadline_s", "start_deadline_s") if k in d}
        try:
            kind = BackendKind.parse(d.get("backend", BackendKind.FILE))
        except ValueError as e:
            raise InputError(f"{where}: {e}") from None
        parts = dict(file=_sub_config(FileStoreConfig, d.get("file"), f"{where}: file"),
                     mooncake=_sub_config(MooncakeStoreConfig, d.get("mooncake"),
                                          f"{where}: mooncake"),
                     memory=_sub_config(MemoryStoreConfig, d.get("memory"), f"{where}: memory"))
        try:
            return cls(kind, **parts, **timing)
        except ValueError as e:
            raise InputError(f"{where}: {e}") from None

    @classmethod
    def from_json_file(cls, path: "str | os.PathLike[str]") -> "StorageConfig":
        try:
            with open(path, "rb") as f:
                raw = f.read(MAX_CONFIG_BYTES + 1)
        except OSError as e:
            raise InputError(f"cannot read storage config {path}: {e.strerror}") from None
        if len(raw) > MAX_CONFIG_BYTES:
            raise InputError(f"storage config {path} is larger than {MAX_CONFIG_BYTES} bytes")
        try:
            d = boundedjson.loads(raw)
        except boundedjson.JSONLimitError as e:
            raise InputError(f"storage config {path} is not JSON this tool reads: {e}") from None
        return cls.from_dict(d, where=str(path))

    @classmethod
    def from_options(cls, backend: "str | BackendKind | None" = None, dir: str | None = None,
                     config_file: str | None = None,
                     size_limit: "int | str | None" = None) -> "StorageConfig":
        """What the CLI flags give: a config file (optional) overridden by explicit flags."""
        cfg = cls.from_json_file(config_file) if config_file else cls()
        if backend is not None:
            cfg = dataclasses.replace(cfg, backend=BackendKind.parse(backend))
        if dir is not None or size_limit is not None:
            fc = cfg.file
            if dir is not None:
                fc = dataclasses.replace(fc, dir=dir)
            if size_limit is not None:
                fc = dataclasses.replace(fc, size_limit_bytes=parse_size(size_limit))
            cfg = dataclasses.replace(cfg, file=fc)
        return cfg

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["backend"] = self.backend.value
        return d
