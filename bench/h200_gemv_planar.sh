#!/usr/bin/env bash
# One device call (<= 9.5 min): the one-token NF4 kernel reading its activations in planes (GEMV_INPUT=planar,
# nf4_gemv XPLANAR: no shared-memory conversion of the activation tile, so no barriers in its loop). Run from the repo
# root with .whl carried. Records under $OUT:
#   gpu-tests-gemv.txt    tests/test_nf4_gemv.py -m gpu (every form incl. planar against dequantize + matmul; the
#                         decode step with GEMV_INPUT=planar against plain)
#   gemv.json / .log      bench.gemv_bench --sweep on Llama-2-7B (SWEEP_TILES x plain/prefetch x plain/planar) and
#                         the autotuned kernels, planar or not, with and without PDL, on both archs
#   batched-{plain,planar}.json / .log   bench.batched through ChatEngine (Llama-2-7B shape, NF4, 512-token prompts,
#                         128 new tokens, chats $CHATS) with GEMV_INPUT=plain, then planar
set -uo pipefail
source bench/h200_env.sh || exit 1
timeout -s INT -k 15 "${TESTS_S:-150}" python3 -m pytest -q -m gpu -rA --tb=short -p no:cacheprovider \
  tests/test_nf4_gemv.py > "$OUT/gpu-tests-gemv.txt" 2>&1
echo "tests rc=$?"; grep -E "^(FAILED|ERROR)|^E |passed|failed" "$OUT/gpu-tests-gemv.txt" | head -12 | cut -c1-300
timeout -s INT -k 15 "${BENCH_S:-170}" python3 -m bench.gemv_bench --sweep --budget-s "${BUDGET_S:-140}" \
  --arch llama-2-7b llama-3-8b \
  --kernels bnb_gemm_4bit_nested,ours_nested,ours_nested_pdl,ours_nested_planar,ours_nested_planar_pdl \
  --out "$OUT/gemv.json" > "$OUT/gemv.log" 2>&1
echo "gemv bench rc=$?"; tail -16 "$OUT/gemv.log" | cut -c1-160
for layout in ${LAYOUTS:-plain planar}; do
  timeout -s INT -k 15 "${BATCHED_S:-100}" python3 -m bench.batched --no-reference --chats "${CHATS:-1,8}" \
    --new-tokens 128 --set GEMV_INPUT=$layout --out "$OUT/batched-$layout.json" > "$OUT/batched-$layout.log" 2>&1
  echo "batched $layout rc=$?"; grep -E '"(recipe|phase)"' "$OUT/batched-$layout.log" | cut -c1-300 | tail -3
done
