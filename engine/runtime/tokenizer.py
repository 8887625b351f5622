"""Tokenizers: byte-level (UTF-8 bytes + special tokens) for the presets, so text prompts work
offline; a checkpoint's own ``tokenizer.json`` when the optional ``tokenizers`` package exists.
"""

from __future__ import annotations

import codecs
import os
from typing import Protocol, Sequence


class Tokenizer(Protocol):
    vocab_size: int
    bos_id: int | None
    eos_id: int | None

    def encode(self, text: str, add_bos: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

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

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.bos_id, *ids] if add_bos else ids

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def is_special(self, token_id: int) -> bool:
        return token_id >= 256

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
    """A checkpoint's ``tokenizer.json`` through the optional ``tokenizers`` package."""

    def __init__(self, path: str, vocab_size: int, bos_id: int | None, eos_id: int | None):
        from tokenizers import Tokenizer as _Tok  # optional dependency

        self._tok = _Tok.from_file(path)
        self.vocab_size = vocab_size
        self.bos_id = bos_id
        self.eos_id = eos_id

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return [self.bos_id, *ids] if add_bos and self.bos_id is not None else list(ids)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

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


def load_tokenizer(model_dir: str | None, vocab_size: int, bos_id: int | None = None,
                   eos_id: int | None = None) -> Tokenizer | None:
    """The tokenizer for a model: bytes for presets (``model_dir`` None), the checkpoint's own
    when ``tokenizers`` is installed, else ``None`` (the server then takes ``input_ids`` only)."""
    if model_dir is None:
        return ByteTokenizer()
    path = os.path.join(model_dir, "tokenizer.json")
    if os.path.exists(path):
        try:
            return HFTokenizer(path, vocab_size, bos_id, eos_id)
        except ImportError:
            return None
    if vocab_size == ByteTokenizer.vocab_size:
        return ByteTokenizer()
    return None
