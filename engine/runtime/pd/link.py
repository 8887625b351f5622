"""The P/D link: one prefill and one decode process over torch.distributed point-to-point.

Why ``torch.distributed`` over gloo (docs/pd.md, "Transport"): it is already how every other
multi-process part of hicache talks (CP, PP, consensus), it ships with torch (no extra service to
run, unlike the Mooncake transfer engine, whose TCP transport also needs its metadata server),
it moves tensors without serialising them, and the same calls would run over NCCL. The link is a
private two-rank ``ProcessGroupGloo`` built on its own ``TCPStore`` — no global process group,
so a server process can hold it next to anything else, and tests can run both ends. Gloo moves
host tensors: on a GPU the prefill side stages each layer's pages through host memory.

Rank 0 is the prefill worker (it hosts the store, bound to ``--pd-addr``'s host only, every key
under the launch secret's prefix: engine.parallel.rendezvous), rank 1 the decode worker. Two
one-way streams, each ordered: requests (decode → prefill) and replies (prefill → decode). A
message is an int64 length and UTF-8 JSON bytes; page data follows as plain tensors, one per
layer. Every send and receive has the link timeout (``--pd-link-timeout``); an idle decode side
sends a ``ping`` request every quarter of it, so the prefill side's wait for the next request
never runs out while the pair is healthy, however long the server sits idle.
"""

from __future__ import annotations

import datetime
import json
from typing import Any

import torch
import torch.distributed as dist

from engine.core.errors import HiCacheError
from engine.parallel.rendezvous import Rendezvous

PREFILL, DECODE = 0, 1
TAG_REQUEST, TAG_REPLY = 1, 2
MAX_MESSAGE_BYTES = 1 << 26


class LinkError(HiCacheError):
    """The P/D link failed (peer gone, timed out, malformed message)."""


class PDLink:
    """One end of the link. ``host:port`` is where the prefill end listens (its store);
    ``secret``: the pair's shared secret (the store takes only keys derived from it)."""

    def __init__(self, role: int, host: str, port: int, secret: str, timeout_s: float = 60.0,
                 connect_timeout_s: float = 60.0):
        assert role in (PREFILL, DECODE), role
        self.role = role
        self.peer = DECODE if role == PREFILL else PREFILL
        self.timeout_s = timeout_s
        addr = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        try:
            rdv = (Rendezvous.host(addr, secret, "pd") if role == PREFILL
                   else Rendezvous(addr, secret, "pd"))
            self.store = rdv.store(connect_timeout_s)
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = datetime.timedelta(seconds=timeout_s)
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
            self.pg = dist.ProcessGroupGloo(self.store, role, 2, opts)
        except (RuntimeError, ValueError, OSError) as exc:
            raise LinkError(f"cannot connect the P/D link at {host}:{port}: "
                            f"{str(exc).splitlines()[0]}") from None

    # -- messages ---------------------------------------------------------------------------
    def send_msg(self, obj: Any, tag: int) -> None:
        data = json.dumps(obj, separators=(",", ":")).encode()
        head = torch.tensor([len(data)], dtype=torch.int64)
        self.send(head, tag)
        self.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), tag)

    def recv_msg(self, tag: int) -> Any:
        head = torch.zeros(1, dtype=torch.int64)
        self.recv_into(head, tag)
        n = int(head[0])
        if not 0 < n <= MAX_MESSAGE_BYTES:
            raise LinkError(f"malformed P/D message header ({n} bytes)")
        body = torch.empty(n, dtype=torch.uint8)
        self.recv_into(body, tag)
        try:
            return json.loads(bytes(body.numpy()))
        except ValueError as exc:
            raise LinkError(f"malformed P/D message: {exc}") from None

    # -- tensors ----------------------------------------------------------------------------
    def send_async(self, t: torch.Tensor, tag: int):
        """Start sending ``t`` (contiguous, kept alive by the caller until ``.wait()``)."""
        try:
            return self.pg.send([t], self.peer, tag)
        except RuntimeError as exc:
            raise LinkError(f"P/D link send failed: {str(exc).splitlines()[0]}") from None

    def send(self, t: torch.Tensor, tag: int) -> None:
        self._wait(self.send_async(t.contiguous(), tag), "send")

    def recv_into(self, t: torch.Tensor, tag: int) -> None:
        try:
            work = self.pg.recv([t], self.peer, tag)
        except RuntimeError as exc:
            raise LinkError(f"P/D link receive failed: {str(exc).splitlines()[0]}") from None
        self._wait(work, "receive")

    @staticmethod
    def _wait(work, what: str) -> None:
        try:
            work.wait()
        except RuntimeError as exc:
            raise LinkError(f"P/D link {what} failed: {str(exc).splitlines()[0]}") from None

    def close(self) -> None:
        self.pg = None
        self.store = None
