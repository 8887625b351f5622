#!/usr/bin/env bash
# One prepared run for a machine with a CUDA GPU: the GPU-marked tests, then the main job and
# a serve+run benchmark on the GPU presets. Prints everything; writes logs under $OUT (or ./gpu-out).
#
# Usage (repo root, on the GPU machine):  bash benchmarks/gpu_check.sh
# With the project's .venv absent, it uses the machine's python3 (which must have torch with
# CUDA) and the repo on PYTHONPATH; missing pure-Python packages can be carried as wheels
# (see docs/gpu.md).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
PY=python3
[ -x .venv/bin/python ] && PY=.venv/bin/python
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1
HC="$PY -m hicache_cli.app"

echo "== device"
$PY -c "import torch; print(torch.__version__, torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '-')"

echo "== GPU-marked tests"
$PY -m pytest -q -m gpu tests/test_gpu_paths.py tests/test_model_gpu.py 2>&1 | tee "$OUT/gpu-tests.log"

echo "== main job on the GPU (small preset)"
$HC bench --device cuda --model small --format json > "$OUT/main-job-small.json" 2> "$OUT/main-job-small.err"
$PY - "$OUT/main-job-small.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for name, run in d["runs"].items():
    print(f"{name:8s} hit {run['hit_rate']['total']:.3f}  ttft p50 {run['ttft_s']['p50']*1e3:.1f} ms"
          f"  throughput {run.get('throughput', {})}")
PY

echo "== agentic load against a GPU server (medium preset)"
$HC bench serve --device cuda --model medium --port 30555 --l1-tokens 262144 --l2-tokens 1048576 \
    --page-size 64 --format json > "$OUT/serve.json" 2> "$OUT/serve.err" &
SERVER=$!
for _ in $(seq 120); do grep -q url "$OUT/serve.json" 2>/dev/null && break; sleep 1; done
$HC bench run --url http://127.0.0.1:30555 -w agentic --format json > "$OUT/agentic.json" \
    2> "$OUT/agentic.err"
tail -c 2000 "$OUT/agentic.json"
kill -INT $SERVER; wait $SERVER
echo "== done: logs in $OUT"
