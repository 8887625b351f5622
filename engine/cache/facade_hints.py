"""The facade's client-hint methods (engine.cache.hints), as a base of
:class:`~engine.cache.facade.HiCache`: the hint clock, a request's hint, a session's close, the
counters, and the marks a split or a lost trust changes. The rules themselves are
engine/cache/hints.py's; these methods tie them to the facade's tree, tiers and events."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from engine.cache.events import EV
from engine.cache.hints import CacheHint, HintBook, apply_hint, close_session
from engine.core.namespace import Namespace, as_namespace

if TYPE_CHECKING:
    from engine.cache.radix_tree import Node


class HintMethods:
    """Needs of the host class: ``config.hint_kwargs``, ``tree``, ``events``, ``hints``,
    ``_t1``/``_t2`` and ``_push_candidate``."""

    hints: HintBook | None
    config: Any
    tree: Any
    events: Any
    _t1: Any
    _t2: Any
    l3: Any

    def _push_candidate(self, node: "Node") -> None:  # the host's
        raise NotImplementedError

    def _hint_book(self) -> HintBook:
        if self.hints is None:
            self.hints = HintBook(**self.config.hint_kwargs)
            self.hints.on_distrust = self._distrust
        return self.hints

    def set_clock(self, t: float) -> None:
        """The hint clock, in seconds (every rank of a group gets the same value at the same
        step): judges declarations whose time passed and expires stale hints."""
        book = self._hint_book()
        book.set_clock(t, self.tree.clock)
        book.judge_due()
        book.expire_due(self._push_candidate)

    def hint(self, last: Node | None, namespace: Namespace | str | None,
             hint: CacheHint | None, rid: Any = None) -> int:
        """Apply a request's hint to the path ending at ``last`` (engine.cache.hints); one
        ``hint`` event when a hint was given. Returns the nodes hinted."""
        n, on = apply_hint(self._hint_book(), last, as_namespace(namespace), hint,
                           self._push_candidate, self._demote_closed)
        if hint is not None:
            self.events.emit(EV.HINT, rid=rid, session=None if hint.session is None
                             else str(hint.session), ttl=hint.ttl_s, close=hint.close,
                             applied=on, nodes=n)
        return n

    def close_session(self, namespace: Namespace | str | None, session: str | int) -> int:
        """A client closed ``session``: its private KV goes first. Returns the nodes marked."""
        n = close_session(self._hint_book(), as_namespace(namespace), session,
                          self._push_candidate, self._demote_closed)
        self.events.emit(EV.SESSION_CLOSE, session=str(session), nodes=n)
        return n

    def _demote_closed(self, nodes: list) -> None:
        """A closed session's private KV is the L3 store's first to evict as well (its L1
        and L2 copies are the tiers' first already); the pages asked are counted."""
        if self.l3 is not None and nodes:
            self._hint_book().counters["l3_pages_demoted"] += self.l3.demote(nodes)

    def hint_stats(self) -> dict[str, Any]:
        return self._hint_book().stats()

    def _hinted_split(self, lower: Node) -> None:
        """A walk split a hinted edge: its new upper half holds the same declaration."""
        assert self.hints is not None and lower.parent is not None
        assert lower.hint_until is not None
        self.hints.mark([lower.parent], lower.hint_until, lower.hint_expiry)

    def _distrust(self, namespace: Any, kind: str) -> None:
        """A namespace's hints of ``kind`` (``close``/``ttl``) stopped being trusted: the nodes
        they marked are ordinary again."""
        closed = kind == "close"
        for tier in (self._t1, self._t2):
            if tier is None:
                continue
            for _, _, node in tier.hheap:
                if node.namespace == namespace and node.hint_until is not None \
                        and (node.hint_until == float("inf")) == closed:
                    node.hint_until, node.hint_expiry = None, float("inf")
                    self._push_candidate(node)

