"""KV events decoded by SGLang's own structs (not part of ``make test``).

Two steps, two interpreters:

1. With an interpreter that has SGLang installed, against a running ``hicache bench serve
   --kv-events-config '{"publisher": "zmq", "endpoint": "tcp://127.0.0.1:P"}'``:

     PEER_PYTHON benchmarks/peer_kv_events.py record URL OUT_DIR

   reads ``/server_info``'s ``kv_events``, subscribes, sends a few prompts (inserts, L1 → L2
   evictions with a small L1), decodes every batch with
   ``msgspec.msgpack.Decoder(sglang.srt.disaggregation.kv_events.KVEventBatch)``, rebuilds the
   blocks per medium, then saves ``POST /dump_tree`` as OUT_DIR/tree.snapshot and the index as
   OUT_DIR/index.json.

2. With hicache's interpreter:

     python benchmarks/peer_kv_events.py compare OUT_DIR

   hashes the snapshot's pages (chained SHA-256 seeded by the namespace, first 8 bytes as a
   signed int64) and compares block by block. Prints one JSON line; exit 1 on a difference.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import sys
import time
import urllib.request


def _post(url: str, body: dict | None) -> bytes:
    req = urllib.request.Request(url, data=json.dumps(body or {}).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=120) as r:
        return r.read()


def record(url: str, out_dir: str) -> None:
    import msgspec
    import zmq
    from sglang.srt.disaggregation.kv_events import AllBlocksCleared, BlockRemoved, KVEventBatch

    with urllib.request.urlopen(url + "/server_info", timeout=30) as r:
        desc = json.loads(r.read())["kv_events"]
    endpoint = f"tcp://{desc['endpoint_host']}:{desc['endpoint_port_base']}"
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.connect(endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, desc["topic"].encode())
    time.sleep(0.3)
    dec = msgspec.msgpack.Decoder(KVEventBatch)
    media: dict[str, dict[int, list]] = {}
    kinds: dict[str, int] = {}
    batches = 0

    def drain(quiet: float = 1.0) -> None:
        nonlocal batches
        last = time.monotonic()
        while time.monotonic() - last < quiet:
            if not sub.poll(50):
                continue
            _topic, _seq, payload = sub.recv_multipart()
            batch = dec.decode(payload)               # SGLang's structs, strictly typed
            batches += 1
            last = time.monotonic()
            for ev in batch.events:
                kinds[type(ev).__name__] = kinds.get(type(ev).__name__, 0) + 1
                if isinstance(ev, AllBlocksCleared):
                    media.clear()
                elif isinstance(ev, BlockRemoved):
                    for h in ev.block_hashes:
                        del media[ev.medium][h]
                else:
                    tier = media.setdefault(ev.medium, {})
                    parent, bs = ev.parent_block_hash, ev.block_size
                    for i, h in enumerate(ev.block_hashes):
                        tier[h] = [parent, ev.token_ids[i * bs:(i + 1) * bs], ev.cache_salt]
                        parent = h

    rng = random.Random(0)
    shared = [rng.randrange(256) for _ in range(96)]
    for k in range(8):
        ids = (shared if k % 3 == 0 else []) + [rng.randrange(256) for _ in range(90)]
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
        if k == 5:
            body["cache_salt"] = "tenant-b"
        _post(url + "/generate", body)
    drain()
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "tree.snapshot"), "wb") as f:
        f.write(_post(url + "/dump_tree", None))
    drain(0.5)
    with open(os.path.join(out_dir, "index.json"), "w") as f:
        json.dump({"media": {m: {str(h): v for h, v in t.items()} for m, t in media.items()},
                   "batches": batches, "kinds": kinds, "block_size": desc["block_size"]}, f)
    print(json.dumps({"batches": batches, "kinds": kinds,
                      "blocks": {m: len(t) for m, t in media.items()}}))


def compare(out_dir: str) -> int:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from engine.core.namespace import parse_text
    from engine.snapshot.take import load_snapshot

    with open(os.path.join(out_dir, "index.json")) as f:
        got = json.load(f)
    snap = load_snapshot(os.path.join(out_dir, "tree.snapshot"))
    p = snap.page_size
    want: dict[str, dict[str, list]] = {"GPU": {}, "CPU_PINNED": {}}
    for ns_text, root in snap.tree.roots.items():
        ns = parse_text(ns_text) if isinstance(ns_text, str) else ns_text
        stack = [(c, ns.seed() if ns else None, None) for c in root.children.values()]
        while stack:
            node, prev, parent = stack.pop()
            toks = [int(t) for t in node.tokens]
            for i in range(len(toks) // p):
                page = toks[i * p:(i + 1) * p]
                prev = hashlib.sha256((prev or b"") + b"".join(
                    t.to_bytes(4, "little") for t in page)).digest()
                h = int.from_bytes(prev[:8], "big", signed=True)
                rec = [parent, page, ns.cache_salt if ns else None]
                for medium, on in (("GPU", node.l1 is not None),
                                   ("CPU_PINNED", node.l2 is not None)):
                    if on:
                        want[medium][str(h)] = rec
                parent = h
            stack.extend((c, prev, parent) for c in node.children.values())
    same = {m: got["media"].get(m, {}) == want[m] for m in want}
    print(json.dumps({"same": same, "blocks": {m: len(want[m]) for m in want},
                      "batches": got["batches"], "kinds": got["kinds"]}))
    return 0 if all(same.values()) else 1


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "record":
        record(sys.argv[2].rstrip("/"), sys.argv[3])
    elif len(sys.argv) == 3 and sys.argv[1] == "compare":
        sys.exit(compare(sys.argv[2]))
    else:
        sys.exit(__doc__)
