"""``hicache inspect SNAPSHOT…``: what a radix-tree snapshot holds, where, and why.

Views: summary + tree (default), ``--hot``, ``--prefix``, ``--owners``, ``--diff``, ``--check``.
The numbers come from :mod:`engine.snapshot.views`, the output from
:mod:`hicache_cli.inspect_render`; this module reads the options.
"""

from __future__ import annotations

import enum
import re
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from engine.core.errors import UsageError
from hicache_cli import inspect_render as render
from hicache_cli.output import EXIT_CHECK, emit_json, fail, handle_errors, stdout

DEFAULT_MAX_VIOLATIONS = 30
_IDS = re.compile(r"^\s*[-+]?\d+(\s*,\s*[-+]?\d+)*\s*,?\s*$")


class InspectFormat(str, enum.Enum):
    human = "human"
    json = "json"
    dot = "dot"


def parse_prompt(text: str) -> list[int]:
    """``"1,2,3"`` → token ids; anything else is text, encoded by the byte-level tokenizer
    (UTF-8 bytes, BOS first) as the server encodes a prompt of the preset models."""
    if _IDS.match(text):
        ids = [int(x) for x in text.replace(" ", "").strip(",").split(",")]
        if any(not 0 <= i <= 0xFFFFFFFF for i in ids):
            raise UsageError("--prefix: token ids must be in [0, 2**32)")
        return ids
    from engine.runtime.tokenizer import ByteTokenizer

    return ByteTokenizer().encode(text)


# ------------------------------------------------------------------------------ command
_O = typer.Option
Snapshots = Annotated[list[Path], typer.Argument(metavar="SNAPSHOT", help="Tree snapshot "
                                                 "file(s) (bench replay --dump-tree, POST "
                                                 "/dump_tree, …).")]
Depth = Annotated[int, _O("--depth", help="Tree view: levels shown below each root before "
                                          "collapsing.")]
MaxChildren = Annotated[int, _O("--max-children", help="Tree view: children shown per node "
                                                       "(largest subtrees first).")]
Hot = Annotated[Optional[int], _O("--hot", metavar="N", help="The N prefixes with the most "
                                                             "reuse (hits × length), with tiers.")]
Prefix = Annotated[Optional[str], _O("--prefix", metavar="TOKENS|TEXT", help="Where this prompt "
                                     "would hit (L1/L2/L3): comma-separated token ids, or text "
                                     "(byte tokenizer).")]
Namespace = Annotated[Optional[str], _O("--namespace", help="Namespace for --prefix, as inspect "
                                        "shows it: a bare name, or fields such as "
                                        "'cache_salt=\"A\" lora_path=\"X\"'.")]
Owners = Annotated[bool, _O("--owners", help="CP owner distribution and rotation segments.")]
Diff = Annotated[Optional[Path], _O("--diff", metavar="OTHER", help="Pages in one snapshot and "
                                    "not the other, and tier changes (by token path).")]
ExpectSame = Annotated[bool, _O("--expect-same", help="With --diff: exit 3 when the snapshots "
                                                      "differ (ranks that must agree).")]
Check = Annotated[bool, _O("--check", help="Run the invariant checker; exit 3 naming the "
                                           "violated invariant.")]
MaxViolations = Annotated[int, _O("--max-violations", metavar="N", help="With --check: list at "
                                  "most N violations (the total is always counted).")]
Fmt = Annotated[InspectFormat, _O("--format", help="human, json, or dot (Graphviz, tree "
                                                   "view).")]


def inspect_cmd(
    snapshots: Snapshots, depth: Depth = 3, max_children: MaxChildren = 8, hot: Hot = None,
    prefix: Prefix = None, namespace: Namespace = None, owners: Owners = False,
    diff: Diff = None, expect_same: ExpectSame = False, check: Check = False,
    max_violations: MaxViolations = DEFAULT_MAX_VIOLATIONS,
    fmt: Fmt = InspectFormat.human,
) -> None:
    """Inspect radix-tree snapshots: summary and tree (default), hot prefixes, prompt hits,
    CP owners, diff, invariant check.

    Example: hicache inspect tree.snapshot --hot 10 --prefix 'Hello' --check
    """
    from engine.snapshot import views as sv
    from engine.snapshot.take import load_snapshot

    views = [v for v, on in (("hot", hot is not None), ("prefix", prefix is not None),
                             ("owners", owners), ("diff", diff is not None),
                             ("check", check)) if on]
    _check_args(depth, max_children, max_violations, hot, expect_same, diff, fmt, views)
    views = views or ["summary", "tree"]
    prompt = parse_prompt(prefix) if prefix is not None else None
    other = load_snapshot(diff) if diff is not None else None
    trees = [load_snapshot(p) for p in snapshots]
    compute = {
        "summary": sv.summary,
        "tree": lambda snap: sv.top(snap, depth=depth, max_children=max_children),
        "hot": lambda snap: sv.hot(snap, hot),
        "prefix": lambda snap: sv.match(snap, prompt, namespace),
        "owners": sv.owners,
        "diff": lambda snap: sv.diff(snap, other),
        "check": lambda snap: check_result(snap, max_violations),
    }
    results = [{"snapshot": sv.info(snap), **{v: compute[v](snap) for v in views}}
               for snap in trees]
    _render(trees, results, views, fmt)
    _verdict(trees, results, diff if expect_same else None)


def _check_args(depth: int, max_children: int, max_violations: int, hot: Optional[int],
                expect_same: bool, diff: Optional[Path], fmt: InspectFormat,
                views: list[str]) -> None:
    if depth < 0 or max_children < 1:
        raise UsageError("--depth must be >= 0 and --max-children >= 1")
    if max_violations < 1:
        raise UsageError(f"--max-violations must be >= 1, got {max_violations}")
    if hot is not None and hot < 1:
        raise UsageError(f"--hot must be >= 1, got {hot}")
    if expect_same and diff is None:
        raise UsageError("--expect-same needs --diff OTHER")
    if fmt is InspectFormat.dot and views:
        raise UsageError("--format dot renders the tree view only; drop --" + views[0])


def _render(trees: list, results: list[dict], views: list[str], fmt: InspectFormat) -> None:
    if fmt is InspectFormat.json:
        emit_json(results[0] if len(results) == 1 else results)
    elif fmt is InspectFormat.dot:
        for snap, res in zip(trees, results):
            stdout.out(render.render_dot(res["tree"], snap.path), end="", highlight=False)
    else:
        for k, (snap, res) in enumerate(zip(trees, results)):
            if k:
                render.blank()
            render.render_info(res["snapshot"])
            for v in views:
                render.blank()
                render.RENDER[v](res[v], snap)


def _verdict(trees: list, results: list[dict], expect_same_as: Optional[Path]) -> None:
    """Exit 3 for a violated invariant, or for snapshots that differ under --expect-same."""
    failed = [(snap.path, res["check"]) for snap, res in zip(trees, results)
              if res.get("check", {}).get("violation_count")]
    if failed:
        total = sum(c["violation_count"] for _, c in failed)
        more = f" (+{total - 1:,} more)" if total > 1 else ""
        fail(f"invariant violated: {failed[0][0]}: {failed[0][1]['violations'][0]}{more}",
             EXIT_CHECK)
    differ = [snap.path for snap, res in zip(trees, results)
              if "diff" in res and not res["diff"]["same"]]
    if expect_same_as is not None and differ:
        fail(f"{differ[0]} and {expect_same_as} differ", EXIT_CHECK)


def register(app: typer.Typer) -> None:
    app.command("inspect")(handle_errors(inspect_cmd))


def check_result(snap: Any, max_violations: int = DEFAULT_MAX_VIOLATIONS) -> dict:
    """The invariant checker on a loaded snapshot (``checkers.snapshot_checks``): the first
    ``max_violations`` messages and the total count."""
    from checkers.snapshot_checks import check_snapshot

    problems = check_snapshot(snap)
    return {"ok": not problems, "violation_count": len(problems),
            "violations": problems[:max_violations]}
