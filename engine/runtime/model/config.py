"""Model shapes as frozen values, the preset registry and Hugging Face ``config.json`` parsing."""

from __future__ import annotations

import dataclasses
import enum
import json
import os
from typing import Any

from engine.core.errors import InputError
from engine.core.layout import KVLayout, torch_dtype

# Byte-level vocabulary: 256 byte tokens followed by the special tokens of engine.runtime.tokenizer.
BYTE_VOCAB = 260

# A config.json larger than this is not a model config.
_MAX_CONFIG_BYTES = 1 << 20


class AttentionKind(str, enum.Enum):
    GQA = "gqa"  # grouped-query attention: K and V per kv-head (KVLayout kv_kinds=2)
    MLA = "mla"  # multi-head latent attention: one latent vector per token (kv_kinds=1)

    @classmethod
    def parse(cls, value: "str | AttentionKind") -> "AttentionKind":
        try:
            return cls(value)
        except ValueError:
            raise ValueError(
                f"unknown attention {value!r}; choose one of {[m.value for m in cls]}") from None


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-style decoder (RMSNorm, RoPE, GQA or MLA, SwiGLU).

    For MLA (DeepSeek-V2 style, absorbed form) each token stores one vector of
    ``kv_lora_rank + qk_rope_dim`` values per layer: the normalised latent followed by the
    RoPE'd shared key part. Queries have ``qk_nope_dim + qk_rope_dim`` dims per head and values
    ``v_head_dim``.
    """

    name: str
    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    vocab_size: int = BYTE_VOCAB
    max_context: int = 16384
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    attention: AttentionKind = AttentionKind.GQA
    kv_lora_rank: int = 0
    qk_rope_dim: int = 0
    qk_nope_dim: int = 0
    v_head_dim: int = 0
    tie_embeddings: bool = False
    dtype: str = "float32"
    seed: int = 0
    # Llama-3 style RoPE scaling: (factor, low_freq_factor, high_freq_factor, original_max_pos)
    rope_llama3: tuple[float, float, float, int] | None = None
    rope_linear_factor: float = 1.0
    bos_id: int | None = 256
    eos_ids: tuple[int, ...] = (257,)

    def __post_init__(self) -> None:
        object.__setattr__(self, "attention", AttentionKind.parse(self.attention))
        for f in ("num_layers", "hidden", "num_heads", "num_kv_heads", "head_dim",
                  "intermediate", "vocab_size", "max_context"):
            if getattr(self, f) < 1:
                raise ValueError(f"ModelConfig.{f} must be >= 1, got {getattr(self, f)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")
        if self.attention is AttentionKind.MLA:
            for f in ("kv_lora_rank", "qk_rope_dim", "qk_nope_dim", "v_head_dim"):
                if getattr(self, f) < 1:
                    raise ValueError(f"MLA needs ModelConfig.{f} >= 1")
            if self.qk_rope_dim % 2:
                raise ValueError("qk_rope_dim must be even")
        elif self.head_dim % 2:
            raise ValueError("head_dim must be even (RoPE)")
        torch_dtype(self.dtype)

    # Derived sizes ----------------------------------------------------------------------
    @property
    def is_mla(self) -> bool:
        return self.attention is AttentionKind.MLA

    @property
    def kv_kinds(self) -> int:
        return 1 if self.is_mla else 2

    @property
    def cache_heads(self) -> int:
        """kv-heads per token in the cache (1 for MLA: one latent vector)."""
        return 1 if self.is_mla else self.num_kv_heads

    @property
    def cache_dim(self) -> int:
        """Width of one cached vector (head_dim, or latent + rope part for MLA)."""
        return self.kv_lora_rank + self.qk_rope_dim if self.is_mla else self.head_dim

    @property
    def rope_dim(self) -> int:
        return self.qk_rope_dim if self.is_mla else self.head_dim

    def kv_layout(self, page_size: int) -> KVLayout:
        return KVLayout(num_layers=self.num_layers, kv_heads=self.cache_heads,
                        head_dim=self.cache_dim, page_size=page_size, dtype=self.dtype,
                        kv_kinds=self.kv_kinds)

    def num_params(self) -> int:
        H, L, I, V = self.hidden, self.num_layers, self.intermediate, self.vocab_size
        if self.is_mla:
            attn = (H * self.num_heads * (self.qk_nope_dim + self.qk_rope_dim)
                    + H * self.cache_dim + self.kv_lora_rank
                    + self.num_heads * self.kv_lora_rank * (self.qk_nope_dim + self.v_head_dim)
                    + self.num_heads * self.v_head_dim * H)
        else:
            attn = H * (self.num_heads + 2 * self.num_kv_heads) * self.head_dim \
                + self.num_heads * self.head_dim * H
        per_layer = attn + 3 * H * I + 2 * H
        return L * per_layer + V * H * (1 if self.tie_embeddings else 2) + H

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["attention"] = self.attention.value
        return d


def _gqa(name: str, **kw: Any) -> ModelConfig:
    return ModelConfig(name=name, **kw)


def _mla(name: str, **kw: Any) -> ModelConfig:
    return ModelConfig(name=name, attention=AttentionKind.MLA, **kw)


# Presets. ``tiny`` prefills a few thousand tokens/s on 2 CPU cores; the others are for GPUs.
PRESETS: dict[str, ModelConfig] = {p.name: p for p in [
    _gqa("tiny", num_layers=4, hidden=256, num_heads=4, num_kv_heads=2, head_dim=64,
         intermediate=768, max_context=16384),
    _mla("tiny-mla", num_layers=4, hidden=256, num_heads=4, num_kv_heads=1, head_dim=64,
         intermediate=768, max_context=16384, kv_lora_rank=128, qk_rope_dim=32,
         qk_nope_dim=64, v_head_dim=64),
    _gqa("small", num_layers=8, hidden=1024, num_heads=16, num_kv_heads=4, head_dim=64,
         intermediate=2816, max_context=65536),
    _mla("small-mla", num_layers=8, hidden=1024, num_heads=16, num_kv_heads=1, head_dim=64,
         intermediate=2816, max_context=65536, kv_lora_rank=256, qk_rope_dim=64,
         qk_nope_dim=64, v_head_dim=64),
    _gqa("medium", num_layers=16, hidden=2048, num_heads=16, num_kv_heads=8, head_dim=128,
         intermediate=5632, max_context=131072, rope_theta=500000.0, dtype="bfloat16"),
]}


def preset(name: str) -> ModelConfig:
    from engine.core.errors import UsageError  # a name the user gave (--model)

    try:
        return PRESETS[name]
    except KeyError:
        raise UsageError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)} "
                         f"or give a local checkpoint directory") from None


_HF_DTYPES = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16"}


def from_hf_config(path: str, dtype: str | None = None) -> ModelConfig:
    """A :class:`ModelConfig` from a Hugging Face Llama ``config.json`` (file or its directory)."""
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if os.path.getsize(path) > _MAX_CONFIG_BYTES:
        raise InputError(f"{path}: larger than {_MAX_CONFIG_BYTES} bytes, not a model config")
    try:
        with open(path, encoding="utf-8") as f:
            c = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InputError(f"{path}: not a JSON config ({exc})") from None
    if not isinstance(c, dict):
        raise InputError(f"{path}: expected a JSON object")
    mt = c.get("model_type", "llama")
    if mt not in ("llama", "mistral", "qwen2"):
        raise InputError(f"{path}: model_type {mt!r} is not supported (Llama-style only)")
    try:
        heads = int(c["num_attention_heads"])
        hidden = int(c["hidden_size"])
        rope_llama3 = None
        linear = 1.0
        rs = c.get("rope_scaling")
        if rs:
            kind = rs.get("rope_type", rs.get("type"))
            if kind == "llama3":
                rope_llama3 = (float(rs["factor"]), float(rs.get("low_freq_factor", 1.0)),
                               float(rs.get("high_freq_factor", 4.0)),
                               int(rs.get("original_max_position_embeddings", 8192)))
            elif kind == "linear":
                linear = float(rs["factor"])
            elif kind not in (None, "default"):
                raise InputError(f"{path}: rope_scaling type {kind!r} is not supported")
        if c.get("attention_bias") or c.get("mlp_bias") or mt == "qwen2":
            raise InputError(f"{path}: biased projections are not supported")
        eos = c.get("eos_token_id")
        eos_ids = tuple(int(e) for e in eos) if isinstance(eos, list) else \
            ((int(eos),) if eos is not None else ())
        bos = c.get("bos_token_id")
        torch_name = dtype or _HF_DTYPES.get(str(c.get("torch_dtype", "float32")), "float32")
        return ModelConfig(
            name=os.path.basename(os.path.dirname(os.path.abspath(path))) or "hf",
            num_layers=int(c["num_hidden_layers"]), hidden=hidden, num_heads=heads,
            num_kv_heads=int(c.get("num_key_value_heads", heads)),
            head_dim=int(c.get("head_dim") or hidden // heads),
            intermediate=int(c["intermediate_size"]), vocab_size=int(c["vocab_size"]),
            max_context=int(c.get("max_position_embeddings", 4096)),
            rope_theta=float(c.get("rope_theta", 10000.0)),
            rms_eps=float(c.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(c.get("tie_word_embeddings", False)),
            dtype=torch_name, rope_llama3=rope_llama3, rope_linear_factor=linear,
            bos_id=None if bos is None else int(bos), eos_ids=eos_ids)
    except KeyError as exc:
        raise InputError(f"{path}: missing field {exc.args[0]!r}") from None
    except (TypeError, ValueError) as exc:
        raise InputError(f"{path}: bad field value ({exc})") from None


def to_hf_config(cfg: ModelConfig) -> dict[str, Any]:
    """The ``config.json`` a Hugging Face Llama loader expects for ``cfg`` (GQA only)."""
    if cfg.is_mla:
        raise ValueError("MLA models have no Llama config.json")
    d: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": cfg.hidden, "intermediate_size": cfg.intermediate,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
        "num_hidden_layers": cfg.num_layers, "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size, "max_position_embeddings": cfg.max_context,
        "rope_theta": cfg.rope_theta, "rms_norm_eps": cfg.rms_eps,
        "tie_word_embeddings": cfg.tie_embeddings, "torch_dtype": cfg.dtype,
        "hidden_act": "silu", "bos_token_id": cfg.bos_id,
        "eos_token_id": list(cfg.eos_ids),
    }
    if cfg.rope_llama3:
        f, lo, hi, orig = cfg.rope_llama3
        d["rope_scaling"] = {"rope_type": "llama3", "factor": f, "low_freq_factor": lo,
                             "high_freq_factor": hi, "original_max_position_embeddings": orig}
    elif cfg.rope_linear_factor != 1.0:
        d["rope_scaling"] = {"rope_type": "linear", "factor": cfg.rope_linear_factor}
    return d
