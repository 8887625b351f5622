"""The facade's values: configuration, match results, lock receipts, admissions, load handles.

Callers (scheduler, replay, CLI) get these back from :class:`engine.cache.facade.HiCache`; none of
them holds a tree node (ids only), so callers never walk or change the tree themselves.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Protocol, Sequence

import numpy as np

from engine.cache.radix_tree import TOKEN_DTYPE
from engine.cache.transfer import TransferOp
from engine.core.choices import Choice
from engine.core.namespace import Namespace

if TYPE_CHECKING:  # the layout module imports torch; a metadata-only cache never needs it
    from engine.core.layout import KVLayout


class HostLayout(Choice):
    __what__ = "host layout"

    LAYER_FIRST = "layer_first"
    PAGE_FIRST = "page_first"


class WritePolicy(Choice):
    __what__ = "write policy"

    WRITE_THROUGH = "write_through"
    WRITE_THROUGH_SELECTIVE = "write_through_selective"
    WRITE_BACK = "write_back"


class FlushScope(Choice):
    """What a flush empties: ``cache`` L1 and L2 (SGLang's ``/flush_cache``), ``storage`` the L3
    store alone (SGLang's ``/clear_hicache_storage_backend``), ``all`` every tier."""

    __what__ = "flush scope"

    CACHE = "cache"
    STORAGE = "storage"
    ALL = "all"


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
    # speculative decoding, sidecar draft layout: the draft's own pools, same page ids
    sidecar: KVLayout | None = None
    events: bool = True
    policy_kwargs: dict = dataclasses.field(default_factory=dict)
    hint_kwargs: dict = dataclasses.field(default_factory=dict)   # engine.cache.hints.HintBook

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
        if self.sidecar is not None and (self.layout is None
                                         or self.sidecar.page_size != self.page_size):
            raise ValueError("a sidecar layout needs a KV layout with the same page size")

    @property
    def l1_pages(self) -> int:
        return self.l1_tokens // self.page_size

    @property
    def l2_pages(self) -> int:
        return self.l2_tokens // self.page_size


@dataclasses.dataclass
class MatchResult:
    """What a prompt hits, per tier. Lengths are tokens (multiples of ``page_size``).

    ``node_id`` is the logical id of the deepest matched tree node (what ``lock`` events and
    snapshots name); the nodes themselves stay inside the facade.
    """

    rid: Any
    namespace: Namespace | None
    l1_len: int
    l2_len: int
    l3_len: int
    l1_pages: np.ndarray                  # L1 page ids covering l1_len (+ loaded_len)
    loaded_len: int = 0                    # tokens made L1-resident by load_back
    load: "LoadHandle | None" = None
    hashes: list = dataclasses.field(default_factory=list, repr=False)  # L3 page hashes
    # The facade's own state (the matched tree path and where its L1 part ends): not public.
    _path: list = dataclasses.field(default_factory=list, repr=False, compare=False)
    _n_l1: int = dataclasses.field(default=0, repr=False, compare=False)

    @property
    def hit_len(self) -> int:
        """Tokens the request does not compute (L1 + L2 + what was fetched from L3)."""
        return self.l1_len + self.l2_len + self.l3_len

    @property
    def node_id(self) -> int | None:
        return self._path[-1].id if self._path else None


@dataclasses.dataclass(frozen=True)
class LockReceipt:
    """What :meth:`HiCache.unlock` needs: acquire and release are paired by this value.

    ``node_id`` is the logical id of the locked node (``None``: nothing was matched)."""

    rid: Any
    node_id: int | None
    _node: Any = dataclasses.field(default=None, repr=False, compare=False)


@dataclasses.dataclass
class Admission:
    """One request admitted by :meth:`HiCache.admit`: its prefix locked, its page table
    complete, the L2 (and L3-prefetched) part of the prefix loading into L1.

    ``pages`` is the request's L1 page table: ``pages[:n_prefix_pages]`` hold the reused prefix
    (owned by the cache; the prefix's KV is usable once ``load`` says so), the rest are the
    request's own pages (given back with ``HiCache.free`` or handed to ``HiCache.insert``).
    Release with ``HiCache.unlock(admission.receipt)`` when ``receipt`` is not ``None``.

    ``partial_len`` (``< page_size``): partial last-page reuse — the first own page,
    ``pages[n_prefix_pages]``, already holds the KV of its first ``partial_len`` tokens,
    copied from a cached L1 page that starts with them (``HiCache.admit``). The request's KV
    is valid up to ``n_prefix_pages * page_size + partial_len``; those tokens count in
    ``device_len`` (and so in ``prefix_len``).
    """

    rid: Any
    namespace: Namespace | None
    pages: np.ndarray
    n_prefix_pages: int
    receipt: LockReceipt | None          # None: admitted without the prefix cache
    load: "LoadHandle | None"            # None: nothing to wait for
    device_len: int = 0                  # prefix tokens that were on L1 already (+ partial_len)
    host_len: int = 0                    # prefix tokens loaded back from L2
    storage_len: int = 0                 # prefix tokens fetched from L3 (through L2)
    hashes: list = dataclasses.field(default_factory=list, repr=False)  # L3 page hashes
    partial_len: int = 0                 # tokens copied into the first own page (see above)

    @property
    def prefix_len(self) -> int:
        """Tokens whose KV the request reuses (``device_len + host_len + storage_len``,
        ``partial_len`` included)."""
        return self.device_len + self.host_len + self.storage_len

    @classmethod
    def of_match(cls, m: "MatchResult", receipt: LockReceipt, own: np.ndarray,
                 load: "LoadHandle | None", page_size: int) -> "Admission":
        """The admission of a locked, loaded-back match plus the request's own pages: the page
        table is the resident prefix (L1, then what was loaded: the L2 part, then what the
        match prefetched from L3 into L2), then ``own``."""
        storage = max(0, min(m.l3_len, m.loaded_len - m.l2_len))
        prefix = m.l1_pages[:(m.l1_len + m.loaded_len) // page_size]
        return cls(m.rid, m.namespace, np.concatenate([prefix, own]), len(prefix), receipt,
                   load if load is not None and load.ops else None,
                   device_len=m.l1_len, host_len=m.loaded_len - storage, storage_len=storage,
                   hashes=m.hashes)


class LayerLoad(Protocol):
    """KV a request's forward waits for, layer by layer — the one protocol of a local load-back
    (:class:`LoadHandle`), and of a P/D decode worker's pages arriving over the link
    (engine.runtime.pd.decode.RemoteLoad). The scheduler calls nothing else on it."""

    error: str | None            # why the KV will not arrive (the request then fails)

    def wait_layer(self, layer: int) -> None:
        """Return once layer ``layer`` is usable (raises if its copy failed)."""

    def wait(self) -> None:
        """Return once every layer has landed (or failed)."""

    def ready(self) -> bool:
        """Whether a forward may start now (some KV is there, or it failed)."""


class CacheFacade(Protocol):
    """What a scheduler needs of a cache: :class:`~engine.cache.facade.HiCache`, and the rank
    wrappers around it (engine.parallel: ``CPCache``, ``TPCache``) that agree or shard under
    the same calls."""

    page_size: int
    config: CacheConfig
    events: Any
    l1: Any
    l1_alloc: Any
    l3: Any                      # the L3 tier, or None

    def match(self, tokens: Any, namespace: Any = None, rid: Any = None,
              priority: int = 0) -> "MatchResult":
        """The longest cached prefix (starts its L3 prefetch)."""

    def ready_count(self, kind: str) -> int:
        """Finished transfers of one queue not yet committed (a pipeline stage's pp_sync)."""

    def admit(self, tokens: Any, namespace: Any = None, *, rid: Any = None, priority: int = 0,
              extra_pages: int = 0, reuse: bool = True, place: Any = None,
              partial: bool = True) -> "Admission | None":
        """Match, lock, allocate and load back in one all-or-nothing step (then partial
        last-page reuse where ``partial`` and the cache can prove it right)."""

    def release(self, tokens: np.ndarray, pages: np.ndarray, *, insert: bool,
                n_prefix_pages: int = 0, namespace: Any = None, rid: Any = None,
                priority: int = 0, prefix_hashes: Sequence = (), receipt: Any = None,
                hint: Any = None) -> None:
        """The end of a request: insert its full pages or free its own, apply its client
        hint (engine.cache.hints), then unlock."""

    def set_clock(self, t: float) -> None:
        """The hint clock in seconds (the same on every rank at a step)."""

    def close_session(self, namespace: Any, session: Any) -> int:
        """A client closed a session: its private KV goes first."""

    def hint_stats(self) -> dict[str, Any]:
        """What the client hints did (engine.cache.hints)."""

    def poll(self, limits: dict | None = None) -> dict[str, int]:
        """Commit finished transfers."""

    def flush(self, scope: str = "cache") -> None:
        """Empty the tiers ``scope`` names."""

    def stats(self) -> dict[str, Any]:
        """Occupancy and counters."""


class LoadHandle:
    """Per-layer completion of the load-backs one request depends on (a :class:`LayerLoad`:
    a local copy's layers land in order, so a forward may start at once)."""

    error: str | None = None     # a local copy's failure raises in wait_layer instead

    def __init__(self, ops: Sequence[TransferOp]):
        self.ops = list(ops)

    def ready(self) -> bool:
        return True

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
