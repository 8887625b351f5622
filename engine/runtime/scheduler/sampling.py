"""Sampling: the logits adjustments (banned specials, penalties, EOS held back), greedy and
random draws, and output/prompt log-probabilities. Pure functions of a request's state."""

from __future__ import annotations

import math
import zlib
from typing import Any

import torch


def input_logprobs(r: Any, c: Any, rows: torch.Tensor) -> None:
    """Prompt logprobs from a chunk's rows: row k predicts position ``c.start + k + 1``."""
    start = min(r.sampling.input_logprobs_from or 0, r.prompt_len - 1)
    if r.input_lp is None:
        r.input_lp = []
        if start == 0:                 # nothing predicts the first token
            r.input_lp.append((int(r.ids[0]), None, []))
    top = r.sampling.top_logprobs
    lp = torch.log_softmax(rows.float(), dim=-1)
    for k in range(len(c)):
        p = c.start + k + 1
        if start <= p < r.prompt_len and p >= max(start, 1):
            t = int(r.ids[p])
            alts: list[tuple[int, float]] = []
            if top > 0:
                v, i = torch.topk(lp[k], min(top, lp.shape[-1]))
                alts = [(int(a), float(b)) for a, b in zip(i.tolist(), v.tolist())]
            r.input_lp.append((t, float(lp[k, t]), alts))


def adjust(logits: torch.Tensor, r: Any, banned: torch.Tensor, eos_ids: frozenset) -> torch.Tensor:
    """The logits sampling sees: banned specials, penalties, EOS held back before
    ``min_new_tokens``. Returns ``logits`` itself when nothing applies."""
    sp = r.sampling
    hold = len(r.out) < sp.min_new_tokens
    if not (banned.numel() or sp.penalized or hold):
        return logits
    x = logits.float().clone()
    if sp.penalized and (r.out or sp.repetition_penalty != 1.0):
        out = torch.as_tensor(r.out, dtype=torch.long, device=x.device)
        if sp.repetition_penalty != 1.0:
            seen = torch.unique(torch.cat([torch.as_tensor(r.ids, device=x.device), out]))
            v = x[seen]
            x[seen] = torch.where(v > 0, v / sp.repetition_penalty,
                                  v * sp.repetition_penalty)
        if len(r.out) and (sp.frequency_penalty or sp.presence_penalty):
            counts = torch.bincount(out, minlength=x.numel()).to(x.dtype)
            x -= sp.frequency_penalty * counts + sp.presence_penalty * (counts > 0).to(x.dtype)
    if hold:
        stops = [t for t in (*sp.stop_token_ids, *eos_ids) if 0 <= t < x.numel()]
        if stops:
            x[torch.as_tensor(stops, dtype=torch.long)] = -math.inf
    if banned.numel():
        x[banned] = -math.inf
    return x


def sample(logits: torch.Tensor, r: Any, banned: torch.Tensor, eos_ids: frozenset) -> int:
    sp = r.sampling
    logits = adjust(logits, r, banned, eos_ids)
    if sp.greedy:
        tok = int(torch.argmax(logits))
    else:
        tok = draw(logits, r, banned)
    if sp.logprobs:
        r.lp_pending = token_logprobs(logits, tok, sp.top_logprobs)
    return tok


def draw(logits: torch.Tensor, r: Any, banned: torch.Tensor) -> int:
    sp = r.sampling
    if r.gen is None:
        seed = sp.seed if sp.seed is not None else zlib.crc32(r.rid.encode())
        r.gen = torch.Generator().manual_seed(seed)
    x = logits.float() / sp.temperature
    if banned.numel():             # -inf / inf (a huge temperature) is nan
        x[banned] = -math.inf
    if sp.top_k > 0:
        kth = torch.topk(x, min(sp.top_k, x.numel())).values[-1]
        x = x.masked_fill(x < kth, -math.inf)
    probs = torch.softmax(x, dim=-1)
    if sp.top_p < 1:
        sp_, idx = torch.sort(probs, descending=True)
        keep = torch.cumsum(sp_, 0) - sp_ < sp.top_p
        keep[0] = True                   # a top_p below float32 resolution keeps the top
        probs = torch.zeros_like(probs).scatter_(0, idx[keep], sp_[keep])
    return int(torch.multinomial(probs.cpu(), 1, generator=r.gen))


def token_logprobs(logits: torch.Tensor, tok: int, top: int
                   ) -> tuple[float, list[tuple[int, float]]]:
    """``(logprob of tok, [(id, logprob)] of the top ``top`` tokens)`` under ``logits``
    (after penalties, before temperature, top-k and top-p)."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    alts: list[tuple[int, float]] = []
    if top > 0:
        v, i = torch.topk(lp, min(top, lp.numel()))
        alts = [(int(a), float(b)) for a, b in zip(i.tolist(), v.tolist())]
    return float(lp[tok]), alts
