"""A node other than 0 of a multi-host server (``bench serve --nnodes K --node-rank R``, R > 0).

It runs its share of the ranks (engine.runtime.ranks.worker) as processes that join the group
at the rendezvous on node 0 and step in lockstep with rank 0, which alone serves HTTP. When
node 0 stops, it halts them: they write their rank logs (and tree snapshots) and exit 0, and so
does this node. A rank of this node that fails, or that its watchdog kills for silence, is
posted on the rendezvous store (:class:`~engine.parallel.launch.ExitBoard`), so node 0 names it.
SIGTERM or SIGINT here asks node 0 to stop the whole group cleanly; a second one kills this
node's ranks at once.
"""

from __future__ import annotations

import signal
from typing import Any, Callable

from engine.runtime.config import ServerConfig
from engine.runtime.launch.group import RankGroup
from engine.runtime.topology import Topology


def serve_node(cfg: ServerConfig, on_ready: Callable[[dict], None] | None = None) -> list[str]:
    """Run this node's ranks until they exit; returns what failed (``… exited (code C)``),
    empty when node 0 halted them cleanly. ``on_ready(pids)`` once they are started."""
    topo = Topology.of(cfg)
    asked: list[int] = []

    def on_signal(signum: int, _frame: Any) -> None:
        asked.append(signum)
        if len(asked) > 1:
            raise SystemExit(128 + signum)
        group.board.request_stop(f"node {cfg.node_rank} got {signal.Signals(signum).name}")
    group = RankGroup(cfg, topo, node=cfg.node_rank)
    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        if on_ready is not None:
            on_ready(group.pids())
        silent = group.procs.watchdog.silent

        def posted(rank: int, code: int) -> None:
            if rank in silent:
                group.board.post_reason(rank, f"{silent[rank]} on node {cfg.node_rank}")
            group.board.post(rank, code)
        return group.procs.wait(on_exit=posted)
    finally:
        group.procs.join(timeout=0)        # stopped here: what still runs is killed
        for s, h in previous.items():
            signal.signal(s, h)
