#!/usr/bin/env bash
# One device call (<= 6 min): where an emulated 8 GiB card's memory goes with the demo's default settings
# (bench.memory_breakdown, random Llama-2-7B NF4, 32k positions): the allocator's segments and owners after start-up,
# right after each worst-reply profile of the start-up sizing (the peak the budget is held to), and after one long
# turn. Run from the repo root with .whl carried; JSON under $OUT. MB_ARGS adds arguments (e.g. "--kv-cache bf16").
# TESTS (pytest arguments) runs those GPU tests first, within TESTS_S seconds (default 120); CARDS (bench.cards
# arguments, e.g. "--only llama-2-7b-32768-8gib --words-per-turn 1500") then runs bench.cards within CARDS_S (240).
# ATTN (bench.attention_rows arguments, e.g. "--tokens 9000") times the decode attention kernel first. MB_S=0 skips
# the breakdown.
set -uo pipefail
source bench/h200_env.sh || exit 1
if [ -n "${TESTS:-}" ]; then
  timeout -s INT -k 15 "${TESTS_S:-120}" python3 -m pytest -q -m gpu -rA -p no:cacheprovider $TESTS > "$OUT/gpu-tests.txt" 2>&1
  echo "tests rc=$?"; grep -E "^(FAILED|ERROR)|^E |passed|failed" "$OUT/gpu-tests.txt" | cut -c1-300 | head -20
fi
if [ -n "${ATTN:-}" ]; then  # bench.attention_rows: the decode attention kernel over each row format
  timeout 120 python3 -m bench.attention_rows --out "$OUT/attention-rows.json" $ATTN 2>&1 | grep -v Warning | cut -c1-300
fi
source bench/h200_cards_part.sh
if [ -n "${CARDS:-}" ]; then
  CARDS_S=${CARDS_S:-240} run_cards
fi
[ "${MB_S:-330}" = 0 ] && exit 0
timeout -s INT -k 15 "${MB_S:-330}" python3 -m bench.memory_breakdown --model llama-2-7b --positions 32768 --card-gib 8 \
  --kv-cache default --no-pickles ${MB_ARGS:-} --out "$OUT/breakdown-llama-2-7b-8gib.json" > "$OUT/breakdown.log" 2>&1
echo "breakdown rc=$?"
grep -iE "Traceback|Error|sizing|re-sized|KV cache" "$OUT/breakdown.log" | cut -c1-300 | head -20
python3 - "$OUT/breakdown-llama-2-7b-8gib.json" <<'P'
import json, sys
try:
    d = json.load(open(sys.argv[1]))
except (OSError, ValueError) as e:
    print("no json", e); raise SystemExit
print(json.dumps(d.get("startup"), default=str)[:1500])
print(json.dumps(d.get("turn"), default=str)[:600])
for name, v in d.items():
    if isinstance(v, dict) and "by_segment_kind" in v:
        print(name, "reserved", v["reserved"], "allocated", v["allocated"], "max_reserved", v["max_reserved"],
              "max_allocated", v["max_allocated"])
        for kind, k in v["by_segment_kind"].items():
            print("   ", kind, {x: k.get(x) for x in ("segments", "reserved", "allocated", "free", "largest_free_block")})
        print("    owners", list(v["allocated_by_owner"].items())[:8])
P
