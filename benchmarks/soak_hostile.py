"""Hostile soak: the classes of attack the hostile review found, in rotation for ``--minutes``,
each trial checked for what it must never do (``python benchmarks/soak.py --hostile``).

Classes (one trial each, picked in turn; every output compared with the same prompt's fresh
output):

* ``namespace_pair`` — one prompt under two different namespaces (random fields among
  ``lora_path``, ``lora_id``, ``cache_salt``, ``extra_key``, ``namespace`` and their
  combinations): the second must reuse nothing (a reuse is a **shared-KV hit**); the first again
  must hit; outputs equal.
* ``converted_store`` — a server writes a file L3 store, ``convert-layout --verify`` converts it
  to a random target (grids, both byte orders, legacy shapes) and back to the unified default, a
  server on the result answers the same prompts: **wrong outputs** counted, storage hits expected.
* ``idle_gap`` — a P/D server with short link timeouts serves a request, stays idle past every
  timeout, and must serve the next one right.
* ``worker_stopped`` / ``worker_killed`` — a ``--tp 2``, ``--cp 2`` or ``--pp 2`` server (or P/D)
  with a short heartbeat: one follower process SIGSTOPped or SIGKILLed; a request in flight must
  end (an answer or an error) within the bound, never **hang**, and the server must stop naming
  the rank.
* ``parent_killed`` — the front process of a multi-process server is SIGKILLed: every worker
  must be gone within a few seconds (else an **orphan**).
* every multi-process server start is also checked for **wildcard listeners** (a listening
  socket of its process tree on 0.0.0.0 or ::).

Report: trials per class, wrong outputs, shared-KV hits, hangs, orphans, wildcard listeners (all
must be 0), and per-class notes. Figures: docs/reliability.md.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np
import requests

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from checkers.procs import alive, descendants, listeners, wildcard  # noqa: E402
from engine.runtime.launch import ServerConfig, start_server  # noqa: E402

FIELDS = ("lora_path", "lora_id", "cache_salt", "extra_key", "namespace")
TARGETS = ["unified:layers=1,heads=1+page_first", "unified:layers=2,heads=2",
           "unified:layers=4,heads=1+page_first", "unified:tp=2,pp=1", "unified+page_first",
           "legacy:tp=2,pp=1", "legacy:tp=2,pp=1+page_first", "legacy:tp=1,pp=2"]
HANG_S = 30.0           # a request still open this long after a fault is a hang
ORPHAN_S = 10.0         # workers must be gone this long after their parent was killed
HEARTBEAT_S = 2.0


def _prompt(rng: random.Random, n: int = 96) -> list[int]:
    return [rng.randrange(0, 256) for _ in range(n)]


def _generate(url: str, ids: list[int], extra: dict | None = None, timeout: float = 120,
              n: int = 6) -> dict:
    r = requests.post(url + "/generate", timeout=timeout, json={
        "input_ids": ids, "sampling_params": {"max_new_tokens": n, "temperature": 0,
                                              "ignore_eos": True}, **(extra or {})})
    if r.status_code != 200:
        raise RuntimeError(f"HTTP {r.status_code}: {r.text[:200]}")
    return r.json()


def _random_namespace(rng: random.Random) -> dict:
    k = rng.randint(1, 3)
    return {f: rng.choice("ABX") for f in rng.sample(FIELDS, k)}


# -- in-process classes ----------------------------------------------------------------------
class Report:
    def __init__(self) -> None:
        self.trials: dict[str, int] = {}
        self.wrong_outputs = self.shared_kv_hits = self.hangs = self.orphans = 0
        self.wildcard_listeners = 0
        self.notes: dict[str, list[str]] = {}
        self.errors: dict[str, int] = {}

    def note(self, cls: str, msg: str) -> None:
        self.notes.setdefault(cls, [])
        if len(self.notes[cls]) < 5:
            self.notes[cls].append(msg)

    def as_dict(self) -> dict:
        return {"trials": self.trials, "wrong_outputs": self.wrong_outputs,
                "shared_kv_hits": self.shared_kv_hits, "hangs": self.hangs,
                "orphans": self.orphans, "wildcard_listeners": self.wildcard_listeners,
                "errors": self.errors, "notes": self.notes}


def namespace_pair(rep: Report, rng: random.Random, ctx: dict) -> None:
    url = ctx.setdefault("ns_server", start_server(ServerConfig(
        port=0, l1_tokens=4096, l2_tokens=4096, page_size=16))).url
    a = _random_namespace(rng)
    b = _random_namespace(rng)
    while b == a:
        b = _random_namespace(rng)
    ids = _prompt(rng)
    first = _generate(url, ids, a)
    other = _generate(url, ids, b)
    again = _generate(url, ids, a)
    if other["meta_info"]["cached_tokens"] != 0:
        rep.shared_kv_hits += 1
        rep.note("namespace_pair", f"{b} reused {other['meta_info']['cached_tokens']} tokens "
                                   f"cached for {a}")
    if again["meta_info"]["cached_tokens"] == 0:
        rep.note("namespace_pair", f"{a} did not reuse its own prefix")
    if not (first["output_ids"] == other["output_ids"] == again["output_ids"]):
        rep.wrong_outputs += 1
        rep.note("namespace_pair", f"outputs differ between {a} and {b}")


def converted_store(rep: Report, rng: random.Random, ctx: dict) -> None:
    work = tempfile.mkdtemp(prefix="hicache-hostile-convert-")
    try:
        src, mid, dst = (os.path.join(work, n) for n in ("src", "mid", "dst"))
        cfg = dict(port=0, l1_tokens=2048, l2_tokens=2048, page_size=16,
                   hicache_storage_backend="file",
                   hicache_storage_prefetch_policy="wait_complete")
        prompts = [_prompt(rng, 128) for _ in range(2)]
        with start_server(ServerConfig(**cfg, hicache_storage_dir=src)) as s:
            want = [_generate(s.url, p)["output_ids"] for p in prompts]
        target = rng.choice(TARGETS)
        for a, b, to in ((src, mid, target), (mid, dst, "unified")):
            r = subprocess.run([sys.executable, "-m", "hicache_cli.app", "convert-layout", a, b,
                                "--to", to, "--verify"], cwd=ROOT, capture_output=True,
                               text=True, timeout=600, env=dict(os.environ, PYTHONPATH=ROOT))
            if r.returncode != 0:
                rep.errors["convert_failed"] = rep.errors.get("convert_failed", 0) + 1
                rep.note("converted_store", f"--to {to}: exit {r.returncode}: "
                                            f"{r.stderr.strip()[:200]}")
                return
        with start_server(ServerConfig(**cfg, hicache_storage_dir=dst)) as s:
            got = [_generate(s.url, p) for p in prompts]
        for w, g in zip(want, got):
            if g["output_ids"] != w:
                rep.wrong_outputs += 1
                rep.note("converted_store", f"via {target}: wrong output")
            if g["meta_info"]["cached_tokens_details"]["storage"] == 0:
                rep.note("converted_store", f"via {target}: no storage hit")
    finally:
        shutil.rmtree(work, ignore_errors=True)


# -- multi-process classes -------------------------------------------------------------------
class Spawned:
    def __init__(self, *args: str):
        # stderr to a file: a pipe nobody reads could fill and block the server's exit
        self.err = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "hicache_cli.app", "bench", "serve", "--port", "0",
             "--format", "json", "--l1-tokens", "1024", "--l2-tokens", "2048", *args],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=self.err, text=True,
            env=dict(os.environ, PYTHONPATH=ROOT), start_new_session=True)
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"server did not start: {self.stderr()[-400:]}")
        self.url = json.loads(line)["url"]
        time.sleep(0.5)
        self.pids = [self.proc.pid] + descendants(self.proc.pid)

    def stderr(self) -> str:
        self.err.seek(0)
        return self.err.read()

    def close(self) -> None:
        for pid in self.pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(timeout=30)
        self.err.close()


MODES = [["--tp", "2"], ["--cp", "2"], ["--pp", "2"]]


def _listeners(rep: Report, srv: Spawned, cls: str) -> None:
    bad = wildcard(listeners(srv.pids + descendants(srv.proc.pid)))
    if bad:
        rep.wildcard_listeners += len(bad)
        rep.note(cls, f"wildcard listeners: {bad}")


def idle_gap(rep: Report, rng: random.Random, ctx: dict) -> None:
    timeout = 3
    srv = Spawned("--disaggregation", "pd", "--pd-link-timeout", str(timeout))
    try:
        _listeners(rep, srv, "idle_gap")
        ids = _prompt(rng)
        first = _generate(srv.url, ids)["output_ids"]
        time.sleep(timeout * 2 + 1)
        try:
            second = _generate(srv.url, ids)["output_ids"]
        except (RuntimeError, requests.RequestException) as exc:
            rep.errors["idle_gap_failed"] = rep.errors.get("idle_gap_failed", 0) + 1
            rep.note("idle_gap", f"after {timeout * 2 + 1} s idle: {exc}")
            return
        if second != first:
            rep.wrong_outputs += 1
    finally:
        srv.close()


def _worker_fault(rep: Report, rng: random.Random, sig: int, cls: str) -> None:
    mode = rng.choice(MODES)
    srv = Spawned(*mode, "--rank-heartbeat-timeout", str(HEARTBEAT_S))
    try:
        _listeners(rep, srv, cls)
        _generate(srv.url, _prompt(rng))
        followers = [p for p in srv.pids if p != srv.proc.pid and _is_rank(p)]
        if not followers:
            rep.note(cls, f"{mode}: no follower process found")
            return
        os.kill(rng.choice(followers), sig)
        t0 = time.monotonic()
        try:
            _generate(srv.url, _prompt(rng), timeout=HANG_S)
        except requests.Timeout:
            rep.hangs += 1
            rep.note(cls, f"{mode}: request still open after {HANG_S} s")
        except (RuntimeError, requests.RequestException):
            pass                                  # an error, at once: what is asked
        try:
            srv.proc.wait(timeout=HANG_S)
        except subprocess.TimeoutExpired:
            rep.hangs += 1
            rep.note(cls, f"{mode}: server still running {HANG_S} s after the fault")
            return
        err = srv.stderr()
        if not any(w in err for w in ("rank", "stage", "worker")):
            rep.note(cls, f"{mode}: exit {srv.proc.returncode} without naming the process")
        rep.note(cls, f"{mode}: stopped in {time.monotonic() - t0:.1f} s")
    finally:
        srv.close()


def worker_stopped(rep: Report, rng: random.Random, ctx: dict) -> None:
    _worker_fault(rep, rng, signal.SIGSTOP, "worker_stopped")


def worker_killed(rep: Report, rng: random.Random, ctx: dict) -> None:
    _worker_fault(rep, rng, signal.SIGKILL, "worker_killed")


def parent_killed(rep: Report, rng: random.Random, ctx: dict) -> None:
    mode = rng.choice(MODES + [["--disaggregation", "pd"]])
    srv = Spawned(*mode)
    try:
        _listeners(rep, srv, "parent_killed")
        workers = [p for p in descendants(srv.proc.pid) if _is_rank(p)]
        os.kill(srv.proc.pid, signal.SIGKILL)
        srv.proc.wait(timeout=30)
        deadline = time.monotonic() + ORPHAN_S
        left = workers
        while left and time.monotonic() < deadline:
            time.sleep(0.2)
            left = [p for p in left if alive(p)]
        if left:
            rep.orphans += len(left)
            rep.note("parent_killed", f"{mode}: {len(left)} workers alive {ORPHAN_S} s after "
                                      "their parent was killed")
    finally:
        srv.close()


def _is_rank(pid: int) -> bool:
    """A rank or worker process (spawned by multiprocessing), not its resource tracker."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"spawn_main" in f.read()
    except OSError:
        return False


CLASSES = {"namespace_pair": namespace_pair, "converted_store": converted_store,
           "idle_gap": idle_gap, "worker_stopped": worker_stopped,
           "worker_killed": worker_killed, "parent_killed": parent_killed}


def run_hostile(minutes: float, seed: int = 0, classes: list[str] | None = None) -> dict:
    rng = random.Random(seed)
    np.random.seed(seed)
    names = classes or list(CLASSES)
    rep = Report()
    ctx: dict = {}
    t0 = time.monotonic()
    end = t0 + minutes * 60
    i = 0
    try:
        while time.monotonic() < end:
            name = names[i % len(names)]
            i += 1
            try:
                CLASSES[name](rep, rng, ctx)
            except Exception as exc:  # noqa: BLE001 - a trial that could not run is counted
                rep.errors[f"{name}: {type(exc).__name__}"] = \
                    rep.errors.get(f"{name}: {type(exc).__name__}", 0) + 1
                rep.note(name, f"trial failed: {exc}"[:300])
            rep.trials[name] = rep.trials.get(name, 0) + 1
    finally:
        if "ns_server" in ctx:
            ctx["ns_server"].stop()
    return {"mode": "hostile", "minutes": minutes, "seed": seed,
            "wall_s": round(time.monotonic() - t0, 1), **rep.as_dict()}
