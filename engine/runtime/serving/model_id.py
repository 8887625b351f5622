"""What identifies a served model: its tokenizer and the tag its L3 keys carry."""

from __future__ import annotations

import os
from typing import Any

from engine.runtime.tokenizer import Tokenizer, gguf_tokenizer, load_tokenizer

__all__ = ["model_tag", "model_tokenizer"]


def model_tokenizer(spec: str, mc: Any) -> Tokenizer | None:
    """The tokenizer of a preset (bytes), a checkpoint directory or a GGUF model."""
    from engine.runtime.model.gguf_loader import gguf_tokenizer_spec, open_gguf, resolve_gguf

    path = resolve_gguf(spec)
    if path is not None:
        return gguf_tokenizer(gguf_tokenizer_spec(open_gguf(path)), mc.vocab_size)
    return load_tokenizer(spec if os.path.isdir(spec) else None, mc.vocab_size, mc.bos_id,
                          mc.eos_ids[0] if mc.eos_ids else None)


def model_tag(spec: str, mc: Any) -> str:
    """What L3 keys carry so that different models (or seeds) never share stored KV."""
    from engine.runtime.model.gguf_loader import file_digest, resolve_gguf

    gguf = resolve_gguf(spec)
    if gguf is not None:
        return f"{mc.name}/gguf-{file_digest(gguf)}"
    if os.path.isdir(spec):
        import hashlib

        with open(os.path.join(spec, "config.json"), "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()[:16]
        return f"{mc.name}/config-{digest}"
    return f"{mc.name}/seed-{getattr(mc, 'seed', None)}"
