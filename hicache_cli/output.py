"""One output helper for ``--format human|json`` and one error table for every command.

Data goes to stdout, diagnostics to stderr. Exit codes: 0 ok, 1 error, 2 usage, 3 a check
found a problem. A user error is one line on stderr, never a traceback.
"""

from __future__ import annotations

import enum
import functools
import json
import sys
from typing import Any, Callable, NoReturn

import typer
from rich.console import Console

from engine.core.errors import CheckFailed, HiCacheError, InputError, UsageError
from formats.errors import FormatError

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_CHECK = 0, 1, 2, 3

stdout = Console(highlight=False, soft_wrap=True)
stderr = Console(stderr=True, highlight=False, soft_wrap=True)


class OutputFormat(str, enum.Enum):
    human = "human"
    json = "json"


def emit_json(obj: Any) -> None:
    """Write one JSON document to stdout (plain print: no rich markup or wrapping)."""
    sys.stdout.write(json.dumps(obj, indent=2, sort_keys=False, default=_json_default) + "\n")
    sys.stdout.flush()


def _json_default(o: Any) -> Any:
    if isinstance(o, enum.Enum):
        return o.value
    if hasattr(o, "tolist"):
        return o.tolist()
    if isinstance(o, (set, frozenset)):
        return sorted(o)
    if isinstance(o, bytes):
        return o.hex()
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def fail(message: str, code: int = EXIT_ERROR) -> NoReturn:
    from rich.markup import escape

    # messages are plain text: a bracket in one (a gloo error names "[host]:port") is not markup
    stderr.print(f"[bold red]error:[/] {escape(message)}", markup=True, highlight=False)
    raise typer.Exit(code)


# exception type -> exit code; first match wins (most specific first)
# A ValueError is not in the table: code raises it for misuse by code, so one that reaches a
# command is a bug (one line, exit 1). What the user got wrong is a UsageError (exit 2).
ERROR_TABLE: list[tuple[type[BaseException], int]] = [
    (CheckFailed, EXIT_CHECK),
    (UsageError, EXIT_USAGE),
    (InputError, EXIT_ERROR),
    (FormatError, EXIT_ERROR),
    (HiCacheError, EXIT_ERROR),
    (FileNotFoundError, EXIT_ERROR),
    (IsADirectoryError, EXIT_ERROR),
    (PermissionError, EXIT_ERROR),
    (OSError, EXIT_ERROR),
]


def handle_errors(fn: Callable) -> Callable:
    """Decorator for command functions: map known exceptions to a one-line message + exit code."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (typer.Exit, typer.Abort, KeyboardInterrupt):
            raise
        except tuple(t for t, _ in ERROR_TABLE) as exc:  # type: ignore[misc]
            for typ, code in ERROR_TABLE:
                if isinstance(exc, typ):
                    msg = str(exc) or type(exc).__name__
                    if isinstance(exc, OSError) and exc.filename is not None:
                        msg = f"{exc.strerror or msg}: {exc.filename}"
                    fail(msg, code)
            raise
        except ValueError as exc:
            fail(f"internal error ({type(exc).__name__}): {exc}", EXIT_ERROR)

    return wrapper
