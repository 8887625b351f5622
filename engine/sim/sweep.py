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
    hints: str = "off"          # the trace's client hints sent (engine.sim.replay.HINTS)

    @property
    def label(self) -> str:
        """``lru``, or ``lru+session-end`` / ``lru+ttl`` / ``lru+ttl+session-end`` with hints."""
        return self.policy + HINT_SUFFIX[self.hints]


HINT_SUFFIX = {"off": "", "session-end": "+session-end", "ttl": "+ttl",
               "on": "+ttl+session-end"}
_SUFFIX_HINTS = {v: k for k, v in HINT_SUFFIX.items() if v} | {"+hints": "on"}


def parse_label(name: str) -> tuple[str, str]:
    """``POLICY[+SIGNAL…]`` (a sweep's policy entry) → (policy, hints); ``ValueError``."""
    base, plus, rest = name.partition("+")
    if not plus:
        return name, "off"
    hints = _SUFFIX_HINTS.get("+" + rest)
    if hints is None or base == "opt":
        raise ValueError(f"{name!r}: a policy may take hints as {base}+session-end, "
                         f"{base}+ttl or {base}+ttl+session-end (opt takes none)")
    return base, hints


def compare_labels(policy: str = "lru") -> list[str]:
    """The per-signal comparison (``--hints compare``): the policy alone, ``density`` (the best
    history-only policy), the policy with each hint signal, and ``opt``."""
    names = [policy] + (["density"] if policy != "density" else [])
    return names + [policy + HINT_SUFFIX[h] for h in ("session-end", "ttl", "on")] + ["opt"]


@dataclasses.dataclass(frozen=True)
class SweepRow:
    policy: str
    l1_tokens: int
    token_hit_rate: float
    cache_seconds: float
    hints: str = "off"

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


def sweep_points(policies: Sequence[str], capacities: Iterable[int],
                 hints: str = "off") -> list[SweepPoint]:
    """The grid, in report order (policy-major). A policy entry may name hint signals
    (:func:`parse_label`); ``hints`` is sent with every other point but ``opt``'s. Unknown
    policies are a ``ValueError``."""
    known = policy_names(include_offline=True)
    parsed = [parse_label(p) for p in policies]
    bad = [p for p, _ in parsed if p not in known]
    if bad:
        raise ValueError(f"unknown eviction policy {bad[0]!r}; choose from {known}")
    caps = list(capacities)
    return [SweepPoint(p, c, h if h != "off" or p == "opt" else hints)
            for p, h in parsed for c in caps]


def gap_closed(rows: Sequence[dict], base: str = "lru") -> dict[tuple[str, int], float]:
    """Each row's share of the ``base`` → ``opt`` hit-rate gap at its capacity, where the sweep
    has both (``(label, l1_tokens)`` → share; 0 = base, 1 = opt)."""
    by = {(r["policy"], r["l1_tokens"]): r["token_hit_rate"] for r in rows}
    out = {}
    for r in rows:
        lo, hi = by.get((base, r["l1_tokens"])), by.get(("opt", r["l1_tokens"]))
        if lo is not None and hi is not None and hi > lo:
            out[(r["policy"], r["l1_tokens"])] = (r["token_hit_rate"] - lo) / (hi - lo)
    return out


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
                       policy=point.policy, limit=_SHARED["limit"], events=False,
                       hints=point.hints)
    # The cycle collector would only re-scan the live tree, again and again: off for the point
    # (the lean replay breaks its own cycles when done, LeanReplay.close: nothing is left for it).
    enabled = gc.isenabled()
    gc.disable()
    try:
        res, _ = replay(_SHARED["input"], cfg, page_level=True)
    finally:
        if enabled:
            gc.enable()
    return SweepRow(point.label, point.l1_tokens, round(res.token_hit_rate, 6),
                    round(res.cache_seconds, 4), point.hints)


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
    inp.page_rows(page_size)
    if any(p.policy == "opt" for p in points):
        inp.future(page_size)
    for h in {p.hints for p in points} - {"off"}:
        inp.hints(h)                       # made once here, inherited by the workers
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
