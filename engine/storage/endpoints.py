"""A whole store at rest, addressed by a user: a directory (file store) or a Mooncake cluster.

What ``hicache convert-layout`` needs and the page path does not: list every key, read an object
of unknown size, and — for a source — touch nothing (the file store's reader bumps mtimes for LRU;
a source is read here with plain ``open``/``read`` instead).

* ``DIR``: a file store (``store.json`` marker). As a source it must exist; as a destination it
  is created on the first write (a run refused while planning creates nothing) and written
  through :class:`FileBackend` (atomic renames, shared usage accounting).
* ``mooncake://HOST:PORT[?metadata=URL&admin=PORT&segment=SIZE]``: the master's RPC address; the
  HTTP metadata server (default ``http://HOST:8080/metadata``); the master's HTTP port, which
  lists keys (``/get_all_keys``, default 9003); the memory this client contributes (default 0:
  a converter must not hold the converted objects in memory that goes away when it exits).
"""

from __future__ import annotations

import os
import shutil
import stat
import threading
import urllib.error
import urllib.parse
import urllib.request
from typing import Sequence

from engine.core.errors import InputError, StorageError
from engine.storage.backend import Buffer, GetStatus
from engine.storage.config import FileStoreConfig, MooncakeStoreConfig, parse_size
from engine.storage.keys import check_key

MAX_OBJECT_BYTES = 1 << 30
"""Objects larger than this are not read (a damaged size, or not one of ours)."""
MAX_LISTING_BYTES = 1 << 30


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_OBJ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class FileEndpoint:
    """A file-store directory: read directly, written through :class:`FileBackend`.

    Reading never follows a symbolic link inside the store: ``objects/``, its fan directories
    and the object files are opened with ``O_NOFOLLOW`` (fan directories once, then objects
    relative to them), and the listing skips links — a link planted in a store cannot make a
    conversion read files outside it."""

    def __init__(self, root: str, *, create: bool, must_exist: bool = False):
        self.root = os.path.realpath(os.path.expanduser(root))
        self.label = self.root
        marker = os.path.join(self.root, "store.json")
        if must_exist and not os.path.isfile(marker):
            what = "does not exist" if not os.path.exists(self.root) else \
                "is not a hicache file store (no store.json)"
            raise InputError(f"source store {root} {what}")
        self._objdir = os.path.join(self.root, "objects")
        self._create = create
        self._backend = None      # created on the first write: a refused run creates nothing
        self._fans: dict[str, int] = {}    # fan name -> its directory's descriptor
        self._fans_lock = threading.Lock()
        self._objdir_fd: int | None = None
        if must_exist and os.path.islink(self._objdir):
            raise InputError(f"source store {root}: objects/ is a symbolic link; a store's "
                             "objects are read only from inside it")

    def _objects_fd(self) -> int | None:
        if self._objdir_fd is None:
            try:
                self._objdir_fd = os.open(self._objdir, _DIR_FLAGS)
            except OSError:
                return None
        return self._objdir_fd

    def list_keys(self) -> list[str]:
        out: list[str] = []
        fd = self._objects_fd()
        if fd is None:
            return out
        for fan in sorted(e.name for e in os.scandir(fd) if e.is_dir(follow_symlinks=False)):
            dfd = self._fan_fd(fan)
            if dfd is None:
                continue
            out.extend(e.name for e in os.scandir(dfd) if e.name[:2] == fan
                       and e.is_file(follow_symlinks=False) and _safe(e.name))
        return sorted(out)

    def _fan_fd(self, fan: str) -> int | None:
        """The fan directory's descriptor (opened once, never through a link), or None (not
        remembered: a destination's fan directory appears on its first write)."""
        got = self._fans.get(fan)
        if got is not None:
            return got
        with self._fans_lock:
            if fan not in self._fans:
                top = self._objects_fd()
                if top is None:
                    return None
                try:
                    self._fans[fan] = os.open(fan, _DIR_FLAGS, dir_fd=top)
                except OSError:
                    return None
            return self._fans[fan]

    def _path(self, key: str) -> str:
        check_key(key)
        return os.path.join(self._objdir, key[:2], key)

    def open_fd(self, key: str) -> int | None:
        """A read-only descriptor of the object's file; None when missing, reached through a
        symbolic link, or not a regular file (a FIFO or device planted in the store is never
        opened for reading)."""
        check_key(key)
        dfd = self._fan_fd(key[:2])
        if dfd is None:
            return None
        try:
            fd = os.open(key, _OBJ_FLAGS, dir_fd=dfd)
        except OSError:
            return None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            return None
        return fd

    def read_head(self, key: str, limit: int) -> tuple[bytes, int] | None:
        """(the object's first ``limit`` bytes, its size), or None when it cannot be read."""
        fd = self.open_fd(key)
        if fd is None:
            return None
        try:
            size = os.fstat(fd).st_size
            head = self.read_fd(fd, limit)
            return None if head is None else (head, size)
        finally:
            os.close(fd)

    @staticmethod
    def read_fd(fd: int, limit: int | None = None) -> bytes | None:
        size = os.fstat(fd).st_size
        if size > MAX_OBJECT_BYTES:
            return None
        n = size if limit is None else min(size, limit)
        parts, at = [], 0
        while at < n:
            chunk = os.pread(fd, n - at, at)
            if not chunk:
                break
            parts.append(chunk)
            at += len(chunk)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def read(self, key: str, limit: int | None = None) -> bytes | None:
        """The object (its first ``limit`` bytes), or None when missing / too large / not a
        regular file."""
        fd = self.open_fd(key)
        if fd is None:
            return None
        try:
            return self.read_fd(fd, limit)
        finally:
            os.close(fd)

    def exists(self, keys: Sequence[str]) -> list[bool]:
        return [os.path.exists(self._path(k)) for k in keys]

    def backend(self):
        """The :class:`FileBackend` that writes this destination (created on the first call:
        a refused run creates nothing)."""
        assert self._create, "a source endpoint is never written"
        if self._backend is None:
            from engine.storage.backends.file import FileBackend

            self._backend = FileBackend(FileStoreConfig(dir=self.root))
        return self._backend

    def put(self, keys: Sequence[str], parts: Sequence[Sequence[Buffer]]) -> list[bool]:
        return self.backend().put(keys, parts)

    def free_bytes(self) -> int | None:
        d = self.root
        while not os.path.exists(d):      # a destination not created yet (dry run)
            d = os.path.dirname(d)
        return shutil.disk_usage(d).free

    def same_as(self, other: object) -> bool:
        return isinstance(other, FileEndpoint) and other.root == self.root

    def close(self) -> None:
        if self._backend is not None:
            self._backend.close()
        with self._fans_lock:
            for fd in self._fans.values():
                os.close(fd)
            self._fans.clear()
        if self._objdir_fd is not None:
            os.close(self._objdir_fd)
            self._objdir_fd = None


class MooncakeEndpoint:
    """A Mooncake cluster, through a client of its own (contributing ``segment`` bytes)."""

    def __init__(self, url: str):
        u = urllib.parse.urlsplit(url)
        if u.scheme != "mooncake" or not u.hostname or not u.port:
            raise ValueError(f"bad store address {url!r}: expected a directory or "
                             "mooncake://HOST:PORT[?metadata=URL&admin=PORT&segment=SIZE]")
        q = dict(urllib.parse.parse_qsl(u.query))
        unknown = set(q) - {"metadata", "admin", "segment"}
        if unknown:
            raise ValueError(f"{url}: unknown parameters {sorted(unknown)}; valid: metadata, "
                             "admin, segment")
        self.host = u.hostname
        self.label = f"mooncake://{u.hostname}:{u.port}"
        self.admin = f"http://{u.hostname}:{int(q.get('admin', 9003))}"
        from engine.storage.backends.mooncake import MooncakeBackend

        cfg = MooncakeStoreConfig(master_server_address=f"{u.hostname}:{u.port}",
                                  metadata_server=q.get("metadata",
                                                        f"http://{u.hostname}:8080/metadata"),
                                  local_hostname="127.0.0.1" if u.hostname in (
                                      "127.0.0.1", "localhost") else u.hostname,
                                  global_segment_size=parse_size(q.get("segment", 0)),
                                  local_buffer_size=16 << 20, staging_bytes=16 << 20)
        self._backend = MooncakeBackend(cfg)     # StorageError when unreachable

    def list_keys(self) -> list[str]:
        try:
            with urllib.request.urlopen(self.admin + "/get_all_keys", timeout=30) as r:
                raw = r.read(MAX_LISTING_BYTES + 1)
        except (urllib.error.URLError, OSError) as e:
            raise StorageError(f"{self.label}: cannot list keys at {self.admin}/get_all_keys "
                               f"({getattr(e, 'reason', e)}); give the master's HTTP port "
                               "as ?admin=PORT") from None
        if len(raw) > MAX_LISTING_BYTES:
            raise StorageError(f"{self.label}: key listing larger than {MAX_LISTING_BYTES} bytes")
        return sorted(k for k in raw.decode("utf-8", "replace").split() if _safe(k))

    def read(self, key: str, limit: int | None = None) -> bytes | None:
        size = self._backend.client.get_size(check_key(key))
        if size < 0 or size > MAX_OBJECT_BYTES:
            return None
        buf = bytearray(size)
        r = self._backend.get([key], [[buf]])[0]
        if r == GetStatus.ERROR:
            raise StorageError(f"{self.label}: reading {key} failed")
        if r < 0:
            return None
        return bytes(buf if limit is None else buf[:limit])

    def read_head(self, key: str, limit: int) -> tuple[bytes, int] | None:
        """(the object's first ``limit`` bytes, its size), or None when it cannot be read."""
        raw = self.read(key)
        return None if raw is None else (raw[:limit], len(raw))

    def exists(self, keys: Sequence[str]) -> list[bool]:
        return self._backend.exists(keys)

    def put(self, keys: Sequence[str], parts: Sequence[Sequence[Buffer]]) -> list[bool]:
        return self._backend.put(keys, parts)

    def free_bytes(self) -> int | None:
        return None

    def same_as(self, other: object) -> bool:
        return isinstance(other, MooncakeEndpoint) and other.label == self.label

    def close(self) -> None:
        self._backend.close()


Endpoint = FileEndpoint | MooncakeEndpoint


def _safe(key: str) -> bool:
    try:
        check_key(key)
        return True
    except ValueError:
        return False


def nested_stores(src: str, dst: str) -> str | None:
    """Why directories ``src`` and ``dst`` cannot be converted one into the other (one inside
    the other, by their real paths: links resolved), or None."""
    if "://" in src or "://" in dst:
        return None
    a, b = (os.path.realpath(os.path.expanduser(x)) for x in (src, dst))
    if a == b:
        return None                 # the same store: said by same_store
    if b.startswith(a.rstrip(os.sep) + os.sep):
        return f"the destination {dst} is inside the source store {src} ({b})"
    if a.startswith(b.rstrip(os.sep) + os.sep):
        return f"the source store {src} is inside the destination {dst} ({a})"
    return None


def same_store(a: str, b: str) -> bool:
    """Whether two store specs name the same store (checked before either is opened)."""
    if "://" in a or "://" in b:
        return a.split("?")[0].rstrip("/") == b.split("?")[0].rstrip("/")
    return os.path.realpath(os.path.expanduser(a)) == os.path.realpath(os.path.expanduser(b))


def open_endpoint(spec: str, *, source: bool, dry_run: bool = False) -> Endpoint:
    """``DIR`` or ``mooncake://…`` (see the module docstring). A source must exist; a
    destination directory is created on the first write (never with ``dry_run``)."""
    if "://" in spec:
        return MooncakeEndpoint(spec)
    if not source and os.path.exists(spec) and not os.path.isdir(spec):
        raise InputError(f"destination {spec} exists and is not a directory")
    if not source and os.path.isdir(spec) and os.listdir(spec) and \
            not os.path.isfile(os.path.join(spec, "store.json")):
        raise InputError(f"destination {spec} is a non-empty directory that is not a hicache "
                         "file store; refusing to write into it")
    return FileEndpoint(spec, create=not (source or dry_run), must_exist=source)

