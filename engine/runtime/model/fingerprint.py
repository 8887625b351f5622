"""What a model's KV bytes depend on, as one digest (docs/storage.md, "Model fingerprint").

* :func:`weights_digest`: XXH3-128 over the weights actually loaded — every tensor's name, dtype,
  shape and bytes, in a fixed order — computed once when a server loads its model (before any
  TP/PP split, so every rank of every shape agrees);
* :func:`arch_identity`: the parsed configuration fields that change the KV a forward writes
  (dimensions, attention kind, RoPE parameters, norm epsilon, dtype); not the name, seed,
  context length or special token ids.

The store's model tag (engine.runtime.model_id) hashes both, so two checkpoints with the
same ``config.json`` and different weights never read each other's objects.
"""

from __future__ import annotations

import dataclasses
import json

import torch
import xxhash

from engine.runtime.model.config import ModelConfig
from engine.runtime.model.weights import LayerWeights, ModelWeights

_NOT_KV = ("name", "seed", "max_context", "bos_id", "eos_ids")


def arch_identity(cfg: ModelConfig) -> str:
    """Canonical JSON of the configuration fields that shape the KV bytes."""
    fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)
              if f.name not in _NOT_KV}
    fields["attention"] = cfg.attention.value
    if fields.get("gemm_dtype") == "float32":   # the default: tags as before the option came
        del fields["gemm_dtype"]
    return json.dumps(fields, sort_keys=True, separators=(",", ":"))


def _tensors(w: ModelWeights):
    yield "embed", w.embed
    for i, lw in enumerate(w.layers):
        for f in dataclasses.fields(LayerWeights):
            t = getattr(lw, f.name)
            if t is not None:
                yield f"layers.{i}.{f.name}", t
    yield "final_norm", w.final_norm
    yield "lm_head", None if w.lm_head is w.embed else w.lm_head


def weights_digest(w: ModelWeights) -> str:
    """32 hex digits of XXH3-128 over every tensor (name, dtype, shape, bytes; a tied head is
    recorded as tied)."""
    h = xxhash.xxh3_128()
    for name, t in _tensors(w):
        if t is None:
            h.update(f"{name}:tied;".encode())
            continue
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        flat = t.detach().contiguous().reshape(-1)
        if flat.numel():
            h.update(flat.view(torch.uint8).cpu().numpy())
    return h.hexdigest()
