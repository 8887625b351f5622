"""The HiCache facade: hits per tier, eviction orders, write policies, locks, load-back bytes."""

import numpy as np
import pytest

from checkers.invariants import assert_healthy
from engine.core.errors import OutOfCapacity
from tests.factories import make_cache, serve


def seq(start, n):
    return list(range(start, start + n))


def evicted(cache, tier="l1"):
    out = []
    for e in cache.events.events:
        if e["kind"] == "evict" and e["tier"] == tier:
            out += e["evicted"]
    return out


def nodes_on(cache, tokens):
    """The tree nodes holding ``tokens`` (white-box: results never expose nodes)."""
    path, _ = cache.tree.walk(np.asarray(tokens, dtype=np.uint32), None, split=False)
    return path


def node_of(cache, tokens):
    return nodes_on(cache, tokens)[-1].id


def test_l1_hit_lengths_are_page_aligned():
    c = make_cache(page_size=4, l1_pages=8)
    assert serve(c, seq(0, 10)).l1_len == 0
    m = serve(c, seq(0, 10) + [99])
    assert (m.l1_len, m.l2_len) == (8, 0)
    m = serve(c, seq(0, 6))
    assert m.l1_len == 4
    assert_healthy(c, idle=True)


@pytest.mark.parametrize("policy,expect", [("lru", ["a", "c"]), ("lfu", ["c", "b"])])
def test_eviction_order(policy, expect):
    c = make_cache(page_size=2, l1_pages=6, eviction_policy=policy)
    a, b, cc = seq(0, 2), seq(10, 2), seq(20, 2)
    for t in (a, b, cc, a, a, cc, b):  # hits: a=2, c=1, b=1; recency: b > c > a
        serve(c, t)
    ids = {"a": node_of(c, a), "b": node_of(c, b), "c": node_of(c, cc)}
    serve(c, seq(30, 10))  # needs 5 pages, 3 free: evicts exactly two one-page nodes
    names = {v: k for k, v in ids.items()}
    assert [names[i] for i in evicted(c)] == expect
    assert_healthy(c, idle=True)


def test_priority_policy_keeps_high_priority():
    c = make_cache(page_size=2, l1_pages=4, eviction_policy="priority", real=False)
    hi, lo = seq(0, 2), seq(10, 2)
    m = c.match(hi, rid="hi", priority=5)
    r = c.lock(m)
    c.insert(hi, c.alloc(1), rid="hi", priority=5)
    c.unlock(r)
    m = c.match(lo, rid="lo")
    r = c.lock(m)
    c.insert(lo, c.alloc(1), rid="lo")
    c.unlock(r)
    c.alloc(3)  # 2 free; must evict one page: the low-priority one even though it is newer
    assert evicted(c) == [node_of(c, hi) + 1]  # lo's node id
    assert c.match(hi).l1_len == 2


def test_locked_kv_is_never_evicted():
    c = make_cache(page_size=2, l1_pages=4)
    m = c.match(seq(0, 4))
    r = c.lock(m)
    pages = c.alloc(2)
    c.insert(seq(0, 4), pages)
    m2 = c.match(seq(0, 4))
    r2 = c.lock(m2)
    c.unlock(r)
    with pytest.raises(OutOfCapacity):
        c.alloc(3)
    assert c.match(seq(0, 4)).l1_len == 4
    c.unlock(r2)
    assert len(c.alloc(3)) == 3
    assert evicted(c) == [m2.node_id]


@pytest.mark.parametrize("host_layout", ["layer_first", "page_first"])
def test_write_through_then_load_back_restores_bytes(host_layout):
    c = make_cache(page_size=4, l1_pages=3, l2_pages=16, host_layout=host_layout)
    a, b = seq(100, 8), seq(200, 8)
    serve(c, a)
    c.wait_all()
    serve(c, b)                      # evicts a from L1; a stays in the tree (backed up)
    c.wait_all()
    assert c.stats()["evicted_l1_pages"] >= 2
    m = serve(c, a + [1, 2, 3, 4])   # serve() verifies the restored KV bytes layer by layer
    assert (m.l1_len, m.l2_len, m.loaded_len) == (0, 8, 8)
    m = serve(c, a)
    assert m.l1_len == 8
    c.wait_all()
    assert_healthy(c, idle=True)


def test_write_through_selective_backs_up_after_n_hits():
    c = make_cache(page_size=2, l1_pages=8, l2_pages=8, write_policy="write_through_selective",
                   write_through_threshold=2)
    a = seq(0, 4)
    serve(c, a)
    c.wait_all()
    assert c.l2_alloc.used_pages == 0
    serve(c, a)   # hit 1 (node hit_count 2 after the first match counted the insert walk? no)
    serve(c, a)
    c.wait_all()
    assert c.l2_alloc.used_pages == 2
    assert_healthy(c, idle=True)


def test_write_back_backs_up_only_on_eviction():
    c = make_cache(page_size=2, l1_pages=2, l2_pages=8, write_policy="write_back")
    a, b = seq(0, 4), seq(10, 4)
    serve(c, a)
    c.wait_all()
    assert c.l2_alloc.used_pages == 0
    serve(c, b)    # evicts a: written back to L2 first
    assert c.l2_alloc.used_pages == 2
    m = serve(c, a)
    assert (m.l1_len, m.l2_len) == (0, 4)
    c.wait_all()
    assert_healthy(c, idle=True)


def test_l2_eviction_removes_leaves():
    c = make_cache(page_size=2, l1_pages=2, l2_pages=4)
    for t in (seq(0, 4), seq(10, 4), seq(20, 4)):
        serve(c, t)
        c.wait_all()
    # L2 holds 4 pages: the oldest backed-up node was dropped from the tree entirely
    assert c.match(seq(0, 4)).hit_len == 0
    assert c.match(seq(20, 4)).l1_len == 4
    assert evicted(c, "l2")
    assert_healthy(c, idle=True)


def test_namespaces_never_share_kv():
    c = make_cache(page_size=2, l1_pages=8)
    serve(c, seq(0, 4), namespace="salt-1")
    assert c.match(seq(0, 4)).hit_len == 0
    assert c.match(seq(0, 4), namespace="salt-2").hit_len == 0
    assert c.match(seq(0, 4), namespace="salt-1").l1_len == 4


def test_in_flight_load_is_not_an_l1_hit():
    c = make_cache(page_size=2, l1_pages=2, l2_pages=8)
    a, b = seq(0, 4), seq(10, 4)
    serve(c, a)
    c.wait_all()
    serve(c, b)
    c.wait_all()
    c.transfers.pause()
    try:
        m = c.match(a, rid="x")
        r = c.lock(m)
        h = c.load_back(m)
        assert not h.done()
        m2 = c.match(a, rid="y")             # same prefix while its load is in flight
        assert (m2.l1_len, m2.l2_len) == (0, 4)
        r2 = c.lock(m2)
        h2 = c.load_back(m2)                 # joins the in-flight load, allocates nothing
        assert h2.ops == h.ops
        assert c.stats()["loadback_ops"] == 1
    finally:
        c.transfers.resume()
    h.wait()
    h2.wait()
    c.poll()
    assert c.match(a).l1_len == 4
    c.unlock(r)
    c.unlock(r2)
    assert_healthy(c, idle=True)


def _match_during_a_finished_load(c):
    """Prefix ``a`` evicted to L2, loaded back (done, not committed: no poll), matched again:
    returns ``a``, the load's lock receipt and the second match."""
    a, b = seq(0, 4), seq(10, 4)
    serve(c, a)
    c.wait_all()
    serve(c, b)
    c.wait_all()
    m = c.match(a, rid="x")
    r = c.lock(m)
    c.load_back(m).wait()
    return a, r, c.match(a, rid="y")


def test_a_finished_load_is_an_l1_hit_only_once_committed_on_ranks():
    """A load that finished but is not committed: a lone cache counts it as L1; a rank of a
    group (``hit_on_commit``) as L2 until the commit, the step every rank agrees on."""
    for on_commit, want in ((False, (4, 0)), (True, (0, 4))):
        c = make_cache(page_size=2, l1_pages=2, l2_pages=8)
        c.hit_on_commit = on_commit
        a, r, m2 = _match_during_a_finished_load(c)
        assert (m2.l1_len, m2.l2_len) == want
        c.poll()
        assert c.match(a).l1_len == 4         # committed: an L1 hit everywhere
        c.unlock(r)
        assert_healthy(c, idle=True)


def test_backup_commits_only_at_poll():
    c = make_cache(page_size=2, l1_pages=4, l2_pages=4)
    m = c.match(seq(0, 4))
    r = c.lock(m)
    c.insert(seq(0, 4), c.alloc(2))
    c.unlock(r)
    node = nodes_on(c, seq(0, 4))[-1]
    node.backing_up[0].wait()
    assert node.l2 is None                    # done but not consumed: not visible yet
    assert c.poll()["backup"] == 1
    assert node.l2 is not None


def test_flush_returns_pools_to_baseline():
    c = make_cache(page_size=2, l1_pages=4, l2_pages=8)
    for t in (seq(0, 4), seq(10, 4), seq(20, 6)):
        serve(c, t)
    c.flush()
    assert c.l1_alloc.used_pages == 0 and c.l2_alloc.used_pages == 0
    assert c.tree.num_nodes == 0
    assert_healthy(c, idle=True)


def test_events_record_each_decision():
    c = make_cache(page_size=2, l1_pages=2, real=False)
    serve(c, seq(0, 4), rid="r1")
    serve(c, seq(10, 4), rid="r2")
    kinds = [e["kind"] for e in c.events.events]
    assert kinds == ["match", "lock", "insert", "unlock",
                     "match", "lock", "evict", "insert", "unlock"]
    ev = [e for e in c.events.events if e["kind"] == "evict"][0]
    assert ev["tier"] == "l1" and ev["evicted"] == ev["eligible"]
    assert [e["seq"] for e in c.events.events] == list(range(len(kinds)))


def test_poll_consumes_exactly_the_agreed_number_of_acks():
    """The PP protocol (docs/parallelism.md §2): a stage consumes exactly N completed ops even if more are
    done locally; ready_count is what it can ACK."""
    c = make_cache(page_size=2, l1_pages=8, l2_pages=8)
    c.transfers.pause()
    for t in (seq(0, 4), seq(10, 4)):
        m = c.match(t)
        r = c.lock(m)
        c.insert(t, c.alloc(2), after=r)     # write-through: one backup op each
        c.unlock(r)
    assert c.ready_count("backup") == 0
    c.transfers.resume()
    for op in c._inflight_ops("backup"):
        op.wait()
    assert c.ready_count("backup") == 2
    assert c.poll(limits={"backup": 1})["backup"] == 1
    assert c.ready_count("backup") == 1      # ACK(2) stays queued although it is done
    assert c.l2_alloc.used_pages == 4
    done = [e["op"] for e in c.events.events if e["kind"] == "backup_done"]
    assert done == [0]
    c.poll()
    assert [e["op"] for e in c.events.events if e["kind"] == "backup_done"] == [0, 1]
    assert_healthy(c, idle=True)


def test_admit_reuses_the_prefix_and_reserves_the_rest():
    c = make_cache(page_size=2, l1_pages=8, l2_pages=8)
    serve(c, seq(0, 6))
    a = c.admit(seq(0, 6) + [99], rid="a", extra_pages=2)
    assert (a.device_len, a.host_len, a.storage_len, a.prefix_len) == (6, 0, 0, 6)
    assert len(a.pages) == 4 + 2 and a.n_prefix_pages == 3
    assert a.receipt.node_id == node_of(c, seq(0, 6)) and a.load is None
    assert not hasattr(a.receipt, "node") and not hasattr(c.match(seq(0, 2)), "path")
    c.free(a.pages[a.n_prefix_pages:])
    c.unlock(a.receipt)
    assert_healthy(c, idle=True)


def test_admit_loads_back_the_l2_part():
    c = make_cache(page_size=2, l1_pages=4, l2_pages=8)
    serve(c, seq(0, 4))
    c.wait_all()
    serve(c, seq(10, 8))                          # pushes the first prefix out of L1 (to L2)
    a = c.admit(seq(0, 4), rid="b")
    assert (a.device_len, a.host_len) == (0, 4) and a.n_prefix_pages == 2
    assert a.load is not None
    a.load.wait()
    c.unlock(a.receipt)
    c.poll()
    assert_healthy(c, idle=True)


def test_admit_without_room_holds_nothing():
    c = make_cache(page_size=2, l1_pages=4, l2_pages=4)
    serve(c, seq(0, 4))
    m = c.match(seq(0, 4))
    r = c.lock(m)                                 # another request pins 2 of the 4 pages
    free_before = c.l1_alloc.free_pages
    kinds = len(c.events.events)
    assert c.admit(seq(0, 4), rid="big", extra_pages=3) is None
    assert c.l1_alloc.free_pages == free_before
    new = [e["kind"] for e in c.events.events[kinds:]]
    assert new[:2] == ["match", "lock"] and new[-1] == "unlock" and "restore" not in new
    assert c.admit(seq(0, 4), rid="no-cache", extra_pages=3, reuse=False) is None
    c.unlock(r)
    a = c.admit(seq(50, 2), rid="plain", extra_pages=1, reuse=False)
    assert a.receipt is None and a.n_prefix_pages == 0 and len(a.pages) == 2
    c.free(a.pages)
    assert_healthy(c, idle=True)


@pytest.mark.parametrize("pp", [1, 2])
def test_a_pipeline_stage_counts_an_uncommitted_load_as_l2(pp):
    """The ranks' cache builder: a pipeline stage's cache (pp > 1) classifies a finished but
    uncommitted load as L2, as a TP rank's does, so stages whose copies finish at different
    times still see the same hit (a lone server keeps the L1 hit)."""
    from engine.cache.facade import CacheConfig
    from engine.runtime.config import ServerConfig
    from engine.runtime.ranks.build import make_cache as rank_cache
    from engine.runtime.topology import Topology
    from tests.factories import tiny_layout

    cfg = CacheConfig(page_size=2, l1_tokens=4, l2_tokens=16, layout=tiny_layout(2))
    c = rank_cache(cfg, None, ServerConfig(pp=pp), Topology(pp=pp, rank=0), None)
    _, r, m2 = _match_during_a_finished_load(c)
    assert (m2.l1_len, m2.l2_len) == ((0, 4) if pp > 1 else (4, 0))
    c.poll()
    c.unlock(r)
    assert_healthy(c, idle=True)
