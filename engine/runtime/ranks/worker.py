"""The main of every rank process but rank 0 (the launcher starts them: engine.runtime.launch).

A rank joins the group at the rendezvous, builds its parts (:func:`build_rank`) and steps in
lockstep until rank 0's halt; then it writes its tree snapshot (``cfg.snapshot_dir``) and its
rank log (``cfg.rank_log_dir``) and exits 0.

* **Signals.** Ctrl-C and SIGTERM sent to the whole process group (a terminal, systemd's
  ``KillMode=control-group``, most supervisors) reach every rank; a rank does not die of them:
  it asks rank 0 to stop the group (a key on the rendezvous store), and rank 0 — which got the
  signal too, or sees the request — halts every rank at one step, so each writes its log.
* **Failures.** A peer lost (a collective that fails) exits 1 after one line; this rank's own
  error (a forward that raised) is posted on the rendezvous store for rank 0 to name, and exits
  2. Neither tears the process group down: taking apart groups whose collectives failed can end
  in ``std::terminate`` inside gloo, and rank 0 would then name this rank as the one that died.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from typing import Any

from engine.core.heap import freeze_startup_objects
from engine.parallel.launch import ExitBoard
from engine.runtime.config import ServerConfig
from engine.runtime.ranks.build import build_rank
from engine.runtime.ranks.lockstep import LockstepScheduler, is_link_error
from engine.runtime.topology import Topology

log = logging.getLogger("hicache.ranks")

EXIT_LOST = 1          # a peer died or hung: the cause is elsewhere
EXIT_FAILED = 2        # this rank failed on its own (its reason is posted)
FAULT_ENV = "HICACHE_DEBUG_RANK_FAULT"   # debug (tests): "R" makes rank R's first forward raise


def _inject_fault(parts: Any) -> None:
    """``HICACHE_DEBUG_RANK_FAULT=R``: rank R's forward raises (a stand-in for a kernel
    error on one rank: the group must stop at once, naming it)."""
    def broken(*_a: Any, **_k: Any) -> Any:
        raise RuntimeError("injected forward fault (HICACHE_DEBUG_RANK_FAULT)")
    parts.model.forward = broken


def _exit(code: int) -> None:
    logging.shutdown()
    sys.stderr.flush()
    os._exit(code)


def rank_main(rank: int, world: int, rendezvous: Any, cfg: ServerConfig) -> None:
    """Rank ``rank`` of ``world``: build, step until halted, write its log; see the module
    docstring for signals and failures."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    logging.basicConfig(level=logging.WARNING)
    topo = Topology.of(cfg, rank)
    board = ExitBoard(rendezvous)
    name = topo.name()

    def stop_requested(signum: int, _frame: Any) -> None:
        board.request_stop(f"{name} got {signal.Signals(signum).name}")
    signal.signal(signal.SIGINT, stop_requested)
    signal.signal(signal.SIGTERM, stop_requested)
    try:
        parts = build_rank(cfg, topo, rendezvous=rendezvous)
    except Exception as exc:  # noqa: BLE001 - one line; rank 0 names this rank
        first = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        why = f"{name} could not start: {type(exc).__name__}: {first}"
        log.error("%s", why)
        board.post_reason(rank, why)
        _exit(EXIT_FAILED)
        return
    sched = parts.scheduler
    assert isinstance(sched, LockstepScheduler)
    freeze_startup_objects()             # the rank's model and cache: out of the GC's passes
    if os.environ.get(FAULT_ENV) == str(rank):
        _inject_fault(parts)
    try:
        sched.serve()
    except Exception as exc:  # noqa: BLE001 - one line, then exit (rank 0 names the cause)
        first = str(exc).splitlines()[0][:200] if str(exc) else ""
        own = not is_link_error(exc)
        if own:
            why = f"{name} failed: {type(exc).__name__}: {first}"
            log.error("%s", why)
            board.post_reason(rank, why)
        else:
            log.error("%s lost its group (rank 0 or another rank stopped): %s: %s", name,
                      type(exc).__name__, first)
        try:
            parts.write_log()            # what it saw up to the failure
        except Exception:  # noqa: BLE001 - best effort on the way out
            pass
        _exit(EXIT_FAILED if own else EXIT_LOST)
    if cfg.snapshot_dir is not None:     # the tree is still: rank 0 halted us
        parts.write_snapshot(cfg.snapshot_dir, {
            "model": cfg.served_model_name or parts.model.cfg.name, "model_path": cfg.model,
            "source": "bench serve"})
    parts.write_log()
    parts.close()
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
