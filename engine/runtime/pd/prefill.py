"""The prefill worker: computes the suffix a decode worker asks for and streams its pages.

One request at a time (a request message names the tokens, the namespace and the first token
the decode side is missing; the decode side's prefix is page-aligned):

1. admit the tokens on this worker's own cache — its own L1 hit, L2/L3 restore, and the start
   of a cached page after them (partial last-page reuse, ``HiCache.admit``) — so the prefill
   side reuses what it has too;
2. compute what this worker is missing, in ``chunk``-token pieces; during the last piece, each
   layer's hook sends that layer's pages as soon as the layer's KV is written (per-layer
   streaming: the decode side can attend layer 0 while this side computes layer 1);
3. send exactly the pages from the decode side's first missing page to the end — never one of
   the pages the decode side already has — then a trailer saying whether all went well;
4. insert the sequence into this worker's tree (the next turn hits it) and release.

Reply on the link: header ``{"rid", "first_token", "pages", "prefill_cached"}``, one tensor per
layer ``[kv_kinds, pages * page_size, kv_heads, head_dim]``, trailer ``{"rid", "ok", "error"}``.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import numpy as np

from engine.core.namespace import from_wire
from engine.runtime.config import parse_fault
from engine.runtime.model import Chunk
from engine.runtime.pd.link import TAG_REPLY, TAG_REQUEST, LinkError, PDLink

log = logging.getLogger("hicache.pd")


class PrefillWorker:
    def __init__(self, model: Any, cache: Any, link: PDLink, chunk: int = 512,
                 fault: str | None = None, partial: bool = True):
        """``partial``: partial last-page reuse at admission (its KV is sent like the rest:
        the page holding it is one of the pages sent)."""
        self.model, self.cache, self.link = model, cache, link
        self.partial = partial
        self.page_size = cache.page_size
        self.num_layers = cache.num_layers
        self.chunk = chunk
        self.fault = parse_fault(fault)
        self.layers_sent = 0
        self.requests = 0

    def serve_forever(self) -> bool:
        """Answer requests until the decode side says ``stop`` (True) or the link fails
        (False). ``ping`` requests (an idle decode side's keepalive) need no answer."""
        while True:
            try:
                msg = self.link.recv_msg(TAG_REQUEST)
            except LinkError as exc:
                log.warning("prefill worker: link closed (%s)", exc)
                return False
            if msg.get("op") == "stop":
                return True
            if msg.get("op") == "ping":
                continue
            self.handle(msg)
            self.cache.poll()

    def handle(self, msg: dict) -> None:
        rid, ns, start = str(msg["rid"]), from_wire(msg.get("namespace")), int(msg["start"])
        toks = np.asarray(msg["tokens"], dtype=np.int64)
        end, p = len(toks), self.page_size
        assert start % p == 0 and 0 <= start < end, (start, end)
        self.requests += 1
        cache = self.cache
        a = cache.admit(toks, ns, rid=rid, partial=self.partial)
        if a is None:
            self._refuse(rid, "the prefill worker has no room for the request")
            return
        send_pages = a.pages[start // p: -(-end // p)]
        h = a.n_prefix_pages * p + a.partial_len       # KV valid up to here
        self.link.send_msg({"rid": rid, "first_token": start, "pages": int(len(send_pages)),
                            "prefill_cached": h}, TAG_REPLY)
        works: list = []
        error = None
        try:
            self._compute_and_send(toks, a, h, send_pages, works)
        except LinkError:
            raise
        except Exception as exc:  # noqa: BLE001 - reported to the decode side, then released
            log.exception("prefill of %s failed", rid)
            error = f"prefill failed: {exc}"
            while len(works) < self.num_layers:   # keep the stream aligned: filler layers
                works.append(self._send_layer(len(works), send_pages))
        finally:
            for w, _ in works:
                w.wait()
            self._release(toks, a, insert=error is None)
        self.link.send_msg({"rid": rid, "ok": error is None, "error": error}, TAG_REPLY)

    def _compute_and_send(self, toks: np.ndarray, a: Any, h: int, send_pages: np.ndarray,
                          works: list) -> None:
        end = len(toks)
        load_hooks = [a.load.wait_layer] if a.load is not None else []
        if self.fault.get("delay") and self.requests == 1:
            time.sleep(self.fault["delay"])

        def send(layer: int) -> None:
            works.append(self._send_layer(layer, send_pages))

        if h >= end:                      # all cached here: only the copy to send
            if a.load is not None:
                a.load.wait()
            for layer in range(self.num_layers):
                send(layer)
            return
        for s in range(h, end, self.chunk):
            e = min(s + self.chunk, end)
            hooks = load_hooks + ([send] if e == end else [])
            self.model.forward([Chunk(toks[s:e], s, a.pages, logits=False)],
                               self.cache.l1.buf, self.page_size, hooks)

    def _send_layer(self, layer: int, pages: np.ndarray) -> tuple:
        data = self.cache.l1.get_layer(layer, pages).contiguous()   # a copy: safe to reuse
        if data.device.type != "cpu":      # gloo moves host tensors: stage through host memory
            data = data.cpu()
        work = self.link.send_async(data, TAG_REPLY)
        self.layers_sent += 1
        die = self.fault.get("die-after-layers")
        if die is not None and self.layers_sent >= die:
            work.wait()
            log.warning("prefill worker: injected fault, exiting after %d layers", die)
            os._exit(17)
        return work, data

    def _refuse(self, rid: str, why: str) -> None:
        self.link.send_msg({"rid": rid, "first_token": 0, "pages": 0, "prefill_cached": 0,
                            "error": why}, TAG_REPLY)

    def _release(self, toks: np.ndarray, a: Any, insert: bool) -> None:
        if a.load is not None:
            a.load.wait()
        self.cache.release(toks, a.pages, insert=insert, n_prefix_pages=a.n_prefix_pages,
                           namespace=a.namespace, rid=a.rid, prefix_hashes=a.hashes,
                           receipt=a.receipt)
