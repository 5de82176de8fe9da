#!/usr/bin/env bash
# One device call (<= 9 min): the re-laid weights (llm_core.memory.compact) and the decode attention's launches.
# 1. GPU tests of the changed parts (TESTS_S, default 150 s; 0 skips);
# 2. bench.attention_rows --sweep (ATTN_S, default 170 s; 0 skips): every launch of the decode attention kernel;
# 3. bench.memory_breakdown on an emulated 8 GiB card, Llama-2-7B, defaults, with start-up's compaction and without
#    (MB_S each, default 110 s; 0 skips; MB_MODES="compact" runs one): held-free bytes, free blocks after
#    empty_cache and what pins them.
# Run from the repo root with .whl carried; JSON under $OUT.
set -uo pipefail
source bench/h200_env.sh || exit 1
if [ "${TESTS_S:-150}" != 0 ]; then
  timeout -s INT -k 15 "${TESTS_S:-150}" python3 -m pytest -q -m gpu -rA -p no:cacheprovider tests/test_compact.py \
    tests/test_attention_launch.py tests/test_nf4_mm.py -k "compact or launch or gpu_gemm_matches" \
    > "$OUT/gpu-tests.txt" 2>&1
  echo "tests rc=$?"; grep -E "^(FAILED|ERROR)|^E |passed|failed" "$OUT/gpu-tests.txt" | cut -c1-300 | head -20
fi
if [ "${ATTN_S:-170}" != 0 ]; then
  timeout -s INT -k 15 "${ATTN_S:-170}" python3 -m bench.attention_rows --sweep --budget-s $(( ${ATTN_S:-170} - 30 )) \
    --out "$OUT/attention-sweep.json" > "$OUT/attention-sweep.log" 2>&1
  echo "sweep rc=$?"; grep -v Warning "$OUT/attention-sweep.log" | tail -40 | cut -c1-250
fi
[ "${MB_S:-110}" = 0 ] && exit 0
for mode in ${MB_MODES:-compact no-compact}; do
  flag=""; [ $mode = no-compact ] && flag="--no-compact"
  timeout -s INT -k 15 "${MB_S:-110}" python3 -m bench.memory_breakdown --model llama-2-7b --positions 32768 \
    --card-gib 8 --kv-cache default --no-pickles $flag --out "$OUT/breakdown-$mode.json" > "$OUT/breakdown-$mode.log" 2>&1
  echo "breakdown $mode rc=$?"; grep -iE "Traceback|Error|re-laid" "$OUT/breakdown-$mode.log" | cut -c1-300 | head -8
  python3 - "$OUT/breakdown-$mode.json" <<'P'
import json, sys
try:
    d = json.load(open(sys.argv[1]))
except (OSError, ValueError) as e:
    print("no json", e); raise SystemExit
s = d.get("startup") or {}
print({k: s.get(k) for k in ("load_s", "context_limit", "fast_memory_profile", "startup_notes")})
e = d.get("after_startup_emptied") or {}
print("emptied reserved", e.get("reserved"), "allocated", e.get("allocated"), (e.get("free_blocks") or {}).get("by_size"))
for b in (e.get("free_blocks") or {}).get("largest", [])[:8]:
    print("   ", b)
P
done
