# Sourced by bench/h200_*.sh after bench/h200_env.sh: run_cards runs bench.cards with $CARDS within ${CARDS_S:-300}
# seconds (JSON and log under $OUT) and prints each start-up, turn and fill record and the summary.
run_cards() {
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
                                     "predicted_peak_vram_bytes", "dropped_turns") if r.get(k) is not None})
        if r.get("what") == "startup":
            print("   ", str(r.get("reason"))[:300], r.get("fast_memory_profile"), r.get("startup_notes"))
print(json.dumps((d.get("summary") or {}).get("cards"), default=str)[:1500])
P
}
