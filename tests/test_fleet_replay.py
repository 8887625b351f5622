"""Fleet replay (engine.sim.fleet): routers over N replica cache stacks sharing one L3."""

import json
import os

import pytest
from typer.testing import CliRunner

from engine.loadgen.trace import TraceRecord, load_trace
from engine.sim.fleet import ROUTERS, fleet_replay, pooled_bound
from engine.sim.replay import ReplayConfig, ReplayInput, replay
from hicache_cli.app import app

DATA = os.path.join(os.path.dirname(__file__), "data", "conversation_trace_head400.jsonl.gz")
B = 512


def crafted(*requests):
    """A trace of requests given as block-id lists, every block full (512 tokens)."""
    return ReplayInput([TraceRecord(float(i), B * len(ids), 10, tuple(ids))
                        for i, ids in enumerate(requests)])


@pytest.fixture(scope="module")
def head():
    return ReplayInput(load_trace(DATA))


def test_round_robin_equals_the_hand_computation():
    # 2 replicas of 2 pages (page = block), LRU over radix nodes (a node inserted in one
    # piece is evicted in one piece). Even requests go to replica 0, odd ones to replica 1.
    #   r0 [1,2] -> 0: miss, node [1,2]          r1 [3]   -> 1: miss, node [3]
    #   r2 [1,2] -> 0: hit 2 blocks              r3 [1,4] -> 1: miss, evicts [3]
    #   r4 [1,2] -> 0: hit 2                     r5 [3]   -> 1: miss, evicts node [1,4]
    #   r6 [1,4] -> 0: hit 1 (splits [1]|[2]),   r7 [1,4] -> 1: miss, evicts [3]
    #                  evicts leaf [2]
    inp = crafted([1, 2], [3], [1, 2], [1, 4], [1, 2], [3], [1, 4], [1, 4])
    cfg = ReplayConfig(page_size=B, l1_tokens=2 * B, events=False)
    res = fleet_replay(inp, cfg, 2, "round-robin")
    assert res.replica_of == [0, 1] * 4
    assert res.hit_tokens == res.l1_hit_tokens == 5 * B
    assert res.input_tokens == 14 * B
    assert res.computed_tokens == [3 * B, 6 * B]
    assert res.load_spread == pytest.approx(6 / 4.5)


def test_the_l3_is_shared_by_the_replicas():
    # Replica 1 never saw block 7; it finds it in the L3 replica 0 backed it up to.
    inp = crafted([7], [7])
    cfg = ReplayConfig(page_size=B, l1_tokens=B, l2_tokens=B, l3_tokens=-1, events=False)
    res = fleet_replay(inp, cfg, 2, "round-robin")
    assert res.replica_of == [0, 1]
    assert (res.l1_hit_tokens, res.l2_hit_tokens, res.l3_hit_tokens) == (0, 0, B)
    alone = fleet_replay(inp, ReplayConfig(page_size=B, l1_tokens=B, events=False), 2,
                         "round-robin")
    assert alone.hit_tokens == 0


@pytest.mark.parametrize("l1,l2,l3", [(100_000, 0, 0), (40_000, 80_000, -1),
                                      (40_000, 80_000, 300_000)])
def test_one_replica_is_the_plain_replay(head, l1, l2, l3):
    cfg = ReplayConfig(l1_tokens=l1, l2_tokens=l2, l3_tokens=l3, limit=200)
    plain, _ = replay(head, cfg)                             # token level, hashed L3 keys
    for router in ROUTERS:
        res = fleet_replay(head, cfg, 1, router)
        assert (res.l1_hit_tokens, res.l2_hit_tokens, res.l3_hit_tokens) == \
            (plain.l1_hit_tokens, plain.l2_hit_tokens, plain.l3_hit_tokens), router
        assert res.input_tokens == plain.input_tokens
        assert res.uncacheable_requests == plain.uncacheable_requests


def test_pooled_bound_is_one_replica_of_n_times_the_capacity(head):
    cfg = ReplayConfig(l1_tokens=30_000, l2_tokens=60_000, l3_tokens=-1, limit=200,
                       events=False)
    pooled = pooled_bound(head, cfg, 4)
    big, _ = replay(head, ReplayConfig(l1_tokens=120_000, l2_tokens=240_000, l3_tokens=-1,
                                       limit=200, events=False), page_level=True)
    assert pooled.hit_tokens == big.hit_tokens and pooled.replicas == 1


@pytest.mark.parametrize("n", [2, 8])
def test_no_router_beats_an_unbounded_pool(head, n):
    cfg = ReplayConfig(l1_tokens=40_000, limit=200, events=False)
    everything = pooled_bound(head, ReplayConfig(l1_tokens=10 ** 9, limit=200, events=False), 1)
    for router in ROUTERS:
        res = fleet_replay(head, cfg, n, router)
        assert res.hit_tokens <= everything.hit_tokens, router
        assert sum(res.routed) == 200


def test_an_unbounded_shared_l3_recovers_what_routing_loses(head):
    cfg = ReplayConfig(l1_tokens=40_000, l2_tokens=80_000, l3_tokens=-1, limit=200,
                       events=False)
    pooled = pooled_bound(head, cfg, 4).hit_tokens
    no_l3 = fleet_replay(head, ReplayConfig(l1_tokens=40_000, l2_tokens=80_000, limit=200,
                                            events=False), 4, "round-robin")
    rr = fleet_replay(head, cfg, 4, "round-robin")
    assert no_l3.hit_tokens < rr.hit_tokens == pooled
    assert rr.l3_hit_tokens > 0


def test_consistent_hash_saturates_one_replica_on_a_skewed_trace():
    # 32 of 40 requests share their first block (a common system prompt): hashing the first
    # block sends all 32 to one replica; round-robin spreads them.
    reqs = [[0, 100 + i, 200 + i] for i in range(32)] + [[300 + i, 400 + i] for i in range(8)]
    reqs = [reqs[(i * 7) % 40] for i in range(40)]               # interleave the two kinds
    inp = crafted(*reqs)
    cfg = ReplayConfig(page_size=B, l1_tokens=64 * B, events=False)
    ch = fleet_replay(inp, cfg, 4, "consistent-hash")
    hot = {r for ids, r in zip(reqs, ch.replica_of) if ids[0] == 0}
    assert len(hot) == 1
    assert ch.routed[hot.pop()] >= 32
    assert ch.load_spread > 3.0
    assert fleet_replay(inp, cfg, 4, "round-robin").load_spread < 1.3


def test_session_routing_keeps_a_conversation_on_one_replica():
    # Every request starts with block 0; the conversation is the block after it.
    convs = {c: [0, 10 * c] for c in range(1, 7)}
    reqs = []
    for turn in range(3):
        for c, ids in convs.items():
            ids = ids + [1000 * c + turn]
            convs[c] = ids
            reqs.append(list(ids))
    inp = crafted(*reqs)
    cfg = ReplayConfig(page_size=B, l1_tokens=64 * B, events=False)
    res = fleet_replay(inp, cfg, 4, "session")
    by_conv: dict = {}
    for ids, r in zip(reqs, res.replica_of):
        by_conv.setdefault(ids[1], set()).add(r)
    assert all(len(s) == 1 for s in by_conv.values())
    assert len({next(iter(s)) for s in by_conv.values()}) > 1     # not all on one replica
    keyed = fleet_replay(inp, cfg, 4, "session", sessions=[0] * len(reqs))
    assert len(set(keyed.replica_of)) == 1                          # the given key wins
    named = fleet_replay(inp, cfg, 4, "session", sessions=[f"s{i % 6}" for i in range(18)])
    assert named.replica_of[:6] == named.replica_of[6:12] == named.replica_of[12:]


def test_cache_aware_follows_the_prefix_and_balances_new_ones():
    # Two long prefixes, each repeated: cache-aware sends each repeat where its prefix went and
    # spreads the two prefixes over different (empty-tree) replicas.
    a, b = list(range(1, 9)), list(range(11, 19))
    inp = crafted(a, b, a + [50], b + [60], a + [51], b + [61])
    cfg = ReplayConfig(page_size=B, l1_tokens=64 * B, events=False)
    res = fleet_replay(inp, cfg, 3, "cache-aware")
    ra, rb = res.replica_of[0], res.replica_of[1]
    assert ra != rb and res.replica_of == [ra, rb, ra, rb, ra, rb]
    assert res.hit_tokens == 4 * 8 * B
    rr = fleet_replay(inp, cfg, 3, "round-robin")
    assert rr.hit_tokens < res.hit_tokens


runner = CliRunner()


def test_cli_fleet_json_and_sweep_plot(tmp_path):
    png = tmp_path / "fleet.png"
    r = runner.invoke(app, ["bench", "replay", DATA, "--replicas", "4", "--router",
                            "round-robin,cache-aware", "--l1-tokens", "40000", "--limit", "120",
                            "--sweep", "--plot", str(png), "--format", "json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert [run["replicas"] for run in d["fleet"]] == [1, 2, 4]
    for run in d["fleet"]:
        assert [row["router"] for row in run["rows"]] == ["round-robin", "cache-aware"]
        for row in run["rows"]:
            for key in ("l1_hit_rate", "l2_hit_rate", "l3_hit_rate", "load_spread",
                        "pooled_hit_rate"):
                assert key in row
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("args,needle", [
    (["--replicas", "2", "--router", "random"], "unknown router 'random'"),
    (["--replicas", "2", "--policy", "opt"], "--policy opt"),
    (["--replicas", "2", "--ranks", "2"], "does not combine"),
    (["--replicas", "0"], "--replicas"),
])
def test_cli_fleet_bad_input(args, needle):
    r = runner.invoke(app, ["bench", "replay", DATA, "--limit", "10", *args])
    assert r.exit_code == 2, r.output
    assert needle in r.output and "Traceback" not in r.output


def test_the_pooled_replica_is_not_a_bound_under_lru(head):
    # A partition can keep streams from evicting each other: sessions kept apart on 16 small
    # replicas hit more than one LRU cache of their summed size (docs/fleet.md).
    cfg = ReplayConfig(l1_tokens=140_000, events=False)
    pooled = pooled_bound(head, cfg, 16)
    session = fleet_replay(head, cfg, 16, "session")
    assert session.hit_tokens > pooled.hit_tokens
    assert fleet_replay(head, cfg, 16, "round-robin").hit_tokens < pooled.hit_tokens


# ------------------------------------------------------------- session keys read from a trace

KEYED = [  # (hash_ids, session key); 10 and 30 lie on different replicas of a 2-replica ring
    ([10, 11], 7), ([30, 31], 7), ([10, 11], 7), ([30, 31], 7), ([30, 32], None)]


def _keyed_trace(path, field="session_id", key=lambda k: k):
    with open(path, "w") as f:
        for i, (ids, k) in enumerate(KEYED):
            row = {"timestamp": i, "input_length": B * len(ids), "output_length": 10,
                   "hash_ids": ids}
            if k is not None:
                row[field] = key(k)
            f.write(json.dumps(row) + "\n")
    return str(path)


def _check_keyed(res, first):
    # By first block, 2 replicas of 2 pages: [10,11] -> A, [30,31] -> B, the repeats hit
    # 2 blocks each, and the unkeyed [30,32] -> B (hits block 30): 5 blocks of 11 hit.
    a, b = first.replica_of[0], first.replica_of[1]
    assert a != b and first.replica_of == [a, b, a, b, b]
    assert first.hit_tokens == 5 * B
    # By the trace's key: the four keyed requests on one replica, which holds one of the two
    # prefixes at a time: each evicts the other, nothing hits; the unkeyed request falls back
    # to its first block (replica B): if that is the keyed replica it finds [30,31] there (1
    # block), else nothing.
    k = res.replica_of[0]
    assert res.replica_of[:4] == [k] * 4 and res.replica_of[4] == b
    assert res.hit_tokens == (B if k == b else 0)
    assert res.computed_tokens[k] >= 8 * B


def test_session_router_uses_the_traces_session_key(tmp_path):
    cfg = ReplayConfig(page_size=B, l1_tokens=2 * B, events=False)
    trace = load_trace(_keyed_trace(tmp_path / "t.jsonl"))
    assert trace.sessions.tolist() == [7, 7, 7, 7, -1]
    first = fleet_replay(crafted(*[ids for ids, _ in KEYED]), cfg, 2, "session")
    _check_keyed(fleet_replay(ReplayInput(trace), cfg, 2, "session"), first)
    for field, key in (("conversation_id", str), ("chat_id", lambda k: f"chat-{k}")):
        t = load_trace(_keyed_trace(tmp_path / f"{field}.jsonl", field, key))
        assert len(set(t.sessions[:4].tolist())) == 1 and t.sessions[4] == -1
        _check_keyed(fleet_replay(ReplayInput(t), cfg, 2, "session"), first)


def test_session_keys_survive_convert_trace_and_reach_the_cli(tmp_path):
    src = _keyed_trace(tmp_path / "t.jsonl", key=lambda k: f"user-{k}")
    runner.invoke(app, ["bench", "convert-trace", src, str(tmp_path / "t.parquet")],
                  catch_exceptions=False)
    a, b = load_trace(src), load_trace(str(tmp_path / "t.parquet"))
    assert b.sessions.tolist() == a.sessions.tolist() and a.sessions[0] != a.sessions[4] == -1
    outs = []
    for f in (src, str(tmp_path / "t.parquet")):
        r = runner.invoke(app, ["bench", "replay", f, "--page-size", str(B), "--l1-tokens",
                                str(2 * B), "--replicas", "2", "--router", "session",
                                "--format", "json"])
        assert r.exit_code == 0, r.output
        row = json.loads(r.stdout)["fleet"][0]["rows"][0]
        outs.append((row["computed_tokens"], row["token_hit_rate"]))
    assert outs[0] == outs[1]
    assert max(outs[0][0]) >= 8 * B                 # the keyed four on one replica


@pytest.mark.parametrize("value,needle", [
    (-1, "a session key must be an integer in [0, 2**63)"),
    ([1], "a session key must be an integer in [0, 2**63) or a string"),
    ("", "a string of 1..1024 characters"),
])
def test_a_bad_session_key_is_one_line(tmp_path, value, needle):
    p = tmp_path / "bad.jsonl"
    p.write_text(json.dumps({"timestamp": 0, "input_length": 10, "output_length": 1,
                             "hash_ids": [1], "session_id": value}) + "\n")
    r = runner.invoke(app, ["bench", "replay", str(p), "--replicas", "2", "--router",
                            "session"])
    assert r.exit_code == 1, r.output
    assert needle in r.stderr and "bad.jsonl:1:" in r.stderr and "Traceback" not in r.output
