"""The self-describing encoding of one stored KV object (an L3 page object).

An object is a header followed by the payload (the raw KV bytes of one page for one layer range ×
kv-head range). Every field needed to check the bytes before anyone interprets them is in the
header; nothing is ever unpickled or evaluated.

Header (little-endian), padded with zeros to a multiple of :data:`ALIGN` bytes so the payload that
follows stays aligned for any dtype::

    0   4   magic  b"HCKV"
    4   2   format version (1)
    6   2   layout_len: bytes of the layout JSON (<= MAX_LAYOUT_BYTES)
    8   8   payload_len
    16  8   payload checksum: XXH3-64 of the payload
    24  32  page hash the object belongs to (SHA-256 chain digest)
    56  n   layout JSON (UTF-8, sorted keys, no spaces): model dims, dtype, page size, layer range,
            kv-head range, byte order — ``KVLayout.to_dict()``
    ..      zero padding
    -8  8   header checksum: XXH3-64 of every header byte before it

This module imports nothing from ``engine/``: layouts travel as plain dicts.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from typing import Any

import xxhash

from formats.errors import FormatError

MAGIC = b"HCKV"
VERSION = 1
ALIGN = 64
MAX_LAYOUT_BYTES = 4096
"""Parsing never reads a layout description longer than this."""

_PREFIX = struct.Struct("<4sHHQQ32s")
_U64 = struct.Struct("<Q")
_TAIL = struct.Struct("<QQ32s")      # payload_len, payload checksum, page hash: per object
_TAIL_AT = 8
_CHECKSUM = xxhash.xxh3_64_intdigest
_LAYOUT_CACHE = 4096


class KVObjectError(FormatError):
    """A stored object cannot be used (``name``: its key or file, when the caller knows it)."""

    def __init__(self, problem: str, name: str = "KV object", where: str | None = None):
        self.path, self.where, self.problem = name, where, problem
        # Exception.__init__ directly: the message is complete whatever FormatError's own
        # constructor takes.
        Exception.__init__(self, f"{name}: {where}: {problem}" if where else f"{name}: {problem}")


class CorruptKVObject(KVObjectError):
    """Bad magic, truncated, failed checksum, or a header that does not parse."""


class KVLayoutMismatch(KVObjectError):
    """A sound object whose layout (or format version) is not the one the reader expects."""


def canonical_layout_json(layout: dict[str, Any]) -> bytes:
    """The one byte string a layout dict encodes to (sorted keys, compact)."""
    return json.dumps(layout, sort_keys=True, separators=(",", ":")).encode("utf-8")


def checksum(data) -> int:
    """XXH3-64 of a bytes-like object (bytes, memoryview, numpy array)."""
    return _CHECKSUM(data)


def checksum_parts(parts) -> int:
    """:func:`checksum` of the concatenation of ``parts`` (bytes-like), without joining them."""
    if len(parts) == 1:
        return _CHECKSUM(parts[0])
    h = xxhash.xxh3_64()
    for p in parts:
        h.update(p)
    return h.intdigest()


def header_len_for(layout_json_len: int) -> int:
    raw = _PREFIX.size + layout_json_len + _U64.size
    return -(-raw // ALIGN) * ALIGN


@dataclasses.dataclass(frozen=True)
class KVObjectHeader:
    version: int
    layout: dict[str, Any]
    layout_json: bytes
    payload_len: int
    payload_checksum: int
    page_hash: bytes
    header_len: int


def parse_header(buf, *, max_payload: int | None = None,
                 layouts: dict[bytes, dict[str, Any]] | None = None) -> KVObjectHeader:
    """Parse and check the header at the start of ``buf`` (any bytes-like object).

    ``layouts``: layout JSON already parsed (bytes -> dict, filled in here; the dicts are shared,
    never to be modified): a caller reading many objects of a few layouts parses each once.

    Raises :class:`CorruptKVObject` for anything malformed and :class:`KVLayoutMismatch` for an
    unknown format version. The payload itself is not checked here (see :func:`verify_payload`).
    """
    mv = memoryview(buf).cast("B")
    if len(mv) < _PREFIX.size:
        raise CorruptKVObject(f"object too short for a header ({len(mv)} bytes)")
    magic, version, layout_len, payload_len, payload_sum, page_hash = _PREFIX.unpack_from(mv, 0)
    if magic != MAGIC:
        raise CorruptKVObject(f"bad magic {bytes(magic)!r}", where="byte 0")
    if version != VERSION:
        raise KVLayoutMismatch(f"object format version {version}, this reader knows {VERSION}")
    if layout_len > MAX_LAYOUT_BYTES:
        raise CorruptKVObject(f"layout description of {layout_len} bytes exceeds "
                              f"{MAX_LAYOUT_BYTES}")
    hlen = header_len_for(layout_len)
    if len(mv) < hlen:
        raise CorruptKVObject(f"object truncated inside its header ({len(mv)} < {hlen} bytes)")
    (hsum,) = _U64.unpack_from(mv, hlen - _U64.size)
    if _CHECKSUM(mv[:hlen - _U64.size]) != hsum:
        raise CorruptKVObject("header checksum mismatch", where=f"byte {hlen - _U64.size}")
    if max_payload is not None and payload_len > max_payload:
        raise CorruptKVObject(f"payload of {payload_len} bytes exceeds the limit {max_payload}")
    layout_json = bytes(mv[_PREFIX.size:_PREFIX.size + layout_len])
    layout = layouts.get(layout_json) if layouts is not None else None
    if layout is None:
        try:
            layout = json.loads(layout_json)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CorruptKVObject(f"layout description is not JSON: {e}") from None
        if not isinstance(layout, dict):
            raise CorruptKVObject("layout description is not a JSON object")
        if layouts is not None and len(layouts) < _LAYOUT_CACHE:
            layouts[layout_json] = layout
    return KVObjectHeader(version, layout, layout_json, payload_len, payload_sum,
                          bytes(page_hash), hlen)


def verify_payload(header: KVObjectHeader, payload) -> None:
    """Check the payload's length and checksum against its header."""
    mv = memoryview(payload).cast("B")
    if len(mv) != header.payload_len:
        raise CorruptKVObject(f"payload is {len(mv)} bytes, header says {header.payload_len}")
    if _CHECKSUM(mv) != header.payload_checksum:
        raise CorruptKVObject("payload checksum mismatch")


class KVObjectCodec:
    """Encoder/checker for the objects of one layout (header size is fixed per layout).

    ``encode_header`` builds the header for one payload; ``check`` validates a header read back
    against the expected layout and page hash — the fast path compares the layout bytes, and only
    a difference is parsed (to tell a foreign layout from corruption).
    """

    def __init__(self, layout: dict[str, Any]):
        self.layout = dict(layout)
        self.layout_json = canonical_layout_json(self.layout)
        if len(self.layout_json) > MAX_LAYOUT_BYTES:
            raise ValueError(f"layout description too long ({len(self.layout_json)} bytes)")
        self.header_len = header_len_for(len(self.layout_json))
        self._template_of: bytes | None = None
        self._template = b""

    def object_size(self, payload_len: int) -> int:
        return self.header_len + payload_len

    def encode_header(self, page_hash: bytes, payload) -> bytes:
        out = bytearray(self.header_len)
        self.encode_header_into(out, page_hash, payload)
        return bytes(out)

    def encode_header_into(self, out, page_hash: bytes, payload,
                           payload_checksum: int | None = None) -> None:
        """Write the header for ``payload`` into ``out`` (a writable buffer of exactly
        ``header_len`` bytes, e.g. a row of a registered arena): no allocation per object.
        ``payload_checksum``: :func:`checksum` of ``payload`` when the caller already has it
        (computed when the bytes were written), which saves a pass over the payload."""
        pv = memoryview(payload).cast("B")
        psum = _CHECKSUM(pv) if payload_checksum is None else payload_checksum
        self._fill(out, page_hash, len(pv), psum)

    def header_for(self, page_hash: bytes, payload_len: int, payload_checksum: int) -> bytes:
        """The header of a payload known only by its length and :func:`checksum` (a payload
        that is copied from elsewhere, never assembled in memory)."""
        out = bytearray(self.header_len)
        self._fill(out, page_hash, payload_len, payload_checksum)
        return bytes(out)

    def _fill(self, out, page_hash: bytes, payload_len: int, psum: int) -> None:
        if len(page_hash) != 32:
            raise ValueError(f"page hash must be 32 bytes, got {len(page_hash)}")
        mv = memoryview(out).cast("B")
        if len(mv) != self.header_len:
            raise ValueError(f"header buffer is {len(mv)} bytes, not {self.header_len}")
        end = self.header_len - _U64.size
        if self._template_of is not self.layout_json:
            # Everything but payload length, checksums and page hash is the same for every
            # object of this layout: built once, copied per object.
            lj = self.layout_json
            self._template = (_PREFIX.pack(MAGIC, VERSION, len(lj), 0, 0, bytes(32)) + lj
                              + bytes(end - _PREFIX.size - len(lj)))
            self._template_of = lj
        mv[:end] = self._template
        _TAIL.pack_into(mv, _TAIL_AT, payload_len, psum, page_hash)
        _U64.pack_into(mv, end, _CHECKSUM(mv[:end]))

    def encode(self, page_hash: bytes, payload) -> bytes:
        """Header and payload as one bytes object (tests, tools; the hot path writes parts)."""
        return self.encode_header(page_hash, payload) + bytes(memoryview(payload).cast("B"))

    def verify(self, header_buf, payload, page_hash: bytes) -> None:
        """Check a header and its payload (held in separate buffers) against this layout and
        page hash; raises :class:`CorruptKVObject` / :class:`KVLayoutMismatch`. The hot path of
        a read: for a sound object of our layout it allocates nothing and parses no JSON."""
        mv = memoryview(header_buf).cast("B")
        pv = memoryview(payload).cast("B")
        lj, hlen = self.layout_json, self.header_len
        if len(mv) == hlen:
            magic, version, layout_len, plen, psum, phash = _PREFIX.unpack_from(mv, 0)
            if (magic == MAGIC and version == VERSION and layout_len == len(lj)
                    and phash == page_hash and plen == len(pv)
                    and mv[_PREFIX.size:_PREFIX.size + layout_len] == lj
                    and _U64.unpack_from(mv, hlen - _U64.size)[0]
                    == _CHECKSUM(mv[:hlen - _U64.size])
                    and _CHECKSUM(pv) == psum):
                return
        verify_payload(self.check(mv, page_hash, len(pv)), pv)   # raises, saying what is wrong

    def check(self, header_buf, page_hash: bytes, payload_len: int) -> KVObjectHeader:
        """Validate a header against this codec's layout, the expected page hash and size.

        Raises :class:`CorruptKVObject` or :class:`KVLayoutMismatch`. The common case (our own
        layout) compares bytes and never parses JSON; anything else goes through
        :func:`parse_header` to say precisely what is wrong.
        """
        mv = memoryview(header_buf).cast("B")
        lj, hlen = self.layout_json, self.header_len
        if len(mv) >= hlen:
            magic, version, layout_len, plen, psum, phash = _PREFIX.unpack_from(mv, 0)
            if (magic == MAGIC and version == VERSION and layout_len == len(lj)
                    and mv[_PREFIX.size:_PREFIX.size + layout_len] == lj
                    and _U64.unpack_from(mv, hlen - _U64.size)[0]
                    == _CHECKSUM(mv[:hlen - _U64.size])):
                h = KVObjectHeader(version, self.layout, lj, plen, psum, phash, hlen)
                self._check_identity(h, page_hash, payload_len)
                return h
        h = parse_header(mv, max_payload=payload_len)
        if h.layout_json != lj:
            raise KVLayoutMismatch(f"stored layout {h.layout} is not the expected {self.layout}")
        self._check_identity(h, page_hash, payload_len)
        return h

    @staticmethod
    def _check_identity(h: KVObjectHeader, page_hash: bytes, payload_len: int) -> None:
        if h.page_hash != page_hash:
            raise CorruptKVObject(f"object holds page {h.page_hash.hex()[:16]}…, "
                                  f"expected {page_hash.hex()[:16]}…")
        if h.payload_len != payload_len:
            raise CorruptKVObject(f"payload length {h.payload_len} for a layout of "
                                  f"{payload_len} bytes")

    def decode(self, obj, page_hash: bytes, payload_len: int) -> memoryview:
        """Check a whole object held in one buffer; return its payload (a view, no copy)."""
        mv = memoryview(obj).cast("B")
        if len(mv) < self.header_len:
            raise CorruptKVObject(f"object truncated ({len(mv)} bytes)")
        h = self.check(mv[:self.header_len], page_hash, payload_len)
        payload = mv[h.header_len:]
        verify_payload(h, payload)
        return payload
