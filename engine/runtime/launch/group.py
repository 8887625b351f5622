"""The launcher's handle on a server's other rank processes: started (and watched) before rank 0
builds its engine, so every rank can meet at the rendezvous rank 0 then hosts.

One host: rank 0's process starts ranks 1 … world-1. Several hosts (``--nnodes``): node 0 starts
its share and every other node runs ``bench serve --node-rank R`` (:mod:`.node`), whose ranks
post their exits on the rendezvous store. :meth:`RankGroup.health` names what is gone, most
likely cause first: a rank the watchdog killed for silence (hung), then one that failed on its
own (its posted reason) or was killed, and last those that only lost their peers (exit code 1).
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

from engine.parallel.launch import ExitBoard, RankProcesses
from engine.parallel.rendezvous import Rendezvous, launch_secret
from engine.runtime.config import ServerConfig
from engine.runtime.ranks.worker import EXIT_LOST, rank_main
from engine.runtime.topology import Topology

log = logging.getLogger("hicache.ranks")


class RankGroup:
    """Node ``node``'s rank processes of ``topo`` (node 0: all its ranks but rank 0, and the
    rendezvous, bound now)."""

    def __init__(self, cfg: ServerConfig, topo: Topology, node: int = 0):
        self.topo = topo
        secret = launch_secret(cfg.nnodes)
        self.rendezvous = (Rendezvous.host(cfg.dist_init_addr, secret) if node == 0
                           else Rendezvous(cfg.dist_init_addr or "", secret))
        ranks = topo.followers(node) if node == 0 else list(topo.node_ranks(node))
        self.ranks = ranks
        self.procs = RankProcesses(rank_main, ranks, (topo.world, self.rendezvous, cfg),
                                   name="rank", heartbeat_timeout_s=cfg.rank_heartbeat_timeout_s,
                                   label=topo.name)
        for r, pid in self.procs.pids().items():
            log.info("%s: pid %d", topo.name(r), pid)
        self.remote = [r for r in topo.remote(node) if r != 0] if node == 0 else []
        self.board = ExitBoard(self.rendezvous)
        self._stop_watch = threading.Event()

    def pids(self) -> dict[int, int]:
        return self.procs.pids()

    def health(self) -> list[str]:
        """What is gone, most likely cause first (empty: every rank is up)."""
        found: list[tuple[int, int, str]] = []
        silent = self.procs.watchdog.silent
        gone = {r: p.exitcode for r, p in self.procs.procs.items() if not p.is_alive()}
        posted = dict(self.board.posted(self.remote)) if self.remote else {}
        reasons = self.board.reasons([r for r, c in gone.items() if c != EXIT_LOST] +
                                     list(posted)) if gone or posted else {}
        for r in sorted(set(gone) | set(posted)):
            name = self.topo.name(r)
            where = "" if r in gone else " on another node"
            code = gone.get(r, posted.get(r))
            if r in silent:
                found.append((0, r, silent[r]))
            elif r in reasons:
                found.append((1, r, reasons[r]))        # it says where
            elif str(code) == str(EXIT_LOST):
                found.append((3, r, f"{name} exited (code 1){where} after losing its group: "
                                    f"another rank died or hung"))
            else:
                found.append((2, r, f"{name} exited (code {code}){where}"))
        return [text for _, _, text in sorted(found)]

    def watch_stop_requests(self, on_request: Callable[[str], None]) -> None:
        """Background: once a rank asks for a stop (it got SIGTERM or SIGINT), call
        ``on_request(who)`` once."""
        def run() -> None:
            while not self._stop_watch.wait(0.25):
                who = self.board.stop_requested()
                if who is not None:
                    log.info("stopping: %s", who)
                    try:
                        on_request(who)
                    except RuntimeError:      # the server is already stopping (loop closed)
                        pass
                    return
        threading.Thread(target=run, name="hicache-stop-watch", daemon=True).start()

    def join(self, timeout: float = 10.0) -> None:
        """Wait for the ranks to exit (halted, they write their logs); kill what is left."""
        self._stop_watch.set()
        self.procs.join(timeout)
