"""CP page ownership: the owner arithmetic, owner-aware allocation, rotation continuation, the
no-join rule, and ownership through backup and restore (docs/parallelism.md §1)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from checkers.invariants import check_cache
from engine.cache.facade import CacheConfig
from engine.core.errors import OutOfCapacity
from engine.parallel.cp import CPShape, OwnerAllocator
from engine.parallel.cp_cache import CPCache

P = 4


def make_cp(n: int = 2, l1_pages: int = 8, l2_pages: int = 0, **kw) -> CPCache:
    """A CP group of ``n`` ranks, each with ``l1_pages``/``l2_pages`` pages (metadata only)."""
    cfg = CacheConfig(page_size=P, l1_tokens=l1_pages * P, l2_tokens=l2_pages * P, layout=None,
                      **kw)
    return CPCache(cfg, n)


def pages_of(*names: int) -> np.ndarray:
    """Tokens of pages named by small ints: page ``a`` is ``a*P … a*P+P-1``."""
    return np.concatenate([np.arange(a * P, a * P + P) for a in names]).astype(np.uint32)


def serve(cp: CPCache, toks: np.ndarray, rid=None) -> tuple:
    """One request: match, lock, load back, allocate the rest continuing the rotation, insert."""
    m = cp.match(toks, rid=rid)
    receipt = cp.lock(m)
    cp.load_back(m)
    n_full = len(toks) // P
    pages = node = None
    try:
        new = cp.alloc_for(m, n_full - len(m.l1_pages))
        pages = np.concatenate([m.l1_pages, new])
        node = cp.insert(toks, pages, rid=rid, after=receipt)
    except OutOfCapacity:                         # no room even after eviction: not cached
        pass
    cp.unlock(receipt)
    cp.poll()
    return m, pages, node


def healthy(cp: CPCache, idle: bool = True) -> None:
    problems = check_cache(cp.cache, idle=idle) + cp.check_rotations()
    assert not problems, "\n".join(problems)


# ---------------------------------------------------------------- the arithmetic, exhaustively
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("p", [1, 2, 3, 4, 7])
def test_owner_arithmetic_matches_a_table_built_by_hand(n, p):
    shape = CPShape(n, p)
    pages_per_rank = 5
    slots = np.arange(n * pages_per_rank * p)
    # The table the arithmetic replaces: deal logical pages round-robin to ranks; each rank
    # stacks the pages it receives in arrival order.
    table = {}
    fill = [0] * n
    for q in range(n * pages_per_rank):
        r = q % n
        for o in range(p):
            table[q * p + o] = (q, r, fill[r] * p + o)
        fill[r] += 1
    q, r, loc = shape.locate(slots)
    assert [(int(a), int(b), int(c)) for a, b, c in zip(q, r, loc)] == \
        [table[int(x)] for x in slots]
    for x in slots.tolist():                       # scalar form agrees with the vector form
        assert shape.locate(x) == table[x]
    # every (rank, row) is used exactly once and maps back to its slot
    assert len({(b, c) for (_, b, c) in table.values()}) == len(slots)
    assert all(0 <= c < pages_per_rank * p for (_, _, c) in table.values())
    back = [shape.logical_slot(int(b), int(c)) for (_, b, c) in (table[x] for x in slots.tolist())]
    assert back == slots.tolist()
    assert np.array_equal(shape.logical_page(r, shape.local_page(q)), q)


def test_rotation_values():
    s = CPShape(3, 4)
    assert s.rotation(2, 5).tolist() == [2, 0, 1, 2, 0]
    assert s.rotation(2, 2, skip=3).tolist() == [2, 0]
    assert s.next_owner(2, 5) == 1
    assert s.counts([2, 0, 1, 2, 0]).tolist() == [2, 1, 2]
    with pytest.raises(ValueError, match="CP size"):
        CPShape(0, 4)


# ---------------------------------------------------------------- the owner-aware allocator
def test_owner_allocator_hands_out_the_asked_owners_and_keeps_accounts():
    a = OwnerAllocator(CPShape(3, P), pages_per_rank=4, name="L1")
    assert (a.num_pages, a.free_pages) == (12, 12)
    got = a.alloc_rotation(5, first_owner=1)
    assert (got % 3).tolist() == [1, 2, 0, 1, 2]
    assert len(set(got.tolist())) == 5 and a.is_allocated(got).all()
    assert a.used_per_rank().tolist() == [1, 2, 2]
    like = a.alloc(3, like=np.array([7, 8, 9]))         # owners 1, 2, 0
    assert (like % 3).tolist() == [1, 2, 0]
    assert a.fresh_owner() == 0                          # rank 0 has most free pages
    assert a.free_per_rank().tolist() == [2, 1, 1]
    assert a.shortfall(3, first_owner=0) == 0
    assert a.shortfall(4, first_owner=1) == 1           # ranks 1, 0, 2, 1: rank 1 lacks one
    assert a.shortfall(12, first_owner=0) == 3           # 4 each: ranks 1 and 2 lack 3
    with pytest.raises(OutOfCapacity, match=r"rank \d asked for"):
        a.alloc_rotation(12, 0)
    assert a.used_pages == 8                             # a refused alloc takes nothing
    a.free(got)
    a.free(like)
    assert a.free_pages == 12 and a.allocated_pages().size == 0
    assert a.local_rows(np.array([4, 5, 7]), rank=1).tolist() == \
        list(range(4, 8)) + list(range(8, 12))           # pages 4 and 7 live on rank 1


# ---------------------------------------------------------------- rotation continuation
def test_extending_a_prefix_continues_its_owner_sequence():
    cp = make_cp(2)
    _, pages, _ = serve(cp, pages_of(1, 2, 3), rid="abc")              # A, B, C
    assert (pages % 2).tolist() == [0, 1, 0]
    m, pages, node = serve(cp, pages_of(1, 2, 3, 4), rid="abcd")      # + D
    assert m.l1_len == 3 * P
    assert (pages % 2).tolist() == [0, 1, 0, 1]                        # D goes to rank 1
    assert node.cp_owner == 1
    healthy(cp)


def test_a_fresh_prompt_starts_where_most_pages_are_free():
    cp = make_cp(2)
    serve(cp, pages_of(1, 2, 3))                  # rank 0 holds 2 pages, rank 1 holds 1
    _, pages, node = serve(cp, pages_of(9))
    assert (pages % 2).tolist() == [1] and node.cp_owner == 1
    healthy(cp)


def test_a_split_edge_keeps_both_halves_on_the_rotation():
    cp = make_cp(3, l1_pages=8)
    _, pages, _ = serve(cp, pages_of(1, 2, 3, 4, 5))
    start = int(pages[0] % 3)
    _, pages2, node = serve(cp, pages_of(1, 2, 8, 9))   # splits after B, branches at page 2
    assert (pages2 % 3).tolist() == CPShape(3, P).rotation(start, 4).tolist()
    assert node.cp_owner % 3 == (start + 2) % 3
    healthy(cp)


# ---------------------------------------------------------------- the no-join rule
def test_a_suffix_whose_rotation_does_not_continue_the_prefix_is_not_cached():
    cp = make_cp(2)
    # two requests for the same new prompt are admitted before either inserts
    a, b = pages_of(1, 2, 3), pages_of(1, 2, 3, 4, 5)
    ma, mb = cp.match(a, rid="a"), cp.match(b, rid="b")
    ra, rb = cp.lock(ma), cp.lock(mb)
    pa = cp.alloc_for(ma, 3)                      # starts on rank 0 (ties: lowest)
    pb = cp.alloc_for(mb, 5)                      # rank 1 has more free pages now
    assert (pa % 2).tolist() == [0, 1, 0] and (pb % 2).tolist() == [1, 0, 1, 0, 1]
    cp.insert(a, pa, rid="a", after=ra)
    node = cp.insert(b, pb, rid="b", after=rb)
    # b's A, B, C are duplicates (the tree keeps a's); its D would start a rotation at rank 0
    # right after C (rank 0): not joined, D and E go back to the allocator
    assert node is not None and len(cp.tree.prefix_tokens(node)) == 3 * P
    assert (cp.cuts, cp.cut_pages) == (1, 2)
    cuts = [e for e in cp.events.events if e["kind"] == "cp_cut"]
    assert [(e["rid"], e["at_page"], e["pages"]) for e in cuts] == [("b", 3, 2)]
    cp.unlock(ra)
    cp.unlock(rb)
    healthy(cp)
    m, pages, _ = serve(cp, b, rid="b2")           # a later request caches D, E on the rotation
    assert m.l1_len == 3 * P and (pages % 2).tolist() == [0, 1, 0, 1, 0]
    healthy(cp)


def test_pages_with_the_wrong_owners_never_revive_an_evicted_node():
    cp = make_cp(2, l1_pages=4, l2_pages=8)
    toks = pages_of(1, 2, 3)
    early = cp.match(toks, rid="early")            # admitted first, before anything is cached
    r_early = cp.lock(early)
    _, pa, _ = serve(cp, toks, rid="a")            # A, B, C on ranks 0, 1, 0; backed up to L2
    assert (pa % 2).tolist() == [0, 1, 0]
    pe = cp.alloc_for(early, 3)                   # rank 1 has more free pages: 1, 0, 1
    assert (pe % 2).tolist() == [1, 0, 1]
    cp.evict_l1(3)                                 # A, B, C now live in L2 only
    assert all(n.l1 is None and n.l2 is not None for n in cp.tree.iter_nodes())
    cp.insert(toks, pe, rid="early", after=r_early)
    # reviving A, B, C with pages on ranks 1, 0, 1 would move them to other ranks: refused
    assert all(n.l1 is None for n in cp.tree.iter_nodes())
    assert cp.cut_pages == 3
    cp.unlock(r_early)
    healthy(cp)


# ---------------------------------------------------------------- ownership through the tiers
@pytest.mark.parametrize("n", [2, 3])
def test_backup_and_restore_keep_each_page_on_its_owner(n):
    cp = make_cp(n, l1_pages=3, l2_pages=12, write_policy="write_through")
    moves = []

    real_submit = cp.transfers.submit

    def record(op):
        moves.append((op.kind.value, op.src_pages.copy(), op.dst_pages.copy()))
        return real_submit(op)

    cp.transfers.submit = record
    rng = random.Random(5)
    prompts = [pages_of(*range(10 * i, 10 * i + rng.randint(1, 4))) for i in range(6)]
    restores = 0
    for step in range(60):
        toks = prompts[rng.randrange(len(prompts))]
        m, pages, _ = serve(cp, toks, rid=step)
        restores += m.l2_len > 0
        healthy(cp)
    kinds = {k for k, _, _ in moves}
    assert kinds == {"backup", "load"} and restores > 5
    for kind, src, dst in moves:
        # every (src, dst) pair stays on one rank: each rank moves exactly the pages it owns
        assert np.array_equal(src % n, dst % n), (kind, src, dst)
    per_rank = [sum(int((src % n == r).sum()) for _, src, _ in moves) for r in range(n)]
    assert min(per_rank) > 0


@pytest.mark.parametrize("n", [2, 3, 4])
def test_random_traffic_keeps_every_path_on_one_rotation(n):
    cp = make_cp(n, l1_pages=5, l2_pages=10, write_policy="write_back")
    rng = random.Random(n)
    base = [rng.randrange(50) for _ in range(12)]
    for step in range(150):
        cut = rng.randint(1, len(base))
        tail = [rng.randrange(50, 60) for _ in range(rng.randint(0, 3))]
        toks = pages_of(*base[:cut], *tail)
        serve(cp, toks, rid=step)
        healthy(cp)
    used = cp.l1_alloc.used_per_rank()
    assert used.max() - used.min() <= cp.tree.num_nodes    # no rank hoards the pages


# ---------------------------------------------------------------- admission (the scheduler's step)
def test_admit_continues_the_rotation_through_l1_and_l2_hits():
    cp = make_cp(2, l1_pages=4, l2_pages=8, write_policy="write_through")
    a = cp.admit(pages_of(1, 2, 3), rid="a", extra_pages=1)   # 3 prompt pages + 1 decode page
    assert (a.pages % 2).tolist() == [0, 1, 0, 1] and a.n_prefix_pages == 0
    cp.insert(pages_of(1, 2, 3), a.pages[:3], rid="a", after=a.receipt)
    cp.free(a.pages[3:])
    cp.unlock(a.receipt)
    cp.wait_all()
    b = cp.admit(pages_of(1, 2, 3, 4), rid="b", extra_pages=1)  # A on L1, D and a decode page
    assert (b.device_len, b.n_prefix_pages) == (3 * P, 3)
    assert (b.pages % 2).tolist() == [0, 1, 0, 1, 0]
    cp.free(b.pages[3:])
    cp.unlock(b.receipt)
    cp.evict_l1(1 << 20)                                     # A now in L2 only
    c = cp.admit(pages_of(1, 2, 3, 4), rid="c")
    assert (c.device_len, c.host_len) == (0, 3 * P)
    assert (c.pages % 2).tolist() == [0, 1, 0, 1]            # restored pages keep their owners
    if c.load is not None:
        c.load.wait()
    cp.free(c.pages[3:])
    cp.unlock(c.receipt)
    cp.poll()
    healthy(cp)
    assert [e["first_owner"] for e in cp.events.events if e["kind"] == "cp_alloc"] == [0, 1, 1]


def test_admit_without_room_holds_nothing():
    cp = make_cp(2, l1_pages=2)
    assert cp.admit(pages_of(*range(5)), rid="big") is None   # 5 pages > 2 per rank x 2
    healthy(cp)
    assert cp.l1_alloc.used_pages == 0
