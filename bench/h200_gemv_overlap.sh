#!/usr/bin/env bash
# One device call (<= 9.5 min): does the NF4 GEMV gain from loading its first weight tile before the PDL wait
# (nf4_gemv(..., pdl=True, early=True); LAUNCH_OVERLAP, llm_core.fast.kernels.pdl)? Run from the repo root with .whl
# carried (bitsandbytes, transformers). Records under $OUT:
#   gpu-tests-gemv.txt   tests/test_nf4_gemv.py and tests/test_pdl.py -m gpu (every variant against dequantize + matmul)
#   gemv.json            bench.gemv_bench: per shape and per layer, ours_nested (one launch after the other),
#                        ours_nested_pdl, ours_nested_pdl_early, bitsandbytes, each in one CUDA graph over weights >> L2
set -uo pipefail
source bench/h200_env.sh || exit 1
timeout -s INT -k 15 "${TESTS_S:-150}" python3 -m pytest -q -m gpu -rA --tb=short -p no:cacheprovider \
  tests/test_nf4_gemv.py tests/test_pdl.py > "$OUT/gpu-tests-gemv.txt" 2>&1
echo "tests rc=$?"; grep -E "^(FAILED|ERROR)|^E |passed|failed" "$OUT/gpu-tests-gemv.txt" | head -12 | cut -c1-300
timeout -s INT -k 15 "${BENCH_S:-300}" python3 -m bench.gemv_bench --budget-s "${BUDGET_S:-240}" \
  --out "$OUT/gemv.json" > "$OUT/gemv.log" 2>&1
echo "gemv bench rc=$?"; tail -24 "$OUT/gemv.log" | cut -c1-200
