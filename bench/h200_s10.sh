#!/usr/bin/env bash
# Device calls of 2026-12-07's fourth session (issue 24): the one-token NF4 kernel over 2-4 rows and with K splits.
# Run from the repo root with .whl carried; records under $OUT:
#   gpu-tests.txt   PARTS=tests: the kernel's rows/splits GPU tests, then the batched step's and the paged pool's
#                   (the engine's loop, the rows pick with the new candidate)
#   gemv-<n>.json   PARTS=sweep: bench.small_m --gemv --archs $ARCHS --ms 1,2,4 (the kernel per linear: autotuned with
#                   and without splits, its several-rows launch, the tile x split grid, nf4_mm's rule beside it)
#   batched-<g>-<n>.json  PARTS=batched: bench.batched --chats $CHATS --gemv G for G in $GEMVS (one process each)
# CKPT the checkpoint (written when missing); N the file number.
set -uo pipefail
source bench/h200_env.sh || exit 1
CKPT=${CKPT:-/tmp/l2-ckpt}
PARTS=" ${PARTS:-tests sweep} "
N=${N:-1}
[[ $PARTS != *" tests "* ]] || { timeout -s INT -k 15 "${TESTS_S:-200}" python3 -m pytest -q -m gpu -rA \
  -p no:cacheprovider tests/test_nf4_gemv.py tests/test_batched_fast.py tests/test_paged_kv.py \
  -k "${TESTS_K:-rows_and_splits or batched_rows or paged_rows}" > "$OUT/gpu-tests.txt" 2>&1
echo "tests rc=$?"; grep -E "^(FAILED|ERROR)|^E |passed|failed" "$OUT/gpu-tests.txt" | head -14 | cut -c1-300; }
[[ $PARTS != *" sweep "* ]] || {
  timeout -s INT -k 15 "${SWEEP_S:-240}" python3 -m bench.small_m --gemv --archs "${ARCHS:-llama-2-7b}" \
    --ms "${MS:-1,2,4}" --budget-s "${BUDGET_S:-200}" --out "$OUT/gemv-$N.json" > "$OUT/gemv-$N.log" 2>&1
  echo "sweep rc=$?"; tail -c 2500 "$OUT/gemv-$N.log"; }
if [[ $PARTS == *" batched "* ]]; then
  for g in ${GEMVS:-all one-row}; do
    timeout -s INT -k 15 "${BATCHED_S:-200}" python3 -m bench.batched --no-reference --chats "${CHATS:-1,2,4}" \
      --new-tokens 128 --ckpt $CKPT --gemv $g --out "$OUT/batched-$g-$N.json" > "$OUT/batched-$g-$N.log" 2>&1
    echo "batched $g rc=$?"
    python3 - "$OUT/batched-$g-$N.json" <<'P'
import json, sys
d = json.load(open(sys.argv[1]))
for r in d["records"]:
    if r.get("phase") == "load":
        print("load", r.get("warmup_s"), r.get("rows_plan"), r.get("rows_timings_us"), (r.get("decode_path_reason") or "")[:400])
    else:
        print(r.get("concurrent_chats"), r.get("aggregate_decode_tokens_per_s"), r.get("per_chat_decode_tokens_per_s"),
              r.get("ttft_p95_s"), round((r.get("step_profile") or {}).get("mean_step_s", 0) * 1e3, 3))
P
    grep -iE "Traceback|Error" "$OUT/batched-$g-$N.log" | head -4 | cut -c1-300
    N=$((N + 1))
  done
fi
