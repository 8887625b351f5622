"""Tokenizers: byte-level (UTF-8 bytes + special tokens) for the presets, so text prompts work
offline; a checkpoint's own ``tokenizer.json`` when the optional ``tokenizers`` package exists.

Both read special-token strings inside text as the special tokens (``"<eos>"`` in a prompt is
id 257 for the presets), as Hugging Face tokenizers do, so a client encoding with the exported
tokenizer directory (:mod:`engine.runtime.tokenizer_export`) gets the server's ids. Every
tokenizer carries a Jinja chat template (:mod:`engine.runtime.chat_template`).
"""

from __future__ import annotations

import codecs
import json
import os
import re
from typing import Protocol, Sequence

# The presets' chat template: BOS, then per message "<sep>ROLE\nCONTENT<eos>", then
# "<sep>assistant\n" to prompt a reply. A prompt of round r is a prefix of round r + 1's.
BYTE_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<sep>{{ message['role'] }}\n"
    "{{ message['content'] }}<eos>{% endfor %}"
    "{% if add_generation_prompt %}<sep>assistant\n{% endif %}")

_MAX_CONFIG_BYTES = 4 << 20        # a tokenizer_config.json larger than this is refused


class Tokenizer(Protocol):
    vocab_size: int
    bos_id: int | None
    eos_id: int | None
    chat_template: str | None
    special_tokens: dict[str, str]   # bos_token, eos_token, ... -> their text

    def encode(self, text: str, add_bos: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def token_text(self, token_id: int) -> str: ...

    def stream(self) -> "StreamDecoder": ...


class StreamDecoder(Protocol):
    def push(self, token_id: int) -> str: ...

    def flush(self) -> str: ...


class ByteTokenizer:
    """Token ``b`` (0–255) is byte ``b``; specials follow: BOS, EOS, PAD, SEP."""

    SPECIALS = ("<bos>", "<eos>", "<pad>", "<sep>")
    bos_id = 256
    eos_id = 257
    pad_id = 258
    sep_id = 259
    vocab_size = 256 + len(SPECIALS)
    chat_template = BYTE_CHAT_TEMPLATE
    special_tokens = {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>",
                      "sep_token": "<sep>"}
    _SPLIT = re.compile("(" + "|".join(re.escape(s) for s in SPECIALS) + ")")

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = [self.bos_id] if add_bos else []
        for i, part in enumerate(self._SPLIT.split(text)):
            if i % 2:                      # a special-token string
                ids.append(256 + self.SPECIALS.index(part))
            else:
                ids.extend(part.encode("utf-8"))
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def token_text(self, token_id: int) -> str:
        """One token as text (logprob listings): a special's name, else its byte decoded
        (an incomplete UTF-8 byte shows as U+FFFD)."""
        if 256 <= token_id < self.vocab_size:
            return self.SPECIALS[token_id - 256]
        return bytes([token_id]).decode("utf-8", errors="replace") if 0 <= token_id < 256 \
            else ""

    def stream(self) -> "_ByteStream":
        return _ByteStream()


class _ByteStream:
    """Incremental decoding: a multi-byte character is emitted once all its bytes arrived."""

    def __init__(self) -> None:
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        if not 0 <= token_id < 256:
            return ""
        return self._dec.decode(bytes([token_id]))

    def flush(self) -> str:
        return self._dec.decode(b"", final=True)


class HFTokenizer:
    """A ``tokenizer.json`` through the optional ``tokenizers`` package (a checkpoint's own, or
    one built from GGUF metadata: ``json_body``). ``bos_id`` is what ``encode`` puts first
    (None: nothing)."""

    def __init__(self, path: str, vocab_size: int, bos_id: int | None, eos_id: int | None,
                 chat_template: str | None = None,
                 special_tokens: dict[str, str] | None = None, *, json_body: str | None = None):
        from tokenizers import Tokenizer as _Tok  # optional dependency

        self._tok = _Tok.from_str(json_body) if json_body is not None else _Tok.from_file(path)
        self.vocab_size = vocab_size
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens or {})

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return [self.bos_id, *ids] if add_bos and self.bos_id is not None else list(ids)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def token_text(self, token_id: int) -> str:
        return self._tok.decode([int(token_id)], skip_special_tokens=False)

    def stream(self) -> "_PrefixStream":
        return _PrefixStream(self)


class _PrefixStream:
    """Streams by re-decoding the whole output and emitting the new suffix."""

    def __init__(self, tok: HFTokenizer) -> None:
        self._tok, self._ids, self._sent = tok, [], ""

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        text = self._tok.decode(self._ids)
        if text.endswith("\ufffd"):          # an incomplete character: wait for more tokens
            return ""
        delta, self._sent = text[len(self._sent):], text
        return delta

    def flush(self) -> str:
        text = self._tok.decode(self._ids)
        delta, self._sent = text[len(self._sent):], text
        return delta


def read_tokenizer_config(model_dir: str) -> dict:
    """``tokenizer_config.json`` of a checkpoint (``{}`` when absent or unreadable)."""
    path = os.path.join(model_dir, "tokenizer_config.json")
    try:
        if os.path.getsize(path) > _MAX_CONFIG_BYTES:
            return {}
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return {}
    return cfg if isinstance(cfg, dict) else {}


def _token_str(v: object) -> str | None:
    if isinstance(v, str):
        return v
    if isinstance(v, dict) and isinstance(v.get("content"), str):
        return v["content"]
    return None


def gguf_tokenizer(spec: object, vocab_size: int) -> "HFTokenizer":
    """The tokenizer a GGUF file describes (a :class:`GGUFTokenizerSpec`)."""
    try:
        return HFTokenizer("", vocab_size, spec.bos_id if spec.add_bos else None,  # type: ignore[attr-defined]
                           spec.eos_id, spec.chat_template, spec.special_tokens,  # type: ignore[attr-defined]
                           json_body=spec.json)  # type: ignore[attr-defined]
    except ImportError:
        raise ImportError("a GGUF model's tokenizer needs the `tokenizers` package") from None


def load_tokenizer(model_dir: str | None, vocab_size: int, bos_id: int | None = None,
                   eos_id: int | None = None) -> Tokenizer | None:
    """The tokenizer for a model: bytes for presets (``model_dir`` None), the checkpoint's own
    when ``tokenizers`` is installed, else ``None`` (the server then takes ``input_ids`` only)."""
    if model_dir is None:
        return ByteTokenizer()
    path = os.path.join(model_dir, "tokenizer.json")
    if os.path.exists(path):
        cfg = read_tokenizer_config(model_dir)
        template = cfg.get("chat_template")
        specials = {k: s for k in ("bos_token", "eos_token", "pad_token", "unk_token")
                    if (s := _token_str(cfg.get(k))) is not None}
        try:
            return HFTokenizer(path, vocab_size, bos_id, eos_id,
                               template if isinstance(template, str) else None, specials)
        except ImportError:
            return None
    if vocab_size == ByteTokenizer.vocab_size:
        return ByteTokenizer()
    return None
