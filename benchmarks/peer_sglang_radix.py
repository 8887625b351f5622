"""Peer side of bench_replay_vs_sglang.py: a Mooncake trace through SGLang's own ``RadixCache``.

Run with an interpreter that has SGLang installed (not hicache's):

  PEER_PYTHON benchmarks/peer_sglang_radix.py TRACE L1_TOKENS PAGE_SIZE [LIMIT]

Tokens are the mapping ``hicache bench replay`` uses (block ``b`` of a request is tokens
``b*512 … b*512+511``, cut at ``input_length``). Each request takes the steps of our replay's
request loop, through SGLang's public cache API: ``match_prefix`` → ``inc_lock_ref`` → evict
what the new pages need (a token-count allocator: ``RadixCache`` calls ``free_segment`` on it) →
``insert`` of the full pages → ``dec_lock_ref``. Only those calls are timed (the token lists are
made before). Prints one JSON line: hit rate, cache seconds, the torch thread count it ran with.
"""

from __future__ import annotations

import gzip
import json
import os
import sys
import time

BLOCK = 512


class TokenCounter:
    """What ``RadixCache`` needs of an allocator in simulation: ``device`` and
    ``free_segment`` (eviction hands back a node's values)."""

    device = "cpu"

    def __init__(self, capacity: int):
        self.free = capacity

    def free_segment(self, value, start_pos: int = 0) -> None:
        self.free += len(value) - start_pos


def read_trace(path: str, limit: int | None):
    opener = gzip.open if path.endswith(".gz") else open
    out = []
    with opener(path, "rt") as f:
        for line in f:
            if not line.strip():
                continue
            rec = json.loads(line)
            out.append((rec["hash_ids"], int(rec["input_length"])))
            if limit is not None and len(out) >= limit:
                break
    return out


def main() -> None:
    if len(sys.argv) < 4:
        sys.exit("usage: peer_sglang_radix.py TRACE L1_TOKENS PAGE_SIZE [LIMIT]")
    path, cap, page = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    limit = int(sys.argv[4]) if len(sys.argv) > 4 else None
    import numpy as np
    import torch

    threads = os.environ.get("OMP_NUM_THREADS")
    if threads:
        torch.set_num_threads(int(threads))
    from array import array

    from sglang.srt.mem_cache.base_prefix_cache import (
        EvictParams,
        InsertParams,
        MatchPrefixParams,
    )
    from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

    offsets = np.arange(BLOCK, dtype=np.int64)
    requests = []
    total = 0
    for ids, n in read_trace(path, limit):
        toks = (np.asarray(ids, dtype=np.int64)[:, None] * BLOCK + offsets).reshape(-1)[:n]
        requests.append(array("q", toks.tobytes()))
        total += n
    alloc = TokenCounter(cap // page * page)
    cache = RadixCache.create_simulated(mock_allocator=alloc, page_size=page)
    hits = uncacheable = 0
    perf = time.perf_counter
    seconds = 0.0
    for toks in requests:
        t0 = perf()
        m = cache.match_prefix(MatchPrefixParams(key=RadixKey(toks)))
        node = m.last_device_node
        cache.inc_lock_ref(node)
        hit = m.device_prefix_len
        full = len(toks) // page * page
        need = full - hit
        if need > alloc.free:
            cache.evict(EvictParams(num_tokens=need - alloc.free))
        if need > alloc.free:
            uncacheable += 1
        elif need > 0:
            alloc.free -= need
            cache.insert(InsertParams(key=RadixKey(toks[:full]),
                                      value=torch.arange(full, dtype=torch.int64)))
        cache.dec_lock_ref(node)
        seconds += perf() - t0
        hits += hit
    print(json.dumps({"peer": "sglang RadixCache", "requests": len(requests),
                      "token_hit_rate": round(hits / total, 6) if total else 0.0,
                      "uncacheable_requests": uncacheable, "seconds": round(seconds, 4),
                      "torch_threads": torch.get_num_threads()}))


if __name__ == "__main__":
    main()
