"""The scheduler loop: admission, batching, the forward, sampling, finishing.

See the package docstring (:mod:`engine.runtime.scheduler`) for the step structure.
"""

from __future__ import annotations

import collections
import concurrent.futures
import itertools
import logging
import math
import queue
import threading
import time
from typing import Any, Callable, Sequence

import numpy as np
import torch

from engine.cache.hints import CacheHint
from engine.cache.types import CacheFacade
from engine.core.errors import InputError, OutOfCapacity
from engine.core.namespace import Namespace, as_namespace, from_wire
from engine.runtime.model import Chunk, Model
from engine.runtime.scheduler import sampling
from engine.runtime.scheduler.params import (
    Callback,
    FinishReason,
    RequestOutput,
    SamplingParams,
    SchedulerConfig,
)
from engine.runtime.scheduler.request import _match_len, _Phase, _Req
from engine.runtime.scheduler.spec import SpecConfig, SpecDecoder, cache_layout, request_meta
from engine.runtime.scheduler.stats import SchedulerMetrics

log = logging.getLogger("hicache.scheduler")


class Scheduler:
    def __init__(self, model: Model, cache: CacheFacade, config: SchedulerConfig | None = None, *,
                 draft: Model | None = None, spec: "SpecConfig | None" = None,
                 kv_source: "Callable[[list[Chunk], list], Any] | None" = None,
                 remote: Any = None):
        """``draft`` + ``spec``: speculative decoding (engine.runtime.scheduler.spec); the cache
        then holds the draft's layers too (packed: after the target's; sidecar: own pools)."""
        assert cache.l1 is not None, "the scheduler needs a cache with KV pools (layout set)"
        assert cache.config.layout == cache_layout(model, cache.page_size, draft, spec), (
            "cache layout does not match the model's kv_layout")
        self.model = model
        self.cache = cache
        self.config = config or SchedulerConfig()
        self.page_size = cache.page_size
        self.metrics = SchedulerMetrics()
        self.step_no = 0
        self.last_error: str | None = None
        self._inbox: "queue.SimpleQueue[tuple[str, Any]]" = queue.SimpleQueue()
        self._waiting: collections.deque[_Req] = collections.deque()
        self._running: list[_Req] = []
        self._by_rid: dict[str, _Req] = {}
        self._rid_counter = itertools.count()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.halted = False                    # a lockstep group's halt was applied
        self._lock = threading.Lock()          # guards _by_rid between submit and the loop
        # What the forward reads and writes KV through: None = the cache's L1 pool; a CP rank's
        # ``kv_source(chunks, layer_hooks)`` returns a ShardedKV (engine.runtime.ranks.cp_kv).
        self.kv_source = kv_source
        cfg = model.cfg
        self.vocab_size = cfg.vocab_size
        self.eos_ids = frozenset(cfg.eos_ids)
        banned = [] if cfg.bos_id is None or cfg.bos_id in self.eos_ids else [cfg.bos_id]
        if cfg.vocab_size == 260 and cfg.bos_id == 256:     # byte vocabulary: PAD, SEP too
            banned += [258, 259]
        self._banned = torch.as_tensor(banned, dtype=torch.long)
        self.spec = SpecDecoder(self, draft, spec) if draft is not None and spec is not None \
            else None
        # P/D decode worker: fetches what admission lacks (engine.runtime.pd.decode.PDClient)
        self.remote = remote

    # -- thread-safe API ------------------------------------------------------------------
    def submit(self, input_ids: Sequence[int] | np.ndarray, sampling: SamplingParams,
               callback: Callback | None = None, *, rid: str | None = None,
               namespace: Namespace | str | None = None, priority: int = 0,
               hint: CacheHint | None = None) -> str:
        """Queue a request; returns its id. Raises :class:`InputError` for bad requests.
        ``hint``: the client's cache hint, applied to the request's path at its release."""
        namespace = as_namespace(namespace)
        ids = np.asarray(input_ids, dtype=np.int64).reshape(-1)
        self.validate(ids, sampling)
        if self._thread is not None and not self._thread.is_alive():
            raise OutOfCapacity(f"the scheduler has stopped: {self.last_error or 'shut down'}")
        rid = rid or f"req-{next(self._rid_counter)}"
        req = _Req(rid, ids, sampling, namespace, priority, callback, hint)
        with self._lock:
            if rid in self._by_rid:
                raise InputError(f"request id {rid!r} is already in use")
            if len(self._by_rid) >= self.config.max_waiting_requests + \
                    self.config.max_running_requests:
                raise OutOfCapacity("too many requests in the queue")
            self._by_rid[rid] = req
        self._inbox.put(("req", req))
        return rid

    def validate(self, ids: np.ndarray, sampling: SamplingParams) -> None:
        cfg = self.model.cfg
        if ids.size == 0:
            raise InputError("the prompt is empty")
        if ids.min() < 0 or ids.max() >= cfg.vocab_size:
            bad = int(ids[(ids < 0) | (ids >= cfg.vocab_size)][0])
            raise InputError(f"token id {bad} is outside the vocabulary [0, {cfg.vocab_size})")
        total = ids.size + sampling.max_new_tokens
        if total > cfg.max_context:
            raise InputError(f"prompt ({ids.size} tokens) + max_new_tokens "
                             f"({sampling.max_new_tokens}) exceeds the model's context of "
                             f"{cfg.max_context} tokens")
        p = self.page_size
        pages = -(-(ids.size + max(sampling.max_new_tokens - 1, 0)) // p)
        if pages > self.cache.l1_alloc.num_pages:
            raise InputError(f"the request needs {pages * p} tokens of KV; L1 holds "
                             f"{self.cache.l1_alloc.num_pages * p}")

    def abort(self, rid: str) -> None:
        self._inbox.put(("abort", rid))

    def close_session(self, namespace: Namespace | str | None, session: str) -> None:
        """A client closed ``session`` (of ``namespace``): at the next step the cache marks
        that session's private KV first to go (every rank of a group at the same step)."""
        ns = as_namespace(namespace)
        self._inbox.put(("close_session", [None if ns is None else ns.to_wire(), str(session)]))

    def finish_early(self, rid: str) -> None:
        """End a request as if it had hit a stop token (the server matched a stop string):
        unlike :meth:`abort`, its sequence goes into the tree."""
        self._inbox.put(("stop", rid))

    def call(self, fn: Callable[[], Any]) -> "concurrent.futures.Future[Any]":
        """Run ``fn`` on the scheduler thread between steps (cache access from other threads)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        if self._thread is None or not self._thread.is_alive():   # no loop: run it here
            try:
                fut.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                fut.set_exception(exc)
            return fut
        self._inbox.put(("call", (fn, fut)))
        return fut

    def generate(self, input_ids: Sequence[int] | np.ndarray, sampling: SamplingParams,
                 **kw: Any) -> tuple[list[int], dict[str, Any]]:
        """Blocking convenience: ``(output_ids, meta)``. Steps inline without a thread."""
        ids: list[int] = []
        final: list[RequestOutput] = []
        done = threading.Event()

        def cb(o: RequestOutput) -> None:
            ids.extend(o.new_token_ids)
            if o.finished:
                final.append(o)
                done.set()

        self.submit(input_ids, sampling, cb, **kw)
        if self._thread is None:
            self.run_until_idle()
        done.wait()
        if final[0].error:
            raise RuntimeError(final[0].error)
        return ids, final[0].meta or {}

    # -- lifecycle ------------------------------------------------------------------------
    def start(self) -> None:
        assert self._thread is None, "scheduler already started"
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="hicache-scheduler",
                                        daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the loop; running and waiting requests are aborted (resources released)."""
        if self._thread is None:
            return
        self._stop.set()
        self._inbox.put(("wake", None))
        self._thread.join(timeout)
        self._thread = None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def num_running(self) -> int:
        return len(self._running)

    def num_waiting(self) -> int:
        return len(self._waiting)

    def idle(self) -> bool:
        return not self._running and not self._waiting and self._inbox.empty()

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                busy = self.step(block=True)
                if not busy:
                    continue
        except BaseException:  # noqa: BLE001 - logged, then every request is failed
            log.exception("scheduler thread crashed")
            self.last_error = "scheduler thread crashed (see server log)"
            self._fail_all(self.last_error)
            raise
        finally:
            self._drain_inbox()
            for r in list(self._running) + list(self._waiting):
                self._finish(r, FinishReason.ABORT)

    def run_until_idle(self, max_steps: int = 1_000_000) -> None:
        """Step inline until nothing is queued or running (tests, no thread)."""
        for _ in range(max_steps):
            self.step(block=False)
            if self.idle():
                self.cache.poll()
                return
        raise AssertionError("scheduler did not become idle")

    # -- one step -------------------------------------------------------------------------
    def step(self, block: bool = False) -> bool:
        """One scheduling step; returns False when there was nothing to run."""
        self._drain_inbox(block=block and not self._running and not self._waiting)
        if self.halted:
            return False
        self.step_no += 1
        self.cache.events.set_step(self.step_no)
        self._tick_clock()
        self._consume_completions()
        ran_spec = self._spec_round()
        chunks, reqs = self._build_batch()
        self._decided()
        if not chunks:
            if ran_spec:
                self.metrics.steps += 1
                return True
            if (block and self._waiting) or self._running:   # waiting for room or for KV
                self._stop.wait(0.002)
            return False
        try:
            self._run_batch(chunks, reqs)
        except Exception as exc:  # noqa: BLE001 - logged; the batch's requests fail
            self._batch_failed(exc, reqs)
        self.metrics.steps += 1
        return True

    def _tick_clock(self) -> None:
        """The hint clock (TTL deadlines), once per step: this process's monotonic clock (a
        lockstep group applies rank 0's, sent with the intake)."""
        self.cache.set_clock(time.monotonic())

    def _decided(self) -> None:
        """The step's cache decisions are made, its forward not yet run (a lockstep group
        compares its ranks' decisions here)."""

    def _batch_failed(self, exc: Exception, reqs: list[_Req]) -> None:
        """A forward that raised: its requests fail, the server goes on (a lockstep rank
        cannot: its peers ran that step; it re-raises)."""
        log.exception("forward failed for %d request(s)", len(reqs))
        self.last_error = f"{type(exc).__name__}: {exc}"
        for r in reqs:
            if r.phase is not _Phase.DONE:
                self._finish(r, FinishReason.ERROR, error=f"internal error: {exc}")

    def _spec_round(self) -> bool:
        """One speculative round for the greedy requests in decode; False when there are none."""
        if self.spec is None:
            return False
        reqs = [r for r in self._running if r.phase is _Phase.DECODE and self.spec.eligible(r)]
        if not reqs:
            return False
        try:
            self.spec.round(reqs)
        except Exception as exc:  # noqa: BLE001 - logged; the round's requests fail
            log.exception("speculative round failed for %d request(s)", len(reqs))
            self.last_error = f"{type(exc).__name__}: {exc}"
            for r in reqs:
                if r.phase is not _Phase.DONE:
                    self._finish(r, FinishReason.ERROR, error=f"internal error: {exc}")
        return True

    def _consume_completions(self) -> None:
        """Commit finished transfers (a pipeline stage consumes the agreed count instead)."""
        self.cache.poll()

    def _drain_inbox(self, block: bool = False) -> None:
        for kind, item in self._pull_inbox(block):
            self._handle(kind, item)

    def _pull_inbox(self, block: bool = False) -> list[tuple[str, Any]]:
        # Wake up now and then even when idle, so poll() commits finished backups.
        out: list[tuple[str, Any]] = []
        while True:
            try:
                if not out and block:
                    out.append(self._inbox.get(timeout=0.02))
                else:
                    out.append(self._inbox.get_nowait())
            except queue.Empty:
                return out

    def _handle(self, kind: str, item: Any) -> None:
        if kind == "req":
            if item.aborted:
                self._finish(item, FinishReason.ABORT)
            else:
                self._waiting.append(item)
        elif kind == "abort":
            with self._lock:
                r = self._by_rid.get(item)
            if r is not None:
                r.aborted = True
                if r in self._waiting or r in self._running:
                    self._finish(r, FinishReason.ABORT)
        elif kind == "stop":
            with self._lock:
                r = self._by_rid.get(item)
            if r is not None and r in self._running:
                self._finish(r, FinishReason.STOP)
            elif r is not None and r in self._waiting:
                self._finish(r, FinishReason.ABORT)
        elif kind == "close_session":
            ns, session = item
            self.cache.close_session(from_wire(ns), session)
        elif kind == "call":
            fn, fut = item
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except BaseException as exc:  # noqa: BLE001 - handed to the caller
                    fut.set_exception(exc)

    def _build_batch(self) -> tuple[list[Chunk], list[_Req]]:
        chunks: list[Chunk] = []
        reqs: list[_Req] = []
        budget = self.config.chunked_prefill_size
        spec = self.spec
        for r in self._running:
            if r.phase is _Phase.DECODE and not (spec is not None and spec.eligible(r)):
                chunks.append(Chunk([r.out[-1]], r.kv_len, r.pages))
                reqs.append(r)
        for r in self._running:
            if r.phase is _Phase.PREFILL and budget > 0:
                budget -= self._add_prefill(r, budget, chunks, reqs)
        while (budget > 0 and self._waiting
               and len(self._running) < self.config.max_running_requests):
            r = self._waiting[0]
            if not self._admit(r):
                break
            self._waiting.popleft()
            self._running.append(r)
            budget -= self._add_prefill(r, budget, chunks, reqs)
        return chunks, reqs

    def _add_prefill(self, r: _Req, budget: int, chunks: list[Chunk], reqs: list[_Req]) -> int:
        if r.load is not None and not r.load.ready():
            return 0                       # P/D: no KV on the way yet; the others run meanwhile
        n = min(budget, r.prompt_len - r.kv_len)
        last = r.kv_len + n == r.prompt_len
        chunks.append(Chunk(r.ids[r.kv_len:r.kv_len + n], r.kv_len, r.pages,
                            logits=last and r.sampling.max_new_tokens > 0,
                            all_logits=r.sampling.input_logprobs_from is not None))
        reqs.append(r)
        return n

    def _admit(self, r: _Req) -> bool:
        """One all-or-nothing :meth:`HiCache.admit`; False (and nothing held) when L1 has no
        room. The last prompt token is never matched: computing it yields the first output's
        logits. The page table covers every position that will hold KV (:meth:`_Req.kv_needed`).

        What is reused: the whole cached pages of the matched prompt (L1, or loaded back from
        L2 / L3), and — partial last-page reuse — the KV of the tokens after them that a cached
        L1 page starts with, copied by the cache into the request's first own page. ``kv_len``
        (and ``draft_len``: the copy carries the draft's KV) starts after both, so the forward
        computes only what is not cached: a repeated prompt computes its last token alone, not
        the last page (SGLang and vLLM recompute that page). The partial copy is off
        (:meth:`_partial_reuse`) where it cannot be proven right.
        """
        p = self.page_size
        matched = r.ids[:_match_len(r)]
        extra = -(-r.kv_needed() // p) - (-(-len(matched) // p))
        a = self.cache.admit(matched, r.namespace, rid=r.rid, priority=r.priority,
                             extra_pages=extra, reuse=not self.config.disable_radix_cache,
                             partial=self._partial_reuse())
        if a is None:
            return False
        r.receipt, r.load, r.hashes = a.receipt, a.load, a.hashes
        r.cached_device, r.cached_host, r.cached_storage = a.device_len, a.host_len, a.storage_len
        r.pages = a.pages
        r.n_prefix_pages = a.n_prefix_pages
        r.kv_len = a.n_prefix_pages * p + a.partial_len
        r.draft_len = r.kv_len            # a cached prefix carries the draft's KV with it
        if self.remote is not None:        # the rest of the matched part comes over the link
            r.pd = {"decode_device": a.device_len, "decode_host": a.host_len,
                    "decode_storage": a.storage_len}
            h = self.remote.fetch(r.rid, r.namespace, matched, r.kv_len, r.pages, r.load, r.pd)
            if h is not None:
                r.load, r.kv_len = h, len(matched)
        r.phase = _Phase.PREFILL
        r.t_admit = time.perf_counter()
        self.metrics.queue_time.observe(r.t_admit - r.t_arrival)
        return True

    def _partial_reuse(self) -> bool:
        """Whether admission may copy a partially matching cached page (:meth:`_admit`). Off
        with ``disable_partial_page_reuse`` (and without the radix cache: nothing is matched);
        on a CP rank (``kv_source`` set: each rank holds the rows of the pages it owns, and the
        cached page and the request's page may have different owners); on a P/D decode worker
        (``remote``: it asks the prefill worker for the KV from a page-aligned position). TP
        and PP ranks keep it: each copies its own heads / layers, and their trees, commits and
        so decisions are the same at every step (an event, ``partial``, records each)."""
        return not (self.config.disable_partial_page_reuse or self.kv_source is not None
                    or self.remote is not None)

    def _run_batch(self, chunks: list[Chunk], reqs: list[_Req]) -> None:
        logits = self._forward(chunks, reqs)
        self._apply(chunks, reqs, self._decide(chunks, reqs, logits), time.perf_counter())

    def _forward(self, chunks: list[Chunk], reqs: list[_Req]) -> torch.Tensor | None:
        """The model over the batch: logits (``None`` where a pipeline stage has none)."""
        hooks = [r.load.wait_layer for r in reqs if r.load is not None]
        t0 = time.perf_counter()
        kv = self.cache.l1.buf if self.kv_source is None else self.kv_source(chunks, hooks)
        try:
            logits = self.model.forward(chunks, kv, self.page_size, hooks)
        finally:
            if kv is not self.cache.l1.buf:
                kv.close()
        self.metrics.forward_seconds += time.perf_counter() - t0
        if self.spec is not None:
            self.spec.mirror(chunks, reqs)
        return logits

    def _decide(self, chunks: list[Chunk], reqs: list[_Req], logits: torch.Tensor | None) -> list:
        """Per chunk: ``(token | None, error | None, logprob, prompt logprobs)`` — what the
        logits make of it (a token only where the chunk completes the prompt or decodes)."""
        assert logits is not None, "only a stage with logits decides"
        out: list = []
        row = 0
        for c, r in zip(chunks, reqs):
            n_rows = len(c) if c.all_logits else int(c.logits)
            rows, row = logits[row:row + n_rows], row + n_rows
            if c.all_logits:
                self._input_logprobs(r, c, rows)
            done_prompt = r.phase is not _Phase.PREFILL or r.kv_len + len(c) >= r.prompt_len
            if not done_prompt or r.sampling.max_new_tokens == 0:
                out.append((None, None, None, r.input_lp))
                continue
            try:
                out.append((self._sample(rows[-1], r), None, r.lp_pending, r.input_lp))
            except Exception as exc:  # one request's sampling never fails its batch
                log.exception("sampling failed for request %s", r.rid)
                out.append((None, f"sampling failed: {exc}", None, r.input_lp))
        return out

    def _apply(self, chunks: list[Chunk], reqs: list[_Req], decisions: list, now: float) -> None:
        """Advance each request by its chunk and take its decided token (every stage of a
        pipeline applies the same decisions)."""
        for c, r, (tok, err, lp, input_lp) in zip(chunks, reqs, decisions):
            r.lp_pending, r.input_lp = lp, input_lp
            failed = r.load.error if r.load is not None else None   # P/D KV that never came
            r.load = None                  # every layer hook has returned: the prefix is in L1
            if failed:
                self._finish(r, FinishReason.ERROR, error=failed)
                continue
            prefill = r.phase is _Phase.PREFILL
            r.kv_len += len(c)
            if prefill:
                self.metrics.computed_prompt_tokens += len(c)
                if r.kv_len < r.prompt_len:
                    continue
                r.phase = _Phase.DECODE
                if r.sampling.max_new_tokens == 0:
                    r.t_first = now
                    self._finish(r, FinishReason.LENGTH)
                    continue
            if err is not None:
                self._finish(r, FinishReason.ERROR, error=err)
                continue
            self._take(r, tok, now)

    def _fail_sampling(self, r: _Req, exc: Exception) -> None:
        log.exception("sampling failed for request %s", r.rid)
        self._finish(r, FinishReason.ERROR, error=f"sampling failed: {exc}")

    def _take(self, r: _Req, tok: int, now: float) -> bool:
        """Record one output token: emit it, or finish the request. True when it finished."""
        r.out.append(tok)
        if math.isnan(r.t_first):
            r.t_first = now
        reason = None
        if tok in r.sampling.stop_token_ids or (tok in self.eos_ids
                                                and not r.sampling.ignore_eos):
            reason = FinishReason.STOP
        elif len(r.out) >= r.sampling.max_new_tokens:
            reason = FinishReason.LENGTH
        if reason is None:
            # The first token carries the meta known so far (cached tokens, queue time).
            meta = self._meta(r, None, now) if len(r.out) == 1 else None
            self._emit(r, RequestOutput(r.rid, [tok], meta=meta))
            return False
        self._finish(r, reason, last_token=tok)
        return True

    def _input_logprobs(self, r: _Req, c: Chunk, rows: torch.Tensor) -> None:
        sampling.input_logprobs(r, c, rows)

    def _sample(self, logits: torch.Tensor, r: _Req) -> int:
        return sampling.sample(logits, r, self._banned, self.eos_ids)

    # -- finishing ------------------------------------------------------------------------
    def _finish(self, r: _Req, reason: FinishReason, *, last_token: int | None = None,
                error: str | None = None) -> None:
        if r.phase is _Phase.DONE:
            return
        was = r.phase
        r.phase = _Phase.DONE
        if r in self._running:
            self._running.remove(r)
        elif r in self._waiting:
            self._waiting.remove(r)
        with self._lock:
            self._by_rid.pop(r.rid, None)
        try:
            if was is not _Phase.WAITING:
                self._release(r, insert=reason in (FinishReason.LENGTH, FinishReason.STOP))
        finally:
            now = time.perf_counter()
            meta = self._meta(r, reason, now)
            m = self.metrics
            m.requests[reason.value] += 1
            if was is not _Phase.WAITING:
                m.prompt_tokens += r.prompt_len
                m.generation_tokens += len(r.out)
                m.cached_tokens["device"] += r.cached_device
                m.cached_tokens["host"] += r.cached_host
                m.cached_tokens["storage"] += r.cached_storage
                if reason in (FinishReason.LENGTH, FinishReason.STOP):
                    m.ttft.observe(r.t_first - r.t_arrival)
                    m.e2e_latency.observe(now - r.t_arrival)
            self._emit(r, RequestOutput(r.rid, [] if last_token is None else [last_token],
                                        True, reason, meta, error))

    def _release(self, r: _Req, insert: bool) -> None:
        if r.load is not None:          # aborted before its first forward: let the copy land
            r.load.wait()
            r.load = None
        keep = insert and not self.config.disable_radix_cache
        valid = r.kv_len if self.spec is None else min(r.kv_len, r.draft_len)
        seq = np.concatenate([r.ids, np.asarray(r.out, dtype=np.int64)])[:valid] if keep \
            else r.ids
        self.cache.release(seq, r.pages, insert=keep, n_prefix_pages=r.n_prefix_pages,
                           namespace=r.namespace, rid=r.rid, priority=r.priority,
                           prefix_hashes=r.hashes, receipt=r.receipt, hint=r.hint)
        r.pages = np.empty(0, dtype=np.int64)
        r.receipt = None

    def _meta(self, r: _Req, reason: FinishReason | None, now: float) -> dict[str, Any]:
        cached = r.cached_device + r.cached_host + r.cached_storage
        return {
            "id": r.rid,
            "finish_reason": None if reason is None else reason.value,
            "prompt_tokens": r.prompt_len,
            "completion_tokens": len(r.out),
            "cached_tokens": cached,
            "cached_tokens_details": {"device": r.cached_device, "host": r.cached_host,
                                      "storage": r.cached_storage},
            "queue_time": _round(r.t_admit - r.t_arrival),
            "ttft": _round(r.t_first - r.t_arrival),
            "e2e_latency": None if reason is None else _round(now - r.t_arrival),
            **request_meta(r),
            **({"pd_transfer": dict(r.pd)} if r.pd is not None else {}),
        }

    def _emit(self, r: _Req, out: RequestOutput) -> None:
        if r.lp_pending is not None and out.new_token_ids:
            out.logprobs = [r.lp_pending]
            r.lp_pending = None
        if r.input_lp is not None and r.kv_len >= r.prompt_len:
            out.input_logprobs, r.input_lp = r.input_lp, None
        if r.cb is None:
            return
        try:
            r.cb(out)
        except Exception:  # noqa: BLE001 - a broken consumer must not stop the scheduler
            log.exception("output callback of %s failed; aborting it", r.rid)
            if not out.finished:
                self._inbox.put(("abort", r.rid))

    def _fail_all(self, msg: str) -> None:
        for r in list(self._running) + list(self._waiting):
            try:
                self._finish(r, FinishReason.ERROR, error=msg)
            except Exception:  # noqa: BLE001
                log.exception("could not release %s", r.rid)


def _round(v: float) -> float | None:
    return None if math.isnan(v) else round(v, 6)

