"""Response bodies in SGLang's and OpenAI's shapes: usage, cache details, logprobs, meta_info."""

from __future__ import annotations

from typing import Any, Sequence

from engine.runtime.serving.batch import Batch, Sub
from engine.runtime.serving.protocol import sglang_finish_reason
from engine.runtime.tokenizer import Tokenizer

_TIERS = ("device", "host", "storage")


def cached_details(subs: Sequence[Sub], storage_backend: str | None = None) -> dict:
    d = {k: 0 for k in _TIERS}
    for s in subs:
        got = (s.meta or {}).get("cached_tokens_details") or {}
        for k in _TIERS:
            d[k] += int(got.get(k, 0) or 0)
    if storage_backend:
        d["storage_backend"] = storage_backend
    return d


def usage(batch: Batch) -> dict:
    firsts = batch.firsts()
    prompt = sum(s.prompt_len for s in firsts)
    completion = sum(len(s.ids) for s in batch.subs)
    cached = sum((s.meta or {}).get("cached_tokens", 0) for s in firsts)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def sglext(batch: Batch, storage_backend: str | None) -> dict:
    return {"cached_tokens_details": cached_details(batch.firsts(), storage_backend)}


def _text(tok: Tokenizer | None, t: int) -> str:
    return tok.token_text(t) if tok is not None else ""


# -- SGLang /generate ----------------------------------------------------------------------
def sglang_meta(batch: Batch, s: Sub, final: bool) -> dict:
    p = batch.parsed
    m = dict(s.meta or {})
    m["id"] = s.rid
    m["prompt_tokens"] = s.prompt_len
    m["completion_tokens"] = len(s.ids)
    m["finish_reason"] = sglang_finish_reason(s.reason, s.ids, s.error, s.matched_stop) \
        if final else None
    m.setdefault("cached_tokens", 0)
    m.setdefault("cached_tokens_details", {k: 0 for k in _TIERS})
    m["weight_version"] = batch.engine.weight_version
    if p.return_logprob:
        tok = batch.engine.tokenizer if p.text_in_logprobs else None

        def entry(lp: float | None, t: int) -> list:
            return [lp, t, _text(tok, t) if tok is not None else None]

        m["output_token_logprobs"] = [entry(lp, t) for (lp, _), t in zip(s.logprobs, s.ids)]
        m["output_top_logprobs"] = [[entry(a, i) for i, a in alts] if p.top_logprobs_num
                                    else None for _, alts in s.logprobs]
        inp = s.input_logprobs or []
        m["input_token_logprobs"] = [entry(lp, t) for t, lp, _ in inp]
        m["input_top_logprobs"] = [[entry(a, i) for i, a in alts] if p.top_logprobs_num and
                                   lp is not None else None for _, lp, alts in inp]
    return m


def generate_item(batch: Batch, s: Sub, final: bool) -> dict:
    d = {"text": s.text, "output_ids": list(s.ids), "meta_info": sglang_meta(batch, s, final)}
    if batch.parsed.batched:
        d["index"] = s.index
    return d


# -- OpenAI logprobs -----------------------------------------------------------------------
def completion_logprobs(tok: Tokenizer | None, s: Sub, echo: bool, offset0: int) -> dict:
    """OpenAI completions ``logprobs``: tokens, token_logprobs, top_logprobs, text_offset."""
    entries: list[tuple[int, float | None, list[tuple[int, float]]]] = []
    if echo:
        inp = {t_i: (lp, alts) for t_i, (_, lp, alts) in enumerate(s.input_logprobs or [])}
        start = len(s.prompt_ids) - len(s.input_logprobs or [])
        for i, t in enumerate(s.prompt_ids):
            lp, alts = inp.get(i - start, (None, []))
            entries.append((t, lp, alts))
    entries += [(t, lp, alts) for t, (lp, alts) in zip(s.ids, s.logprobs)]
    tokens, lps, tops, offsets = [], [], [], []
    off = offset0
    for t, lp, alts in entries:
        txt = _text(tok, t)
        tokens.append(txt)
        lps.append(lp)
        tops.append({_text(tok, i): a for i, a in alts} if lp is not None else None)
        offsets.append(off)
        off += len(txt)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops,
            "text_offset": offsets}


def chat_logprobs(tok: Tokenizer | None, ids: Sequence[int],
                  lps: Sequence[tuple[float, list[tuple[int, float]]]]) -> dict:
    def one(t: int, lp: float) -> dict[str, Any]:
        txt = _text(tok, t)
        return {"token": txt, "logprob": lp, "bytes": list(txt.encode("utf-8"))}

    return {"content": [{**one(t, lp), "top_logprobs": [one(i, a) for i, a in alts]}
                        for t, (lp, alts) in zip(ids, lps)]}
