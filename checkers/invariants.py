"""Invariant checker for the cache stack: tree shape, tier residency, lock counts, slots.

``check_tree`` works on anything with the node attributes of :class:`engine.cache.radix_tree.Node`
(the live tree or a loaded snapshot); ``check_cache`` adds pool/allocator accounting of a live
:class:`engine.cache.facade.HiCache`. Both return a list of violations (empty = healthy); tests call
``assert_healthy`` after every scenario.
"""

from __future__ import annotations

from typing import Any, Iterable

import numpy as np


def _children(node) -> Iterable:
    ch = node.children
    return ch.values() if isinstance(ch, dict) else ch


SHARED_SESSION = -1
"""``Node.session`` of a node several sessions touched (engine.cache.hints.SHARED)."""


def check_tree(tree: Any, idle: bool = False) -> list[str]:
    """Structural invariants. ``idle``: no request holds a lock (all lock counts are 0)."""
    p = tree.page_size
    out: list[str] = []
    seen_ids: set[int] = set()
    count = 0
    for ns, root in tree.roots.items():
        stack = [root]
        while stack:
            node = stack.pop()
            is_root = node.parent is None
            if not is_root:
                count += 1
            if node.id in seen_ids:
                out.append(f"tree shape: node id {node.id} appears twice")
            seen_ids.add(node.id)
            if getattr(node, "namespace", ns) != ns:
                out.append(f"namespace: node {node.id} has namespace {node.namespace!r} under "
                           f"root {ns!r}")
            n_tok = len(node.tokens)
            if is_root and (n_tok or node.l1 is not None or node.l2 is not None
                            or getattr(node, "l3", 0)):
                where = "the default namespace" if ns is None else f"namespace {ns!r}"
                out.append(f"tree shape: root {node.id} of {where} holds tokens or pages (a "
                           f"root is the empty prefix)")
            if not is_root:
                if n_tok == 0 or n_tok % p:
                    out.append(f"tree shape: node {node.id} edge of {n_tok} tokens is not a "
                               f"positive multiple of page size {p}")
                k = n_tok // p
                for tier in ("l1", "l2"):
                    pages = getattr(node, tier)
                    if pages is not None and len(pages) != k:
                        out.append(f"residency: node {node.id} has {len(pages)} {tier.upper()} "
                                   f"pages for {k} pages of tokens")
                if getattr(node, "l3", 0) > k:
                    out.append(f"residency: node {node.id} records {node.l3} L3 pages for {k} "
                               f"pages of tokens")
                if node.l1 is None and node.l2 is None and not getattr(node, "l3", 0):
                    out.append(f"residency: node {node.id} lives in no tier")
                parent = node.parent
                if node.l1 is not None and parent.parent is not None and parent.l1 is None:
                    out.append(f"residency: node {node.id} is on L1 but its parent "
                               f"{parent.id} is not (L1 must be prefix-closed)")
                if node.lock_ref < 0:
                    out.append(f"locks: node {node.id} has lock count {node.lock_ref}")
                if idle and node.lock_ref != 0:
                    out.append(f"locks: node {node.id} still locked ({node.lock_ref}) while idle")
                if getattr(node, "session", None) == SHARED_SESSION and \
                        getattr(node, "hint_until", None) is not None:
                    out.append(f"hints: node {node.id} is shared by several sessions but holds "
                               f"a hint (hints only move a session's private nodes)")
            kids = list(_children(node))
            child_locks = 0
            n_l1 = 0
            first_pages = set()
            for child in kids:
                if child.parent is not node:
                    out.append(f"tree shape: node {child.id}'s parent link does not point to "
                               f"{node.id}")
                fp = bytes(np.asarray(child.tokens[:p], dtype=np.uint32).tobytes())
                if fp in first_pages:
                    out.append(f"tree shape: two children of node {node.id} start with the "
                               f"same page")
                first_pages.add(fp)
                if isinstance(node.children, dict):
                    key = next((k for k, v in node.children.items() if v is child), None)
                    if key is not None and key != fp:
                        out.append(f"tree shape: child {child.id} is filed under a key that is "
                                   f"not its first page")
                child_locks += max(child.lock_ref, 0)
                n_l1 += child.l1 is not None
                stack.append(child)
            if not is_root and node.lock_ref < max((c.lock_ref for c in kids), default=0):
                out.append(f"locks: node {node.id} lock count {node.lock_ref} is below a "
                           f"child's (locks count along the path)")
            if hasattr(node, "n_l1_children") and not is_root and node.n_l1_children != n_l1:
                out.append(f"residency: node {node.id} counts {node.n_l1_children} L1 children, "
                           f"has {n_l1}")
    if hasattr(tree, "num_nodes") and tree.num_nodes != count:
        out.append(f"tree shape: tree counts {tree.num_nodes} nodes, walk found {count}")
    return out


def tier_pages(tree: Any, tier: str) -> tuple[np.ndarray, list[str]]:
    parts = [getattr(n, tier) for n in tree.iter_nodes() if getattr(n, tier) is not None]
    pages = np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)
    out = []
    uniq, counts = np.unique(pages, return_counts=True)
    if (counts > 1).any():
        out.append(f"slots: {tier.upper()} pages {uniq[counts > 1][:8].tolist()} belong to "
                   f"more than one node")
    return pages, out


def check_cache(cache: Any, idle: bool = False) -> list[str]:
    """Tree invariants plus slot accounting. ``idle``: no running request owns pages."""
    out = check_tree(cache.tree, idle=idle)
    for tier, alloc in (("l1", cache.l1_alloc), ("l2", cache.l2_alloc)):
        if alloc is None:
            continue
        pages, dup = tier_pages(cache.tree, tier)
        out += dup
        if pages.size and not alloc.is_allocated(pages).all():
            out.append(f"slots: {tier.upper()} pages referenced by the tree are free in the "
                       f"allocator")
        if alloc.used_pages + alloc.free_pages != alloc.num_pages:
            out.append(f"slots: {tier.upper()} used + free != capacity")
        if idle:
            held = pages.size
            if tier == "l2":  # in-flight backups own their destination pages
                held += sum(len(op.dst_pages) for op in cache._inflight_ops("backup"))
            if alloc.used_pages != held:
                out.append(f"slots: {tier.upper()} allocator has {alloc.used_pages} pages in "
                           f"use, the tree holds {held} (leak or double ownership)")
    return out


def assert_healthy(cache: Any, idle: bool = False) -> None:
    problems = check_cache(cache, idle=idle) if hasattr(cache, "tree") else check_tree(cache, idle)
    assert not problems, "invariants violated:\n  " + "\n  ".join(problems)
