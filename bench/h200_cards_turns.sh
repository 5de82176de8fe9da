#!/usr/bin/env bash
# One device call (<= 9 min), each part optional (its _S=0 or unset arguments skip it), JSON under $OUT:
# CARDS (bench.cards arguments, within CARDS_S s, default 300): ours + the seed recipe on emulated cards;
# TURNS (bench.multiturn arguments, within TURNS_S s, default 240): a chat of long messages, TTFT per turn;
# BATCHED (bench.batched arguments, within BATCHED_S s, default 240): concurrent chats through ChatEngine.
# Run from the repo root with .whl carried.
set -uo pipefail
source bench/h200_env.sh || exit 1
if [ -n "${CARDS:-}" ] && [ "${CARDS_S:-300}" != 0 ]; then
  timeout -s INT -k 15 "${CARDS_S:-300}" python3 -m bench.cards $CARDS --budget-s $(( ${CARDS_S:-300} - 60 )) \
    --out "$OUT/cards.json" > "$OUT/cards.log" 2>&1
  echo "cards rc=$?"; grep -iE "Traceback|Error" "$OUT/cards.log" | cut -c1-300 | head -8
  python3 - "$OUT/cards.json" <<'P'
import json, sys
try:
    d = json.load(open(sys.argv[1]))
except (OSError, ValueError) as e:
    print("no json", e); raise SystemExit
for r in d["records"]:
    if r.get("what") in ("startup", "turn", "fill"):
        print({k: r.get(k) for k in ("recipe", "case", "what", "turn", "outcome", "load_s", "prompt_tokens",
                                     "context_fit_tokens", "decode_tokens_per_s", "peak_vram_bytes",
                                     "predicted_peak_vram_bytes") if r.get(k) is not None})
        if r.get("what") == "startup":
            print("   ", r.get("fast_memory_profile"), r.get("startup_notes"))
print(json.dumps((d.get("summary") or {}).get("cards"), default=str)[:1500])
P
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
