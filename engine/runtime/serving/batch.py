"""The sub-requests of one HTTP request: every prompt × ``n`` choices submitted to the
scheduler, their outputs applied as they arrive (text, stop strings, logprobs).

A stop string is matched on the decoded text; the request is then ended with
:meth:`~engine.runtime.scheduler.Scheduler.finish_early` (its sequence still goes into the
tree), the text is cut before the stop string and later outputs are ignored.
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from typing import Any, AsyncIterator

from aiohttp import web

from engine.runtime.scheduler import RequestOutput
from engine.runtime.serving.common import error_response
from engine.runtime.serving.protocol import ParsedRequest
from engine.runtime.serving.runtime import Engine
from engine.runtime.serving.session_routes import end_sessions, use_sessions

POLL_S = 0.25          # how often a waiting handler checks that its client is still there


class ClientGone(Exception):
    """The client closed the connection; the request is aborted."""


def _gone(request: web.Request) -> bool:
    t = request.transport
    return t is None or t.is_closing()


@dataclasses.dataclass
class Sub:
    """One choice: one prompt, one sampled continuation."""

    index: int
    prompt_index: int
    rid: str
    prompt_ids: list[int]
    stream: Any                        # tokenizer StreamDecoder or None
    stop: tuple[str, ...] = ()
    ids: list[int] = dataclasses.field(default_factory=list)
    text: str = ""
    delta: str = ""                    # text added by the last update
    new_ids: list[int] = dataclasses.field(default_factory=list)   # ids of the last update
    meta: dict | None = None
    reason: str | None = None
    error: str | None = None
    matched_stop: int | str | None = None
    logprobs: list[tuple[float, list[tuple[int, float]]]] = dataclasses.field(
        default_factory=list)
    new_logprobs: list[tuple[float, list[tuple[int, float]]]] = dataclasses.field(
        default_factory=list)
    input_logprobs: list | None = None
    stopped_early: bool = False
    raw: str = ""                      # all decoded text; ``text`` is what may be shown

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def finished(self) -> bool:
        return self.reason is not None

    def apply(self, out: RequestOutput) -> None:
        if self.stopped_early:            # a stop string ended it; the rest is not output
            self.delta, self.new_ids, self.new_logprobs = "", [], []
            return
        self.new_ids = list(out.new_token_ids)
        self.new_logprobs = list(out.logprobs or [])
        if out.input_logprobs is not None:
            self.input_logprobs = out.input_logprobs
        d = []
        if self.stream is not None:
            d = [self.stream.push(t) for t in out.new_token_ids]
            if out.finished:
                d.append(self.stream.flush())
        old = len(self.raw)
        self.raw += "".join(d)
        if out.meta is not None:
            self.meta = out.meta
        self.ids.extend(self.new_ids)
        self.logprobs.extend(self.new_logprobs)
        end = len(self.raw)
        if self.stop:
            end = self._match_stop(old, out.finished)
        self.delta = self.raw[len(self.text):end]
        self.text = self.raw[:end]
        if out.finished and not self.stopped_early:
            self.reason = out.finish_reason.value if out.finish_reason else "error"
            self.error = out.error
            if self.reason == "stop" and self.ids:
                self.matched_stop = self.ids[-1]

    def _match_stop(self, old: int, finished: bool) -> int:
        """How much of ``raw`` may be shown: up to a stop string (then the request ends),
        else all but a tail that could still grow into one (shown once it cannot)."""
        longest = max(len(x) for x in self.stop)
        lo = max(0, old - longest + 1)     # a match may start in text decoded earlier
        best = -1
        for x in self.stop:
            at = self.raw.find(x, lo)
            if at >= 0 and (best < 0 or at < best):
                best, self.matched_stop = at, x
        if best >= 0:
            self.stopped_early = True
            self.reason = "stop"
            return best
        self.matched_stop = None
        if finished:
            return len(self.raw)
        for k in range(min(longest - 1, len(self.raw)), 0, -1):
            tail = self.raw[-k:]
            if any(x.startswith(tail) for x in self.stop):
                return len(self.raw) - k
        return len(self.raw)


class Batch:
    """The sub-requests of one HTTP request and the queue their outputs arrive on."""

    def __init__(self, engine: Engine, parsed: ParsedRequest):
        self.engine = engine
        self.parsed = parsed
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[tuple[int, RequestOutput]] = asyncio.Queue()
        tok = engine.tokenizer
        sched = engine.scheduler
        for ids in parsed.prompts:            # validate all before submitting any
            sched.validate(ids, parsed.sampling)
        use_sessions(engine, parsed.namespace, parsed.session)
        self.subs: list[Sub] = []
        single = len(parsed.prompts) == 1 and parsed.n == 1
        try:
            for p, ids in enumerate(parsed.prompts):
                for j in range(parsed.n):
                    sp = parsed.sampling
                    if j and sp.seed is not None:     # n choices from one seed: distinct draws
                        sp = dataclasses.replace(sp, seed=(sp.seed + j) % (1 << 63))
                    rid = parsed.rid if parsed.rid and single else uuid.uuid4().hex
                    i = len(self.subs)
                    sched.submit(ids, sp, self._callback(i), rid=rid,
                                 namespace=parsed.namespace, priority=parsed.priority,
                                 hint=parsed.hint)
                    self.subs.append(Sub(i, p, rid, [int(t) for t in ids],
                                         tok.stream() if tok else None, parsed.stop))
        except BaseException:
            self.abort()
            raise
        end_sessions(engine, parsed.namespace, parsed.session)

    def _callback(self, index: int):
        def cb(out: RequestOutput) -> None:
            try:
                self.loop.call_soon_threadsafe(self.queue.put_nowait, (index, out))
            except RuntimeError:      # the event loop is closed: the server is shutting down
                pass
        return cb

    def abort(self) -> None:
        for s in self.subs:
            if not s.finished:
                self.engine.scheduler.abort(s.rid)

    @property
    def done(self) -> bool:
        return all(s.finished for s in self.subs)

    async def updates(self, request: web.Request) -> AsyncIterator[Sub]:
        """Yield the sub-request each output updated, until all finished."""
        while not self.done:
            try:
                i, out = await asyncio.wait_for(self.queue.get(), POLL_S)
            except asyncio.TimeoutError:
                i, out = -1, None
            if _gone(request):
                raise ClientGone()
            if out is None:
                continue
            sub = self.subs[i]
            if sub.finished:
                continue
            sub.apply(out)
            if sub.stopped_early:
                self.engine.scheduler.finish_early(sub.rid)
            yield sub

    async def finish(self, request: web.Request) -> web.Response | None:
        """Run to completion (non-streaming); the error response if a request failed."""
        async for _ in self.updates(request):
            pass
        return self.failure()

    def failure(self) -> web.Response | None:
        for s in self.subs:
            if s.reason == "error":       # a lost rank or worker: 503, the server cannot serve
                return error_response(503 if self.unavailable(s.error) else 500,
                                      s.error or "internal error", "server_error")
            if s.reason == "abort":
                return error_response(503, "the request was aborted (server shutting down)",
                                      "overloaded")
        return None

    def unavailable(self, error: str | None) -> bool:
        """Whether a request failed because the server lost part of itself (a rank, a stage,
        the prefill worker), not because of the request."""
        eng = self.engine
        if error is not None and error == eng.scheduler.last_error:
            return True
        return eng.pd_health() is not None or \
            eng.group_health() is not None

    def firsts(self) -> list[Sub]:
        """One sub per prompt (prompt tokens and cache hits are counted once per prompt)."""
        seen, out = set(), []
        for s in self.subs:
            if s.prompt_index not in seen:
                seen.add(s.prompt_index)
                out.append(s)
        return out
