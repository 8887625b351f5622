"""The decode side of the P/D link: ask for the missing suffix, write each layer as it arrives.

The scheduler admits a request on the decode worker's own cache first (L1 hit, L2/L3 restore,
:meth:`engine.cache.facade.HiCache.admit`); what its page table still lacks — from the first
page past the reused prefix to the last prompt token it would have matched — is asked from the
prefill worker with :meth:`PDClient.fetch`. The returned :class:`RemoteLoad` is a per-layer
handle like the facade's ``LoadHandle``: the scheduler's forward waits on ``wait_layer(l)``
before attending layer ``l``, so decode computes the last prompt token while later layers are
still on the wire.

Failure never leaves a request's pages half-owned: a handle that fails (link down, timeout,
prefill error) is *cancelled* under its lock, and the receiving thread writes into the page
table only while holding that lock and only if the handle is not cancelled — so once
``wait_layer`` or ``wait`` returned, nothing writes into those pages again and the scheduler can
free them.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any

import numpy as np
import torch

from engine.core.namespace import Namespace
from engine.runtime.pd.link import TAG_REPLY, TAG_REQUEST, LinkError, PDLink

log = logging.getLogger("hicache.pd")


class RemoteLoad:
    """The KV for positions ``start .. end-1`` of one request, arriving layer by layer."""

    def __init__(self, rid: str, num_layers: int, slots: torch.Tensor, timeout_s: float,
                 inner: Any = None, meta: dict | None = None):
        self.rid, self.num_layers, self.slots = rid, num_layers, slots
        self.inner = inner                 # the request's L2/L3 load-back (LoadHandle) or None
        self.meta = meta if meta is not None else {}
        self.deadline = time.monotonic() + timeout_s
        self.timeout_s = timeout_s
        self.arrived = 0
        self.error: str | None = None
        self.cancelled = False
        self.cond = threading.Condition()

    # -- the scheduler's side ----------------------------------------------------------------
    def wait_layer(self, layer: int) -> None:
        """Return once ``layer`` is in L1, or the handle failed (then ``error`` is set and the
        forward's result for this request is thrown away). Never raises."""
        if self.inner is not None:
            self.inner.wait_layer(layer)
        with self.cond:
            while self.arrived <= layer and self.error is None:
                left = self.deadline - time.monotonic()
                if left <= 0:
                    self._fail(f"P/D transfer timed out after {self.timeout_s:g}s")
                    break
                self.cond.wait(left)

    def ready(self) -> bool:
        """Whether a forward may include the request now: its first layer is in (the others
        follow at the prefill's pace, each awaited by :meth:`wait_layer`), or the transfer
        failed — a slow or silent prefill worker never holds up the other requests' steps."""
        with self.cond:
            if self.arrived == 0 and self.error is None and time.monotonic() >= self.deadline:
                self._fail(f"P/D transfer timed out after {self.timeout_s:g}s")
            return self.arrived > 0 or self.error is not None

    def wait(self) -> None:
        """The request is going away: let the local load-back land, stop any further write."""
        if self.inner is not None:
            self.inner.wait()
        with self.cond:
            if self.arrived < self.num_layers and self.error is None:
                self._fail("request ended before its KV arrived")

    def done(self) -> bool:
        return (self.inner is None or self.inner.done()) and (
            self.arrived >= self.num_layers or self.error is not None)

    def _fail(self, why: str) -> None:       # holds self.cond
        self.error = self.error or why
        self.cancelled = True
        self.cond.notify_all()

    # -- the receiving thread's side -------------------------------------------------------
    def write_layer(self, layer: int, l1_buf: torch.Tensor, data: torch.Tensor, rows: int,
                    final: bool = True) -> None:
        with self.cond:
            if self.cancelled:
                return
            l1_buf[layer].index_copy_(1, self.slots, data[:, :rows].to(l1_buf.device))
            if final:
                self.arrived = layer + 1
                self.cond.notify_all()

    def complete(self) -> None:
        with self.cond:
            if not self.cancelled:
                self.arrived = self.num_layers
                self.cond.notify_all()

    def fail(self, why: str) -> None:
        with self.cond:
            self._fail(why)


class PDClient:
    """The decode worker's end of the link: a sender and a receiver thread, requests in order.

    ``totals`` (read by ``/metrics``) sums every request's ``pd_transfer`` in tokens and bytes.
    """

    def __init__(self, link: PDLink, l1: Any, page_size: int, timeout_s: float = 30.0,
                 keepalive_s: float | None = None):
        """``keepalive_s``: an idle link sends a ``ping`` this often (default: a quarter of
        the link's timeout), so the prefill side's wait for a request never times out."""
        self.link, self.l1, self.page_size = link, l1, page_size
        self.keepalive_s = keepalive_s if keepalive_s is not None else \
            max(0.05, getattr(link, "timeout_s", 60.0) / 4)
        self.num_layers = l1.layout.num_layers
        self.page_bytes = l1.layout.page_bytes
        self.timeout_s = timeout_s
        self.down: str | None = None
        self.totals: collections.Counter = collections.Counter()
        self._out: collections.deque = collections.deque()      # messages to send
        self._pending: collections.deque = collections.deque()  # handles awaiting a reply
        self._cv = threading.Condition()
        self._stop = False
        self._threads = [threading.Thread(target=self._send_loop, name="pd-send", daemon=True),
                         threading.Thread(target=self._recv_loop, name="pd-recv", daemon=True)]
        for t in self._threads:
            t.start()

    def fetch(self, rid: str, namespace: Namespace | None, tokens: np.ndarray, start: int,
              pages: np.ndarray, inner: Any, meta: dict) -> RemoteLoad | None:
        """Ask for the KV of ``tokens[start:]`` (``start`` page-aligned), to be written into
        the page table ``pages``; returns the per-layer handle (failed at once if the link is
        down), or None when nothing is missing. ``meta`` (the request's ``pd_transfer``, with
        the decode-side tiers filled in) gets ``transferred`` and ``bytes`` on arrival."""
        p = self.page_size
        end = len(tokens)
        meta.setdefault("transferred", 0)
        meta.setdefault("bytes", 0)
        with self._cv:
            self.totals["requests"] += 1
            for k in ("decode_device", "decode_host", "decode_storage"):
                self.totals[k] += int(meta.get(k, 0))
        if start >= end:
            return None
        pos = np.arange(start, end, dtype=np.int64)
        slots = torch.as_tensor(pages[pos // p] * p + pos % p, device=self.l1.buf.device)
        h = RemoteLoad(rid, self.num_layers, slots, self.timeout_s, inner, meta)
        h.start, h.end = start, end
        msg = {"rid": rid, "namespace": None if namespace is None else namespace.to_wire(),
               "start": int(start),
               "tokens": [int(t) for t in tokens]}
        with self._cv:
            if self.down is not None:
                h.fail(f"prefill worker down: {self.down}")
                return h
            self._out.append(msg)
            self._pending.append(h)
            self._cv.notify_all()
        return h

    # -- threads ----------------------------------------------------------------------------
    def _send_loop(self) -> None:
        while True:
            with self._cv:
                idle_until = time.monotonic() + self.keepalive_s
                while not self._out and not self._stop and self.down is None:
                    left = idle_until - time.monotonic()
                    if left <= 0:
                        self._out.append({"op": "ping"})    # keep the idle link alive
                        break
                    self._cv.wait(left)
                if self.down is not None or (self._stop and not self._out):
                    return
                msg = self._out.popleft()
            try:
                self.link.send_msg(msg, TAG_REQUEST)
            except LinkError as exc:
                self._link_down(str(exc))
                return
            if msg.get("op") == "stop":
                return

    def _recv_loop(self) -> None:
        while True:
            with self._cv:
                while not self._pending and not self._stop and self.down is None:
                    self._cv.wait()
                if not self._pending:
                    return
                h = self._pending[0]
            try:
                self._receive(h)
            except LinkError as exc:
                self._link_down(str(exc))
                return
            except Exception as exc:  # noqa: BLE001 - a broken stream: the link is unusable
                log.exception("P/D receive failed")
                self._link_down(f"{type(exc).__name__}: {exc}")
                return
            with self._cv:
                self._pending.popleft()

    def _receive(self, h: RemoteLoad) -> None:
        link, p = self.link, self.page_size
        head = link.recv_msg(TAG_REPLY)
        if head.get("rid") != h.rid:
            raise LinkError(f"P/D reply for {head.get('rid')!r}, expected {h.rid!r}")
        if head.get("error"):
            h.fail(str(head["error"]))
            return
        n_pages, first = int(head["pages"]), int(head["first_token"])
        want = -(-h.end // p) - h.start // p
        lay = self.l1.layout
        data = torch.empty((lay.kv_kinds, n_pages * p, lay.kv_heads, lay.head_dim),
                           dtype=self.l1.buf.dtype)
        ok = n_pages == want and first == h.start
        for layer in range(self.num_layers):
            link.recv_into(data, TAG_REPLY)
            if ok:      # the last layer counts as arrived only with an ok trailer
                h.write_layer(layer, self.l1.buf, data, h.end - h.start,
                              final=layer < self.num_layers - 1)
        tail = link.recv_msg(TAG_REPLY)
        sent = n_pages * self.page_bytes
        # Audit: bytes of pages covering tokens the decode side already had (must be 0).
        redundant = max(0, -(-(h.start - first) // p)) * self.page_bytes
        h.meta.update(transferred=h.end - h.start, bytes=sent, redundant_bytes=redundant,
                      prefill_cached=int(head.get("prefill_cached", 0)))
        if not ok:
            h.fail(f"P/D reply does not match the request ({n_pages} pages from token "
                   f"{first}, asked {want} from {h.start})")
        elif not tail.get("ok"):
            h.fail(str(tail.get("error") or "prefill failed"))
        else:
            h.complete()
        with self._cv:
            t = self.totals
            for k in ("transferred", "bytes", "redundant_bytes"):
                t[k] += int(h.meta.get(k, 0))
            t["failed"] += h.error is not None

    def _link_down(self, why: str) -> None:
        with self._cv:
            (log.info if self._stop else log.error)("P/D link down: %s", why)
            self.down = self.down or why
            pending = list(self._pending)
            self._pending.clear()
            self._out.clear()
            self.totals["failed"] += len(pending)
            self._cv.notify_all()
        for h in pending:
            h.fail(f"prefill worker down: {why}")

    def close(self, timeout: float = 5.0) -> None:
        """Tell the prefill worker to stop (if the link is up) and end both threads."""
        with self._cv:
            if self.down is None:
                self._out.append({"op": "stop"})
            self._stop = True
            self._cv.notify_all()
        for t in self._threads:
            t.join(timeout)
