"""Workload generators: deterministic under a seed, and shaped as documented."""

import pytest

from engine.loadgen.workloads import agentic, multiturn


def play(workload, answer=lambda spec: [7] * spec.max_tokens):
    """Run every session to completion with a fake model answer; returns specs per session."""
    out = []
    for sess in workload.sessions:
        specs, spec = [], sess.first()
        while spec is not None:
            specs.append(spec)
            spec = sess.after(spec, answer(spec))
        out.append(specs)
    return out


def test_multiturn_shape():
    w = multiturn(num_clients=3, num_rounds=4, request_length=10, output_length=2, seed=5)
    assert w.name == "multiturn" and w.total_requests == 12
    sessions = play(w)
    assert [len(s) for s in sessions] == [4, 4, 4]
    for c, specs in enumerate(sessions):
        assert [s.turn for s in specs] == [0, 1, 2, 3]
        assert all(s.session == c and s.max_tokens == 2 and s.arrival is None for s in specs)
        # round r = previous prompt + the answer + 10 new user tokens
        assert [s.prompt_len for s in specs] == [10, 22, 34, 46]
        for prev, cur in zip(specs, specs[1:]):
            assert cur.input_ids[:prev.prompt_len] == prev.input_ids
            assert cur.input_ids[prev.prompt_len:prev.prompt_len + 2] == (7, 7)
        assert all(0 <= t < 256 for t in specs[-1].input_ids)
    # different clients ask different things
    assert sessions[0][0].input_ids != sessions[1][0].input_ids


def test_multiturn_deterministic_per_seed():
    a = play(multiturn(2, 3, 16, 1, seed=1))
    b = play(multiturn(2, 3, 16, 1, seed=1))
    c = play(multiturn(2, 3, 16, 1, seed=2))
    assert a == b
    assert a[0][0].input_ids != c[0][0].input_ids


def test_history_uses_the_real_answer_and_failure_ends_the_client():
    w = multiturn(1, 3, 4, 3, seed=0)
    sess = w.sessions[0]
    s0 = sess.first()
    s1 = sess.after(s0, [1, 2, 3])
    assert s1.input_ids[4:7] == (1, 2, 3)
    assert sess.after(s1, None) is None


def test_vocab_bounds_tokens():
    specs = play(multiturn(2, 2, 200, 0, vocab_size=5, seed=3))
    assert {t for s in specs for sp in s for t in sp.input_ids} <= set(range(5))


def test_agentic_reuses_most_of_each_prompt():
    w = agentic(num_clients=2, num_rounds=5, context_length=1000, system_length=300,
                request_length=50, output_length=10, seed=0)
    assert w.name == "agentic" and w.total_requests == 10
    a, b = play(w)
    assert a[0].prompt_len == 1000
    # the system prefix is shared across clients, the task context is not
    assert a[0].input_ids[:300] == b[0].input_ids[:300]
    assert a[0].input_ids[300:310] != b[0].input_ids[300:310]
    for prev, cur in zip(a, a[1:]):
        assert cur.input_ids[:prev.prompt_len] == prev.input_ids
        assert cur.prompt_len - prev.prompt_len == 60
        assert prev.prompt_len / cur.prompt_len > 0.9   # most of the history is reused


@pytest.mark.parametrize("kwargs", [dict(num_clients=0), dict(request_length=0),
                                    dict(output_length=-1)])
def test_bad_shapes_raise(kwargs):
    with pytest.raises(ValueError):
        multiturn(**kwargs)


def test_agentic_context_must_exceed_system():
    with pytest.raises(ValueError, match="context-length"):
        agentic(context_length=100, system_length=100)
