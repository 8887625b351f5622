"""A stalled store never stalls its caller: non-regular objects are never opened, and a backend
call past its deadline is abandoned with the store marked degraded until the call returns.

The stalls are real: a FIFO in place of an object, another process holding the file store's
lock (what a writer stopped mid-publish does), a real mooncake_master stopped with SIGSTOP.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from engine.storage import L3Store, StorageConfig
from engine.storage.config import FileStoreConfig
from tests.factories import STORE_LAYOUT as LAYOUT
from tests.factories import page_chain as chain
from tests.factories import store_pool as pool
from tests.mooncake_master import MooncakeMaster


def bounded(fn, timeout_s: float = 20.0):
    """Run ``fn`` on a daemon thread; fail (instead of hanging the suite) if it blocks."""
    box: dict = {}

    def run() -> None:
        try:
            box["r"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            box["e"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout_s)
    assert not t.is_alive(), f"{fn} blocked for {timeout_s}s"
    if "e" in box:
        raise box["e"]
    return box.get("r")


def file_store(tmp_path, deadline_s: float = 0.5) -> L3Store:
    cfg = StorageConfig("file", file=FileStoreConfig(dir=str(tmp_path / "store")),
                        deadline_s=deadline_s)
    return L3Store.open(cfg, LAYOUT)


def test_fifo_object_is_never_opened_and_is_quarantined(tmp_path):
    store = file_store(tmp_path)
    src, dst = pool(), pool(fill=False)
    hs = chain(4)
    assert store.put_pages(hs, src, [0, 1, 2, 3]) == 4
    path = store.backend.object_path(store.keys(hs[2:3])[0])   # an object of page 2
    os.unlink(path)
    os.mkfifo(path)                          # opening it for reading would block forever
    n = bounded(lambda: store.get_pages(hs, dst, [4, 5, 6, 7]))
    assert n == 2
    assert torch.equal(dst.buf[4:6], src.buf[0:2])
    st = store.stats()
    assert st["corrupt"] == 1 and not st["degraded"]
    assert not os.path.exists(path)         # taken out of service
    assert store.backend.quarantined()
    store.close()


def test_store_marker_that_is_a_fifo_is_refused(tmp_path):
    from engine.core.errors import StorageError

    d = tmp_path / "store"
    d.mkdir()
    os.mkfifo(d / "store.json")
    with pytest.raises(StorageError, match="not a regular file"):
        bounded(lambda: file_store(tmp_path))


HOLD_LOCK = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(600)
"""


def hold_lock(root: str) -> subprocess.Popen:
    """Another process holds the lock of the file store at ``root`` (a writer stopped
    mid-publish)."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, os.path.join(root, "lock")],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_stuck_put_is_abandoned_store_degraded_then_recovers(tmp_path):
    store = file_store(tmp_path, deadline_s=0.3)
    src, dst = pool(), pool(fill=False)
    hs = chain(2)
    holder = hold_lock(store.backend.root)
    try:
        t0 = time.monotonic()
        assert bounded(lambda: store.put_pages(hs, src, [0, 1])) == 0
        assert time.monotonic() - t0 < 5
        st = bounded(store.stats)
        assert st["degraded"] and "put of 2 pages" in st["degraded_reason"]
        assert st["backend"]["healthy"] is False
        # every later call fails fast instead of queueing behind the stuck one
        assert bounded(lambda: store.exists_prefix(hs)) == 0
        assert bounded(lambda: store.get_pages(hs, dst, [2, 3])) == 0
        assert store.guard.counters["refused"] >= 2
    finally:
        holder.kill()
        holder.wait()
    deadline = time.monotonic() + 10
    while store.degraded and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not store.degraded and store.guard.counters["recovered"] == 1
    # the abandoned put finished once the lock was free; the store works again
    assert store.get_pages(hs, dst, [2, 3]) == 2
    assert torch.equal(dst.buf[2:4], src.buf[0:2])
    store.close()


def test_close_while_degraded_is_bounded(tmp_path):
    store = file_store(tmp_path, deadline_s=0.3)
    holder = hold_lock(store.backend.root)
    try:
        assert store.put_pages(chain(1), pool(), [0]) == 0
        bounded(store.close, timeout_s=5)
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.mooncake
def test_stopped_mooncake_master_degrades_instead_of_blocking(tmp_path):
    m = MooncakeMaster(tmp_path).start()
    try:
        cfg = StorageConfig("mooncake", mooncake=m.config(), deadline_s=0.5)
        store = L3Store.open(cfg, LAYOUT)
        src, dst = pool(), pool(fill=False)
        hs = chain(3)
        assert store.put_pages(hs, src, [0, 1, 2]) == 3
        os.kill(m.proc.pid, signal.SIGSTOP)      # alive, connected, never answers
        try:
            t0 = time.monotonic()
            for _ in range(3):
                bounded(lambda: store.get_pages(hs, dst, [3, 4, 5]))
                bounded(lambda: store.put_pages(chain(2), src, [0, 1]))
                bounded(lambda: store.exists_prefix(hs))
            took = time.monotonic() - t0
            st = bounded(store.stats)
            assert took < 15, took
            assert st["degraded"] and "did not return within" in st["degraded_reason"]
            assert st["refused"] > 0 and st["backend"]["healthy"] is False
        finally:
            os.kill(m.proc.pid, signal.SIGCONT)
        bounded(store.close, timeout_s=30)
    finally:
        m.stop()


@pytest.mark.mooncake
def test_close_with_master_stopped_is_bounded(tmp_path):
    m = MooncakeMaster(tmp_path).start()
    try:
        store = L3Store.open(StorageConfig("mooncake", mooncake=m.config(), deadline_s=0.5),
                             LAYOUT)
        assert store.put_pages(chain(1), pool(), [0]) == 1
        os.kill(m.proc.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            bounded(store.close, timeout_s=30)
            assert time.monotonic() - t0 < 10
        finally:
            os.kill(m.proc.pid, signal.SIGCONT)
    finally:
        m.stop()


def test_deadline_config_is_validated():
    from engine.core.errors import InputError

    assert StorageConfig.from_dict({"backend": "file", "deadline_s": 2}).deadline_s == 2
    for bad in (-1, float("nan"), "x", True):
        with pytest.raises(InputError, match="deadline_s"):
            StorageConfig.from_dict({"backend": "file", "deadline_s": bad})
