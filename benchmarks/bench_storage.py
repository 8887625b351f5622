"""L3 storage throughput: the full page path against the backend's raw bytes, same run.

For each backend (memory, file, mooncake) and each object size — 64-token pages of the tiny model
(``KVLayout(4 layers, 2 kv-heads, head_dim 64, page 64, float32)``: 256 KiB) and 1 MiB pages
(page 256) — this times

* ours: ``L3Store.put_pages`` / ``get_pages`` between a ``page_first`` host pool and the store
  (on a one-cell grid: one object per page)
  (existence check, header + XXH3 checksum, atomic write; on read, header/layout/checksum
  verification), in batches as the store issues them. The pool is filled the way the cache
  fills L2 — a backup from an L1 pool into a pool the store is bound to — so, as in the cache,
  the payload checksum was computed when the page landed in L2 and the put does not read the
  page a second time (that pass is part of the backup, untimed here);
* raw: the same number of objects of the same size moved the plainest way the backend allows —
  memory: a dict of bytes and a copy out; file: ``open/write/close`` and ``open/readinto/close``
  of plain files in one directory of the same filesystem; mooncake: the client's own
  ``batch_put_from`` / ``batch_get_into`` on registered memory, in the store's
  default batch size (about 8 MiB), fixed whatever the store under test is tuned to.

Each pair of runs times ours and raw back to back, alternating which goes first; file puts start
from a ``sync`` (untimed) so that neither side pays for the other's writeback. Reported: GB/s
(1e9 bytes/s of payload + header) of the best of ``--repeat`` runs each, their ratio, and the
median of the per-pair ratios as a noise indicator — on a shared machine the best run is the
closest to the hardware; the verdict needs both. A
``mooncake_master`` is started on free 127.0.0.1 ports unless ``--mooncake-config FILE`` points
at a running cluster.

    .venv/bin/python benchmarks/bench_storage.py [--backends memory,file,mooncake]
        [--mib 64] [--repeat 9] [--dir DIR] [--grid default] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from engine.cache.pool import DevicePool, HostPool  # noqa: E402
from engine.cache.transfer import OpKind, TransferEngine  # noqa: E402
from engine.core.hashing import namespace_seed, page_hashes  # noqa: E402
from engine.core.layout import KVLayout  # noqa: E402
from engine.storage import L3Store, StorageConfig, make_backend  # noqa: E402
from engine.storage.config import FileStoreConfig  # noqa: E402
from engine.storage.placement import Placement  # noqa: E402

SIZES = {
    "page 256KiB": KVLayout(num_layers=4, kv_heads=2, head_dim=64, page_size=64),
    "page 1MiB": KVLayout(num_layers=4, kv_heads=2, head_dim=64, page_size=256),
}


class Raw:
    """The backend's plainest way to move n objects of `size` bytes."""

    def __init__(self, kind: str, backend, size: int, n: int, batch: int, workdir: str):
        self.kind, self.size, self.n, self.batch = kind, size, n, batch
        self.src = np.random.default_rng(0).integers(0, 256, (n, size), dtype=np.uint8)
        self.dst = np.zeros((n, size), dtype=np.uint8)
        if kind == "memory":
            self.d: dict[str, bytes] = {}
        elif kind == "file":
            self.dir = tempfile.mkdtemp(prefix="raw-", dir=workdir)
        else:
            self.client = backend.client
            for a in (self.src, self.dst):
                backend.register_memory(a)
        self.keys: list[str] = []

    def put(self) -> float:
        self.cleanup()
        self.keys = [uuid.uuid4().hex for _ in range(self.n)]
        t0 = time.perf_counter()
        if self.kind == "memory":
            for k, row in zip(self.keys, self.src):
                self.d[k] = row.tobytes()
        elif self.kind == "file":
            for k, row in zip(self.keys, self.src):
                with open(os.path.join(self.dir, k), "wb") as f:
                    f.write(row)
        else:
            for s in range(0, self.n, self.batch):
                ks = self.keys[s:s + self.batch]
                rc = self.client.batch_put_from(
                    ks, [int(self.src[i].ctypes.data) for i in range(s, s + len(ks))],
                    [self.size] * len(ks))
                assert all(r == 0 for r in rc), rc
        return time.perf_counter() - t0

    def get(self) -> float:
        t0 = time.perf_counter()
        if self.kind == "memory":
            for k, row in zip(self.keys, self.dst):
                row[:] = np.frombuffer(self.d[k], dtype=np.uint8)
        elif self.kind == "file":
            for k, row in zip(self.keys, self.dst):
                with open(os.path.join(self.dir, k), "rb", buffering=0) as f:
                    assert f.readinto(row) == self.size
        else:
            for s in range(0, self.n, self.batch):
                ks = self.keys[s:s + self.batch]
                rc = self.client.batch_get_into(
                    ks, [int(self.dst[i].ctypes.data) for i in range(s, s + len(ks))],
                    [self.size] * len(ks))
                assert all(r == self.size for r in rc), rc
        dt = time.perf_counter() - t0
        assert np.array_equal(self.src, self.dst)
        self.dst[:] = 0
        return dt

    def cleanup(self) -> None:
        if not self.keys:
            return
        if self.kind == "memory":
            self.d.clear()
        elif self.kind == "file":
            for k in self.keys:
                os.unlink(os.path.join(self.dir, k))
        else:
            self.client.batch_remove(self.keys, True)
        self.keys = []


class Ours:
    def __init__(self, backend, layout: KVLayout, n: int, deadline_s: float = 0.0,
                 grid: str | None = None):
        # Default: a one-cell grid, each page one object like the raw side. --grid default
        # (or any grid) measures the unified layout's cut of a page into several objects
        # against raw whole-page objects (docs/storage.md, "Unified layout").
        self.store = L3Store(backend, layout, placement=Placement(
            grid=grid or f"layers={layout.num_layers},heads={layout.kv_heads}"),
            deadline_s=deadline_s)
        self.n = n
        self.src = HostPool(layout, n, host_layout="page_first")
        # Pages reach L2 the way the cache writes them: a backup from L1 into a pool the
        # store is bound to, which checksums each page as it lands (untimed here; the put
        # then reuses the checksum instead of reading the page twice).
        self.store.bind(self.src)
        l1 = DevicePool(layout, n)
        l1.buf.copy_(torch.randn(l1.buf.shape, generator=torch.Generator().manual_seed(0)))
        eng = TransferEngine("cpu")
        eng.submit(eng.new_op(OpKind.BACKUP, l1, np.arange(n), self.src, np.arange(n),
                              layout.num_layers)).wait()
        eng.close()
        self.dst = HostPool(layout, n, host_layout="page_first")
        self.pages = list(range(n))
        self.hashes: list = []
        self.backend = backend

    def put(self) -> float:
        self.cleanup()
        self.hashes = page_hashes(np.arange(self.n * self.src.layout.page_size),
                                  self.src.layout.page_size,
                                  seed=namespace_seed(uuid.uuid4().hex))
        t0 = time.perf_counter()
        assert self.store.put_pages(self.hashes, self.src, self.pages) == self.n
        return time.perf_counter() - t0

    def get(self) -> float:
        t0 = time.perf_counter()
        assert self.store.get_pages(self.hashes, self.dst, self.pages) == self.n
        dt = time.perf_counter() - t0
        assert torch.equal(self.src.buf, self.dst.buf)
        self.dst.buf.zero_()
        return dt

    def cleanup(self) -> None:
        if self.hashes:
            self.backend.delete(self.store.keys(self.hashes))
            self.hashes = []


def run_backend(kind: str, cfg: StorageConfig, mib: int, repeat: int, workdir: str,
                deadline_s: float = 0.0, grid: str | None = None) -> list:
    backend = make_backend(cfg)
    rows = []
    try:
        for label, layout in SIZES.items():
            ours = Ours(backend, layout, max(1, (mib << 20) // layout.page_bytes),
                        deadline_s, grid)
            # raw batches: the store's default batch size, fixed whatever ours is tuned to
            raw_batch = max(1, min(32, (8 << 20) // layout.page_bytes))
            raw = Raw(kind, backend, ours.store.object_size, ours.n, raw_batch, workdir)
            nbytes = ours.n * ours.store.object_size
            for side in (ours, raw):      # warm up: first touches of store memory, dirs
                side.put()
                side.get()
            for op in ("put", "get"):
                # ours and raw back to back, the order alternating from pair to pair (neither
                # side always inherits the other's cache state or writeback); before a file put
                # the dirty pages of the previous run are flushed, untimed, so that writeback
                # throttling lands on neither side.
                t_o, t_r = [], []
                for k in range(repeat):
                    for side, ts in ((ours, t_o), (raw, t_r))[::1 if k % 2 == 0 else -1]:
                        if op == "put" and kind == "file":
                            os.sync()
                        ts.append(getattr(side, op)())
                rows.append({"backend": kind, "objects": label, "op": op, "n": ours.n,
                             "ours_gbps": round(nbytes / min(t_o) / 1e9, 3),
                             "raw_gbps": round(nbytes / min(t_r) / 1e9, 3),
                             "ratio": round(min(t_r) / min(t_o), 3),
                             "ratio_median": round(statistics.median(
                                 r / o for o, r in zip(t_o, t_r)), 3)})
            ours.cleanup()
            raw.cleanup()
            ours.store.close(close_backend=False)
    finally:
        backend.close()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backends", default="memory,file,mooncake")
    ap.add_argument("--mib", type=int, default=64, help="MiB moved per run and object size")
    ap.add_argument("--repeat", type=int, default=9)
    ap.add_argument("--dir", help="directory for the file store (default: a temp dir)")
    ap.add_argument("--mooncake-config", help="JSON config of a running Mooncake cluster")
    ap.add_argument("--grid", default=None, help="unified-layout grid of ours, e.g. default "
                    "or layers=2,heads=1 (default: one object per page)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--deadline-s", type=float, default=0.0,
                    help="L3Store call deadline (the server's default is 5; 0 = unguarded "
                         "zero-copy gets, the default here)")
    args = ap.parse_args()

    workdir = args.dir or tempfile.mkdtemp(prefix="bench-storage-")
    master = None
    rows: list = []
    try:
        for kind in args.backends.split(","):
            if kind == "memory":
                cfg = StorageConfig("memory")
            elif kind == "file":
                cfg = StorageConfig("file", file=FileStoreConfig(
                    dir=os.path.join(workdir, "store")))
            elif kind == "mooncake":
                if args.mooncake_config:
                    cfg = StorageConfig.from_json_file(args.mooncake_config)
                else:
                    from tests.mooncake_master import MooncakeMaster
                    master = MooncakeMaster(os.path.join(workdir, "mooncake")).start()
                    cfg = StorageConfig("mooncake", mooncake=master.config(
                        global_segment_size=(4 * args.mib + 64) << 20,
                        local_buffer_size=256 << 20, staging_bytes=64 << 20))
            else:
                raise SystemExit(f"unknown backend {kind!r}")
            rows += run_backend(kind, cfg, args.mib, args.repeat, workdir, args.deadline_s,
                                args.grid)
    finally:
        if master is not None:
            master.stop()
        if not args.dir:
            shutil.rmtree(workdir, ignore_errors=True)

    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{'backend':9} {'objects':12} {'op':4} {'n':>4} {'ours GB/s':>10} {'raw GB/s':>9} "
          f"{'ratio':>6} {'median':>7}")
    for r in rows:
        print(f"{r['backend']:9} {r['objects']:12} {r['op']:4} {r['n']:4d} "
              f"{r['ours_gbps']:10.3f} {r['raw_gbps']:9.3f} {r['ratio']:6.2f} "
              f"{r['ratio_median']:7.2f}")
    low = [f"{r['backend']} {r['objects']} {r['op']}" for r in rows
           if min(r["ratio"], r["ratio_median"]) < 0.8]
    print("target ratio >= 0.8:", "met" if not low else "missed by " + "; ".join(low))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
