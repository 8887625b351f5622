"""Rank divergence classes on a live server (docs/parallelism.md, "Rank divergence classes"):
for each class injected on one rank of real rank processes (``--debug-diverge``),

1. with the agreement that prevents it, outputs equal one process and the logs agree;
2. with it off (``,unguarded``), ``--consensus-check online`` stops the server in one line
   naming the divergence before any collective hangs;
3. ``hicache consensus-check`` on the logs it wrote names the same category.
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from engine.runtime.launch import ServerConfig, start_server
from hicache_cli.app import app
from tests.serve_client import SCRIPT, generate, prompt

# the request script of the other multi-rank tests, then prompts of varied lengths: enough L1
# churn that a one-page capacity difference shows in an eviction
WORK = SCRIPT + [prompt(17 * (i % 5) + 40, 50 + i) for i in range(12)]

# an extra eviction on the smaller rank: the first differing event, aligned by sequence number
# (online) or with the logs' context (offline), is an extra event or a lock taken elsewhere
CAPACITY = ("eviction_eligibility_divergence", "missing_events", "lock_order_mismatch")
# another victim on one rank: its evict pass names other nodes, or the next event differs
EVICT = ("eviction_eligibility_divergence", "missing_events", "lock_order_mismatch",
         "hit_length_mismatch", "event_mismatch")
# case -> (the injection, the shape, the consensus categories its first symptom can fall in:
# docs/parallelism.md maps each class to them)
CASES = {
    "capacity-tp2": ("capacity@1", dict(tp=2), CAPACITY),
    "capacity-pp2": ("capacity@1", dict(pp=2), CAPACITY),
    "capacity-cp2": ("capacity@1", dict(cp=2), CAPACITY),
    # unguarded turns every TP agreement of the cache off (no collective left to mismatch),
    # so on a loaded machine the commit counts may differ first (as for clock and host-alloc)
    "prefetch-count-tp2": ("prefetch-count@1", dict(tp=2), ("hit_length_mismatch",
                                                            "event_mismatch",
                                                            "restore_completion_mismatch",
                                                            "missing_events")),
    "clock-tp2": ("clock@1", dict(tp=2), ("hit_length_mismatch", "event_mismatch",
                                          "restore_completion_mismatch", "missing_events")),
    "host-alloc-tp2": ("host-alloc@1", dict(tp=2), ("hit_length_mismatch", "event_mismatch",
                                                    "missing_events")),
    "ack-order-tp2": ("ack-order@1", dict(tp=2), ("restore_completion_mismatch",
                                                  "missing_events")),
    "ack-order-pp2": ("ack-order@1", dict(pp=2), ("pp_ack_consumption_mismatch",
                                                  "restore_completion_mismatch",
                                                  "missing_events")),
    # a backup issued on one rank only: the next event differs in kind (often a lock)
    "backup-alloc-tp2": ("backup-alloc@1", dict(tp=2), ("event_mismatch", "missing_events",
                                                        "lock_order_mismatch",
                                                        "restore_completion_mismatch")),
    "l3-exists-pp2": ("l3-exists@1", dict(pp=2), ("hit_length_mismatch", "event_mismatch",
                                                  "missing_events")),
    "evict-order-tp2": ("evict-order@1", dict(tp=2), EVICT),
    "evict-order-pp2": ("evict-order@1", dict(pp=2), EVICT),
    # CP's load-backs go through its owner agreement: on a loaded machine (a whole-suite run)
    # a load-back one rank makes and the other does not, after the other victim, showed first
    "evict-order-cp2": ("evict-order@1", dict(cp=2), EVICT + ("restore_completion_mismatch",)),
}


def _cfg(tmp_path, **kw) -> ServerConfig:
    return ServerConfig(port=0, l1_tokens=256, l2_tokens=2048, page_size=16,
                        collective_timeout_s=60, **kw)


L3_CLASSES = ("prefetch-count", "clock", "host-alloc", "l3-exists")


def _storage(tmp_path, name: str, spec: str) -> dict:
    if not spec.startswith(L3_CLASSES):
        return {}
    return dict(hicache_storage_backend="file", hicache_storage_dir=str(tmp_path / name),
                hicache_storage_prefetch_policy="timeout" if spec.startswith("clock")
                else "wait_complete", hicache_storage_prefetch_timeout=30.0)


def _script(url: str, twice: bool) -> list:
    out = [list(generate(url, ids)) for ids in WORK]
    if twice:                      # a second round: the L3 copies of the first are read back
        out += [list(generate(url, ids)) for ids in WORK]
    return out


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    out = {}
    for twice in (False, True):
        d = tmp_path_factory.mktemp("one")
        h = start_server(_cfg(d, **({} if not twice else _storage(d, "l3", "prefetch-count"))))
        try:
            if twice:
                _script(h.url, False)
                requests_flush(h.url)
            out[twice] = _script(h.url, twice=False)
        finally:
            h.stop()
    return out


def requests_flush(url: str) -> None:
    import requests

    assert requests.post(url + "/flush_cache", timeout=60).ok     # L1+L2: the next round reads L3


def _consistent(log_dir) -> dict:
    r = CliRunner().invoke(app, ["consensus-check", str(log_dir), "--format", "json"])
    return {"code": r.exit_code, **json.loads(r.stdout)}


@pytest.mark.parametrize("case", list(CASES))
def test_the_agreement_keeps_every_rank_equal(one_process, tmp_path, case):
    spec, shape, _ = CASES[case]
    l3 = spec.startswith(L3_CLASSES)
    h = start_server(_cfg(tmp_path, rank_log_dir=str(tmp_path / "logs"), debug_diverge=spec,
                          consensus_check="online", **shape, **_storage(tmp_path, "l3", spec)))
    try:
        if l3:
            _script(h.url, False)
            requests_flush(h.url)
        got = _script(h.url, twice=False)
    finally:
        h.stop()
    assert [o for o, _ in got] == [o for o, _ in one_process[l3]]
    out = _consistent(tmp_path / "logs")
    assert out["code"] == 0 and out["consistent"] is True, out


def _flags(shape: dict, spec: str, tmp_path) -> list[str]:
    out = [x for k, v in shape.items() for x in (f"--{k}", str(v))]
    for k, v in _storage(tmp_path, "l3", spec).items():
        out += [f"--{k.replace('_', '-')}", str(v)]
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_unguarded_the_online_check_stops_in_one_line_and_the_logs_name_it(tmp_path, case):
    """The server runs in its own process (a divergence the check missed could make gloo abort
    it): the check, before each step's forward, must stop it first."""
    import re
    import signal

    import requests

    from tests.serve_client import spawn

    spec, shape, category = CASES[case]
    l3 = spec.startswith(L3_CLASSES)
    logs = tmp_path / "logs"
    err_path = tmp_path / "server.err"
    with open(err_path, "w") as err:
        proc, url = spawn(*_flags(shape, spec, tmp_path), "--rank-log-dir", str(logs),
                          "--debug-diverge", spec + ",unguarded", "--consensus-check", "online",
                          "--consensus-every", "1", "--collective-timeout", "60", stderr=err)
    errors = []
    sent = []                            # the request ids, in order
    try:
        for _round in range(2 if l3 else 1):
            for i, ids in enumerate(WORK):
                sent.append(f"req-{_round}-{i}")
                try:
                    r = requests.post(url + "/generate", timeout=120, json={
                        "input_ids": ids, "rid": sent[-1],
                        "sampling_params": {"max_new_tokens": 6, "ignore_eos": True}})
                except requests.ConnectionError:
                    break                                 # it stopped
                if r.status_code != 200:
                    errors.append(r.json()["error"]["message"])
                    break
            if errors:
                break
            if l3:
                requests_flush(url)
        proc.wait(timeout=90)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
    text = err_path.read_text()
    assert errors, f"the divergence went unnoticed: {text[-2000:]}"
    assert "stopped before a hang: rank consensus lost" in errors[0], errors[0]
    assert "while serving request " in errors[0], errors[0]      # the trigger, named
    assert proc.returncode == 1 and "stopped: stopped before a hang" in text, text[-2000:]
    assert "Traceback" not in text, text[-2000:]
    online = re.search(r"since the last agreement\): (\w+): rank", errors[0]).group(1)
    out = _consistent(logs)                  # offline, on the logs the ranks wrote
    assert out["code"] == 3 and out["consistent"] is False, out
    assert online in category, (online, category)
    first = out["divergences"][0]
    assert first["category"] in category, out
    # the trigger: one of the requests sent, arrived no later than the divergence
    trigger = first["trigger_request"]
    assert trigger is not None and trigger["rid"] in sent, (trigger, sent)
    assert trigger["arrival_step"] is not None and trigger["arrival_step"] <= first["step"]
    # the chain starts at the first divergent event, then each later category once
    chain = first["chain"]
    assert chain and chain[0]["category"] == first["category"], chain
    assert chain[0]["events"] == {str(r): first["context"][str(r)]["at"]
                                  for r in (first["majority"][0], first["ranks"][0])}, chain
    assert len({c["category"] for c in chain}) == len(chain), chain
    assert [c["step"] for c in chain] == sorted(c["step"] for c in chain), chain


@pytest.mark.parametrize("spec, shape, needs", [
    ("l3-exists@1", dict(tp=2), "needs --pp > 1 without --cp and an L3 store"),
    ("l3-exists@1", dict(pp=2), "needs --pp > 1 without --cp and an L3 store"),
    ("backup-alloc@1", dict(pp=2), "needs --tp > 1 and an L2 host pool"),
    ("backup-alloc@1", dict(tp=2, l2_tokens=0), "needs --tp > 1 and an L2 host pool"),
    ("evict-order@0", dict(), "needs --tp, --cp or --pp > 1"),
    ("evict-order@2", dict(tp=2), "rank 2 is outside the 2 ranks"),
    ("evict-order", dict(tp=2), "expected CLASS@RANK[:AFTER][,unguarded]"),
])
def test_a_class_on_a_shape_it_does_not_apply_to_is_one_line(spec, shape, needs):
    with pytest.raises(ValueError) as e:
        ServerConfig(port=0, debug_diverge=spec, **shape)
    assert needs in str(e.value) and "\n" not in str(e.value), str(e.value)
