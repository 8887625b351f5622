"""Model weights: seeded random initialisation and local Hugging Face Llama checkpoints.

Random weights are drawn from one explicitly seeded ``torch.Generator`` in a fixed order, on the
CPU in float32, so every process and machine gets the same model for the same (config, seed).
Checkpoints are read from a local directory (``config.json`` + ``*.safetensors``); nothing is
downloaded.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os

import torch

from engine.core.errors import InputError
from engine.runtime.model.config import ModelConfig


@dataclasses.dataclass
class LayerWeights:
    attn_norm: torch.Tensor
    wo: torch.Tensor
    mlp_norm: torch.Tensor
    w_gate_up: torch.Tensor          # [2 * intermediate, hidden]: gate rows, then up rows
    w_down: torch.Tensor
    # GQA
    wqkv: torch.Tensor | None = None  # [(Hq + 2 Hkv) * D, hidden]
    # MLA
    wq: torch.Tensor | None = None    # [Hq * (dn + dr), hidden]
    wkv_a: torch.Tensor | None = None  # [dc + dr, hidden]
    kv_norm: torch.Tensor | None = None
    w_uk: torch.Tensor | None = None  # [Hq, dn, dc]
    w_uv: torch.Tensor | None = None  # [Hq, dc, dv]

    def to(self, device: torch.device, dtype: torch.dtype) -> "LayerWeights":
        return LayerWeights(**{f.name: (None if getattr(self, f.name) is None else
                                        getattr(self, f.name).to(device, dtype).contiguous())
                               for f in dataclasses.fields(self)})


@dataclasses.dataclass
class ModelWeights:
    embed: torch.Tensor
    layers: list[LayerWeights]
    final_norm: torch.Tensor
    lm_head: torch.Tensor

    def to(self, device: torch.device, dtype: torch.dtype) -> "ModelWeights":
        embed = self.embed.to(device, dtype).contiguous()
        head = embed if self.lm_head is self.embed else self.lm_head.to(device, dtype).contiguous()
        return ModelWeights(embed=embed, layers=[lw.to(device, dtype) for lw in self.layers],
                            final_norm=self.final_norm.to(device, dtype), lm_head=head)


def random_weights(cfg: ModelConfig, seed: int | None = None) -> ModelWeights:
    """Deterministic weights for ``cfg`` from ``seed`` (default ``cfg.seed``)."""
    g = torch.Generator().manual_seed(cfg.seed if seed is None else seed)

    def lin(out_f: int, in_f: int) -> torch.Tensor:
        return torch.randn((out_f, in_f), generator=g) / in_f ** 0.5

    H, I = cfg.hidden, cfg.intermediate
    embed = torch.randn((cfg.vocab_size, H), generator=g)
    layers = []
    for _ in range(cfg.num_layers):
        ones = torch.ones(H)
        if cfg.is_mla:
            dn, dr, dc, dv, Hq = (cfg.qk_nope_dim, cfg.qk_rope_dim, cfg.kv_lora_rank,
                                  cfg.v_head_dim, cfg.num_heads)
            attn = dict(wq=lin(Hq * (dn + dr), H), wkv_a=lin(dc + dr, H),
                        kv_norm=torch.ones(dc),
                        w_uk=torch.randn((Hq, dn, dc), generator=g) / dn ** 0.5,
                        w_uv=torch.randn((Hq, dc, dv), generator=g) / dc ** 0.5,
                        wo=lin(H, Hq * dv))
        else:
            qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
            attn = dict(wqkv=lin(qkv, H), wo=lin(H, cfg.num_heads * cfg.head_dim))
        layers.append(LayerWeights(attn_norm=ones, mlp_norm=ones.clone(),
                                   w_gate_up=lin(2 * I, H), w_down=lin(H, I), **attn))
    head = embed if cfg.tie_embeddings else lin(cfg.vocab_size, H)
    return ModelWeights(embed=embed, layers=layers, final_norm=torch.ones(H), lm_head=head)


# -- Hugging Face Llama checkpoints ---------------------------------------------------------

def _hf_names(i: int) -> dict[str, str]:
    p = f"model.layers.{i}."
    return {"q": p + "self_attn.q_proj.weight", "k": p + "self_attn.k_proj.weight",
            "v": p + "self_attn.v_proj.weight", "o": p + "self_attn.o_proj.weight",
            "gate": p + "mlp.gate_proj.weight", "up": p + "mlp.up_proj.weight",
            "down": p + "mlp.down_proj.weight", "ln1": p + "input_layernorm.weight",
            "ln2": p + "post_attention_layernorm.weight"}


MAX_SAFETENSORS_HEADER = 100 << 20
"""Bytes of a safetensors file's JSON header we read (the format's own readers stop there)."""
_ST_DTYPES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
              "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


def check_safetensors(f: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Each tensor's (dtype, shape) from a safetensors file, after checking its header from
    the bytes alone: an 8-byte length no larger than the file (or MAX_SAFETENSORS_HEADER),
    bounded JSON, known dtypes, and data ranges that lie inside the file and match the shapes.
    :class:`InputError` naming the file otherwise, before the reader maps anything."""
    import math
    import struct

    from formats import boundedjson

    size = os.path.getsize(f)
    if size < 8:
        raise InputError(f"{f}: {size} bytes, too short for a safetensors file")
    with open(f, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        if n > min(size - 8, MAX_SAFETENSORS_HEADER):
            raise InputError(f"{f}: not a safetensors file (its header claims {n:,} bytes; the "
                             f"file holds {size - 8:,} after the length, and at most "
                             f"{MAX_SAFETENSORS_HEADER:,} are read)")
        raw = fh.read(n)
    try:
        header = boundedjson.loads(raw)
    except boundedjson.JSONLimitError as exc:
        raise InputError(f"{f}: not a safetensors file (header: {exc})") from None
    if not isinstance(header, dict):
        raise InputError(f"{f}: not a safetensors file (the header is not a JSON object)")
    data = size - 8 - n
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        ok = (isinstance(t, dict) and t.get("dtype") in _ST_DTYPES
              and isinstance(t.get("shape"), list)
              and all(type(d) is int and 0 <= d < 1 << 40 for d in t["shape"])
              and isinstance(t.get("data_offsets"), list) and len(t["data_offsets"]) == 2
              and all(type(o) is int for o in t["data_offsets"]))
        if ok:
            lo, hi = t["data_offsets"]
            ok = (0 <= lo <= hi <= data
                  and hi - lo == math.prod(t["shape"]) * _ST_DTYPES[t["dtype"]])
        if not ok:
            raise InputError(f"{f}: tensor {name[:60]!r}: bad header entry (dtype, shape or "
                             f"data offsets outside the file's {data:,} data bytes)")
        out[name] = (t["dtype"], tuple(t["shape"]))
    return out


def load_hf(path: str, cfg: ModelConfig) -> ModelWeights:
    """Read a local Llama checkpoint directory (``*.safetensors``); no download. Every file's
    header is checked first (:func:`check_safetensors`), and every tensor's shape against the
    config before it is read."""
    from safetensors import SafetensorError, safe_open

    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise InputError(f"{path}: no *.safetensors files")
    where: dict[str, str] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for f in files:
        for k, (_, shape) in check_safetensors(f).items():
            where[k] = f
            shapes[k] = shape
    handles: dict[str, object] = {}

    def get(name: str) -> torch.Tensor:
        if name not in where:
            raise InputError(f"{path}: checkpoint lacks tensor {name!r}")
        f = where[name]
        try:
            if f not in handles:
                handles[f] = safe_open(f, framework="pt")
            return handles[f].get_tensor(name).float()  # type: ignore[attr-defined]
        except (SafetensorError, RuntimeError, OSError) as exc:
            raise InputError(f"{f}: cannot read tensor {name!r} ({str(exc)[:120]})") from None

    def take(key: str, shape: tuple[int, ...], name: str) -> torch.Tensor:
        """The tensor ``key``, its header's shape checked against the config before reading."""
        if key in shapes and shapes[key] != shape:
            raise InputError(f"{path}: {name} has shape {shapes[key]}, config implies {shape}")
        t = get(key)
        if tuple(t.shape) != shape:
            raise InputError(f"{path}: {name} has shape {tuple(t.shape)}, config implies {shape}")
        return t

    H, I, D = cfg.hidden, cfg.intermediate, cfg.head_dim
    Hq, Hkv = cfg.num_heads, cfg.num_kv_heads
    layers = []
    for i in range(cfg.num_layers):
        n = _hf_names(i)
        q = take(n["q"], (Hq * D, H), n["q"])
        k = take(n["k"], (Hkv * D, H), n["k"])
        v = take(n["v"], (Hkv * D, H), n["v"])
        layers.append(LayerWeights(
            attn_norm=take(n["ln1"], (H,), n["ln1"]),
            mlp_norm=take(n["ln2"], (H,), n["ln2"]),
            wqkv=torch.cat([q, k, v]),
            wo=take(n["o"], (H, Hq * D), n["o"]),
            w_gate_up=torch.cat([take(n["gate"], (I, H), n["gate"]),
                                 take(n["up"], (I, H), n["up"])]),
            w_down=take(n["down"], (H, I), n["down"])))
    embed = take("model.embed_tokens.weight", (cfg.vocab_size, H), "embed_tokens")
    if cfg.tie_embeddings or "lm_head.weight" not in where:
        head = embed
    else:
        head = take("lm_head.weight", (cfg.vocab_size, H), "lm_head")
    return ModelWeights(embed=embed, layers=layers,
                        final_norm=take("model.norm.weight", (H,), "model.norm"),
                        lm_head=head)


def save_hf(path: str, cfg: ModelConfig, w: ModelWeights) -> None:
    """Write ``cfg``/``w`` as a Hugging Face Llama checkpoint directory (GQA models only)."""
    from safetensors.torch import save_file

    from engine.runtime.model.config import to_hf_config

    os.makedirs(path, exist_ok=True)
    D, Hq, Hkv, I = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.intermediate
    t: dict[str, torch.Tensor] = {"model.embed_tokens.weight": w.embed,
                                  "model.norm.weight": w.final_norm}
    if not cfg.tie_embeddings:
        t["lm_head.weight"] = w.lm_head
    for i, lw in enumerate(w.layers):
        assert lw.wqkv is not None, "save_hf needs GQA weights"
        n = _hf_names(i)
        q, k, v = lw.wqkv.split([Hq * D, Hkv * D, Hkv * D])
        g, u = lw.w_gate_up.split([I, I])
        t.update({n["q"]: q, n["k"]: k, n["v"]: v, n["o"]: lw.wo, n["gate"]: g, n["up"]: u,
                  n["down"]: lw.w_down, n["ln1"]: lw.attn_norm, n["ln2"]: lw.mlp_norm})
    save_file({k: v.detach().to("cpu").contiguous() for k, v in t.items()},
              os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
        json.dump(to_hf_config(cfg), f, indent=2)
