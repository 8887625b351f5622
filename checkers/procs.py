"""What a process tree holds, read from ``/proc`` (Linux): its descendants, whether a process is
still alive, and the TCP sockets it listens on — for the checks that no rank process is left
behind and none listens on every interface (tests/test_rank_liveness.py, benchmarks/soak.py
--hostile)."""

from __future__ import annotations

import os
import re


def descendants(pid: int) -> list[int]:
    """``pid``'s children, grandchildren, … (from /proc)."""
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(d))
    out, todo = [], [pid]
    while todo:
        for c in kids.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def listeners(pids: list[int]) -> list[tuple[str, int]]:
    """(address, port) of every listening TCP socket the processes ``pids`` hold."""
    inodes = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    m = re.match(r"socket:\[(\d+)\]", os.readlink(f"/proc/{pid}/fd/{fd}"))
                except OSError:
                    continue
                if m:
                    inodes.add(m.group(1))
        except OSError:
            continue
    out: list[tuple[str, int]] = []
    tables = {(f"/proc/{pid}/net/tcp{v}", v == "6") for pid in pids for v in ("", "6")}
    for table, v6 in sorted(tables):       # each process's own network namespace
        try:
            rows = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            f = row.split()
            if f[3] != "0A" or f[9] not in inodes:
                continue
            hexip, hexport = f[1].split(":")
            if v6:
                ip = "::" if int(hexip, 16) == 0 else ("::1" if hexip.endswith("01000000") and
                                                       int(hexip[:24], 16) == 0 else hexip)
            else:
                ip = ".".join(str(int(hexip[i:i + 2], 16)) for i in (6, 4, 2, 0))
            if (ip, int(hexport, 16)) not in out:
                out.append((ip, int(hexport, 16)))
    return out


def wildcard(listening: list[tuple[str, int]]) -> list[tuple[str, int]]:
    """The listening sockets bound to every interface (0.0.0.0 or ``::``)."""
    return [(ip, port) for ip, port in listening if ip in ("0.0.0.0", "::")]
