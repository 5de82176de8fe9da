#!/usr/bin/env bash
# One device call (<= 9.5 min): the one-token NF4 kernel's forms on a GPU (the name is historical: its level table
# in registers, TABLE_REGS, was timed here, gave no gain and is removed; commit f9de589 still has it). Run from the
# repo root with .whl carried. Records under $OUT:
#   gpu-tests-gemv.txt   tests/test_nf4_gemv.py -m gpu (every form incl. planar against dequantize + matmul; the
#                        decode step with GEMV_INPUT=planar against plain)
#   gemv.json / .log     bench.gemv_bench --sweep on Llama-2-7B (SWEEP_TILES x SWEEP_MODES) and the autotuned kernels
#   batched-{all,plain}.json / .log   bench.batched through ChatEngine (Llama-2-7B shape, NF4, 512-token
#                        prompts, 128 new tokens, chats $CHATS): the library's defaults (GEMV_INPUT=planar), then
#                        GEMV_INPUT=plain (RUNS picks the runs, of all, plain and planar; RUNS="" runs none; a run
#                        named twice writes -2, -3, ...)
# TESTS_S=0 / BENCH_S=0 skip the tests / the kernel sweep.
set -uo pipefail
source bench/h200_env.sh || exit 1
[ "${TESTS_S:-150}" = 0 ] || timeout -s INT -k 15 "${TESTS_S:-150}" python3 -m pytest -q -m gpu -rA --tb=short -p no:cacheprovider \
  tests/test_nf4_gemv.py > "$OUT/gpu-tests-gemv.txt" 2>&1
echo "tests rc=$?"; [ "${TESTS_S:-150}" = 0 ] || grep -E "^(FAILED|ERROR)|^E |passed|failed" "$OUT/gpu-tests-gemv.txt" | head -12 | cut -c1-300
[ "${BENCH_S:-170}" = 0 ] || timeout -s INT -k 15 "${BENCH_S:-170}" python3 -m bench.gemv_bench --sweep --budget-s "${BUDGET_S:-140}" \
  --arch llama-2-7b llama-3-8b \
  --kernels bnb_gemm_4bit_nested,ours_nested,ours_nested_pdl,ours_nested_planar,ours_nested_planar_pdl \
  --out "$OUT/gemv.json" > "$OUT/gemv.log" 2>&1
echo "gemv bench rc=$?"; [ "${BENCH_S:-170}" = 0 ] || tail -16 "$OUT/gemv.log" | cut -c1-160
declare -A seen=()
for run in ${RUNS-all plain}; do  # RUNS="" runs none
  case $run in
    all) extra="" ;;
    plain) extra="--set GEMV_INPUT=plain" ;;
    planar) extra="--set GEMV_INPUT=planar" ;;
    *) echo "unknown run $run"; continue ;;
  esac
  seen[$run]=$(( ${seen[$run]:-0} + 1 ))
  name=$run; [ "${seen[$run]}" = 1 ] || name=$run-${seen[$run]}
  timeout -s INT -k 15 "${BATCHED_S:-120}" python3 -m bench.batched --no-reference --chats "${CHATS:-1,8}" \
    --new-tokens 128 --ckpt /tmp/l2-ckpt $extra --out "$OUT/batched-$name.json" > "$OUT/batched-$name.log" 2>&1
  echo "batched $name rc=$?"; grep -E '"(recipe|phase)"' "$OUT/batched-$name.log" | cut -c1-300 | tail -3
done
