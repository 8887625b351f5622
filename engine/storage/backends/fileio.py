"""Low-level file I/O of the file store (engine/storage/backends/file.py): opening only regular
files, vectored writes and reads in full, in-kernel range copies, and linking an unnamed
(``O_TMPFILE``) file into place by its descriptor."""

from __future__ import annotations

import ctypes
import errno
import os
import stat

from engine.storage.backend import FileRange

_RDFLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK


class NotRegular(OSError):
    """A store path that is not a regular file (FIFO, device, socket, symlink)."""


def open_regular(path: str, flags: int = _RDFLAGS, mode: int = 0o644) -> int:
    """Open ``path`` only if it is a regular file: checked before the open (so a FIFO or a
    device is never opened) and after it (the path may have been swapped in between)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        if not flags & os.O_CREAT:
            raise
    else:
        if not stat.S_ISREG(st.st_mode):
            raise NotRegular(errno.EINVAL, "not a regular file", path)
    fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise NotRegular(errno.EINVAL, "not a regular file", path)
    return fd


WRITE_CHUNK = 256 << 10
"""Bytes per write system call at most. The kernel sizes page-cache folios by the write: a call
of 1 MiB or more gets high-order ones, and on the development VM (free memory handed back to the
host in large blocks) those cost up to 10x the system time of the same bytes in smaller calls.
Up to 256 KiB a call costs no more than 64 KiB calls, and an object of up to 256 KiB (a
128 KiB head-cut object with its header) goes out in one call: splitting it into 64 KiB calls
cost 2-3x the system time (docs/storage.md, "convert-layout")."""


def _capped(views: list[memoryview]) -> list[memoryview]:
    """The first WRITE_CHUNK bytes of ``views`` (the next write call's vector)."""
    out, room = [], WRITE_CHUNK
    for v in views:
        if room <= 0:
            break
        out.append(v[:room] if len(v) > room else v)
        room -= len(out[-1])
    return out


def _writev_all(fd: int, views: list[memoryview]) -> None:
    views = [v for v in views if len(v)]
    while views:
        n = os.writev(fd, _capped(views))
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if n:
            views[0] = views[0][n:]


def _copy_range(r: FileRange, fd: int) -> None:
    """Append ``r`` to ``fd`` inside the kernel; OSError when the source is shorter."""
    off, left = r.offset, r.length
    while left:
        n = os.copy_file_range(r.fd, fd, left, off)
        if n <= 0:
            raise OSError(errno.EIO, f"source file ended {left} bytes early")
        off, left = off + n, left - n


AT_EMPTY_PATH = 0x1000


def _fd_linker():
    """``link(fd, dir_fd, name)``: ``linkat(fd, "", dir_fd, name, AT_EMPTY_PATH)`` through libc
    (no path walk through ``/proc``), or None where libc has no ``linkat``. The kernel allows
    it only to a process that may search any directory (CAP_DAC_READ_SEARCH): the caller probes
    it once and otherwise links ``/proc/self/fd/N``."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).linkat
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
    fn.restype = ctypes.c_int

    def link(fd: int, dir_fd: int, name: str) -> None:
        if fn(fd, b"", dir_fd, os.fsencode(name), AT_EMPTY_PATH) != 0:
            e = ctypes.get_errno()
            raise OSError(e, os.strerror(e), name)
    return link


def _proc_link(fd: int, dir_fd: int, name: str) -> None:
    os.link(f"/proc/self/fd/{fd}", name, dst_dir_fd=dir_fd, follow_symlinks=True)


def _preadv_all(fd: int, views: list[memoryview]) -> int:
    views = [v for v in views if len(v)]
    off = 0
    while views:
        n = os.preadv(fd, views, off)
        if n == 0:
            break
        off += n
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if n:
            views[0] = views[0][n:]
    return off
