"""L1 <-> L2 transfer throughput against a plain contiguous copy of the same bytes, same run.

For each host layout (``layer_first``, ``page_first``) and page size (16, 64) this times, through
the cache's own :class:`~engine.cache.transfer.TransferEngine` (the per-layer path the cache uses,
with per-layer completion):

* ``load``: L2 -> L1 load-back of ``--mib`` MiB of pages;
* ``backup``: L1 -> L2 backup of the same amount;

and, in the same run, the same number of bytes moved by one ``dst.copy_(src)`` between two
contiguous tensors on the same two devices (``load_raw`` / ``backup_raw``: host -> device and
device -> host). The pages of an op are scattered the way a busy allocator hands them out (a
seeded random sample of the pool, in random order; ``--pattern contiguous`` for runs instead).
Reported: GB/s (1e9 bytes/s) of the best of ``--repeat`` runs each and ``*_ratio`` = ours / raw.
On a machine without CUDA both "devices" are host memory (L1 on CPU, as the CPU build runs), and
``copy_path`` in the output says which host copy loop ran: ``native`` (the C loop,
engine/cache/hostcopy.py) or ``python`` (the fallback; ``HICACHE_NATIVE_COPY=0`` forces it).
On CUDA each row's ``copy_path`` says how L2 was reached: ``mapped`` (pinned L2 seen in the
device's address space, gather/scatter kernels move the pages; the default) or ``staged``
(gather into a temporary, copy, scatter; ``HICACHE_UVA_COPY=0`` forces it).

    .venv/bin/python benchmarks/bench_transfer.py [--mib 128] [--repeat 30] [--json]
        [--layers 8 --kv-heads 8 --head-dim 128 --dtype bfloat16] [--pattern scattered]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np
import torch

from engine.cache.hostcopy import copy_path
from engine.cache.pool import DevicePool, HostLayout, HostPool, _host_buffer
from engine.cache.transfer import OpKind, TransferEngine
from engine.core.layout import KVLayout


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _time(fn, device: str) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process: all its threads) of one call."""
    w0, c0 = time.perf_counter(), time.process_time()
    fn()
    _sync(device)
    return time.perf_counter() - w0, time.process_time() - c0


def _pages(n: int, pool_pages: int, pattern: str, rng: np.random.Generator) -> np.ndarray:
    if pattern == "contiguous":
        start = int(rng.integers(0, pool_pages - n + 1))
        return np.arange(start, start + n, dtype=np.int64)
    return rng.choice(pool_pages, size=n, replace=False).astype(np.int64)


def bench_one(host_layout: str, page_size: int, args, device: str) -> dict:
    lay = KVLayout(num_layers=args.layers, kv_heads=args.kv_heads, head_dim=args.head_dim,
                   page_size=page_size, dtype=args.dtype)
    page_bytes = (lay.num_layers * lay.kv_kinds * page_size * lay.kv_heads * lay.head_dim
                  * torch.tensor([], dtype=lay.torch_dtype).element_size())
    n = max(1, (args.mib << 20) // page_bytes)
    pool_pages = 2 * n
    pin = device.startswith("cuda")
    l1 = DevicePool(lay, pool_pages, device)
    l2 = HostPool(lay, pool_pages, host_layout, pin=pin)
    l1.buf.normal_()
    l2.buf.normal_()
    rng = np.random.default_rng(args.seed)
    eng = TransferEngine(device)

    def run(kind, src, src_pages, dst, dst_pages):  # one op through the engine, waited for
        op = eng.submit(eng.new_op(kind, src, src_pages, dst, dst_pages, lay.num_layers))
        op.wait()
        assert not op.failed

    l1_pages = _pages(n, pool_pages, args.pattern, rng)
    l2_pages = _pages(n, pool_pages, args.pattern, rng)
    nbytes = n * page_bytes
    elems = nbytes // l1.buf.element_size()
    host = torch.empty(elems, dtype=lay.torch_dtype, pin_memory=pin).normal_()
    dev = torch.empty(elems, dtype=lay.torch_dtype, device=device).normal_()
    # The same copy between buffers allocated like the pools (huge-page hint), to show what
    # is the copy loop and what is the allocation.
    hhost = host if pin else _host_buffer((elems,), lay.torch_dtype).normal_()
    hdev = dev if pin else _host_buffer((elems,), lay.torch_dtype).normal_()
    out = {"host_layout": host_layout, "page_size": page_size, "pages": int(n),
           "bytes": int(nbytes)}
    if pin:
        out["copy_path"] = "mapped" if l2.device_alias() is not None else "staged"
    for name, fn, raw, hraw in (
            ("load", lambda: run(OpKind.LOAD, l2, l2_pages, l1, l1_pages),
             lambda: dev.copy_(host, non_blocking=pin),
             lambda: hdev.copy_(hhost, non_blocking=pin)),
            ("backup", lambda: run(OpKind.BACKUP, l1, l1_pages, l2, l2_pages),
             lambda: host.copy_(dev, non_blocking=pin),
             lambda: hhost.copy_(hdev, non_blocking=pin))):
        # Pairs: ours then raw (then raw then ours), back to back, so both see the same
        # machine. Wall time on a shared machine swings with other load; CPU time (all
        # threads of this process) does not count time the copy was not running.
        fn()
        raw()
        _sync(device)
        ours_t, raw_t, huge_t = [], [], []
        for i in range(args.repeat):
            if i % 2:
                raw_t.append(_time(raw, device))
                huge_t.append(_time(hraw, device))
                ours_t.append(_time(fn, device))
            else:
                ours_t.append(_time(fn, device))
                huge_t.append(_time(hraw, device))
                raw_t.append(_time(raw, device))
        wall_o, wall_r = min(t[0] for t in ours_t), min(t[0] for t in raw_t)
        cpu_o, cpu_r = min(t[1] for t in ours_t), min(t[1] for t in raw_t)
        out[f"{name}_gbps"] = round(nbytes / wall_o / 1e9, 3)
        out[f"{name}_raw_gbps"] = round(nbytes / wall_r / 1e9, 3)
        out[f"{name}_ratio"] = round(wall_r / wall_o, 3)
        out[f"{name}_pair_median_ratio"] = round(statistics.median(
            r[0] / o[0] for o, r in zip(ours_t, raw_t)), 3)
        if not device.startswith("cuda"):
            out[f"{name}_cpu_ratio"] = round(cpu_r / max(cpu_o, 1e-9), 3)
            wall_h = min(t[0] for t in huge_t)
            out[f"{name}_hugepage_raw_gbps"] = round(nbytes / wall_h / 1e9, 3)
            out[f"{name}_vs_hugepage_raw"] = round(wall_h / wall_o, 3)
    # Correctness of what was timed: the last backup wrote l1's pages into l2.
    for layer in (0, lay.num_layers - 1):
        assert torch.equal(l2.get_layer(layer, l2_pages).to(device),
                           l1.get_layer(layer, l1_pages)), "transfer copied the wrong bytes"
    eng.close()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=128,
                    help="MiB per transfer op (a few thousand tokens of a real model; well "
                         "above the last-level cache)")
    ap.add_argument("--repeat", type=int, default=30, help="timed pairs (ours, raw) per figure")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--page-sizes", default="16,64")
    ap.add_argument("--layouts", default="layer_first,page_first")
    ap.add_argument("--pattern", choices=("scattered", "contiguous"), default="scattered")
    ap.add_argument("--device", default=None, help="L1 device (default: cuda if present)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    rows = []
    for host_layout in args.layouts.split(","):
        HostLayout.parse(host_layout)
        for ps in (int(x) for x in args.page_sizes.split(",")):
            rows.append(bench_one(host_layout, ps, args, device))
            if not args.json:
                r = rows[-1]
                print(f"{host_layout:12s} page {ps:3d}: load {r['load_gbps']:7.2f} GB/s "
                      f"(raw {r['load_raw_gbps']:7.2f}, ratio {r['load_ratio']:.2f})  "
                      f"backup {r['backup_gbps']:7.2f} GB/s (raw {r['backup_raw_gbps']:7.2f}, "
                      f"ratio {r['backup_ratio']:.2f})", flush=True)
    ratios = [r[k] for r in rows for k in ("load_ratio", "backup_ratio")]
    summary = {"device": device, "pattern": args.pattern, "threads": torch.get_num_threads(),
               "copy_path": copy_path() if device == "cpu" else rows[0].get("copy_path"),
               "layout": {"layers": args.layers, "kv_heads": args.kv_heads,
                          "head_dim": args.head_dim, "dtype": args.dtype},
               "results": rows, "min_ratio": min(ratios)}
    if args.json:
        json.dump(summary, sys.stdout, indent=2)
        print()
    else:
        print(f"min ratio {summary['min_ratio']:.2f}; host copies: {summary['copy_path']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
