#!/usr/bin/env bash
# One device call (<= 9 min), each part optional (its _S=0 or unset arguments skip it), JSON under $OUT:
# CARDS (bench.cards arguments, within CARDS_S s, default 300): ours + the seed recipe on emulated cards;
# TURNS (bench.multiturn arguments, within TURNS_S s, default 240): a chat of long messages, TTFT per turn;
# BATCHED (bench.batched arguments, within BATCHED_S s, default 240): concurrent chats through ChatEngine.
# Run from the repo root with .whl carried.
set -uo pipefail
source bench/h200_env.sh || exit 1
source bench/h200_cards_part.sh
if [ -n "${CARDS:-}" ] && [ "${CARDS_S:-300}" != 0 ]; then
  run_cards
fi
if [ -n "${TURNS:-}" ] && [ "${TURNS_S:-240}" != 0 ]; then
  timeout -s INT -k 15 "${TURNS_S:-240}" python3 -m bench.multiturn $TURNS --out "$OUT/multiturn.json" \
    > "$OUT/multiturn.log" 2>&1
  echo "multiturn rc=$?"; grep -v Warning "$OUT/multiturn.log" | tail -25 | cut -c1-250
fi
if [ -n "${BATCHED:-}" ] && [ "${BATCHED_S:-240}" != 0 ]; then
  timeout -s INT -k 15 "${BATCHED_S:-240}" python3 -m bench.batched $BATCHED --out "$OUT/batched.json" \
    > "$OUT/batched.log" 2>&1
  echo "batched rc=$?"; grep -v Warning "$OUT/batched.log" | tail -25 | cut -c1-250
fi
