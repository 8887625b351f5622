"""The cache facade of one TP rank: the same decisions as every other rank, its own kv-heads.

Every rank of a TP group holds the whole logical cache (same tree, same page ids, same eviction
order); its pools hold only its kv-heads (the model's ``kv_layout`` is the rank's shard), so a
page costs ``1/tp`` of the bytes. What could make ranks drift apart is timing: each rank's copies
(L1↔L2, L2↔L3) finish at their own pace. :class:`TPCache` wraps a
:class:`~engine.cache.facade.HiCache` and makes those points visible agreement steps:

* :meth:`poll` commits, per queue, the number of leading transfers *every* rank has finished
  (``all_reduce(MIN)``), through the facade's ``poll(limits)``;
* the L3 tier (:meth:`attach_l3`) agrees on how many pages every rank's store holds, whether a
  prefetch is complete, how many pages every rank fetched, whether a backup succeeded on every
  rank, and how many finished jobs to commit (each rank reads and writes its own shard objects);
* a backup's L2 allocation (L1 → L2): issued only where every rank could allocate it.

A queue that is empty is empty on every rank (the same submissions), so an idle step costs no
collective. After :meth:`wait_all` or :meth:`close` (the group is stopping, the peers may be
gone) the rank decides alone.
"""

from __future__ import annotations

from typing import Any, Sequence

from engine.cache.facade import HiCache

QUEUES = ("load", "backup")


class TPCache:
    """Rank ``rank`` of a TP group of ``tp_size``: a :class:`HiCache` whose completions are
    agreed over ``group``. ``page_bytes``: the KV bytes of one page on each rank (for
    ``stats()["tp"]``; kv-heads may split unevenly)."""

    def __init__(self, cache: Any, tp_size: int, rank: int, group: Any,
                 page_bytes: Sequence[int]):
        self.cache = cache
        self.tp_size, self.rank, self.group = tp_size, rank, group
        self.page_bytes = list(page_bytes)
        self.agreeing = group is not None
        self.agreements = 0
        if group is not None:      # a backup one rank cannot place in L2 is skipped by all
            base = cache
            while not isinstance(base, HiCache) and "cache" in vars(base):
                base = base.cache               # through a CPCache to its facade
            if isinstance(base, HiCache):
                base.agree_backup = self.agree

    def __getattr__(self, name: str) -> Any:
        # match, admit, lock, unlock, load_back, insert, flush, tree, events, l1, l2, l3, ...
        return getattr(self.cache, name)

    def agree(self, values: list[int]) -> list[int]:
        """The element-wise minimum of ``values`` over the group (a visible step)."""
        if not self.agreeing:
            return list(values)
        import torch
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        self.agreements += 1
        return [int(v) for v in t.tolist()]

    def poll(self, limits: dict | None = None) -> dict[str, int]:
        """Commit the transfers every rank has finished (see the module docstring)."""
        cache = self.cache
        if limits is not None or not self.agreeing or \
                not any(cache._inflight_ops(q) for q in QUEUES):
            return cache.poll(limits)
        counts = self.agree([cache.ready_count(q) for q in QUEUES])
        return cache.poll(limits=dict(zip(QUEUES, counts)))

    def attach_l3(self, impl: Any, prefetch_policy: str = "wait_complete",
                  prefetch_timeout: float = 1.0, ordered: bool = False) -> None:
        self.cache.attach_l3(impl, prefetch_policy=prefetch_policy,
                             prefetch_timeout=prefetch_timeout,
                             agree=self.agree if self.group is not None else None,
                             ordered=ordered)

    def wait_all(self) -> None:
        """Finish every transfer; the group is stopping, so from now on this rank decides
        alone (a peer may already be gone)."""
        self.agreeing = False
        self.cache.wait_all()

    def close(self) -> None:
        self.agreeing = False
        self.cache.close()

    def stats(self) -> dict[str, Any]:
        """The facade's stats, and ``tp``: KV bytes per rank of the group (with CP, rank
        ``cp_rank * tp + tp_rank`` holds its CP rank's pages of its TP rank's kv-heads)."""
        out = self.cache.stats()
        p = self.cache.page_size
        cp = out.get("cp")

        def per_rank(tier: str) -> list[int] | None:
            if tier == "l2" and self.cache.l2_alloc is None:
                return None
            used = (cp[f"{tier}_used_tokens_per_rank"] if cp is not None
                    else [out.get(f"{tier}_used_tokens", 0)])
            return [u // p * b for u in used for b in self.page_bytes]

        out["tp"] = {"tp_size": self.tp_size, "l1_kv_bytes_per_rank": per_rank("l1"),
                     "l2_kv_bytes_per_rank": per_rank("l2"), "agreements": self.agreements}
        return out
