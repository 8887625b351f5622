"""Chained page hashes (docs/design.md, "L3 keys"): the L3 keys of the cache.

``h_i = SHA-256(h_{i-1} || tokens of page i as uint32 little-endian)``; the first page has no
predecessor unless a namespace seeds the chain. This is the chaining SGLang uses, so keys
interoperate; it never depends on Python's ``hash()`` or ``PYTHONHASHSEED``.
"""

from __future__ import annotations

import hashlib
from typing import Any, NewType, Sequence

import numpy as np

PageHash = NewType("PageHash", bytes)
"""A 32-byte SHA-256 digest naming one page *and its whole prefix*."""


def namespace_seed(namespace: Any) -> PageHash | None:
    """The chain seed for a namespace (:class:`engine.core.namespace.Namespace`, or a string:
    its ``namespace`` field); ``None`` for the default one.

    Different namespaces get different seeds, so identical tokens never share a key.
    """
    from engine.core.namespace import as_namespace

    ns = as_namespace(namespace)
    return None if ns is None else PageHash(ns.seed())


def _as_u32le(tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    arr = np.asarray(tokens)
    if arr.size and (arr.min() < 0 or arr.max() > 0xFFFFFFFF):
        raise ValueError("token ids must fit in uint32")
    return arr.astype("<u4", copy=False)


def page_hash(prev: PageHash | None, page_tokens: Sequence[int] | np.ndarray) -> PageHash:
    """Hash of one page chained on the previous page's digest."""
    h = hashlib.sha256()
    if prev is not None:
        h.update(prev)
    h.update(_as_u32le(page_tokens).tobytes())
    return PageHash(h.digest())


def page_hashes(tokens: Sequence[int] | np.ndarray, page_size: int,
                seed: PageHash | None = None) -> list[PageHash]:
    """Hashes of every *full* page of ``tokens`` (a trailing partial page is not hashed)."""
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    raw = _as_u32le(tokens).tobytes()
    step = page_size * 4
    n = len(raw) // step
    out: list[PageHash] = []
    prev = seed
    sha = hashlib.sha256
    for i in range(n):
        h = sha()
        if prev is not None:
            h.update(prev)
        h.update(raw[i * step:(i + 1) * step])
        prev = PageHash(h.digest())
        out.append(prev)
    return out
