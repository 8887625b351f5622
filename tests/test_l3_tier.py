"""The facade's L3 tier: write-through to storage, prefetch into L2, load-back, sharing, faults."""

import pytest

from checkers.invariants import assert_healthy
from engine.cache.l3 import SimulatedTier, StoreTier
from engine.storage import L3Store, MemoryStoreConfig
from engine.storage.backends.memory import MemoryBackend
from tests.factories import make_cache, serve


def seq(start, n):
    return list(range(start, start + n))


def with_store(backend, policy="wait_complete", **kw):
    c = make_cache(page_size=4, l1_pages=4, l2_pages=4, **kw)
    c.attach_l3(StoreTier(L3Store(backend, c.config.layout), c.l2), prefetch_policy=policy)
    return c


def test_second_cache_hits_l3_with_exact_kv():
    backend = MemoryBackend(MemoryStoreConfig())
    a = with_store(backend)
    prompt = seq(500, 12)
    serve(a, prompt)
    a.wait_all()
    assert a.stats()["l3"]["puts"] == 3
    b = with_store(backend)                 # cold L1 and L2, same store
    m = serve(b, prompt + [1, 2, 3, 4])      # serve() checks every restored KV byte
    assert (m.l1_len, m.l2_len, m.l3_len) == (0, 0, 12)
    assert m.loaded_len == 12
    b.wait_all()
    assert_healthy(b, idle=True)
    m = serve(b, prompt)
    assert m.l1_len == 12


def test_namespaces_do_not_share_l3():
    backend = MemoryBackend(MemoryStoreConfig())
    a = with_store(backend)
    serve(a, seq(0, 8), namespace="tenant-a")
    a.wait_all()
    b = with_store(backend)
    assert serve(b, seq(0, 8)).l3_len == 0
    b.wait_all()
    assert serve(b, seq(0, 8), namespace="tenant-b").l3_len == 0
    b.wait_all()
    m = serve(b, seq(0, 8), namespace="tenant-a")   # the owner's namespace: served from L3
    assert m.l3_len == 8


def test_corrupt_object_is_a_miss_and_output_stays_right():
    backend = MemoryBackend(MemoryStoreConfig())
    a = with_store(backend)
    serve(a, seq(0, 12))
    a.wait_all()
    keys = list(backend._objects)
    victim = sorted(keys)[0]
    raw = bytearray(backend._objects[victim])
    raw[-1] ^= 0xFF
    backend._objects[victim] = bytes(raw)
    b = with_store(backend)
    m = serve(b, seq(0, 12))
    # the chain stops at the corrupt page: fewer pages hit, and every byte used is correct
    assert m.l3_len < 12
    assert b.stats()["l3"]["corrupt"] + b.stats()["l3"]["hits"] >= 1
    b.wait_all()
    assert_healthy(b, idle=True)


def test_best_effort_does_not_wait_but_lands_later():
    backend = MemoryBackend(MemoryStoreConfig())
    a = with_store(backend)
    serve(a, seq(0, 8))
    a.wait_all()
    b = with_store(backend, policy="best_effort")
    m = b.match(seq(0, 8), rid="x")
    assert m.l3_len in (0, 8)        # 0 unless the worker already finished
    b.wait_all()
    m2 = b.match(seq(0, 8), rid="y")
    assert m2.hit_len == 8
    assert_healthy(b, idle=True)


def test_a_fetch_in_flight_is_not_issued_twice_and_lands_when_polled():
    """A pipeline stage (``ordered``): a best_effort fetch waits for ``poll(limit)``; a second
    request for the same prefix meanwhile starts no second fetch."""
    backend = MemoryBackend(MemoryStoreConfig())
    a = with_store(backend)
    serve(a, seq(0, 8))
    a.wait_all()
    b = with_store(backend, policy="best_effort")
    b.l3.ordered = True
    assert b.match(seq(0, 8), rid="x").l3_len == 0
    b.l3.inflight[0].event.wait()
    assert b.match(seq(0, 8), rid="y").l3_len == 0      # done, but not consumed yet
    assert len(b.l3.inflight) == 1 and b.counters["prefetch_pages_issued"] == 2
    assert b.ready_count("storage") == 1
    assert b.poll(limits={"storage": 1})["storage"] == 1
    assert b.match(seq(0, 8), rid="z").l2_len == 8
    assert_healthy(b, idle=True)


def test_simulated_tier_capacity():
    c = make_cache(page_size=2, l1_pages=2, l2_pages=2, real=False)
    c.attach_l3(SimulatedTier(capacity_pages=4))
    for t in (seq(0, 4), seq(10, 4), seq(20, 4)):
        serve(c, t)
    c.wait_all()
    assert c.stats()["l3"]["stored_pages"] == 4
    assert serve(c, seq(10, 4)).hit_len == 4


def test_l3_needs_l2():
    c = make_cache(page_size=2, l1_pages=2, l2_pages=0, real=False)
    with pytest.raises(ValueError):
        c.attach_l3(SimulatedTier(capacity_pages=4))


def test_put_split_in_flight_marks_every_piece():
    import threading

    backend = MemoryBackend(MemoryStoreConfig())
    c = with_store(backend)
    gate = threading.Event()
    store = c.l3.impl.store
    real_put = store.put_pages

    def gated_put(*args, **kw):          # hold the worker so the put is still in flight
        gate.wait(10)
        return real_put(*args, **kw)

    store.put_pages = gated_put
    serve(c, seq(0, 16))                 # one node of 4 pages
    for op in list(c._inflight_ops("backup")):
        op.wait()
    c.poll()                             # backup committed -> L3 put issued, held at the gate
    assert c.l3.inflight and not c.l3.inflight[0].event.is_set()
    c.match(seq(0, 8) + [999] * 8)       # splits the node 2 + 2 while its put is in flight
    gate.set()
    c.wait_all()
    nodes = sorted(c.tree.iter_nodes(), key=lambda n: n.id)
    assert [len(n.tokens) // 4 for n in nodes] == [2, 2]
    assert [n.l3 for n in nodes] == [2, 2]
    assert_healthy(c, idle=True)


def test_timeout_policy_counts_the_existence_query_against_the_timeout():
    """``timeout`` bounds the whole prefetch: a job waits only what is left of the timeout
    after the existence query (here: nothing is left of an hour, so it does not wait)."""
    import time

    import numpy as np

    from engine.cache.l3 import Job

    c = with_store(MemoryBackend(MemoryStoreConfig()), policy="timeout")
    c.l3.timeout = 3600.0
    job = Job("get", [], np.zeros(0, np.int64), None, 0)
    assert c.l3.wait(job, started=time.monotonic() - 3600.0) is False
    job.event.set()
    assert c.l3.wait(job, started=time.monotonic() - 3600.0) is True
