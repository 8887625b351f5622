"""KV layouts as frozen values (docs/design.md: "layouts are frozen values").

A :class:`KVLayout` describes the bytes of one page of KV for a range of layers and kv-heads:
model dims, dtype, page size, byte order. Sizes are derived, never stored. Storage keys and
object headers are built from it, and they never contain a rank number (docs/parallelism.md §4).
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import torch

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


def torch_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(_DTYPES)}") from None


_INT_FIELDS = ("num_layers", "kv_heads", "head_dim", "page_size", "kv_kinds", "layer_start",
               "head_start", "total_layers", "total_kv_heads")


@dataclasses.dataclass(frozen=True)
class KVLayout:
    """What one page of KV holds.

    ``kv_kinds`` is 2 for ordinary attention (K and V) and 1 for MLA (one latent vector per
    token, ``kv_heads`` = 1, ``head_dim`` = latent dim). ``layer_start``/``head_start`` locate a
    shard inside the whole model (``num_layers``/``kv_heads`` are the shard's extent;
    ``total_layers``/``total_kv_heads`` the model's).
    """

    num_layers: int
    kv_heads: int
    head_dim: int
    page_size: int
    dtype: str = "float32"
    kv_kinds: int = 2
    layer_start: int = 0
    head_start: int = 0
    total_layers: int | None = None
    total_kv_heads: int | None = None
    byte_order: str = sys.byteorder

    def __post_init__(self) -> None:
        # Layouts also come from stored headers (untrusted JSON): every field is checked for its
        # type as well as its range, so a string or a list is a ValueError, never a TypeError
        # from a comparison further on.
        for name in _INT_FIELDS:
            v = getattr(self, name)
            if v is None and name in ("total_layers", "total_kv_heads"):
                continue
            if isinstance(v, bool) or not hasattr(v, "__index__"):
                raise ValueError(f"KVLayout.{name} must be an integer, got {v!r:.40}")
            object.__setattr__(self, name, int(v.__index__()))
        for name in ("num_layers", "kv_heads", "head_dim", "page_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"KVLayout.{name} must be >= 1, got {getattr(self, name)}")
        if self.layer_start < 0 or self.head_start < 0:
            raise ValueError(f"KVLayout layer_start/head_start must be >= 0, got "
                             f"{self.layer_start}/{self.head_start}")
        if self.kv_kinds not in (1, 2):
            raise ValueError(f"kv_kinds must be 1 (MLA) or 2 (K and V), got {self.kv_kinds}")
        if not isinstance(self.dtype, str):
            raise ValueError(f"KVLayout.dtype must be a name, got {self.dtype!r:.40}")
        if self.byte_order not in ("little", "big"):
            raise ValueError(f"KVLayout.byte_order must be 'little' or 'big', got "
                             f"{self.byte_order!r:.40}")
        torch_dtype(self.dtype)

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch_dtype(self.dtype)

    @property
    def itemsize(self) -> int:
        return self.torch_dtype.itemsize

    @property
    def token_bytes_per_layer(self) -> int:
        """Bytes of one token's KV in one layer (K and V together)."""
        return self.kv_kinds * self.kv_heads * self.head_dim * self.itemsize

    @property
    def page_bytes(self) -> int:
        """Bytes of one page across all layers of this layout."""
        return self.page_size * self.num_layers * self.token_bytes_per_layer

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "KVLayout":
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - fields
        if unknown:
            raise ValueError(f"unknown KVLayout fields: {sorted(unknown)}")
        return cls(**d)

    # -- the model and its shards -------------------------------------------------------------
    @property
    def model_layers(self) -> int:
        """Layers of the whole model (``total_layers``, or the end of this range)."""
        return self.total_layers if self.total_layers is not None else \
            self.layer_start + self.num_layers

    @property
    def model_kv_heads(self) -> int:
        """Kv-heads of the whole model (``total_kv_heads``, or the end of this range)."""
        return self.total_kv_heads if self.total_kv_heads is not None else \
            self.head_start + self.kv_heads

    def region(self, layers: tuple[int, int], heads: tuple[int, int]) -> "KVLayout":
        """The same model restricted to ``layers`` × ``heads`` (``[start, end)`` ranges of the
        whole model), with the model totals filled in."""
        L, H = self.model_layers, self.model_kv_heads
        if not (0 <= layers[0] < layers[1] <= L and 0 <= heads[0] < heads[1] <= H):
            raise ValueError(f"region layers {layers} × heads {heads} is outside the model "
                             f"({L} layers, {H} kv-heads)")
        return dataclasses.replace(self, layer_start=layers[0], num_layers=layers[1] - layers[0],
                                   head_start=heads[0], kv_heads=heads[1] - heads[0],
                                   total_layers=L, total_kv_heads=H)

    def whole(self) -> "KVLayout":
        """The whole model's layout (every layer and kv-head)."""
        return self.region((0, self.model_layers), (0, self.model_kv_heads))

    def shard(self, tp: int = 1, tp_rank: int = 0, pp: int = 1, pp_rank: int = 0) -> "KVLayout":
        """The part of the whole model rank (``tp_rank``, ``pp_rank``) of a TP×PP deployment
        holds: :func:`pp_layer_range` × :func:`tp_head_range`."""
        heads = (0, 1) if self.kv_kinds == 1 else tp_head_range(self.model_kv_heads, tp, tp_rank)
        return self.region(pp_layer_range(self.model_layers, pp, pp_rank), heads)


def pp_layer_range(layers: int, pp: int, rank: int) -> tuple[int, int]:
    """Layers of pipeline stage ``rank`` of ``pp``: an even split, the first ``layers % pp``
    stages one layer more."""
    if not (1 <= pp <= layers and 0 <= rank < pp):
        raise ValueError(f"pipeline stage {rank} of {pp} is impossible with {layers} layers")
    base, extra = divmod(layers, pp)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


def tp_head_range(heads: int, tp: int, rank: int) -> tuple[int, int]:
    """Kv-heads of tensor-parallel rank ``rank`` of ``tp``: ``heads / tp`` each, or, with more
    ranks than heads, one head shared by ``tp / heads`` consecutive ranks."""
    if not (tp >= 1 and 0 <= rank < tp):
        raise ValueError(f"tensor-parallel rank {rank} of {tp} is impossible")
    if heads % tp == 0:
        n = heads // tp
        return rank * n, (rank + 1) * n
    if tp % heads == 0:
        h = rank // (tp // heads)
        return h, h + 1
    raise ValueError(f"{heads} kv-heads cannot be split over {tp} tensor-parallel ranks")
