"""One rule for every file the tools write (snapshots, rank logs, plots, parquet tables).

* **Never replace what is not a regular file.** A destination that exists and is a device, a
  FIFO, a socket or a directory is refused (:class:`OutputPathError`) — an atomic
  write-then-rename over ``/dev/full`` would replace the device node with a plain file.
* **Write through symlinks.** A destination that is a symlink is written at its final target
  (which must be a regular file or not exist yet), so the link stays a link.
* **Atomic.** The bytes go to a temporary file next to the target and are renamed onto it only
  when complete; a failure leaves the old file and no temporary behind.
* **Errors name the path asked for**, not the temporary file; :func:`check_output_file` and
  :func:`check_output_dir` run the same checks up front, so a command fails at start rather than
  after an hour of work.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from typing import IO, Iterator

_KIND = {stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device",
         stat.S_IFIFO: "a FIFO", stat.S_IFSOCK: "a socket", stat.S_IFDIR: "a directory"}


class OutputPathError(OSError):
    """An output destination that cannot or must not be written; ``str()`` is one line."""

    def __init__(self, path: "str | os.PathLike[str]", problem: str, err: int = errno.EINVAL):
        super().__init__(err, problem, os.fspath(path))
        self.problem = problem

    def __str__(self) -> str:
        return f"{self.filename}: {self.problem}"


def _kind(mode: int) -> str:
    return _KIND.get(stat.S_IFMT(mode), "not a regular file")


def resolve_output(path: "str | os.PathLike[str]") -> str:
    """Where writing ``path`` puts the bytes: ``path`` itself, or the final target of a
    symlink. Raises :class:`OutputPathError` when that is not a regular file (or nothing yet)
    or its directory is missing or not writable."""
    p = os.fspath(path)
    if not p or p.endswith(os.sep):
        raise OutputPathError(p, "is a directory name, expected a file name")
    target = os.path.realpath(p) if os.path.islink(p) else os.path.abspath(p)
    try:
        st = os.stat(target)
    except FileNotFoundError:
        st = None
    except OSError as e:
        raise OutputPathError(p, f"cannot be checked ({e.strerror})", e.errno) from None
    if st is not None and stat.S_ISDIR(st.st_mode):
        raise OutputPathError(p, "is a directory, expected a file name", errno.EISDIR)
    if st is not None and not stat.S_ISREG(st.st_mode):
        via = f" (a symlink to {target})" if target != os.path.abspath(p) else ""
        raise OutputPathError(p, f"is {_kind(st.st_mode)}{via}; only a regular file is "
                                 "replaced")
    parent = os.path.dirname(target)
    if not os.path.isdir(parent):
        raise OutputPathError(p, f"directory {parent} does not exist", errno.ENOENT)
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputPathError(p, f"directory {parent} is not writable", errno.EACCES)
    return target


def check_output_file(path: "str | os.PathLike[str]") -> str:
    """The up-front check of an output file (what :func:`atomic_output` will do)."""
    return resolve_output(path)


def check_output_dir(path: "str | os.PathLike[str]", create: bool = True) -> str:
    """An output directory: created when ``create`` (and missing), must be a writable
    directory; with ``create=False`` a missing one must be creatable (its nearest existing
    ancestor a writable directory). Returns its absolute path."""
    p = os.fspath(path)
    if create:
        try:
            os.makedirs(p, exist_ok=True)
        except FileExistsError:
            pass
        except OSError as e:
            raise OutputPathError(p, f"cannot be created ({e.strerror})", e.errno) from None
    if not create and not os.path.lexists(p):
        # to be created later: the nearest existing ancestor must be a writable directory
        up = os.path.dirname(os.path.abspath(p))
        while not os.path.lexists(up):
            up = os.path.dirname(up)
        if not os.path.isdir(up) or not os.access(up, os.W_OK | os.X_OK):
            raise OutputPathError(p, f"cannot be created: {up} is not a writable directory",
                                  errno.EACCES)
        return os.path.abspath(p)
    try:
        st = os.stat(p)
    except OSError as e:
        raise OutputPathError(p, f"cannot be used ({e.strerror})", e.errno) from None
    if not stat.S_ISDIR(st.st_mode):
        raise OutputPathError(p, "exists and is not a directory", errno.ENOTDIR)
    if not os.access(p, os.W_OK | os.X_OK):
        raise OutputPathError(p, "directory is not writable", errno.EACCES)
    return os.path.abspath(p)


@contextlib.contextmanager
def atomic_output(path: "str | os.PathLike[str]") -> Iterator[IO[bytes]]:
    """Open a temporary file next to ``path``'s target for writing (binary); on a clean exit
    rename it onto the target. Errors (``OSError``) name ``path``."""
    p = os.fspath(path)
    target = resolve_output(p)
    tmp = os.path.join(os.path.dirname(target),
                       f".{os.path.basename(target)}.tmp-{os.getpid()}")
    try:
        with open(tmp, "xb", buffering=1 << 20) as f:
            yield f
        resolve_output(p)          # still a regular file (or nothing) just before the rename
        os.replace(tmp, target)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(exc, OSError) and not isinstance(exc, OutputPathError) and \
                exc.filename in (tmp, target):
            raise OSError(exc.errno, exc.strerror, p) from None
        raise


def write_output(path: "str | os.PathLike[str]", data: bytes) -> None:
    """Write ``data`` to ``path`` by the rule above."""
    with atomic_output(path) as f:
        f.write(data)
