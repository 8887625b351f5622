"""The facade's values: configuration, match results, lock receipts, load handles.

Callers (scheduler, replay, CLI) get these back from :class:`engine.cache.facade.HiCache` and never
walk tree nodes themselves (STYLE: a facade that returns result objects).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np

from engine.cache.pool import HostLayout
from engine.cache.radix_tree import TOKEN_DTYPE, Node
from engine.cache.transfer import TransferOp
from engine.core.choices import Choice
from engine.core.layout import KVLayout


class WritePolicy(Choice):
    __what__ = "write policy"

    WRITE_THROUGH = "write_through"
    WRITE_THROUGH_SELECTIVE = "write_through_selective"
    WRITE_BACK = "write_back"


@dataclasses.dataclass
class CacheConfig:
    page_size: int = 16
    l1_tokens: int = 1 << 16
    l2_tokens: int = 0                      # 0: no L2
    write_policy: str = "write_through"
    write_through_threshold: int = 2        # hits before a selective backup
    eviction_policy: str = "lru"
    host_layout: str = "layer_first"
    device: str = "cpu"
    layout: KVLayout | None = None          # None: metadata only (no KV bytes)
    events: bool = True
    policy_kwargs: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("page_size",):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("l1_tokens", "l2_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.write_through_threshold < 1:
            raise ValueError("write_through_threshold must be >= 1")
        WritePolicy.parse(self.write_policy)
        HostLayout.parse(self.host_layout)
        if self.layout is not None and self.layout.page_size != self.page_size:
            raise ValueError(f"layout page_size {self.layout.page_size} != {self.page_size}")

    @property
    def l1_pages(self) -> int:
        return self.l1_tokens // self.page_size

    @property
    def l2_pages(self) -> int:
        return self.l2_tokens // self.page_size


@dataclasses.dataclass
class MatchResult:
    """What a prompt hits, per tier. Lengths are tokens (multiples of ``page_size``)."""

    rid: Any
    namespace: str | None
    l1_len: int
    l2_len: int
    l3_len: int
    l1_pages: np.ndarray                  # L1 page ids covering l1_len (+ loaded_len)
    path: list[Node] = dataclasses.field(repr=False)
    n_l1_nodes: int = 0                    # path[:n_l1_nodes] is the L1 hit
    loaded_len: int = 0                    # tokens made L1-resident by load_back
    load: "LoadHandle | None" = None
    hashes: list = dataclasses.field(default_factory=list, repr=False)  # L3 page hashes

    @property
    def hit_len(self) -> int:
        """Tokens the request does not compute (L1 + L2 + what was fetched from L3)."""
        return self.l1_len + self.l2_len + self.l3_len

    @property
    def node_id(self) -> int | None:
        return self.path[-1].id if self.path else None


@dataclasses.dataclass(frozen=True)
class LockReceipt:
    """What :meth:`HiCache.unlock` needs: acquire and release are paired by this value."""

    node: Node | None
    rid: Any


class LoadHandle:
    """Per-layer completion of the load-backs one request depends on."""

    def __init__(self, ops: Sequence[TransferOp]):
        self.ops = list(ops)

    def wait_layer(self, layer: int) -> None:
        for op in self.ops:
            op.wait_layer(layer)

    def wait(self) -> None:
        for op in self.ops:
            op.wait()

    def done(self) -> bool:
        return all(op.done() for op in self.ops)


def as_tokens(tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    arr = np.asarray(tokens)
    if arr.dtype == TOKEN_DTYPE:
        return arr
    if arr.size and (arr.min() < 0 or arr.max() > 0xFFFFFFFF):
        raise ValueError("token ids must be in [0, 2**32)")
    return arr.astype(TOKEN_DTYPE)
