"""C sources of the package built for this machine on first use, and loaded (ctypes): the host
copy loop (engine/cache/hostcopy.py) and the exact path's products and attention
(engine/runtime/model/native_gemm.py, native_attn.py).

A library is built once per source, flag set and machine into the first usable cache directory
— the per-user cache, then a private one under the temp directory; a directory is used only if
it is ours and not writable by others (code is loaded from it) — atomically (a temporary file
renamed into place), and rebuilt when the file there does not load. The compiler (``CC``, else
cc, gcc or clang) is needed only to build. Every failure is a :class:`RuntimeError` or
``OSError`` naming why; the callers fall back to their Python or torch path and say so.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

BUILD_TIMEOUT_S = 120


def compiler() -> list[str] | None:
    """The C compiler command (``CC`` when set), or None."""
    if os.environ.get("CC"):
        cmd = shlex.split(os.environ["CC"])
        return cmd if cmd and shutil.which(cmd[0]) else None
    for name in ("cc", "gcc", "clang"):
        path = shutil.which(name)
        if path:
            return [path]
    return None


def cache_dirs() -> list[Path]:
    """The per-user cache directory, then a private one under the temp directory, each only if
    it is ours and not writable by others."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    out = []
    for d in (Path(base) / "hicache", Path(tempfile.gettempdir()) / f"hicache-{os.getuid()}"):
        try:
            d.mkdir(parents=True, exist_ok=True, mode=0o700)
            st = d.stat()
        except OSError:
            continue
        if st.st_uid == os.getuid() and not st.st_mode & 0o022 and os.access(d, os.W_OK):
            out.append(d)
    return out


def compile_shared(cc: list[str], flags: list[str], source: bytes, so: Path,
                   libs: tuple[str, ...] = ()) -> None:
    """Compile ``source`` (read from stdin) to the shared library ``so``, atomically."""
    fd, tmp = tempfile.mkstemp(prefix=f".{so.stem}-", suffix=".so", dir=so.parent)
    os.close(fd)
    try:
        res = subprocess.run(cc + flags + ["-x", "c", "-o", tmp, "-", *libs], input=source,
                             capture_output=True, timeout=BUILD_TIMEOUT_S)
        if res.returncode != 0:
            msg = res.stderr.decode(errors="replace").strip().splitlines()
            raise RuntimeError(f"{cc[0]} failed: {msg[-1] if msg else res.returncode}")
        os.replace(tmp, so)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load(source_path: Path, flags: list[str], key_extra: str = "",
         libs: tuple[str, ...] = ()) -> tuple[ctypes.CDLL, Path]:
    """``source_path`` built with ``flags`` (``key_extra``: what else the build depends on,
    e.g. the CPU's features under ``-march=native``) and loaded; the library and its path."""
    source = source_path.read_bytes()
    parts = flags + [platform.machine(), sys.platform] + ([key_extra] if key_extra else [])
    key = hashlib.sha256(source + " ".join(parts).encode()).hexdigest()[:16]
    errors = []
    for d in cache_dirs():
        so = d / f"{source_path.stem}-{key}.so"
        try:
            if so.exists():
                try:
                    return ctypes.CDLL(str(so)), so
                except OSError:                  # not loadable here: build it afresh
                    pass
            cc = compiler()
            if cc is None:
                raise RuntimeError("no C compiler: set CC or install gcc")
            compile_shared(cc, flags, source, so, libs)
            return ctypes.CDLL(str(so)), so
        except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
            errors.append(str(exc) if "no C compiler" in str(exc) else f"{d}: {exc}")
    raise RuntimeError("; ".join(dict.fromkeys(errors)) or "no writable cache directory")
