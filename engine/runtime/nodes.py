"""A node other than 0 of a multi-host server (``bench serve --nnodes K --node-rank R``, R > 0).

It runs its share of the ranks — CP or TP ranks (:func:`engine.runtime.cp_serve.follower_main`) or
pipeline stages (:func:`engine.runtime.pipeline.stage_worker`) — as processes that join the group
at the rendezvous on node 0 and step in lockstep with rank 0, which alone serves HTTP. When
node 0 stops, it halts them: they write their rank logs (and CP tree snapshots) and exit 0, and
so does this node. A rank of this node that fails is posted on the rendezvous store
(:class:`~engine.parallel.launch.ExitBoard`), so node 0 stops naming it. Stopping this node
(Ctrl-C, SIGTERM) kills its ranks; node 0 then stops with a message saying a rank was lost.
"""

from __future__ import annotations

import signal
from typing import Any, Callable

from engine.parallel.launch import ExitBoard, RankProcesses, node_ranks
from engine.parallel.rendezvous import Rendezvous, launch_secret


def _terminate(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def serve_node(cfg: Any, on_ready: Callable[[dict], None] | None = None) -> list[str]:
    """Run this node's ranks until they exit; returns what failed (``rank R exited (code
    C)``), empty when node 0 halted them cleanly. ``on_ready(pids)`` once they are started."""
    world = cfg.ranks * cfg.pp
    if cfg.ranks > 1 and cfg.pp == 1:
        from engine.runtime.cp_serve import follower_main as target
    else:
        from engine.runtime.pipeline import stage_worker as target
    ranks = node_ranks(world, cfg.nnodes, cfg.node_rank)
    rdv = Rendezvous(cfg.dist_init_addr, launch_secret(cfg.nnodes))
    previous = signal.signal(signal.SIGTERM, _terminate)
    group = RankProcesses(target, ranks, (world, rdv, cfg, cfg.collective_timeout_s),
                          name="rank" if cfg.ranks > 1 and cfg.pp == 1 else "stage",
                          heartbeat_timeout_s=cfg.rank_heartbeat_timeout_s)
    try:
        if on_ready is not None:
            on_ready(group.pids())
        board = ExitBoard(rdv)                     # node 0 names our dead ranks
        return group.wait(on_exit=board.post)
    finally:
        group.join(timeout=0)            # stopped here: what still runs is killed
        signal.signal(signal.SIGTERM, previous)
