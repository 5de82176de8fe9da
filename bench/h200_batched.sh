#!/usr/bin/env bash
# Issue 16 on the GPU: the batched fast path's GPU tests, then bench.batched (1/8/32 chats, Llama-2-7B shape, NF4,
# 512 + 128, beside transformers' batched generate). Run from the repo root; results under $OUT.
set -uo pipefail
source bench/h200_env.sh || exit 1
timeout "${TESTS_S:-170}" python3 -m pytest -q -m gpu -x -rA -p no:cacheprovider tests/test_batched_fast.py > "$OUT/gpu-tests.txt" 2>&1
echo "tests rc=$?"
tail -25 "$OUT/gpu-tests.txt" | cut -c1-300
timeout "${BENCH_S:-280}" python3 -m bench.batched --out "$OUT/batched.json" > "$OUT/bench.log" 2>&1
echo "bench rc=$?"
grep -iE "warn|not captured|error|Traceback" "$OUT/bench.log" | cut -c1-300 | head -20
python3 - "$OUT/batched.json" <<'P'
import json, sys
d = json.load(open(sys.argv[1]))
for r in d["records"]:
    r = {k: v for k, v in r.items() if k not in ("versions", "command", "decode_path_reason")}
    print(json.dumps(r)[:900])
print(d.get("summary"))
P
