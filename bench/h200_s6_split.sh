#!/usr/bin/env bash
# Device calls (<= 9.5 min each) for PREFIX_ATTENTION=split (a later prefill chunk: its queries over the cached prefix
# unmasked, by cuDNN's attention where it runs, and over their own keys causally; merged by log-sum-exp). Run from the
# repo root with .whl carried. PART=a (~5 min): the GPU tests of the split form and of the flash prefix form, then
# bench.prefix_attention --split (per layer: the engine's gather path against split with flash / cuDNN, first calls
# of new shapes, diffs from fp32). PART=b (~6 min): a 9-turn chat through ChatEngine with the default (gather), then
# with split. PART=c: the same pair in the other order. Llama-2-7B shape, emulated 16 GiB card (int8 KV there),
# 2k-word messages; records under $OUT. PART=t (~7 min): the tests of PART a, then PART b (2026-12-06 seventh session:
# the split form with its buckets, layer.PREFIX_SPLIT_BUCKET).
set -uo pipefail
source bench/h200_env.sh || exit 1
turns() {  # $1 = PREFIX_ATTENTION, $2 = the record's name
  timeout -s INT -k 15 "${TURNS_S:-170}" python3 -m bench.multiturn --random llama-2-7b --max-positions 32768 \
    --card-gib 16 --message-tokens 2000 --turns 9 --new-tokens 64 --only-first --set PREFIX_ATTENTION=$1 \
    --out "$OUT/multiturn-$2.json" > "$OUT/multiturn-$2.log" 2>&1
  echo "multiturn $2 rc=$?"; grep -E '"kind": "(startup|turn)"' "$OUT/multiturn-$2.log" | cut -c1-200
  grep -iE "Traceback|Error" "$OUT/multiturn-$2.log" | head -4 | cut -c1-300
}
if [ "${PART:-a}" = t ]; then  # the split form's GPU tests, then gather and split through ChatEngine
  timeout -s INT -k 15 "${TESTS_S:-90}" python3 -m pytest -q -m gpu -rA -p no:cacheprovider \
    tests/test_prefix_cache.py -k "split or flash" > "$OUT/gpu-tests-split.txt" 2>&1
  echo "tests rc=$?"; grep -E "^(PASSED|FAILED|ERROR)|^E |passed|failed" "$OUT/gpu-tests-split.txt" | head -14 | cut -c1-300
  turns gather gather-1
  turns split split-1
elif [ "${PART}" = a ]; then
  timeout -s INT -k 15 "${TESTS_S:-90}" python3 -m pytest -q -m gpu -rA -p no:cacheprovider \
    tests/test_prefix_cache.py -k "split or flash" > "$OUT/gpu-tests-split.txt" 2>&1
  echo "tests rc=$?"; grep -E "^(PASSED|FAILED|ERROR)|^E |passed|failed" "$OUT/gpu-tests-split.txt" | head -14 | cut -c1-300
  timeout -s INT -k 15 "${KERNEL_S:-120}" python3 -m bench.prefix_attention --split --out "$OUT/prefix-split.json" \
    > "$OUT/prefix-split.log" 2>&1
  echo "split bench rc=$?"; grep -E '^\{' "$OUT/prefix-split.log" | cut -c1-600
  # PyTorch's opt-in (PR 155958): cuDNN attention through its ragged path for BSHD layouts, one plan for every length
  TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1 timeout -s INT -k 15 "${KERNEL_S:-120}" python3 -m bench.prefix_attention \
    --split --out "$OUT/prefix-split-avoid-recompile.json" > "$OUT/prefix-split-avoid-recompile.log" 2>&1
  echo "split bench, AVOID_RECOMPILE rc=$?"
  grep -E '^\{' "$OUT/prefix-split-avoid-recompile.log" | grep -oE '"(model|rows|new_tokens|cached_tokens|split_cudnn[a-z_]*)": [^,]*' \
    | paste -sd' ' | sed 's/"model"/\n&/g' | cut -c1-400
elif [ "${PART}" = b ]; then
  turns gather gather-1
  turns split split-1
else
  turns split split-2
  turns gather gather-2
fi
