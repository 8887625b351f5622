"""Generate synthetic rank logs (format v1, msgpack) for benchmarking ``consensus-check``.

One event stream per data-parallel group from ``engine.parallel.divergence.synthetic_decisions`` (a cache
under continuous batching: match, lock, restore/restore_done, unlock, backup/backup_done, evict,
pp_ack), written for every rank of the group. ``restore``/``backup`` carry ``local_slots``
(physical page ids, equal on every rank, as with a deterministic allocator).
``--local-diff-rate`` adds a rank-local timing ``local_us`` that differs between ranks to that
fraction of events (the checker's slow path); ``--inject`` breaks one rank with the engine's
divergence switch (engine/parallel/divergence.py).

    .venv/bin/python benchmarks/gen_ranklogs.py OUT_DIR [--ranks 8] [--events 2000000] [--dp 1]
        [--local-diff-rate 0.0] [--inject 'hit_length@rank=3,step=1000']
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from engine.cache.events import RankInfo  # noqa: E402
from engine.parallel.divergence import injector_for, synthetic_decisions  # noqa: E402
from formats.ranklog_writer import event_packer  # noqa: E402


def generate(out_dir: str, *, ranks: int = 8, events: int = 2_000_000, dp: int = 1,
             seed: int = 0, local_diff_rate: float = 0.0, inject: str | None = None,
             quiet: bool = False) -> list[str]:
    """Write ``rank{r}.ranklog`` for ``ranks`` ranks in ``dp`` groups; returns the paths."""
    if ranks < 1 or dp < 1 or ranks % dp:
        raise ValueError(f"ranks ({ranks}) must be a positive multiple of dp ({dp})")
    os.makedirs(out_dir, exist_ok=True)
    tp = ranks // dp
    pack = event_packer().pack
    paths = []
    for g in range(dp):
        t0 = time.perf_counter()
        evs = [{"seq": i, **d} for i, d in enumerate(synthetic_decisions(events, seed + g))]
        recs = list(map(pack, evs))
        rng = random.Random(seed * 7919 + g)
        diff_idx = (sorted(rng.sample(range(events), int(events * local_diff_rate)))
                    if local_diff_rate > 0 else [])
        for t in range(tp):
            r = g * tp + t
            info = RankInfo(rank=r, world_size=ranks, dp_rank=g, tp_rank=t, tp_size=tp)
            injector = injector_for(inject, r) if inject else None
            lat = random.Random(r)
            local = {i: lat.randrange(10, 5000) for i in diff_idx}
            mine = recs
            if injector is not None:       # every event through the mutator, as EventLog does
                mine = []
                for i, ev in enumerate(evs):
                    ev2 = dict(ev)
                    if i in local:
                        ev2["local_us"] = local[i]
                    mine.append(pack(injector(ev2)))
            elif local:
                mine = list(recs)
                for i, us in local.items():
                    mine[i] = pack({**evs[i], "local_us": us})
            path = os.path.join(out_dir, f"rank{r}.ranklog")
            with open(path, "wb") as fh:
                fh.write(pack(info.header()))
                fh.write(b"".join(mine))
            paths.append(path)
        if not quiet:
            size = sum(os.path.getsize(p) for p in paths[-tp:])
            print(f"group dp={g}: {tp} ranks x {events:,} events, {size / 1e6:.0f} MB, "
                  f"{time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return paths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--events", type=int, default=2_000_000, help="events per rank")
    ap.add_argument("--dp", type=int, default=1, help="data-parallel groups")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--local-diff-rate", type=float, default=0.0,
                    help="fraction of events with a rank-local timing that differs per rank")
    ap.add_argument("--inject", default=None, help="divergence spec, e.g. "
                    "'hit_length@rank=3,step=1000' (see engine/parallel/divergence.py)")
    a = ap.parse_args()
    generate(a.out_dir, ranks=a.ranks, events=a.events, dp=a.dp, seed=a.seed,
             local_diff_rate=a.local_diff_rate, inject=a.inject)


if __name__ == "__main__":
    main()
