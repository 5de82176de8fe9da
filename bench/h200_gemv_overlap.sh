#!/usr/bin/env bash
# One device call (<= 9.5 min): what LAUNCH_OVERLAP (llm_core.fast.kernels.pdl) does per linear, and does loading a
# program's first weight tile before the PDL wait (early=True) add to it? Run from the repo root with .whl carried
# (bitsandbytes, transformers). Records under $OUT:
#   gpu-tests-gemv.txt   tests/test_nf4_gemv.py and tests/test_pdl.py -m gpu (every variant against dequantize +
#                        matmul; the PDL forms' bits equal the plain ones', the probe passes)
#   gemv.json            bench.gemv_bench (M = 1): per shape and per layer, ours_nested (one launch after the other),
#                        ours_nested_pdl, ours_nested_pdl_early, bitsandbytes, each in one CUDA graph over weights >> L2
#   small-m.json         bench.small_m --overlap (M = 2..32, nf4_mm's launch rule): plain, pdl, pdl + early
set -uo pipefail
source bench/h200_env.sh || exit 1
timeout -s INT -k 15 "${TESTS_S:-120}" python3 -m pytest -q -m gpu -rA --tb=short -p no:cacheprovider \
  tests/test_nf4_gemv.py tests/test_pdl.py > "$OUT/gpu-tests-gemv.txt" 2>&1
echo "tests rc=$?"; grep -E "^(FAILED|ERROR)|^E |passed|failed" "$OUT/gpu-tests-gemv.txt" | head -12 | cut -c1-300
timeout -s INT -k 15 "${BENCH_S:-220}" python3 -m bench.gemv_bench --budget-s "${BUDGET_S:-180}" \
  --out "$OUT/gemv.json" > "$OUT/gemv.log" 2>&1
echo "gemv bench rc=$?"; tail -24 "$OUT/gemv.log" | cut -c1-200
timeout -s INT -k 15 "${SMALLM_S:-170}" python3 -m bench.small_m --overlap --ms "${MS:-2,8,16,32}" \
  --budget-s "${SMALLM_BUDGET_S:-120}" --out "$OUT/small-m.json" > "$OUT/small-m.log" 2>&1
echo "small_m rc=$?"; grep -E "M=" "$OUT/small-m.log" | cut -c1-220 | tail -16
