"""The learning eviction policies in the live server: `bench serve --eviction-policy density`
(and bip) over a small L1 with evictions and host-memory restores answer exactly what an LRU
server answers (a policy only decides what stays cached, never what is computed), and the
policy really ran past its warm-up and filtered new prefixes."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest
import requests

from tests.serve_client import SCRIPT, generate, prompt, spawn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _spawn(policy: str) -> tuple[subprocess.Popen, str]:
    return spawn("--eviction-policy", policy,
                 base=["--l1-tokens", "256", "--l2-tokens", "1024", "--page-size", "16",
                       "--format", "json"])


def _traffic() -> list[list[int]]:
    """Rounds of: the fixed script, long one-shot prompts, and the previous round's short
    prompts continued — enough insertions (> 4 x L1) for the policy to leave its warm-up."""
    out, short = [], []
    for rnd in range(4):
        out += SCRIPT
        out += [prompt(160, 100 + 10 * rnd + i) for i in range(3)]
        out += [s + prompt(8, 200 + 10 * rnd + j) for j, s in enumerate(short)]
        short = [prompt(32, 300 + 10 * rnd + j) for j in range(3)]
        out += short
    return out


@pytest.mark.parametrize("policy_name", ["density", "bip"])
def test_a_learning_policy_serves_what_lru_serves(policy_name):
    traffic = _traffic()
    lru, url_lru = _spawn("lru")
    other, url = _spawn(policy_name)
    try:
        want = [generate(url_lru, ids) for ids in traffic]
        got = [generate(url, ids) for ids in traffic]
        policy = requests.get(url + "/get_server_info", timeout=10).json()["cache"]["policy"]
        metrics = requests.get(url + "/metrics", timeout=10).text
    finally:
        for p in (lru, other):
            p.send_signal(signal.SIGINT)
        for p in (lru, other):
            _, err = p.communicate(timeout=60)
            assert p.returncode == 0, err
    assert [o for o, _ in got] == [o for o, _ in want]
    assert sum(d.get("device", 0) for _, d in got) > 0          # it did cache and hit
    assert policy["name"] == policy_name
    assert policy["not_admitted"] > 0                             # it left its warm-up, filtered
    assert f"hicache_eviction_not_admitted_total {policy['not_admitted']}" in metrics
    if policy_name == "density":
        assert policy["filtering_decisions"] > 0
