"""Options several commands share, declared once, and how option values are read.

Each alias is an ``Annotated`` type a command uses as ``page_size: PageSize = 64``: the flag, its
range and its help live here, the default with the command. Choices are the engine's own enums
(``WritePolicy``, ``PolicyName``), so a new value appears in every command without a copy.
Range checks are typer's (exit 2 with the flag named); what typer cannot check is a
:class:`~engine.core.errors.UsageError` (exit 2), raised here or by :func:`usage`.

Also: typer's rich help prints a value type beside every option, so an on/off flag read
``--sweep <bool>`` as if it took a value; a flag's type column is left empty.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Annotated, Iterator, Optional

import typer
import typer.core
import typer.rich_utils

from engine.cache.policy import PolicyName, policy_names
from engine.cache.types import WritePolicy
from engine.core.errors import UsageError
from hicache_cli.output import OutputFormat

Format = Annotated[OutputFormat, typer.Option("--format", help="human or json.")]
PageSize = Annotated[int, typer.Option("--page-size", min=1, help="Tokens per KV page.")]
L1Tokens = Annotated[int, typer.Option("--l1-tokens", min=1,
                                       help="L1 (device) KV capacity in tokens.")]
L2Tokens = Annotated[int, typer.Option("--l2-tokens", min=0,
                                       help="L2 (host) KV capacity in tokens; 0 = no L2.")]
L3Tokens = Annotated[int, typer.Option("--l3-tokens", min=-1,
                                       help="L3 (storage) capacity in tokens; 0 = no L3, -1 = "
                                            "unbounded. Needs --l2-tokens > 0.")]
# One name per concept across commands, the other command's spelling as an alias: replay's
# --policy is bench serve's --eviction-policy, its --write-policy serve's --hicache-write-policy.
Policy = Annotated[PolicyName, typer.Option("--policy", "--eviction-policy",
                                            help="Eviction policy (opt: Belady's offline bound, "
                                                 "replay only).")]
WritePolicyOpt = Annotated[WritePolicy, typer.Option("--write-policy", "--hicache-write-policy",
                                                     help="When L1 pages are copied to L2.")]
Limit = Annotated[Optional[int], typer.Option("--limit", min=1,
                                              help="Only the first N requests of the trace.")]
RankLogDir = Annotated[Optional[Path], typer.Option(
    "--rank-log-dir", help="Write this rank's log of cache decisions there (for `hicache "
                           "consensus-check`).")]
InjectDivergence = Annotated[Optional[str], typer.Option(
    "--inject-divergence", help="Debug: break this rank's recorded decisions, e.g. "
    "'hit_length@rank=1,step=30' (kinds: hit_length, restore_completion, lock_order, "
    "eviction_eligibility, pp_ack, missing_events).")]
NNodes = Annotated[int, typer.Option("--nnodes", min=1, help="Hosts the ranks spread over, "
                                     "evenly (run the same command on each host, with its "
                                     "--node-rank).")]
NodeRank = Annotated[int, typer.Option("--node-rank", min=0, help="This host's index (0 … "
                                       "--nnodes-1); node 0 hosts the rendezvous and rank 0.")]
DistInitAddr = Annotated[Optional[str], typer.Option(
    "--dist-init-addr", help="HOST:PORT of the rendezvous on node 0 (needed with --nnodes > "
                             "1).")]
Progress = Annotated[bool, typer.Option("--progress", help="Progress bar even with --format "
                                                           "json.")]


@contextlib.contextmanager
def usage(flag: str = "") -> Iterator[None]:
    """Around code that checks values straight from the command line (a config built from the
    options): its ``ValueError`` is a usage error (exit 2), not an internal one."""
    try:
        yield
    except ValueError as exc:
        raise UsageError(f"{flag}: {exc}" if flag else str(exc)) from None


MAX_TOKEN_COUNT = 10 ** 15


def token_counts(flag: str, text: str) -> list[int]:
    """``'640k,1.28m,2g'`` → token counts (k, m, g are 10**3, 10**6, 10**9), each >= 1."""
    out = []
    for part in text.split(","):
        word = part.strip().lower().replace("_", "")
        mult = 1
        for suffix, m in (("k", 1_000), ("m", 1_000_000), ("g", 1_000_000_000)):
            if word.endswith(suffix):
                word, mult = word[:-1], m
        try:
            val = int(float(word) * mult)
        except (ValueError, OverflowError):
            raise UsageError(f"{flag}: {word!r} is not a token count") from None
        if val < 1:
            raise UsageError(f"{flag}: capacities must be >= 1, got {val}")
        if val > MAX_TOKEN_COUNT:
            raise UsageError(f"{flag}: capacities must be at most {MAX_TOKEN_COUNT:,} tokens, "
                             f"got {word}{part.strip()[len(word):]}")
        out.append(val)
    return out


def policy_list(flag: str, text: str) -> list[str]:
    """``'lru,opt'`` → registered eviction-policy names, in order, without repeats (a name may
    carry hint signals, ``lru+session-end``: checked by the sweep)."""
    known = policy_names(include_offline=True)
    names = [p.strip() for p in text.split(",") if p.strip()]
    if not names:
        raise UsageError(f"{flag}: name at least one policy")
    bad = [p for p in names if p.partition("+")[0] not in known]
    if bad:
        raise UsageError(f"{flag}: {bad[0]!r} is not an eviction policy; choose from "
                         f"{', '.join(known)}")
    return list(dict.fromkeys(names))


# A flag's help row shows no type (``--verify`` rather than ``--verify BOOLEAN``). A private
# hook of typer's rich help, present in the versions pinned here; with other typer versions the
# help just keeps typer's own rendering.
_display_type_rich = getattr(typer.core.TyperOption, "display_type_rich", None)


def _flag_shows_no_type(self, ctx):  # type: ignore[no-untyped-def]
    if getattr(self, "is_flag", False) and not getattr(self, "count", False):
        return None
    return _display_type_rich(self, ctx)


if _display_type_rich is not None:
    typer.core.TyperOption.display_type_rich = _flag_shows_no_type  # type: ignore[method-assign]


# Narrow terminals (80 columns, or help piped where rich assumes 80): typer's option table has
# one column for the names and cuts a long one ("--hicache-storage…"). When the longest names,
# the longest type and _HELP_MIN columns of help do not fit side by side, each option is printed
# stacked instead — its names and type on one line (folded, never cut), its help indented
# below — so every flag stays readable. A private hook of typer's, patched only where it exists
# with the signature used here; elsewhere typer's own rendering is kept.
_HELP_MIN = 40
_options_panel = getattr(typer.rich_utils, "_print_options_panel", None) \
    if hasattr(typer, "rich_utils") else None


def _stacked_options_panel(*, name, params, ctx, markup_mode, console):  # type: ignore[no-untyped-def]
    def names_of(p) -> str:  # type: ignore[no-untyped-def]
        return ",".join([*p.opts, *p.secondary_opts])

    def type_of(p) -> str:  # type: ignore[no-untyped-def]
        shown = p.display_type_rich(ctx=ctx) if hasattr(p, "display_type_rich") else None
        bounds = p._get_number_range_help_str() if hasattr(p, "_get_number_range_help_str") \
            else ""
        return (shown or "") + (typer.rich_utils.RANGE_STRING.format(bounds) if bounds else "")

    # one decision for every panel of the command (typer sizes each panel's name column apart)
    every = [p for p in getattr(ctx.command, "params", params) if not getattr(p, "hidden", False)
             and getattr(p, "opts", None)] or params
    need = max((len(names_of(p)) for p in every), default=0) + \
        max((len(type_of(p)) for p in every), default=0) + _HELP_MIN + 8
    if console.width >= need or not params:
        return _options_panel(name=name, params=params, ctx=ctx, markup_mode=markup_mode,
                              console=console)
    from rich.padding import Padding
    from rich.panel import Panel
    from rich.table import Table
    from rich.text import Text

    ru = typer.rich_utils
    grid = Table.grid(expand=True)
    grid.add_column(overflow="fold")
    for param in params:
        names = ", ".join([*param.opts, *param.secondary_opts])
        if isinstance(param, typer.core.TyperArgument):
            names = param.display_name_raw or names
        line = Text(names, style=ru.STYLE_OPTION, overflow="fold")
        if type_of(param):
            line.append(" " + type_of(param), style=ru.STYLE_TYPES)
        if getattr(param, "required", False):
            line.append(" " + ru.REQUIRED_LONG_STRING, style=ru.STYLE_REQUIRED_LONG)
        grid.add_row(line)
        grid.add_row(Padding(ru._get_parameter_help(param=param, ctx=ctx,
                                                    markup_mode=markup_mode), (0, 0, 0, 4)))
    console.print(Panel(grid, border_style=ru.STYLE_OPTIONS_PANEL_BORDER, title=name,
                        title_align=ru.ALIGN_OPTIONS_PANEL))


if _options_panel is not None and {"name", "params", "ctx", "markup_mode", "console"} <= set(
        __import__("inspect").signature(_options_panel).parameters):
    typer.rich_utils._print_options_panel = _stacked_options_panel
