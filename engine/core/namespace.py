"""Cache namespaces: who may read a prefix (docs/model-and-server.md, "Cache namespaces").

A :class:`Namespace` is a frozen value with one field per request field that selects it (the
adapter path and id, the cache salt, the extra key, hicache's own ``namespace``). Two requests
share cached KV only when every field is equal: ``{"cache_salt": "A"}`` and
``{"lora_path": "A"}`` are different namespaces, and so are ``(salt A, adapter X)`` and
``(salt A)``. The default namespace (no field set) is ``None`` everywhere in the engine.

* :meth:`Namespace.seed` seeds the L3 page-hash chain with a digest of a tagged, length-prefixed
  encoding of the set fields (never a string joined from the values), so no two namespaces share
  an L3 key;
* :meth:`Namespace.text` is a readable, injective rendering for snapshots and ``hicache
  inspect`` (``cache_salt="A" lora_path="X"``; a namespace with only the ``namespace`` field and
  no ``=`` in it is just that string, as snapshots always showed it), :func:`parse_text` reads
  it back;
* :meth:`Namespace.to_wire` / :func:`from_wire` carry it in JSON messages (P/D links).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from typing import Any

FIELDS = ("lora_path", "lora_id", "cache_salt", "extra_key", "namespace")
"""Request fields that form the namespace, in their canonical order."""
MAX_FIELD_CHARS = 1024
"""Longest value of one namespace field (a request with a longer one is refused)."""
_SEED_TAG = b"hicache-namespace-v2\x00"


@dataclasses.dataclass(frozen=True)
class Namespace:
    """The fields a request named its cache namespace with; ``None``: not given.

    ``namespace`` is hicache's own field (and what a plain string given to the engine API
    means)."""

    lora_path: str | None = None
    lora_id: str | None = None
    cache_salt: str | None = None
    extra_key: str | None = None
    namespace: str | None = None

    def __post_init__(self) -> None:
        for f in FIELDS:
            v = getattr(self, f)
            if v is None:
                continue
            if not isinstance(v, str) or not v:
                raise ValueError(f"namespace field {f!r} must be a non-empty string or None")
            if len(v) > MAX_FIELD_CHARS:
                raise ValueError(f"namespace field {f!r} is longer than {MAX_FIELD_CHARS} "
                                 "characters")

    def items(self) -> list[tuple[str, str]]:
        """The set fields, in canonical order."""
        return [(f, getattr(self, f)) for f in FIELDS if getattr(self, f) is not None]

    def seed(self) -> bytes:
        """32 bytes seeding the L3 chain: SHA-256 over a tag, then for every set field its
        name and its UTF-8 value, each length-prefixed (1-byte name length, 4-byte little-endian
        value length)."""
        h = hashlib.sha256(_SEED_TAG)
        for name, value in self.items():
            raw = value.encode("utf-8")
            h.update(bytes([len(name)]) + name.encode("ascii") + len(raw).to_bytes(4, "little"))
            h.update(raw)
        return h.digest()

    def text(self) -> str:
        """Readable and injective: ``field="json string" ...``, or the bare ``namespace`` value
        when it is the only field and holds no ``=``."""
        items = self.items()
        if len(items) == 1 and items[0][0] == "namespace" and "=" not in items[0][1]:
            return items[0][1]
        return " ".join(f"{k}={json.dumps(v, ensure_ascii=False)}" for k, v in items)

    def to_wire(self) -> dict[str, str]:
        return dict(self.items())

    def __str__(self) -> str:
        return self.text()


def as_namespace(value: Any) -> Namespace | None:
    """Normalise what callers pass as a namespace: ``None``/``""`` → the default (``None``), a
    string → ``Namespace(namespace=value)``, a :class:`Namespace` with no field → ``None``."""
    if value is None or value == "":
        return None
    if isinstance(value, Namespace):
        return value if value.items() else None
    if isinstance(value, str):
        return Namespace(namespace=value)
    raise TypeError(f"a namespace is a Namespace, a string or None, not {type(value).__name__}")


def from_wire(obj: Any) -> Namespace | None:
    """The namespace of a JSON message (:meth:`Namespace.to_wire`); ValueError if malformed."""
    if obj is None:
        return None
    if not isinstance(obj, dict) or not set(obj) <= set(FIELDS):
        raise ValueError(f"a namespace on the wire is an object with fields among {FIELDS}")
    return as_namespace(Namespace(**obj))


_PAIR = re.compile(r'\s*([a-z_]+)=("(?:[^"\\]|\\.)*")')


def parse_text(text: str | None) -> Namespace | None:
    """Read :meth:`Namespace.text` back (``None``/``""``: the default namespace); ValueError
    names what is wrong."""
    if text is None or text == "":
        return None
    if "=" not in text:
        return Namespace(namespace=text)
    fields: dict[str, str] = {}
    pos = 0
    while pos < len(text):
        m = _PAIR.match(text, pos)
        if m is None:
            raise ValueError(f"bad namespace {text!r}: write field=\"value\" pairs separated by "
                             f"spaces, fields among {', '.join(FIELDS)}")
        key = m.group(1)
        if key not in FIELDS or key in fields:
            raise ValueError(f"bad namespace {text!r}: field {key!r} is unknown or repeated "
                             f"(fields: {', '.join(FIELDS)})")
        fields[key] = json.loads(m.group(2))
        pos = m.end()
    return as_namespace(Namespace(**fields))


def text_of(value: Any) -> str | None:
    """The snapshot / display form of a namespace (``None`` for the default one)."""
    ns = as_namespace(value)
    return None if ns is None else ns.text()
