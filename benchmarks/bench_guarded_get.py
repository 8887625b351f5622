"""What the deadline guard costs a get: ``L3Store.get_pages`` from a file store with
``deadline_s`` 0 (unguarded, zero copy into the pool) vs 5 (the server's default: guarded,
read into staging rows and copied into the pool), interleaved in one process.

    python benchmarks/bench_guarded_get.py --page-mib 1 --repeat 7

Prints GB/s (best and median of ``--repeat``) for both and the ratio of the best runs.
Figures: docs/reliability.md.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from engine.cache.pool import HostPool  # noqa: E402
from engine.core.hashing import namespace_seed, page_hashes  # noqa: E402
from engine.core.layout import KVLayout  # noqa: E402
from engine.storage import L3Store  # noqa: E402
from engine.storage.backends.file import FileBackend  # noqa: E402
from engine.storage.config import FileStoreConfig  # noqa: E402
from engine.storage.placement import Placement  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--page-mib", type=int, default=1, help="page size in MiB (one object)")
    ap.add_argument("--mib", type=int, default=64, help="MiB read per run")
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args()
    layout = KVLayout(num_layers=8, kv_heads=4, head_dim=64, page_size=64 * args.page_mib)
    n = max(1, (args.mib << 20) // layout.page_bytes)
    root = tempfile.mkdtemp(prefix="bench-guard-")
    try:
        backend = FileBackend(FileStoreConfig(dir=root))
        grid = Placement(grid=f"layers={layout.num_layers},heads={layout.kv_heads}")
        stores = {d: L3Store(backend, layout, placement=grid, deadline_s=d) for d in (0.0, 5.0)}
        src = HostPool(layout, n, host_layout="page_first")
        src.buf.normal_()
        dst = HostPool(layout, n, host_layout="page_first")
        hs = page_hashes(np.arange(n * layout.page_size), layout.page_size,
                         seed=namespace_seed("bench-guard"))
        pages = list(range(n))
        assert stores[0.0].put_pages(hs, src, pages) == n
        times: dict[float, list[float]] = {0.0: [], 5.0: []}
        for r in range(args.repeat + 1):
            for d in ((0.0, 5.0) if r % 2 else (5.0, 0.0)):
                t = time.perf_counter()
                assert stores[d].get_pages(hs, dst, pages) == n
                if r:                       # the first round warms both up
                    times[d].append(time.perf_counter() - t)
        nbytes = n * layout.page_bytes
        best = {d: nbytes / min(ts) / 1e9 for d, ts in times.items()}
        for d, ts in times.items():
            print(f"deadline_s {d:g}: best {best[d]:.2f} GB/s, median "
                  f"{nbytes / statistics.median(ts) / 1e9:.2f} GB/s ({n} pages of "
                  f"{layout.page_bytes >> 10} KiB)")
        print(f"guarded / unguarded (best): {best[5.0] / best[0.0]:.2f}")
        for s in stores.values():
            s.close(close_backend=False)
        backend.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
