"""KV events on the wire (SGLang 0.5.23's ``kv_events`` encoding) and recorded to a file.

A published message is three ZMQ frames ``[topic, seq, payload]``: ``seq`` is the batch's
sequence number as 8 bytes big-endian, ``payload`` one msgpack-encoded batch. A batch is an
array ``[ts, events, attn_dp_rank]`` (``ts``: float seconds). An event is a msgpack *map* whose
first key ``type`` names its kind, then its fields in this order, a field whose default is null
left out when it is null (msgspec's ``tag=True, omit_defaults=True`` encoding):

* ``BlockStored``: ``block_hashes`` (int64 list), ``parent_block_hash`` (int64 or null, always
  present), ``token_ids`` (``block_size`` ids per block, concatenated), ``block_size``,
  ``lora_id`` (always present, null here), then when set ``medium``, ``cache_salt``,
  ``session_id``, ``lora_name``;
* ``BlockRemoved``: ``block_hashes``, then ``medium`` when set;
* ``AllBlocksCleared``: no field.

:class:`BlockState` applies events and holds the blocks they imply per medium (what a router's
index holds); a recording (``hicache bench record-events``) is a header and the received frames,
read back with size limits (docs/kv-events.md).
"""

from __future__ import annotations

import dataclasses
import os
import struct
import time
from typing import IO, Any, Iterator

import msgpack

from formats.errors import FormatError

GPU, CPU_PINNED, DISK, EXTERNAL = "GPU", "CPU_PINNED", "DISK", "EXTERNAL"
MEDIA = (GPU, CPU_PINNED, DISK, EXTERNAL)
"""SGLang's ``StorageMedium`` values: L1 device, L2 host, L3 disk (file store), L3 external
(a shared store such as Mooncake)."""

STORED, REMOVED, CLEARED = "BlockStored", "BlockRemoved", "AllBlocksCleared"
END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The replay socket's last frame: sequence -1 (empty topic and payload)."""

MAX_PAYLOAD_BYTES = 64 << 20
MAX_BLOCKS = 10_000_000
"""Blocks one :class:`BlockState` holds at most (all media together)."""
INT64 = (-(1 << 63), 1 << 63)


def block_hash_of(digest: bytes) -> int:
    """The published id of a page: the first 8 bytes of its chained SHA-256, as a signed
    big-endian int64 (what SGLang's ``hash_str_to_int64`` makes of the hex digest)."""
    return int.from_bytes(digest[:8], "big", signed=True)


# ------------------------------------------------------------------------------ events
def block_stored(block_hashes: list[int], parent: int | None, token_ids: list[int],
                 block_size: int, medium: str | None, *, cache_salt: str | None = None,
                 lora_name: str | None = None, session_id: str | None = None) -> dict:
    ev: dict[str, Any] = {"type": STORED, "block_hashes": block_hashes,
                          "parent_block_hash": parent, "token_ids": token_ids,
                          "block_size": block_size, "lora_id": None}
    for key, value in (("medium", medium), ("cache_salt", cache_salt),
                       ("session_id", session_id), ("lora_name", lora_name)):
        if value is not None:
            ev[key] = value
    return ev


def block_removed(block_hashes: list[int], medium: str | None) -> dict:
    ev: dict[str, Any] = {"type": REMOVED, "block_hashes": block_hashes}
    if medium is not None:
        ev["medium"] = medium
    return ev


def all_cleared() -> dict:
    return {"type": CLEARED}


def encode_batch(events: list[dict], ts: float | None = None, dp_rank: int = 0) -> bytes:
    return msgpack.packb([float(time.time() if ts is None else ts), events, dp_rank],
                         use_bin_type=True)


class EventsError(FormatError):
    """A batch or recording that does not decode; the message is one line."""


def _unpack(payload: bytes) -> Any:
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise EventsError(f"batch of {len(payload)} bytes (limit {MAX_PAYLOAD_BYTES})")
    try:
        return msgpack.unpackb(payload, raw=False, strict_map_key=True, max_ext_len=0,
                               max_bin_len=0)
    except Exception as exc:  # noqa: BLE001 - msgpack raises several kinds
        raise EventsError(f"batch is not msgpack ({type(exc).__name__})") from None


def _ints(v: Any, what: str) -> list[int]:
    if not isinstance(v, list) or not all(type(x) is int and INT64[0] <= x < INT64[1] for x in v):
        raise EventsError(f"{what} must be a list of int64")
    return v


def _opt_str(ev: dict, key: str) -> str | None:
    v = ev.get(key)
    if v is not None and not isinstance(v, str):
        raise EventsError(f"{ev.get('type')}.{key} must be a string or null")
    return v


def decode_batch(payload: bytes) -> tuple[float, list[dict], int | None]:
    """``(ts, events, attn_dp_rank)`` of one payload, checked field by field."""
    obj = _unpack(payload)
    if not isinstance(obj, list) or not 2 <= len(obj) <= 3:
        raise EventsError("a batch is an array [ts, events, attn_dp_rank]")
    ts, events = obj[0], obj[1]
    rank = obj[2] if len(obj) == 3 else None
    if type(ts) not in (int, float) or not isinstance(events, list) or \
            (rank is not None and type(rank) is not int):
        raise EventsError("a batch is an array [ts (float), events (array), attn_dp_rank]")
    for ev in events:
        if not isinstance(ev, dict) or ev.get("type") not in (STORED, REMOVED, CLEARED):
            raise EventsError("an event is a map whose type is BlockStored, BlockRemoved or "
                              "AllBlocksCleared")
        if ev["type"] == STORED:
            hashes = _ints(ev.get("block_hashes"), "BlockStored.block_hashes")
            toks = _ints(ev.get("token_ids"), "BlockStored.token_ids")
            bs = ev.get("block_size")
            parent = ev.get("parent_block_hash")
            if type(bs) is not int or bs < 1 or len(toks) != bs * len(hashes):
                raise EventsError("BlockStored: token_ids must hold block_size ids per block")
            if parent is not None and type(parent) is not int:
                raise EventsError("BlockStored.parent_block_hash must be an int64 or null")
            for key in ("medium", "cache_salt", "lora_name", "session_id"):
                _opt_str(ev, key)
        elif ev["type"] == REMOVED:
            _ints(ev.get("block_hashes"), "BlockRemoved.block_hashes")
            _opt_str(ev, "medium")
    return float(ts), events, rank


# ------------------------------------------------------------------------------ state
@dataclasses.dataclass(frozen=True)
class Block:
    parent: int | None
    tokens: tuple[int, ...]
    cache_salt: str | None = None
    lora_name: str | None = None


class BlockState:
    """The blocks a stream of events implies, per medium: ``blocks[medium][hash] = Block``."""

    def __init__(self, max_blocks: int = MAX_BLOCKS):
        self.blocks: dict[str, dict[int, Block]] = {}
        self.max_blocks = max_blocks
        self.count = 0
        self.batches = 0
        self.events = 0

    def apply(self, events: list[dict]) -> None:
        self.batches += 1
        for ev in events:
            self.events += 1
            kind = ev["type"]
            if kind == CLEARED:
                self.blocks.clear()
                self.count = 0
            elif kind == REMOVED:
                tier = self.blocks.get(ev.get("medium") or GPU, {})
                for h in ev["block_hashes"]:
                    if tier.pop(h, None) is not None:
                        self.count -= 1
            else:
                tier = self.blocks.setdefault(ev.get("medium") or GPU, {})
                bs, toks = ev["block_size"], ev["token_ids"]
                parent = ev["parent_block_hash"]
                for i, h in enumerate(ev["block_hashes"]):
                    if h not in tier:
                        self.count += 1
                        if self.count > self.max_blocks:
                            raise EventsError(f"more than {self.max_blocks} blocks")
                    tier[h] = Block(parent, tuple(toks[i * bs:(i + 1) * bs]),
                                    ev.get("cache_salt"), ev.get("lora_name"))
                    parent = h


# ------------------------------------------------------------------------------ recordings
MAGIC = b"HCKVEV1\n"
FORMAT_NAME = "hicache-kv-events"
VERSION = 1
MAX_HEADER_BYTES = 64 << 10
MAX_TOPIC_BYTES = 4096
MAX_FRAMES = 10_000_000
_LEN = struct.Struct(">I")


def is_recording(path: str | os.PathLike) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(len(MAGIC)) == MAGIC
    except OSError:
        return False


def write_header(f: IO[bytes], header: dict) -> None:
    body = msgpack.packb({"format": FORMAT_NAME, "version": VERSION, **header},
                         use_bin_type=True)
    f.write(MAGIC + _LEN.pack(len(body)) + body)


def write_frame(f: IO[bytes], topic: bytes, seq: int, payload: bytes,
                received: float | None = None) -> None:
    """One received message: ``u32 length`` + msgpack ``[topic, seq, received_at, payload]``."""
    body = msgpack.packb([topic, seq, float(time.time() if received is None else received),
                          payload], use_bin_type=True)
    f.write(_LEN.pack(len(body)) + body)


@dataclasses.dataclass
class Frame:
    topic: bytes
    seq: int
    received: float
    payload: bytes


def _read_exact(f: IO[bytes], n: int, name: str, what: str) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise EventsError(f"{name}: truncated {what} ({len(data)} of {n} bytes)")
    return data


def read_recording(path: str | os.PathLike, max_frames: int = MAX_FRAMES
                   ) -> tuple[dict, Iterator[Frame]]:
    """The header and an iterator over the frames of a recording (``EventsError`` on a
    corrupt or truncated file, naming it)."""
    name = os.fspath(path)
    f = open(name, "rb")
    try:
        if f.read(len(MAGIC)) != MAGIC:
            raise EventsError(f"{name}: not a KV-event recording (bad magic)")
        (n,) = _LEN.unpack(_read_exact(f, 4, name, "header length"))
        if n > MAX_HEADER_BYTES:
            raise EventsError(f"{name}: header of {n} bytes (limit {MAX_HEADER_BYTES})")
        try:
            header = msgpack.unpackb(_read_exact(f, n, name, "header"), raw=False,
                                     strict_map_key=True, max_bin_len=0, max_ext_len=0)
        except EventsError:
            raise
        except Exception:  # noqa: BLE001
            raise EventsError(f"{name}: header is not msgpack") from None
        if not isinstance(header, dict) or header.get("format") != FORMAT_NAME or \
                header.get("version") != VERSION:
            raise EventsError(f"{name}: header does not name {FORMAT_NAME} version {VERSION}")
    except BaseException:
        f.close()
        raise

    def frames() -> Iterator[Frame]:
        with f:
            k = 0
            while True:
                head = f.read(4)
                if not head:
                    return
                if len(head) != 4:
                    raise EventsError(f"{name}: truncated frame {k} (length)")
                (m,) = _LEN.unpack(head)
                if m > MAX_PAYLOAD_BYTES + MAX_TOPIC_BYTES + 64:
                    raise EventsError(f"{name}: frame {k} of {m} bytes (limit "
                                      f"{MAX_PAYLOAD_BYTES})")
                body = _read_exact(f, m, name, f"frame {k}")
                try:
                    obj = msgpack.unpackb(body, raw=False, max_ext_len=0,
                                          max_bin_len=MAX_PAYLOAD_BYTES)
                except Exception:  # noqa: BLE001
                    raise EventsError(f"{name}: frame {k} is not msgpack") from None
                if not (isinstance(obj, list) and len(obj) == 4 and isinstance(obj[0], bytes)
                        and type(obj[1]) is int and type(obj[2]) in (int, float)
                        and isinstance(obj[3], bytes)):
                    raise EventsError(f"{name}: frame {k} is not [topic, seq, time, payload]")
                k += 1
                if k > max_frames:
                    raise EventsError(f"{name}: more than {max_frames} frames")
                yield Frame(obj[0], obj[1], float(obj[2]), obj[3])

    return header, frames()


def state_of_recording(path: str | os.PathLike, max_blocks: int = MAX_BLOCKS
                       ) -> tuple[dict, BlockState]:
    """Apply every batch of a recording; ``EventsError`` names the file and the frame."""
    header, frames = read_recording(path)
    state = BlockState(max_blocks)
    for k, fr in enumerate(frames):
        try:
            _, events, _ = decode_batch(fr.payload)
            state.apply(events)
        except EventsError as exc:
            raise EventsError(f"{os.fspath(path)}: frame {k} (seq {fr.seq}): {exc}") from None
    return header, state
