"""Start-up check of the exact path: the same rows in other batch shapes and thread counts must
give the same bits, or the exact products fall back to the single-thread kernel.

:func:`check_exact` runs a short prompt through the model three ways — one chunk; ragged chunks
(a one-token step among them) beside a batch mate; one chunk on one thread — and compares the
logits bit for bit. It also makes every first-call check of :mod:`engine.runtime.model.exact`
happen at start rather than mid-request. A difference forces the safe kernel
(:func:`engine.runtime.model.exact.force_safe`), logs one line and is checked again.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from engine.runtime.model import exact
from engine.runtime.model.transformer import Chunk, Model

_PS = 16
_log = logging.getLogger("hicache.model")


def _logits(model: Model, toks: np.ndarray, cuts: list[int], mate: np.ndarray | None
            ) -> torch.Tensor:
    lay = model.kv_layout(_PS)
    layers = len(model.w.layers)
    pages_per = -(-max(len(toks), 1 if mate is None else len(mate)) // _PS)
    kv = torch.zeros((layers, lay.kv_kinds, 2 * pages_per * _PS, lay.kv_heads,
                      lay.head_dim), dtype=model.dtype, device=model.device)
    mine = np.arange(pages_per)
    other = np.arange(pages_per, 2 * pages_per)
    if mate is not None:
        model.forward([Chunk(mate[:-1], 0, other)], kv, _PS)
    out = None
    for s, e in zip(cuts, cuts[1:]):
        chunks = [Chunk(toks[s:e], s, mine)]
        if mate is not None and e == cuts[-1]:
            chunks.insert(0, Chunk(mate[-1:], len(mate) - 1, other))
        out = model.forward(chunks, kv, _PS)
    assert out is not None
    return out[-1]


def _agree(model: Model, toks: np.ndarray, mate: np.ndarray) -> bool:
    n = len(toks)
    whole = _logits(model, toks, [0, n], None)
    ragged = _logits(model, toks, [0, 1, 2, n // 3, n - 1, n], mate)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one = _logits(model, toks, [0, n], None)
    finally:
        torch.set_num_threads(before)
    return torch.equal(whole, ragged) and torch.equal(whole, one)


def check_exact(model: Model, tokens: int = 300) -> bool:
    """``True`` when the exact path gave the same bits every way (possibly after falling back
    to the safe kernel); ``False`` if even the safe kernel did not (logged). No-op (``True``)
    for a model not on the exact path, and for a TP rank or pipeline stage (their forward
    needs the other ranks)."""
    if not model.exact or model.tp is not None or model.stage is not None:
        return True
    rng = np.random.default_rng(0)
    vocab = model.cfg.vocab_size
    n = max(8, min(tokens, model.cfg.max_context - 1))
    toks, mate = rng.integers(0, vocab, n), rng.integers(0, vocab, max(4, n // 5))
    if _agree(model, toks, mate):
        return True
    _log.warning("exact path: rows gave other bits in another batch shape or thread count "
                 "(%d threads); using the single-thread kernel for every product",
                 torch.get_num_threads())
    exact.force_safe()
    if _agree(model, toks, mate):
        return True
    _log.error("exact path: not batch invariant even with the single-thread kernel")
    return False
