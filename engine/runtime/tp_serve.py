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


def reduce_backend(device: str, world: int) -> str:
    """``nccl`` when the ranks run on CUDA with a GPU each and NCCL is built in, else ``gloo``."""
    import torch.distributed as dist

    if device.startswith("cuda") and torch.cuda.is_available() and \
            torch.cuda.device_count() >= world and dist.is_nccl_available():
        return "nccl"
    return "gloo"


def rank_device(device: str, rank: int, backend: str) -> str:
    """The device of TP rank ``rank``: its own GPU under NCCL, else the configured one."""
    return f"cuda:{rank}" if backend == "nccl" else device


def make_reduce(backend: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """All-reduce (SUM) over the TP group; a gloo reduce of a CUDA tensor goes through host
    memory. Every rank must build it in the same order (``new_group`` is collective)."""
    import torch.distributed as dist

    group = dist.new_group(backend=backend) if backend == "nccl" else None

    def reduce(t: torch.Tensor) -> torch.Tensor:
        if backend == "gloo" and t.device.type != "cpu":
            c = t.cpu()
            dist.all_reduce(c, group=group)
            return c.to(t.device)
        dist.all_reduce(t, group=group)
        return t
    return reduce


def shard_model(model: Any, rank: int, tp: int, backend: str) -> Any:
    from engine.runtime.model.tp import tp_model

    return tp_model(model, rank, tp, make_reduce(backend))


def tp_cache(cache: Any, model: Any, cfg: Any, rank: int) -> Any:
    """Rank ``rank``'s :class:`TPCache` over ``cache`` (``cfg.tp`` ranks, the world group)."""
    import torch.distributed as dist

    from engine.parallel.tp_cache import TPCache

    whole = model.kv_layout(cfg.page_size).whole()
    page_bytes = [whole.shard(cfg.tp, r).page_bytes for r in range(cfg.tp)]
    return TPCache(cache, cfg.tp, rank, dist.group.WORLD, page_bytes)
