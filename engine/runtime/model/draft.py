"""Draft models for speculative decoding (docs/speculative.md).

A draft proposes tokens the target then verifies in one pass; with greedy acceptance the output is
exactly the target's, so a draft only changes speed. A draft here has its own layers and its own
KV (which the cache stores, restores and evicts with the target's) and shares the target's token
embedding, final norm and output head (as EAGLE/MTP heads do).

With seeded random weights an independent draft would agree with the target only by chance, which
would make every acceptance figure meaningless. The presets therefore start from a copy of the
target's first layers and perturb every weight matrix with seeded noise (a fraction of its own
spread): the draft keeps its own weights and KV, yet agrees with the target most of the time.

======================  ==============================  ========================================
preset                  layers                          noise (x each matrix's std)
======================  ==============================  ========================================
``mirror`` (default)    all of the target's             0.03
``mirror-half``         the first half                  0.03
======================  ==============================  ========================================
"""

from __future__ import annotations

import dataclasses

import torch

from engine.runtime.model.transformer import Model
from engine.runtime.model.weights import LayerWeights, ModelWeights


@dataclasses.dataclass(frozen=True)
class DraftPreset:
    name: str
    layer_fraction: float
    noise: float


DRAFT_PRESETS: dict[str, DraftPreset] = {p.name: p for p in (
    DraftPreset("mirror", 1.0, 0.03),
    DraftPreset("mirror-half", 0.5, 0.03),
)}


def draft_preset(name: str) -> DraftPreset:
    try:
        return DRAFT_PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown draft preset {name!r}; choose one of "
                         f"{', '.join(sorted(DRAFT_PRESETS))}") from None


def _perturb(t: torch.Tensor, noise: float, g: torch.Generator) -> torch.Tensor:
    if t.dim() < 2 or noise == 0:
        return t.clone()
    base = t.float()
    return (base + noise * base.std() * torch.randn(base.shape, generator=g)).to(t.dtype)


def make_draft(target: Model, preset: str = "mirror", seed: int | None = None) -> Model:
    """A draft model for ``target`` (same device, dtype and kernels)."""
    p = draft_preset(preset)
    n = max(1, round(target.cfg.num_layers * p.layer_fraction))
    g = torch.Generator().manual_seed((target.cfg.seed if seed is None else seed) + 7919)
    layers = []
    for lw in target.w.layers[:n]:
        fields = {f.name: getattr(lw, f.name) for f in dataclasses.fields(lw)}
        layers.append(LayerWeights(**{k: None if v is None else _perturb(v.cpu(), p.noise, g)
                                      for k, v in fields.items()}))
    w = ModelWeights(embed=target.w.embed, layers=layers, final_norm=target.w.final_norm,
                     lm_head=target.w.lm_head)
    cfg = dataclasses.replace(target.cfg, num_layers=n, name=f"{target.cfg.name}+draft-{p.name}")
    return Model(cfg, w, device=str(target.device), exact=target.exact)
