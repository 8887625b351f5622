"""Capacity sweeps: one trace replayed at many (policy, L1 capacity) points, on every core.

The trace is parsed once by the caller and prepared once here (:class:`ReplayInput`, plus the
future index when ``opt`` is swept); worker processes inherit it (``fork``) or receive it once
each (other start methods), never per point. Points run in worker processes, the most
expensive first; each finished point is reported to ``on_point`` as it lands, so a caller can
drive a progress bar. Points replay page-level (one token per page, the same hits as a
token-level replay: :func:`~engine.sim.replay.replay`) and record no events: a sweep reports
hit rates only.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import gc
import multiprocessing
import os
from typing import Callable, Iterable, Sequence

from engine.cache.policy import policy_names
from engine.sim.replay import ReplayConfig, ReplayInput, replay


@dataclasses.dataclass(frozen=True)
class SweepPoint:
    policy: str
    l1_tokens: int


@dataclasses.dataclass(frozen=True)
class SweepRow:
    policy: str
    l1_tokens: int
    token_hit_rate: float
    cache_seconds: float

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# A trace carries no request priorities: ``priority`` would order exactly as ``lru`` does.
TRACE_BLIND = ("priority",)


def default_policies() -> list[str]:
    """Every registered policy a trace can drive, ``opt`` (the offline bound) last."""
    names = [p for p in policy_names(include_offline=True) if p not in TRACE_BLIND]
    return sorted(names, key=lambda p: p == "opt")


def default_capacities(l1_tokens: int, page_size: int) -> list[int]:
    """``l1_tokens`` × 1/8 … 4, each at least one page."""
    return sorted({max(page_size, int(l1_tokens * f)) for f in (0.125, 0.25, 0.5, 1, 2, 4)})


def sweep_points(policies: Sequence[str], capacities: Iterable[int]) -> list[SweepPoint]:
    """The grid, in report order (policy-major). Unknown policies are a ``ValueError``."""
    known = policy_names(include_offline=True)
    bad = [p for p in policies if p not in known]
    if bad:
        raise ValueError(f"unknown eviction policy {bad[0]!r}; choose from {known}")
    caps = list(capacities)
    return [SweepPoint(p, c) for p in policies for c in caps]


def default_jobs() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


_SHARED: dict = {}     # the worker's prepared trace and page size


def _init_worker(inp: ReplayInput | None, page_size: int, limit: int | None) -> None:
    if inp is not None:                    # spawn/forkserver: sent once per worker
        _SHARED["input"] = inp
    _SHARED["page_size"] = page_size
    _SHARED["limit"] = limit


def _run_point(point: SweepPoint) -> SweepRow:
    cfg = ReplayConfig(page_size=_SHARED["page_size"], l1_tokens=point.l1_tokens, l2_tokens=0,
                       policy=point.policy, limit=_SHARED["limit"], events=False)
    # The lean replay makes no reference cycles (a node leaves the tree unlinked), so the
    # cycle collector would only re-scan the live tree, again and again: off for the point.
    enabled = gc.isenabled()
    gc.disable()
    try:
        res, _ = replay(_SHARED["input"], cfg, page_level=True)
    finally:
        if enabled:
            gc.enable()
    return SweepRow(point.policy, point.l1_tokens, round(res.token_hit_rate, 6),
                    round(res.cache_seconds, 4))


def _cost_order(points: Sequence[SweepPoint]) -> list[int]:
    """Indices of ``points``, the slowest first (opt, then small capacities: most evictions),
    so the last point to finish is a short one."""
    return sorted(range(len(points)),
                  key=lambda i: (points[i].policy != "opt", points[i].l1_tokens))


def run_sweep(inp: ReplayInput, points: Sequence[SweepPoint], page_size: int, *,
              limit: int | None = None, jobs: int | None = None,
              on_point: Callable[[SweepRow], None] | None = None) -> list[SweepRow]:
    """Replay every point; rows come back in ``points`` order. ``jobs`` worker processes
    (default: every core); 1, or a single point, runs in this process."""
    jobs = min(jobs or default_jobs(), len(points))
    inp.page_ends(page_size)               # built once here, inherited by the workers
    if any(p.policy == "opt" for p in points):
        inp.future(page_size)
    order = _cost_order(points)
    rows: list[SweepRow | None] = [None] * len(points)
    if jobs <= 1:
        _init_worker(inp, page_size, limit)
        for i in order:
            rows[i] = _run_point(points[i])
            if on_point is not None:
                on_point(rows[i])
        return rows  # type: ignore[return-value]
    methods = multiprocessing.get_all_start_methods()
    ctx = multiprocessing.get_context("fork" if "fork" in methods else None)
    if ctx.get_start_method() == "fork":
        _SHARED["input"] = inp             # the children see it: nothing is pickled
        init_args: tuple = (None, page_size, limit)
    else:
        init_args = (inp, page_size, limit)
    with cf.ProcessPoolExecutor(jobs, mp_context=ctx, initializer=_init_worker,
                                initargs=init_args) as pool:
        futures = {pool.submit(_run_point, points[i]): i for i in order}
        try:
            for fut in cf.as_completed(futures):
                row = fut.result()
                rows[futures[fut]] = row
                if on_point is not None:
                    on_point(row)
        except BaseException:
            for fut in futures:
                fut.cancel()
            raise
        finally:
            _SHARED.pop("input", None)
    return rows  # type: ignore[return-value]
