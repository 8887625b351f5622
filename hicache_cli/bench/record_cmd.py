"""``hicache bench record-events``: subscribe to a server's KV events and write them to a file
that ``hicache inspect`` reads as a tree (docs/kv-events.md, "Recording")."""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import Optional

import typer

from engine.core.errors import UsageError
from hicache_cli.output import OutputFormat, emit_json, handle_errors, stderr, stdout

_O = typer.Option


def record_events_cmd(
    endpoint: str = _O("tcp://127.0.0.1:5557", "--endpoint", help="The server's KV-event PUB "
                       "endpoint (/server_info's kv_events)."),
    out: Path = _O(..., "--out", help="File to write (replaced when the recording ends)."),
    duration: Optional[float] = _O(None, "--duration", metavar="S",
                                   help="Stop after S seconds."),
    count: Optional[int] = _O(None, "--count", metavar="N", help="Stop after N batches."),
    topic: str = _O("", "--topic", help="Topic prefix to subscribe to."),
    replay: Optional[str] = _O(None, "--replay-endpoint", help="The server's replay endpoint: "
                               "start with every batch it still buffers, then go live."),
    max_bytes: int = _O(1 << 30, "--max-bytes", help="Stop before the file would grow past "
                        "this size."),
    fmt: OutputFormat = _O(OutputFormat.human, "--format"),
) -> None:
    """Record a server's KV-event stream (ZMQ SUB) until --duration, --count or Ctrl-C;
    `hicache inspect FILE` shows the tree the events imply, per medium.

    Example: hicache bench record-events --endpoint tcp://127.0.0.1:5557 --out ev.kvev
    --duration 10
    """
    from engine.runtime.serving.kv_events import record

    for name, ep in (("--endpoint", endpoint), ("--replay-endpoint", replay)):
        if ep is not None and not ep.startswith("tcp://"):
            raise UsageError(f"{name} {ep!r}: give tcp://HOST:PORT")
    if (duration is not None and duration <= 0) or (count is not None and count < 1):
        raise UsageError("--duration must be > 0 and --count >= 1")
    if max_bytes < 1024:
        raise UsageError("--max-bytes must be >= 1024")
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        res = record(endpoint, str(out), topic=topic, replay=replay, duration=duration,
                     count=count, max_bytes=max_bytes, stop=stop)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if fmt is OutputFormat.json:
        emit_json({"out": str(out), "batches": res.batches, "first_seq": res.first_seq,
                   "last_seq": res.last_seq, "stopped_by": res.stopped_by})
        return
    span = f" (seq {res.first_seq}..{res.last_seq})" if res.batches else ""
    stdout.print(f"recorded {res.batches} batches{span} to {out}", highlight=False)
    if res.stopped_by == "size limit":
        stderr.print(f"stopped at --max-bytes {max_bytes}")


def register(bench_app: typer.Typer) -> None:
    bench_app.command("record-events")(handle_errors(record_events_cmd))
