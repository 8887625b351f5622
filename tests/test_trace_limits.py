"""Traces are untrusted input whose file size says little about what they decode to: a few KB of
run-length encoded Parquet or of gzip can describe billions of blocks. Reading one is bounded by
named limits (MAX_TRACE_BLOCKS, MAX_TRACE_BYTES), checked before the memory is taken, with one
line and exit 1 when a trace goes past them; peak memory is measured in a child process."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import tracemalloc

import numpy as np
import pytest

from engine.core.errors import InputError
from engine.loadgen.trace import load_trace, trace_workload

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIG = 4_000_000                         # input_length: 7813 blocks of 512 tokens
NEED = -(-BIG // 512)
ROWS = (1 << 24) // NEED + 2           # just past the default block limit (MAX_TRACE_BLOCKS)

# Runs the CLI in a child and writes its peak RSS (KiB) to a file, whatever the exit. VmHWM,
# not getrusage's ru_maxrss: Linux carries ru_maxrss over from the forking parent (pytest).
CHILD = """
import runpy, sys
out = sys.argv.pop(1)
sys.argv = ["hicache"] + sys.argv[1:]
try:
    runpy.run_module("hicache_cli.app", run_name="__main__")
finally:
    hwm = [l for l in open("/proc/self/status") if l.startswith("VmHWM:")][0]
    open(out, "w").write(hwm.split()[1])
"""


def run_cli(tmp_path, *args, env=None, timeout=90):
    rss = tmp_path / "rss"
    try:
        p = subprocess.run([sys.executable, "-c", CHILD, str(rss), *args], cwd=ROOT,
                           capture_output=True, text=True, timeout=timeout,
                           env={**os.environ, "PYTHONPATH": ROOT, **(env or {})})
    except subprocess.TimeoutExpired:
        pytest.fail(f"no answer in {timeout} s")
    return p, int(rss.read_text()) // 1024


def crafted_parquet(path, rows, need=NEED, n=BIG):
    """``rows`` requests of ``n`` (4M) tokens whose hash ids are all 0: a few KB on disk."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    offsets = pa.array(np.arange(rows + 1, dtype=np.int32) * need)
    table = pa.table({
        "timestamp": pa.array(np.zeros(rows)),
        "input_length": pa.array(np.full(rows, n, dtype=np.int64)),
        "output_length": pa.array(np.ones(rows, dtype=np.int64)),
        "hash_ids": pa.ListArray.from_arrays(offsets, pa.array(np.zeros(rows * need,
                                                                        dtype=np.int64))),
    })
    pq.write_table(table, path, compression="zstd")
    return str(path)


def line(ts=0, n=BIG, ids=None):
    return json.dumps({"timestamp": ts, "input_length": n, "output_length": 1,
                       "hash_ids": [0] * NEED if ids is None else ids},
                      separators=(",", ":")) + "\n"


def test_tiny_parquet_describing_billions_of_blocks_is_refused_before_decoding(tmp_path):
    path = crafted_parquet(tmp_path / "bomb.parquet", ROWS)
    assert os.path.getsize(path) < 64 << 10
    p, peak = run_cli(tmp_path, "bench", "replay", path)
    assert p.returncode == 1, p.stderr[-2000:]
    err = p.stderr.strip().splitlines()
    assert len(err) == 1 and "MAX_TRACE_BLOCKS" in err[0] and "HICACHE_TRACE_MAX_BLOCKS" in err[0]
    assert "Traceback" not in p.stderr
    assert peak < 400, f"peak RSS {peak} MiB"


def test_gzip_bomb_of_long_requests_is_refused_with_bounded_memory(tmp_path):
    path = tmp_path / "bomb.jsonl.gz"
    with gzip.open(path, "wt", compresslevel=9) as f:
        one = line()
        for _ in range(ROWS):
            f.write(one)
    assert os.path.getsize(path) < 256 << 10
    p, peak = run_cli(tmp_path, "bench", "replay", str(path))
    assert p.returncode == 1, p.stderr[-2000:]
    err = p.stderr.strip().splitlines()
    assert len(err) == 1 and f"bomb.jsonl.gz:{ROWS - 1}:" in err[0] and "MAX_TRACE_BLOCKS" in err[0]
    assert peak < 400, f"peak RSS {peak} MiB"


def test_gzip_bomb_of_padding_hits_the_byte_limit(tmp_path):
    path = tmp_path / "pad.jsonl.gz"
    with gzip.open(path, "wt") as f:
        for _ in range(64):
            f.write(" " * (1 << 20) + "\n")
        f.write(line(n=10, ids=[1]))
    p, _ = run_cli(tmp_path, "bench", "convert-trace", str(path), str(tmp_path / "o.parquet"),
                   env={"HICACHE_TRACE_MAX_BYTES": str(16 << 20)})
    assert p.returncode == 1 and "MAX_TRACE_BYTES" in p.stderr, p.stderr[-2000:]
    assert len(p.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "o.parquet").exists()


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_block_limit_is_named_and_can_be_raised(tmp_path, monkeypatch, kind):
    if kind == "jsonl":
        path = tmp_path / "t.jsonl"
        path.write_text(line(n=5000, ids=list(range(10))) * 4)
    else:
        path = crafted_parquet(tmp_path / "t.parquet", 4, need=10, n=5000)
    monkeypatch.setenv("HICACHE_TRACE_MAX_BLOCKS", "30")
    with pytest.raises(InputError, match="exceeds the limit 30 .MAX_TRACE_BLOCKS"):
        load_trace(str(path))
    monkeypatch.setenv("HICACHE_TRACE_MAX_BLOCKS", "40")
    assert len(load_trace(str(path))) == 4


def test_bad_limit_value_is_a_usage_error(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(line(n=10, ids=[1]))
    p, _ = run_cli(tmp_path, "bench", "replay", str(path),
                   env={"HICACHE_TRACE_MAX_BLOCKS": "-5"})
    assert p.returncode == 2 and "HICACHE_TRACE_MAX_BLOCKS='-5'" in p.stderr, p.stderr


@pytest.mark.parametrize("ts", [1e300, 2.0 ** 53])
def test_timestamps_past_2_53_ms_are_refused(tmp_path, ts):
    path = tmp_path / "t.jsonl"
    path.write_text(line(0, 10, [1]) + line(ts, 10, [2]))
    with pytest.raises(InputError, match="t.jsonl:2: timestamp must be a number of ms"):
        load_trace(str(path))


def test_replay_workload_holds_blocks_not_tokens(tmp_path):
    """A 70 KB trace of three 4M-token requests: the workload keeps the 23k block ids; each
    prompt's 4M tokens are made only when the request is sent (the old workload built every
    prompt up front as a tuple of Python ints, 36 bytes a token)."""
    path = tmp_path / "long.jsonl"
    path.write_text("".join(line(i, BIG, list(range(i * NEED, (i + 1) * NEED)))
                            for i in range(3)))
    tracemalloc.start()
    try:
        wl = trace_workload(str(path))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 32 << 20, f"{peak >> 20} MiB"
    spec = wl.sessions[2].first()
    assert spec.prompt_len == BIG and len(list(spec.input_ids)) == BIG
    assert spec.input_ids[:3] == tuple(spec.input_ids[i] for i in range(3))


def test_compressed_arrow_batches_are_sized_before_they_are_decoded(tmp_path):
    """A zstd-compressed Arrow IPC file of 2.4 KB whose one batch decodes to 12.5 MB: its
    decoded size is read from the batch's metadata (each compressed buffer leads with its
    length) and checked against MAX_TRACE_BYTES before the batch is decompressed."""
    import pyarrow as pa

    rows = 200
    table = pa.table({
        "timestamp": pa.array(np.zeros(rows)),
        "input_length": pa.array(np.full(rows, BIG, dtype=np.int64)),
        "output_length": pa.array(np.ones(rows, dtype=np.int64)),
        "hash_ids": pa.ListArray.from_arrays(pa.array(np.arange(rows + 1, dtype=np.int32) * NEED),
                                             pa.array(np.zeros(rows * NEED, dtype=np.int64))),
    })
    path = str(tmp_path / "bomb.arrow")
    with pa.OSFile(path, "wb") as f, pa.ipc.new_file(
            f, table.schema, options=pa.ipc.IpcWriteOptions(compression="zstd")) as w:
        w.write_table(table)
    assert os.path.getsize(path) < 16 << 10
    p, _ = run_cli(tmp_path, "bench", "replay", path,
                   env={"HICACHE_TRACE_MAX_BYTES": str(5_000_000)})
    assert p.returncode == 1, p.stderr[-2000:]
    assert "bomb.arrow: 12,5" in p.stderr and "exceeds the limit 5,000,000 (MAX_TRACE_BYTES" \
        in p.stderr and len(p.stderr.strip().splitlines()) == 1
    assert len(load_trace(path)) == rows            # within the default limit it reads
