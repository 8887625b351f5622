"""A fixed request script for the multi-rank server tests: fresh prompts, a device (L1) hit and,
after the small L1 has been cycled, a prefix restored from host memory (L2). Run as
``python -m tests.serve_client URL`` it sends the script and prints one JSON list of
``[output_ids, cached_tokens_details]`` — so a test can drive a server that only a process in
another network namespace can reach."""

from __future__ import annotations

import json
import sys

import numpy as np
import requests


def prompt(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 256, n).tolist()


P1 = prompt(100, 1)
SCRIPT = [P1, prompt(60, 2), P1[:96] + prompt(10, 3)] + \
         [prompt(120, 10 + i) for i in range(5)] + [P1[:96] + prompt(7, 4)]
"""With ``--l1-tokens 256 --l2-tokens 2048 --page-size 16``: request 2 hits 96 tokens on the
device, the last one finds P1's prefix in host memory only."""


def generate(url: str, ids: list[int]) -> tuple[list[int], dict]:
    r = requests.post(url + "/generate", timeout=60, json={
        "input_ids": ids, "sampling_params": {"max_new_tokens": 6, "temperature": 0,
                                              "ignore_eos": True}})
    r.raise_for_status()
    d = r.json()
    return d["output_ids"], d["meta_info"]["cached_tokens_details"]


def run(url: str) -> list:
    return [list(generate(url, ids)) for ids in SCRIPT]


if __name__ == "__main__":
    print(json.dumps(run(sys.argv[1])))
