"""A fixed request script for the multi-rank server tests: fresh prompts, a device (L1) hit and,
after the small L1 has been cycled, a prefix restored from host memory (L2). Run as
``python -m tests.serve_client URL`` it sends the script and prints one JSON list of
``[output_ids, cached_tokens_details]`` — so a test can drive a server that only a process in
another network namespace can reach."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import requests

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SERVE_ARGS = ["--l1-tokens", "256", "--l2-tokens", "2048", "--page-size", "16", "--format",
              "json"]
"""The tier sizes :data:`SCRIPT` is written for."""


def prompt(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 256, n).tolist()


P1 = prompt(100, 1)
SCRIPT = [P1, prompt(60, 2), P1[:96] + prompt(10, 3)] + \
         [prompt(120, 10 + i) for i in range(5)] + [P1[:96] + prompt(7, 4)]
"""With ``--l1-tokens 256 --l2-tokens 2048 --page-size 16``: request 2 hits 96 tokens on the
device, the last one finds P1's prefix in host memory only."""


def generate(url: str, ids: list[int]) -> tuple[list[int], dict]:
    """A greedy 6-token ``/generate``: the output ids and where the cached prompt tokens came
    from (``cached_tokens_details``)."""
    r = requests.post(url + "/generate", timeout=120, json={
        "input_ids": ids, "sampling_params": {"max_new_tokens": 6, "temperature": 0,
                                              "ignore_eos": True}})
    assert r.status_code == 200, r.text
    d = r.json()
    return d["output_ids"], d["meta_info"]["cached_tokens_details"]


def spawn(*args: str, stderr=subprocess.PIPE, base=SERVE_ARGS) -> tuple[subprocess.Popen, str]:
    """``hicache bench serve --port 0`` in a subprocess; returns it and its URL."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "hicache_cli.app", "bench", "serve", "--port", "0", *base, *args],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=stderr, text=True,
        env=dict(os.environ, PYTHONPATH=ROOT))
    line = proc.stdout.readline()
    assert line, f"server did not start: {proc.stderr.read() if proc.stderr else ''}"
    return proc, json.loads(line)["url"]


def kill_follower(proc: subprocess.Popen, url: str, log_path, label: str) -> "str | None":
    """SIGKILL the follower the server logged as ``{label}: pid N``; return the 503 text
    ``/health`` gave before the server went away (None if it never did), once it exited."""
    try:
        pid = int(re.search(label + r": pid (\d+)", log_path.read_text()).group(1))
        os.kill(pid, signal.SIGKILL)
        health = None
        for _ in range(100):
            try:
                h = requests.get(url + "/health", timeout=2)
            except requests.ConnectionError:
                break                                   # already gone
            if h.status_code == 503:
                health = h.text
                break
            time.sleep(0.1)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    return health


def run(url: str) -> list:
    return [list(generate(url, ids)) for ids in SCRIPT]


if __name__ == "__main__":
    print(json.dumps(run(sys.argv[1])))
