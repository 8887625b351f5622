"""``convert-layout`` throughput against a plain copy of the same store, same disk, same run.

Builds a legacy TP2 file store of at least ``--gb`` GiB (``KVLayout(8 layers, 8 kv-heads,
head_dim 128, page 64, float16)``: 2 MiB pages, two 1 MiB objects per page), then times four
conversions in a chain, each against ``cp -r`` of its own source store:

1. legacy ``tp=2`` → ``unified:tp=2,pp=2`` (each legacy object split in two layer chunks);
2. that → ``unified:tp=2,pp=1`` (the chunks joined again);
3. that → unified, default grid (16 objects of 128 KiB per page: a cut along the heads);
4. that → ``unified:layers=8,heads=8+page_first`` (one object per page, assembled from 16 and
   transposed to token-major order).

In 1 and 2 every target payload is whole runs of source files, copied in the kernel
(``copy_file_range``, as ``cp`` does); in 3 and 4 payloads are cut or transposed in memory and
written from user memory (the ``kernel_copied_bytes`` column says which).

A conversion is timed as the command does it (``plan``: list and read every header, check the
destination; ``run``: read, verify checksums, cut, encode, write with atomic renames), in this
process (no interpreter start-up). Every timed operation starts after an untimed ``sync`` so that
neither side pays for the other's writeback, and writes a directory of its own: nothing is
deleted between the timed operations of a step. Deleting is left to the end of a step, followed
by ``sync`` and ``--settle`` seconds of waiting, because on ext4 without a journal (the
development VM's disk) creating a file scans past every inode of its block group freed in the
last 60 s — 300 s while that inode's table block is dirty, as the next creates make it — and
after the thousands of deletes of a previous copy a create took up to 1 ms (``perf``:
``recently_deleted`` under ``__ext4_new_inode``): a penalty on whoever creates the most files
next, not a cost of either operation. Each pair alternates which goes first (``--first``
says which does in the first pair); the best
of ``--repeat`` is reported, with the per-pair ratios (a copy and a conversion run back to back)
as the noise indicator. Speed is source bytes per second; the ratio is convert / copy speed.

Two timings of every operation are reported. The main one (``copy_s``, ``convert_s``,
``ratio``, ``pair_ratios``) stops when the operation returns: its bytes are in the page cache,
not yet on disk (neither ``cp`` nor ``convert-layout`` syncs). The ``durable`` block stops after a
``sync`` run right after it, inside the timing, for both sides alike: the bytes are on disk.
``sync`` flushes the whole machine, so another job's writes land in it too. ``copy_cpu_s`` and
``convert_cpu_s`` give each operation's ``[user, system]`` CPU seconds (``cp``'s from its child
accounting, the conversion's from this process); ``copy_mem_free_gb`` and
``convert_mem_free_gb`` the free memory when each started (on the development VM, writes into
the page cache cost several times more CPU when the kernel hands out memory the host has not
backed yet; docs/storage.md).

    .venv/bin/python benchmarks/bench_convert.py [--gb 2] [--dir DIR] [--repeat 2] [--json]
        [--settle 300] [--workers N] [--only 3] [--first copy|convert]

``--only N[,N...]`` times only those steps (1-4); the steps before them are run once, untimed,
to make their sources, and nothing is deleted before the timed steps (so no settling is
needed there). ``--only 3`` times the head cut alone.

``--sglang`` times SGLang file stores instead (docs/sglang-stores.md): the source is an SGLang
``HiCacheFile`` store of TP2, host layout ``page_first`` (the same model: 1 MiB per rank file,
two per page, named ``{page_hash}_bench_{rank}_2.bin``, written here in SGLang's byte layout,
which the tests check against SGLang's own writer), and the steps are

1. SGLang ``tp=2`` → SGLang ``tp=1`` (heads merged: one 2 MiB file per page);
2. SGLang ``tp=2`` → a hicache unified store (default grid).

Each is paired with ``cp -r`` of the same source, interleaved; the median pair ratio and CPU
seconds per GB of source (``cpu_s_per_gb``, user + system) are printed for both sides.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from typing import NamedTuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from engine.cache.pool import HostPool  # noqa: E402
from engine.core.hashing import namespace_seed, page_hashes  # noqa: E402
from engine.core.layout import KVLayout  # noqa: E402
from engine.storage import L3Store  # noqa: E402
from engine.storage.backends.file import FileBackend  # noqa: E402
from engine.storage.config import FileStoreConfig  # noqa: E402
from engine.storage.convert import plan, run  # noqa: E402
from engine.storage.endpoints import open_endpoint  # noqa: E402
from engine.storage.placement import Placement  # noqa: E402

MODEL = KVLayout(num_layers=8, kv_heads=8, head_dim=128, page_size=64, dtype="float16")
CHUNK = 64
STEPS = [("legacy tp=2 -> unified:tp=2,pp=2", "unified:tp=2,pp=2"),
         ("unified:tp=2,pp=2 -> unified:tp=2,pp=1", "unified:tp=2,pp=1"),
         ("unified:tp=2,pp=1 -> unified (default grid)", "unified"),
         ("default grid -> layers=8,heads=8+page_first", "unified:layers=8,heads=8+page_first")]


def build_source(root: str, gib: float) -> int:
    """A legacy TP2 store of >= gib GiB; returns its bytes on disk (objects only)."""
    pages = -(-int(gib * (1 << 30)) // MODEL.page_bytes)
    b = FileBackend(FileStoreConfig(dir=root))
    shards = [MODEL.shard(2, r) for r in range(2)]
    stores = [L3Store(b, s, placement=Placement("legacy", tp=(r, 2)))
              for r, s in enumerate(shards)]
    pools = [HostPool(s, CHUNK, host_layout="page_first") for s in shards]
    g = torch.Generator().manual_seed(0)
    for pool in pools:
        pool.buf.copy_(torch.randn(pool.buf.shape, generator=g).to(pool.buf.dtype))
    seed = namespace_seed(uuid.uuid4().hex)
    hs = page_hashes(np.arange(pages * MODEL.page_size) % 50_000, MODEL.page_size, seed)
    for s in range(0, pages, CHUNK):
        chunk = hs[s:s + CHUNK]
        for st, pool in zip(stores, pools):
            pool.buf[0, 0, 0, 0, 0] += 1             # pages differ from chunk to chunk
            assert st.put_pages(chunk, pool, list(range(len(chunk)))) == len(chunk)
    for st in stores:
        st.close(close_backend=False)
    used, _ = b.usage()
    b.close()
    return used


SG_GEOMETRY = ("model=bench&layers=8&kv_heads=8&head_dim=128&dtype=fp16&page_size=64"
               "&layout=page_first")
SG_STEPS = [("sglang tp=2 page_first -> sglang tp=1", "sglang-file:{out}?tp=1"),
            ("sglang tp=2 page_first -> hicache unified", "{out}")]


def build_sglang_source(root: str, gib: float) -> int:
    """An SGLang TP2 ``page_first`` store of >= gib GiB; returns its bytes."""
    from engine.storage.sglang_geometry import geometry, parse_spec

    _, f = parse_spec(f"sglang-file:{root}?{SG_GEOMETRY}&tp=2")
    g = geometry(f, "bench")
    ranks = g.ranks()
    pages = -(-int(gib * (1 << 30)) // g.page_bytes())
    os.makedirs(root, exist_ok=True)
    rng = np.random.default_rng(0)
    bufs = [rng.integers(0, 255, r.nbytes, dtype=np.uint8) for r in ranks]
    hs = page_hashes(np.arange(pages * g.page_size) % 50_000, g.page_size)
    for i, h in enumerate(hs):
        for r, buf in zip(ranks, bufs):
            buf[:8] = np.frombuffer(i.to_bytes(8, "little"), np.uint8)   # pages differ
            buf.tofile(os.path.join(root, f"{h.hex()}{r.suffix}.bin"))
    return pages * sum(r.nbytes for r in ranks)


def time_sglang_convert(src: str, dst: str, workers: int | None) -> Timed:
    from engine.storage import sglang_convert as sc

    def do() -> dict:
        p = sc.plan(f"sglang-file:{src}?{SG_GEOMETRY}&tp=2", dst, model_tag="bench")
        try:
            res = sc.run(p, workers=workers)
        finally:
            sc.close(p)
        return {**p.summary, **res.counts}
    return _timed(do, False)


def sglang_main(a, work: str) -> None:
    src = os.path.join(work, "sg")
    t0 = time.perf_counter()
    nbytes = build_sglang_source(src, a.gb)
    print(f"source: SGLang tp=2 page_first, {nbytes / 1e9:.2f} GB in "
          f"{time.perf_counter() - t0:.0f} s", file=sys.stderr)
    settle([], a.settle)
    rows = []
    for i, (name, dst) in enumerate(SG_STEPS):
        if a.only and str(i + 1) not in a.only.split(","):
            continue
        copies, convs, outs = [], [], []
        for r in range(a.repeat):
            order = ("copy", "convert") if (a.first == "copy") == (r % 2 == 0) else \
                ("convert", "copy")
            for which in order:
                out = os.path.join(work, f"sg{i}-{which}{r}")
                outs.append(out)
                if which == "copy":
                    copies.append(time_copy(src, out))
                else:
                    convs.append(time_sglang_convert(src, dst.format(out=out), a.workers))
        info = convs[-1].info
        gb = nbytes / 1e9
        row = {"conversion": name, "bytes_in": nbytes, "pages": info["pages"],
               "objects_out": info["objects_out"],
               **_ratios([c.s for c in copies], [t.s for t in convs], nbytes),
               "durable": _ratios([c.durable_s for c in copies], [t.durable_s for t in convs],
                                  nbytes),
               "copy_cpu_s_per_gb": [round((c.user + c.sys) / gb, 2) for c in copies],
               "convert_cpu_s_per_gb": [round((t.user + t.sys) / gb, 2) for t in convs],
               "load_avg_after": load()}
        rows.append(row)
        print(f"{name:44s} {gb:5.2f} GB  {info['pages']} pages -> {info['objects_out']} "
              f"objects\n"
              f"  page cache: copy {_secs(row['all_copy_s'])} s  convert "
              f"{_secs(row['all_convert_s'])} s  pairs {_secs(row['pair_ratios'])}  median "
              f"{row['median_pair_ratio']:.2f}\n"
              f"  + sync:     pairs {_secs(row['durable']['pair_ratios'])}  median "
              f"{row['durable']['median_pair_ratio']:.2f}\n"
              f"  cpu-s/GB: copy {_secs(row['copy_cpu_s_per_gb'])}  convert "
              f"{_secs(row['convert_cpu_s_per_gb'])}", file=sys.stderr)
        settle(outs, a.settle if i + 1 < len(SG_STEPS) else 0)
    if a.json:
        print(json.dumps({"cpus": os.cpu_count(), "workers": a.workers, "gb": a.gb,
                          "load_avg": load(), "rows": rows}, indent=2))


def sync() -> None:
    subprocess.run(["sync"], check=False)


class Timed(NamedTuple):
    """One timed operation: seconds until it returned, seconds until its bytes were on disk
    (``sync`` right after it, inside the timing), its CPU seconds, the conversion's counts."""

    s: float
    durable_s: float
    user: float
    sys: float
    info: dict
    mem_free_gb: float | None    # MemFree when it started (Linux)


def mem_free_gb() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemFree:"):
                    return round(int(line.split()[1]) / 2**20, 2)
    except OSError:
        pass
    return None


def _timed(do, children: bool) -> Timed:
    sync()
    free = mem_free_gb()
    c0, t0 = os.times(), time.perf_counter()
    info = do()
    t1, c1 = time.perf_counter(), os.times()
    sync()
    t2 = time.perf_counter()
    if children:
        user, system = c1.children_user - c0.children_user, c1.children_system - c0.children_system
    else:
        user, system = c1.user - c0.user, c1.system - c0.system
    return Timed(t1 - t0, t2 - t0, user, system, info or {}, free)


def time_copy(src: str, dst: str) -> Timed:
    return _timed(lambda: subprocess.run(["cp", "-r", src, dst], check=True) and None, True)


def time_convert(src: str, dst: str, to: str, workers: int | None) -> Timed:
    def do() -> dict:
        s_ep = open_endpoint(src, source=True)
        d_ep = open_endpoint(dst, source=False)
        p = plan(s_ep, d_ep, to)
        res = run(p, s_ep, d_ep, workers=workers)
        s_ep.close()
        d_ep.close()
        return {**p.summary(), **res.counts}
    return _timed(do, False)


def settle(paths: list[str], seconds: float) -> None:
    """Delete ``paths`` (untimed), then let the freed inodes age (see the module docstring)."""
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)
    sync()
    if seconds > 0:
        print(f"settling {seconds:.0f} s after deleting", file=sys.stderr)
        time.sleep(seconds)


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, default=2.0, help="source size in GiB (default 2)")
    ap.add_argument("--dir", default=None, help="work directory (default: a temp dir)")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--settle", type=float, default=300.0,
                    help="seconds to wait after deleting, before timing (default 300)")
    ap.add_argument("--workers", type=int, default=None,
                    help="convert-layout worker threads (default: its own default)")
    ap.add_argument("--only", default=None,
                    help="time only these steps, e.g. 3 or 1,3 (default: all four)")
    ap.add_argument("--first", choices=("copy", "convert"), default="copy",
                    help="which of a pair runs first in the first pair (then alternating)")
    ap.add_argument("--sglang", action="store_true",
                    help="time SGLang file stores (TP2 -> TP1, TP2 -> hicache unified)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if not a.gb > 0 or a.repeat < 1 or a.settle < 0:
        ap.error("--gb must be > 0, --repeat >= 1 and --settle >= 0")
    try:
        steps = SG_STEPS if a.sglang else STEPS
        only = sorted({int(x) for x in a.only.split(",")}) if a.only else \
            list(range(1, len(steps) + 1))
        if not all(1 <= x <= len(steps) for x in only):
            raise ValueError
    except ValueError:
        ap.error(f"--only takes step numbers 1-{len(steps)}, comma-separated")
    try:
        if a.dir:
            os.makedirs(a.dir, exist_ok=True)
        work = tempfile.mkdtemp(prefix="bench-convert-", dir=a.dir)
    except OSError as e:
        sys.exit(f"bench_convert: cannot use --dir {a.dir}: {e.strerror or e}")
    try:
        free = shutil.disk_usage(work).free
        need = (2 * a.repeat + 2.5) * a.gb * (1 << 30)
        if free < need:
            sys.exit(f"bench_convert: {free / 2**30:.1f} GiB free in {work}; needs about "
                     f"{need / 2**30:.1f} (use --gb, --repeat or --dir)")
        if a.sglang:
            sglang_main(a, work)
            return
        src = os.path.join(work, "s0")
        t0 = time.perf_counter()
        nbytes = build_source(src, a.gb)
        print(f"source: legacy tp=2, {nbytes / 1e9:.2f} GB in {time.perf_counter() - t0:.0f} s",
              file=sys.stderr)
        settle([], a.settle)
        rows = []
        for i, (name, to) in enumerate(STEPS[:only[-1]]):
            src = os.path.join(work, f"s{i}")
            if i + 1 in only:
                rows.append(step(i, name, to, src, work, a, last=i + 1 == only[-1]))
            else:                       # untimed: only the next step's source
                time_convert(src, os.path.join(work, f"s{i + 1}"), to, a.workers)
        if a.json:
            print(json.dumps({"cpus": os.cpu_count(), "workers": a.workers, "first": a.first,
                              "load_avg": load(), "rows": rows}, indent=2))
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _secs(xs: list, digits: int = 2) -> str:
    return " / ".join("?" if x is None else f"{x:.{digits}f}" for x in xs)


def _cpu(xs: list[list[float]]) -> str:
    return " / ".join(f"{u:.2f}+{s:.2f}" for u, s in xs)


def _ratios(copies: list[float], convs: list[float], nbytes: int) -> dict:
    """Best-of and per-pair figures of one timing (ratio: copy seconds / convert seconds)."""
    pairs = [round(c / t, 3) for c, t in zip(copies, convs)]
    best_copy, best_conv = min(copies), min(convs)
    return {"copy_s": round(best_copy, 3), "convert_s": round(best_conv, 3),
            "copy_gbps": round(nbytes / best_copy / 1e9, 3),
            "convert_gbps": round(nbytes / best_conv / 1e9, 3),
            "ratio": round(best_copy / best_conv, 3), "pair_ratios": pairs,
            "median_pair_ratio": round(statistics.median(pairs), 3),
            "all_copy_s": [round(t, 3) for t in copies],
            "all_convert_s": [round(t, 3) for t in convs]}


def step(i: int, name: str, to: str, src: str, work: str, a, last: bool) -> dict:
    """Time ``--repeat`` pairs of (cp -r, convert) of ``src``; keeps the last conversion as the
    next step's source and deletes everything else."""
    copies: list[Timed] = []
    convs: list[Timed] = []
    outs: list[str] = []
    load_before = load()
    pair_load: list[float] = []       # 1-minute load average after each pair
    for r in range(a.repeat):
        order = ("copy", "convert") if a.first == "copy" else ("convert", "copy")
        for which in (order if r % 2 == 0 else order[::-1]):
            out = os.path.join(work, f"s{i}-{which}{r}")
            outs.append(out)
            if which == "copy":
                copies.append(time_copy(src, out))
            else:
                convs.append(time_convert(src, out, to, a.workers))
        pair_load.append(load()[0])
    info = convs[-1].info
    src_bytes = info["bytes_in"]
    row = {"conversion": name, "bytes_in": src_bytes, "objects_in": info["objects_in"],
           "objects_out": info["objects_out"],
           **_ratios([c.s for c in copies], [t.s for t in convs], src_bytes),
           "pair_load_avg": pair_load,
           "kernel_copied_bytes": info["kernel_copied_bytes"],
           "durable": _ratios([c.durable_s for c in copies], [t.durable_s for t in convs],
                              src_bytes),
           "copy_cpu_s": [[round(c.user, 2), round(c.sys, 2)] for c in copies],
           "convert_cpu_s": [[round(t.user, 2), round(t.sys, 2)] for t in convs],
           "copy_mem_free_gb": [c.mem_free_gb for c in copies],
           "convert_mem_free_gb": [t.mem_free_gb for t in convs],
           "load_avg_before": load_before, "load_avg_after": load()}
    kernel = info["kernel_copied_bytes"] / max(1, info["bytes_out"])
    dur = row["durable"]
    print(f"{name:46s} {src_bytes / 1e9:5.2f} GB  {info['objects_in']:6d} -> "
          f"{info['objects_out']:6d} objects  kernel-copied {kernel:4.0%}\n"
          f"  page cache: copy {_secs(row['all_copy_s'])} s  convert "
          f"{_secs(row['all_convert_s'])} s  pairs {_secs(row['pair_ratios'])}  best/best "
          f"{row['ratio']:.2f}\n"
          f"  + sync:     copy {_secs(dur['all_copy_s'])} s  convert "
          f"{_secs(dur['all_convert_s'])} s  pairs {_secs(dur['pair_ratios'])}  best/best "
          f"{dur['ratio']:.2f}\n"
          f"  cpu user+sys: copy {_cpu(row['copy_cpu_s'])}  convert "
          f"{_cpu(row['convert_cpu_s'])}\n"
          f"  free memory GB at start: copy {_secs(row['copy_mem_free_gb'], 1)}  convert "
          f"{_secs(row['convert_mem_free_gb'], 1)}\n"
          f"  load after each pair {_secs(pair_load, 1)}  load "
          f"{row['load_avg_before'][0]:.1f}-{row['load_avg_after'][0]:.1f}",
          file=sys.stderr)
    keep = [o for o in outs if "-convert" in os.path.basename(o)][-1]
    os.rename(keep, os.path.join(work, f"s{i + 1}"))
    if not last:
        settle([src, *[o for o in outs if o != keep]], a.settle)
    return row


if __name__ == "__main__":
    main()
