"""Mooncake trace loader and replay workload (plain and gzip, bad lines)."""

import gzip
import json

import numpy as np
import pytest

from engine.core.errors import InputError
from engine.loadgen.trace import block_tokens, read_trace, request_tokens, trace_workload

LINES = [
    {"timestamp": 0, "input_length": 700, "output_length": 5, "hash_ids": [0, 1]},
    {"timestamp": 1500, "input_length": 1100, "output_length": 3, "hash_ids": [0, 1, 2]},
    {"timestamp": 500, "input_length": 300, "output_length": 0, "hash_ids": [9]},
]


def write(path, lines, gz=False):
    text = "".join((l if isinstance(l, str) else json.dumps(l)) + "\n" for l in lines)
    if gz:
        with gzip.open(path, "wt") as f:
            f.write(text)
    else:
        path.write_text(text)
    return str(path)


@pytest.mark.parametrize("gz", [False, True])
def test_read_plain_and_gz(tmp_path, gz):
    recs = read_trace(write(tmp_path / ("t.jsonl.gz" if gz else "t.jsonl"), LINES, gz))
    assert [r.input_length for r in recs] == [700, 1100, 300]
    assert recs[1].hash_ids == (0, 1, 2)
    assert read_trace(write(tmp_path / "l.jsonl", LINES), limit=2)[-1].timestamp_ms == 1500


def test_blocks_shared_prefix_and_cut(tmp_path):
    w = trace_workload(write(tmp_path / "t.jsonl", LINES), speedup=2.0)
    specs = [s.first() for s in w.sessions]
    # sorted by timestamp, arrival in seconds / speedup
    assert [s.arrival for s in specs] == [0.0, 0.25, 0.75]
    assert [s.prompt_len for s in specs] == [700, 300, 1100]
    assert [s.max_tokens for s in specs] == [5, 1, 3]   # output 0 still asks for one token
    a, c = specs[0].input_ids, specs[2].input_ids
    assert c[:700] == a                                  # blocks 0,1 identical across requests
    assert specs[1].input_ids != c[:300]                 # block 9 differs from block 0
    assert list(c[:512]) == block_tokens(0).tolist()
    assert list(c[1024:1100]) == block_tokens(2)[:76].tolist()


def test_block_scaling_and_vocab(tmp_path):
    w = trace_workload(write(tmp_path / "t.jsonl", LINES), block_tokens_n=32, vocab_size=50,
                       max_tokens=2)
    specs = sorted((s.first() for s in w.sessions), key=lambda s: s.session)
    assert [s.prompt_len for s in specs] == [44, 19, 69]   # ceil(len * 32 / 512)
    assert [s.max_tokens for s in specs] == [2, 1, 2]
    assert max(max(s.input_ids) for s in specs) < 50
    assert specs[2].input_ids[:44] == specs[0].input_ids


def test_distinct_blocks_are_distinct_even_in_a_tiny_vocab():
    blocks = [tuple(block_tokens(b, 512, 256)) for b in range(2000)]
    assert len(set(blocks)) == 2000
    assert len(set(tuple(block_tokens(b, 4, 256)) for b in range(200))) > 195


def test_request_tokens_deterministic(tmp_path):
    r = read_trace(write(tmp_path / "t.jsonl", LINES))[1]
    assert np.array_equal(request_tokens(r), request_tokens(r))


@pytest.mark.parametrize("bad, msg", [
    ("{not json", "t.jsonl:2: not JSON"),
    ("[1, 2]", "t.jsonl:2: expected a JSON object"),
    (json.dumps({"timestamp": 0, "input_length": 10, "output_length": 1}), "missing field 'hash_ids'"),
    (json.dumps({"timestamp": -1, "input_length": 10, "output_length": 1, "hash_ids": [0]}), "timestamp"),
    (json.dumps({"timestamp": 0, "input_length": "10", "output_length": 1, "hash_ids": [0]}), "input_length"),
    (json.dumps({"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [0]}), "cannot cover"),
    (json.dumps({"timestamp": 0, "input_length": 6, "output_length": 1, "hash_ids": ["a"]}), "hash_ids"),
    # a bool is an int to Python, a whole float compares like one: neither is a block id
    (json.dumps({"timestamp": 0, "input_length": 6, "output_length": 1, "hash_ids": [0, True]}),
     "hash_ids must be a list of integers"),
    (json.dumps({"timestamp": 0, "input_length": 6, "output_length": 1, "hash_ids": [1.0]}),
     "hash_ids must be a list of integers"),
])
def test_bad_line_names_file_and_line(tmp_path, bad, msg):
    path = write(tmp_path / "t.jsonl", [LINES[0], bad])
    with pytest.raises(InputError, match=msg.replace("[", r"\[")):
        read_trace(path)


def test_empty_missing_and_corrupt_gz(tmp_path):
    with pytest.raises(InputError, match="no requests"):
        read_trace(write(tmp_path / "e.jsonl", [""]))
    with pytest.raises(FileNotFoundError):
        read_trace(str(tmp_path / "nope.jsonl"))
    broken = tmp_path / "b.jsonl.gz"
    broken.write_bytes(b"\x1f\x8b" + b"not really gzip" * 4)
    with pytest.raises(InputError, match="cannot read trace"):
        read_trace(str(broken))


def test_bad_options(tmp_path):
    path = write(tmp_path / "t.jsonl", LINES)
    with pytest.raises(ValueError, match="speedup"):
        trace_workload(path, speedup=0)
    with pytest.raises(ValueError, match="block tokens"):
        trace_workload(path, block_tokens_n=513)


# ---- columnar traces (Parquet / Arrow) ---------------------------------------------------

@pytest.mark.parametrize("suffix", [".parquet", ".arrow"])
def test_columnar_round_trip(tmp_path, suffix):
    from engine.loadgen.trace import load_trace
    from engine.loadgen.trace_arrow import write_columnar

    lines = LINES + [{"timestamp": 7, "input_length": 5, "output_length": 2,
                      "hash_ids": [4, 5, 6]}]             # more ids than the input needs
    src = load_trace(write(tmp_path / "t.jsonl", lines))
    dst = str(tmp_path / ("t" + suffix))
    write_columnar(src, dst)
    back = load_trace(dst)
    for col in ("timestamps_ms", "input_lengths", "output_lengths", "offsets", "blocks"):
        assert np.array_equal(getattr(back, col), getattr(src, col)), col
    assert back.records()[3].hash_ids == (4,)            # cut to the covering blocks
    assert read_trace(dst, limit=2) == read_trace(write(tmp_path / "u.jsonl", lines), limit=2)


def _parquet(path, **cols):
    import pyarrow as pa
    import pyarrow.parquet as pq

    base = {"timestamp": [0.0, 1.0], "input_length": [600, 10], "output_length": [1, 1],
            "hash_ids": [[1, 2], [3]]}
    base.update(cols)
    pq.write_table(pa.table({k: v for k, v in base.items() if v is not None}), path)
    return str(path)


@pytest.mark.parametrize("cols, msg", [
    ({"hash_ids": None}, "missing column 'hash_ids'"),
    ({"input_length": [600, None]}, "'input_length' has empty"),
    ({"input_length": [600.0, 10.0]}, "'input_length' must hold integers"),
    ({"input_length": [600, 0]}, "row 2: input_length must be an integer >= 1"),
    ({"timestamp": [0.0, -3.0]}, "row 2: timestamp"),
    ({"hash_ids": [[1], [3]]}, "row 1: hash_ids cannot cover"),
    ({"hash_ids": [[1, 2], [-3]]}, "row 2: hash_ids must be integers"),
    ({"hash_ids": [["a", "b"], ["c"]]}, "must be a list of integers"),
])
def test_columnar_bad_input_names_the_row(tmp_path, cols, msg):
    path = _parquet(tmp_path / "bad.parquet", **cols)
    with pytest.raises(InputError, match=msg):
        read_trace(path)


def test_columnar_truncated_file(tmp_path):
    good = _parquet(tmp_path / "good.parquet")
    cut = tmp_path / "cut.parquet"
    cut.write_bytes(open(good, "rb").read()[:60])
    with pytest.raises(InputError, match="cut.parquet: cannot read trace"):
        read_trace(str(cut))
