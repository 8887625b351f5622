"""One request's state inside the scheduler: its phase, page table, KV progress, outputs and
the figures reported with it (cache tiers, speculative decoding, P/D)."""

from __future__ import annotations

import dataclasses
import enum
import math
import time
from typing import Any

import numpy as np
import torch

from engine.cache.hints import CacheHint
from engine.cache.types import LayerLoad
from engine.core.namespace import Namespace, from_wire
from engine.runtime.scheduler.params import Callback, SamplingParams


class _Phase(enum.Enum):
    WAITING = 0
    PREFILL = 1
    DECODE = 2
    DONE = 3


class _Req:
    __slots__ = ("rid", "ids", "sampling", "namespace", "priority", "cb", "t_arrival",
                 "t_admit", "t_first", "phase", "receipt", "load", "pages", "n_prefix_pages",
                 "kv_len", "out", "cached_device", "cached_host", "cached_storage", "gen",
                 "aborted", "hashes", "lp_pending", "input_lp", "draft_len", "spec_proposed",
                 "spec_accepted", "spec_steps", "spec_dropped", "pd", "hint")

    def __init__(self, rid: str, ids: np.ndarray, sampling: SamplingParams,
                 namespace: Namespace | None, priority: int, cb: Callback | None,
                 hint: CacheHint | None = None):
        self.rid, self.ids, self.sampling = rid, ids, sampling
        self.hint = hint                            # the client's cache hint (soft)
        self.namespace, self.priority, self.cb = namespace, priority, cb
        self.t_arrival = time.perf_counter()
        self.t_admit = math.nan
        self.t_first = math.nan
        self.phase = _Phase.WAITING
        self.receipt: Any = None                    # the prefix's lock (HiCache.admit)
        self.load: LayerLoad | None = None          # its load-back / P/D transfer (per layer)
        self.pages = np.empty(0, dtype=np.int64)   # page table: prefix pages, then own pages
        self.n_prefix_pages = 0                     # leading pages owned by the tree
        self.kv_len = 0                             # positions whose KV is in L1
        self.out: list[int] = []
        self.cached_device = self.cached_host = self.cached_storage = 0
        self.gen: torch.Generator | None = None
        self.aborted = False
        self.hashes: list = []                      # L3 page hashes of the matched prefix
        self.lp_pending: tuple | None = None        # logprob of the token about to be emitted
        self.input_lp: list | None = None           # prompt logprobs, sent with the first output
        self.draft_len = 0                          # speculative: positions with draft KV
        self.spec_proposed = self.spec_accepted = self.spec_steps = 0
        self.spec_dropped = False
        self.pd: dict | None = None                 # P/D: where the prompt's KV came from

    # -- the one wire format of a request between ranks (the lockstep intake) ---------------
    def to_wire(self) -> list:
        """Plain values only (msgpack-able): what another rank needs to rebuild this request
        as it arrived — id, prompt, sampling, namespace, priority, whether it was aborted
        before the step that carries it, and its cache hint (None or ``CacheHint.to_wire``)."""
        sampling = {k: list(v) if isinstance(v, tuple) else v
                    for k, v in dataclasses.asdict(self.sampling).items()}
        ns = None if self.namespace is None else self.namespace.to_wire()
        return [self.rid, np.ascontiguousarray(self.ids, dtype="<i8").tobytes(), sampling, ns,
                int(self.priority), bool(self.aborted),
                None if self.hint is None else self.hint.to_wire()]

    @classmethod
    def from_wire(cls, w: Any) -> "_Req":
        """The request :meth:`to_wire` described (no callback: it lives on rank 0);
        ``ValueError`` for anything else."""
        if not (isinstance(w, (list, tuple)) and len(w) == 7 and isinstance(w[0], str)
                and isinstance(w[1], bytes) and len(w[1]) % 8 == 0 and isinstance(w[2], dict)
                and isinstance(w[4], int) and isinstance(w[5], bool)):
            raise ValueError("malformed request on the rank link")
        rid, ids, sampling, ns, priority, aborted, hint = w
        known = {f.name for f in dataclasses.fields(SamplingParams)}
        if not set(sampling) <= known:
            raise ValueError(f"unknown sampling fields on the rank link: {set(sampling) - known}")
        sampling = {k: tuple(v) if isinstance(v, list) else v for k, v in sampling.items()}
        r = cls(rid, np.frombuffer(ids, dtype="<i8").astype(np.int64), SamplingParams(**sampling),
                from_wire(ns), priority, None, CacheHint.from_wire(hint))
        r.aborted = aborted
        return r

    @property
    def prompt_len(self) -> int:
        return len(self.ids)

    def kv_needed(self) -> int:
        """Positions that will ever hold KV: the prompt and every output token but the last."""
        return self.prompt_len + max(self.sampling.max_new_tokens - 1, 0)


def _match_len(r: _Req) -> int:
    """Prompt tokens the prefix match may cover: all but the last (it yields the first
    output's logits), and none past the first position whose logprob was asked for."""
    n = r.prompt_len - 1
    if r.sampling.input_logprobs_from is not None:
        n = min(n, max(r.sampling.input_logprobs_from - 1, 0))
    return n
