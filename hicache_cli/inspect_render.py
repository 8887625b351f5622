"""What ``hicache inspect`` prints: the human views of a snapshot and the Graphviz tree.
The numbers come from :mod:`engine.snapshot.views`; nothing here computes them."""

from __future__ import annotations

import datetime
import re
from typing import Any, Callable

from hicache_cli.output import stdout

BAR = 8
_TIER_STYLE = {"L1": "green", "L2": "blue", "L3": "magenta"}


# ------------------------------------------------------------------------- human rendering
def _n(x: int) -> str:
    return f"{x:,}"


def _pl(x: int, word: str) -> str:
    return f"{x:,} {word}{'' if x == 1 else 's'}"


def bar(part: int, whole: int, width: int = BAR) -> str:
    """``████░░░░``: one cell at least when ``part`` > 0, all cells only when complete."""
    if whole <= 0 or part <= 0:
        return "░" * width
    filled = round(width * part / whole)
    filled = min(max(filled, 1), width if part >= whole else width - 1)
    return "█" * filled + "░" * (width - filled)


def _bars(sub: dict, total: int) -> str:
    return "  ".join(f"{t} [{_TIER_STYLE[t]}]{bar(sub[t], total)}[/]" for t in ("L1", "L2", "L3"))


def _preview(tokens: list[int], more: bool) -> str:
    return "[" + " ".join(map(str, tokens)) + (" …" if more else "") + "]"


def _ns(ns: str | None) -> str:
    """A namespace's text: a bare name (quoted) or its fields (``cache_salt="A" ...``)."""
    if ns is None:
        return "(default namespace)"
    return f"namespace {ns}" if "=" in ns else f"namespace {ns!r}"


_PLAIN_KEY = re.compile(r"[A-Za-z_][\w.:@/+-]{0,39}")


def _key(key: str | int) -> str:
    """A client session key: as written when plain (``chat-7``, ``42``), quoted otherwise (so
    the string ``'42'`` is not the integer 42 and control characters show escaped)."""
    if type(key) is int or _PLAIN_KEY.fullmatch(str(key)):
        return str(key)
    text = repr(key)
    return text if len(text) <= 42 else text[:40] + "…'"


def hint_text(session: Any, hint: dict | None) -> str:
    """``session chat-7, next use in 12.3 s`` / ``…, closed (first to go)`` / ``shared``; empty
    for a node no session touched."""
    if session is None and hint is None:
        return ""
    who = ("shared" if session is True else "session (dropped from the cache's book)"
           if session is None else f"session {_key(session)}")
    if hint is None:
        return who
    if hint["closed"]:
        return f"{who}, closed (first to go)"
    if hint["in_s"] is None:
        return f"{who}, next use at {hint['next_use']:,.1f} s"
    if hint["in_s"] >= 0:
        return f"{who}, next use in {hint['in_s']:,.1f} s"
    return f"{who}, next use was due {-hint['in_s']:,.1f} s ago"


def _table(headers: list[str], rows: list[list[Any]], right: set[int]) -> list[str]:
    cells = [headers] + [[str(x) for x in r] for r in rows]
    widths = [max(len(r[k]) for r in cells) for k in range(len(headers))]
    lines = []
    for r in cells:
        parts = [c.rjust(w) if k in right else c.ljust(w)
                 for k, (c, w) in enumerate(zip(r, widths))]
        lines.append("  ".join(parts).rstrip())
    return lines


def _print(line: str = "", markup: bool = False) -> None:
    stdout.print(line, markup=markup, highlight=False)


def render_info(info: dict) -> None:
    r = info["rank"]
    when = datetime.datetime.fromtimestamp(info["created_at"], datetime.timezone.utc)
    coords = " ".join(f"{k} {r.get(k + '_rank', 0)}/{r.get(k + '_size', 1)}"
                      for k in ("tp", "pp", "cp") if (k + "_size") in r)
    rank = f"rank {r.get('rank', 0)}/{r.get('world_size', 1)}" + (f" ({coords})" if coords else "")
    _print(f"snapshot  {info['file']}  (v{info['version']}, page size {info['page_size']}, "
           f"{rank}, {when:%Y-%m-%d %H:%M:%S} UTC)")
    model, layout = info["model"].get("name"), info["model"].get("layout")
    if model or layout:
        desc = model or "?"
        if layout:
            desc += (f" (layout: {layout.get('num_layers')} layers × {layout.get('kv_heads')} "
                     f"kv-heads × {layout.get('head_dim')}, {layout.get('dtype')})")
        _print(f"model     {desc}")
    if info["meta"]:
        _print("meta      " + ", ".join(f"{k}={v}" for k, v in info["meta"].items()))


def render_summary(s: dict) -> None:
    ns = s["namespaces"]
    lines = [
        ("nodes", f"{_n(s['nodes'])} ({_n(s['leaves'])} leaves, {ns} namespace"
                  f"{'' if ns == 1 else 's'})"),
        ("tokens", f"{_n(s['tokens'])} ({_n(s['pages'])} pages)"),
    ]
    width = max(len(_n(t["tokens"])) for t in s["tiers"].values())
    for t, v in s["tiers"].items():
        text = f"{_n(v['tokens']).rjust(width)} tokens"
        if v["capacity"]:
            text += (f"  [{_TIER_STYLE[t]}]{bar(v['tokens'], v['capacity'], 20)}[/] "
                     f"{100 * v['tokens'] / v['capacity']:5.1f}% of {_n(v['capacity'])}")
        lines.append((t, text))
    lines += [
        ("locked", f"{_n(s['locked_tokens'])} tokens"),
        ("evictable", f"{_n(s['evictable_tokens'])} tokens (on L1, unlocked)"),
    ]
    if s["loading_tokens"]:
        lines.append(("loading", f"{_n(s['loading_tokens'])} tokens (L2 -> L1 in flight)"))
    d, f = s["depth"], s["fanout"]
    lines += [
        ("depth", f"{d['max_nodes']} nodes / {_n(d['max_tokens'])} tokens max, "
                  f"{d['mean_leaf_tokens']:,.1f} tokens mean at leaves"),
        ("fan-out", f"{f['root']} at the root{'s' if ns > 1 else ''}, {f['mean']} mean, "
                    f"{f['max']} max"),
    ] + _hint_lines(s["hints"])
    for k, v in lines:
        _print(f"{k:<10}{v}", markup=True)


def _hint_lines(h: dict) -> list[tuple[str, str]]:
    """The summary's hints block; nothing for a snapshot no session touched."""
    def part(p: dict) -> str:
        return f"{_pl(p['nodes'], 'node')}, {_n(p['tokens'])} tokens"

    if not (h["private"]["nodes"] or h["shared"]["nodes"] or h["ttl"]["nodes"]
            or h["closed"]["nodes"]):
        return []
    clock = "" if h["hint_clock"] is None else f" (hint clock {h['hint_clock']:,.1f} s)"
    lines = [("sessions", f"{h['sessions']:,} owning nodes{clock}"),
             ("private", part(h["private"]) + " (one session's)"),
             ("shared", part(h["shared"]) + " (several sessions': hints never move them)")]
    if h["ttl"]["nodes"]:
        soon = h["ttl"]["next_use_in_s"]
        when = "" if soon is None else (f" (next use in {soon[0]:,.1f} s … {soon[1]:,.1f} s)"
                                        if soon[0] != soon[1] else
                                        f" (next use in {soon[0]:,.1f} s)")
        lines.append(("retained", part(h["ttl"]) + when))
    if h["closed"]["nodes"]:
        lines.append(("closed", part(h["closed"]) + " (session closed: first to go)"))
    if h["dropped_session"]["nodes"]:
        lines.append(("", part(h["dropped_session"]) + " hinted for a session the cache's "
                          "book dropped"))
    return lines


def _node_label(v: dict) -> str:
    from rich.markup import escape

    sub = v["subtree"]
    more = v["tokens"] > len(v["preview"])
    text = escape(f"#{v['id']} {_preview(v['preview'], more)} {_n(v['tokens'])} tok  "
                  f"{v['tiers']}  hits {v['hits']}")
    if v["lock"]:
        text += f"  [bold yellow]lock {v['lock']}[/]"
    hint = hint_text(v["session"], v["hint"])
    if hint:
        text += "  [cyan]" + escape(hint) + "[/]"
    if sub["nodes"] > 1:
        text += f"  · subtree {_n(sub['nodes'])} nodes {_n(sub['tokens'])} tok"
    return text + "  " + _bars(sub, sub["tokens"])


def _hidden_text(h: dict, cut: bool) -> str:
    kids = _pl(h["children"], "child").replace("childs", "children")
    what = f"{kids} below" if cut else f"{h['children']:,} more " + kids.split(" ", 1)[1]
    return f"… {what}: {_pl(h['nodes'], 'node')}, {_n(h['tokens'])} tok"


def _hidden_label(h: dict, cut: bool) -> str:
    return f"[dim]{_hidden_text(h, cut)}[/]"


def render_tree(top: list[dict]) -> None:
    from rich.console import Console
    from rich.text import Text
    from rich.tree import Tree

    # the tree's lines are as long as they need to be (a narrow terminal scrolls, not crops)
    wide = Console(width=1 << 20, highlight=False, force_terminal=stdout.is_terminal,
                   color_system=stdout.color_system, no_color=stdout.no_color)

    def label(markup: str) -> Text:
        return Text.from_markup(markup, overflow="ignore", end="")

    def add(parent: Tree, v: dict) -> None:
        node = parent.add(label(_node_label(v)))
        for c in v["children"]:
            add(node, c)
        if v["hidden"]:
            node.add(label(_hidden_label(v["hidden"], cut=not v["children"])))

    for root in top:
        sub = root["subtree"]
        t = Tree(label(f"{_ns(root['namespace'])}  {_n(sub['nodes'])} nodes "
                       f"{_n(sub['tokens'])} tok  " + _bars(sub, sub["tokens"])),
                 guide_style="dim")
        for c in root["children"]:
            add(t, c)
        if root["hidden"]:
            t.add(label(_hidden_label(root["hidden"], cut=not root["children"])))
        wide.print(t)


def _hot_tokens(h: dict) -> str:
    """The prefix's first tokens, then (when the node is deeper) its own edge's first tokens."""
    ns = "" if h["namespace"] is None else f"{h['namespace']}: "
    head = " ".join(map(str, h["preview"]))
    if h["depth"] <= 1:
        return ns + head + (" …" if h["tokens"] > len(h["preview"]) else "")
    edge = " ".join(map(str, h["edge_preview"]))
    return f"{ns}{head} … | {edge}" + (" …" if h["tokens"] > len(h["edge_preview"]) else "")


def render_hot(hot: list[dict]) -> None:
    _print("hot prefixes (score = hits × prefix length)")
    if not hot:
        _print("  no prefix has been hit")
        return
    rows = [[k + 1, f"#{h['id']}", _n(h["score"]), _n(h["hits"]), _n(h["prefix_len"]),
             h["tiers"], _hot_tokens(h)] for k, h in enumerate(hot)]
    heads = ["#", "node", "score", "hits", "prefix", "tier",
             "tokens (prefix start … | node's edge)"]
    hints = [hint_text(h["session"], h["hint"]) for h in hot]
    if any(hints):                            # a column only when some prefix has a session
        heads.insert(6, "session / hint")
        for r, text in zip(rows, hints):
            r.insert(6, text or "-")
    for line in _table(heads, rows, right={0, 2, 3, 4}):
        _print("  " + line)


def render_prefix(m: dict, page_size: int) -> None:
    n, aligned = m["prompt_tokens"], m["aligned_tokens"]
    part = n - aligned
    _print(f"prompt    {_n(n)} tokens ({aligned // page_size} full pages of {page_size}"
           + (f" + {part} in a partial page" if part else "") + ") in the "
           + ("default namespace" if m["namespace"] is None else _ns(m["namespace"])))
    pct = f" ({100 * m['hit_tokens'] / n:.1f}%)" if n else ""
    _print(f"hit       {_n(m['hit_tokens'])} tokens{pct}: L1 {_n(m['l1_len'])}, "
           f"L2 {_n(m['l2_len'])}, L3 {_n(m['l3_len'])}; miss {_n(m['miss_tokens'])}")
    if m["tree_tokens"] > m["hit_tokens"]:
        _print(f"          {_n(m['tree_tokens'] - m['hit_tokens'])} more tokens are in the tree "
               f"but not reachable as a hit")
    if not m["path"]:
        _print("path      (no page of the prompt is in the tree)")
        return
    rows = [[f"#{s['id']}", f"{_n(s['matched'])}/{_n(s['edge'])}",
             f"{s['hit']} {_n(s['hit_tokens'])}" if s["hit_tokens"] else "-", s["resident"]]
            for s in m["path"]]
    heads = ["node", "matched", "hit", "resident"]
    hints = [hint_text(s["session"], s["hint"]) for s in m["path"]]
    if any(hints):
        heads.append("session / hint")
        for r, text in zip(rows, hints):
            r.append(text or "-")
    for k, line in enumerate(_table(heads, rows, right={1})):
        _print(("path      " if k == 0 else "          ") + line)


def render_owners(o: dict) -> None:
    if not o["sharded"]:
        _print(f"not CP-sharded (cp_size {o['cp_size']}, {o['nodes_with_owner']} nodes carry "
               f"an owner)")
        return
    _print(f"CP owners (cp_size {o['cp_size']}): {o['segments']} rotation segments, "
           f"{_pl(o['restarts'], 'restart')}, imbalance {o['imbalance']} (max / mean pages)")
    rows = [[w["rank"], _n(w["pages"]), _n(w["L1"]), _n(w["L2"])] for w in o["owners"]]
    for line in _table(["rank", "pages", "L1", "L2"], rows, right={0, 1, 2, 3}):
        _print("  " + line)
    starts = ", ".join(f"{r}: {k}" for r, k in enumerate(o["segment_start_owners"]))
    _print(f"segments start on owner  {starts}")
    if o["nodes_without_owner"]:
        _print(f"nodes without an owner   {o['nodes_without_owner']}")
    for e in o["restart_examples"]:
        _print(f"restart   #{e['id']} under #{e['parent']} (prefix {_n(e['prefix_len'])}): "
               f"owner {e['owner']}, the parent's rotation continues with {e['expected_owner']}")


def render_diff(d: dict) -> None:
    _print(f"diff      A = {d['a']}, B = {d['b']} (pages compared by token path)")
    _print(f"common    {_n(d['common']['pages'])} pages ({_n(d['common']['tokens'])} tokens)")
    for key, name in (("only_a", "A"), ("only_b", "B")):
        s = d[key]
        _print(f"only in {name} {_pl(s['pages'], 'page')} ({_n(s['tokens'])} tokens) in "
               f"{_pl(s['nodes'], 'node')}")
        for e in s["examples"]:
            _print(f"          #{e['id']}: {_pl(e['pages'], 'page')}, prefix "
                   f"{_n(e['prefix_len'])}, {e['tiers']}")
    for k, c in enumerate(d["tier_changes"]):
        _print(f"{'tier' if k == 0 else '':<10}{c['from']} -> {c['to']}: "
               f"{_pl(c['pages'], 'page')} ({_n(c['tokens'])} tokens)")
    for e in d["tier_change_examples"]:
        _print(f"          e.g. A #{e['id_a']} / B #{e['id_b']} (prefix "
               f"{_n(e['prefix_len'])}): {e['from']} -> {e['to']}")
    if d["same"]:
        _print("same      both snapshots hold the same pages in the same tiers")


def render_check(r: dict, nodes: int) -> None:
    problems, count = r["violations"], r["violation_count"]
    if not count:
        _print(f"check     ok: {_pl(nodes, 'node')}, no invariant violated")
        return
    _print(f"check     {count:,} violation{'' if count == 1 else 's'}")
    for p in problems:
        _print(f"  {p}")
    if count > len(problems):
        _print(f"  … {count - len(problems):,} more (shown: the first {len(problems)}; "
               "raise --max-violations to see more)")


# ------------------------------------------------------------------------------ DOT
def _dot_str(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


_DOT_FILL = {"L1": "#b7e4c7", "L2": "#bde0fe", "L3": "#e2c2f0", "none": "#ffffff"}


def render_dot(top: list[dict], name: str) -> str:
    lines = [f"digraph {_dot_str(name)} {{", "  rankdir=LR;",
             '  node [shape=box, style="rounded,filled", fontname="monospace", fontsize=10];']
    counter = [0]

    def node_line(key: str, label: str, fill: str, extra: str = "") -> None:
        lines.append(f"  {key} [label={_dot_str(label)}, fillcolor={_dot_str(fill)}{extra}];")

    def visit(v: dict, key: str) -> None:
        for c in v["children"]:
            ck = f"n{c['id']}"
            first = c["tiers"].split("+")[0].split(" ")[0]
            hint = hint_text(c["session"], c["hint"])
            label = (f"#{c['id']}  {c['tokens']} tok\n{c['tiers']}  hits {c['hits']}"
                     + (f"\n{hint}" if hint else "")
                     + (f"\nsubtree {c['subtree']['nodes']} nodes {c['subtree']['tokens']} tok"
                        if c["subtree"]["nodes"] > 1 else ""))
            node_line(ck, label, _DOT_FILL.get(first, "#ffffff"),
                      ", penwidth=2" if c["lock"] else "")
            lines.append(f"  {key} -> {ck};")
            visit(c, ck)
        if v["hidden"]:
            counter[0] += 1
            hk = f"h{counter[0]}"
            h = v["hidden"]
            label = _hidden_text(h, cut=not v["children"])
            lines.append(f"  {hk} [label={_dot_str(label)}, style=dashed];")
            lines.append(f"  {key} -> {hk} [style=dashed];")

    for root in top:
        rk = f"n{root['id']}"
        sub = root["subtree"]
        node_line(rk, f"{_ns(root['namespace'])}\n{sub['nodes']} nodes {sub['tokens']} tok",
                  "#eeeeee")
        visit(root, rk)
    lines.append("}")
    return "\n".join(lines) + "\n"


def blank() -> None:
    """The empty line between views."""
    _print()


RENDER: dict[str, Callable[[Any, Any], None]] = {
    "summary": lambda r, snap: render_summary(r),
    "tree": lambda r, snap: render_tree(r),
    "hot": lambda r, snap: render_hot(r),
    "prefix": lambda r, snap: render_prefix(r, snap.page_size),
    "owners": lambda r, snap: render_owners(r),
    "diff": lambda r, snap: render_diff(r),
    "check": lambda r, snap: render_check(r, snap.num_nodes),
}
