"""``--disaggregation pd`` as three processes: the HTTP front end (here: this process), a decode
worker and a prefill worker. Same API through the front end (JSON and SSE); when a worker dies
the front end stays up and its /health names the worker."""

from __future__ import annotations

import json

import requests

from engine.runtime.pd.frontend import FrontendHandle
from engine.runtime.serving import ServerConfig
from tests.test_pd import PS, reference, toks

SP = {"max_new_tokens": 8, "ignore_eos": True, "temperature": 0}


def test_front_end_proxies_to_the_pair_and_survives_its_workers():
    cfg = ServerConfig(model="tiny", port=0, page_size=PS, l1_tokens=4096, l2_tokens=8192,
                       chunked_prefill_size=128, disaggregation="pd")
    with FrontendHandle(cfg) as h:
        prompt = toks(100, 81)
        r = requests.post(h.url + "/generate", json={"input_ids": prompt, "sampling_params": SP},
                          timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["meta_info"]["pd_transfer"]["transferred"] == 99
        assert r.json()["output_ids"] == reference(prompt)
        s = requests.post(h.url + "/generate", json={"input_ids": prompt + [5] * 20,
                                                     "sampling_params": SP, "stream": True},
                          stream=True, timeout=120)
        lines = [ln for ln in s.iter_lines(decode_unicode=True) if ln]
        assert lines[-1] == "data: [DONE]"
        last = json.loads(lines[-2][6:])
        assert last["meta_info"]["pd_transfer"]["decode_device"] == 96
        assert last["output_ids"] == reference(prompt + [5] * 20)
        assert "hicache_pd_link_up 1" in requests.get(h.url + "/metrics", timeout=30).text
        assert requests.get(h.url + "/health", timeout=30).status_code == 200

        h.workers.prefill.kill()
        h.workers.prefill.join(10)
        health = requests.get(h.url + "/health", timeout=30)
        assert health.status_code == 503 and "prefill worker down" in health.text
        bad = requests.post(h.url + "/generate", json={"input_ids": toks(60, 82),
                                                       "sampling_params": SP}, timeout=120)
        assert bad.status_code == 500 and "prefill worker down" in bad.text

        h.workers.decode.kill()
        h.workers.decode.join(10)
        health = requests.get(h.url + "/health", timeout=30)
        assert health.status_code == 503 and "worker down" in health.text
        gone = requests.post(h.url + "/generate", json={"input_ids": [1, 2],
                                                        "sampling_params": SP}, timeout=60)
        assert gone.status_code == 503
