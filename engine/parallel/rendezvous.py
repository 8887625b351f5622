"""Rank rendezvous and links that only the processes of one launch can use, and the watch a
parent keeps on the processes it started (docs/parallelism.md, "Ports, peers and liveness").

* **Where it listens.** Rank 0 binds the rendezvous (a ``torch.distributed`` ``TCPStore``) on
  ``127.0.0.1`` — or, when a multi-node address is given, on that address only — *before* it
  starts the other ranks (no free-port race), and hands the bound socket to the store. The gloo
  links of the group bind the interface that routes to the rendezvous (``lo`` on one host;
  ``GLOO_SOCKET_IFNAME`` when set wins).
* **Who may join.** Every key the group uses lives under a prefix derived (HMAC-SHA256) from a
  per-launch secret. One host: the parent draws it and passes it to its children over the spawn
  pipe (never argv, never the environment). Several hosts: every node reads the same secret from
  ``HICACHE_RANK_SECRET``. A process that connects to the port without the secret can set any
  key it likes: none of them is a key the group reads, so it can neither join nor disturb it.
* **Liveness.** A child beats into shared memory every :data:`BEAT_S`; the parent's
  :class:`Watchdog` names a child silent for longer than its timeout (stopped, frozen) and kills
  it, so the group fails at once — naming it — instead of at the collective timeout. A child
  whose parent is gone (the spawn pipe at EOF, or re-parented) exits at once.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import logging
import os
import secrets
import socket
import sys
import threading
import time
from typing import Any, Callable

from engine.core.errors import HiCacheError

log = logging.getLogger("hicache.ranks")

SECRET_ENV = "HICACHE_RANK_SECRET"
MIN_SECRET_CHARS = 16
BEAT_S = 0.25                   # a child's heartbeat period
DEFAULT_HEARTBEAT_TIMEOUT_S = 5.0


def launch_secret(nnodes: int = 1, required: bool = False) -> str:
    """The secret of this launch: ``HICACHE_RANK_SECRET`` when set (``required``, and with
    several nodes: the processes started apart must agree on it), else a fresh random one.
    ``ValueError`` (a usage error) when it is needed and missing or short."""
    s = os.environ.get(SECRET_ENV)
    if s:
        if len(s) < MIN_SECRET_CHARS:
            raise ValueError(f"{SECRET_ENV} must be at least {MIN_SECRET_CHARS} characters")
        return s
    if nnodes > 1:
        raise ValueError(f"--nnodes > 1 needs {SECRET_ENV} set to the same secret (at least "
                         f"{MIN_SECRET_CHARS} characters) on every node")
    if required:
        raise ValueError(f"--disaggregation prefill/decode need {SECRET_ENV} set to the same "
                         f"secret (at least {MIN_SECRET_CHARS} characters) in both commands")
    return secrets.token_hex(16)


def key_prefix(secret: str, purpose: str) -> str:
    """The store prefix of one group: unguessable without the secret."""
    mac = hmac.new(secret.encode(), f"hicache rendezvous {purpose}".encode(), hashlib.sha256)
    return f"hicache/{mac.hexdigest()[:32]}/"


def split_addr(addr: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` too; port 0: any) → (host, port)."""
    host, sep, port = addr.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"expected HOST:PORT, got {addr!r}")
    return host, int(port)


def join_addr(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def listen(host: str, port: int = 0) -> socket.socket:
    """A TCP socket bound to ``host:port`` only (never the wildcard unless ``host`` is one)."""
    fam, _, _, _, sa = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    s = socket.socket(fam, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if fam == socket.AF_INET6:
            s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        s.bind(sa)
        s.listen(128)
    except OSError:
        s.close()
        raise
    return s


def interface_for(host: str) -> str | None:
    """The name of the local IPv4 interface that routes to ``host`` (``lo`` for 127.0.0.1),
    or None when it cannot be told."""
    import fcntl
    import struct

    try:
        fam, _, _, _, sa = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
        if fam != socket.AF_INET:
            return None
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(sa)
            local = s.getsockname()[0]
        for _, name in socket.if_nameindex():
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                try:    # SIOCGIFADDR: the interface's address
                    raw = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
                except OSError:
                    continue
            if socket.inet_ntoa(raw[20:24]) == local:
                return name
    except OSError:
        return None
    return None


class Rendezvous:
    """Where the ranks of one launch meet (``addr``, HOST:PORT) and the secret of the launch.
    :meth:`host` binds the port now (rank 0's side); the object pickles without the socket, so
    it can be handed to the processes that join (over the spawn pipe)."""

    def __init__(self, addr: str, secret: str, purpose: str = "ranks"):
        self.addr, self.secret, self.purpose = addr, secret, purpose
        self._sock: socket.socket | None = None

    @classmethod
    def host(cls, addr: str | None, secret: str, purpose: str = "ranks") -> "Rendezvous":
        """Rank 0: bind ``addr`` (default ``127.0.0.1`` on a free port) and keep it for the
        store. ``ValueError`` when the address cannot be bound."""
        host, port = split_addr(addr) if addr else ("127.0.0.1", 0)
        try:
            sock = listen(host, port)
        except OSError as exc:
            raise ValueError(f"cannot listen on {join_addr(host, port)} for the ranks' "
                             f"rendezvous: {exc.strerror or exc}") from None
        r = cls(join_addr(host, sock.getsockname()[1]), secret, purpose)
        r._sock = sock
        return r

    def __getstate__(self) -> dict:
        return {"addr": self.addr, "secret": self.secret, "purpose": self.purpose}

    def __setstate__(self, st: dict) -> None:
        self.__dict__.update(st)
        self._sock = None

    def store(self, timeout_s: float, server: bool | None = None) -> Any:
        """The group's store: the server (on the socket :meth:`host` bound) or a client,
        wrapped in the secret's prefix."""
        import torch.distributed as dist

        host, port = split_addr(self.addr)
        td = datetime.timedelta(seconds=timeout_s)
        if self._sock is not None and server is not False:
            fd, self._sock = self._sock.detach(), None      # the store owns it now
            raw = dist.TCPStore(host, port, None, True, td, wait_for_workers=False,
                                master_listen_fd=fd)
        else:
            raw = dist.TCPStore(host, port, None, False, td, wait_for_workers=False)
        return dist.PrefixStore(key_prefix(self.secret, self.purpose), raw)

    def join(self, rank: int, world: int, timeout_s: float, nnodes: int = 1) -> None:
        """Join the default process group (gloo) as ``rank`` of ``world`` (spread evenly over
        ``nnodes`` hosts). With several hosts every rank first posts the address its links
        will advertise; a peer on another host that would advertise a loopback address (its
        host name resolves to 127.0.x.x and no interface was picked) is said in one line here
        instead of a connect timeout later."""
        import torch.distributed as dist

        host = split_addr(self.addr)[0]
        use_interface(host)   # stays set: gloo reads it again for every group made later
        store = self.store(timeout_s)
        if nnodes > 1:
            check_advertised(store, rank, world, nnodes, host, timeout_s)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s))

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def advertised_address() -> str:
    """The address this process's gloo links advertise: ``GLOO_SOCKET_IFNAME``'s interface
    address, else what the host name resolves to (gloo's own default)."""
    import fcntl
    import struct

    name = os.environ.get("GLOO_SOCKET_IFNAME", "").split(",")[0]
    if name:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                raw = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
            return socket.inet_ntoa(raw[20:24])
        except OSError:
            return f"?{name}"
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "?"


class LoopbackPeer(HiCacheError):
    """A rank on another node would advertise a loopback address: no peer could reach it."""


def check_advertised(store: Any, rank: int, world: int, nnodes: int, host: str,
                     timeout_s: float) -> None:
    """Post this rank's advertised address; :class:`LoopbackPeer` naming the first rank on
    another node whose address is a loopback one (no peer could reach it)."""
    import ipaddress

    per = world // nnodes
    store.set(f"hicache/advertise/rank{rank}", advertised_address())
    keys = [f"hicache/advertise/rank{r}" for r in range(world)]
    store.wait(keys, datetime.timedelta(seconds=timeout_s))
    for r in range(world):
        if r // per == rank // per:
            continue
        addr = store.get(keys[r]).decode(errors="replace")
        try:
            loop = ipaddress.ip_address(addr).is_loopback
        except ValueError:
            loop = False
        if loop:
            raise LoopbackPeer(
                f"rank {r} (node {r // per}) would advertise the loopback address {addr} to the "
                f"other nodes (its host name resolves to it and no interface routes to {host}): "
                f"set GLOO_SOCKET_IFNAME on node {r // per} to the interface that reaches "
                f"{host}")


def use_interface(host: str) -> None:
    """Make this process's gloo links bind the interface that reaches ``host`` (unless
    ``GLOO_SOCKET_IFNAME`` says otherwise)."""
    if not os.environ.get("GLOO_SOCKET_IFNAME"):
        name = interface_for(host)
        if name is not None:
            os.environ["GLOO_SOCKET_IFNAME"] = name


# -- liveness -------------------------------------------------------------------------------

class Watchdog:
    """Heartbeats of the child processes a parent started, in shared memory. :meth:`beat` is
    what a child gets (pickled through the spawn pipe); :meth:`watch` starts the parent's
    thread that kills a child silent for ``timeout_s`` (0: never) and records why."""

    def __init__(self, ctx: Any, n: int, timeout_s: float = DEFAULT_HEARTBEAT_TIMEOUT_S):
        self.beats = ctx.RawArray("d", n)          # time.monotonic() of each last beat; 0: none
        self.timeout_s = timeout_s
        self.silent: dict[Any, str] = {}           # key -> why it was killed
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def beat(self, slot: int) -> tuple:
        return (self.beats, slot, os.getpid())

    def watch(self, procs: dict[Any, tuple[int, Any]], label: Callable[[Any], str],
              on_silent: Callable[[Any, str], None] | None = None) -> None:
        """``procs``: key -> (slot, process). ``label(key)`` names one in messages."""
        if self.timeout_s <= 0:
            return

        def run() -> None:
            while not self._stop.wait(BEAT_S):
                now = time.monotonic()
                for key, (slot, p) in procs.items():
                    last = self.beats[slot]
                    if key in self.silent or last == 0 or not p.is_alive() or \
                            now - last < self.timeout_s:
                        continue
                    why = (f"{label(key)} stopped answering (no heartbeat for "
                           f"{now - last:.1f} s; killed)")
                    self.silent[key] = why
                    log.error("%s", why)
                    try:
                        os.kill(p.pid, 9)
                    except ProcessLookupError:
                        pass
                    if on_silent is not None:
                        on_silent(key, why)

        self._thread = threading.Thread(target=run, name="hicache-watchdog", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()


def child_setup(beat: tuple | None) -> None:
    """Call first thing in a child process: exit when the parent dies (the spawn pipe reaches
    EOF, or the process is re-parented); with ``beat`` (:meth:`Watchdog.beat`), also beat."""
    import multiprocessing

    parent = multiprocessing.parent_process()
    parent_pid = beat[2] if beat is not None else (parent.pid if parent else os.getppid())

    def orphaned() -> None:
        print(f"hicache: {multiprocessing.current_process().name}: the parent process "
              f"(pid {parent_pid}) is gone; exiting", file=sys.stderr, flush=True)
        os._exit(1)

    if parent is not None and getattr(parent, "sentinel", None) is not None:
        from multiprocessing.connection import wait

        def watch_pipe() -> None:
            wait([parent.sentinel])
            orphaned()
        threading.Thread(target=watch_pipe, name="hicache-parent-watch", daemon=True).start()

    def beat_loop() -> None:
        beats, slot = (beat[0], beat[1]) if beat is not None else (None, 0)
        while True:
            if os.getppid() != parent_pid:
                orphaned()
            if beats is not None:
                beats[slot] = time.monotonic()
            time.sleep(BEAT_S)
    threading.Thread(target=beat_loop, name="hicache-heartbeat", daemon=True).start()
