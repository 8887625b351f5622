"""The server's storage layout option: unified (default) and legacy per-rank keys.

Each check compares greedy output with the uncached output of the same prompt: a wrong restore
would show up as different tokens. The second server of each pair is a fresh process-local engine
over the same store directory, so its hits can only come from L3.
"""

from __future__ import annotations

import os

import pytest

from engine.runtime.launch import ServerConfig, start_server
from tests.test_server_storage import BASE, generate


@pytest.fixture(scope="module")
def uncached():
    with start_server(ServerConfig(port=0, l1_tokens=2048, l2_tokens=0,
                                   disable_radix_cache=True)) as s:
        return generate(s.url)["output_ids"]


def served(tmp_path, **kw) -> dict:
    cfg = ServerConfig(**BASE, hicache_storage_backend="file", hicache_storage_dir=str(tmp_path),
                       hicache_storage_prefetch_policy="wait_complete", **kw)
    with start_server(cfg) as s:
        return generate(s.url)


def object_names(root) -> list[str]:
    return sorted(f for d, _, fs in os.walk(os.path.join(root, "objects")) for f in fs)


def test_legacy_layout_round_trips_and_unified_readers_miss_it(tmp_path, uncached):
    first = served(tmp_path, hicache_storage_layout="legacy")
    assert first["output_ids"] == uncached
    names = object_names(tmp_path)
    assert names and all(n.endswith(".tp0of1.pp0of1") for n in names)
    again = served(tmp_path, hicache_storage_layout="legacy")
    assert again["meta_info"]["cached_tokens_details"]["storage"] > 0
    assert again["output_ids"] == uncached
    other = served(tmp_path)                       # unified: other keys, a miss
    assert other["meta_info"]["cached_tokens_details"]["storage"] == 0
    assert other["output_ids"] == uncached


def test_unified_layout_grid_is_part_of_the_key(tmp_path, uncached):
    served(tmp_path, hicache_storage_grid="layers=1,heads=1")
    names = object_names(tmp_path)
    assert names and all(".l" in n and ".h" in n for n in names)
    same = served(tmp_path, hicache_storage_grid="layers=1,heads=1")
    assert same["meta_info"]["cached_tokens_details"]["storage"] > 0
    assert same["output_ids"] == uncached
    other = served(tmp_path)                       # the default grid: another namespace
    assert other["meta_info"]["cached_tokens_details"]["storage"] == 0


def test_bad_layout_options_are_refused():
    with pytest.raises(ValueError, match="storage layout"):
        ServerConfig(**BASE, hicache_storage_layout="diagonal")
    with pytest.raises(ValueError, match="bad grid"):
        ServerConfig(**BASE, hicache_storage_grid="layers=two")
    with pytest.raises(ValueError, match="unified layout only"):
        ServerConfig(**BASE, hicache_storage_layout="legacy", hicache_storage_grid="tp=2")


def test_legacy_store_converted_to_unified_is_hit(tmp_path, uncached):
    from typer.testing import CliRunner

    from hicache_cli.app import app

    legacy = tmp_path / "legacy"
    served(legacy, hicache_storage_layout="legacy")
    res = CliRunner().invoke(app, ["convert-layout", str(legacy), str(tmp_path / "unified"),
                                   "--to", "unified", "--verify"])
    assert res.exit_code == 0, res.output
    out = served(tmp_path / "unified")
    assert out["meta_info"]["cached_tokens_details"]["storage"] > 0
    assert out["output_ids"] == uncached


@pytest.mark.parametrize("hops", [
    ["unified:layers=1,heads=1+page_first", "unified"],
    ["legacy:tp=2,pp=1+page_first", "unified:layers=4,heads=1+page_first", "unified"],
    ["unified:layers=1,heads=1", "legacy:tp=2,pp=2", "unified"],
])
def test_server_on_a_converted_store_answers_as_a_fresh_run(tmp_path, uncached, hops):
    """The store a server wrote, converted through other grids and byte orders and back to the
    layout servers read: a fresh server hits it in L3 and answers as the unconverted store and
    an uncached run do."""
    from typer.testing import CliRunner

    from hicache_cli.app import app

    first = served(tmp_path / "s0")
    assert first["output_ids"] == uncached
    unconverted = served(tmp_path / "s0")
    assert unconverted["meta_info"]["cached_tokens_details"]["storage"] > 0
    for i, to in enumerate(hops):
        res = CliRunner().invoke(app, ["convert-layout", str(tmp_path / f"s{i}"),
                                       str(tmp_path / f"s{i + 1}"), "--to", to, "--verify"])
        assert res.exit_code == 0, res.output
    out = served(tmp_path / f"s{len(hops)}")
    assert out["meta_info"]["cached_tokens_details"]["storage"] == \
        unconverted["meta_info"]["cached_tokens_details"]["storage"]
    assert out["output_ids"] == unconverted["output_ids"] == uncached
