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
class InspectFormat(str, enum.Enum):
    human = "human"
    json = "json"
    dot = "dot"


_IDS = re.compile(r"^\s*\d+(\s*-\s*\d+)?(\s*,\s*\d+(\s*-\s*\d+)?)*\s*,?\s*$")
_SIGNED = re.compile(r"^\s*[-+]?\d+(\s*,\s*[-+]?\d+)*\s*,?\s*$")
_ID_LIKE = re.compile(r"^[\d\s,.\-+…]+$")
MAX_PROMPT_IDS = 1 << 22
"""Token ids ``--prefix`` takes at most (ranges included)."""


def parse_prompt(text: str, encoder: "Any" = None) -> list[int]:
    """``"1,2,3"`` or ``"0-511,1380864-1382399"`` (inclusive ranges) → token ids; anything else
    is text, encoded by what ``encoder()`` returns (asked only for text; None or a None answer:
    the byte-level tokenizer of the preset models, UTF-8 bytes with BOS first). Ids elided with
    ``…`` or ``...`` are refused, not read as text."""
    if _SIGNED.match(text) and not _IDS.match(text):
        raise UsageError("--prefix: token ids must be in [0, 2**32)")
    if _IDS.match(text):
        ids: list[int] = []
        for part in text.replace(" ", "").strip(",").split(","):
            lo, _, hi = part.partition("-")
            a, b = int(lo), int(hi or lo)
            if not (0 <= a <= 0xFFFFFFFF and 0 <= b <= 0xFFFFFFFF):
                raise UsageError("--prefix: token ids must be in [0, 2**32)")
            if b < a:
                raise UsageError(f"--prefix: range {part} runs backwards")
            if len(ids) + b - a + 1 > MAX_PROMPT_IDS:
                raise UsageError(f"--prefix: more than {MAX_PROMPT_IDS} token ids")
            ids.extend(range(a, b + 1))
        return ids
    if _ID_LIKE.match(text) and any(c.isdigit() for c in text):
        raise UsageError(f"--prefix {text[:40]!r}: looks like token ids but is not a list of ids "
                         f"or ranges (write 0-511 for a run of ids, not 0,1,…,511)")
    encode = encoder() if encoder is not None else None
    if encode is None:
        from engine.runtime.tokenizer import ByteTokenizer

        encode = ByteTokenizer().encode
    return list(encode(text))


def text_encoder(meta: dict, tokenizer: "str | None") -> Any:
    """How ``--prefix`` text is encoded for a snapshot whose header ``meta`` names the model the
    server ran (``model_path``): a preset's byte tokenizer; the model's own tokenizer for
    smollm2-135m or when ``--tokenizer`` names a model or checkpoint directory. A snapshot of a
    checkpoint directory or GGUF file names a path of another machine (and an untrusted file
    must not make us read one): text then needs ``--tokenizer``."""
    from engine.runtime.model.config import PRESETS
    from engine.runtime.model.gguf_loader import SMOLLM2

    spec = tokenizer or meta.get("model_path")
    if spec is None or (tokenizer is None and spec in PRESETS):
        return None                             # bytes: presets, and snapshots of old servers
    if tokenizer is None and spec != SMOLLM2:
        raise UsageError(f"--prefix TEXT: the snapshot's model {str(spec)[:80]!r} has its own "
                         f"tokenizer; give --tokenizer MODEL|DIR (what the server ran) or token "
                         f"ids")
    from engine.runtime.tokenizer_export import tokenizer_for_model

    try:
        tok, _, _ = tokenizer_for_model(str(spec))
    except (ValueError, OSError) as exc:
        raise UsageError(f"--tokenizer {spec}: {exc}") from None
    return tok.encode


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
                                     "would hit (L1/L2/L3): token ids (1,2,3 or ranges "
                                     "0-511,900-950), or text (the snapshot's model's "
                                     "tokenizer, see --tokenizer).")]
TokenizerOpt = Annotated[Optional[str], _O("--tokenizer", metavar="MODEL|DIR", help="Encode "
                                           "--prefix text with this model's tokenizer (a preset, "
                                           "smollm2-135m, a checkpoint directory); default: the "
                                           "snapshot's model when it is a preset or "
                                           "smollm2-135m.")]
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
    prefix: Prefix = None, tokenizer: TokenizerOpt = None, namespace: Namespace = None,
    owners: Owners = False,
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
    other = load_snapshot(diff) if diff is not None else None
    trees = [load_snapshot(p) for p in snapshots]
    prompt = None
    if prefix is not None:
        prompt = parse_prompt(prefix, lambda: text_encoder(trees[0].header.get("meta", {}),
                                                           tokenizer))
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
