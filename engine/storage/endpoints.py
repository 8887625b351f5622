"""A whole store at rest, addressed by a user: a directory (file store) or a Mooncake cluster.

What ``hicache convert-layout`` needs and the page path does not: list every key, read an object
of unknown size, and — for a source — touch nothing (the file store's reader bumps mtimes for LRU;
a source is read here with plain ``open``/``read`` instead).

* ``DIR``: a file store (``store.json`` marker). As a source it must exist; as a destination it
  is created on the first write (a run refused while planning creates nothing) and written
  through :class:`FileBackend` (atomic renames, shared usage accounting).
* ``mooncake://HOST:PORT[?metadata=URL&admin=PORT&segment=SIZE&timeout=SECONDS]``: the master's
  RPC address; the HTTP metadata server (default ``http://HOST:8080/metadata``; http or https
  only); the master's HTTP port, which lists keys (``/get_all_keys``, default 9003); the memory
  this client contributes (default 0: a converter must not hold the converted objects in memory
  that goes away when it exits); how long to wait for the client to start and for the whole
  key listing (default :data:`DEFAULT_TIMEOUT_S`).
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import shutil
import socket
import stat
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Iterator, Sequence

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


DEFAULT_TIMEOUT_S = 15.0
"""How long a Mooncake endpoint waits for its master and metadata server to take the client
(``setup``), and for the whole key listing (``?timeout=SECONDS`` overrides)."""
MAX_TIMEOUT_S = 3600.0


class MooncakeEndpoint:
    """A Mooncake cluster, through a client of its own (contributing ``segment`` bytes).

    Nothing it waits for is unbounded: the client's start (``setup``, which retries a master
    that accepts connections but never answers) runs under a deadline, and so does the key
    listing as a whole (not per read: a listing that dribbles in fails too). The native
    library's log lines (a dozen or more per run) are kept off stderr unless ``verbose``."""

    def __init__(self, url: str, *, verbose: bool = False):
        u = urllib.parse.urlsplit(url)
        try:
            port = u.port
        except ValueError:
            port = None
        if u.scheme != "mooncake" or not u.hostname or not port:
            raise ValueError(f"bad store address {url!r}: expected a directory or "
                             "mooncake://HOST:PORT[?metadata=URL&admin=PORT&segment=SIZE"
                             "&timeout=SECONDS]")
        q = dict(urllib.parse.parse_qsl(u.query))
        unknown = set(q) - {"metadata", "admin", "segment", "timeout"}
        if unknown:
            raise ValueError(f"{url}: unknown parameters {sorted(unknown)}; valid: metadata, "
                             "admin, segment, timeout")
        self.host, self.port = u.hostname, port
        self.label = f"mooncake://{u.hostname}:{port}"
        self.timeout = _seconds(q.get("timeout", DEFAULT_TIMEOUT_S), url)
        self.quiet = not verbose
        admin = q.get("admin", "9003")
        if not admin.isdigit() or not 0 < int(admin) < 65536:
            raise ValueError(f"{url}: admin must be a port number, got {admin!r}")
        self.admin = f"http://{_url_host(u.hostname)}:{int(admin)}"
        metadata = q.get("metadata", f"http://{_url_host(u.hostname)}:8080/metadata")
        m = urllib.parse.urlsplit(metadata)
        if m.scheme not in ("http", "https") or not m.hostname:
            # the native client aborts the process on a metadata URL it cannot use
            raise ValueError(f"{url}: metadata must be the http:// or https:// URL of the "
                             f"metadata server, got {metadata!r}")
        cfg = MooncakeStoreConfig(master_server_address=f"{_url_host(u.hostname)}:{port}",
                                  metadata_server=metadata,
                                  local_hostname="127.0.0.1" if u.hostname in (
                                      "127.0.0.1", "localhost") else u.hostname,
                                  global_segment_size=parse_size(q.get("segment", 0)),
                                  local_buffer_size=16 << 20, staging_bytes=16 << 20,
                                  connect_timeout_s=min(self.timeout, 5.0))
        self._backend = self._start(cfg)

    def _start(self, cfg: MooncakeStoreConfig):
        """The backend, once the master and the metadata server have shown they answer within
        :attr:`timeout` (the native ``setup`` holds the interpreter while it waits, so it
        cannot be timed out from here: a silent server is found before it is called)."""
        from engine.storage.backends.mooncake import MooncakeBackend

        _answers_rpc(cfg.master_server_address, self.timeout, self.label)
        _answers_http(cfg.metadata_server, self.timeout, self.label)
        with native_quiet(self.quiet):
            return MooncakeBackend(cfg)     # StorageError when unreachable or refused

    def list_keys(self) -> list[str]:
        where = f"{self.admin}/get_all_keys"
        deadline = time.monotonic() + self.timeout
        parts, n = [], 0
        try:
            with urllib.request.urlopen(where, timeout=self.timeout) as r:
                while True:
                    if time.monotonic() > deadline:
                        raise StorageError(f"{self.label}: the key listing at {where} did not "
                                           f"arrive within {self.timeout:g} s (?timeout="
                                           "SECONDS to wait longer)")
                    chunk = r.read1(1 << 20)
                    if not chunk:
                        break
                    parts.append(chunk)
                    n += len(chunk)
                    if n > MAX_LISTING_BYTES:
                        raise StorageError(f"{self.label}: key listing larger than "
                                           f"{MAX_LISTING_BYTES} bytes")
        except (urllib.error.URLError, OSError, ValueError) as e:
            raise StorageError(f"{self.label}: cannot list keys at {where} "
                               f"({getattr(e, 'reason', e)}); give the master's HTTP port "
                               "as ?admin=PORT") from None
        raw = b"".join(parts)
        return sorted(k for k in raw.decode("utf-8", "replace").split() if _safe(k))

    def read(self, key: str, limit: int | None = None) -> bytes | None:
        with native_quiet(self.quiet):
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
        with native_quiet(self.quiet):
            return self._backend.exists(keys)

    def put(self, keys: Sequence[str], parts: Sequence[Sequence[Buffer]]) -> list[bool]:
        with native_quiet(self.quiet):
            return self._backend.put(keys, parts)

    def free_bytes(self) -> int | None:
        return None

    def same_as(self, other: object) -> bool:
        return isinstance(other, MooncakeEndpoint) and \
            same_master(self.host, self.port, other.host, other.port)

    def close(self) -> None:
        with native_quiet(self.quiet):
            self._backend.close()


def _answers_rpc(hostport: str, timeout: float, label: str) -> None:
    """StorageError unless the RPC server at ``hostport`` answers: sent a request it cannot
    parse, a Mooncake master closes the connection at once; a server that accepts and then
    says nothing within ``timeout`` seconds is refused (unreachable: said by the backend)."""
    host, _, port = hostport.rpartition(":")
    try:
        s = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout)
    except (OSError, ValueError):
        return                               # the backend's own probe says it is unreachable
    try:
        s.sendall(bytes(32))
        s.recv(1)                            # b"" (closed) or an answer: either is one
    except socket.timeout:
        raise StorageError(f"{label}: the master at {hostport} accepted a connection but did "
                           f"not answer within {timeout:g} s (?timeout=SECONDS to wait "
                           "longer)") from None
    except OSError:
        pass                                 # reset: it answered
    finally:
        s.close()


def _answers_http(url: str, timeout: float, label: str) -> None:
    """StorageError when the HTTP server of ``url`` accepts but does not answer a GET within
    ``timeout`` seconds (any status is an answer; unreachable: said by the backend)."""
    probe = url + ("&" if "?" in url else "?") + "key=hicache-probe"
    try:
        with urllib.request.urlopen(probe, timeout=timeout) as r:
            r.read1(1)
    except urllib.error.HTTPError:
        return
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        if isinstance(reason, (socket.timeout, TimeoutError)) or "timed out" in str(reason):
            raise StorageError(f"{label}: the metadata server {url} accepted a connection but "
                               f"did not answer within {timeout:g} s (?timeout=SECONDS to "
                               "wait longer)") from None


def _seconds(text, url: str) -> float:
    try:
        t = float(text)
    except (TypeError, ValueError):
        t = float("nan")
    if not 0 < t <= MAX_TIMEOUT_S:          # also NaN
        raise ValueError(f"{url}: timeout must be seconds in (0, {MAX_TIMEOUT_S:g}], got "
                         f"{text!r}")
    return t


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


_QUIET = threading.Lock()
_quiet_depth = 0
_saved_stderr: int | None = None


@contextlib.contextmanager
def native_quiet(enabled: bool = True) -> Iterator[None]:
    """While inside: file descriptor 2 goes to /dev/null (the native Mooncake client logs
    there, through its own logger that no setting of ours reaches). Nested and concurrent uses
    share one redirection; Python's own ``sys.stderr`` is flushed first."""
    global _quiet_depth, _saved_stderr
    if not enabled:
        yield
        return
    with _QUIET:
        if _quiet_depth == 0:
            try:
                sys.stderr.flush()
            except (OSError, ValueError):
                pass
            _saved_stderr = os.dup(2)
            null = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
            os.dup2(null, 2)
            os.close(null)
        _quiet_depth += 1
    try:
        yield
    finally:
        with _QUIET:
            _quiet_depth -= 1
            if _quiet_depth == 0 and _saved_stderr is not None:
                os.dup2(_saved_stderr, 2)
                os.close(_saved_stderr)
                _saved_stderr = None


def _host_ids(host: str, port: int) -> set[str]:
    """What ``host`` resolves to, with every address of this machine (loopback, unspecified,
    or one a socket can bind here) as ``local``; the name itself when it does not resolve."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return {host.lower()}
    out = set()
    for family, _, _, _, addr in infos:
        ip = ipaddress.ip_address(addr[0].split("%")[0])
        if ip.is_loopback or ip.is_unspecified or _bindable(family, addr[0]):
            out.add("local")
        else:
            out.add(str(ip))
    return out or {host.lower()}


def _bindable(family: int, ip: str) -> bool:
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((ip, 0))
        return True
    except OSError:
        return False


def same_master(host_a: str, port_a: int, host_b: str, port_b: int) -> bool:
    """Whether two master addresses reach one master: the same port on hosts that resolve to
    a common address (all of this machine's addresses counting as one)."""
    return port_a == port_b and bool(_host_ids(host_a, port_a) & _host_ids(host_b, port_b))


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
    """Whether two store specs name the same store (checked before either is opened): the
    same directory by its real path, or Mooncake masters on the same port of hosts that
    resolve to one address (``localhost`` and ``127.0.0.1`` are one)."""
    if "://" in a or "://" in b:
        ua, ub = urllib.parse.urlsplit(a), urllib.parse.urlsplit(b)
        try:
            pa, pb = ua.port, ub.port
        except ValueError:
            pa = pb = None
        if ua.scheme == ub.scheme == "mooncake" and ua.hostname and ub.hostname and pa and pb:
            return same_master(ua.hostname, pa, ub.hostname, pb)
        return a.split("?")[0].rstrip("/") == b.split("?")[0].rstrip("/")
    return os.path.realpath(os.path.expanduser(a)) == os.path.realpath(os.path.expanduser(b))


def open_endpoint(spec: str, *, source: bool, dry_run: bool = False,
                  verbose: bool = False) -> Endpoint:
    """``DIR`` or ``mooncake://…`` (see the module docstring). A source must exist; a
    destination directory is created on the first write (never with ``dry_run``)."""
    if "://" in spec:
        return MooncakeEndpoint(spec, verbose=verbose)
    if not source and os.path.exists(spec) and not os.path.isdir(spec):
        raise InputError(f"destination {spec} exists and is not a directory")
    if not source and os.path.isdir(spec) and os.listdir(spec) and \
            not os.path.isfile(os.path.join(spec, "store.json")):
        raise InputError(f"destination {spec} is a non-empty directory that is not a hicache "
                         "file store; refusing to write into it")
    return FileEndpoint(spec, create=not (source or dry_run), must_exist=source)

