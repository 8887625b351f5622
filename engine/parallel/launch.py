"""Start a group of rank processes over ``torch.distributed`` (gloo on CPU) and collect what
each returns — with collective timeouts, so a rank that dies or hangs makes the others fail
with a message naming it instead of waiting forever.

Multi-host, as in SGLang: a group of ``world`` ranks spreads evenly over ``nnodes`` hosts, node
``R`` running ranks ``R*k … R*k+k-1`` (``k = world / nnodes``); every rank meets at the
rendezvous ``HOST:PORT`` (``--dist-init-addr``), which rank 0 — on node 0 — hosts. The
rendezvous binds that address only (``127.0.0.1`` on one host) and takes only keys derived from
the launch's secret (engine.parallel.rendezvous); every rank process beats, and exits with its
parent.
"""

from __future__ import annotations

import socket
import traceback
from typing import Any, Callable

from engine.core.errors import HiCacheError
from engine.parallel.rendezvous import DEFAULT_HEARTBEAT_TIMEOUT_S, Rendezvous, Watchdog, child_setup, launch_secret


class RankFailed(HiCacheError):
    """A rank raised, died or did not answer in time."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_addr(addr: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` too) → (host, port); ``ValueError`` when it is not one."""
    host, _, port = addr.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--dist-init-addr must be HOST:PORT, got {addr!r}")
    return host, int(port)


def check_nodes(world: int, nnodes: int, node_rank: int, addr: str | None,
                what: str) -> None:
    """``ValueError`` (a usage error to the CLI) unless ``world`` ranks — ``what`` names the
    option that sets them, e.g. ``"--cp 4"`` — spread evenly over ``nnodes`` hosts and, with
    more than one, a rendezvous address is given."""
    if nnodes < 1:
        raise ValueError(f"--nnodes must be >= 1, got {nnodes}")
    if not 0 <= node_rank < nnodes:
        raise ValueError(f"--node-rank must be in [0, --nnodes), got {node_rank} of {nnodes}")
    if world % nnodes:
        raise ValueError(f"{what} ranks do not spread evenly over --nnodes {nnodes}")
    if nnodes > 1 and addr is None:
        raise ValueError("--nnodes > 1 needs --dist-init-addr HOST:PORT (node 0's address)")
    if addr is not None:
        parse_addr(addr)


def node_ranks(world: int, nnodes: int, node_rank: int) -> range:
    """The ranks node ``node_rank`` runs."""
    k = world // nnodes
    return range(node_rank * k, (node_rank + 1) * k)


def _child(target: Callable, beat: tuple | None, *args: Any) -> None:
    child_setup(beat)                  # exit with the parent; beat for its watchdog
    target(*args)


class RankProcesses:
    """The rank processes this host runs: ``target(rank, *args)`` for each rank, spawned (a
    module-level function: it is imported by name). Watches them and names the dead: a rank
    silent for ``heartbeat_timeout_s`` (stopped, frozen; 0: no watch) is killed and named as
    such. Every rank exits when this process dies."""

    def __init__(self, target: Callable, ranks: Any, args: tuple, name: str = "rank",
                 heartbeat_timeout_s: float = DEFAULT_HEARTBEAT_TIMEOUT_S,
                 label: Callable[[int], str] = lambda r: f"rank {r}"):
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
        ranks = list(ranks)
        self.label = label
        self.watchdog = Watchdog(ctx, max(1, len(ranks)), heartbeat_timeout_s)
        self.procs = {r: ctx.Process(target=_child,
                                     args=(target, self.watchdog.beat(i), r, *args),
                                     name=f"hicache-{name}{r}", daemon=True)
                      for i, r in enumerate(ranks)}
        for p in self.procs.values():
            p.start()
        self.watchdog.watch({r: (i, self.procs[r]) for i, r in enumerate(ranks)}, label)

    def pids(self) -> dict[int, int]:
        return {r: p.pid for r, p in self.procs.items()}

    def silent(self) -> list[str]:
        """Why each rank the watchdog killed was killed."""
        return list(self.watchdog.silent.values())

    def dead(self) -> list[str]:
        """``rank R exited (code C)`` for every rank gone, silent (killed by the watchdog)
        ones first, then killed ones (a rank that exits with code 1 may only have lost its
        peers)."""
        silent = self.watchdog.silent
        gone = [(r, p.exitcode) for r, p in self.procs.items()
                if r not in silent and not p.is_alive()]
        gone.sort(key=lambda rc: (rc[1] == 1, rc[0]))
        return [silent[r] for r in sorted(silent)] + \
            [f"{self.label(r)} exited (code {c})" for r, c in gone]

    def wait(self, on_exit: Callable[[int, int], None] | None = None) -> list[str]:
        """Block until every rank has exited (``on_exit(rank, code)`` as each one that failed
        does); what :meth:`dead` says of those that failed."""
        from multiprocessing.connection import wait

        left = dict(self.procs)
        while left:
            wait([p.sentinel for p in left.values()])
            for r, p in list(left.items()):
                if not p.is_alive():
                    del left[r]
                    if p.exitcode != 0 and on_exit is not None:
                        on_exit(r, p.exitcode)
        return [d for d in self.dead() if not d.endswith("(code 0)")]

    def join(self, timeout: float = 10.0) -> None:
        self.watchdog.close()
        for p in self.procs.values():
            p.join(timeout)
            if p.is_alive():
                p.kill()
                p.join(1.0)


class ExitBoard:
    """Where the nodes of a multi-host group post the exits of their ranks — the rendezvous
    store that rank 0 hosts on node 0 — so node 0 can name a rank that died on another host
    (its own ranks it watches as processes). Best effort: a store that cannot be reached (node 0
    gone) is silently skipped."""

    KEY = "hicache/exit/rank{}"
    WHY = "hicache/why/rank{}"            # a rank's own failure, in one line
    STOP = "hicache/stop"                 # a rank (or node) that got SIGTERM asks rank 0 to stop

    def __init__(self, rendezvous: Rendezvous, timeout_s: float = 2.0):
        self.rendezvous = Rendezvous(rendezvous.addr, rendezvous.secret)   # a client's
        self.timeout_s = timeout_s
        self._store: Any = None

    def _client(self) -> Any:
        if self._store is None:
            self._store = self.rendezvous.store(self.timeout_s, server=False)
        return self._store

    def post(self, rank: int, code: int) -> None:
        try:
            self._client().set(self.KEY.format(rank), str(code))
        except Exception:  # noqa: BLE001 - node 0 is gone: nobody left to tell
            pass

    def post_reason(self, rank: int, why: str) -> None:
        """Why rank ``rank`` stopped on its own (a forward that raised, a silence its node's
        watchdog saw), for rank 0 to name it with."""
        try:
            self._client().set(self.WHY.format(rank), why[:500])
        except Exception:  # noqa: BLE001 - node 0 is gone: nobody left to tell
            pass

    def reasons(self, ranks: Any) -> dict[int, str]:
        """The reasons posted so far for each of ``ranks``."""
        out: dict[int, str] = {}
        try:
            store = self._client()
            for r in ranks:
                key = self.WHY.format(r)
                if store.check([key]):
                    out[r] = store.get(key).decode(errors="replace")
        except Exception:  # noqa: BLE001 - the store is gone with the group
            pass
        return out

    def request_stop(self, who: str) -> None:
        """Ask rank 0 to stop the whole group cleanly (``who`` got a SIGTERM)."""
        try:
            self._client().set(self.STOP, who[:200])
        except Exception:  # noqa: BLE001 - node 0 is gone: nothing to stop
            pass

    def stop_requested(self) -> str | None:
        """Who asked rank 0 to stop, if anyone did."""
        try:
            store = self._client()
            if store.check([self.STOP]):
                return store.get(self.STOP).decode(errors="replace")
        except Exception:  # noqa: BLE001
            pass
        return None

    def posted(self, ranks: Any) -> list[tuple[int, str]]:
        """``(rank, exit code)`` of each of ``ranks`` posted so far."""
        out = []
        try:
            store = self._client()
            for r in ranks:
                key = self.KEY.format(r)
                if store.check([key]):
                    out.append((r, store.get(key).decode()))
        except Exception:  # noqa: BLE001 - the store is gone with the group
            pass
        return out

    def exits(self, ranks: Any, what: str = "rank") -> list[str]:
        """``rank R exited (code C) on another node`` for each of ``ranks`` posted so far."""
        return [f"{what} {r} exited (code {c}) on another node" for r, c in self.posted(ranks)]


def _main(rank: int, world: int, rdv: Rendezvous, timeout_s: float, target: Callable,
          args: tuple, out: Any) -> None:
    import torch.distributed as dist

    child_setup(None)
    try:
        rdv.join(rank, world, timeout_s)
        try:
            result = target(rank, world, *args)
        finally:
            dist.destroy_process_group()
        out.put((rank, "ok", result))
    except BaseException as exc:  # reported to the parent, never swallowed
        out.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def run_ranks(target: Callable, world: int, *args: Any, timeout_s: float = 60.0,
              collective_timeout_s: float = 30.0) -> list[Any]:
    """Run ``target(rank, world, *args)`` on ``world`` spawned processes (a module-level
    function: it is imported by name); returns the results by rank. Raises :class:`RankFailed`
    naming the first rank that raised, exited without answering, or ran past ``timeout_s``."""
    import queue

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    rdv = Rendezvous.host(None, launch_secret())
    server = rdv.store(collective_timeout_s)      # this process hosts it; every rank joins
    procs = [ctx.Process(target=_main, args=(r, world, rdv, collective_timeout_s, target, args,
                                             out), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    try:
        import time

        deadline = time.monotonic() + timeout_s
        while len(results) < world:
            try:
                rank, status, value = out.get(timeout=0.2)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in results]
                if dead and out.empty():
                    raise RankFailed(f"rank {dead[0]} exited (code {procs[dead[0]].exitcode}) "
                                     f"without a result") from None
                if time.monotonic() > deadline:
                    late = [r for r in range(world) if r not in results]
                    raise RankFailed(f"rank {late[0]} did not finish within {timeout_s:g} s") \
                        from None
                continue
            if status == "error":
                # a peer that died is the cause of the others' collective errors: name it
                time.sleep(0.5)
                dead = [r for r, p in enumerate(procs) if r != rank and not p.is_alive()
                        and p.exitcode not in (0, None)]
                first = value.splitlines()[0] if value else ""
                if dead:
                    raise RankFailed(f"rank {dead[0]} exited (code {procs[dead[0]].exitcode}) "
                                     f"without a result; rank {rank} then failed: {first}")
                raise RankFailed(f"rank {rank} failed: {value}")
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
        del server
    return [results[r] for r in range(world)]
