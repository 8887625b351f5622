"""``bench serve --threads 8``: a prompt's output ids and logprobs are the same bits alone and
beside 1-7 batch mates, fresh or with its prefix cached on the device (L1), restored from host
memory (L2) or from the file store (L3)."""

from __future__ import annotations

import concurrent.futures as cf
import signal

import pytest
import requests

from tests.serve_client import prompt, spawn


def _gen(url: str, ids: list[int], n: int = 6) -> tuple[list, dict]:
    r = requests.post(url + "/generate", timeout=300, json={
        "input_ids": ids, "return_logprob": True,
        "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    m = r.json()["meta_info"]
    return m["output_token_logprobs"], m["cached_tokens_details"]


def _with_mates(url: str, ids: list[int], mates: int, seed: int) -> tuple[list, dict]:
    """``ids`` sent at the same time as ``mates`` other prompts of other lengths."""
    others = [prompt(30 + 37 * i, seed + i) for i in range(mates)]
    with cf.ThreadPoolExecutor(mates + 1) as pool:
        futs = [pool.submit(_gen, url, o, 10) for o in others[:mates // 2]]
        mine = pool.submit(_gen, url, ids)
        futs += [pool.submit(_gen, url, o, 10) for o in others[mates // 2:]]
        for f in futs:
            f.result()
        return mine.result()


TIERS = {
    "l1": (["--l1-tokens", "4096", "--l2-tokens", "0"], None),
    "l2": (["--l1-tokens", "1536", "--l2-tokens", "8192"], "host"),
    "l3": (["--l1-tokens", "1536", "--l2-tokens", "1536", "--hicache-storage-backend",
            "file"], "storage"),
}


@pytest.mark.parametrize("tier", sorted(TIERS))
def test_batch_mates_do_not_change_output_bits_at_8_threads(tier, tmp_path):
    args, restored_from = TIERS[tier]
    if tier == "l3":
        args = [*args, "--hicache-storage-dir", str(tmp_path / "store")]
    proc, url = spawn("--threads", "8", "--page-size", "16", "--format", "json", *args,
                      base=[])
    try:
        info = requests.get(url + "/get_server_info", timeout=30).json()
        assert info["threads"] == 8 and info["exact_kernels"] and not info["exact_fallbacks"]
        assert set(info["native_kernels"]) == {"products", "attention", "threads",
                                               "block_products"}
        p = prompt(150, 1)
        alone, _ = _gen(url, p)                          # fresh, alone
        for k, mates in enumerate((1, 3, 7)):
            got, cached = _with_mates(url, p, mates, 100 * k)  # cached prefix, with mates
            assert cached["device"] > 0 and got == alone
            q = prompt(120 + 9 * k, 50 + k)
            fresh, cached = _with_mates(url, q, mates, 200 * k)  # fresh, with mates
            assert sum(cached.values()) == 0
            assert _gen(url, q)[0] == fresh                 # cached prefix, alone
        if restored_from:
            for i in range(8):                              # push p's pages out of L1 (and L2)
                _gen(url, prompt(400, 1000 + i), 1)
            got, cached = _with_mates(url, p, 3, 900)
            assert cached[restored_from] > 0 and got == alone
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
