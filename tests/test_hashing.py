import hashlib
import os
import subprocess
import sys

import numpy as np
import pytest

from engine.core.hashing import namespace_seed, page_hash, page_hashes


def test_first_page_is_sha256_of_uint32_le():
    want = hashlib.sha256(b"".join(t.to_bytes(4, "little") for t in [1, 2, 3, 4])).digest()
    assert page_hashes([1, 2, 3, 4, 5], page_size=4) == [want]


def test_chain_includes_previous_digest():
    h = page_hashes([1, 2, 3, 4, 5, 6, 7, 8], page_size=4)
    second = hashlib.sha256(h[0] + b"".join(t.to_bytes(4, "little") for t in [5, 6, 7, 8]))
    assert h[1] == second.digest()
    assert page_hash(h[0], [5, 6, 7, 8]) == h[1]


def test_same_page_different_prefix_differs():
    a = page_hashes([1, 2, 9, 9], page_size=2)
    b = page_hashes([3, 4, 9, 9], page_size=2)
    assert a[1] != b[1]


def test_namespace_seeds_the_chain():
    plain = page_hashes([1, 2], 2)
    s1 = page_hashes([1, 2], 2, seed=namespace_seed("lora-1"))
    s2 = page_hashes([1, 2], 2, seed=namespace_seed("lora-2"))
    assert len({plain[0], s1[0], s2[0]}) == 3
    assert namespace_seed(None) is None and namespace_seed("") is None


def test_deterministic_across_processes():
    code = ("from engine.core.hashing import page_hashes;"
            "print(page_hashes(list(range(64)), 16)[-1].hex())")
    outs = set()
    for seed in ("0", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        outs.add(subprocess.check_output([sys.executable, "-c", code], env=env,
                                         cwd=os.path.dirname(os.path.dirname(__file__))).strip())
    assert len(outs) == 1
    assert outs.pop().decode() == page_hashes(np.arange(64), 16)[-1].hex()


def test_rejects_bad_input():
    with pytest.raises(ValueError):
        page_hashes([1, 2], 0)
    with pytest.raises(ValueError):
        page_hashes([-1, 2], 2)
