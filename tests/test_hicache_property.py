"""Random operation sequences against a simple reference model, invariants after each step."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from checkers.invariants import assert_healthy
from tests.factories import make_cache, serve

PAGE = 2

# A request: namespace choice + a prefix drawn from a few shared "documents" + a random tail.
request = st.tuples(
    st.sampled_from([None, None, "ns"]),
    st.integers(0, 2),               # which shared document
    st.integers(0, 4),               # how many pages of it
    st.lists(st.integers(0, 5), max_size=5),  # tail tokens
)


def tokens_of(doc, n_pages, tail):
    base = [1000 * (doc + 1) + i for i in range(n_pages * PAGE)]
    return base + [t + 50 for t in tail]


def longest_inserted(inserted, ns, toks):
    """Reference: the longest page-aligned prefix of toks ever inserted (upper bound on hits)."""
    best = 0
    for k in range(len(toks) // PAGE, 0, -1):
        if (ns, tuple(toks[:k * PAGE])) in inserted:
            best = k * PAGE
            break
    return best


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(request, min_size=1, max_size=25),
       l1_pages=st.integers(6, 12), l2_pages=st.sampled_from([0, 4, 16]),
       policy=st.sampled_from(["write_through", "write_back", "write_through_selective"]),
       evict=st.sampled_from(["lru", "lfu"]))
def test_random_requests_keep_invariants_and_kv(ops, l1_pages, l2_pages, policy, evict):
    cache = make_cache(page_size=PAGE, l1_pages=l1_pages, l2_pages=l2_pages,
                       write_policy=policy, eviction_policy=evict)
    inserted: set = set()
    for ns, doc, n_pages, tail in ops:
        toks = tokens_of(doc, n_pages, tail)
        if len(toks) // PAGE > l1_pages:
            continue
        bound = longest_inserted(inserted, ns, toks)
        m = serve(cache, toks, namespace=ns)   # verifies every reused KV byte
        assert m.l1_len + m.l2_len <= bound, "hit on tokens never inserted in this namespace"
        assert m.l1_len % PAGE == 0 and m.l2_len % PAGE == 0
        n_full = len(toks) // PAGE
        for k in range(1, n_full + 1):
            inserted.add((ns, tuple(toks[:k * PAGE])))
        assert_healthy(cache)
    cache.wait_all()
    assert_healthy(cache, idle=True)
    cache.flush()
    assert cache.l1_alloc.used_pages == 0
    assert_healthy(cache, idle=True)


@settings(max_examples=40, deadline=None)
@given(ops=st.lists(request, min_size=1, max_size=30))
def test_unbounded_cache_hits_exactly_the_reference(ops):
    cache = make_cache(page_size=PAGE, l1_pages=400, real=False)
    inserted: set = set()
    for ns, doc, n_pages, tail in ops:
        toks = tokens_of(doc, n_pages, tail)
        want = longest_inserted(inserted, ns, toks)
        m = serve(cache, toks, namespace=ns)
        assert m.l1_len == want
        for k in range(1, len(toks) // PAGE + 1):
            inserted.add((ns, tuple(toks[:k * PAGE])))
    assert_healthy(cache, idle=True)
