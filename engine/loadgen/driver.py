"""The async HTTP driver: sends a workload's requests to ``POST {url}/generate`` (SGLang API).

Bounded by construction: a run ends when every session has finished, or — with ``duration`` —
stops issuing new requests once that many seconds have passed and waits only for the requests
already in flight (each bounded by ``timeout``). Requests go to the given URL and nowhere else.

Scheduling: at most ``concurrency`` requests in flight. Requests without an arrival time (the
conversation workloads) wait in one FIFO ready queue — a client's next turn joins the back of it
when its previous turn returns — and leave it at ``request_rate`` (Poisson, seeded) or as fast as
slots free up. Trace requests join the ready queue at their arrival time.
"""

from __future__ import annotations

import asyncio
import dataclasses
import heapq
import json
import math
import random
import time
from typing import TYPE_CHECKING, Any, Callable, Sequence
from urllib.parse import urlsplit

from engine.core.errors import InputError
from engine.loadgen.workloads import RequestSpec, Session, Workload

if TYPE_CHECKING:      # the HTTP client loads only when a load runs: CLI start-up stays fast
    import aiohttp


@dataclasses.dataclass(frozen=True)
class LoadConfig:
    url: str
    concurrency: int = 16
    duration: float | None = None
    """Seconds after which no new request is issued (in-flight ones still finish)."""
    request_rate: float = math.inf
    """Requests per second (Poisson arrivals) for requests without an arrival time."""
    max_tokens: int | None = None
    """Cap on every request's ``max_new_tokens``."""
    stream: bool = False
    """Stream responses (SSE) and measure TTFT on the client as well."""
    timeout: float = 600.0
    """Seconds one request may take."""
    ignore_eos: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "url", normalize_url(self.url))
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.duration is not None and not (self.duration > 0 and math.isfinite(self.duration)):
            raise ValueError(f"duration must be a finite number of seconds > 0, got {self.duration}")
        if not self.request_rate > 0:
            raise ValueError(f"request rate must be > 0 (inf = no limit), got {self.request_rate}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max-tokens must be >= 1, got {self.max_tokens}")
        if not self.timeout > 0:
            raise ValueError(f"timeout must be > 0, got {self.timeout}")


def normalize_url(url: str) -> str:
    """``host:port`` → ``http://host:port``; validates scheme and host; strips a trailing ``/``."""
    if "://" not in url:
        url = "http://" + url
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"invalid server URL {url!r}; expected http://HOST:PORT")
    try:
        _ = parts.port
    except ValueError:
        raise ValueError(f"invalid port in server URL {url!r}") from None
    return url.rstrip("/")


@dataclasses.dataclass
class RequestRecord:
    """What happened to one request (one parquet row). Times are seconds."""

    session: int
    turn: int
    start: float
    """Send time, seconds since the run started."""
    status: str = "ok"
    """``ok``, the HTTP status code of a failure (``"400"``…), ``connection``, ``timeout`` or
    ``bad_response``."""
    error: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    cached_device: int = 0
    cached_host: int = 0
    cached_storage: int = 0
    ttft: float = math.nan
    """Server-side time to first token (``meta_info.ttft``); client-measured when missing."""
    client_ttft: float = math.nan
    """Time to the first streamed chunk (``stream`` only)."""
    queue_time: float = math.nan
    e2e_latency: float = math.nan
    """Client-measured: send to last byte."""
    server_e2e_latency: float = math.nan
    spec_verify_steps: int = 0
    """Speculative decoding: target verify passes that produced this request's tokens."""
    pd_transfer: dict | None = None
    """P/D disaggregation (``meta_info.pd_transfer``): the decode worker's own tiers and what
    crossed the link, in tokens and bytes."""
    output_ids: list[int] | None = dataclasses.field(default=None, repr=False)

    @property
    def ok(self) -> bool:
        return self.status == "ok"


@dataclasses.dataclass
class LoadResult:
    workload: str
    records: list[RequestRecord]
    wall_s: float
    stopped_by: str
    """``done`` (every session finished) or ``duration``."""


class ServerUnreachable(InputError):
    pass


class _StreamError(Exception):
    """An error chunk inside an SSE stream (status, message)."""


async def _check_health(http: aiohttp.ClientSession, url: str, timeout: float) -> None:
    import aiohttp

    try:
        async with http.get(url + "/health", timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            if r.status >= 500:
                raise ServerUnreachable(f"server at {url} is unhealthy (GET /health: {r.status})")
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
        reason = str(exc) or type(exc).__name__
        raise ServerUnreachable(f"cannot reach server at {url}: {reason}") from None


def server_info(url: str, timeout: float = 5.0) -> dict | None:
    """``GET {url}/get_server_info`` as a dict (device, max_context, vocab_size… on our server,
    SGLang has the endpoint too); ``None`` when the server has no such endpoint or is down."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(normalize_url(url) + "/get_server_info", timeout=timeout) as r:
            body = json.loads(r.read(1 << 20))
    except (urllib.error.URLError, OSError, ValueError):
        return None
    return body if isinstance(body, dict) else None


def _payload(spec: RequestSpec, cfg: LoadConfig) -> dict[str, Any]:
    n = spec.max_tokens if cfg.max_tokens is None else min(spec.max_tokens, cfg.max_tokens)
    body = {
        "input_ids": list(spec.input_ids),
        "sampling_params": {"max_new_tokens": n, "temperature": 0.0,
                            "ignore_eos": cfg.ignore_eos},
        "stream": cfg.stream,
    }
    if spec.hint:
        body.update(spec.hint)             # the client's cache hints (docs/cache-hints.md)
    return body


def _fnum(v: Any) -> float:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else math.nan


def _inum(v: Any) -> int:
    return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else 0


PD_FIELDS = ("decode_device", "decode_host", "decode_storage", "transferred", "bytes",
             "redundant_bytes")


def _fill(rec: RequestRecord, body: dict, output_ids: list[int]) -> None:
    meta = body.get("meta_info")
    if not isinstance(meta, dict):
        raise ValueError("response has no meta_info")
    rec.prompt_tokens = _inum(meta.get("prompt_tokens"))
    rec.completion_tokens = _inum(meta.get("completion_tokens")) or len(output_ids)
    rec.cached_tokens = _inum(meta.get("cached_tokens"))
    det = meta.get("cached_tokens_details")
    if isinstance(det, dict):
        rec.cached_device = _inum(det.get("device"))
        rec.cached_host = _inum(det.get("host"))
        rec.cached_storage = _inum(det.get("storage"))
    rec.spec_verify_steps = _inum(meta.get("spec_verify_steps"))
    pd = meta.get("pd_transfer")
    if isinstance(pd, dict):
        rec.pd_transfer = {k: _inum(pd.get(k)) for k in PD_FIELDS}
    rec.queue_time = _fnum(meta.get("queue_time"))
    rec.server_e2e_latency = _fnum(meta.get("e2e_latency"))
    ttft = _fnum(meta.get("ttft"))
    rec.ttft = ttft if not math.isnan(ttft) else rec.client_ttft
    rec.output_ids = output_ids


def _ids(body: dict) -> list[int]:
    ids = body.get("output_ids")
    if ids is None:
        return []
    if not isinstance(ids, list):
        raise ValueError("output_ids is not a list")
    return [int(t) for t in ids]


async def _read_stream(resp: aiohttp.ClientResponse, rec: RequestRecord, t0: float
                       ) -> tuple[dict, list[int]]:
    """SSE ``data: {...}`` chunks until ``data: [DONE]``. Handles both cumulative and
    incremental ``output_ids``: incremental chunks are concatenated."""
    last: dict | None = None
    chunks: list[list[int]] = []
    async for raw in resp.content:
        line = raw.decode("utf-8", "replace").strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            break
        if math.isnan(rec.client_ttft):
            rec.client_ttft = time.perf_counter() - t0
        obj = json.loads(data)
        if not isinstance(obj, dict):
            raise ValueError("stream chunk is not a JSON object")
        if "error" in obj:
            err = obj["error"]
            code = err.get("code", 500) if isinstance(err, dict) else 500
            raise _StreamError(str(code), _error_message(json.dumps(obj)))
        chunks.append(_ids(obj))
        last = obj
    if last is None:
        raise ValueError("empty stream")
    meta = last.get("meta_info") or {}
    want = _inum(meta.get("completion_tokens")) if isinstance(meta, dict) else 0
    ids = chunks[-1]
    if want and len(ids) < want:
        ids = [t for c in chunks for t in c]
    return last, ids


async def _send(http: aiohttp.ClientSession, spec: RequestSpec, cfg: LoadConfig,
                t_start: float) -> RequestRecord:
    import aiohttp

    t0 = time.perf_counter()
    rec = RequestRecord(spec.session, spec.turn, t0 - t_start)
    try:
        async with http.post(cfg.url + "/generate", json=_payload(spec, cfg),
                             timeout=aiohttp.ClientTimeout(total=cfg.timeout)) as resp:
            if resp.status != 200:
                text = await resp.text(errors="replace")
                rec.status, rec.error = str(resp.status), _error_message(text)
            elif cfg.stream:
                body, ids = await _read_stream(resp, rec, t0)
                _fill(rec, body, ids)
            else:
                body = await resp.json(content_type=None)
                if not isinstance(body, dict):
                    raise ValueError("response is not a JSON object")
                _fill(rec, body, _ids(body))
    except _StreamError as exc:
        rec.status, rec.error = exc.args
    except asyncio.TimeoutError:
        rec.status, rec.error = "timeout", f"no answer within {cfg.timeout:g} s"
    except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, OSError) as exc:
        rec.status, rec.error = "connection", str(exc) or type(exc).__name__
    except (ValueError, TypeError, aiohttp.ContentTypeError) as exc:
        rec.status, rec.error = "bad_response", str(exc)[:200]
    rec.e2e_latency = time.perf_counter() - t0
    return rec


def _error_message(text: str) -> str:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return text.strip()[:200]
    if isinstance(obj, dict):
        err = obj.get("error", obj.get("message", obj))
        if isinstance(err, dict):
            err = err.get("message", err)
        return str(err)[:200]
    return str(obj)[:200]


async def run_load_async(workload: Workload, cfg: LoadConfig,
                         on_record: Callable[[RequestRecord], None] | None = None,
                         check_health: bool = True) -> LoadResult:
    import aiohttp

    rng = random.Random(cfg.seed)
    conn = aiohttp.TCPConnector(limit=cfg.concurrency, force_close=False)
    async with aiohttp.ClientSession(connector=conn) as http:
        if check_health:
            await _check_health(http, cfg.url, timeout=min(cfg.timeout, 10.0))
        loop = asyncio.get_running_loop()
        t_start = time.perf_counter()
        deadline = None if cfg.duration is None else loop.time() + cfg.duration
        start_loop = loop.time()

        ready: list[tuple[Session, RequestSpec]] = []
        timed: list[tuple[float, int, Session, RequestSpec]] = []  # heap by arrival
        counter = 0

        def enqueue(sess: Session, spec: RequestSpec | None) -> None:
            nonlocal counter
            if spec is None:
                return
            if spec.arrival is None:
                ready.append((sess, spec))
            else:
                heapq.heappush(timed, (start_loop + spec.arrival, counter, sess, spec))
                counter += 1

        for sess in workload.sessions:
            enqueue(sess, sess.first())

        in_flight: dict[asyncio.Task, tuple[Session, RequestSpec]] = {}
        records: list[RequestRecord] = []
        next_send = loop.time()
        stopped_by = "done"
        ready_head = 0
        try:
            while True:
                now = loop.time()
                if deadline is not None and now >= deadline:
                    if ready_head < len(ready) or timed or in_flight:
                        stopped_by = "duration"
                    break
                while timed and timed[0][0] <= now:
                    _, _, s, sp = heapq.heappop(timed)
                    ready.append((s, sp))
                pending = len(ready) - ready_head
                if pending and len(in_flight) < cfg.concurrency and now >= next_send:
                    sess, spec = ready[ready_head]
                    ready_head += 1
                    task = asyncio.ensure_future(_send(http, spec, cfg, t_start))
                    in_flight[task] = (sess, spec)
                    if math.isfinite(cfg.request_rate):
                        next_send = max(now, next_send) + rng.expovariate(cfg.request_rate)
                    continue
                if not pending and not timed and not in_flight:
                    break
                waits = []
                if timed:
                    waits.append(timed[0][0] - now)
                if pending and len(in_flight) < cfg.concurrency:
                    waits.append(next_send - now)
                if deadline is not None:
                    waits.append(deadline - now)
                timeout = max(0.0, min(waits)) if waits else None
                if in_flight:
                    done, _ = await asyncio.wait(in_flight, timeout=timeout,
                                                 return_when=asyncio.FIRST_COMPLETED)
                else:
                    await asyncio.sleep(timeout if timeout is not None else 0)
                    done = set()
                for task in done:
                    sess, spec = in_flight.pop(task)
                    rec = task.result()
                    records.append(rec)
                    if on_record is not None:
                        on_record(rec)
                    enqueue(sess, sess.after(spec, rec.output_ids if rec.ok else None))
                if ready_head > 1024 and ready_head * 2 > len(ready):
                    del ready[:ready_head]
                    ready_head = 0
            if in_flight:
                done, _ = await asyncio.wait(in_flight)
                in_flight.clear()
                for task in done:
                    rec = task.result()
                    records.append(rec)
                    if on_record is not None:
                        on_record(rec)
        finally:
            for task in in_flight:
                task.cancel()
        wall = time.perf_counter() - t_start
    records.sort(key=lambda r: r.start)
    return LoadResult(workload.name, records, wall, stopped_by)


def run_load(workload: Workload, cfg: LoadConfig,
             on_record: Callable[[RequestRecord], None] | None = None,
             check_health: bool = True) -> LoadResult:
    """Run a workload against ``cfg.url`` and return one record per request sent."""
    return asyncio.run(run_load_async(workload, cfg, on_record, check_health))


def records_as_columns(records: Sequence[RequestRecord]) -> dict[str, list]:
    """Column-wise view (one entry per request) for parquet/JSON output; drops output ids."""
    fields = [f.name for f in dataclasses.fields(RequestRecord)
              if f.name not in ("output_ids", "pd_transfer")]
    cols = {name: [getattr(r, name) for r in records] for name in fields}
    if any(r.pd_transfer is not None for r in records):    # flat: pd_transferred, pd_bytes…
        for k in PD_FIELDS:
            cols[f"pd_{k}"] = [None if r.pd_transfer is None else r.pd_transfer[k]
                               for r in records]
    return cols
