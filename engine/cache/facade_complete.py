"""The facade's transfer completion, as a base of :class:`~engine.cache.facade.HiCache`: the
queues of load-back and backup ops in flight committed in submission order (``poll``, with the
pipeline stages' agreed counts; ``wait_all``; ``ready_count``, what a rank can ACK), and what a
committed op does to its nodes — a finished load-back leaves L1 in place (a failed one rolls
back to L2 only), a finished backup gives its nodes their L2 pages (and their L3 write)."""

from __future__ import annotations

import collections
from typing import Any

import numpy as np

from engine.cache.events import EV
from engine.cache.facade_evict import EvictionMethods
from engine.cache.transfer import OpKind, TransferOp


class CompletionMethods(EvictionMethods):
    """Needs of the host class, beyond :class:`EvictionMethods`': ``_inflight`` (op kind ->
    its ops in submission order)."""

    _inflight: dict[OpKind, collections.deque[TransferOp]]
    l3: Any

    def poll(self, limits: dict | None = None) -> dict[str, int]:
        """Commit finished transfers in submission order; returns how many per queue.

        ``limits`` (queue name → count) consumes exactly that many, waiting for local
        completion if needed — the PP stage protocol (docs/engine-api.md): every stage of a
        pipeline commits the same ops in the same step. Each queue named in ``limits`` records
        one ``pp_ack`` event (the count consumed and the op ids) before its ``*_done`` events.
        """
        if limits is None and self.l3 is None and not any(self._inflight.values()):
            return {}
        out = {}
        for kind, q in self._inflight.items():
            if limits is not None and kind.value in limits:
                n = int(limits[kind.value])
                assert 0 <= n <= len(q), (f"asked to consume {n} {kind.value} ACKs, "
                                          f"{len(q)} in flight")
                # the agreed decision first, then its consequences (the *_done commits)
                self.events.emit(EV.PP_ACK, queue=kind.value, consumed=n,
                                 acks=[q[i].op_id for i in range(n)])
                for _ in range(n):
                    q[0].wait()
                    self._complete(q.popleft())
            else:
                n = 0
                while q and q[0].done():
                    self._complete(q.popleft())
                    n += 1
            out[kind.value] = n
        if self.l3 is not None:
            out["storage"] = self.l3.poll(None if limits is None else limits.get("storage"))
        return out

    def _inflight_ops(self, kind: str) -> list[TransferOp]:
        return list(self._inflight[OpKind(kind)])

    def ready_count(self, kind: str) -> int:
        """How many leading ops of a queue are locally complete (what a rank can ACK);
        ``storage``: the L3 tier's jobs (0 without one)."""
        if kind == "storage":
            return 0 if self.l3 is None else self.l3.ready_count()
        n = 0
        for op in self._inflight[OpKind(kind)]:
            if not op.done():
                break
            n += 1
        return n

    def _drain(self, kind: OpKind, until: TransferOp) -> None:
        q = self._inflight[kind]
        while q:
            op = q.popleft()
            op.wait()
            self._complete(op)
            if op is until:
                return

    def wait_all(self) -> None:
        for q in self._inflight.values():
            while q:
                op = q.popleft()
                op.wait()
                self._complete(op)
        if self.l3 is not None:
            self.l3.wait_all()
            self.l3.poll()

    def _complete(self, op: TransferOp) -> None:
        if op.kind is OpKind.LOAD:
            for node in op.payload:
                if node.loading is op:
                    node.loading = None
                    if op.failed:           # roll back: the node is L2-only again
                        self.l1_alloc.free(node.l1)
                        node.l1 = None
                        node.parent.n_l1_children -= 1
                        self._push_candidate(node.parent)
                    self._push_candidate(node)
            self.events.emit(EV.RESTORE_DONE, op=op.op_id)
        elif op.kind is OpKind.BACKUP:
            p = self.page_size
            claimed = np.zeros(len(op.dst_pages), dtype=bool)
            for node in op.payload:
                if node.backing_up is None or node.backing_up[0] is not op:
                    continue
                start = node.backing_up[1]
                k = len(node.tokens) // p
                node.backing_up = None
                if node.parent is None or op.failed:
                    continue
                node.l2 = op.dst_pages[start:start + k]
                claimed[start:start + k] = True
                self._push_candidate(node)
                if self.l3 is not None and node.l3 < k:
                    self._l3_put(node)
            if not claimed.all():
                assert self.l2_alloc is not None  # a backup op implies an L2 tier
                self.l2_alloc.free(op.dst_pages[~claimed])
            self.events.emit(EV.BACKUP_DONE, op=op.op_id)
