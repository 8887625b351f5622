"""The server's session registry: which client sessions are open, per cache namespace.

Bounded: at most ``max_sessions`` entries, whatever clients send. A session is *opened*
(SGLang ``/open_session``, Dynamo ``nvext.session_control`` action ``open``) or *seen* (a
request naming ``session_id`` / ``prompt_cache_key`` / a Dynamo session without an action).
Seen sessions are soft: when the registry is full the least recently used one is forgotten
(its KV keeps whatever hints it has; only its close would then be refused as unknown). Opened
sessions are kept until closed or idle past their timeout; when every entry is an opened,
live session, opening another is refused (400) with the reason. Used on the event loop only.
"""

from __future__ import annotations

import collections
import dataclasses
import time
import uuid
from typing import Any, Callable

from engine.core.errors import InputError
from engine.core.namespace import Namespace

DEFAULT_MAX_SESSIONS = 4096
REAP_EVERY_S = 1.0


@dataclasses.dataclass
class _Entry:
    opened: bool
    timeout_s: float | None         # idle seconds until it expires (None: until closed)
    last: float
    capacity: int = 0               # SGLang's capacity_of_str_len (recorded, not enforced)


def ns_key(ns: Namespace | None) -> tuple:
    return () if ns is None else tuple(ns.items())


class SessionRegistry:
    def __init__(self, max_sessions: int = DEFAULT_MAX_SESSIONS,
                 clock: Callable[[], float] = time.monotonic):
        if max_sessions < 1:
            raise ValueError("max_sessions must be >= 1")
        self.max_sessions = max_sessions
        self._clock = clock
        self._d: collections.OrderedDict[tuple, _Entry] = collections.OrderedDict()
        self._seen: collections.OrderedDict[tuple, None] = collections.OrderedDict()
        self._last_reap = -REAP_EVERY_S
        self.counters = {"opened": 0, "closed": 0, "seen": 0, "expired": 0, "forgotten": 0,
                         "refused": 0}

    def __len__(self) -> int:
        return len(self._d)

    def __contains__(self, key: tuple) -> bool:
        return key in self._d and not self._expired(self._d[key], self._clock())

    @staticmethod
    def key(ns: Namespace | None, session: str) -> tuple:
        return (ns_key(ns), session)

    def _expired(self, e: _Entry, now: float) -> bool:
        return e.timeout_s is not None and now - e.last > e.timeout_s

    def _reap(self, now: float) -> None:
        """Drop expired entries: a walk over the registry, at most once per REAP_EVERY_S."""
        if now - self._last_reap < REAP_EVERY_S:
            return
        self._last_reap = now
        for k in [k for k, e in self._d.items() if self._expired(e, now)]:
            del self._d[k]
            self._seen.pop(k, None)
            self.counters["expired"] += 1

    def _room(self, now: float) -> None:
        if len(self._d) < self.max_sessions:
            return
        self._reap(now)
        if len(self._d) < self.max_sessions:
            return
        if self._seen:                             # the least recently used seen session
            k, _ = self._seen.popitem(last=False)
            del self._d[k]
            self.counters["forgotten"] += 1
            return
        self.counters["refused"] += 1
        raise InputError(f"too many open sessions: this server keeps at most "
                         f"{self.max_sessions} (--max-sessions); close one with "
                         "/close_session first")

    def open(self, ns: Namespace | None, session: str | None, *, timeout_s: float | None = None,
             capacity: int = 0, exist_ok: bool = False) -> str:
        """Open a session (a new id when ``session`` is None); refused when it is open
        already (unless ``exist_ok``: then it is refreshed) or the registry is full."""
        now = self._clock()
        session = session or uuid.uuid4().hex
        k = self.key(ns, session)
        e = self._d.get(k)
        if e is not None and not self._expired(e, now):
            if e.opened and not exist_ok:
                raise InputError(f"session {session!r} is already open")
            e.opened, e.last = True, now
            e.timeout_s = timeout_s if timeout_s is not None else e.timeout_s
            self._d.move_to_end(k)
            self._seen.pop(k, None)
            return session
        self._d.pop(k, None)
        self._seen.pop(k, None)
        self._room(now)
        self._d[k] = _Entry(True, timeout_s, now, capacity)
        self.counters["opened"] += 1
        return session

    def use(self, ns: Namespace | None, session: str, *, must_exist: bool = False) -> None:
        """A request names ``session``: refresh it (register it when new, unless it had to
        be opened first)."""
        now = self._clock()
        k = self.key(ns, session)
        e = self._d.get(k)
        if e is not None and self._expired(e, now):
            del self._d[k]
            self._seen.pop(k, None)
            self.counters["expired"] += 1
            e = None
        if e is None:
            if must_exist:
                raise InputError(f"session id {session!r} does not exist (open it with "
                                 "/open_session first)")
            self._room(now)
            self._d[k] = _Entry(False, None, now)
            self._seen[k] = None
            self.counters["seen"] += 1
            return
        e.last = now
        self._d.move_to_end(k)
        if not e.opened:
            self._seen.move_to_end(k)

    def close(self, ns: Namespace | None, session: str) -> None:
        """Forget an open (or seen) session; unknown ones are refused."""
        k = self.key(ns, session)
        e = self._d.pop(k, None)
        self._seen.pop(k, None)
        if e is None or self._expired(e, self._clock()):
            if e is not None:
                self.counters["expired"] += 1
            raise InputError(f"session {session!r} is not open" +
                             ("" if not k[0] else " in this namespace"))
        self.counters["closed"] += 1

    def stats(self) -> dict[str, Any]:
        opened = sum(1 for e in self._d.values() if e.opened)
        return {"sessions": len(self._d), "opened_sessions": opened,
                "max_sessions": self.max_sessions,
                **{f"{k}_total": v for k, v in self.counters.items()}}
