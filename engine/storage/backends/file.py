"""The embedded default L3 backend: one file per object under a directory.

Layout of the store directory::

    store.json                 marker: {"format": "hicache-file-store", "version": 1}
    lock                       flock'd by every writer; holds the usage counters (bytes, objects)
    objects/ab/<key>           fan-out by the key's first 2 characters (256 directories)
    tmp/                       objects being written (same filesystem, so links and renames are
                               atomic)
    quarantine/<key>.<ns>      corrupt objects taken out of service (the newest few are kept)

* **Atomic writes.** An object is written to an unnamed file (``O_TMPFILE`` in ``tmp/``) and
  linked into place whole (``linkat`` of the descriptor itself where the kernel allows it to this
  process, else of ``/proc/self/fd/N``), so a reader never sees a partial object and a crash
  leaves nothing behind. Where the filesystem or ``/proc`` does not allow that, it is written to
  a named temp file in ``tmp/`` and renamed into place (a crash leaves only that temp file,
  which the next eviction pass removes).
* **Several processes at once.** Renames and usage accounting happen under an exclusive
  ``flock`` on ``lock``; the usage counters live in that file, so every process sees the same
  total.
* **LRU across processes.** An object's mtime is its last use: set by the write, bumped on every
  read hit (nanosecond clock). When the total passes ``size_limit_bytes`` the writer that noticed
  it rescans the directory under the lock and deletes the least recently used objects until the
  total is at most ``evict_to × size_limit_bytes``; the rescan also corrects drift from files
  removed by hand.
* **Only regular files are read.** An object path is ``lstat``-ed before it is opened and only a
  regular file is opened (``O_NOFOLLOW | O_NONBLOCK``, checked again with ``fstat``): a FIFO,
  device, socket or symlink put in the store is a bad object (quarantined), never an ``open``
  that blocks. The marker and the lock file are checked the same way.
* **No escape.** Keys pass :func:`engine.storage.keys.check_key` (no separators, no dots first),
  so every path is ``<root>/objects/xx/<key>``.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import itertools
import json
import logging
import os
import shutil
import struct
import tempfile
import threading
import time
from typing import Any, Iterator, NamedTuple, Sequence

from engine.core.errors import StorageError
from engine.storage.backend import (
    Buffer,
    Counters,
    FileRange,
    GetStatus,
    byte_view,
    check_batch,
)
from engine.storage.backends.fileio import (  # noqa: F401 (WRITE_CHUNK, NotRegular: re-exported)
    WRITE_CHUNK,
    NotRegular,
    _copy_range,
    _fd_linker,
    _preadv_all,
    _proc_link,
    _writev_all,
    open_regular,
)
from engine.storage.config import BackendKind, FileStoreConfig, StorageConfig
from engine.storage.keys import check_key

log = logging.getLogger("hicache.storage")

STORE_FORMAT = "hicache-file-store"
STORE_VERSION = 1
QUARANTINE_KEEP = 16
STALE_TMP_S = 15 * 60
DEMOTED_NS = 1                     # the mtime of a demoted object: older than any real use
WARN_EVERY_S = 10.0
_USAGE = struct.Struct("<8sQQ")
_USAGE_MAGIC = b"HCUSAGE1"
_seq = itertools.count()


class Staged(NamedTuple):
    """An object written by :meth:`FileBackend.stage`, not yet visible: an unnamed file open
    as ``fd`` (``tmp`` None), or a named temp file ``tmp`` (``fd`` -1)."""

    tmp: str | None
    path: str
    size: int
    fd: int = -1


STAGE_BATCH = 64
"""Objects staged before they are published, at most (:meth:`FileBackend.put`)."""

def _discard(st: Staged) -> None:
    """Drop a staged object that will not be published."""
    with contextlib.suppress(OSError):
        if st.tmp is None:
            os.close(st.fd)
        else:
            os.unlink(st.tmp)


class FileBackend:
    kind = BackendKind.FILE
    prefers_batches = False

    def __init__(self, config: FileStoreConfig | None = None):
        self.config = config or FileStoreConfig()
        self._owned = self.config.dir is None
        try:
            if self._owned:
                self.root = tempfile.mkdtemp(prefix="hicache-l3-")
            else:
                self.root = os.path.realpath(os.path.expanduser(self.config.dir))
                os.makedirs(self.root, exist_ok=True)
            self._objdir = os.path.join(self.root, "objects")
            self._tmpdir = os.path.join(self.root, "tmp")
            self._qdir = os.path.join(self.root, "quarantine")
            for d in (self._objdir, self._tmpdir, self._qdir):
                os.makedirs(d, exist_ok=True)
            self._check_marker()
            self._lock_fd = open_regular(os.path.join(self.root, "lock"),
                                         os.O_RDWR | os.O_CREAT)
        except OSError as e:
            raise StorageError(f"file store {self.config.dir or 'in a temp dir'} cannot be "
                               f"used: {e.strerror or e}") from None
        self._tlock = threading.Lock()
        self._dirs: set[str] = set()
        self._link = _proc_link
        self._objfd = self._unnamed_files()
        self._sink = memoryview(bytearray(1))   # the byte past an object's end (never used)
        self._closed = False
        self._warned: dict[int, tuple[float, int]] = {}   # errno -> (last warning, since)
        self.counters = Counters("puts", "put_skipped", "gets", "hits", "misses", "evictions",
                                 "errors", "quarantined")
        with self._locked():
            if self._read_usage() is None:
                self._write_usage(*self._scan_and_evict(None))
            else:
                self._clean_tmp()

    @classmethod
    def from_config(cls, config: StorageConfig) -> "FileBackend":
        return cls(config.file)

    def _unnamed_files(self) -> int | None:
        """A descriptor of ``objects/`` when objects can be written as unnamed files and
        linked into place (``O_TMPFILE``, then ``linkat``: tried once here, which also picks
        :attr:`_link`), else None."""
        if not hasattr(os, "O_TMPFILE"):
            return None
        try:
            dfd = os.open(self._tmpdir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                self._link = self._probe_link(dfd)
            finally:
                os.close(dfd)
            return os.open(self._objdir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:     # not supported by this filesystem or kernel, or no /proc
            return None

    def _probe_link(self, dfd: int):
        """The first way of linking an unnamed file in ``tmp/`` that works here (a linked
        probe is removed again); OSError when none does."""
        last: OSError | None = None
        for link in (_fd_linker(), _proc_link):
            if link is None:
                continue
            name = f"probe.{os.getpid()}.{next(_seq)}.tmp"
            fd = os.open(self._tmpdir, os.O_WRONLY | os.O_TMPFILE | os.O_CLOEXEC, 0o644)
            try:
                link(fd, dfd, name)
            except OSError as e:
                last = e
                continue
            finally:
                os.close(fd)
            os.unlink(name, dir_fd=dfd)
            return link
        raise last or OSError(errno.ENOTSUP, "no way to link an unnamed file")

    # -- setup helpers -----------------------------------------------------------------------
    def _check_marker(self) -> None:
        path = os.path.join(self.root, "store.json")
        try:
            with os.fdopen(open_regular(path), "rb") as f:
                raw = f.read(4097)
        except NotRegular:
            raise StorageError(f"{path} is not a regular file; refusing to use this "
                               "directory") from None
        except FileNotFoundError:
            tmp = os.path.join(self._tmpdir, f"store.json.{os.getpid()}.{next(_seq)}")
            with open(tmp, "w") as f:
                json.dump({"format": STORE_FORMAT, "version": STORE_VERSION}, f)
            os.replace(tmp, path)
            return
        try:
            marker = json.loads(raw)
            ok = (marker.get("format") == STORE_FORMAT
                  and marker.get("version") == STORE_VERSION)
        except (ValueError, AttributeError):
            ok = False
        if not ok:
            raise StorageError(f"{path} is not a {STORE_FORMAT} v{STORE_VERSION} marker; "
                               "refusing to use this directory")

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with self._tlock:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    def _read_usage(self) -> tuple[int, int] | None:
        raw = os.pread(self._lock_fd, _USAGE.size, 0)
        if len(raw) != _USAGE.size:
            return None
        magic, used, n = _USAGE.unpack(raw)
        return (used, n) if magic == _USAGE_MAGIC else None

    def _write_usage(self, used: int, n: int) -> None:
        os.pwrite(self._lock_fd, _USAGE.pack(_USAGE_MAGIC, max(used, 0), max(n, 0)), 0)

    def object_path(self, key: str) -> str:
        """Where ``key`` lives (whether or not it exists)."""
        check_key(key)
        return f"{self._objdir}/{key[:2]}/{key}"

    # -- eviction ----------------------------------------------------------------------------
    def _scan_and_evict(self, target: int | None) -> tuple[int, int]:
        """Under the lock: total the objects, delete LRU ones down to ``target`` bytes."""
        entries: list[tuple[int, str, int]] = []
        total = 0
        for d in os.scandir(self._objdir):
            if not d.is_dir(follow_symlinks=False):
                continue
            for f in os.scandir(d.path):
                try:
                    st = f.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                entries.append((st.st_mtime_ns, f.path, st.st_size))
                total += st.st_size
        n = len(entries)
        if target is not None and total > target:
            entries.sort()
            for _, path, size in entries:
                if total <= target:
                    break
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                    self.counters.add("evictions")
                total -= size
                n -= 1
        self._clean_tmp()
        return total, n

    def _clean_tmp(self) -> None:
        cutoff = time.time() - STALE_TMP_S
        for f in os.scandir(self._tmpdir):
            with contextlib.suppress(OSError):
                if f.stat(follow_symlinks=False).st_mtime < cutoff:
                    os.unlink(f.path)

    # -- protocol ----------------------------------------------------------------------------
    def exists(self, keys: Sequence[str]) -> list[bool]:
        return [os.path.exists(self.object_path(k)) for k in keys]

    def get(self, keys: Sequence[str], parts: Sequence[Sequence[Buffer]]) -> list[int]:
        check_batch(keys, parts)
        out: list[int] = []
        for key, ps in zip(keys, parts):
            out.append(self._get_one(self.object_path(key), [byte_view(p) for p in ps]))
        self.counters.add("gets", len(keys))
        hits = sum(1 for r in out if r >= 0)
        if hits:
            self.counters.add("hits", hits)
        return out

    def _get_one(self, path: str, views: list[memoryview]) -> int:
        """One lstat, one open, one ``preadv`` straight into the caller's parts, one
        ``futimens``. A path that is not a regular file is a bad object (never opened)."""
        try:
            fd = open_regular(path)
        except FileNotFoundError:
            self.counters.add("misses")
            return GetStatus.MISS
        except (NotRegular, OSError) as e:
            if isinstance(e, NotRegular) or e.errno == errno.ELOOP:   # a symlink (O_NOFOLLOW)
                log.warning("file store: %s is not a regular file: a bad object", path)
                return GetStatus.SIZE_MISMATCH
            self._error("open", path, e)
            return GetStatus.ERROR
        try:
            size = sum(len(v) for v in views)
            # Ask for one byte past the end: a longer object fills it, without an fstat. A
            # regular file reads in full up to its end, so one call is the common case.
            views.append(self._sink)
            n = os.preadv(fd, views, 0)
            if n != size:
                if n > size or n == 0 or _preadv_all(fd, views) != size:
                    return GetStatus.SIZE_MISMATCH
            now = time.time_ns()
            try:
                os.utime(fd, ns=(now, now))    # LRU: last use (whichever process set the limit)
            except OSError:
                pass
            return size
        except OSError as e:
            self._error("read", path, e)
            return GetStatus.ERROR
        finally:
            os.close(fd)

    def put(self, keys: Sequence[str], parts: Sequence[Sequence[Buffer]]) -> list[bool]:
        """Stage the objects, then publish them under one lock, :data:`STAGE_BATCH` at a time
        (each staged object holds an open file until it is published)."""
        check_batch(keys, parts)
        out: list[bool] = []
        for at in range(0, len(keys), STAGE_BATCH):
            out += self.publish([self.stage(k, ps) for k, ps in
                                 zip(keys[at:at + STAGE_BATCH], parts[at:at + STAGE_BATCH])])
        return out

    def stage(self, key: str, parts: Sequence[Buffer]) -> Staged | None:
        """Write one object to an unnamed (or temp) file: not visible yet, :meth:`publish`
        makes it so and closes it. None when it cannot be written (counted; nothing is left).
        Safe to call from several threads at once: creating and writing files runs without
        the GIL."""
        path = self.object_path(key)
        if len(parts) == 1 and not isinstance(parts[0], FileRange):
            views = [byte_view(parts[0])]       # the common case: one buffer
            size = len(views[0])
        else:
            views = [p if isinstance(p, FileRange) else byte_view(p) for p in parts]
            size = sum(len(v) for v in views)
        limit = self.config.size_limit_bytes
        if limit and size > limit:
            return None
        tmp = None if self._objfd is not None else \
            os.path.join(self._tmpdir, f"{key}.{os.getpid()}.{next(_seq)}.tmp")
        fd = -1
        try:
            parent = os.path.dirname(path)
            if parent not in self._dirs:
                os.makedirs(parent, exist_ok=True)
                self._dirs.add(parent)
            if tmp is None:
                fd = os.open(self._tmpdir, os.O_WRONLY | os.O_TMPFILE | os.O_CLOEXEC, 0o644)
                self._write_fd(fd, views)
                return Staged(None, path, size, fd)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            try:
                self._write_fd(fd, views)
            finally:
                os.close(fd)
            return Staged(tmp, path, size)
        except OSError as e:
            if tmp is None and fd >= 0:
                os.close(fd)
            elif tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
            self._error("write", path, e)
            return None

    def publish(self, staged: Sequence[Staged | None]) -> list[bool]:
        """Link (or rename) staged objects into place under one lock (an object already there
        is kept: content-addressed); per object, whether it is stored now. None entries answer
        False."""
        out = [False] * len(staged)
        todo = [(i, s) for i, s in enumerate(staged) if s is not None]
        if todo:
            self._publish(todo, out)
        return out

    def _write_fd(self, fd: int, views: list) -> None:
        if len(views) == 1 and 0 < len(views[0]) <= WRITE_CHUNK and \
                not isinstance(views[0], FileRange):
            n = os.write(fd, views[0])
            if n != len(views[0]):          # a short write: the rest, in a loop
                _writev_all(fd, [views[0][n:]])
            if self.config.fsync:
                os.fsync(fd)
            return
        run: list[memoryview] = []
        for v in views:
            if isinstance(v, FileRange):     # memory parts before it first, in order
                _writev_all(fd, run)
                run = []
                _copy_range(v, fd)
            else:
                run.append(v)
        _writev_all(fd, run)
        if self.config.fsync:
            os.fsync(fd)

    def _place(self, st: Staged) -> bool:
        """Make a staged object visible under its key; False when an object is there already
        (content-addressed: the old one is kept). Closes or removes what was staged."""
        if st.tmp is None:
            try:
                self._link(st.fd, self._objfd, st.path[len(self._objdir) + 1:])
                return True
            except FileExistsError:
                return False
            finally:
                os.close(st.fd)
        try:
            if not os.path.exists(st.path):
                os.replace(st.tmp, st.path)
                return True
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(st.tmp)
            raise
        os.unlink(st.tmp)
        return False

    def _publish(self, staged: list[tuple[int, Staged]], out: list[bool]) -> None:
        """Under the lock: link or rename staged objects into place (unless present), account,
        evict."""
        limit = self.config.size_limit_bytes
        done = puts = 0
        try:
            with self._locked():
                used, n = self._read_usage() or (0, 0)
                for i, st in staged:
                    done += 1
                    try:
                        if self._place(st):
                            used, n, puts = used + st.size, n + 1, puts + 1
                        else:
                            self.counters.add("put_skipped")
                        out[i] = True
                    except OSError as e:
                        self._error("publish", st.path, e)
                if limit and used > limit:
                    used, n = self._scan_and_evict(int(limit * self.config.evict_to))
                self._write_usage(used, n)
        except OSError as e:
            self._error("lock", os.path.join(self.root, "lock"), e)
            for _, st in staged[done:]:
                _discard(st)
        finally:
            if puts:
                self.counters.add("puts", puts)

    def demote(self, keys: Sequence[str]) -> int:
        """Make these objects the first to be evicted (a closed session's KV): their mtime,
        the LRU clock, goes to :data:`DEMOTED_NS`. The number found; a read makes an object
        recent again, whichever process reads it."""
        n = 0
        for k in keys:
            try:
                os.utime(self.object_path(k), ns=(DEMOTED_NS, DEMOTED_NS),
                         follow_symlinks=False)
            except FileNotFoundError:
                continue
            except OSError as e:
                self._error("demote", self.object_path(k), e)
                continue
            n += 1
        if n:
            self.counters.add("demoted", n)
        return n

    def delete(self, keys: Sequence[str]) -> int:
        paths = [self.object_path(k) for k in keys]
        removed = 0
        with self._locked():
            used, n = self._read_usage() or (0, 0)
            for p in paths:
                try:
                    size = os.lstat(p).st_size
                    os.unlink(p)
                except FileNotFoundError:
                    continue
                used, n, removed = used - size, n - 1, removed + 1
            self._write_usage(used, n)
        return removed

    def clear(self) -> int:
        with self._locked():
            _, before = self._read_usage() or (0, 0)
            used, n = self._scan_and_evict(0)
            self._write_usage(used, n)
        return max(before - n, 0)

    def quarantine(self, key: str) -> None:
        path = self.object_path(key)
        dest = os.path.join(self._qdir, f"{key}.{time.time_ns()}")
        with self._locked():
            try:
                size = os.lstat(path).st_size
                os.replace(path, dest)
            except FileNotFoundError:
                return
            except OSError as e:
                self._error("quarantine", path, e)
                return
            used, n = self._read_usage() or (0, 0)
            self._write_usage(used - size, n - 1)
            kept = sorted(os.scandir(self._qdir), key=lambda f: f.name.rsplit(".", 1)[-1])
            for f in kept[:-QUARANTINE_KEEP]:
                with contextlib.suppress(OSError):
                    os.unlink(f.path)
        self.counters.add("quarantined")
        log.warning("quarantined corrupt object %s to %s", key, dest)

    def quarantined(self) -> list[str]:
        return sorted(os.listdir(self._qdir))

    def register_memory(self, buf: Buffer) -> bool:
        return False

    def unregister_memory(self, buf: Buffer) -> None:
        return None

    def usage(self) -> tuple[int, int]:
        """(bytes, objects) as the shared counters say."""
        with self._locked():
            return self._read_usage() or (0, 0)

    def health(self) -> dict[str, Any]:
        healthy = not self._closed and os.access(self._objdir, os.W_OK)
        used, n = self.usage() if not self._closed else (0, 0)
        return {"backend": self.kind.value, "healthy": healthy, "dir": self.root,
                "bytes": used, "objects": n, "size_limit_bytes": self.config.size_limit_bytes,
                **self.counters.as_dict()}

    def _error(self, what: str, path: str, e: OSError) -> None:
        """Count an I/O failure. A full disk, an I/O error or a read-only filesystem is a
        warning — at most one per kind every ``WARN_EVERY_S`` (a full disk fails every write:
        one line says so, with how many more there were), the rest at debug level."""
        self.counters.add("errors")
        if e.errno not in (errno.ENOSPC, errno.EIO, errno.EROFS):
            log.info("file store: %s %s failed: %s", what, path, e)
            return
        now = time.monotonic()
        last, quiet = self._warned.get(e.errno, (-WARN_EVERY_S, 0))
        if now - last < WARN_EVERY_S:
            self._warned[e.errno] = (last, quiet + 1)
            log.debug("file store: %s %s failed: %s", what, path, e)
            return
        self._warned[e.errno] = (now, 0)
        more = f" (and {quiet} more like it since the last warning)" if quiet else ""
        log.warning("file store: %s %s failed: %s%s", what, path, e, more)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        os.close(self._lock_fd)
        if self._objfd is not None:
            os.close(self._objfd)
        if self._owned:
            shutil.rmtree(self.root, ignore_errors=True)
