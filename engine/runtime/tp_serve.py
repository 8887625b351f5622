"""Serving on a TP group: one process per rank behind the single HTTP front end.

The process layout and the lockstep are the CP server's (engine.runtime.cp_serve: rank 0 serves
HTTP and leads; followers step when it steps, applying the leader's broadcast inbox; a dead rank
turns ``/health`` 503 and stops the server). What differs is what a rank holds:

* its shard of the model (engine.runtime.model.tp): its query heads and kv-heads, its slice of
  the MLP, an all-reduce after the output and down projections;
* a :class:`~engine.parallel.tp_cache.TPCache` whose pools hold its kv-heads only, with the
  transfer completions and every L3 decision agreed over the group;
* an L3 store opened with its shard layout (its kv-heads, ``tp_rank``/``tp_size`` for the legacy
  keys), so each rank reads and writes only the objects of its shard.

Control messages (the inbox broadcast, the agreements) go over the gloo group of the whole world;
the activations' all-reduce over NCCL when every rank has its own GPU, else over gloo (probed at
start by :func:`reduce_backend`).
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch

log = logging.getLogger("hicache.tp")


def check_options(cfg: Any) -> None:
    """``ValueError`` for server options ``--tp`` does not combine with (``ServerConfig``)."""
    if cfg.disaggregation is not None or cfg.speculative_num_draft_tokens:
        raise ValueError("--tp > 1 does not combine with P/D disaggregation or speculative "
                         "decoding yet")
    from engine.runtime.model.config import PRESETS
    from engine.runtime.model.tp import check_tp

    if cfg.model in PRESETS:          # other models are checked once loaded (check_model)
        check_tp(PRESETS[cfg.model], cfg.tp)


def check_model(model_cfg: Any, tp: int) -> None:
    """A loaded model that does not split over ``tp`` ranks: a usage error."""
    from engine.core.errors import UsageError
    from engine.runtime.model.tp import check_tp

    try:
        check_tp(model_cfg, tp)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def probe_backend(device: str, world: int, rank: int) -> tuple[str, str]:
    """The all-reduce backend (:func:`reduce_backend`) and this rank's device."""
    backend = reduce_backend(device, world)
    return backend, rank_device(device, rank, backend)


def share_cores(device: str, world: int) -> Callable[[], None]:
    """On the CPU the ranks of a host (``world`` of them) share its cores: this process takes
    ``cores / world`` compute threads (ranks that each run a thread per core wait on each
    other's oversubscribed threads at every all-reduce; measured in benchmarks/bench_tp.py).
    Returns what restores the process's thread count (a server started in a longer-lived
    process)."""
    import os

    before = torch.get_num_threads()
    if device == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    return lambda: torch.set_num_threads(before)


def rank_label(tp: int, cp: int) -> str:
    """What a group is called in messages: ``TP``, ``CP`` or ``TPxCP``."""
    return "TPxCP" if tp > 1 and cp > 1 else "TP" if tp > 1 else "CP"


def split_rank(rank: int, tp: int) -> tuple[int, int]:
    """``(tp_rank, cp_rank)`` of a global rank: the TP groups are runs of ``tp`` consecutive
    ranks, ``rank = cp_rank * tp + tp_rank``."""
    return rank % tp, rank // tp


def reduce_backend(device: str, world: int) -> str:
    """``nccl`` when the ranks run on CUDA with a GPU each and NCCL is built in, else ``gloo``."""
    import torch.distributed as dist

    if device.startswith("cuda") and torch.cuda.is_available() and \
            torch.cuda.device_count() >= world and dist.is_nccl_available():
        return "nccl"
    return "gloo"


def rank_device(device: str, rank: int, backend: str) -> str:
    """The device of rank ``rank``: its own GPU under NCCL, else the configured one."""
    return f"cuda:{rank}" if backend == "nccl" else device


def rank_groups(tp: int, cp: int, rank: int, backend: str) -> tuple[Any, Any]:
    """This rank's TP group (the activations' all-reduce; ``None``: the world) and CP group
    (the per-layer KV gather; ``None`` without CP). Every rank creates every group, in the same
    order (``new_group`` is collective)."""
    import torch.distributed as dist

    if cp == 1:
        return (dist.new_group(backend=backend) if backend == "nccl" else None), None
    tp_groups = [dist.new_group([c * tp + t for t in range(tp)], backend=backend)
                 for c in range(cp)]
    cp_groups = [dist.new_group([c * tp + t for c in range(cp)], backend="gloo")
                 for t in range(tp)]
    tp_rank, cp_rank = split_rank(rank, tp)
    return tp_groups[cp_rank], cp_groups[tp_rank]


def make_reduce(backend: str, group: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """All-reduce (SUM) over ``group``; a gloo reduce of a CUDA tensor goes through host
    memory."""
    import torch.distributed as dist

    def reduce(t: torch.Tensor) -> torch.Tensor:
        if backend == "gloo" and t.device.type != "cpu":
            c = t.cpu()
            dist.all_reduce(c, group=group)
            return c.to(t.device)
        dist.all_reduce(t, group=group)
        return t
    return reduce


def shard_model(model: Any, cfg: Any, rank: int, backend: str) -> tuple[Any, Any]:
    """Rank ``rank``'s shard of ``model`` (its TP rank's heads and MLP slice, the all-reduce over
    its TP group) and its CP group (``None`` without CP)."""
    from engine.runtime.model.tp import tp_model

    tp_group, cp_group = rank_groups(cfg.tp, cfg.cp, rank, backend)
    tp_rank, _ = split_rank(rank, cfg.tp)
    return tp_model(model, tp_rank, cfg.tp, make_reduce(backend, tp_group)), cp_group


def tp_cache(cache_cfg: Any, model: Any, cfg: Any, rank: int, events: Any, group: Any = None,
             stage: int = 0) -> Any:
    """Rank ``rank``'s cache: a :class:`TPCache` (agreement over ``group``, default the world)
    around a :class:`HiCache`, or around a :class:`CPCache` (pages sharded by owner) with CP.
    ``stage``: its pipeline stage (``--pp`` × ``--tp``: the group is the stage's TP group)."""
    import torch.distributed as dist

    from engine.cache.facade import HiCache
    from engine.parallel.cp_cache import CPCache
    from engine.parallel.tp_cache import TPCache

    tp_rank, cp_rank = split_rank(rank, cfg.tp)
    inner = (CPCache(cache_cfg, cfg.cp, events=events, rank=cp_rank) if cfg.cp > 1
             else HiCache(cache_cfg, events=events))
    (inner.cache if cfg.cp > 1 else inner).hit_on_commit = True
    whole = model.kv_layout(cfg.page_size).whole()
    page_bytes = [whole.shard(cfg.tp, r, cfg.pp, stage).page_bytes for r in range(cfg.tp)]
    return TPCache(inner, cfg.tp, tp_rank, dist.group.WORLD if group is None else group,
                   page_bytes)
