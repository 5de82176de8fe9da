#!/usr/bin/env bash
# One device call: the two small-cards GPU tests that failed on the H200 (-rA for their messages), then
# bench.batched (Llama-2-7B, 1/8/32 chats beside transformers' batched generate) through ChatEngine with the
# start-up pick serving nf4_mm where it won. Run from the repo root; results under $OUT.
set -uo pipefail
source bench/h200_env.sh || exit 1
timeout 150 python3 -m pytest -q -m gpu -rA -p no:cacheprovider "tests/test_fast_decode.py::test_prefill_graphs_match_the_compiled_prefill" "tests/test_fast_decode.py::test_re_sizing_the_cache_leaves_no_memory_behind" > "$OUT/cards-gpu-tests.txt" 2>&1; echo "tests rc=$?"
grep -E "^E |Error|assert|passed|failed" "$OUT/cards-gpu-tests.txt" | cut -c1-400 | head -40
timeout 240 python3 -m bench.batched --out "$OUT/batched-llama2.json" > "$OUT/batched-llama2.log" 2>&1; echo "llama2 rc=$?"
for f in "$OUT"/batched-*.json; do python3 - "$f" <<'P'
import json, sys
d = json.load(open(sys.argv[1]))
for r in d["records"]:
    print(json.dumps({k: v for k, v in r.items() if k not in ("versions", "command", "decode_path_reason")})[:700])
print(d.get("summary"))
P
done
