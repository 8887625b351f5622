"""The ``hicache`` command: assembles the sub-commands, nothing else."""

from __future__ import annotations

import os

# Before torch loads: OpenMP threads that spin-wait collapse when another process (the load
# generator, a second server) shares the cores; passive waiting keeps the speed-up.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Likewise numpy's OpenBLAS: its threads spin 2**28 cycles (about 0.1 CPU-s) after starting, at
# every import, before they sleep; 2**4 makes them sleep at once (BLAS stays threaded).
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")

import typer  # noqa: E402

from hicache_cli import options  # noqa: E402,F401  (flags read as flags in --help)

app = typer.Typer(
    name="hicache",
    help="Hierarchical KV cache toolkit: benchmark the cache (bench), inspect radix-tree "
         "snapshots (inspect), check rank logs (consensus-check), convert L3 stores between layouts "
         "(convert-layout).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

# One line per command module; each module exposes ``register(app)``.
from hicache_cli import (
    cmd_bench,  # noqa: E402
    cmd_consensus,  # noqa: E402
    cmd_convert,  # noqa: E402
    cmd_inspect,  # noqa: E402
)

cmd_bench.register(app)
cmd_inspect.register(app)
cmd_consensus.register(app)
cmd_convert.register(app)


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            typer.echo(f"hicache {version('hicache')}")
        except PackageNotFoundError:
            typer.echo("hicache (not installed)")
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="Print the version and exit.")) -> None:
    """Hierarchical KV cache toolkit."""


def _click_errors() -> tuple:
    """The click exception modules typer raises from: recent typer versions vendor click
    (``typer._click``), older ones use click itself; both are caught."""
    import importlib

    mods = []
    for name in ("typer._click.exceptions", "click.exceptions"):
        try:
            mods.append(importlib.import_module(name))
        except ImportError:
            pass
    return tuple(mods)


def main() -> None:
    """The console entry point: typer's own handling, except that a usage error (unknown
    option, bad value, missing argument) is one line on stderr plus one hint line, exit 2,
    instead of a boxed panel."""
    import sys

    mods = _click_errors()

    def of(name: str) -> tuple:
        return tuple(getattr(m, name) for m in mods if hasattr(m, name))

    try:
        rv = app(standalone_mode=False)
    except of("NoArgsIsHelpError") as exc:     # a bare group: its help, as typer does
        ctx = getattr(exc, "ctx", None)
        sys.stdout.write((ctx.get_help() if ctx is not None else "") + "\n")
        sys.exit(2)
    except of("UsageError") as exc:
        ctx = getattr(exc, "ctx", None)
        path = ctx.command_path if ctx is not None else "hicache"
        sys.stderr.write(f"error: {exc.format_message()}\n")
        sys.stderr.write(f"hint: '{path} --help' lists the options\n")
        sys.exit(exc.exit_code)
    except of("ClickException") as exc:
        sys.stderr.write(f"error: {exc.format_message()}\n")
        sys.exit(exc.exit_code)
    except of("Abort"):
        sys.stderr.write("error: aborted\n")
        sys.exit(1)
    sys.exit(rv if isinstance(rv, int) else 0)


if __name__ == "__main__":
    main()
