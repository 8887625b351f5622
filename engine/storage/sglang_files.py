"""SGLang's page files as ``convert-layout`` reads and writes them: a source file taken only
when it is a regular file of exactly the size its geometry says (read whole, or mapped), and a
target file written whole through a temporary file renamed into place, as SGLang's own writer
does, so an SGLang reader never sees part of a file."""

from __future__ import annotations

import os
import stat
import uuid

import numpy as np

from engine.core.errors import StorageError
from engine.storage.backends.fileio import WRITE_CHUNK

_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def read_exact(path: str, nbytes: int, buf: np.ndarray | None = None) -> np.ndarray | None:
    """The file's bytes when it is a regular file of exactly ``nbytes``, else None."""
    try:
        fd = os.open(path, _READ_FLAGS)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if st.st_size != nbytes or not stat.S_ISREG(st.st_mode):
            return None
        out = np.empty(nbytes, np.uint8) if buf is None else buf
        view, at = memoryview(out), 0
        while at < nbytes:
            n = os.readv(fd, [view[at:]])
            if n <= 0:
                return None
            at += n
        return out
    except OSError:
        return None
    finally:
        os.close(fd)


def map_exact(path: str, nbytes: int):
    """The file mapped read-only when it is a regular file of exactly ``nbytes``, else None.
    SGLang never rewrites a page file in place (it renames whole new files into place and
    unlinks evicted ones), so the size checked here holds while it is mapped."""
    from engine.storage.convert_io import map_source

    try:
        fd = os.open(path, _READ_FLAGS)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return map_source(fd, nbytes)
    finally:
        os.close(fd)


def write_atomic(root: str, name: str, buf) -> None:
    """Write ``root/name`` whole: a temporary file in ``root`` renamed into place (what SGLang's
    own writer does: its readers never see part of a file)."""
    tmp = os.path.join(root, f".{uuid.uuid4().hex}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW,
                 0o644)
    try:
        view, at = memoryview(buf).cast("B"), 0
        while at < len(view):       # capped calls: see WRITE_CHUNK (large folios cost more)
            at += os.write(fd, view[at:at + WRITE_CHUNK])
        os.close(fd)
        fd = -1
        os.replace(tmp, os.path.join(root, name))
    except OSError as e:
        if fd >= 0:
            os.close(fd)
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise StorageError(f"cannot write {name} in {root}: {e.strerror or e}; every file "
                           "written so far is whole: fix it and run again to resume") from None
