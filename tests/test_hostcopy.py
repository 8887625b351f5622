"""Host-to-host chunk copies: the native loop and the Python fallback move the same bytes, and
the native library is built, cached and chosen (or refused) the way docs/design.md says."""

import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.cache import hostcopy, transfer
from engine.cache.pool import DevicePool, HostPool
from engine.cache.transfer import OpKind, TransferEngine, copy_pages_host
from engine.core.layout import KVLayout

ROOT = Path(__file__).resolve().parents[1]
HAVE_CC = bool(os.environ.get("CC")) or any(shutil.which(c) for c in ("cc", "gcc", "clang"))


@pytest.fixture(scope="module")
def cache_home(tmp_path_factory):
    """The library is built once for this module, away from the user's own cache."""
    return tmp_path_factory.mktemp("xdg")


@pytest.fixture(params=["native", "python"])
def path(request, monkeypatch, cache_home):
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache_home))
    if request.param == "python":
        monkeypatch.setenv(hostcopy.ENV, "0")
    else:
        monkeypatch.delenv(hostcopy.ENV, raising=False)
    hostcopy.reset()
    chosen = hostcopy.copy_path()
    if request.param == "native" and not chosen.startswith("native"):
        if HAVE_CC:
            pytest.fail(f"a C compiler exists but the native copy is not used: {chosen}")
        pytest.skip(f"no C compiler (cc, gcc or clang) on PATH: {chosen}")
    assert chosen.startswith(request.param), chosen
    yield request.param
    hostcopy.reset()


@pytest.fixture
def small_thresholds(monkeypatch):
    """Tiny pools still take the paths a large transfer takes: three copy threads (parts cut
    inside runs) and streaming stores."""
    monkeypatch.setattr(transfer, "_threads", lambda: 3)
    monkeypatch.setattr(transfer, "_PARALLEL_MIN_BYTES", 1)
    monkeypatch.setattr(transfer, "_STREAM_MIN_BYTES", 1)


# (chunk, dst offsets, src offsets): one chunk; scattered; runs of adjacent chunks; a run that
# is adjacent on one side only; odd sizes below, at and above the 256-byte streaming cut-off.
CHUNKS = [(4099, [9000], [13]), (256, [2560, 512, 7680, 0], [1024, 9216, 256, 4096]),
          (300, [3000, 3300, 3600, 17, 900], [5, 305, 605, 6000, 7001]),
          (1000, [100, 1100, 5000], [2000, 3000, 9000]), (255, [1, 999], [3, 2000]),
          (1, [5, 6, 7], [9, 10, 11])]


@pytest.mark.parametrize("chunk,d_off,s_off", CHUNKS)
@pytest.mark.parametrize("stream", [False, True])
def test_chunk_copy_equals_one_memmove_per_chunk(path, chunk, d_off, s_off, stream):
    src = np.random.default_rng(chunk).integers(0, 256, 16384, dtype=np.uint8)
    want, got = np.zeros(16384, np.uint8), np.zeros(16384, np.uint8)
    for d, s in zip(d_off, s_off):
        want[d:d + chunk] = src[s:s + chunk]
    n = hostcopy.copy_chunks(got.ctypes.data, src.ctypes.data, np.array(d_off, np.int64),
                             np.array(s_off, np.int64), chunk, stream)
    assert n == chunk * len(d_off)
    assert np.array_equal(got, want)


def test_empty_chunk_list_copies_nothing(path):
    buf = np.zeros(64, np.uint8)
    empty = np.array([], np.int64)
    assert hostcopy.copy_chunks(buf.ctypes.data, buf.ctypes.data, empty, empty, 16, True) == 0


def pools(host_layout, page_size, num_pages=24):
    lay = KVLayout(num_layers=2, kv_heads=2, head_dim=8, page_size=page_size, kv_kinds=2,
                   dtype="bfloat16")
    l1, l2 = DevicePool(lay, num_pages), HostPool(lay, num_pages, host_layout)
    g = torch.Generator().manual_seed(page_size)
    l1.buf.copy_(torch.randn(l1.buf.shape, generator=g))
    l2.buf.copy_(torch.randn(l2.buf.shape, generator=g))
    return l1, l2


# Empty, one page, scattered, adjacent on both sides (one run per kind), reversed.
PAGES = [([], []), ([5], [17]), ([7, 2, 9, 21, 14, 0], [3, 11, 23, 6, 1, 18]),
         (list(range(3, 13)), list(range(12, 22))), ([9, 8, 7, 6], [0, 1, 2, 3])]


@pytest.mark.parametrize("host_layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("src_pages,dst_pages", PAGES)
@pytest.mark.parametrize("via", ["layer", "op"])
def test_load_and_backup_bytes_equal_the_gather_scatter_path(path, small_thresholds, host_layout,
                                                             page_size, src_pages, dst_pages, via):
    """``layer``: copy_pages_host, one layer at a time; ``op``: an engine op, whose copy
    threads run through all layers without waiting for each other."""
    src, dst = np.array(src_pages, np.int64), np.array(dst_pages, np.int64)
    for kind in (OpKind.LOAD, OpKind.BACKUP):
        l1, l2 = pools(host_layout, page_size)
        a, b = (l2, l1) if kind is OpKind.LOAD else (l1, l2)
        before = b.buf.clone()
        for layer in range(2):                            # the reference: gather, scatter
            b.set_layer(layer, dst, a.get_layer(layer, src))
        ref = b.buf.clone()
        b.buf.copy_(before)
        if via == "layer":
            for layer in range(2):
                assert copy_pages_host(a, src, b, dst, layer) == len(src) * 2 * b.chunk_bytes
        else:
            eng = TransferEngine("cpu")
            eng.submit(eng.new_op(kind, a, src, b, dst, 2)).wait()
            eng.close()
        assert torch.equal(b.buf, ref), f"{kind.value} wrote different bytes"
        assert torch.equal(b.buf, before) == (len(src) == 0)


def test_a_failing_copy_thread_fails_the_op_without_hanging(path, small_thresholds, monkeypatch):
    l1, l2 = pools("page_first", 16)
    real = transfer.HostCopy.copy_part

    def copy_part(self, layer, part):
        if part[0] > 0 and layer == 1:
            raise OSError("copy thread lost")
        real(self, layer, part)

    monkeypatch.setattr(transfer.HostCopy, "copy_part", copy_part)
    eng = TransferEngine("cpu")
    op = eng.submit(eng.new_op(OpKind.LOAD, l2, np.arange(9), l1, np.arange(9, 18), 2))
    with pytest.raises(RuntimeError, match="failed") as err:
        op.wait()
    assert isinstance(err.value.__cause__, OSError) and op.failed
    eng.close()


@pytest.mark.parametrize("host_layout", ["layer_first", "page_first"])
def test_engine_ops_through_both_paths(path, small_thresholds, host_layout):
    l1, l2 = pools(host_layout, 16)
    eng = TransferEngine("cpu")
    l1_pages, l2_pages = np.array([4, 5, 6, 20, 1]), np.array([0, 9, 10, 11, 2])
    op = eng.submit(eng.new_op(OpKind.BACKUP, l1, l1_pages, l2, l2_pages, 2))
    op.wait()
    back = np.array([13, 14, 15, 16, 17])
    op = eng.submit(eng.new_op(OpKind.LOAD, l2, l2_pages, l1, back, 2))
    op.wait()
    eng.close()
    for layer in range(2):
        assert torch.equal(l1.get_layer(layer, back), l1.get_layer(layer, l1_pages))
    assert eng.bytes_moved["load"] == eng.bytes_moved["backup"] == 2 * 5 * 2 * l1.chunk_bytes


def fresh(code, **env):
    """Run ``code`` in a new interpreter (the choice is made once per process)."""
    full = {k: v for k, v in os.environ.items() if k != hostcopy.ENV}
    full.update(PYTHONPATH=str(ROOT), **env)
    return subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True,
                          timeout=120, cwd=ROOT)


PRINT_PATH = "from engine.cache import hostcopy; print(hostcopy.copy_path())"


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler (cc, gcc or clang) on PATH")
def test_native_library_builds_and_loads(tmp_path):
    res = fresh(PRINT_PATH, XDG_CACHE_HOME=str(tmp_path))
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("native ("), res.stdout
    built = list((tmp_path / "hicache").iterdir())
    assert [p.suffix for p in built] == [".so"], built        # no temporary left behind
    again = fresh(PRINT_PATH, XDG_CACHE_HOME=str(tmp_path), CC="/nonexistent/cc")
    assert again.stdout.startswith("native ("), again.stdout  # the cached build, no compiler


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler (cc, gcc or clang) on PATH")
def test_ranks_starting_together_all_load_one_build(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "XDG_CACHE_HOME": str(tmp_path)}
    env.pop(hostcopy.ENV, None)
    procs = [subprocess.Popen([sys.executable, "-c", PRINT_PATH], env=env, cwd=ROOT,
                              stdout=subprocess.PIPE, text=True) for _ in range(3)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(o.startswith("native (") for o in outs), outs
    assert len(list((tmp_path / "hicache").iterdir())) == 1


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler (cc, gcc or clang) on PATH")
def test_unwritable_cache_home_builds_under_the_temp_dir(tmp_path):
    blocked = tmp_path / "not-a-dir"
    blocked.write_text("")
    res = fresh(PRINT_PATH, XDG_CACHE_HOME=str(blocked), TMPDIR=str(tmp_path))
    assert res.stdout.startswith(f"native ({tmp_path}/hicache-{os.getuid()}/"), res.stdout


def test_one_log_line_names_the_path(path, caplog):
    hostcopy.reset()
    with caplog.at_level(logging.INFO, logger="hicache.transfer"):
        hostcopy.copy_path()
        hostcopy.copy_path()
    lines = [r.getMessage() for r in caplog.records if r.name == "hicache.transfer"]
    assert len(lines) == 1 and lines[0].startswith(f"host copies: {path} ("), lines


FAILING_CC = f"{sys.executable} -c 'raise SystemExit(1)'"


# A compiler that fails is a WARNING (printed without any logging set up); the others INFO.
@pytest.mark.parametrize("env,reason,warns", [({hostcopy.ENV: "0"}, "HICACHE_NATIVE_COPY=0", False),
                                              ({"CC": "/nonexistent/cc"}, "no C compiler", False),
                                              ({"CC": FAILING_CC}, "failed", True)])
def test_fallback_is_chosen_and_says_why(tmp_path, env, reason, warns):
    code = ("import numpy as np; from engine.cache import hostcopy\n"
            "a = np.arange(64, dtype=np.uint8); b = np.zeros(64, np.uint8)\n"
            "hostcopy.copy_chunks(b.ctypes.data, a.ctypes.data, np.array([0]), np.array([8]), 8)\n"
            "assert list(b[:8]) == list(range(8, 16)); print(hostcopy.copy_path())")
    res = fresh(code, XDG_CACHE_HOME=str(tmp_path), TMPDIR=str(tmp_path), **env)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("python (") and reason in res.stdout, res.stdout
    assert ("host copies: python (" in res.stderr) == warns, res.stderr
