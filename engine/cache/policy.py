"""Eviction policies behind one registry.

A policy turns a node into a sort key; the smallest key is evicted first. Eviction itself
(leaf-first, locks, tiers) is the cache's business — a policy only orders candidates.
"""

from __future__ import annotations

import enum
from typing import Callable, Protocol


class EvictionPolicy(Protocol):
    name: str

    def key(self, node) -> tuple: ...


class LRU:
    name = "lru"

    @staticmethod
    def key(node) -> tuple:
        return (node.last_access,)


class LFU:
    name = "lfu"

    @staticmethod
    def key(node) -> tuple:
        return (node.hit_count, node.last_access)


class Priority:
    """Lower request priority is evicted first; LRU among equals."""

    name = "priority"

    @staticmethod
    def key(node) -> tuple:
        return (node.priority, node.last_access)


class Belady:
    """Offline optimum (replay only): evict the node whose next use is farthest away.

    ``next_use(node)`` is supplied by whoever knows the future (the trace replay); ``None``
    means never used again.
    """

    name = "opt"

    def __init__(self, next_use: Callable[[object], "int | None"]):
        self._next_use = next_use

    def key(self, node) -> tuple:
        nxt = self._next_use(node)
        return (-(nxt if nxt is not None else 1 << 62), node.last_access)


def _bip(**kwargs) -> EvictionPolicy:
    from engine.cache.policy_bip import AdaptiveBIP

    return AdaptiveBIP(**kwargs)


def _density(**kwargs) -> EvictionPolicy:
    from engine.cache.policy_density import DensityPolicy

    return DensityPolicy(**kwargs)


class PolicyName(str, enum.Enum):
    lru = "lru"
    lfu = "lfu"
    priority = "priority"
    opt = "opt"
    bip = "bip"
    density = "density"


_REGISTRY: dict[str, Callable[..., EvictionPolicy]] = {
    "lru": LRU,
    "lfu": LFU,
    "priority": Priority,
    "opt": Belady,
    "bip": _bip,
    "density": _density,
}


def make_policy(name: str, **kwargs) -> EvictionPolicy:
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; choose one of {sorted(_REGISTRY)}") \
            from None
    return factory(**kwargs)


def policy_names(include_offline: bool = False) -> list[str]:
    return [n for n in _REGISTRY if include_offline or n != "opt"]
