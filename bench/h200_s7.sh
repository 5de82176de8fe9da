#!/usr/bin/env bash
# One device call (<= 9.5 min; 2026-12-06 seventh session, when starts were scarce): the two changes of that session
# measured through ChatEngine, each against the library's default in the same lease. Run from the repo root with
# .whl carried; records under $OUT:
#   gpu-tests.txt            the GPU tests of the split-K GEMV (tests/test_nf4_gemv.py -k split) and of the split
#                            prefix attention (tests/test_prefix_cache.py -k "split or flash")
#   multiturn-{A}-{n}.json   bench.multiturn: Llama-2-7B shape (32k positions), emulated 16 GiB card, 2,000-token
#                            messages, 9 turns, PREFIX_ATTENTION=A (gather: the default; split: cuDNN in buckets)
#   batched-{R}-{n}.json     bench.batched --chats $CHATS on the same checkpoint: R = all (the library's autotuner)
#                            | split (with the split-K configs too)
# ORDER=ab (default) runs gather, split, all, split; ORDER=ba the reverse pairs (split, gather, split, all).
# PARTS (default "tests turns batched") picks the stages; CKPT the batched runs' checkpoint when the turns do not run
# (written when missing).
set -uo pipefail
source bench/h200_env.sh || exit 1
CKPT=${CKPT:-/tmp/multiturn-ckpt/llama-2-7b-32768}
PARTS=" ${PARTS:-tests turns batched} "
n=${PAIR:-1}
[[ $PARTS != *" tests "* ]] || { timeout -s INT -k 15 "${TESTS_S:-80}" python3 -m pytest -q -m gpu -rA \
  -p no:cacheprovider tests/test_nf4_gemv.py tests/test_prefix_cache.py -k "split or flash" > "$OUT/gpu-tests.txt" 2>&1
echo "tests rc=$?"; grep -E "^(FAILED|ERROR)|^E |passed|failed|autotuned pick" "$OUT/gpu-tests.txt" | head -14 | cut -c1-300; }
turns() {  # $1 = PREFIX_ATTENTION
  [[ $PARTS == *" turns "* ]] || return 0
  timeout -s INT -k 15 "${TURNS_S:-150}" python3 -m bench.multiturn --random llama-2-7b --max-positions 32768 \
    --card-gib 16 --message-tokens 2000 --turns 9 --new-tokens 64 --only-first --set PREFIX_ATTENTION=$1 \
    --out "$OUT/multiturn-$1-$n.json" > "$OUT/multiturn-$1-$n.log" 2>&1
  echo "multiturn $1 rc=$?"; grep -E '"kind": "(startup|turn)"' "$OUT/multiturn-$1-$n.log" | cut -c1-200
  grep -iE "Traceback|Error" "$OUT/multiturn-$1-$n.log" | head -4 | cut -c1-300
}
batched() {  # $1 = all | split
  [[ $PARTS == *" batched "* ]] || return 0
  timeout -s INT -k 15 "${BATCHED_S:-100}" python3 -m bench.batched --no-reference --chats "${CHATS:-1}" \
    --new-tokens 128 --ckpt $CKPT --gemv-configs $1 --out "$OUT/batched-$1-$n.json" > "$OUT/batched-$1-$n.log" 2>&1
  echo "batched $1 rc=$?"; grep -E '"(recipe|phase)"' "$OUT/batched-$1-$n.log" | cut -c1-300 | tail -3
}
if [ "${ORDER:-ab}" = ab ]; then
  turns gather; turns split; batched all; batched split
else
  turns split; turns gather; batched split; batched all
fi
