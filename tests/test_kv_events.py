"""KV events (``bench serve --kv-events-config``): a real ZMQ subscriber decodes every batch
with msgspec structs declared here in SGLang 0.5.23's field order (an independent decoder),
rebuilds the blocks each medium holds, and compares them with a snapshot of the tree taken at
the same moment (hashes computed here from the snapshot's tokens and namespaces)."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Optional, Union

import msgspec
import pytest
import requests
import zmq
from typer.testing import CliRunner

from engine.core.namespace import parse_text
from engine.snapshot.take import load_snapshot
from hicache_cli.app import app
from tests.serve_client import ROOT, SCRIPT, generate, prompt, spawn


# -- SGLang's structs, as an independent decoder ----------------------------------------------
class Batch(msgspec.Struct, array_like=True):
    ts: float
    events: list
    attn_dp_rank: Optional[int] = None


class Event(msgspec.Struct, tag=True, omit_defaults=True):
    pass


class BlockStored(Event):
    block_hashes: list[int]
    parent_block_hash: Optional[int]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str] = None
    cache_salt: Optional[str] = None
    session_id: Optional[str] = None
    lora_name: Optional[str] = None


class BlockRemoved(Event):
    block_hashes: list[int]
    medium: Optional[str] = None


class AllBlocksCleared(Event):
    pass


class KVBatch(Batch):
    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]


DECODER = msgspec.msgpack.Decoder(KVBatch)


class Index:
    """What a router keeps: per medium, hash -> (parent, tokens, cache_salt)."""

    def __init__(self):
        self.media: dict[str, dict[int, tuple]] = {}
        self.seqs: list[int] = []
        self.stored: list[BlockStored] = []

    def apply(self, seq: int, payload: bytes) -> None:
        self.seqs.append(seq)
        for ev in DECODER.decode(payload).events:
            if isinstance(ev, AllBlocksCleared):
                self.media.clear()
            elif isinstance(ev, BlockRemoved):
                tier = self.media[ev.medium]
                for h in ev.block_hashes:
                    del tier[h]                      # a removal of an unknown block fails
            else:
                self.stored.append(ev)
                assert ev.lora_id is None and ev.block_size == 16
                assert len(ev.token_ids) == 16 * len(ev.block_hashes)
                tier = self.media.setdefault(ev.medium, {})
                parent = ev.parent_block_hash
                for i, h in enumerate(ev.block_hashes):
                    assert h not in tier, "a block stored twice in one medium"
                    tier[h] = (parent, tuple(ev.token_ids[16 * i:16 * (i + 1)]), ev.cache_salt)
                    parent = h


def expected_blocks(path, l3_medium: str) -> dict[str, dict[int, tuple]]:
    """The blocks a snapshot file shows per tier, hashed here: SHA-256 chained over uint32
    little-endian tokens, seeded by the namespace, the first 8 bytes as a signed int64."""
    snap = load_snapshot(path)
    out: dict[str, dict[int, tuple]] = {"GPU": {}, "CPU_PINNED": {}, l3_medium: {}}
    for ns_text, root in snap.tree.roots.items():
        ns = parse_text(ns_text) if isinstance(ns_text, str) else ns_text
        seed = ns.seed() if ns is not None else None
        salt = ns.cache_salt if ns is not None else None
        stack = [(c, seed, None) for c in root.children.values()]
        while stack:
            node, prev, parent = stack.pop()
            toks = [int(t) for t in node.tokens]
            for i in range(len(toks) // 16):
                page = toks[16 * i:16 * (i + 1)]
                h = hashlib.sha256((prev or b"") + b"".join(t.to_bytes(4, "little")
                                                            for t in page))
                prev = h.digest()
                block = int.from_bytes(prev[:8], "big", signed=True)
                rec = (parent, tuple(page), salt)
                if node.l1 is not None:
                    out["GPU"][block] = rec
                if node.l2 is not None:
                    out["CPU_PINNED"][block] = rec
                if i < node.l3:
                    out[l3_medium][block] = rec
                parent = block
            stack.extend((c, prev, parent) for c in node.children.values())
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def drain(sub, index: Index, quiet_s: float = 0.8) -> None:
    last = time.monotonic()
    while time.monotonic() - last < quiet_s:
        if sub.poll(50):
            _topic, seq, payload = sub.recv_multipart()
            index.apply(int.from_bytes(seq, "big"), payload)
            last = time.monotonic()


def snapshot(url: str, path) -> None:
    r = requests.post(url + "/dump_tree", timeout=30)
    assert r.status_code == 200
    path.write_bytes(r.content)


def replay(endpoint: str, start: int, ctx) -> list[tuple[int, bytes]]:
    req = ctx.socket(zmq.DEALER)
    req.connect(endpoint)
    req.send_multipart([b"", start.to_bytes(8, "big")])
    out = []
    while True:
        assert req.poll(10_000), "the replay socket did not answer"
        _empty, _topic, seq, payload = req.recv_multipart()
        seq_i = int.from_bytes(seq, "big", signed=True)
        if seq_i == -1:
            break
        out.append((seq_i, payload))
    req.close(0)
    return out


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """One server for the module (a start costs seconds on 2 cores)."""
    tmp_path = tmp_path_factory.mktemp("kv-events")
    port, rport = free_port(), free_port()
    cfg = {"publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{port}",
           "replay_endpoint": f"tcp://127.0.0.1:{rport}", "topic": "kv"}
    proc, url = spawn("--kv-events-config", json.dumps(cfg), "--hicache-storage-backend",
                      "file", "--hicache-storage-dir", str(tmp_path / "store"))
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.connect(cfg["endpoint"])
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    try:
        yield proc, url, sub, cfg, ctx, Index()       # one index: a router's, all along
    finally:
        sub.close(0)
        proc.send_signal(signal.SIGINT)
        _out, err = proc.communicate(timeout=60)
        ctx.term()
        assert proc.returncode == 0 and "Traceback" not in err, err


def test_events_rebuild_the_snapshot_tree_per_medium(served, tmp_path):
    proc, url, sub, cfg, ctx, index = served
    info = requests.get(url + "/server_info", timeout=10).json()["kv_events"]
    assert info["publisher"] == "zmq" and info["endpoint_host"] == "127.0.0.1"
    assert info["endpoint_port_base"] == int(cfg["endpoint"].rsplit(":", 1)[1])
    assert info["block_size"] == 16 and info["topic"] == "kv" and info["dp_size"] == 1
    assert info["replay_endpoint_port_base"] == int(cfg["replay_endpoint"].rsplit(":", 1)[1])
    time.sleep(0.3)                                    # the subscription reaches the PUB
    checked = 0
    for k, ids in enumerate(SCRIPT):                  # inserts, L1 -> L2 evictions, L3 backups
        generate(url, ids)
        if k in (1, len(SCRIPT) - 1):
            for _ in range(5):                         # a moment where nothing moves
                drain(sub, index)
                snapshot(url, tmp_path / "a.snapshot")
                drain(sub, index)
                snapshot(url, tmp_path / "b.snapshot")
                want = expected_blocks(tmp_path / "a.snapshot", "DISK")
                if want == expected_blocks(tmp_path / "b.snapshot", "DISK"):
                    break
            got = {m: index.media.get(m, {}) for m in want}
            for medium in want:
                assert got[medium] == want[medium], medium
            checked += 1
    assert checked == 2
    media = {m for m, blocks in index.media.items() if blocks}
    assert media == {"GPU", "CPU_PINNED", "DISK"}, media     # every tier was exercised
    assert any(ev.medium == "GPU" for ev in index.stored)
    assert index.seqs == list(range(len(index.seqs)))        # no batch lost, in order

    # the replay socket sends the same batches again, from a sequence number on
    again = replay(cfg["replay_endpoint"], 2, ctx)
    assert [s for s, _ in again] == index.seqs[2:]
    metrics = requests.get(url + "/metrics", timeout=10).text
    assert "hicache_kv_events_dropped_total 0" in metrics
    assert f"hicache_kv_events_published_total {len(index.seqs)}" in metrics

    # record-events (replay from 0, then live) -> inspect shows the snapshot's tiers
    rec = tmp_path / "events.kvev"
    done = subprocess.run(
        [sys.executable, "-m", "hicache_cli.app", "bench", "record-events", "--endpoint",
         cfg["endpoint"], "--replay-endpoint", cfg["replay_endpoint"], "--topic", "kv",
         "--out", str(rec), "--duration", "0.5", "--format", "json"],
        cwd=ROOT, capture_output=True, text=True, timeout=60, env=dict(os.environ, PYTHONPATH=ROOT))
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["batches"] == len(index.seqs)
    views = []
    for f in (rec, tmp_path / "b.snapshot"):
        res = CliRunner().invoke(app, ["inspect", str(f), "--format", "json"])
        assert res.exit_code == 0, res.output
        views.append(json.loads(res.output)["summary"])
    assert views[0]["tiers"] == {t: {**v, "capacity": None, "used": None}
                                 for t, v in views[1]["tiers"].items()}
    assert views[0]["pages"] == views[1]["pages"] and views[0]["namespaces"] == 1
    human = CliRunner().invoke(app, ["inspect", str(rec)])
    assert human.exit_code == 0 and "L1" in human.output


def test_inspect_refuses_a_corrupt_or_truncated_recording(tmp_path):
    from formats import kv_events as kv

    good = tmp_path / "good.kvev"
    with open(good, "wb") as f:
        kv.write_header(f, {"endpoint": "tcp://127.0.0.1:1"})
        ev = kv.block_stored([5, 6], None, list(range(32)), 16, "GPU")
        kv.write_frame(f, b"", 0, kv.encode_batch([ev]))
    res = CliRunner().invoke(app, ["inspect", str(good), "--format", "json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["summary"]["tiers"]["L1"]["tokens"] == 32
    data = good.read_bytes()
    cases = {"truncated": data[:-5], "magic": b"XX" + data[2:],
             "payload": data[:-40] + b"\xc1" * 40,
             "huge": data[:len(data) - len(data) + 8] + (1 << 30).to_bytes(4, "big")}
    for name, body in cases.items():
        bad = tmp_path / f"{name}.kvev"
        bad.write_bytes(body)
        res = CliRunner().invoke(app, ["inspect", str(bad)])
        assert res.exit_code == 1, (name, res.output)
        assert "Traceback" not in res.output and len(res.output.strip().splitlines()) == 1, \
            (name, res.output)


def test_namespaces_never_share_block_hashes(served):
    proc, url, sub, cfg, _ctx, index = served
    drain(sub, index, 0.3)
    mark = len(index.stored)
    ids = prompt(64, 7)
    for salt in (None, "A", "B"):
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
        if salt is not None:
            body["cache_salt"] = salt
        assert requests.post(url + "/generate", json=body, timeout=60).status_code == 200
    drain(sub, index)
    by_salt: dict = {}
    for ev in index.stored[mark:]:
        if ev.medium == "GPU":
            by_salt.setdefault(ev.cache_salt, set()).update(ev.block_hashes)
            assert ev.token_ids[:16] == ids[:16] or ev.parent_block_hash is not None
    assert set(by_salt) == {None, "A", "B"}
    assert all(len(v) == 4 for v in by_salt.values()), by_salt      # 64 tokens, 4 pages
    assert not (by_salt[None] & by_salt["A"]) and not (by_salt["A"] & by_salt["B"]) \
        and not (by_salt[None] & by_salt["B"])
    # the roots' blocks (same tokens) have no parent: only the namespace tells them apart
    roots = [ev for ev in index.stored[mark:] if ev.medium == "GPU"
             and ev.parent_block_hash is None]
    assert len({ev.block_hashes[0] for ev in roots}) == 3


@pytest.mark.parametrize("config,msg", [
    ("{not json", "not JSON"),
    ('{"publisher": "kafka"}', "unknown publisher"),
    ('{"publisher": "zmq", "endpoint": "ipc:///tmp/x"}', "tcp://HOST:PORT"),
    ('{"publisher": "zmq", "endpoint": "tcp://127.0.0.1:70000"}', "tcp://HOST:PORT"),
    ('{"publisher": "zmq", "hwm": 0}', "hwm"),
    ('{"publisher": "zmq", "colour": 1}', "unknown key"),
    ('[1]', "JSON object"),
])
def test_malformed_config_is_one_line_exit_2(config, msg):
    res = CliRunner().invoke(app, ["bench", "serve", "--port", "0", "--kv-events-config",
                                   config])
    assert res.exit_code == 2, res.output
    assert msg in res.output and "Traceback" not in res.output


def test_port_in_use_is_one_line_exit_2():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        res = CliRunner().invoke(app, ["bench", "serve", "--port", "0", "--kv-events-config",
                                       json.dumps({"publisher": "zmq",
                                                   "endpoint": f"tcp://127.0.0.1:{port}"})])
    assert res.exit_code == 2, res.output
    assert "cannot bind" in res.output and "Traceback" not in res.output


def test_flush_sends_all_blocks_cleared(served, tmp_path):
    """``/flush_cache`` drops L1 and L2 and the tree's nodes with them (L3's objects stay in
    the store, but the tree no longer names them): AllBlocksCleared, and nothing stored."""
    proc, url, sub, cfg, _ctx, index = served
    drain(sub, index, 0.3)
    assert index.media.get("DISK"), "the earlier tests backed pages up to L3"
    mark = len(index.seqs)
    assert requests.post(url + "/flush_cache", timeout=30).status_code == 200
    drain(sub, index)
    batches = replay(cfg["replay_endpoint"], mark, _ctx)
    first = DECODER.decode(batches[0][1]).events
    assert isinstance(first[0], AllBlocksCleared)
    snapshot(url, tmp_path / "flushed.snapshot")
    want = expected_blocks(tmp_path / "flushed.snapshot", "DISK")
    assert want == {"GPU": {}, "CPU_PINNED": {}, "DISK": {}}
    assert all(not blocks for blocks in index.media.values())
    assert all(not isinstance(ev, BlockStored) for _, b in batches
               for ev in DECODER.decode(b).events)


def test_inspect_survives_a_parent_cycle(tmp_path):
    from formats import kv_events as kv

    rec = tmp_path / "cycle.kvev"
    with open(rec, "wb") as f:
        kv.write_header(f, {})
        events = [kv.block_stored([7], 7, list(range(16)), 16, "GPU"),      # its own parent
                  kv.block_stored([8], 9, list(range(16)), 16, "GPU"),
                  kv.block_stored([9], 8, list(range(16)), 16, "GPU"),
                  kv.block_stored([1, 2], None, list(range(32)), 16, "GPU")]
        kv.write_frame(f, b"", 0, kv.encode_batch(events))
    res = CliRunner().invoke(app, ["inspect", str(rec), "--format", "json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["summary"]["tiers"]["L1"]["tokens"] == 32
