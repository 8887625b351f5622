"""pp_sync: every pipeline stage consumes the same number of completed operations.

docs/parallelism.md §2. Each stage runs the same logical cache decisions, but its transfers
(load-back, backup, L3 prefetch) finish at its own pace. If stages committed whatever had finished
locally, their trees would drift apart (one stage sees a backup done and may evict a node the next
stage must keep). So:

* the first stage takes its locally ready ACK counts per queue, agrees with its TP/CP peers on the
  minimum (``all_reduce(MIN)``: a visible step), and sends that count down the pipeline;
* every later stage receives the count and consumes exactly that many, waiting for its own
  completion when it is behind, and leaving anything beyond that queued (the ACK(4)/ACK(6) case);
* the counts travel on a background thread per direction, through bounded queues: a first stage
  that runs ahead blocks once ``max_outstanding`` messages wait (backpressure), and a stage that
  hears nothing for ``timeout_s`` stops with an error naming the stage it waits for.

Consumption happens in :meth:`HiCache.poll` with ``limits``, which records a ``pp_ack`` event per
queue, so ``hicache consensus-check`` sees exactly what each stage consumed. ``enabled=False`` is
the debug switch that shows what the mechanism prevents: each stage consumes what it has.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
from typing import Any, Protocol

QUEUES = ("load", "backup", "storage")     # storage: L3 prefetches and backups


class StageCache(Protocol):
    def ready_count(self, kind: str) -> int: ...
    def poll(self, limits: dict | None = None) -> dict[str, int]: ...


class PPSyncError(RuntimeError):
    """A stage stopped hearing from the stage before it (dead, hung, or too slow)."""


@dataclasses.dataclass(frozen=True)
class StageLinks:
    """Where one stage sits: its index and the process groups it talks over.

    ``recv_group``/``send_group`` are two-member groups shared with the previous / next stage
    (one group per direction, so each background thread owns its group); ``peer_group`` holds the
    first stage's TP/CP peers (``None``: no peers, the stage's own counts are the minimum).
    """

    stage: int
    num_stages: int
    prev_rank: int | None = None
    next_rank: int | None = None
    recv_group: Any = None
    send_group: Any = None
    peer_group: Any = None

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.num_stages - 1


def adjacent_groups(num_stages: int, stage_ranks: list[int] | None = None) -> list[Any]:
    """One two-member gloo group per adjacent pair of stages (every rank must call this, in the
    same order, as ``new_group`` requires). ``stage_ranks[s]`` is stage s's global rank."""
    import torch.distributed as dist

    ranks = stage_ranks or list(range(num_stages))
    return [dist.new_group([ranks[s], ranks[s + 1]], backend="gloo")
            for s in range(num_stages - 1)]


def links_for(stage: int, num_stages: int, groups: list[Any], stage_ranks: list[int] | None = None,
              peer_group: Any = None) -> StageLinks:
    ranks = stage_ranks or list(range(num_stages))
    return StageLinks(
        stage=stage, num_stages=num_stages,
        prev_rank=ranks[stage - 1] if stage > 0 else None,
        next_rank=ranks[stage + 1] if stage < num_stages - 1 else None,
        recv_group=groups[stage - 1] if stage > 0 else None,
        send_group=groups[stage] if stage < num_stages - 1 else None,
        peer_group=peer_group)


def agree_min(values: list[int], group: Any = None) -> list[int]:
    """Element-wise minimum across the ranks of ``group`` (a no-op without one)."""
    if group is None:
        return list(values)
    import torch
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return [int(v) for v in t.tolist()]


class PPSync:
    """The per-step ACK agreement of one pipeline stage (see the module docstring)."""

    def __init__(self, links: StageLinks, *, enabled: bool = True, max_outstanding: int = 8,
                 timeout_s: float = 60.0, queues: tuple[str, ...] = QUEUES):
        if max_outstanding < 1:
            raise ValueError(f"max_outstanding must be >= 1, got {max_outstanding}")
        self.links = links
        self.enabled = enabled
        self.timeout_s = timeout_s
        self.queues = queues
        self.steps = 0
        self.max_seen_outstanding = 0
        self._outbox: queue.Queue = queue.Queue(maxsize=max_outstanding)
        self._inbox: queue.Queue = queue.Queue(maxsize=max_outstanding)
        self._error: BaseException | None = None
        self._threads: list[threading.Thread] = []
        if enabled and links.next_rank is not None:
            self._start(self._send_loop, "pp-sync-send")
        if enabled and links.prev_rank is not None:
            self._start(self._recv_loop, "pp-sync-recv")

    # -- the step --------------------------------------------------------------------------
    def decide(self, cache: StageCache) -> list[int]:
        """How many completed ops of each queue this stage consumes now."""
        if not self.enabled:
            return [cache.ready_count(q) for q in self.queues]
        if self.links.first:
            counts = agree_min([cache.ready_count(q) for q in self.queues], self.links.peer_group)
        else:
            counts = self._receive()
        if not self.links.last:
            self._publish(counts)
        return counts

    def step(self, cache: StageCache) -> dict[str, int]:
        """Agree (or receive), forward, and consume: returns what :meth:`poll` consumed."""
        counts = self.decide(cache)
        self.steps += 1
        return cache.poll(limits=dict(zip(self.queues, counts)))

    # -- the links -------------------------------------------------------------------------
    def _publish(self, counts: list[int]) -> None:
        self._check()
        msg = [self.steps, *counts]
        try:
            self._outbox.put(msg, timeout=self.timeout_s)      # blocks when full: backpressure
        except queue.Full:
            raise PPSyncError(f"pp_sync: stage {self.links.stage + 1} accepted no ACK counts for "
                              f"{self.timeout_s:g} s (dead or hung)") from None
        self.max_seen_outstanding = max(self.max_seen_outstanding, self._outbox.qsize())

    def _receive(self) -> list[int]:
        try:
            msg = self._inbox.get(timeout=self.timeout_s)
        except queue.Empty:
            self._check()
            raise PPSyncError(f"pp_sync: stage {self.links.stage} heard nothing from stage "
                              f"{self.links.stage - 1} for {self.timeout_s:g} s (dead or hung)") from None
        if isinstance(msg, BaseException):
            raise PPSyncError(f"pp_sync: the link from stage {self.links.stage - 1} failed: "
                              f"{msg}") from msg
        step, *counts = msg
        assert step == self.steps, f"pp_sync message for step {step} arrived at step {self.steps}"
        return counts

    def _start(self, target, name: str) -> None:
        t = threading.Thread(target=target, name=name, daemon=True)
        t.start()
        self._threads.append(t)

    def _send_loop(self) -> None:
        import torch
        import torch.distributed as dist

        try:
            while True:
                msg = self._outbox.get()
                if msg is None:
                    return
                dist.send(torch.tensor(msg, dtype=torch.int64), dst=self.links.next_rank,
                          group=self.links.send_group)
        except BaseException as exc:  # surfaced on the next step, never swallowed
            self._error = exc

    def _recv_loop(self) -> None:
        import torch
        import torch.distributed as dist

        buf = torch.empty(1 + len(self.queues), dtype=torch.int64)
        try:
            while True:
                dist.recv(buf, src=self.links.prev_rank, group=self.links.recv_group)
                msg = [int(v) for v in buf.tolist()]
                if msg[0] < 0:          # the upstream stage closed its link
                    return
                self._inbox.put(msg)
        except BaseException as exc:
            self._inbox.put(exc)

    def _check(self) -> None:
        if self._error is not None:
            raise PPSyncError(f"pp_sync: sending to stage {self.links.stage + 1} failed: "
                              f"{self._error}") from self._error

    def close(self) -> None:
        """Flush what is queued, tell the next stage the link ends, and stop the threads.

        Raises :class:`PPSyncError` when the next stage does not take the last counts in time.
        """
        if self.enabled and self.links.next_rank is not None:
            try:
                self._outbox.put([-1] + [0] * len(self.queues), timeout=self.timeout_s)
                self._outbox.put(None, timeout=self.timeout_s)
            except queue.Full:
                raise PPSyncError(f"pp_sync: stage {self.links.stage + 1} did not take the last "
                                  f"ACK counts within {self.timeout_s:g} s (dead or hung)") from None
        for t in self._threads:
            t.join(timeout=self.timeout_s)
            if t.is_alive() and t.name == "pp-sync-send":
                raise PPSyncError(f"pp_sync: stage {self.links.stage + 1} did not receive the last "
                                  f"ACK counts within {self.timeout_s:g} s (dead or hung)")
        self._check()
