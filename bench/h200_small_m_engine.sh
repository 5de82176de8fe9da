#!/usr/bin/env bash
# The small-M NF4 kernel wired into the batched step, on the GPU: the kernel's GPU tests, bench.batched (1/8/32 chats,
# Llama-2-7B shape, NF4, 512 + 128, beside transformers' batched generate), then the batched path's GPU tests.
# Run from the repo root with .whl carried (bench/h200_env.sh installs it); results under $OUT.
set -uo pipefail
source bench/h200_env.sh || exit 1
timeout "${MM_TESTS_S:-70}" python3 -m pytest -q -m gpu -x -rfE -p no:cacheprovider tests/test_nf4_mm.py > "$OUT/gpu-tests.txt" 2>&1
echo "nf4_mm tests rc=$?"; tail -3 "$OUT/gpu-tests.txt" | cut -c1-300
timeout "${BENCH_S:-290}" python3 -m bench.batched --out "$OUT/batched.json" > "$OUT/bench.log" 2>&1
echo "bench rc=$?"
grep -iE "warn|not captured|error|Traceback" "$OUT/bench.log" | cut -c1-300 | head -12
python3 -c "import json, sys; d = json.load(open(sys.argv[1])); keys = ('recipe', 'concurrent_chats', 'aggregate_decode_tokens_per_s', 'rows_plan', 'rows_timings_us', 'compiled'); [print({k: r[k] for k in keys if k in r}) for r in d['records']]" "$OUT/batched.json"
timeout "${BATCH_TESTS_S:-100}" python3 -m pytest -q -m gpu -x -rfE -p no:cacheprovider tests/test_batched_fast.py -k "rows_equal" >> "$OUT/gpu-tests.txt" 2>&1
echo "batched tests rc=$?"; tail -3 "$OUT/gpu-tests.txt" | cut -c1-300
