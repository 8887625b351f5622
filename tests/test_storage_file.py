"""The file backend: damage to real files, LRU size limit, several processes, path safety."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.cache.pool import HostPool
from engine.core.errors import StorageError
from engine.core.hashing import page_hashes
from engine.core.layout import KVLayout
from engine.storage import L3Store
from engine.storage.backends.file import FileBackend
from engine.storage.config import FileStoreConfig
from engine.storage.placement import Placement

LAYOUT = KVLayout(num_layers=2, kv_heads=2, head_dim=8, page_size=4)
ONE_OBJECT = Placement(grid="layers=2,heads=2")   # a page is one object (a 1×1 grid)
REPO = Path(__file__).resolve().parents[1]


def open_store(path, **kw) -> FileBackend:
    return FileBackend(FileStoreConfig(dir=str(path), **kw))


def filled_pool() -> HostPool:
    pool = HostPool(LAYOUT, 4, host_layout="page_first")
    pool.buf.copy_(torch.randn(pool.buf.shape, generator=torch.Generator().manual_seed(0)))
    return pool


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_damaged_files_are_misses_and_moved_to_quarantine(tmp_path, damage):
    b = open_store(tmp_path)
    st = L3Store(b, LAYOUT, placement=ONE_OBJECT)
    src, dst = filled_pool(), HostPool(LAYOUT, 4, host_layout="page_first")
    hs = page_hashes(np.arange(12), 4)
    assert st.put_pages(hs, src, [0, 1, 2]) == 3
    path = b.object_path(st.keys(hs)[1])
    if damage == "flip":
        with open(path, "r+b") as f:
            f.seek(st.codec.header_len + 17)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0xFF]))
    else:
        os.truncate(path, st.object_size // 2)
    assert st.get_pages(hs, dst, [0, 1, 2]) == 1
    assert st.counters["corrupt"] == 1
    assert not os.path.exists(path)
    assert [q.split(".")[0] for q in b.quarantined()] == [hs[1].hex()]
    assert b.usage()[1] == 2
    st.close()


def raw_put(b: FileBackend, key: str, n: int = 1000) -> None:
    assert b.put([key], [[bytes([len(key) % 256]) * n]]) == [True]


def test_lru_evicts_least_recently_used_down_to_the_watermark(tmp_path):
    b = open_store(tmp_path, size_limit_bytes=10_000, evict_to=0.9)
    keys = [f"k{i:03d}" for i in range(11)]
    for k in keys[:10]:
        raw_put(b, k)
    assert b.usage() == (10_000, 10)
    assert b.get([keys[0]], [[bytearray(1000)]]) == [1000]      # k000 is used again
    raw_put(b, keys[10])                                         # 11 000 > 10 000: evict
    assert b.exists(keys) == [True, False, False] + [True] * 8   # k001, k002 were LRU
    assert b.usage() == (9_000, 9)
    assert b.health()["evictions"] == 2
    b.close()


@pytest.mark.parametrize("backend", ["file", "memory"])
def test_demoted_objects_are_evicted_first_and_a_read_restores_them(tmp_path, backend):
    """A closed session's objects (``demote``) go before older ones; a read of a demoted
    object makes it recent again (another reader still wants it)."""
    if backend == "file":
        b = open_store(tmp_path, size_limit_bytes=10_000, evict_to=0.9)
    else:
        from engine.storage.backends.memory import MemoryBackend
        from engine.storage.config import MemoryStoreConfig

        b = MemoryBackend(MemoryStoreConfig(size_limit_bytes=10_000))
    keys = [f"k{i:03d}" for i in range(12)]
    for k in keys[:10]:
        raw_put(b, k)
    assert b.demote([keys[7], keys[8], keys[9], "nope"]) == 3   # the newest three, closed
    assert b.get([keys[9]], [[bytearray(1000)]]) == [1000]      # k009 is read again
    raw_put(b, keys[10])
    raw_put(b, keys[11])
    gone = [k for k, e in zip(keys, b.exists(keys)) if not e]
    # (file: 11 000 > 10 000, down to 9 000; memory: one out per put past the limit)
    assert gone == [keys[7], keys[8]], gone   # not k000, k001: older, but not closed
    assert b.health().get("demoted", b.counters["demoted"]) == 3
    b.close()


def test_an_object_larger_than_the_limit_is_refused(tmp_path):
    b = open_store(tmp_path, size_limit_bytes=500)
    assert b.put(["big0"], [[bytes(501)]]) == [False]
    assert b.usage() == (0, 0)
    b.close()


def test_usage_is_shared_and_survives_reopening(tmp_path):
    a, b = open_store(tmp_path), open_store(tmp_path)
    raw_put(a, "aaaa")
    raw_put(b, "bbbb")
    assert a.usage() == b.usage() == (2000, 2)
    a.close()
    b.close()
    c = open_store(tmp_path)
    assert c.usage() == (2000, 2)
    assert c.exists(["aaaa", "bbbb"]) == [True, True]
    c.close()


WORKER = r"""
import hashlib, random, sys
from engine.storage.config import FileStoreConfig
from engine.storage.backends.file import FileBackend
root, me, n, limit = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
b = FileBackend(FileStoreConfig(dir=root, size_limit_bytes=limit))
def body(k):
    return hashlib.sha256(k.encode()).digest() * 64          # 2 KiB, derived from the key
rng = random.Random(me)
bad = 0
for i in range(n):
    k = f"w{me}-{i:04d}"
    assert b.put([k], [[body(k)]]) == [True]
    other = f"w{rng.randrange(3)}-{rng.randrange(i + 1):04d}"
    buf = bytearray(2048)
    r = b.get([other], [[buf]])[0]
    if r >= 0 and bytes(buf) != body(other):
        bad += 1
print(bad)
"""


def test_several_processes_share_one_store_safely(tmp_path):
    limit = 64 * 2048
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(tmp_path), str(w), "300",
                               str(limit)], cwd=REPO, stdout=subprocess.PIPE, text=True)
             for w in range(3)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0]
    assert [o.strip() for o in outs] == ["0", "0", "0"]         # no reader saw a torn object
    files = [p for p in (tmp_path / "objects").rglob("*") if p.is_file()]
    total = sum(p.stat().st_size for p in files)
    assert total <= limit
    for p in files:
        assert p.read_bytes() == hashlib.sha256(p.name.encode()).digest() * 64
    b = open_store(tmp_path)
    assert b.usage() == (total, len(files))                     # the shared counter is exact
    assert list((tmp_path / "tmp").iterdir()) == []
    b.close()


def test_a_read_in_another_process_keeps_an_object_alive(tmp_path):
    b = open_store(tmp_path, size_limit_bytes=5000, evict_to=0.6)
    for i in range(5):
        raw_put(b, f"obj{i}")
    code = ("from engine.storage.config import FileStoreConfig\n"
            "from engine.storage.backends.file import FileBackend\n"
            f"b = FileBackend(FileStoreConfig(dir={str(tmp_path)!r}))\n"
            "assert b.get(['obj0'], [[bytearray(1000)]]) == [1000]\n")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=60)
    raw_put(b, "obj5")                                          # evict down to 3000 bytes
    assert b.exists([f"obj{i}" for i in range(6)]) == [True, False, False, False, True, True]
    b.close()


def test_keys_cannot_leave_the_store(tmp_path):
    store = tmp_path / "store"
    b = open_store(store)
    for bad in ["../../escape", "../escape1", "/tmp/escape2", "ab/../../../escape3", ".."]:
        with pytest.raises(ValueError):
            b.put([bad], [[b"x"]])
        with pytest.raises(ValueError):
            b.object_path(bad)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["store"]
    p = Path(b.object_path("abcdef0123"))
    assert p.parent == store.resolve() / "objects" / "ab"
    b.close()


def test_a_directory_of_something_else_is_refused(tmp_path):
    (tmp_path / "store.json").write_text(json.dumps({"format": "other"}))
    with pytest.raises(StorageError, match="refusing"):
        open_store(tmp_path)
    f = tmp_path / "plainfile"
    f.write_text("x")
    with pytest.raises(StorageError, match="cannot be used"):
        open_store(f)


def test_default_is_a_temp_dir_removed_on_close():
    b = FileBackend()
    root = b.health()["dir"]
    raw_put(b, "tmpobj")
    assert os.path.isdir(root)
    b.close()
    assert not os.path.exists(root)


def test_stale_temp_files_are_cleaned(tmp_path):
    b = open_store(tmp_path)
    b.close()
    stale = tmp_path / "tmp" / "deadbeef.123.0.tmp"
    stale.write_bytes(b"half an object")
    old = time.time() - 3600
    os.utime(stale, (old, old))
    open_store(tmp_path).close()
    assert not stale.exists()


def test_a_full_disk_is_one_warning_not_one_per_object(tmp_path, caplog):
    import errno
    import logging

    b = FileBackend(FileStoreConfig(dir=str(tmp_path / "s")))
    full = OSError(errno.ENOSPC, "No space left on device")
    with caplog.at_level(logging.DEBUG, logger="hicache.storage"):
        for i in range(200):
            b._error("write", f"/store/objects/{i}", full)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "No space left" in warnings[0].getMessage()
    assert b.counters["errors"] == 200
    b._warned[errno.ENOSPC] = (time.monotonic() - 60, 199)     # ten seconds later
    b._error("write", "/store/objects/x", full)
    assert "(and 199 more like it since the last warning)" in caplog.records[-1].getMessage()
    b.close()


def test_staged_objects_from_threads_appear_only_when_published(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    b = open_store(tmp_path / "s", size_limit_bytes=4 << 20)
    keys = [f"{i:02x}" * 32 + ".x" for i in range(16)]
    payloads = [np.full(100_000 + i, i, dtype=np.uint8) for i in range(16)]
    big = np.zeros(5 << 20, dtype=np.uint8)                # over the size limit: refused
    with ThreadPoolExecutor(4) as ex:
        staged = list(ex.map(lambda kp: b.stage(kp[0], [b"head", kp[1]]),
                             zip(keys, payloads)))
    staged.append(b.stage("ff" * 32 + ".big", [big]))
    assert staged[-1] is None
    assert b.exists(keys) == [False] * 16                   # nothing visible yet
    assert b.publish(staged) == [True] * 16 + [False]
    assert b.exists(keys) == [True] * 16 and os.listdir(tmp_path / "s" / "tmp") == []
    got = [bytearray(4 + len(p)) for p in payloads]
    assert b.get(keys, [[g] for g in got]) == [4 + len(p) for p in payloads]
    assert all(bytes(g) == b"head" + p.tobytes() for g, p in zip(got, payloads))
    assert b.usage() == (sum(4 + len(p) for p in payloads), 16)
    b.close()


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("how", ["unnamed", "unnamed-proc", "named"])
def test_staged_objects_leave_nothing_behind_and_the_first_copy_stays(tmp_path, monkeypatch,
                                                                      how):
    from engine.storage.backends import file
    from engine.storage.backends.file import STAGE_BATCH

    unnamed = how != "named"
    if not unnamed:                       # as on a filesystem without O_TMPFILE
        monkeypatch.setattr(FileBackend, "_unnamed_files", lambda self: None)
    if how == "unnamed-proc":             # as for a process the kernel refuses linkat(fd, "")

        def refused(fd, dir_fd, name):
            raise PermissionError(1, "Operation not permitted", name)
        monkeypatch.setattr(file, "_fd_linker", lambda: refused)
    b = open_store(tmp_path / "s")
    if unnamed and b._objfd is None:
        pytest.skip("this filesystem cannot link unnamed files into place")
    if how == "unnamed-proc":
        assert b._link is file._proc_link
    tmp, key = tmp_path / "s" / "tmp", "ab" * 32
    fds = open_fds()
    st = b.stage(key, [b"first ", np.arange(10, dtype=np.uint8)])
    assert b.exists([key]) == [False]                     # not visible before publish
    assert len(os.listdir(tmp)) == (0 if unnamed else 1)  # an unnamed file has no name at all
    assert b.publish([st]) == [True]
    first = open(b.object_path(key), "rb").read()
    assert first == b"first " + bytes(range(10))
    again = b.stage(key, [b"second"])
    assert b.publish([again]) == [True]                   # stored: the object already was
    assert open(b.object_path(key), "rb").read() == first and b.counters["put_skipped"] == 1
    assert os.listdir(tmp) == [] and open_fds() == fds    # every staged file closed or removed
    keys = [f"{i:04x}" * 16 for i in range(2 * STAGE_BATCH + 3)]
    assert b.put(keys, [[k.encode()] for k in keys]) == [True] * len(keys)
    assert b.usage() == (len(first) + sum(len(k) for k in keys), 1 + len(keys))
    assert open(b.object_path(keys[-1]), "rb").read() == keys[-1].encode()
    assert os.listdir(tmp) == [] and open_fds() == fds
    b.close()


def test_large_payloads_are_written_in_full_by_capped_calls(tmp_path):
    from engine.storage.backends.file import WRITE_CHUNK

    b = open_store(tmp_path / "s")
    parts = [b"h" * 100, np.arange(3 * WRITE_CHUNK + 7, dtype=np.uint8), b"", b"tail"]
    assert b.put(["ab" * 32], [parts]) == [True]
    raw = open(b.object_path("ab" * 32), "rb").read()
    assert raw == b"".join(bytes(memoryview(p)) for p in parts)
    one = np.arange(2 * WRITE_CHUNK + 5, dtype=np.uint8)      # one buffer, several calls
    assert b.put(["cd" * 32], [[one]]) == [True]
    assert open(b.object_path("cd" * 32), "rb").read() == one.tobytes()
    b.close()
