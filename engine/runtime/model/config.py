"""Model shapes as frozen values, the preset registry and Hugging Face ``config.json`` parsing."""

from __future__ import annotations

import dataclasses
import enum
import math
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


GEMM_DTYPES = ("float32", "bfloat16")
"""The exact path's product dtypes (``ModelConfig.gemm_dtype``, ``--gemm-dtype``)."""


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
    gemm_dtype: str = "float32"
    """The exact CPU path's weight products: ``float32``, or ``bfloat16`` (weights and inputs
    rounded to bf16, float32 sums: twice the speed, still batch invariant; docs/model-and-server.md)."""
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
        if self.gemm_dtype not in GEMM_DTYPES:
            raise ValueError(f"gemm dtype must be one of {', '.join(GEMM_DTYPES)}, got "
                             f"{self.gemm_dtype!r:.40}")

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

# Ranges a config.json value must fall in (docs/reliability.md, "Named limits"). Past any
# Llama-style checkpoint this server could load, and small enough that the tables sized by them
# (RoPE: max_position_embeddings rows) fit in memory.
MAX_LAYERS = 1024
MAX_HIDDEN = 1 << 16
MAX_HEADS = 1024
MAX_HEAD_DIM = 1024
MAX_INTERMEDIATE = 1 << 18
MAX_VOCAB = 1 << 22
MAX_POSITION_EMBEDDINGS = 1 << 20
_REQUIRED = object()


class _Fields:
    """Typed reads of one parsed config.json: an integer field must be a JSON integer (not a
    string, a float or a bool) in its range, a number finite and in range; anything else is an
    :class:`InputError` naming the file and the field."""

    def __init__(self, path: str, c: dict):
        self.path, self.c = path, c

    def _get(self, key: str, default: Any) -> Any:
        v = self.c.get(key, default)
        if v is _REQUIRED:
            raise InputError(f"{self.path}: missing field {key!r}")
        return v

    def bad(self, key: str, what: str, v: Any) -> InputError:
        return InputError(f"{self.path}: {key} must be {what}, got {_short(v)}")

    def int(self, key: str, lo: int, hi: int, default: Any = _REQUIRED, v: Any = _REQUIRED) -> int:
        v = self._get(key, default) if v is _REQUIRED else v
        if type(v) is not int or not lo <= v <= hi:
            raise self.bad(key, f"an integer in [{lo}, {hi:,}]", v)
        return v

    def num(self, key: str, lo: float, hi: float, default: Any = _REQUIRED,
            v: Any = _REQUIRED) -> float:
        v = self._get(key, default) if v is _REQUIRED else v
        if type(v) not in (int, float) or not math.isfinite(v) or not lo < v <= hi:
            raise self.bad(key, f"a number in ({lo:g}, {hi:g}]", v)
        return float(v)

    def bool(self, key: str, default: bool) -> bool:
        v = self._get(key, default)
        if type(v) is not bool:
            raise self.bad(key, "true or false", v)
        return v


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


def from_hf_config(path: str, dtype: str | None = None) -> ModelConfig:
    """A :class:`ModelConfig` from a Hugging Face Llama ``config.json`` (file or its directory).
    Untrusted input: bounded JSON (size, depth, numbers), every field typed and in range."""
    from formats import boundedjson

    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if os.path.getsize(path) > _MAX_CONFIG_BYTES:
        raise InputError(f"{path}: larger than {_MAX_CONFIG_BYTES} bytes, not a model config")
    with open(path, "rb") as f:
        raw = f.read(_MAX_CONFIG_BYTES + 1)
    try:
        c = boundedjson.loads(raw)
    except boundedjson.JSONLimitError as exc:
        raise InputError(f"{path}: not a JSON config ({exc})") from None
    if not isinstance(c, dict):
        raise InputError(f"{path}: expected a JSON object")
    mt = c.get("model_type", "llama")
    if mt not in ("llama", "mistral", "qwen2"):
        raise InputError(f"{path}: model_type {_short(mt)} is not supported (Llama-style only)")
    f = _Fields(path, c)
    heads = f.int("num_attention_heads", 1, MAX_HEADS)
    hidden = f.int("hidden_size", 1, MAX_HIDDEN)
    kv_heads = f.int("num_key_value_heads", 1, heads, heads)
    head_dim = c.get("head_dim")
    head_dim = f.int("head_dim", 2, MAX_HEAD_DIM, v=hidden // heads if head_dim is None
                     else head_dim)
    vocab = f.int("vocab_size", 1, MAX_VOCAB)
    rope_llama3 = None
    linear = 1.0
    rs = c.get("rope_scaling")
    if rs is not None and not isinstance(rs, dict):
        raise f.bad("rope_scaling", "an object or null", rs)
    if rs:
        kind = rs.get("rope_type", rs.get("type"))
        r = _Fields(f"{path}: rope_scaling", rs)
        if kind == "llama3":
            lo = r.num("low_freq_factor", 0, 1e6, 1.0)
            hi = r.num("high_freq_factor", 0, 1e6, 4.0)
            if hi <= lo:
                raise r.bad("high_freq_factor", f"> low_freq_factor ({lo:g})", hi)
            rope_llama3 = (r.num("factor", 0, 1e6), lo, hi,
                           r.int("original_max_position_embeddings", 1,
                                 MAX_POSITION_EMBEDDINGS, 8192))
        elif kind == "linear":
            linear = r.num("factor", 0, 1e6)
        elif kind not in (None, "default"):
            raise InputError(f"{path}: rope_scaling type {_short(kind)} is not supported")
    if c.get("attention_bias") or c.get("mlp_bias") or mt == "qwen2":
        raise InputError(f"{path}: biased projections are not supported")
    eos = c.get("eos_token_id")
    eos_list = eos if isinstance(eos, list) else [] if eos is None else [eos]
    if len(eos_list) > 64:
        raise f.bad("eos_token_id", "at most 64 ids", eos)
    eos_ids = tuple(f.int("eos_token_id", 0, vocab - 1, v=e) for e in eos_list)
    bos = c.get("bos_token_id")
    td = c.get("torch_dtype", "float32")
    torch_name = dtype or (_HF_DTYPES.get(td, "float32") if isinstance(td, str) else "float32")
    try:
        return ModelConfig(
            name=os.path.basename(os.path.dirname(os.path.abspath(path))) or "hf",
            num_layers=f.int("num_hidden_layers", 1, MAX_LAYERS), hidden=hidden,
            num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
            intermediate=f.int("intermediate_size", 1, MAX_INTERMEDIATE), vocab_size=vocab,
            max_context=f.int("max_position_embeddings", 1, MAX_POSITION_EMBEDDINGS, 4096),
            rope_theta=f.num("rope_theta", 0, 1e12, 10000.0),
            rms_eps=f.num("rms_norm_eps", 0, 1.0, 1e-6),
            tie_embeddings=f.bool("tie_word_embeddings", False),
            dtype=torch_name, rope_llama3=rope_llama3, rope_linear_factor=linear,
            bos_id=None if bos is None else f.int("bos_token_id", 0, vocab - 1, v=bos),
            eos_ids=eos_ids)
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
