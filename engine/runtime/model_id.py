"""What identifies a served model: its tokenizer and the tag its L3 keys carry."""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

from engine.runtime.tokenizer import Tokenizer, gguf_tokenizer, load_tokenizer

__all__ = ["check_fingerprint", "model_tag", "model_tokenizer"]


def model_tokenizer(spec: str, mc: Any) -> Tokenizer | None:
    """The tokenizer of a preset (bytes), a checkpoint directory or a GGUF model."""
    from engine.runtime.model.gguf_loader import gguf_tokenizer_spec, open_gguf, resolve_gguf

    path = resolve_gguf(spec)
    if path is not None:
        return gguf_tokenizer(gguf_tokenizer_spec(open_gguf(path)), mc.vocab_size)
    return load_tokenizer(spec if os.path.isdir(spec) else None, mc.vocab_size, mc.bos_id,
                          mc.eos_ids[0] if mc.eos_ids else None)


MAX_FINGERPRINT_CHARS = 256


def check_fingerprint(value: str | None) -> None:
    """``--hicache-model-fingerprint``: 1-256 printable characters (ValueError otherwise)."""
    if value is None:
        return
    if not isinstance(value, str) or not value or len(value) > MAX_FINGERPRINT_CHARS \
            or not value.isprintable():
        raise ValueError(f"--hicache-model-fingerprint must be 1-{MAX_FINGERPRINT_CHARS} "
                         "printable characters")


def model_tag(mc: Any, weights_digest: str, override: str | None = None) -> str:
    """What L3 keys and object headers carry so that different models never share stored KV:
    the name and a digest of the KV-shaping configuration (:func:`arch_identity`) and of the
    weights actually loaded (``weights_digest``). ``override`` (``--hicache-model-fingerprint``)
    replaces the name and the weights: servers given the same value share objects whenever
    their configuration matches (the operator vouches that their weights are the same)."""
    from engine.runtime.model.fingerprint import arch_identity

    arch = arch_identity(mc)
    if override is not None:
        check_fingerprint(override)
        raw = json.dumps({"arch": arch, "declared": override}, sort_keys=True)
        return f"declared-{hashlib.sha256(raw.encode()).hexdigest()[:16]}"
    raw = json.dumps({"arch": arch, "weights": weights_digest}, sort_keys=True)
    return f"{mc.name}/w-{hashlib.sha256(raw.encode()).hexdigest()[:16]}"
