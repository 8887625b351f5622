#!/usr/bin/env bash
# SGLang's own benchmark clients, unchanged, against `hicache bench serve` (docs/sglang-compat.md).
#
# Usage (repo root):  bash benchmarks/sglang_clients.sh [SGLANG_PYTHON]
#   SGLANG_PYTHON: a Python with sglang==0.5.23 and `datasets` installed (default
#                  /tmp/peer-sglang-venv/bin/python). No network is used: HF_HUB_OFFLINE=1,
#                  a generated ShareGPT-format file as --dataset-path, and the tokenizer the
#                  server exports (GET /model_info -> tokenizer_path), so no --tokenizer.
# Env: HICACHE_PY (the Python with hicache's dependencies; default .venv/bin/python), PORT (30123), OUT (./sglang-clients-out), SERVE_ARGS (extra `bench serve` options),
#      N (prompts per bench_serving run, 16), BENCH_MULTITURN (path to SGLang's
#      benchmark/hicache/bench_multiturn.py from a source checkout; run with both API formats
#      when given; without it, the same client functions from the wheel's cache-hit kit run a
#      multi-turn conversation in both formats).
set -uo pipefail
cd "$(dirname "$0")/.."
SPY=${1:-/tmp/peer-sglang-venv/bin/python}
PORT=${PORT:-30123}
OUT=${OUT:-sglang-clients-out}
N=${N:-16}
PY=${HICACHE_PY:-python3}
[ -z "${HICACHE_PY:-}" ] && [ -x .venv/bin/python ] && PY=.venv/bin/python
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
BASE=http://127.0.0.1:$PORT
if ! "$SPY" -c "import sglang, datasets" 2>/dev/null; then
  echo "error: $SPY lacks sglang/datasets (build it with the peer venv recipe)" >&2; exit 1
fi

# shellcheck disable=SC2086
$PY -m hicache_cli.app bench serve --port "$PORT" ${SERVE_ARGS:-} >"$OUT/serve.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null' EXIT
for _ in $(seq 120); do curl -sf "$BASE/health" >/dev/null && break; sleep 0.5; done
curl -sf "$BASE/health" >/dev/null || { echo "error: server did not start"; cat "$OUT/serve.log"; exit 1; }
TOK=$(curl -s "$BASE/model_info" | "$SPY" -c "import json,sys; print(json.load(sys.stdin)['tokenizer_path'])")
echo "server $BASE, tokenizer_path $TOK"

# A ShareGPT-format file of synthetic English-like turns (the `random` dataset samples from it).
DATA="$OUT/sharegpt_sample.json"
"$SPY" - "$DATA" <<'PY'
import json, random, sys
random.seed(0)
words = ("cache page tier host device storage prefix radix tree node token request batch layer "
         "kernel memory bandwidth latency throughput eviction policy write load store hit miss "
         "copy stream queue server client model prompt answer question").split()
def sentence(n): return " ".join(random.choice(words) for _ in range(n)).capitalize() + "."
rows = [{"id": str(i), "conversations": [
    {"from": "human", "value": " ".join(sentence(random.randint(8, 20))
                                        for _ in range(random.randint(3, 12)))},
    {"from": "gpt", "value": " ".join(sentence(12) for _ in range(4))}]} for i in range(400)]
json.dump(rows, open(sys.argv[1], "w"))
PY

summary() {  # the figures worth quoting from a bench_serving log
  grep -E "Successful requests|Total input tokens|Total generated tokens:|Mean TTFT|Median TTFT|Output token throughput|Total cached tokens|Cache hit rate|Device:|Host:" "$1" | sed 's/^/    /'
}

bs() {  # bench_serving NAME ARGS...
  local name=$1; shift
  echo "== bench_serving $name"
  curl -sf -X POST "$BASE/flush_cache" >/dev/null   # each run starts from an empty cache
  "$SPY" -m sglang.bench_serving --host 127.0.0.1 --port "$PORT" --disable-tqdm \
    --output-file "$OUT/$name.jsonl" "$@" >"$OUT/$name.log" 2>&1
  echo "   exit $?"; summary "$OUT/$name.log"
}

# Every backend bench_serving has for an SGLang-style server, both datasets, and each run once
# more with bench_serving's own --flush-cache (sglang*: POST /flush_cache; vllm*: POST
# /reset_prefix_cache; both empty L1 + L2 here, as SGLang's flush does: docs/sglang-compat.md).
BACKENDS=${BACKENDS:-sglang sglang-oai sglang-oai-chat vllm vllm-chat}
for b in $BACKENDS; do
  report=(); case $b in sglang*) report=(--cache-report);; esac
  for flush in "" --flush-cache; do
    bs "random-$b${flush:+-flush}" --backend "$b" --dataset-name random --dataset-path "$DATA" \
      --num-prompts "$N" --random-input-len 256 --random-output-len 16 --max-concurrency 4 \
      "${report[@]}" $flush
    bs "gsp-$b${flush:+-flush}" --backend "$b" --dataset-name generated-shared-prefix \
      --gsp-num-groups 2 --gsp-prompts-per-group 4 --gsp-system-prompt-len 256 \
      --gsp-question-len 32 --gsp-output-len 8 --max-concurrency 4 "${report[@]}" $flush
  done
done
bs gsp-sglang --backend sglang --dataset-name generated-shared-prefix --gsp-num-groups 4 \
  --gsp-prompts-per-group 4 --gsp-system-prompt-len 512 --gsp-question-len 64 \
  --gsp-output-len 16 --max-concurrency 4 --cache-report
bs gsp-chat-3turns --backend sglang-oai-chat --dataset-name generated-shared-prefix \
  --gsp-num-groups 4 --gsp-prompts-per-group 4 --gsp-system-prompt-len 512 \
  --gsp-question-len 64 --gsp-output-len 16 --gsp-num-turns 3 --max-concurrency 4 --cache-report

echo "== cache-hit kit: run_multiturn_cache_hit_test (its assertions: cached >= expected)"
"$SPY" - "$BASE" "$TOK" "$DATA" >"$OUT/cache-hit-kit.log" 2>&1 <<'PY'
import sys
from sglang.test.kits.cache_hit_kit import run_multiturn_cache_hit_test
base, tok, data = sys.argv[1:4]
r = run_multiturn_cache_hit_test(base, tok, num_clients=4, num_rounds=3, request_length=128,
                                 output_length=16, dataset_path=data)
print("RESULT", r["overall"])
PY
echo "   exit $?"; grep -E "Round [0-9]:|RESULT|Error|assert" "$OUT/cache-hit-kit.log" | sed 's/^/    /'

if [ -n "${BENCH_MULTITURN:-}" ]; then
  for fmt in sglang openai; do
    echo "== bench_multiturn --api-format $fmt"
    "$SPY" "$BENCH_MULTITURN" --host 127.0.0.1 --port "$PORT" --model-path "$TOK" \
      --dataset-path "$DATA" --api-format "$fmt" --num-clients 4 --num-rounds 3 \
      --request-length 128 --first-round-input-length 256 --output-length 16 \
      --max-parallel 4 --request-rate 4 --log-file "$OUT/multiturn-$fmt.jsonl" \
      >"$OUT/multiturn-$fmt.log" 2>&1
    echo "   exit $?"; tail -12 "$OUT/multiturn-$fmt.log" | sed 's/^/    /'
  done
else
  echo "== multi-turn in both API formats through the wheel's client functions"
  "$SPY" - "$BASE" "$TOK" >"$OUT/multiturn-kit.log" 2>&1 <<'PY'
import asyncio, sys
from sglang.benchmark.utils import get_tokenizer
from sglang.test.kits.cache_hit_kit import (async_request_openai_chat_completions,
                                            async_request_sglang_generate, gen_payload,
                                            gen_payload_openai)
base, tok_path = sys.argv[1:3]
tok = get_tokenizer(tok_path)
questions = [f"Question {i}: how does a hierarchical cache keep its prefix pages? " * 4
             for i in range(4)]
for fmt in ("sglang", "openai"):
    hist_ids, msgs, rows = [], [], []
    for q in questions:
        if fmt == "sglang":
            hist_ids += tok.encode(q, add_special_tokens=not hist_ids)
            out = asyncio.run(async_request_sglang_generate(gen_payload(hist_ids, 16),
                                                            base + "/generate"))
            hist_ids += out.output_ids
        else:
            msgs.append({"role": "user", "content": q})
            out = asyncio.run(async_request_openai_chat_completions(
                gen_payload_openai(msgs, 16, "tiny"), base + "/v1/chat/completions"))
            msgs.append({"role": "assistant", "content": out.generated_text})
        assert out.success, out.error
        rows.append((out.prompt_len, out.cached_tokens))
    hit = sum(c for _, c in rows) / sum(p for p, _ in rows)
    print(f"RESULT {fmt}: turns (prompt, cached) {rows}  hit rate {hit:.3f}")
PY
  echo "   exit $?"; grep -E "RESULT|Error|assert" "$OUT/multiturn-kit.log" | sed 's/^/    /'
fi
echo "logs in $OUT"
