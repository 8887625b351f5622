"""Speculative decoding in the scheduler (docs/speculative.md).

Per scheduling step, every greedy request in decode runs one *round*:

1. **propose** — the draft model first catches up on the tokens it has not seen (its KV ends at
   ``draft_len``; a prefix restored from the cache brings the draft's KV with it), then proposes
   ``k`` tokens one at a time, all requests batched;
2. **verify** — the target runs ``[last, d1 … dk]`` in one pass (``k + 1`` logit rows);
3. **accept** — the target's own choice at each position is taken in order while it equals the
   proposal; the first disagreement (or the row after ``dk``) contributes the target's token and
   ends the round. Every emitted token is exactly what non-speculative greedy decoding emits.

KV bookkeeping: the verify pass writes target KV for positions ``kv_len … kv_len + k``; the KV
of accepted tokens is valid, the rest is overwritten later. The draft's KV is valid up to
``draft_len``; pages are inserted into the tree only where both are valid, so a cached prefix
always carries a usable draft state.

The draft's KV sits in the cache stack with the target's: ``packed`` (more layers of the same
pools: the draft reads ``l1.buf[L:]``) or ``sidecar`` (its own pools addressed by the same page
ids: :class:`engine.cache.sidecar.PairedPool`). Either way a load-back op numbers the draft's
layers ``L …``, so the draft waits on ``L + layer``.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import numpy as np
import torch

from engine.runtime.config_fields import DraftLayout  # noqa: F401 - re-exported
from engine.runtime.model import Chunk, Model


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    num_draft_tokens: int = 4
    draft_preset: str = "mirror"
    draft_layout: str = "packed"
    debug_skip_draft_restore: bool = False   # plant the bug: restored prefixes lose draft KV

    def __post_init__(self) -> None:
        if not 1 <= self.num_draft_tokens <= 16:
            raise ValueError(f"speculative draft tokens must be 1..16, got {self.num_draft_tokens}")
        DraftLayout.parse(self.draft_layout)


class SpecDecoder:
    """The draft model and the propose/verify/accept round of one scheduler."""

    def __init__(self, sched: Any, draft: Model, cfg: SpecConfig):
        self.s = sched
        self.draft = draft
        self.cfg = cfg
        self.k = cfg.num_draft_tokens
        self.split = sched.model.cfg.num_layers          # the draft's first layer in the pools
        l1 = sched.cache.l1
        sidecar = DraftLayout.parse(cfg.draft_layout) is DraftLayout.SIDECAR
        self.kv = l1.sidecar.buf if sidecar else l1.buf[self.split:]
        if self.kv.shape[0] != draft.cfg.num_layers:
            raise ValueError(f"the cache holds {self.kv.shape[0]} draft layers, the draft has "
                             f"{draft.cfg.num_layers}")
        self.m = sched.metrics

    def eligible(self, r: Any) -> bool:
        return r.sampling.greedy

    def _hooks(self, reqs: list) -> list:
        return [lambda li, h=r.load: h.wait_layer(self.split + li)
                for r in reqs if r.load is not None]

    # -- keeping the draft's KV in step with the target's -----------------------------------
    def mirror(self, chunks: list[Chunk], reqs: list) -> None:
        """Run the draft over chunks the target just ran (prefill, plain decode): fills its KV."""
        if self.cfg.debug_skip_draft_restore:
            self._drop_restored_draft_kv(reqs)
        quiet = [Chunk(c.tokens, c.start, c.pages, logits=False) for c in chunks]
        t0 = time.perf_counter()
        self.draft.forward(quiet, self.kv, self.s.page_size, self._hooks(reqs))
        self.m.spec_draft_seconds += time.perf_counter() - t0
        for c, r in zip(chunks, reqs):
            if r.draft_len == c.start:
                r.draft_len = c.start + len(c)

    def _drop_restored_draft_kv(self, reqs: list) -> None:
        """Debug: zero the draft KV of pages restored from L2/L3 (the failure seen in engines
        that restore only the target's KV). Acceptance after a restore then collapses."""
        p = self.s.page_size
        for r in reqs:
            restored = (r.cached_host + r.cached_storage) // p
            if restored and not r.spec_dropped:
                if r.load is not None:
                    r.load.wait()
                first = r.cached_device // p
                slots = torch.as_tensor(self.s.cache.l1.slots(r.pages[first:first + restored]),
                                        device=self.kv.device)
                self.kv[:, :, slots] = 0
                r.spec_dropped = True

    # -- one round -------------------------------------------------------------------------
    def round(self, reqs: list) -> None:
        s, p, k = self.s, self.s.page_size, self.k
        max_ctx = s.model.cfg.max_context
        ks = [max(0, min(k, r.sampling.max_new_tokens - len(r.out) - 1,
                         len(r.pages) * p - r.kv_len - 1, max_ctx - r.kv_len - 1))
              for r in reqs]
        props: list[list[int]] = [[] for _ in reqs]
        t0 = time.perf_counter()
        # propose: catch up, then one token per pass
        chunks = []
        for r, kr in zip(reqs, ks):
            seq = np.concatenate([r.ids, np.asarray(r.out, dtype=np.int64)])
            chunks.append(Chunk(seq[r.draft_len:r.kv_len + 1], r.draft_len, r.pages,
                                logits=kr > 0))
        logits = self.draft.forward(chunks, self.kv, p)
        live = [i for i, kr in enumerate(ks) if kr > 0]
        for row, i in enumerate(live):
            props[i].append(int(torch.argmax(logits[row])))
        for step in range(1, max(ks, default=0)):
            live = [i for i in live if ks[i] > step]
            if not live:
                break
            chunks = [Chunk([props[i][-1]], reqs[i].kv_len + step, reqs[i].pages) for i in live]
            logits = self.draft.forward(chunks, self.kv, p)
            for row, i in enumerate(live):
                props[i].append(int(torch.argmax(logits[row])))
        self.m.spec_draft_seconds += time.perf_counter() - t0
        # verify: the target over [last, d1 .. dk], all rows
        chunks = [Chunk([r.out[-1], *pr], r.kv_len, r.pages, all_logits=True)
                  for r, pr in zip(reqs, props)]
        t0 = time.perf_counter()
        logits = s.model.forward(chunks, s.cache.l1.buf, p)
        s.metrics.forward_seconds += time.perf_counter() - t0
        now = time.perf_counter()
        row = 0
        for r, pr in zip(reqs, props):
            rows, row = logits[row:row + len(pr) + 1], row + len(pr) + 1
            self._accept(r, pr, rows, now)

    def _accept(self, r: Any, proposal: list[int], rows: torch.Tensor, now: float) -> None:
        s = self.s
        start = r.kv_len
        n_acc = 0
        self.m.spec_verify_steps += 1
        r.spec_steps += 1
        self.m.spec_proposed += len(proposal)
        r.spec_proposed += len(proposal)
        for i in range(len(proposal) + 1):
            r.kv_len = start + i + 1           # KV of last, d1 .. d_i is the target's own
            try:
                tok = s._sample(rows[i], r)
            except Exception as exc:  # one request's sampling never fails its batch
                s._fail_sampling(r, exc)
                return
            agree = i < len(proposal) and tok == proposal[i]
            self.m.spec_emitted += 1
            if s._take(r, tok, now) or not agree:
                break
            n_acc += 1
        self.m.spec_accepted += n_acc
        r.spec_accepted += n_acc
        # the draft saw last, d1 .. d_(k-1): its KV is right through the accepted ones
        r.draft_len = start + max(1, min(n_acc + 1, len(proposal)))

    # -- figures ---------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        m = self.m
        return {
            "num_draft_tokens": self.k,
            "draft_preset": self.cfg.draft_preset,
            "draft_layout": self.cfg.draft_layout,
            "proposed": m.spec_proposed,
            "accepted": m.spec_accepted,
            "verify_steps": m.spec_verify_steps,
            "accept_rate": round(m.spec_accepted / m.spec_proposed, 4) if m.spec_proposed else None,
            "accept_length": (round(m.spec_emitted / m.spec_verify_steps, 4)
                              if m.spec_verify_steps else None),
            "draft_seconds": round(m.spec_draft_seconds, 4),
        }


def request_meta(r: Any) -> dict[str, Any]:
    """``meta_info`` fields of one request (only when it ran speculative rounds)."""
    if not r.spec_steps:
        return {}
    return {"spec_accept_rate": round(r.spec_accepted / r.spec_proposed, 4)
            if r.spec_proposed else None,
            "spec_accept_length": round((r.spec_accepted + r.spec_steps) / r.spec_steps, 4),
            "spec_verify_steps": r.spec_steps}


def cache_layout(model: Model, page_size: int, draft: Model | None = None,
                 spec: SpecConfig | None = None):
    """The L1/L2 layout a cache needs for ``model`` (plus a packed draft's layers)."""
    layout = model.kv_layout(page_size)
    if draft is None or spec is None or DraftLayout.parse(spec.draft_layout) is DraftLayout.SIDECAR:
        return layout
    n = layout.num_layers + draft.cfg.num_layers
    return dataclasses.replace(layout, num_layers=n, total_layers=n)


def sidecar_layout(model: Model, page_size: int, draft: Model):
    """The draft's own pools in the sidecar layout: its layers, after the target's."""
    layout = model.kv_layout(page_size)
    n = layout.num_layers + draft.cfg.num_layers
    return dataclasses.replace(draft.kv_layout(page_size), layer_start=layout.num_layers,
                               total_layers=n)
