"""``--disaggregation pd`` as three processes: the HTTP front end (here: this process), a decode
worker and a prefill worker. Same API through the front end (JSON and SSE); when a worker dies
the front end stays up and its /health names the worker (the one that died, not its peer that
then lost the link); after an idle gap longer than the link's timeout it still serves."""

from __future__ import annotations

import json
import time

import requests

from engine.runtime.launch.pd_frontend import FrontendHandle
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
        assert bad.status_code == 503 and "prefill worker down" in bad.text

        h.workers.decode.kill()
        h.workers.decode.join(10)
        health = requests.get(h.url + "/health", timeout=30)
        assert health.status_code == 503 and "worker down" in health.text
        gone = requests.post(h.url + "/generate", json={"input_ids": [1, 2],
                                                        "sampling_params": SP}, timeout=60)
        assert gone.status_code == 503


def test_an_idle_pair_keeps_serving_and_a_dead_decode_worker_is_named():
    """Idle for longer than the link timeout (1.5 s here, 60 s by default): the prefill side's
    wait for the next request must not run out (the decode side pings an idle link)."""
    cfg = ServerConfig(model="tiny", port=0, page_size=PS, l1_tokens=4096, l2_tokens=8192,
                       chunked_prefill_size=128, disaggregation="pd", pd_link_timeout=1.5)
    with FrontendHandle(cfg) as h:
        prompt = toks(70, 91)
        body = {"input_ids": prompt, "sampling_params": SP}
        r = requests.post(h.url + "/generate", json=body, timeout=120)
        assert r.status_code == 200, r.text
        time.sleep(5)                                  # > every timeout the links have
        assert requests.get(h.url + "/health", timeout=30).status_code == 200
        again = requests.post(h.url + "/generate", json={"input_ids": prompt[:40] + [7] * 30,
                                                         "sampling_params": SP}, timeout=120)
        assert again.status_code == 200, again.text
        assert again.json()["output_ids"] == reference(prompt[:40] + [7] * 30)

        h.workers.decode.kill()                        # the prefill worker then loses its link
        h.workers.decode.join(10)
        h.workers.prefill.join(30)
        health = requests.get(h.url + "/health", timeout=30)
        assert health.status_code == 503, health.text
        assert "decode worker down" in health.text and "prefill" not in health.text
