"""KV events for routers (``bench serve --kv-events-config JSON``; docs/kv-events.md).

SGLang's publisher, on hicache's cache: a ZMQ PUB socket sends ``[topic, seq, payload]``
messages whose payload is a batch of ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``
events (:mod:`formats.kv_events`), one medium per tier (L1 ``GPU``, L2 ``CPU_PINNED``, L3
``DISK`` for the file store, ``EXTERNAL`` for a shared one); an optional ROUTER socket replays
buffered batches from a sequence number.

How the events are made: the cache's event log (:mod:`engine.cache.events`) tells a listener
that the tree changed; a ticker thread then runs :meth:`BlockTracker.sync` on the scheduler
thread between steps (where the tree is quiescent, as for a snapshot). ``sync`` lists the
blocks (pages) each tier holds and publishes the difference from the last list: removals,
then stores as parent-linked chains. A block stored and removed between two syncs is never
published; the subscriber's view after each batch is the tree's state at a step boundary.
A flush publishes ``AllBlocksCleared`` and then what is left (L3, when only L1 and L2 were
flushed). The cost of a sync is one walk of the tree's nodes (hashes are cached per node).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import re
import threading
import time
from typing import Any, Iterator

from engine.core.hashing import namespace_seed, page_hashes
from engine.core.namespace import as_namespace
from formats import kv_events as wire

log = logging.getLogger("hicache.kv_events")

DEFAULT_ENDPOINT = "tcp://127.0.0.1:5557"
PUBLISHERS = ("zmq", "null")
KEYS = ("publisher", "endpoint", "replay_endpoint", "buffer_steps", "hwm", "max_queue_size",
        "topic", "bind", "format")
TICK_S = 0.02
"""How often the ticker looks for a changed tree (a sync runs only after a change); after a
sync it waits at least four times as long as the sync took."""
_TCP = re.compile(r"^tcp://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.\-*]+):(\d{1,5})$")


@dataclasses.dataclass(frozen=True)
class KVEventsConfig:
    publisher: str = "zmq"
    endpoint: str = DEFAULT_ENDPOINT
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""


def _endpoint(value: Any, key: str) -> str:
    """A ``tcp://HOST:PORT`` to bind (``*`` for every interface only when written); an
    endpoint without a host (``tcp://:5557``) binds 127.0.0.1."""
    if not isinstance(value, str):
        raise ValueError(f"{key} must be a string such as {DEFAULT_ENDPOINT}")
    if value.startswith("tcp://:"):
        value = "tcp://127.0.0.1:" + value[len("tcp://:"):]
    m = _TCP.match(value)
    if m is None or not 1 <= int(m.group(2)) <= 65535:
        raise ValueError(f"{key} {value!r}: give tcp://HOST:PORT with a port in 1..65535")
    return value


def parse_config(text: str) -> KVEventsConfig:
    """The ``--kv-events-config`` JSON, checked; ``ValueError`` names what is wrong (one line)."""
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"not JSON ({str(exc).splitlines()[0][:80]})") from None
    if not isinstance(obj, dict):
        raise ValueError("must be a JSON object such as {\"publisher\": \"zmq\"}")
    unknown = sorted(set(obj) - set(KEYS))
    if unknown:
        raise ValueError(f"unknown key {unknown[0]!r} (keys: {', '.join(KEYS)})")
    pub = obj.get("publisher", "null")
    if pub not in PUBLISHERS:
        raise ValueError(f"unknown publisher {pub!r} (zmq or null)")
    if obj.get("format", "default") != "default":
        raise ValueError(f"format {obj['format']!r}: only \"default\" (SGLang's) is published")
    if obj.get("bind", True) is not True:
        raise ValueError("bind: the publisher always binds its endpoint (true or leave it out)")
    kw: dict[str, Any] = {"publisher": pub,
                          "endpoint": _endpoint(obj.get("endpoint", DEFAULT_ENDPOINT),
                                                "endpoint")}
    if obj.get("replay_endpoint") is not None:
        kw["replay_endpoint"] = _endpoint(obj["replay_endpoint"], "replay_endpoint")
        if kw["replay_endpoint"].rsplit(":", 1)[1] == kw["endpoint"].rsplit(":", 1)[1]:
            raise ValueError("replay_endpoint must use another port than endpoint")
    for key, hi in (("buffer_steps", 10_000_000), ("hwm", 10_000_000),
                    ("max_queue_size", 10_000_000)):
        if key in obj:
            v = obj[key]
            if type(v) is not int or not 1 <= v <= hi:
                raise ValueError(f"{key} must be an integer in 1..{hi}, got {v!r}")
            kw[key] = v
    if "topic" in obj:
        if not isinstance(obj["topic"], str) or len(obj["topic"].encode()) > 1024:
            raise ValueError("topic must be a string of at most 1024 bytes")
        kw["topic"] = obj["topic"]
    return KVEventsConfig(**kw)


def _host_port(endpoint: str) -> tuple[str, int]:
    host, port = endpoint[len("tcp://"):].rsplit(":", 1)
    return host, int(port)


# ------------------------------------------------------------------------------ publisher
class ZmqPublisher:
    """The sockets and the publishing thread. Binding happens in the constructor, so a port in
    use fails before the server starts (``OSError``)."""

    def __init__(self, cfg: KVEventsConfig):
        import zmq

        self.cfg = cfg
        self._zmq = zmq
        self._ctx = zmq.Context()
        self._pub = self._replay = None
        try:
            self._pub = self._ctx.socket(zmq.PUB)
            self._pub.set_hwm(cfg.hwm)
            self._pub.setsockopt(zmq.LINGER, 0)
            self._bind(self._pub, cfg.endpoint)
            if cfg.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._bind(self._replay, cfg.replay_endpoint)
        except BaseException:
            self._close_sockets()
            raise
        self._topic = cfg.topic.encode("utf-8")
        self._queue: collections.deque = collections.deque()
        self._buffer: collections.deque = collections.deque(maxlen=cfg.buffer_steps)
        self._cv = threading.Condition()
        self._closing = False
        self.seq = 0
        self.dropped = 0            # batches dropped from a full queue (the oldest first)
        self.published = 0
        self.replays = 0
        self._thread = threading.Thread(target=self._run, name="hicache-kv-events",
                                        daemon=True)
        self._thread.start()

    def _bind(self, sock: Any, endpoint: str) -> None:
        try:
            sock.bind(endpoint)
        except self._zmq.ZMQError as exc:
            raise OSError(exc.errno, f"cannot bind {endpoint}: {exc.strerror}") from None

    def put(self, payload: bytes) -> None:
        with self._cv:
            if self._closing:
                return
            if len(self._queue) >= self.cfg.max_queue_size:
                self._queue.popleft()
                self.dropped += 1
            self._queue.append(payload)
            self._cv.notify()

    def _run(self) -> None:
        zmq = self._zmq
        poller = zmq.Poller()
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        while True:
            with self._cv:
                if not self._queue and not self._closing:
                    self._cv.wait(0.05 if self._replay is not None else 0.5)
                batch = list(self._queue)
                self._queue.clear()
                closing = self._closing
            for payload in batch:
                seq_b = self.seq.to_bytes(8, "big")
                try:
                    self._pub.send_multipart((self._topic, seq_b, payload), copy=False)
                except zmq.ZMQError as exc:       # never fatal: the subscriber replays
                    log.warning("kv events: publish failed: %s", exc)
                self._buffer.append((self.seq, payload))
                self.seq += 1
                self.published += 1
            if self._replay is not None:
                while poller.poll(0):
                    self._serve_replay()
            if closing and not batch:
                return

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.info("kv events: malformed replay request (%d frames) ignored", len(frames))
            return
        client, _, start_b = frames
        start = int.from_bytes(start_b, "big")
        self.replays += 1
        for seq, payload in list(self._buffer):
            if seq >= start:
                self._replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"),
                                             payload))
        self._replay.send_multipart((client, b"", b"", wire.END_SEQ, b""))

    def close(self, timeout: float = 2.0) -> None:
        with self._cv:
            self._closing = True
            self._cv.notify()
        self._thread.join(timeout)
        self._close_sockets()

    def _close_sockets(self) -> None:
        for s in (self._pub, self._replay):
            if s is not None:
                s.close(linger=0)
        self._ctx.term()


# ------------------------------------------------------------------------------ tracker
def medium_of_l3(backend: str | None) -> str:
    return wire.DISK if backend == "file" else wire.EXTERNAL


class _Entry:
    """What was last published of one node: its blocks and the tiers holding them."""

    __slots__ = ("hashes", "pages", "parent", "tiers", "salt", "lora")

    def __init__(self, hashes: list[int], pages: list[tuple], parent: int | None,
                 tiers: tuple, salt: str | None, lora: str | None):
        self.hashes, self.pages, self.parent = hashes, pages, parent
        self.tiers, self.salt, self.lora = tiers, salt, lora

    def blocks(self, medium: str, l3_medium: str) -> range:
        """Indices of the blocks ``medium`` holds (L3: a prefix of the edge)."""
        l1, l2, l3 = self.tiers
        n = len(self.hashes)
        if medium == wire.GPU:
            return range(n if l1 else 0)
        if medium == wire.CPU_PINNED:
            return range(n if l2 else 0)
        return range(min(l3, n) if medium == l3_medium else 0)


class BlockTracker:
    """The blocks each tier of a cache's tree holds, and the events between two syncs.

    A sync walks the nodes; a node whose pages and tiers are what was last published costs a
    comparison. The pages of changed nodes (new, split, moved between tiers, gone) are compared
    block by block, per medium: a split moves blocks between nodes and publishes nothing."""

    def __init__(self, tree: Any, l3_medium: str):
        self.tree = tree
        self.l3_medium = l3_medium
        self.media = (wire.GPU, wire.CPU_PINNED, l3_medium)
        self.page_size = tree.page_size
        self._hashes: dict[int, tuple[bytes | None, int, list[bytes], list[int]]] = {}
        self._published: dict[int, _Entry] = {}      # node id -> entry
        self.cleared = False        # a flush since the last sync

    def _node_hashes(self, node: Any, prev: bytes | None) -> tuple[list[bytes], list[int]]:
        n = len(node.tokens) // self.page_size
        hit = self._hashes.get(node.id)
        if hit is not None and hit[0] == prev and hit[1] == n:
            return hit[2], hit[3]
        seed = prev if prev is not None else namespace_seed(node.namespace)
        digests = page_hashes(node.tokens, self.page_size, seed)
        ints = [wire.block_hash_of(d) for d in digests]
        self._hashes[node.id] = (prev, n, digests, ints)
        return digests, ints

    def _walk(self) -> Iterator[tuple[Any, list[bytes], list[int], int | None, Any]]:
        for root in list(self.tree.roots.values()):
            ns = as_namespace(root.namespace)
            stack = [(child, None, None) for child in root.children.values()]
            while stack:
                node, prev_digest, parent = stack.pop()
                digests, ints = self._node_hashes(node, prev_digest)
                yield node, digests, ints, parent, ns
                last = digests[-1] if digests else prev_digest
                last_h = ints[-1] if ints else parent
                stack.extend((c, last, last_h) for c in node.children.values())

    def blocks(self) -> dict[str, dict[int, tuple]]:
        """``{medium: {hash: (parent, tokens, cache_salt, lora_name)}}`` of what was last
        published (for tests and tools)."""
        out: dict[str, dict[int, tuple]] = {m: {} for m in self.media}
        for e in self._published.values():
            for m in self.media:
                for i in e.blocks(m, self.l3_medium):
                    out[m][e.hashes[i]] = (e.parent if i == 0 else e.hashes[i - 1],
                                           e.pages[i], e.salt, e.lora)
        return out

    def sync(self) -> list[dict]:
        """The events from the last sync to now (on the scheduler thread)."""
        p = self.page_size
        events: list[dict] = []
        old_pub = self._published
        if self.cleared:
            self.cleared = False
            events.append(wire.all_cleared())
            old_pub = {}
        new_pub: dict[int, _Entry] = {}
        changed_old: list[_Entry] = []
        changed_new: list[_Entry] = []
        for node, _digests, ints, parent, ns in self._walk():
            tiers = (node.l1 is not None, node.l2 is not None, int(node.l3 or 0))
            e = old_pub.get(node.id)
            if e is not None and e.hashes is ints and e.tiers == tiers and e.parent == parent:
                new_pub[node.id] = e
                continue
            toks = node.tokens.tolist()
            pages = [tuple(toks[i * p:(i + 1) * p]) for i in range(len(ints))]
            ne = _Entry(ints, pages, parent, tiers, ns.cache_salt if ns else None,
                        ns.lora_path if ns else None)
            new_pub[node.id] = ne
            changed_new.append(ne)
            if e is not None:
                changed_old.append(e)
        changed_old.extend(e for nid, e in old_pub.items() if nid not in new_pub)
        for m in self.media:
            had = {e.hashes[i] for e in changed_old for i in e.blocks(m, self.l3_medium)}
            has = {e.hashes[i] for e in changed_new for i in e.blocks(m, self.l3_medium)}
            gone = [h for h in had if h not in has]
            if gone:
                events.append(wire.block_removed(gone, m))
        for m in self.media:
            had = {e.hashes[i] for e in changed_old for i in e.blocks(m, self.l3_medium)}
            chain: dict | None = None
            for e in changed_new:
                for i in e.blocks(m, self.l3_medium):
                    h = e.hashes[i]
                    if h in had:
                        continue
                    parent = e.parent if i == 0 else e.hashes[i - 1]
                    if chain is not None and chain["block_hashes"][-1] == parent and \
                            chain.get("cache_salt") == e.salt and \
                            chain.get("lora_name") == e.lora:
                        chain["block_hashes"].append(h)
                        chain["token_ids"].extend(e.pages[i])
                        continue
                    chain = wire.block_stored([h], parent, list(e.pages[i]), p, m,
                                              cache_salt=e.salt, lora_name=e.lora)
                    events.append(chain)
        self._published = new_pub
        if len(self._hashes) > 2 * max(len(new_pub), 1024):   # forget nodes gone from the tree
            self._hashes = {k: v for k, v in self._hashes.items() if k in new_pub}
        return events


# ------------------------------------------------------------------------------ service
class KVEventsService:
    """A server's publisher: config, sockets, tracker and ticker (one per server, rank 0)."""

    def __init__(self, cfg: KVEventsConfig):
        self.cfg = cfg
        self.publisher = ZmqPublisher(cfg) if cfg.publisher == "zmq" else None
        self.tracker: BlockTracker | None = None
        self.engine: Any = None
        self._dirty = threading.Event()
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None
        self.syncs = 0
        self.failed_syncs = 0

    def attach(self, engine: Any, l3_backend: str | None) -> None:
        """Start publishing ``engine``'s cache (call once the server is up)."""
        self.engine = engine
        engine.kv_events = self
        if self.publisher is None:
            return
        self.tracker = BlockTracker(engine.cache.tree, medium_of_l3(l3_backend))
        log_ = engine.cache.events
        if not log_.enabled:              # a log that keeps nothing still calls its listeners
            log_.keep, log_.enabled = False, True
        log_.subscribe(self._on_event)
        self._dirty.set()                 # publish what is already there
        self._ticker = threading.Thread(target=self._tick, name="hicache-kv-events-tick",
                                        daemon=True)
        self._ticker.start()

    def _on_event(self, ev: dict) -> None:
        if ev["kind"] == "flush" and self.tracker is not None:
            self.tracker.cleared = True
        self._dirty.set()

    def _tick(self) -> None:
        while not self._stop.is_set():
            if not self._dirty.wait(0.2):
                continue
            self._dirty.clear()
            t0 = time.monotonic()
            try:
                self.engine.scheduler.call(self.sync_now).result(timeout=30)
            except Exception as exc:  # noqa: BLE001 - a stopped scheduler; logged, retried
                self.failed_syncs += 1
                log.debug("kv events: sync did not run: %s", exc)
                if self._stop.wait(0.2):
                    return
                self._dirty.set()
            # at most a fifth of the scheduler thread's time goes to syncs (a large tree)
            self._stop.wait(max(TICK_S, 4 * (time.monotonic() - t0)))

    def sync_now(self) -> None:
        """Publish the tree's changes now (the scheduler thread, or a stopped scheduler)."""
        if self.tracker is None or self.publisher is None:
            return
        events = self.tracker.sync()
        self.syncs += 1
        if events:
            self.publisher.put(wire.encode_batch(events))

    def close(self) -> None:
        """At shutdown: a last sync (the scheduler has stopped), then the sockets (once)."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join(5)
        if self.tracker is not None:
            try:
                self.sync_now()
            except Exception as exc:  # noqa: BLE001 - shutdown goes on
                log.warning("kv events: last sync failed: %s", exc)
        if self.publisher is not None:
            self.publisher.close()

    def describe(self, page_size: int) -> dict | None:
        """``/server_info``'s ``kv_events`` (SGLang's ``describe_kv_events_publisher``)."""
        if self.publisher is None:
            return None
        host, port = _host_port(self.cfg.endpoint)
        d: dict[str, Any] = {"publisher": self.cfg.publisher, "endpoint_host": host,
                             "endpoint_port_base": port, "topic": self.cfg.topic,
                             "block_size": page_size, "dp_size": 1}
        if self.cfg.replay_endpoint is not None:
            d["replay_endpoint_port_base"] = _host_port(self.cfg.replay_endpoint)[1]
        return d

    def metrics_text(self) -> str:
        p = self.publisher
        if p is None:
            return ""
        rows = [("hicache_kv_events_published_total", "counter",
                 "KV event batches published", p.published),
                ("hicache_kv_events_dropped_total", "counter",
                 "KV event batches dropped from a full queue (oldest first)", p.dropped),
                ("hicache_kv_events_replays_total", "counter",
                 "replay requests served", p.replays),
                ("hicache_kv_events_syncs_total", "counter",
                 "tree syncs that looked for changed blocks", self.syncs)]
        return "".join(f"# HELP {n} {h}\n# TYPE {n} {t}\n{n} {v}\n" for n, t, h, v in rows)



# ------------------------------------------------------------------------------ recording
@dataclasses.dataclass
class RecordResult:
    batches: int = 0
    first_seq: int | None = None
    last_seq: int | None = None
    stopped_by: str = "stop"
    size: int = 0


def record(endpoint: str, out: str, *, topic: str = "", replay: str | None = None,
           duration: float | None = None, count: int | None = None,
           max_bytes: int = 1 << 30, stop: threading.Event | None = None) -> RecordResult:
    """Subscribe to ``endpoint`` and write what arrives to ``out`` (``hicache bench
    record-events``): with ``replay``, first every batch the server still buffers (from
    sequence 0), then live ones (a sequence already written is skipped). Stops after
    ``duration`` seconds, ``count`` batches, before passing ``max_bytes``, or at ``stop``.
    ``ValueError``: an endpoint zmq refuses, or a replay socket that does not answer."""
    import zmq

    from formats.outpath import atomic_output

    stop = stop or threading.Event()
    res = RecordResult()
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.MAXMSGSIZE, wire.MAX_PAYLOAD_BYTES + 8192)
    try:
        try:
            sub.connect(endpoint)
            sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        except zmq.ZMQError as exc:
            raise ValueError(f"{endpoint}: {exc.strerror}") from None
        t0 = time.monotonic()
        with atomic_output(out) as f:
            wire.write_header(f, {"endpoint": endpoint, "topic": topic,
                                  "started_at": time.time()})

            def keep(frames: list) -> bool:
                if len(frames) != 3 or len(frames[1]) != 8:
                    return True                   # not a KV-event message: skipped
                seq = int.from_bytes(frames[1], "big")
                if res.last_seq is not None and seq <= res.last_seq:
                    return True                   # already written (replayed, then live)
                grow = len(frames[0]) + len(frames[2]) + 64
                if res.size + grow > max_bytes:
                    res.stopped_by = "size limit"
                    return False
                wire.write_frame(f, frames[0], seq, frames[2])
                res.size += grow
                res.batches += 1
                res.first_seq = seq if res.first_seq is None else res.first_seq
                res.last_seq = seq
                if count is not None and res.batches >= count:
                    res.stopped_by = "count"
                    return False
                return True

            going = True if replay is None else _replay_into(ctx, replay, keep)
            while going and not stop.is_set():
                if duration is not None and time.monotonic() - t0 >= duration:
                    res.stopped_by = "duration"
                    break
                if sub.poll(100):
                    going = keep(sub.recv_multipart())
    finally:
        sub.close(0)
        ctx.term()
    return res


def _replay_into(ctx: Any, endpoint: str, keep: Any) -> bool:
    import zmq

    req = ctx.socket(zmq.DEALER)
    req.setsockopt(zmq.LINGER, 0)
    try:
        try:
            req.connect(endpoint)
        except zmq.ZMQError as exc:
            raise ValueError(f"{endpoint}: {exc.strerror}") from None
        req.send_multipart([b"", (0).to_bytes(8, "big")])
        while True:
            if not req.poll(10_000):
                raise ValueError(f"replay endpoint {endpoint}: no answer in 10 s")
            frames = req.recv_multipart()
            if len(frames) != 4:
                continue
            _, topic, seq, payload = frames
            if seq == wire.END_SEQ:
                return True
            if not keep([topic, seq, payload]):
                return False
    finally:
        req.close(0)
