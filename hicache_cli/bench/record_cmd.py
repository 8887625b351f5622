"""``hicache bench record-events``: subscribe to a server's KV events and write them to a file
that ``hicache inspect`` reads as a tree (docs/kv-events.md, "Recording")."""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Optional

import typer

from engine.core.errors import UsageError
from hicache_cli.output import OutputFormat, emit_json, handle_errors, stderr, stdout

DEFAULT_MAX_BYTES = 1 << 30


def register(bench_app: typer.Typer) -> None:
    @bench_app.command("record-events")
    @handle_errors
    def record_events_cmd(
        endpoint: str = typer.Option("tcp://127.0.0.1:5557", "--endpoint", help="The server's "
                                     "KV-event PUB endpoint (/server_info's kv_events)."),
        out: Path = typer.Option(..., "--out", help="File to write (replaced)."),
        duration: Optional[float] = typer.Option(None, "--duration", metavar="S",
                                                 help="Stop after S seconds."),
        count: Optional[int] = typer.Option(None, "--count", metavar="N",
                                            help="Stop after N batches."),
        topic: str = typer.Option("", "--topic", help="Topic prefix to subscribe to."),
        replay: Optional[str] = typer.Option(None, "--replay-endpoint", help="The server's "
                                             "replay endpoint: start with every batch it still "
                                             "buffers (from sequence 0), then go live."),
        max_bytes: int = typer.Option(DEFAULT_MAX_BYTES, "--max-bytes", help="Stop before "
                                      "the file would grow past this size."),
        fmt: OutputFormat = typer.Option(OutputFormat.human, "--format"),
    ) -> None:
        """Record a server's KV-event stream (ZMQ SUB) until --duration, --count or Ctrl-C;
        `hicache inspect FILE` shows the tree the events imply, per medium.

        Example: hicache bench record-events --endpoint tcp://127.0.0.1:5557 --out ev.kvev
        --duration 10
        """
        import zmq

        from formats import kv_events as kv
        from formats.outpath import atomic_output

        for name, ep in (("--endpoint", endpoint), ("--replay-endpoint", replay)):
            if ep is not None and not ep.startswith(("tcp://", "ipc://")):
                raise UsageError(f"{name} {ep!r}: give tcp://HOST:PORT")
        if duration is not None and duration <= 0 or count is not None and count < 1:
            raise UsageError("--duration must be > 0 and --count >= 1")
        if max_bytes < 1024:
            raise UsageError("--max-bytes must be >= 1024")
        stop = {"now": False}
        signal.signal(signal.SIGINT, lambda *_: stop.update(now=True))
        signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
        ctx = zmq.Context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.MAXMSGSIZE, kv.MAX_PAYLOAD_BYTES + 8192)
        n = size = 0
        first = last = None
        full = False
        try:
            try:
                sub.connect(endpoint)
                sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
            except zmq.ZMQError as exc:
                raise UsageError(f"--endpoint {endpoint}: {exc.strerror}") from None
            t0 = time.monotonic()
            with atomic_output(out) as f:
                kv.write_header(f, {"endpoint": endpoint, "topic": topic,
                                    "started_at": time.time()})

                def keep(frames: list) -> bool:
                    nonlocal n, size, first, last, full
                    if len(frames) != 3 or len(frames[1]) != 8:
                        return True               # not a KV-event message: skipped
                    seq = int.from_bytes(frames[1], "big")
                    if last is not None and seq <= last:
                        return True               # already recorded (replay, then live)
                    grow = len(frames[0]) + len(frames[2]) + 64
                    if size + grow > max_bytes:
                        full = True
                        return False
                    kv.write_frame(f, frames[0], seq, frames[2])
                    size += grow
                    n += 1
                    first = seq if first is None else first
                    last = seq
                    return count is None or n < count

                going = True
                if replay is not None:
                    going = _replay(ctx, replay, keep)
                while going and not stop["now"]:
                    if duration is not None and time.monotonic() - t0 >= duration:
                        break
                    if sub.poll(100):
                        going = keep(sub.recv_multipart())
                f.flush()
        finally:
            sub.close(0)
            ctx.term()
        why = "size limit" if full else "count" if count is not None and n >= count else "stop"
        if fmt is OutputFormat.json:
            emit_json({"out": str(out), "batches": n, "first_seq": first, "last_seq": last,
                       "stopped_by": why})
        else:
            span = f" (seq {first}..{last})" if n else ""
            stdout.print(f"recorded {n} batches{span} to {out}", highlight=False)
            if full:
                stderr.print(f"stopped at --max-bytes {max_bytes}")


def _replay(ctx, endpoint: str, keep) -> bool:
    """Every batch the replay socket still buffers, through ``keep``; False: stop."""
    import zmq

    from formats import kv_events as kv

    req = ctx.socket(zmq.DEALER)
    req.setsockopt(zmq.LINGER, 0)
    try:
        req.connect(endpoint)
        req.send_multipart([b"", (0).to_bytes(8, "big")])
        while True:
            if not req.poll(10_000):
                raise UsageError(f"--replay-endpoint {endpoint}: no answer in 10 s")
            frames = req.recv_multipart()
            if len(frames) != 4:
                continue
            _, topic, seq, payload = frames
            if seq == kv.END_SEQ:
                return True
            if not keep([topic, seq, payload]):
                return False
    finally:
        req.close(0)
