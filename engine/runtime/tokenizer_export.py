"""Write a tokenizer as a Hugging Face tokenizer directory a client can load offline
(``AutoTokenizer.from_pretrained(DIR)``, ``tokenizers.Tokenizer.from_file``): ``tokenizer.json``,
``tokenizer_config.json`` (with the chat template) and ``special_tokens_map.json``.

The presets' byte tokenizer becomes a byte-level BPE with no merges: each UTF-8 byte is one
token whose id is the byte, the four specials are added tokens 256–259 (so their strings in text
encode as the specials), and a template post-processor puts ``<bos>`` first, as the server's
``encode`` does. Layout and round trip: docs/sglang-compat.md.
"""

from __future__ import annotations

import json
import os
from typing import Any

from engine.runtime.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def byte_level_alphabet() -> list[str]:
    """The printable stand-in character of every byte (index = byte), the byte-level scheme of
    GPT-2-style tokenizers: printable Latin-1 bytes stand for themselves, the others are
    mapped, in order, to code points from 256 up."""
    keep = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAD)) | \
        set(range(0xAE, 0x100))
    out, extra = [], 0
    for b in range(256):
        if b in keep:
            out.append(chr(b))
        else:
            out.append(chr(256 + extra))
            extra += 1
    return out


def _added(token_id: int, text: str) -> dict[str, Any]:
    return {"id": token_id, "content": text, "single_word": False, "lstrip": False,
            "rstrip": False, "normalized": False, "special": True}


def byte_tokenizer_json() -> dict[str, Any]:
    tok = ByteTokenizer
    vocab = {ch: b for b, ch in enumerate(byte_level_alphabet())}
    bos = tok.SPECIALS[0]
    return {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [_added(256 + i, s) for i, s in enumerate(tok.SPECIALS)],
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                          "use_regex": False},
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": bos, "type_id": 0}},
                       {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": bos, "type_id": 0}},
                     {"Sequence": {"id": "A", "type_id": 0}},
                     {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {bos: {"id": bos, "ids": [tok.bos_id], "tokens": [bos]}}},
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                    "use_regex": False},
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": []},
    }


def export_tokenizer(tok: Tokenizer, directory: str, model_name: str,
                     max_length: int) -> str:
    """Write ``tok`` into ``directory`` (created if needed); returns the directory."""
    if isinstance(tok, ByteTokenizer):
        body = json.dumps(byte_tokenizer_json(), ensure_ascii=False)
    elif isinstance(tok, HFTokenizer):
        body = tok._tok.to_str()
    else:
        raise ValueError(f"cannot export a {type(tok).__name__}")
    specials = dict(tok.special_tokens)
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_length,
        "clean_up_tokenization_spaces": False, "add_bos_token": tok.bos_id is not None,
        "name_or_path": model_name, **specials}
    if tok.chat_template:
        config["chat_template"] = tok.chat_template
    from formats.outpath import check_output_dir, write_output

    check_output_dir(directory)
    for name, data in (("tokenizer.json", body),
                       ("tokenizer_config.json", json.dumps(config, indent=2)),
                       ("special_tokens_map.json", json.dumps(specials, indent=2))):
        # formats.outpath's rule: never replaces a device or FIFO, writes through symlinks
        write_output(os.path.join(directory, name), data.encode("utf-8"))
    return directory


def tokenizer_for_model(spec: str) -> tuple[Tokenizer, str, int]:
    """``(tokenizer, model name, context length)`` of a preset name or checkpoint directory,
    without loading weights. :class:`ValueError` when the model has no usable tokenizer."""
    from engine.runtime.model import from_hf_config, preset
    from engine.runtime.model.gguf_loader import gguf_config, gguf_tokenizer_spec, open_gguf, resolve_gguf
    from engine.runtime.tokenizer import gguf_tokenizer, load_tokenizer

    path = resolve_gguf(spec)
    if path is not None:
        r = open_gguf(path)
        mc = gguf_config(r, spec)
        return gguf_tokenizer(gguf_tokenizer_spec(r), mc.vocab_size), mc.name, mc.max_context
    if os.path.isdir(spec):
        mc = from_hf_config(spec)
        tok = load_tokenizer(spec, mc.vocab_size, mc.bos_id, mc.eos_ids[0] if mc.eos_ids
                             else None)
    else:
        mc = preset(spec)
        tok = load_tokenizer(None, mc.vocab_size, mc.bos_id, mc.eos_ids[0] if mc.eos_ids
                             else None)
    if tok is None:
        raise ValueError(f"model {spec!r} has no tokenizer this server can load (a checkpoint's "
                         "tokenizer.json needs the `tokenizers` package)")
    return tok, mc.name, mc.max_context
