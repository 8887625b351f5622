"""L3 across TP shapes through the real server (docs/storage.md, docs/parallelism.md §3): each
TP rank reads and writes the objects of its kv-heads, so a unified store written by ``--tp 2``
serves ``--tp 1`` and the reverse, and a legacy per-rank store written by ``--tp 2`` serves
``--tp 1`` once ``convert-layout --to unified`` has rewritten it. Every check compares greedy
output with the uncached output of the same prompt, and each reader is a fresh server, so its
hits can only come from L3."""

from __future__ import annotations

import os

import pytest
from typer.testing import CliRunner

from engine.runtime.launch import ServerConfig, start_server
from hicache_cli.app import app
from tests.test_server_storage import BASE, generate
from tests.test_server_storage_layout import object_names


@pytest.fixture(scope="module")
def uncached():
    with start_server(ServerConfig(port=0, l1_tokens=2048, l2_tokens=0,
                                   disable_radix_cache=True)) as s:
        return generate(s.url)["output_ids"]


def served(store, tp: int, **kw) -> dict:
    cfg = ServerConfig(**BASE, tp=tp, hicache_storage_backend="file",
                       hicache_storage_dir=str(store),
                       hicache_storage_prefetch_policy="wait_complete", **kw)
    with start_server(cfg) as s:
        return generate(s.url)


def storage_hit(out: dict) -> int:
    return out["meta_info"]["cached_tokens_details"]["storage"]


@pytest.mark.parametrize("writer,reader", [(2, 1), (1, 2)])
def test_a_unified_store_written_by_one_tp_shape_serves_another(tmp_path, uncached, writer,
                                                                reader):
    logs = tmp_path / "logs"               # the TP 2 run's rank logs
    first = served(tmp_path / "l3", writer, **({"rank_log_dir": str(logs)} if writer > 1 else {}))
    assert first["output_ids"] == uncached and storage_hit(first) == 0
    again = served(tmp_path / "l3", reader, **({"rank_log_dir": str(logs)} if reader > 1 else {}))
    assert storage_hit(again) > 0
    assert again["output_ids"] == uncached
    # the TP 2 run's ranks took the same decisions, L3 ones included
    res = CliRunner().invoke(app, ["consensus-check", str(logs), "--format", "json"])
    assert res.exit_code == 0, res.output


def test_a_legacy_tp2_store_converted_to_unified_serves_tp1(tmp_path, uncached):
    legacy, unified = tmp_path / "legacy", tmp_path / "unified"
    first = served(legacy, 2, hicache_storage_layout="legacy")
    assert first["output_ids"] == uncached
    names = object_names(legacy)
    ranks = {n.rsplit(".", 2)[-2] for n in names}
    assert ranks == {"tp0of2", "tp1of2"}                  # one object per page and rank
    same = served(legacy, 2, hicache_storage_layout="legacy")     # legacy reads its own
    assert storage_hit(same) > 0 and same["output_ids"] == uncached
    res = CliRunner().invoke(app, ["convert-layout", str(legacy), str(unified), "--to",
                                   "unified", "--verify"])
    assert res.exit_code == 0, res.output
    out = served(unified, 1)
    assert storage_hit(out) > 0
    assert out["output_ids"] == uncached
    assert os.path.isdir(legacy / "objects")              # the source is left as it was
    assert object_names(legacy) == names


def test_ranks_agree_on_what_the_store_holds(tmp_path, uncached):
    """Rank 1's objects are gone, rank 0's are there: the ranks agree on the pages every rank's
    store holds (none), so neither restores and the output is the uncached one (without the
    agreement rank 0 would restore the prefix and rank 1 compute it: different batches)."""
    store = tmp_path / "l3"
    served(store, 1)
    gone = [os.path.join(d, f) for d, _, fs in os.walk(store / "objects") for f in fs
            if f.endswith(".h1-2")]
    assert gone
    for f in gone:
        os.remove(f)
    out = served(store, 2, rank_log_dir=str(tmp_path / "logs"))
    assert storage_hit(out) == 0
    assert out["output_ids"] == uncached
    res = CliRunner().invoke(app, ["consensus-check", str(tmp_path / "logs")])
    assert res.exit_code == 0, res.output


def test_mla_tp2_keeps_the_latent_whole_and_shares_the_store_with_tp1(tmp_path):
    """tiny-mla: TP shards the query heads and keeps the latent replicated, so every rank
    caches (and stores) the whole latent; a --tp 2 store serves --tp 1, outputs equal."""
    mla = dict(model="tiny-mla", page_size=16)
    with start_server(ServerConfig(port=0, l1_tokens=2048, l2_tokens=0,
                                   disable_radix_cache=True, **mla)) as s:
        ref = generate(s.url)["output_ids"]
    store = dict(hicache_storage_backend="file", hicache_storage_dir=str(tmp_path),
                 hicache_storage_prefetch_policy="wait_complete")
    with start_server(ServerConfig(**{**BASE, **mla}, tp=2, **store)) as s:
        first, again = generate(s.url), generate(s.url)
    assert first["output_ids"] == again["output_ids"] == ref
    assert again["meta_info"]["cached_tokens_details"]["device"] > 0
    assert all(".h" not in n for n in object_names(tmp_path))     # MLA keys: layers only
    with start_server(ServerConfig(**{**BASE, **mla}, **store)) as s:
        out = generate(s.url)
    assert storage_hit(out) > 0 and out["output_ids"] == ref
