"""Deadlines on L3 store calls: a backend that stops answering never stalls the server.

An :class:`L3Store` operation (exists, get, put, health, close) runs on a helper thread of a
:class:`CallGuard` while its caller waits at most a deadline. A call that does not return in
time is *abandoned*: the caller gets the operation's failure answer (a miss, a failed put), the
store is marked **degraded** with the reason, and — until the abandoned call returns — every
later call is answered the same way at once, so nothing piles up behind a stuck call and the
memory the stuck call may still write is never handed to another one. When the abandoned call
returns, the store is healthy again (counted as ``recovered``).

Helper threads are daemons: a call stuck forever (a hung network filesystem, a stopped
Mooncake master) never keeps the process from exiting. Two lanes — ``data`` (get, put, close)
and ``query`` (exists, health) — so a long put does not delay the scheduler's existence queries.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any, Callable

from engine.storage.backend import Counters

log = logging.getLogger("hicache.storage")

_MISSING = object()


class _Call:
    __slots__ = ("fn", "args", "result", "exc", "done", "what")

    def __init__(self, what: str, fn: Callable[..., Any], args: tuple):
        self.what, self.fn, self.args = what, fn, args
        self.result: Any = _MISSING
        self.exc: BaseException | None = None
        self.done = threading.Event()


class _Lane:
    """One daemon thread running calls in order."""

    def __init__(self, name: str):
        self.name = name
        self.q: "queue.SimpleQueue[_Call | None]" = queue.SimpleQueue()
        self.thread: threading.Thread | None = None

    def submit(self, call: _Call) -> None:
        if self.thread is None:
            self.thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            self.thread.start()
        self.q.put(call)

    def _run(self) -> None:
        while True:
            call = self.q.get()
            if call is None:
                return
            try:
                call.result = call.fn(*call.args)
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller
                call.exc = exc
            call.done.set()

    def stop(self) -> None:
        if self.thread is not None:
            self.q.put(None)


class CallGuard:
    """Runs calls with a deadline; ``deadline_s <= 0`` runs them inline (no guard)."""

    def __init__(self, name: str, deadline_s: float):
        self.name = name
        self.deadline_s = float(deadline_s)
        self._lock = threading.Lock()
        self._lanes = {lane: _Lane(f"{name}-{lane}") for lane in ("data", "query")}
        self._stuck: list[_Call] = []     # abandoned calls that have not returned yet
        self.reason: str | None = None
        self.since: float | None = None
        self.counters = Counters("abandoned", "refused", "recovered")

    @property
    def enabled(self) -> bool:
        return self.deadline_s > 0

    @property
    def degraded(self) -> bool:
        """True while an abandoned call has not returned (also clears the state once it has)."""
        with self._lock:
            return self._check_stuck()

    def _check_stuck(self) -> bool:
        if not self._stuck:
            return False
        back = [c for c in self._stuck if c.done.is_set()]
        if back:
            self._stuck = [c for c in self._stuck if not c.done.is_set()]
            self.counters.add("recovered", len(back))
        if self._stuck:
            return True
        log.warning("%s: the abandoned %s returned after %.1fs; the store is healthy again",
                    self.name, back[-1].what, time.monotonic() - (self.since or 0.0))
        self.reason = self.since = None
        return False

    def run(self, what: str, fn: Callable[..., Any], *args: Any, default: Any,
            lane: str = "data", deadline_s: float | None = None) -> Any:
        """``fn(*args)`` within the deadline, else ``default`` (and the store is degraded).
        Exceptions of ``fn`` propagate."""
        if not self.enabled:
            return fn(*args)
        limit = self.deadline_s if deadline_s is None else deadline_s
        call = _Call(what, fn, args)
        with self._lock:
            if self._check_stuck():
                self.counters.add("refused")
                return default
            self._lanes[lane].submit(call)
        if not call.done.wait(limit):
            with self._lock:
                if not call.done.is_set():
                    self._stuck.append(call)
                    if self.since is None:
                        self.since = time.monotonic()
                        self.reason = f"{what} did not return within {limit:.3g}s"
                    self.counters.add("abandoned")
                    log.warning("%s degraded: %s; L3 calls fail fast until it returns",
                                self.name, self.reason)
                    return default
        if call.exc is not None:
            raise call.exc
        return call.result

    def state(self) -> dict[str, Any]:
        with self._lock:
            degraded = self._check_stuck()
            out: dict[str, Any] = {"degraded": degraded, **self.counters.as_dict()}
            if degraded:
                out["degraded_reason"] = self.reason
                out["degraded_for_s"] = round(time.monotonic() - (self.since or 0.0), 3)
        return out

    def close(self) -> None:
        with self._lock:
            for lane in self._lanes.values():
                lane.stop()
