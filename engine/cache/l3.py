"""The L3 tier of the facade: prefetch L3 → L2 on a miss, back up L2 → L3.

:class:`L3Tier` is the object the facade holds (composition) for these steps. It drives one of two
implementations behind one small interface, so its logic is written once:

* :class:`StoreTier` moves real bytes through an :class:`engine.storage.l3store.L3Store`
  (file or Mooncake backend) on a background thread; results are committed on the scheduler
  thread in :meth:`HiCache.poll`.
* :class:`SimulatedTier` (trace replay) keeps only the set of stored page keys, with a capacity
  in pages and LRU eviction; everything completes at once.

Prefetch policies (docs/engine-api.md): ``best_effort`` (never wait: what arrives later serves later
requests), ``wait_complete`` (wait for the whole fetch), ``timeout`` (wait up to a deadline).
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from engine.cache.events import EV
from engine.core.choices import Choice
from engine.core.hashing import PageHash, namespace_seed, page_hashes
from engine.core.namespace import Namespace
from formats.ranklog_events import OpId

log = logging.getLogger("hicache.l3")


class PrefetchPolicy(Choice):
    __what__ = "prefetch policy"

    BEST_EFFORT = "best_effort"
    WAIT_COMPLETE = "wait_complete"
    TIMEOUT = "timeout"


def chain_hashes(tokens: np.ndarray, page_size: int, namespace: Namespace | str | None,
                 prefix: Sequence[PageHash] = ()) -> list[PageHash]:
    """Chained page hashes of every full page of ``tokens``, reusing ``prefix`` hashes."""
    n_full = len(tokens) // page_size
    k = min(len(prefix), n_full)
    head = list(prefix[:k])
    seed = head[-1] if head else namespace_seed(namespace)
    return head + page_hashes(tokens[k * page_size:n_full * page_size], page_size, seed)


class Job:
    """One asynchronous L3 operation; ``result`` is set by the worker."""

    __slots__ = ("kind", "hashes", "pages", "payload", "result", "error", "event", "op_id")

    def __init__(self, kind: str, hashes: list, pages: np.ndarray, payload: Any, op_id: OpId):
        self.kind = kind
        self.hashes = hashes
        self.pages = pages
        self.payload = payload
        self.result: int | None = None
        self.error: BaseException | None = None
        self.event = threading.Event()
        self.op_id = op_id


class SimulatedTier:
    """Keys only: what a store of ``capacity_pages`` (-1: unbounded) would hold."""

    synchronous = True

    def __init__(self, capacity_pages: int):
        self.capacity = capacity_pages
        self._keys: "collections.OrderedDict[bytes, None]" = collections.OrderedDict()
        self.counters: collections.Counter = collections.Counter()

    def exists_prefix(self, hashes: Sequence[PageHash]) -> int:
        n = 0
        for h in hashes:
            if h not in self._keys:
                break
            self._keys.move_to_end(h)
            n += 1
        return n

    def run(self, job: Job) -> None:
        if job.kind == "get":
            job.result = self.exists_prefix(job.hashes)
            self.counters["pages_read"] += job.result
        else:
            for h in job.hashes:
                if h in self._keys:
                    self._keys.move_to_end(h)
                    continue
                self._keys[h] = None
                self.counters["pages_written"] += 1
            if self.capacity >= 0:
                while len(self._keys) > self.capacity:
                    self._keys.popitem(last=False)
                    self.counters["pages_evicted"] += 1
            job.result = len(job.hashes)
        job.event.set()

    def demote(self, hashes: Sequence[PageHash]) -> None:
        """These pages are evicted first (a closed session's); a later use makes them recent."""
        keys = self._keys
        for h in hashes:
            if h in keys:
                keys.move_to_end(h, last=False)
                self.counters["pages_demoted"] += 1

    def clear(self) -> int:
        n = len(self._keys)
        self._keys.clear()
        return n

    def stats(self) -> dict[str, Any]:
        return {"backend": "simulated", "stored_pages": len(self._keys),
                "capacity_pages": self.capacity, **self.counters}

    def close(self) -> None:
        pass


class StoreTier:
    """Real bytes between the L2 host pool and an L3 store, on one worker thread."""

    synchronous = False

    def __init__(self, store: Any, host_pool: Any):
        self.store = store
        self.pool = host_pool
        bind = getattr(store, "bind", None)
        if bind is not None:               # checksums of L3 objects as pages land in L2
            bind(host_pool)
        self._q: "queue.Queue[Job | None]" = queue.Queue()
        self._thread = threading.Thread(target=self._worker, name="hicache-l3", daemon=True)
        self._thread.start()

    def exists_prefix(self, hashes: Sequence[PageHash]) -> int:
        try:
            return self.store.exists_prefix(hashes)
        except Exception as exc:  # an unreachable store is a miss, counted by the store
            log.warning("L3 exists failed: %s", exc)
            return 0

    debug_delay_s = 0.0        # debug: hold each job this long (stage-delay demos/tests)

    def run(self, job: Job) -> None:
        self._q.put(job)

    def demote(self, hashes: Sequence[PageHash]) -> None:
        """Ask the store to evict these pages first, on the worker, in order with the jobs
        queued before it; nobody waits."""
        self._q.put(Job("demote", list(hashes), np.empty(0, dtype=np.int64), None, OpId(0)))

    def _worker(self) -> None:
        while True:
            job = self._q.get()
            if job is None:
                return
            if self.debug_delay_s:
                time.sleep(self.debug_delay_s)
            try:
                if job.kind == "get":
                    job.result = self.store.get_pages(job.hashes, self.pool, job.pages)
                elif job.kind == "demote":
                    demote = getattr(self.store, "demote_pages", None)
                    job.result = 0 if demote is None else demote(job.hashes)
                else:
                    job.result = self.store.put_pages(job.hashes, self.pool, job.pages)
            except BaseException as exc:  # surfaced on the scheduler thread at commit
                job.error = exc
                job.result = 0
                if job.kind == "demote":  # advisory, never committed: said here instead
                    log.warning("L3 demote of %d pages failed: %s", len(job.hashes), exc)
            job.event.set()

    def clear(self) -> int:
        return self.store.clear()

    def stats(self) -> dict[str, Any]:
        return self.store.stats()

    def close(self) -> None:
        self._q.put(None)
        self._thread.join(timeout=10)
        self.store.close()


class L3Tier:
    """The facade's L3 tier: prefetch L3 → L2 on a miss, back up L2 → L3 (composition: the
    facade holds one, see :meth:`engine.cache.facade.HiCache.attach_l3`).

    Prefetched pages become L2-only tree nodes under the matched path, so the ordinary
    load-back brings them on to L1. Backups are written through to L3 when a node's L2 copy is
    committed, and on L2 eviction when not yet stored. Every step emits its event.

    What it needs of the cache is handed to it explicitly: the tree, the L2 allocator, the event
    log and counters, ``pin(node, ±1)`` (the facade's one lock walk), ``touch(node)`` (make a
    node an eviction candidate), ``evict_l2(pages)`` and ``op_ids`` (the op-id counter transfers
    draw from too, so every ``op`` of a rank's events is one integer sequence).
    """

    def __init__(self, impl: "SimulatedTier | StoreTier", page_size: int, *,
                 tree: Any, l2_alloc: Any, events: Any, counters: collections.Counter,
                 pin: Callable[[Any, int], None], touch: Callable[[Any], None],
                 evict_l2: Callable[[int], int], op_ids: Iterator[OpId],
                 prefetch_policy: "str | PrefetchPolicy" = PrefetchPolicy.WAIT_COMPLETE,
                 prefetch_timeout: float = 1.0,
                 agree: Callable[[list[int]], list[int]] | None = None,
                 place: Callable[[list, int], np.ndarray] | None = None,
                 adopt: Callable[[Any], None] | None = None):
        self.impl = impl
        # Several ranks holding shards of the same pages (TP) must take the same L3 decisions
        # although each reads and writes its own objects: ``agree(counts)`` returns the
        # element-wise minimum over the ranks (None: a single rank, decide alone).
        self._agree = agree
        # Ranks that each hold some of the pages (CP): ``place(path, n)`` gives the L2 pages of
        # up to ``n`` pages fetched after ``path`` (continuing its owner rotation, evicting for
        # the ranks short of room; maybe fewer), ``adopt(node)`` records a prefetched node's
        # rotation. None: plain allocation.
        self._place, self._adopt = place, adopt
        self.page_size = page_size
        self.policy = PrefetchPolicy.parse(prefetch_policy)
        self.timeout = prefetch_timeout
        self.inflight: "collections.deque[Job]" = collections.deque()
        self.counters: collections.Counter = collections.Counter()
        self._tree, self._l2_alloc, self._events = tree, l2_alloc, events
        self._cache_counters = counters
        self._pin, self._touch, self._evict_l2 = pin, touch, evict_l2
        self._op_ids = op_ids
        # A pipeline stage (docs/parallelism.md §2): a prefetch is committed at admission only
        # when every stage waits for it (wait_complete); otherwise it stays queued until
        # ``poll(limit)`` consumes it at the step pp_sync names, so all stages see the same
        # L3 hit lengths whatever their own copy speed.
        self.ordered = False
        # Debug hooks of a divergence injector (engine.runtime.ranks.diverge), on one rank: the
        # clock that times a prefetch, and a cap on the L2 pages a prefetch may get.
        self.clock: Callable[[], float] = time.monotonic
        self.alloc_cap: Callable[[int], int] | None = None
        # Pipeline stages (each its own store objects) agree on one L3 decision: the pages
        # every stage's store holds, every stage fetched, whether a backup reached every
        # stage's store. ``agree_stages(counts)`` is the minimum over the replica's ranks
        # (None: one stage); called where every stage decides in the same order (admission,
        # and the commits pp_sync names).
        self.agree_stages: Callable[[list[int]], list[int]] | None = None

    # -- jobs ----------------------------------------------------------------------------------
    def hashes(self, tokens: np.ndarray, namespace: Namespace | str | None,
               prefix: Sequence[PageHash] = ()) -> list[PageHash]:
        return chain_hashes(tokens, self.page_size, namespace, prefix)

    def exists_prefix(self, hashes: Sequence[PageHash]) -> int:
        return self.impl.exists_prefix(hashes)

    def submit(self, kind: str, hashes: list, pages: np.ndarray, payload: Any) -> Job:
        job = Job(kind, hashes, pages, payload, next(self._op_ids))
        self.inflight.append(job)
        self.impl.run(job)
        return job

    def wait(self, job: Job, started: float | None = None) -> bool:
        """Wait for a prefetch as the policy says; True when it is complete. ``timeout``:
        the whole prefetch (from ``started``, ``time.monotonic()`` before its existence query)
        waits at most the prefetch timeout."""
        if job.event.is_set():
            return True
        if self.policy is PrefetchPolicy.BEST_EFFORT:
            return False
        if self.policy is PrefetchPolicy.WAIT_COMPLETE:
            job.event.wait()
            return True
        spent = 0.0 if started is None else self.clock() - started
        # a timer past threading's limit (1e308 s, say) raises OverflowError: clamp it
        return job.event.wait(min(max(0.0, self.timeout - spent), threading.TIMEOUT_MAX))

    def take_done(self, job_filter: Callable[[Job], bool] | None = None) -> list[Job]:
        """Remove and return finished jobs (in submission order for each leading run)."""
        done = []
        keep: "collections.deque[Job]" = collections.deque()
        for job in self.inflight:
            if job.event.is_set() and (job_filter is None or job_filter(job)):
                done.append(job)
            else:
                keep.append(job)
        self.inflight = keep
        return done

    def wait_all(self) -> None:
        for job in list(self.inflight):
            job.event.wait()

    def clear(self) -> int:
        """Empty the store (after :meth:`wait_all`: no job of ours is left in flight)."""
        self.wait_all()
        removed = self.impl.clear()
        self.counters["cleared"] += max(removed, 0)
        return removed

    def stats(self) -> dict[str, Any]:
        return {**self.impl.stats(), **{f"tier_{k}": v for k, v in self.counters.items()},
                "prefetch_policy": self.policy.value}

    def close(self) -> None:
        self.wait_all()
        self.impl.close()

    def demote(self, nodes: Sequence[Any]) -> int:
        """The stored pages of ``nodes`` (a closed session's) are the store's first to evict;
        returns the pages asked. Soft: a later read or write of them makes them recent."""
        hashes: list = []
        for node in nodes:
            k = int(node.l3 or 0)
            if k:
                hashes += self.node_hashes(node)[:k]
        if hashes:
            self.impl.demote(hashes)
            self.counters["pages_demoted"] += len(hashes)
        return len(hashes)

    # -- hashes ------------------------------------------------------------------------------
    def node_hashes(self, node) -> list:
        if node.l3_hashes is None:
            toks = self._tree.prefix_tokens(node)
            k = len(node.tokens) // self.page_size
            node.l3_hashes = self.hashes(toks, node.namespace)[-k:]
        return node.l3_hashes

    def assign_hashes(self, path: list, hashes: Sequence[PageHash]) -> None:
        off = 0
        for node in path:
            k = len(node.tokens) // self.page_size
            if node.l3_hashes is None:
                node.l3_hashes = list(hashes[off:off + k])
            off += k

    # -- prefetch L3 -> L2 ---------------------------------------------------------------------
    def prefetch(self, path: list, toks: np.ndarray, namespace, hashes: list,
                 start: int, rid) -> int:
        """Fetch pages ``start…`` that L3 holds into L2 (a new node appended to ``path`` when
        committed now); returns the pages committed now."""
        p = self.page_size
        if any(j.kind == "get" and j.hashes[:1] == hashes[start:start + 1]
               for j in self.inflight):
            return 0                       # already on its way (an earlier request's fetch)
        started = self.clock()
        n3 = self.exists_prefix(hashes[start:])
        if self._agree is not None:        # the pages every rank's store holds
            n3 = self._agree([n3])[0]
        if self.agree_stages is not None:  # ... and every stage's
            n3 = self.agree_stages([n3])[0]
        alloc = self._l2_alloc
        if n3 == 0 or alloc is None:
            return 0
        parent = path[-1] if path else self._tree.root(namespace)
        self._pin(parent, +1)
        pages = self._place(path, n3) if self._place is not None else self._alloc_l2(n3)
        if self._agree is not None and self._place is None:   # TP: the pages every rank got
            m = self._agree([len(pages)])[0]
            if m < len(pages):
                self._l2_alloc.free(pages[m:])
                pages = pages[:m]
        n = len(pages)
        if n == 0:
            self._pin(parent, -1)
            return 0
        job = self.submit("get", hashes[start:start + n], pages,
                          payload=(parent, toks[start * p:(start + n) * p].copy(), rid))
        self._events.emit(EV.RESTORE, op=job.op_id, rid=rid, pages=int(n), src="l3")
        self._cache_counters["prefetch_pages_issued"] += n
        # A pipeline stage (``ordered``) waits only where every stage waits (wait_complete);
        # otherwise the job stays queued for the step pp_sync names.
        inline = not self.ordered or self.policy is PrefetchPolicy.WAIT_COMPLETE
        done = inline and self.wait(job, started)
        if self._agree is not None:        # committed now only where every rank has it
            done = bool(self._agree([int(done)])[0])
            if done:
                job.event.wait()
        if done:
            self.take_done(lambda j: j is job)
            node = self._commit(job)
            if node is not None:
                path.append(node)
                return len(node.tokens) // p
        return 0

    def _alloc_l2(self, n: int) -> np.ndarray:
        """Up to ``n`` L2 pages, evicting for them (fewer when L2 cannot make room)."""
        alloc = self._l2_alloc
        short = n - alloc.free_pages
        if short > 0:
            self._evict_l2(short)
        n = min(n, alloc.free_pages)
        if self.alloc_cap is not None:
            n = min(n, self.alloc_cap(n))
        return alloc.alloc(n) if n else np.empty(0, dtype=np.int64)

    def _commit(self, job: Job):
        if job.error is not None:
            log.warning("L3 %s failed: %s", job.kind, job.error)
            self._cache_counters["l3_errors"] += 1
        if job.kind == "put":
            node = job.payload
            ok = False
            if job.error is None:
                assert job.result is not None, "a finished job without an error has a result"
                ok = int(job.result) == len(job.hashes)
            if self._agree is not None:
                ok = bool(self._agree([int(ok)])[0])
            if self.agree_stages is not None:
                ok = bool(self.agree_stages([int(ok)])[0])
            if ok:
                # The node may have been split while the put was in flight: its pages are now
                # the last len(hashes) pages of the path ending at it, spread over ancestors.
                left, cur = len(job.hashes), node
                while left > 0 and cur.parent is not None:
                    k = len(cur.tokens) // self.page_size
                    cur.l3 = max(cur.l3, min(k, left))
                    left -= k
                    cur = cur.parent
            self._pin(node, -1)
            self._events.emit(EV.BACKUP_DONE, op=job.op_id, dst="l3")
            return None
        parent, toks, rid = job.payload
        p = self.page_size
        tree = self._tree
        n_ok = int(job.result or 0)
        if self._agree is not None:        # the pages every rank fetched
            n_ok = self._agree([n_ok])[0]
        if self.agree_stages is not None:  # ... on every stage
            n_ok = self.agree_stages([n_ok])[0]
        pages = job.pages
        node = None
        alive = parent.parent is not None or tree.roots.get(parent.namespace) is parent
        if n_ok and alive and tree.key_of(toks) not in parent.children:
            node = tree.add_child(parent, toks[:n_ok * p])
            node.l2 = pages[:n_ok]
            node.l3 = n_ok
            node.l3_hashes = list(job.hashes[:n_ok])
            node.last_access = tree.tick()
            if self._adopt is not None:
                self._adopt(node)
            self._touch(node)
            self._cache_counters["prefetch_pages"] += n_ok
            rest = pages[n_ok:]
        else:
            rest = pages
        if len(rest):
            self._l2_alloc.free(rest)
        self._pin(parent, -1)
        self._events.emit(EV.RESTORE_DONE, op=job.op_id, pages=int(n_ok) if node else 0)
        return node

    # -- backup L2 -> L3 -----------------------------------------------------------------------
    def put(self, node, sync: bool = False) -> None:
        hashes = self.node_hashes(node)
        self._pin(node, +1)
        job = self.submit("put", list(hashes), node.l2, payload=node)
        self._events.emit(EV.BACKUP, op=job.op_id, pages=len(hashes), dst="l3")
        if sync or self.impl.synchronous:
            job.event.wait()
            self.take_done(lambda j: j is job)
            self._commit(job)

    def ready_count(self) -> int:
        """How many leading jobs are locally complete (what a stage can ACK)."""
        n = 0
        while n < len(self.inflight) and self.inflight[n].event.is_set():
            n += 1
        return n

    def poll(self, limit: int | None = None) -> int:
        """Commit finished jobs. ``limit`` (a pipeline stage, pp_sync): exactly the first
        ``limit`` in submission order, waiting for each, recorded first as a ``pp_ack`` of
        queue ``storage``. With ``agree`` (TP ranks): the leading jobs every rank finished."""
        if limit is not None:
            assert 0 <= limit <= len(self.inflight), (
                f"asked to consume {limit} storage ACKs, {len(self.inflight)} in flight")
            done = [self.inflight.popleft() for _ in range(limit)]
            self._events.emit(EV.PP_ACK, queue="storage", consumed=limit,
                              acks=[j.op_id for j in done])
        elif self._agree is not None:
            if not self.inflight:          # the same jobs in flight on every rank
                return 0
            n = self._agree([self.ready_count()])[0]   # the leading jobs every rank finished
            done = [self.inflight.popleft() for _ in range(n)]
        else:
            done = self.take_done()
        for job in done:
            job.event.wait()
            self._commit(job)
        return len(done)
