#!/usr/bin/env bash
# One device call (<= 9.5 min): the one-engine issue's chat measurements through ChatEngine with the default settings
# (since 2026-12-05 these batch on the paged pool: MAX_BATCH_SIZE auto = 8 on CUDA, KV_LAYOUT=paged): bench.multiturn, a 9-turn chat
# of 2k-token messages on a random Llama-2-7B (NF4, 32k positions) on emulated 16 and 8 GiB cards, PREFIX_CACHE on
# and off in the same run. Run from the repo root with .whl carried; JSON under $OUT.
# MT_SET adds settings (e.g. MT_SET="--set KV_LAYOUT=slots", or "--only-first" for a shorter call); MT_CARDS the cards.
set -uo pipefail
source bench/h200_env.sh || exit 1
SET=${MT_SET:-}
for entry in ${MT_CARDS:-"16:280 8:240"}; do
  card=${entry%%:*} limit=${entry##*:}
  timeout -s INT -k 15 "$limit" python3 -m bench.multiturn --random llama-2-7b --card-gib "$card" --message-tokens 2000 \
    --turns 9 --new-tokens 64 --ckpt-dir /tmp/mt-ckpt $SET --out "$OUT/multiturn-${card}gib.json" \
    > "$OUT/multiturn-${card}gib.log" 2>&1
  echo "card $card rc=$?"
  grep -iE "Traceback|Error" "$OUT/multiturn-${card}gib.log" | cut -c1-300 | head -8
  python3 - "$OUT/multiturn-${card}gib.json" <<'P'
import json, sys
try:
    d = json.load(open(sys.argv[1]))
except (OSError, ValueError) as e:
    print("no json", e); raise SystemExit
for r in d["records"]:
    if r.get("kind") == "startup":
        print({k: r.get(k) for k in ("mode", "load_s", "decode_path", "context_limit")}, str(r.get("reason"))[:200])
    if r.get("kind") == "turn":
        print({k: r.get(k) for k in ("mode", "turn", "prompt_tokens", "cached_prompt_tokens", "ttft_s",
                                     "decode_tokens_per_s", "dropped_turns")})
s = d.get("summary") or {}
for k in ("ttft_s_on", "ttft_s_off", "prompt_tokens", "cached_prompt_tokens_on", "decode_tokens_per_s_on",
          "decode_tokens_per_s_off", "last_over_turns_2_3_on", "last_over_turns_2_3_off", "tokens_identical_per_turn"):
    print(k, s.get(k))
P
done
