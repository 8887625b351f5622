"""The small real transformer whose attention reads the KV pools.

``load_model("tiny")`` builds a preset with seeded random weights; ``load_model(DIR)`` reads a
local Hugging Face Llama checkpoint. See docs/model-and-server.md.
"""

from __future__ import annotations

import dataclasses
import os

from engine.runtime.model.config import PRESETS, AttentionKind, ModelConfig, from_hf_config, preset
from engine.runtime.model.transformer import Chunk, LayerHook, Model
from engine.runtime.model.weights import load_hf, random_weights, save_hf

__all__ = ["AttentionKind", "Chunk", "LayerHook", "Model", "ModelConfig", "PRESETS",
           "from_hf_config", "load_model", "load_hf", "preset", "random_weights", "save_hf"]


def load_model(spec: str | ModelConfig = "tiny", device: str = "cpu", *, seed: int | None = None,
               exact: bool | None = None, dtype: str | None = None,
               gemm_dtype: str | None = None) -> Model:
    """A ready model: a preset name, a :class:`ModelConfig`, a local checkpoint directory, or a
    GGUF model (``smollm2-135m`` or a ``*.gguf`` path; engine.runtime.model.gguf_loader).
    ``gemm_dtype``: ``ModelConfig.gemm_dtype`` (the exact path's weight products)."""
    from engine.runtime.model.gguf_loader import load_gguf, resolve_gguf

    gguf_path = resolve_gguf(spec)
    if isinstance(spec, ModelConfig):
        cfg = spec
        weights = random_weights(cfg, seed)
    elif gguf_path is not None:
        cfg, weights, _ = load_gguf(gguf_path)
    elif os.path.isdir(spec):
        cfg = from_hf_config(spec, dtype)
        weights = load_hf(spec, cfg)
    else:
        cfg = preset(spec)
        if dtype is not None:
            cfg = dataclasses.replace(cfg, dtype=dtype)
        weights = random_weights(cfg, seed)
    if seed is not None:
        cfg = dataclasses.replace(cfg, seed=seed)
    if gemm_dtype is not None:
        cfg = dataclasses.replace(cfg, gemm_dtype=gemm_dtype)
    return Model(cfg, weights, device=device, exact=exact)
