"""Fault soak: the server under a multi-turn load while faults are injected at random; every
greedy output is checked against a fault-free reference.

1. **Reference.** A fault-free server without any cache runs every turn of ``--sessions``
   multi-turn sessions once (greedy, fixed lengths): the expected output of each prompt.
2. **Soak.** The server under test (L1 + L2 + an L3 store with a short call deadline,
   ``wait_complete`` prefetch: the strictest policy) serves ``--clients`` threads that replay the
   sessions again and again for ``--minutes``. Every output is compared with the reference.
3. **Faults**, one at a time, every few seconds, at random:

   * file store: ``stall_store`` (another process holds the store's lock for seconds: puts
     stall, the store must degrade and recover), ``fifo_object`` (an object replaced by a FIFO),
     ``corrupt_object`` (bytes flipped in an object), ``full_disk`` (the store's filesystem — a
     small tmpfs the soak mounts — filled to the last byte for seconds; without root the same
     is emulated by shrinking the store's size limit);
   * Mooncake store (``--backend mooncake``, a real ``mooncake_master``): ``master_killed``
     (killed and restarted on the same ports), ``master_stopped`` (SIGSTOP for seconds, then
     SIGCONT: alive, connected, silent);
   * both: ``client_disconnect`` (streaming requests whose clients vanish mid-stream) and
     ``flush`` (``/flush_cache`` under load).
4. **Report** (JSON on stdout, also ``--out``): requests served, faults by kind, wrong outputs
   (must be 0), errors returned to clients by kind, pools and locks after the final flush (must
   be 0), the cache invariants, the store's degraded/abandoned/recovered counters, and p50/p99
   latency of requests that overlapped a fault vs those that did not.

Usage::

    python benchmarks/soak.py --minutes 10 --backend file --out soak-file.json
    python benchmarks/soak.py --hostile --minutes 10 --out soak-hostile.json
    python benchmarks/soak.py --minutes 5 --backend mooncake --out soak-mooncake.json
    python benchmarks/soak.py --tp 2 --minutes 10 --clients 2 --out soak-tp2.json
    python benchmarks/soak.py --pp 2 --minutes 10 --clients 2 --out soak-pp2.json

``--tp``/``--pp`` > 1 runs the multi-rank divergence soak instead (benchmarks/soak_ranks.py):
rounds of a live multi-rank server with one rank driven into a random divergence class.

Figures and how to read them: docs/reliability.md.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse

import numpy as np
import requests

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from checkers.invariants import check_cache  # noqa: E402
from engine.runtime.launch import ServerConfig, start_server  # noqa: E402

BOS = 256
GRACE_S = 1.0           # a request ending this long after a fault still counts as "during"

HOLD_LOCK = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(3600)
"""


@dataclasses.dataclass
class Turn:
    prompt: list[int]
    max_new: int
    expected: list[int]


# -- reference ----------------------------------------------------------------------------
def build_reference(args) -> list[list[Turn]]:
    rng = random.Random(args.seed)
    systems = [[rng.randrange(256) for _ in range(rng.randint(200, 400))] for _ in range(3)]
    sessions: list[list[Turn]] = []
    cfg = ServerConfig(port=0, model=args.model, l1_tokens=8192, l2_tokens=0,
                       disable_radix_cache=True)
    with start_server(cfg) as ref:
        for s in range(args.sessions):
            hist = [BOS] + systems[s % len(systems)]
            turns = []
            for _ in range(args.turns):
                hist = hist + [rng.randrange(256) for _ in range(rng.randint(30, 100))]
                n = rng.randint(4, 16)
                out = generate(ref.url, hist, n, stream=False)["output_ids"]
                turns.append(Turn(list(hist), n, out))
                hist = hist + out
            sessions.append(turns)
    return sessions


def generate(url: str, ids: list[int], n: int, stream: bool, timeout: float = 120) -> dict:
    body = {"input_ids": ids, "stream": stream,
            "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}
    r = requests.post(url + "/generate", json=body, timeout=timeout, stream=stream)
    if r.status_code != 200:
        raise HTTPStatus(r.status_code, r.text[:200])
    if not stream:
        return r.json()
    last = None
    for line in r.iter_lines(decode_unicode=True):
        if line.startswith("data: ") and line != "data: [DONE]":
            last = json.loads(line[6:])
    if last is None or "error" in last:
        raise HTTPStatus(200, f"stream ended without output: {last}")
    return last


class HTTPStatus(Exception):
    def __init__(self, status: int, text: str):
        super().__init__(f"HTTP {status}: {text}")
        self.status = status


# -- the store under test -------------------------------------------------------------------
class FileStoreSite:
    """A file store on a small tmpfs (so a full disk is real), or a plain directory."""

    def __init__(self, work: str, size_mb: int):
        self.root = os.path.join(work, "store")
        os.makedirs(self.root)
        self.tmpfs = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs",
                                     self.root], capture_output=True).returncode == 0
        self.size_limit = (size_mb * 3 // 4) << 20

    def config(self, deadline_s: float) -> dict:
        return {"backend": "file", "file": {"dir": self.root,
                                            "size_limit": self.size_limit},
                "deadline_s": deadline_s}

    def objects(self) -> list[str]:
        out = []
        with contextlib.suppress(OSError):
            for d in os.scandir(os.path.join(self.root, "objects")):
                with contextlib.suppress(OSError):
                    out.extend(f.path for f in os.scandir(d.path)
                               if f.is_file(follow_symlinks=False))
        return out

    def close(self) -> None:
        if self.tmpfs:
            subprocess.run(["umount", "-l", self.root], capture_output=True)


class MooncakeSite:
    def __init__(self, work: str):
        from tests.mooncake_master import MooncakeMaster

        self.master = MooncakeMaster(os.path.join(work, "master")).start()

    def config(self, deadline_s: float) -> dict:
        m = self.master
        return {"backend": "mooncake", "deadline_s": deadline_s, "mooncake": {
            "master_server_address": f"127.0.0.1:{m.rpc_port}",
            "metadata_server": f"http://127.0.0.1:{m.http_port}/metadata",
            "global_segment_size": "256mb", "local_buffer_size": "64mb",
            "staging_bytes": "16mb"}}

    def close(self) -> None:
        with contextlib.suppress(Exception):
            os.kill(self.master.proc.pid, signal.SIGCONT)
        self.master.stop()


# -- faults ---------------------------------------------------------------------------------
class Faults:
    def __init__(self, args, site, handle, rng: random.Random):
        self.args, self.site, self.handle, self.rng = args, site, handle, rng
        self.url = handle.url
        self.windows: list[tuple[float, float, str]] = []
        self.counts: dict[str, int] = {}
        self.notes: list[str] = []
        self.flush_s: list[float] = []
        self.stop = threading.Event()
        if isinstance(site, FileStoreSite):
            self.kinds = ["stall_store", "fifo_object", "corrupt_object", "full_disk",
                          "client_disconnect", "flush"]
        else:
            self.kinds = ["master_killed", "master_stopped", "client_disconnect", "flush"]

    def run(self) -> None:
        while not self.stop.wait(self.rng.uniform(*self.args.fault_every)):
            kind = self.rng.choice(self.kinds)
            t0 = time.monotonic()
            try:
                getattr(self, kind)()
            except Exception as exc:  # noqa: BLE001 - a fault that could not be set up
                self.notes.append(f"{kind}: {type(exc).__name__}: {exc}")
                continue
            self.windows.append((t0, time.monotonic(), kind))
            self.counts[kind] = self.counts.get(kind, 0) + 1

    def _hold(self) -> float:
        return self.rng.uniform(1.5, 4.0)

    # file store
    def stall_store(self) -> None:
        p = subprocess.Popen([sys.executable, "-c", HOLD_LOCK,
                              os.path.join(self.site.root, "lock")], stdout=subprocess.PIPE,
                             text=True)
        try:
            p.stdout.readline()
            time.sleep(self._hold())
        finally:
            p.kill()
            p.wait()

    def _pick(self) -> str:
        objs = self.site.objects()
        if not objs:
            raise RuntimeError("no stored object yet")
        return self.rng.choice(objs)

    def fifo_object(self) -> None:
        path = self._pick()
        os.unlink(path)
        os.mkfifo(path)

    def corrupt_object(self) -> None:
        path = self._pick()
        size = os.path.getsize(path)
        with open(path, "r+b") as f:
            f.seek(self.rng.randrange(size))
            b = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([b[0] ^ 0xFF]))

    def full_disk(self) -> None:
        if self.site.tmpfs:
            ballast = os.path.join(self.site.root, "ballast")
            fd = os.open(ballast, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                for chunk in (1 << 20, 4096, 1):      # until ENOSPC: the disk is full now
                    with contextlib.suppress(OSError):
                        while True:
                            os.write(fd, b"\0" * chunk)
                time.sleep(self._hold())
            finally:
                os.close(fd)
                with contextlib.suppress(OSError):
                    os.unlink(ballast)
        else:   # no tmpfs (not root): the store's own limit shrinks to nothing for a while
            backend = self.handle.engine.l3_store.backend
            old = backend.config
            backend.config = dataclasses.replace(old, size_limit_bytes=64 << 10)
            try:
                time.sleep(self._hold())
            finally:
                backend.config = old

    # mooncake
    def master_killed(self) -> None:
        self.site.master.stop()
        time.sleep(self._hold())
        self.site.master.start()

    def master_stopped(self) -> None:
        os.kill(self.site.master.proc.pid, signal.SIGSTOP)
        try:
            time.sleep(self._hold())
        finally:
            os.kill(self.site.master.proc.pid, signal.SIGCONT)

    # both
    def client_disconnect(self) -> None:
        u = urllib.parse.urlparse(self.url)
        body = json.dumps({"input_ids": [BOS] + [self.rng.randrange(256) for _ in range(300)],
                           "stream": True, "sampling_params": {
                               "max_new_tokens": 400, "temperature": 0,
                               "ignore_eos": True}}).encode()
        socks = []
        for _ in range(3):
            s = socket.create_connection((u.hostname, u.port), timeout=30)
            s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                      b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            socks.append(s)
        for s in socks:
            buf = b""
            with contextlib.suppress(OSError):
                while buf.count(b"data: ") < 2:
                    chunk = s.recv(65536)
                    if not chunk:
                        break
                    buf += chunk
            s.close()

    def flush(self) -> None:
        t = time.monotonic()
        r = requests.get(self.url + "/flush_cache", timeout=120)
        self.flush_s.append(time.monotonic() - t)
        if r.status_code != 200:
            raise HTTPStatus(r.status_code, r.text[:200])


# -- load -----------------------------------------------------------------------------------
@dataclasses.dataclass
class Sample:
    t0: float
    t1: float
    outcome: str        # "ok", "wrong", or an error kind


def client(url: str, sessions: list[list[Turn]], k: int, n_clients: int, end: float,
           rng: random.Random, out: list[Sample], wrong: list[dict]) -> None:
    mine = sessions[k::n_clients] or sessions
    i = 0
    while time.monotonic() < end:
        for turn in mine[i % len(mine)]:
            if time.monotonic() >= end:
                return
            t0 = time.monotonic()
            try:
                res = generate(url, turn.prompt, turn.max_new, stream=rng.random() < 0.5)
                outcome = "ok" if res["output_ids"] == turn.expected else "wrong"
                if outcome == "wrong" and len(wrong) < 20:
                    wrong.append({"prompt_len": len(turn.prompt), "got": res["output_ids"],
                                  "expected": turn.expected})
            except HTTPStatus as exc:
                outcome = f"http_{exc.status}"
            except requests.RequestException as exc:
                outcome = type(exc).__name__
            out.append(Sample(t0, time.monotonic(), outcome))
        i += 1


def percentiles(xs: list[float]) -> dict:
    if not xs:
        return {"n": 0}
    a = np.asarray(xs) * 1000
    return {"n": len(xs), "p50_ms": round(float(np.percentile(a, 50)), 1),
            "p99_ms": round(float(np.percentile(a, 99)), 1),
            "max_ms": round(float(a.max()), 1)}


def overlaps(s: Sample, windows: list[tuple[float, float, str]]) -> bool:
    return any(s.t0 <= b + GRACE_S and s.t1 >= a for a, b, _ in windows)


# -- main -----------------------------------------------------------------------------------
def soak(args) -> dict:
    t_ref = time.monotonic()
    sessions = build_reference(args)
    ref_s = time.monotonic() - t_ref
    work = tempfile.mkdtemp(prefix="hicache-soak-")
    site = FileStoreSite(work, args.store_mb) if args.backend == "file" else MooncakeSite(work)
    conf = os.path.join(work, "l3.json")
    with open(conf, "w") as f:
        json.dump(site.config(args.deadline_s), f)
    cfg = ServerConfig(port=0, model=args.model, l1_tokens=args.l1_tokens,
                       l2_tokens=args.l2_tokens, max_running_requests=16,
                       chunked_prefill_size=256, hicache_storage_backend_config=conf,
                       hicache_storage_prefetch_policy="wait_complete")
    handle = start_server(cfg)
    faults = Faults(args, site, handle, random.Random(args.seed + 1))
    samples: list[Sample] = []
    wrong: list[dict] = []
    try:
        end = time.monotonic() + args.minutes * 60
        injector = threading.Thread(target=faults.run, daemon=True)
        loaders = [threading.Thread(target=client, args=(
            handle.url, sessions, k, args.clients, end, random.Random(args.seed + 10 + k),
            samples, wrong), daemon=True) for k in range(args.clients)]
        for t in loaders:
            t.start()
        injector.start()
        for t in loaders:
            t.join()
        faults.stop.set()
        injector.join(timeout=120)
        degraded_at_end = handle.engine.storage_degraded()
        time.sleep(args.deadline_s * 2)
        t = time.monotonic()
        r = requests.get(handle.url + "/flush_cache", timeout=120)
        final_flush_s = time.monotonic() - t
        eng = handle.engine
        stats = eng.scheduler.call(eng.cache.stats).result(60)
        problems = eng.scheduler.call(lambda: check_cache(eng.cache, idle=True)).result(60)
        health = requests.get(handle.url + "/health", timeout=30).json()
    finally:
        t = time.monotonic()
        handle.stop()
        stop_s = time.monotonic() - t
        site.close()
        shutil.rmtree(work, ignore_errors=True)
    l3 = stats.get("l3") or {}
    outcomes: dict[str, int] = {}
    for s in samples:
        outcomes[s.outcome] = outcomes.get(s.outcome, 0) + 1
    served = [s for s in samples if s.outcome in ("ok", "wrong")]
    during = [s.t1 - s.t0 for s in served if overlaps(s, faults.windows)]
    quiet = [s.t1 - s.t0 for s in served if not overlaps(s, faults.windows)]
    return {
        "config": {"backend": args.backend, "minutes": args.minutes, "clients": args.clients,
                   "sessions": args.sessions, "turns": args.turns, "seed": args.seed,
                   "l1_tokens": args.l1_tokens, "l2_tokens": args.l2_tokens,
                   "deadline_s": args.deadline_s, "prefetch_policy": "wait_complete",
                   "full_disk": ("tmpfs filled" if getattr(site, "tmpfs", False)
                                 else "size limit shrunk") if args.backend == "file" else None,
                   "reference_s": round(ref_s, 1), "cpus": os.cpu_count()},
        "requests": len(samples),
        "served": len(served),
        "wrong_outputs": outcomes.get("wrong", 0),
        "wrong_examples": wrong[:3],
        "errors": {k: v for k, v in outcomes.items() if k not in ("ok", "wrong")},
        "faults": faults.counts,
        "fault_setup_failures": faults.notes[:10],
        "flush_under_load_s": percentiles(faults.flush_s),
        "latency_during_faults": percentiles(during),
        "latency_without_faults": percentiles(quiet),
        "after_final_flush": {
            "status": r.status_code, "flush_s": round(final_flush_s, 3),
            "l1_used_tokens": stats.get("l1_used_tokens"),
            "l2_used_tokens": stats.get("l2_used_tokens"),
            "l1_locked_tokens": stats.get("l1_locked_tokens"),
            "inflight_ops": stats.get("inflight_ops"),
            "invariant_violations": len(problems), "health": health},
        "store": {k: l3.get(k) for k in ("hits", "misses", "corrupt", "errors", "puts",
                                          "put_failed", "abandoned", "refused", "recovered")},
        "store_degraded_at_end_of_load": degraded_at_end,
        "server_stop_s": round(stop_s, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--backend", choices=["file", "mooncake"], default="file")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--sessions", type=int, default=12)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--l1-tokens", type=int, default=2048)
    ap.add_argument("--l2-tokens", type=int, default=2048)
    ap.add_argument("--deadline-s", type=float, default=1.0)
    ap.add_argument("--store-mb", type=int, default=96, help="file store tmpfs size")
    ap.add_argument("--fault-every", type=float, nargs=2, default=(2.0, 6.0),
                    metavar=("MIN_S", "MAX_S"))
    ap.add_argument("--out", help="also write the report here (JSON)")
    ap.add_argument("--hostile", action="store_true", help="the hostile classes instead "
                    "(benchmarks/soak_hostile.py): namespace pairs, converted stores, idle "
                    "gaps, workers stopped and killed, parent killed, wildcard listeners")
    ap.add_argument("--classes", help="with --hostile: a comma-separated subset")
    ap.add_argument("--tp", type=int, default=1, help="> 1: the multi-rank divergence soak "
                    "(benchmarks/soak_ranks.py): rounds of a TP server, one rank driven into "
                    "a random divergence class, guarded or not")
    ap.add_argument("--pp", type=int, default=1, help="> 1: the same with pipeline stages")
    ap.add_argument("--round-s", type=float, default=20.0,
                    help="with --tp/--pp: seconds of load per round")
    ap.add_argument("--diverge-classes", help="with --tp/--pp: a comma-separated subset of "
                    "the divergence classes (default: every one the shape allows)")
    ap.add_argument("--keep-dir", default=os.path.join(tempfile.gettempdir(),
                                                       "hicache-soak-ranks-kept"),
                    help="with --tp/--pp: where a round that went wrong keeps its rank logs")
    args = ap.parse_args()
    if args.tp > 1 or args.pp > 1:
        from soak_ranks import run_ranks

        rep = run_ranks(args)
    elif args.hostile:
        from soak_hostile import CLASSES, run_hostile

        names = args.classes.split(",") if args.classes else None
        bad = [n for n in names or [] if n not in CLASSES]
        if bad:
            ap.error(f"--classes: unknown {bad[0]!r}; choose from {', '.join(CLASSES)}")
        rep = run_hostile(args.minutes, args.seed, names)
    else:
        rep = soak(args)
    text = json.dumps(rep, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
