"""Multi-rank divergence soak (``python benchmarks/soak.py --tp 2`` or ``--pp 2``): rounds of a
live multi-rank server, each with one rank driven into a random divergence class
(``--debug-diverge``, docs/parallelism.md "Rank divergence classes"), guarded or unguarded at
random, under a multi-turn load whose every greedy output is checked against a one-process
reference.

Per round:

* the server (its own process: a divergence that slipped through could make gloo abort it) runs
  with ``--consensus-check online --consensus-every 1`` and a file L3 (so every class applies
  where the shape allows it), with rank logs;
* clients replay the sessions for ``--round-s`` seconds (each request bounded by a timeout: one
  that runs out is a **hang**), then the L1/L2 are flushed and the sessions replayed once more
  (the L3 classes act on the second pass);
* guarded: every output must equal the reference, the server must still serve, and
  ``hicache consensus-check`` on its logs must find them consistent;
* unguarded: the server either stays consistent (the class did not fire in that round) or stops
  with the one ``stopped before a hang`` line naming the category; ``consensus-check`` must then
  report a divergence (exit 3). A stop without that line, an exit that takes longer than
  ``STOP_S``, or a hung request is a failure;
* in both, every output served before a stop must be right.

The report (JSON): rounds by class and outcome, hangs, wrong outputs, unnamed stops, the
categories named online and offline. All must be 0 where the docs say so.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import requests

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
REQUEST_TIMEOUT_S = 90.0   # a request that takes longer is a hang (collective timeout is 60)
STOP_S = 60.0              # a server asked to stop (or stopping itself) exits within this
L3_STORE_CLASSES = ("prefetch-count", "clock", "host-alloc", "l3-exists")


def classes_for(tp: int, pp: int) -> list[str]:
    """Every divergence class the server accepts for this shape (with a file L3)."""
    from engine.runtime.config import DIVERGE_CLASSES, DIVERGE_SHAPES, ServerConfig

    cfg = ServerConfig(tp=tp, pp=pp, hicache_storage_backend="file")
    return [c for c in DIVERGE_CLASSES if DIVERGE_SHAPES[c](cfg)]


def _spawn(args: list[str], err_path: str) -> tuple[subprocess.Popen, str]:
    with open(err_path, "w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "hicache_cli.app", "bench", "serve", "--port", "0",
             "--format", "json", *args],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=err, text=True,
            env=dict(os.environ, PYTHONPATH=ROOT))
    line = proc.stdout.readline() if proc.stdout else ""
    if not line:
        proc.wait(timeout=STOP_S)
        with open(err_path) as f:
            raise RuntimeError(f"server did not start: {f.read()[-500:]}")
    return proc, json.loads(line)["url"]


def _offline(log_dir: str) -> dict:
    r = subprocess.run([sys.executable, "-m", "hicache_cli.app", "consensus-check", log_dir,
                        "--format", "json"], cwd=ROOT, capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=ROOT), timeout=300)
    try:
        out = json.loads(r.stdout)
    except ValueError:
        out = {"unparsed": r.stdout[-300:] + r.stderr[-300:]}
    return {"code": r.returncode, **out}


def _client(url: str, sessions: list, k: int, n: int, end: float, rng: random.Random,
            res: dict, stopped: threading.Event) -> None:
    from soak import HTTPStatus, generate

    mine = sessions[k::n] or sessions
    i = 0
    while time.monotonic() < end and not stopped.is_set():
        for turn in mine[i % len(mine)]:
            if time.monotonic() >= end or stopped.is_set():
                return
            try:
                out = generate(url, turn.prompt, turn.max_new, stream=rng.random() < 0.3,
                               timeout=REQUEST_TIMEOUT_S)["output_ids"]
                key = "ok" if out == turn.expected else "wrong"
            except HTTPStatus as exc:
                key = f"http_{exc.status}"
                if exc.status >= 500:
                    res.setdefault("messages", []).append(str(exc)[:400])
                    stopped.set()
            except requests.Timeout:
                key = "hang"
            except requests.ConnectionError:
                key = "connection_closed"
                stopped.set()
            res[key] = res.get(key, 0) + 1
        i += 1


def one_round(args, sessions: list, cls: str, rank: int, after: int, unguarded: bool,
              seed: int) -> dict:
    work = tempfile.mkdtemp(prefix="hicache-soak-ranks-")
    logs = os.path.join(work, "logs")
    spec = f"{cls}@{rank}:{after}" + (",unguarded" if unguarded else "")
    flags = ["--tp", str(args.tp), "--pp", str(args.pp), "--l1-tokens", str(args.l1_tokens),
             "--l2-tokens", str(args.l2_tokens), "--page-size", "16",
             "--hicache-storage-backend", "file",
             "--hicache-storage-dir", os.path.join(work, "l3"),
             "--hicache-storage-prefetch-policy", "timeout" if cls == "clock" else
             "wait_complete", "--hicache-storage-prefetch-timeout", "30",
             "--rank-log-dir", logs, "--debug-diverge", spec, "--consensus-check", "online",
             "--consensus-every", "1", "--collective-timeout", "60"]
    err_path = os.path.join(work, "server.err")
    out: dict = {"class": cls, "spec": spec, "unguarded": unguarded}
    t0 = time.monotonic()
    proc, url = _spawn(flags, err_path)
    res: dict = {}
    stopped = threading.Event()
    try:
        for phase in range(2):              # the second pass after a flush reads the L3
            end = time.monotonic() + (args.round_s if phase == 0 else args.round_s / 2)
            threads = [threading.Thread(target=_client, args=(
                url, sessions, k, args.clients, end, random.Random(seed * 100 + k + phase),
                res, stopped), daemon=True) for k in range(args.clients)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(REQUEST_TIMEOUT_S + args.round_s + 30)
            if any(t.is_alive() for t in threads):
                res["hang"] = res.get("hang", 0) + 1
                break
            if stopped.is_set() or proc.poll() is not None:
                break
            try:
                requests.post(url + "/flush_cache", timeout=REQUEST_TIMEOUT_S)
            except requests.RequestException:
                stopped.set()
                break
        if proc.poll() is None and not stopped.is_set():
            proc.send_signal(signal.SIGINT)          # the group stops at one step, logs kept
        try:
            proc.wait(timeout=STOP_S)
        except subprocess.TimeoutExpired:
            out["stop_hang"] = True
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    with open(err_path) as f:
        text = f.read()
    named = re.search(r"stopped before a hang: rank consensus lost at step \d+, seq \d+ "
                      r"\(event \d+ since the last agreement\): (\w+):", text)
    out.update(requests=res, seconds=round(time.monotonic() - t0, 1), exit=proc.returncode,
               online=named.group(1) if named else None,
               traceback="Traceback" in text)
    if stopped.is_set() or proc.returncode not in (0, None):
        out["stopped"] = True
        out["named"] = bool(named) and proc.returncode == 1
        if not out["named"]:
            out["stderr_tail"] = text[-600:]
    off = _offline(logs)
    out["offline"] = {"code": off.get("code"), "consistent": off.get("consistent"),
                      "category": (off.get("divergences") or [{}])[0].get("category")}
    out["problems"] = _verdict(out)
    if out["problems"] and args.keep_dir:        # the logs and the server's stderr, to study
        dest = os.path.join(args.keep_dir, f"round-{seed}")
        shutil.copytree(work, dest, dirs_exist_ok=True)
        out["kept"] = dest
    shutil.rmtree(work, ignore_errors=True)
    return out


def _verdict(r: dict) -> list[str]:
    """What went wrong in a round (empty: it behaved as the docs say)."""
    bad = []
    req = r["requests"]
    if req.get("hang") or r.get("stop_hang"):
        bad.append("hang")
    if req.get("wrong"):
        bad.append("wrong outputs")
    if r.get("traceback"):
        bad.append("traceback in the server's log")
    if not r["unguarded"]:
        if r.get("stopped"):
            bad.append("a guarded round stopped")
        if r["offline"]["code"] != 0:
            bad.append("a guarded round's logs are not consistent")
    elif r.get("stopped"):
        if not r.get("named"):
            bad.append("a stop without its one named line")
        if r["offline"]["code"] != 3:
            bad.append("consensus-check did not find the divergence the server stopped on")
    elif r["offline"]["code"] != 0:
        bad.append("an unguarded divergence went unnoticed online")
    return bad


def run_ranks(args) -> dict:
    from soak import build_reference

    t_ref = time.monotonic()
    sessions = build_reference(args)
    ref_s = time.monotonic() - t_ref
    rng = random.Random(args.seed)
    names = classes_for(args.tp, args.pp)
    if args.diverge_classes:
        names = [n for n in args.diverge_classes.split(",") if n in names] or names
    n_ranks = args.tp * args.pp
    rounds = []
    end = time.monotonic() + args.minutes * 60
    while time.monotonic() < end:
        cls = rng.choice(names)
        r = one_round(args, sessions, cls, rng.randrange(n_ranks), rng.randint(0, 3),
                      rng.random() < 0.5, rng.randrange(1 << 30))
        rounds.append(r)
        print(json.dumps({k: r[k] for k in ("spec", "seconds", "online", "problems")}),
              file=sys.stderr, flush=True)
    by: dict = {}
    for r in rounds:
        b = by.setdefault(r["class"], {"guarded": 0, "unguarded": 0, "stopped_named": 0,
                                       "unguarded_quiet": 0, "categories": []})
        b["unguarded" if r["unguarded"] else "guarded"] += 1
        if r.get("stopped") and r.get("named"):
            b["stopped_named"] += 1
            b["categories"].append(r["online"])
        elif r["unguarded"]:
            b["unguarded_quiet"] += 1
    count = (lambda key: sum(r["requests"].get(key, 0) for r in rounds))
    return {
        "config": {"tp": args.tp, "pp": args.pp, "minutes": args.minutes,
                   "round_s": args.round_s, "clients": args.clients, "seed": args.seed,
                   "classes": names, "reference_s": round(ref_s, 1), "cpus": os.cpu_count()},
        "rounds": len(rounds),
        "requests_ok": count("ok"),
        "wrong_outputs": count("wrong"),
        "hangs": sum(1 for r in rounds if "hang" in r["problems"]),
        "unnamed_stops": sum(1 for r in rounds if r.get("stopped") and not r.get("named")),
        "rounds_with_problems": [r for r in rounds if r["problems"]],
        "by_class": by,
    }
