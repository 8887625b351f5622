"""Start a group of rank processes over ``torch.distributed`` (gloo on CPU) and collect what
each returns — with collective timeouts, so a rank that dies or hangs makes the others fail
with a message naming it instead of waiting forever."""

from __future__ import annotations

import datetime
import socket
import traceback
from typing import Any, Callable

from engine.core.errors import HiCacheError


class RankFailed(HiCacheError):
    """A rank raised, died or did not answer in time."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _main(rank: int, world: int, port: int, timeout_s: float, target: Callable, args: tuple,
          out: Any) -> None:
    import torch.distributed as dist

    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s))
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
    port = free_port()
    procs = [ctx.Process(target=_main, args=(r, world, port, collective_timeout_s, target, args,
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
    return [results[r] for r in range(world)]
