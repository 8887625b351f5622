"""The CLI's shared pieces: error table, option parsing, enum choices, thin command modules."""

import ast
import pathlib

import pytest
import typer

from engine.cache.policy import PolicyName, policy_names
from engine.core.errors import UsageError
from hicache_cli.options import policy_list, token_counts, usage
from hicache_cli.output import EXIT_ERROR, EXIT_USAGE, handle_errors

CLI = pathlib.Path(__file__).resolve().parent.parent / "hicache_cli"


def _exit_code(exc: BaseException) -> int:
    @handle_errors
    def cmd() -> None:
        raise exc

    with pytest.raises(typer.Exit) as e:
        cmd()
    return e.value.exit_code


def test_internal_value_error_is_not_a_usage_error(capsys):
    assert _exit_code(ValueError("a bug")) == EXIT_ERROR
    assert "internal error" in capsys.readouterr().err
    assert _exit_code(UsageError("--x: bad")) == EXIT_USAGE
    with pytest.raises(UsageError, match="--flag: nope"):
        with usage("--flag"):
            raise ValueError("nope")


def test_token_counts_and_policy_lists():
    assert token_counts("--c", "640k, 1.28m,2g") == [640_000, 1_280_000, 2_000_000_000]
    for bad in ("abc", "1e400", "0"):
        with pytest.raises(UsageError, match="--c"):
            token_counts("--c", bad)
    names = policy_names(include_offline=True)
    assert policy_list("--p", ",".join(reversed(names)) + "," + names[0]) == names[::-1]
    with pytest.raises(UsageError, match="'nope' is not an eviction policy"):
        policy_list("--p", "lru,nope")


def test_policy_choice_is_the_registry():
    # --policy/--eviction-policy offer the engine's PolicyName: it must name every registered
    # policy, or a new one could not be chosen from the command line
    assert {m.value for m in PolicyName} == set(policy_names(include_offline=True))


def test_no_command_module_function_over_60_lines():
    long = []
    for path in CLI.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > 60:
                    long.append(f"{path.relative_to(CLI)}:{node.name} ({n} lines)")
    assert not long, long
