"""ServerConfig's concerns (engine/runtime/config.py): every field in exactly one group, every
``bench serve`` option mapped onto a field of the same name (the CLI→config mapping is derived,
not typed out), each group one help panel, and the mode-combination table refuses what it says."""

from __future__ import annotations

import dataclasses

import pytest

from engine.runtime.config import FIELD_GROUP, GROUP_TITLES, GROUPS, MODE_RULES, ServerConfig


def test_every_field_sits_in_exactly_one_group():
    names = [f.name for f in dataclasses.fields(ServerConfig)]
    grouped = [f for g in GROUPS.values() for f in g]
    assert sorted(grouped) == sorted(names), set(grouped) ^ set(names)
    assert len(grouped) == len(set(grouped))
    assert set(GROUP_TITLES) == set(GROUPS)
    cfg = ServerConfig(tp=2)
    assert cfg.group("parallel")["tp"] == 2 and set(cfg.group("pd")) == set(GROUPS["pd"])


def test_every_serve_option_is_a_config_field_in_its_groups_panel():
    import typing

    from hicache_cli.bench.serve_cmd import CLI_ONLY, serve_cmd

    hints = typing.get_type_hints(serve_cmd, include_extras=True)
    for name, hint in hints.items():
        if name in CLI_ONLY or name == "return":
            continue
        assert name in FIELD_GROUP, f"--{name.replace('_', '-')}: no ServerConfig field {name}"
        info = hint.__metadata__[0]
        assert info.rich_help_panel == GROUP_TITLES[FIELD_GROUP[name]], name


@pytest.mark.parametrize("rule", MODE_RULES, ids=lambda r: f"{r.first} + {r.second}")
def test_each_mode_rule_refuses_its_combination(rule):
    kw = {"--tp > 1": dict(tp=2), "--cp > 1": dict(cp=2), "--pp > 1": dict(pp=2),
          "--disaggregation": dict(disaggregation="pd"),
          "--debug-transfer-delay": dict(debug_transfer_delay="0:1"),
          "--pp-micro-batches": dict(pp_micro_batches=2)}[rule.first]
    kw.update({"P/D disaggregation": dict(disaggregation="pd"),
               "--disaggregation": dict(disaggregation="pd"),
               "speculative decoding": dict(speculative_num_draft_tokens=2),
               "the memory L3 backend": dict(hicache_storage_backend="memory"),
               "--pp 1": {}}[rule.second])
    with pytest.raises(ValueError) as e:
        ServerConfig(**kw)
    assert str(e.value) == rule.message()
