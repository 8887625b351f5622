"""Object keys: what an object holds, never who wrote it (docs/storage.md, "Unified layout").

``<page hash, 64 hex>.<namespace, 16 hex>.l<first>-<end>.h<first>-<end>`` (MLA: no ``.h`` part)

* the chained page hash (:mod:`engine.core.hashing`) names the page and its whole prefix (a namespace
  seeds the chain, so namespaces never share keys);
* the namespace (:func:`namespace_id`) is a digest of the model id and the storage layout (the
  fleet's grid, the payload order): a reader configured differently misses instead of
  misreading;
* the model id is a digest of the model-wide dims (total layers and kv-heads, head dim, page
  size, dtype, K/V kinds, byte order, plus an optional model tag), so different models or dtypes
  never collide;
* the layer and kv-head ranges (end exclusive) are the object's coordinate inside the model.

No rank numbers — except in the legacy per-rank layout kept for migration
(``<page hash>.<namespace>.tp<rank>of<size>.pp<rank>of<size>``, :func:`legacy_coordinate`).
Keys use ``[0-9a-z.-]`` only: safe as file names, and no key can name a path outside a directory
(:func:`check_key` is what every backend applies).
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:   # keys need no torch at run time (the file store's workers stay light)
    from engine.core.hashing import PageHash
    from engine.core.layout import KVLayout

KEY_MAX_LEN = 200
_SAFE_KEY = re.compile(r"^[0-9a-z][0-9a-z._-]{3,%d}$" % (KEY_MAX_LEN - 1))


def check_key(key: str) -> str:
    """Return ``key`` if it is safe for every backend; ``ValueError`` otherwise.

    Safe: 4–200 characters of ``[0-9a-z._-]``, starting with ``[0-9a-z]`` — so never a path
    separator, never ``.``/``..``, never empty, never absolute, never a NUL.
    """
    if not isinstance(key, str) or not _SAFE_KEY.match(key):
        raise ValueError(f"unsafe storage key {key!r}: keys are 4-{KEY_MAX_LEN} characters of "
                         "[0-9a-z._-] starting with a letter or digit")
    return key


def model_id(layout: KVLayout, model_tag: str = "") -> str:
    """16 hex digits naming the model-wide shape of a layout (not which shard it is)."""
    ident = {
        "total_layers": layout.total_layers if layout.total_layers is not None
        else layout.layer_start + layout.num_layers,
        "total_kv_heads": layout.total_kv_heads if layout.total_kv_heads is not None
        else layout.head_start + layout.kv_heads,
        "head_dim": layout.head_dim,
        "page_size": layout.page_size,
        "dtype": layout.dtype,
        "kv_kinds": layout.kv_kinds,
        "byte_order": layout.byte_order,
        "tag": model_tag,
    }
    raw = json.dumps(ident, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(raw).hexdigest()[:16]


def coordinate(layout: KVLayout, model_tag: str = "") -> str:
    """The key suffix for objects of ``layout``: model id, layer range, kv-head range."""
    l0, h0 = layout.layer_start, layout.head_start
    return (f"{model_id(layout, model_tag)}.l{l0}-{l0 + layout.num_layers}"
            f".h{h0}-{h0 + layout.kv_heads}")


def object_key(page_hash: PageHash | bytes, coord: str) -> str:
    if len(page_hash) != 32:
        raise ValueError(f"page hash must be 32 bytes, got {len(page_hash)}")
    return f"{page_hash.hex()}.{coord}"


def namespace_id(layout: KVLayout, model_tag: str = "", **storage: object) -> str:
    """16 hex digits: the model id plus how the store lays objects out (``storage``: JSON-ready
    values such as the grid and the payload order)."""
    raw = json.dumps({"model": model_id(layout, model_tag), **storage}, sort_keys=True,
                     separators=(",", ":")).encode()
    return hashlib.sha256(raw).hexdigest()[:16]


def unified_coordinate(namespace: str, layers: tuple[int, int],
                       heads: tuple[int, int] | None) -> str:
    """Key suffix of the object holding ``layers`` × ``heads`` (``None``: MLA, no head axis)."""
    s = f"{namespace}.l{layers[0]}-{layers[1]}"
    return s if heads is None else f"{s}.h{heads[0]}-{heads[1]}"


def legacy_coordinate(namespace: str, tp: tuple[int, int], pp: tuple[int, int]) -> str:
    """Key suffix of the legacy per-rank object of TP rank ``tp[0]`` of ``tp[1]``, PP stage
    ``pp[0]`` of ``pp[1]``."""
    return f"{namespace}.tp{tp[0]}of{tp[1]}.pp{pp[0]}of{pp[1]}"
