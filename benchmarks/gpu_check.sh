#!/usr/bin/env bash
# One prepared run for a machine with a CUDA GPU: the GPU-marked tests, the L1<->L2 transfer
# benchmark (mapped and staged paths), the main job and a serve+run benchmark on the GPU
# presets, then the whole test suite with CUDA present (the cache defaults to the GPU there).
# Prints everything; writes logs under $OUT (or ./gpu-out).
#
# Usage (repo root, on the GPU machine):  bash benchmarks/gpu_check.sh [STEP...]
#   STEP: info gputests transfer mainjob serve suite (default: all, in that order)
#   DEVICE=cpu bash benchmarks/gpu_check.sh mainjob serve   # rehearse the steps without a GPU
# With the project's .venv absent, it uses the machine's python3 (which must have torch with
# CUDA) and the repo on PYTHONPATH; missing pure-Python packages can be carried as wheels
# (see docs/gpu.md). SUITE_TIMEOUT (default 300 s) bounds the last step; SERVE_MODEL,
# SERVE_L1, SERVE_L2 (tokens) and RUN_TIMEOUT size the serve step.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-out}
DEVICE=${DEVICE:-cuda}
mkdir -p "$OUT"
PY=python3
[ -x .venv/bin/python ] && PY=.venv/bin/python
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1
HC="$PY -m hicache_cli.app"
STEPS=${*:-info gputests transfer mainjob serve suite}
T0=$(date +%s)
stamp() { echo "== [$(( $(date +%s) - T0 )) s] $*"; }

for step in $STEPS; do
case $step in
info)
  stamp "device"
  $PY -c "import torch; print(torch.__version__, torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '-')"
  nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv 2>/dev/null
  nproc; ;;
gputests)
  stamp "GPU-marked tests"
  $PY -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_paths.py tests/test_model_gpu.py \
      2>&1 | tee "$OUT/gpu-tests.log" | tail -25 ;;
transfer)
  stamp "L1<->L2 transfers, pinned L2 mapped into the device (default)"
  $PY benchmarks/bench_transfer.py --device "$DEVICE" --repeat 10 --json > "$OUT/transfer-mapped.json"
  $PY - "$OUT/transfer-mapped.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for r in d["results"]:
    print(f"{r['host_layout']:12s} page {r['page_size']:3d} {r.get('copy_path', d['copy_path'])}: "
          f"load {r['load_gbps']:7.2f} GB/s (raw {r['load_raw_gbps']:7.2f}, ratio {r['load_ratio']:.3f})  "
          f"backup {r['backup_gbps']:7.2f} GB/s (raw {r['backup_raw_gbps']:7.2f}, ratio {r['backup_ratio']:.3f})")
print("min ratio", d["min_ratio"])
PY
  stamp "L1<->L2 transfers, staged (HICACHE_UVA_COPY=0)"
  HICACHE_UVA_COPY=0 $PY benchmarks/bench_transfer.py --device "$DEVICE" --repeat 5 > "$OUT/transfer-staged.txt"
  cat "$OUT/transfer-staged.txt" ;;
mainjob)
  stamp "main job on $DEVICE (small preset)"
  $HC bench --device "$DEVICE" --model small --format json > "$OUT/main-job-small.json" 2> "$OUT/main-job-small.err"
  tail -n 3 "$OUT/main-job-small.err"
  $PY - "$OUT/main-job-small.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for name, run in d["runs"].items():
    print(f"{name:8s} hit {run['hit_rate']['total']:.3f}  ttft p50 {run['ttft_s']['p50']*1e3:.1f} ms"
          f"  throughput {run.get('throughput', {})}")
PY
  ;;
serve)
  stamp "agentic load against a $DEVICE server (medium preset)"
  $HC bench serve --device "$DEVICE" --model "${SERVE_MODEL:-medium}" --port 30555 \
      --l1-tokens "${SERVE_L1:-65536}" --l2-tokens "${SERVE_L2:-262144}" \
      --page-size 64 --format json > "$OUT/serve.json" 2> "$OUT/serve.err" &
  SERVER=$!
  for _ in $(seq 180); do
    grep -q url "$OUT/serve.json" 2>/dev/null && break
    kill -0 $SERVER 2>/dev/null || break; sleep 1
  done
  timeout "${RUN_TIMEOUT:-240}" $HC bench run --url http://127.0.0.1:30555 -w agentic --format json \
      > "$OUT/agentic.json" 2> "$OUT/agentic.err"
  echo "bench run exit $?"
  tail -c 1500 "$OUT/agentic.json"; tail -n 3 "$OUT/agentic.err" "$OUT/serve.err"
  kill -INT $SERVER 2>/dev/null; wait $SERVER ;;
suite)
  stamp "whole test suite with CUDA present (xdist where installed)"
  XD=""; $PY -c "import xdist" 2>/dev/null && XD="-n $(( $(nproc) > 12 ? 12 : $(nproc) ))"
  IGN=""; $PY -c "import openai" 2>/dev/null || \
      IGN="--ignore=tests/test_server.py --ignore=tests/test_server_compat.py --ignore=tests/test_smollm2.py"
  timeout -s INT -k 30 "${SUITE_TIMEOUT:-300}" $PY -m pytest -q -rfE $XD $IGN -p no:cacheprovider -o addopts="" \
      tests 2>&1 | tee "$OUT/suite.log" | grep -E "passed|failed|error|FAILED|ERROR" | tail -40 ;;
*) echo "unknown step $step"; exit 2 ;;
esac
done
stamp "done: logs in $OUT"
