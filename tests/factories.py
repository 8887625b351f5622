"""Tiny factories shared by the cache-stack tests."""

from __future__ import annotations

import numpy as np
import torch

from engine.cache.facade import CacheConfig, HiCache
from engine.cache.radix_tree import RadixTree
from engine.core.layout import KVLayout

LAYERS = 2


def make_tree(page_size: int = 4) -> RadixTree:
    return RadixTree(page_size)


def tiny_layout(page_size: int = 4, kv_kinds: int = 2) -> KVLayout:
    return KVLayout(num_layers=LAYERS, kv_heads=2, head_dim=3, page_size=page_size,
                    kv_kinds=kv_kinds)


def make_cache(page_size: int = 4, l1_pages: int = 8, l2_pages: int = 0, *, real: bool = True,
               **kw) -> HiCache:
    cfg = CacheConfig(page_size=page_size, l1_tokens=l1_pages * page_size,
                      l2_tokens=l2_pages * page_size,
                      layout=tiny_layout(page_size) if real else None, **kw)
    return HiCache(cfg)


def kv_value(tokens: np.ndarray, positions: np.ndarray, layer: int, kind: int) -> torch.Tensor:
    """Deterministic fake KV of a token at a position: what a model would have computed."""
    v = (torch.as_tensor(tokens.astype(np.int64), dtype=torch.float32) * 1000.0
         + torch.as_tensor(positions, dtype=torch.float32) + layer * 0.25 + kind * 0.125)
    return v.view(-1, 1, 1).expand(-1, 2, 3)


def serve(cache: HiCache, tokens, namespace=None, rid=None, check_kv: bool = True):
    """One request as the scheduler does it: match, lock, load back, alloc, write KV, verify the
    reused KV, insert, unlock. Returns the MatchResult."""
    toks = np.asarray(tokens, dtype=np.uint32)
    p = cache.page_size
    m = cache.match(toks, namespace=namespace, rid=rid)
    receipt = cache.lock(m)
    handle = cache.load_back(m)
    n_full = len(toks) // p
    have = len(m.l1_pages)
    new = cache.alloc(n_full - have)
    pages = np.concatenate([m.l1_pages, new])
    if cache.l1 is not None:
        slots = cache.l1.slots(new)
        pos = np.arange(have * p, n_full * p)
        for layer in range(cache.num_layers):
            for kind in range(cache.l1.layout.kv_kinds):
                dev = cache.l1.buf.device
                cache.l1.buf[layer, kind, torch.as_tensor(slots, device=dev)] = kv_value(
                    toks[pos], pos, layer, kind).to(dev)
        if handle is not None:
            for layer in range(cache.num_layers):
                handle.wait_layer(layer)
        if check_kv and have:
            slots = cache.l1.slots(m.l1_pages)
            pos = np.arange(have * p)
            for layer in range(cache.num_layers):
                for kind in range(cache.l1.layout.kv_kinds):
                    got = cache.l1.buf[layer, kind, torch.as_tensor(slots)].cpu()
                    want = kv_value(toks[pos], pos, layer, kind)
                    assert torch.equal(got, want), f"wrong KV restored at layer {layer}"
    cache.insert(toks[:n_full * p], pages, namespace=namespace, rid=rid, after=receipt)
    cache.unlock(receipt)
    cache.poll()
    return m


# -- L3 store tests: a small page layout, fresh hash chains, host pools of it -------------------
STORE_LAYOUT = KVLayout(num_layers=2, kv_heads=2, head_dim=8, page_size=4)


def page_chain(n: int):
    """Hashes of ``n`` pages under a fresh namespace (keys no earlier test stored)."""
    import uuid

    from engine.core.hashing import namespace_seed, page_hashes

    return page_hashes(np.arange(n * 4), 4, seed=namespace_seed(uuid.uuid4().hex))


def store_pool(fill: bool = True):
    """A page_first host pool of 8 pages of :data:`STORE_LAYOUT`, random bytes when ``fill``."""
    from engine.cache.pool import HostPool

    p = HostPool(STORE_LAYOUT, 8, host_layout="page_first")
    if fill:
        p.buf.copy_(torch.randn(p.buf.shape, generator=torch.Generator().manual_seed(1)))
    return p
