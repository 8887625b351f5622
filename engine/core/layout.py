"""KV layouts as frozen values (STYLE: "layout is a frozen value").

A :class:`KVLayout` describes the bytes of one page of KV for a range of layers and kv-heads:
model dims, dtype, page size, byte order. Sizes are derived, never stored. Storage keys and
object headers are built from it, and they never contain a rank number (SPEC §2.4).
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
        for name in ("num_layers", "kv_heads", "head_dim", "page_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"KVLayout.{name} must be >= 1, got {getattr(self, name)}")
        if self.kv_kinds not in (1, 2):
            raise ValueError(f"kv_kinds must be 1 (MLA) or 2 (K and V), got {self.kv_kinds}")
        torch_dtype(self.dtype)

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch_dtype(self.dtype)

    @property
    def itemsize(self) -> int:
        return torch.tensor([], dtype=self.torch_dtype).element_size()

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
