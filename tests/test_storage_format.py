"""The stored-object format, object keys and the storage config: pure functions, no backend."""

from __future__ import annotations

import json
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.core.errors import InputError
from engine.core.layout import KVLayout
from engine.storage import (
    BackendKind,
    StorageConfig,
    check_key,
    coordinate,
    make_backend,
    model_id,
    object_key,
    parse_size,
)
from formats.kvobject import (
    ALIGN,
    MAX_LAYOUT_BYTES,
    CorruptKVObject,
    KVLayoutMismatch,
    KVObjectCodec,
    parse_header,
)

LAYOUT = KVLayout(num_layers=4, kv_heads=2, head_dim=64, page_size=64)
H1, H2 = bytes(range(32)), bytes(range(1, 33))
CODEC = KVObjectCodec(LAYOUT.to_dict())
PAYLOAD = bytes(range(256)) * 16


def test_header_is_aligned_and_self_describing():
    obj = CODEC.encode(H1, PAYLOAD)
    assert CODEC.header_len % ALIGN == 0 and len(obj) == CODEC.object_size(len(PAYLOAD))
    h = parse_header(obj)
    assert obj[:4] == b"HCKV" and h.version == 1
    assert KVLayout.from_dict(h.layout) == LAYOUT
    assert (h.payload_len, h.page_hash) == (len(PAYLOAD), H1)
    assert bytes(CODEC.decode(obj, H1, len(PAYLOAD))) == PAYLOAD


@pytest.mark.parametrize("mutate, error, match", [
    (lambda b: b"XXXX" + b[4:], CorruptKVObject, "bad magic"),
    (lambda b: b[:20], CorruptKVObject, "truncated"),
    (lambda b: b[:100], CorruptKVObject, "truncated"),
    (lambda b: b[:-1], CorruptKVObject, "payload is"),
    (lambda b: b[:-1] + bytes([b[-1] ^ 1]), CorruptKVObject, "payload checksum"),
    (lambda b: b[:70] + bytes([b[70] ^ 1]) + b[71:], CorruptKVObject, "header checksum"),
    (lambda b: b[:4] + struct.pack("<H", 2) + b[6:], KVLayoutMismatch, "format version 2"),
    (lambda b: b[:6] + struct.pack("<H", MAX_LAYOUT_BYTES + 1) + b[8:], CorruptKVObject,
     "exceeds"),
])
def test_damage_is_detected(mutate, error, match):
    with pytest.raises(error, match=match):
        CODEC.decode(mutate(CODEC.encode(H1, PAYLOAD)), H1, len(PAYLOAD))


def test_parse_header_needs_a_whole_prefix():
    with pytest.raises(CorruptKVObject, match="too short"):
        parse_header(CODEC.encode(H1, PAYLOAD)[:20])


def test_wrong_page_or_layout_is_refused():
    obj = CODEC.encode(H1, PAYLOAD)
    with pytest.raises(CorruptKVObject, match="expected"):
        CODEC.decode(obj, H2, len(PAYLOAD))
    other = KVObjectCodec(KVLayout(num_layers=4, kv_heads=2, head_dim=64, page_size=64,
                                   dtype="float16").to_dict())
    with pytest.raises(KVLayoutMismatch, match="float16"):
        other.decode(obj, H1, len(PAYLOAD))


def test_verify_checks_header_and_payload_in_separate_buffers():
    obj = CODEC.encode(H1, PAYLOAD)
    head, payload = obj[:CODEC.header_len], obj[CODEC.header_len:]
    assert CODEC.verify(head, payload, H1) is None
    with pytest.raises(CorruptKVObject, match="payload checksum"):
        CODEC.verify(head, payload[:-1] + b"\0", H1)
    with pytest.raises(CorruptKVObject, match="header checksum"):
        CODEC.verify(head[:40] + b"\0" + head[41:], payload, H1)
    with pytest.raises(CorruptKVObject, match="expected"):
        CODEC.verify(head, payload, H2)
    with pytest.raises(CorruptKVObject, match="payload length"):
        CODEC.verify(head, payload[:-4], H1)
    half = KVObjectCodec(KVLayout(num_layers=4, kv_heads=2, head_dim=64, page_size=64,
                                  dtype="float16").to_dict())
    with pytest.raises(KVLayoutMismatch):
        half.verify(head, payload, H1)


def test_a_header_that_is_not_json_is_corrupt_not_a_crash():
    lj = CODEC.layout_json
    bad = KVObjectCodec.__new__(KVObjectCodec)
    bad.__dict__.update(CODEC.__dict__, layout_json=b"{" + lj[1:-1] + b"X")
    with pytest.raises(CorruptKVObject, match="not JSON"):
        parse_header(bad.encode(H1, PAYLOAD))


@settings(max_examples=200, deadline=None)
@given(pos=st.integers(0, CODEC.header_len + len(PAYLOAD) - 1), bit=st.integers(0, 7))
def test_every_single_bit_flip_is_caught(pos, bit):
    obj = bytearray(CODEC.encode(H1, PAYLOAD))
    obj[pos] ^= 1 << bit
    with pytest.raises((CorruptKVObject, KVLayoutMismatch)):
        CODEC.decode(bytes(obj), H1, len(PAYLOAD))


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=600))
def test_arbitrary_bytes_never_parse_as_an_object(data):
    with pytest.raises((CorruptKVObject, KVLayoutMismatch)):
        CODEC.decode(data, H1, len(PAYLOAD))


# -- keys -------------------------------------------------------------------------------------
def test_keys_name_page_model_and_coordinate_without_ranks():
    k = object_key(H1, coordinate(LAYOUT))
    assert k == f"{H1.hex()}.{model_id(LAYOUT)}.l0-4.h0-2"
    assert check_key(k) == k
    shard = KVLayout(num_layers=2, kv_heads=1, head_dim=64, page_size=64, layer_start=2,
                     head_start=1, total_layers=4, total_kv_heads=2)
    assert coordinate(shard) == f"{model_id(LAYOUT)}.l2-4.h1-2"   # same model, other range


@pytest.mark.parametrize("change", [dict(dtype="float16"), dict(head_dim=32),
                                    dict(page_size=32), dict(kv_kinds=1),
                                    dict(byte_order="big"), dict(total_layers=8)])
def test_different_models_get_different_ids(change):
    assert model_id(KVLayout(**{**LAYOUT.to_dict(), **change})) != model_id(LAYOUT)


def test_model_tag_separates_models_of_equal_shape():
    assert model_id(LAYOUT, "llama-3-8b") != model_id(LAYOUT, "qwen-2-7b")


# -- config -----------------------------------------------------------------------------------
@pytest.mark.parametrize("text, n", [(1024, 1024), ("512mb", 512 << 20), ("1.5GiB", 3 << 29),
                                     ("64 KiB", 64 << 10), ("0", 0)])
def test_sizes(text, n):
    assert parse_size(text) == n


@pytest.mark.parametrize("bad", ["-1", "1pb", "lots", True, -5])
def test_bad_sizes(bad):
    with pytest.raises(ValueError):
        parse_size(bad)


def test_config_from_nested_json(tmp_path):
    p = tmp_path / "l3.json"
    p.write_text(json.dumps({"backend": "file", "file": {"dir": str(tmp_path / "s"),
                                                         "size_limit": "1mb"}}))
    cfg = StorageConfig.from_json_file(p)
    assert cfg.backend is BackendKind.FILE and cfg.file.size_limit_bytes == 1 << 20
    b = make_backend(cfg)
    assert b.health()["dir"] == str(tmp_path / "s")
    b.close()


def test_mooncake_config_in_mooncakes_own_format(tmp_path):
    p = tmp_path / "mooncake.json"
    p.write_text(json.dumps({"local_hostname": "10.0.0.2",
                             "metadata_server": "http://10.0.0.1:8080/metadata",
                             "master_server_address": "10.0.0.1:50051",
                             "global_segment_size": "4gb", "local_buffer_size": 1 << 30,
                             "protocol": "tcp", "device_name": ""}))
    cfg = StorageConfig.from_json_file(p)
    assert cfg.backend is BackendKind.MOONCAKE
    assert cfg.mooncake.global_segment_size == 4 << 30
    assert cfg.mooncake.master_server_address == "10.0.0.1:50051"


def test_flags_override_the_file(tmp_path):
    p = tmp_path / "l3.json"
    p.write_text(json.dumps({"backend": "memory", "file": {"size_limit": "2mb"}}))
    cfg = StorageConfig.from_options(backend="file", dir="/x", config_file=str(p))
    assert (cfg.backend, cfg.file.dir, cfg.file.size_limit_bytes) == (BackendKind.FILE, "/x",
                                                                      2 << 20)


@pytest.mark.parametrize("doc, match", [
    ({"backend": "s3"}, "unknown storage backend"),
    ({"backend": "file", "file": {"dirr": "/x"}}, "unknown key 'dirr'"),
    ({"backend": "file", "extra": 1}, "unknown keys"),
    ({"backend": "file", "file": {"size_limit": "huge"}}, "not a size"),
    ({"master_server_address": "nohostport"}, "host:port"),
    ([1, 2], "expected a JSON object"),
])
def test_bad_config_is_an_input_error(tmp_path, doc, match):
    p = tmp_path / "c.json"
    p.write_text(json.dumps(doc))
    with pytest.raises(InputError, match=match):
        StorageConfig.from_json_file(p)


def test_config_file_size_and_syntax_are_checked(tmp_path):
    big = tmp_path / "big.json"
    big.write_bytes(b" " * ((1 << 20) + 1))
    with pytest.raises(InputError, match="larger than"):
        StorageConfig.from_json_file(big)
    bad = tmp_path / "bad.json"
    bad.write_text("{nope")
    with pytest.raises(InputError, match="not JSON"):
        StorageConfig.from_json_file(bad)
    with pytest.raises(InputError, match="cannot read"):
        StorageConfig.from_json_file(tmp_path / "missing.json")
