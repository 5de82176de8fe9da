#!/usr/bin/env bash
# One device call (<= 9.5 min): issue 24's table through the engine the demo runs. bench.batched with 1, 8 and 32
# concurrent chats beside transformers' batched generate (Llama-2-7B shape, random weights, NF4, 512-token prompts +
# 128 new tokens), then bench.decode: the seed recipe (plain generate) beside ours on a 512-token prompt (TTFT and
# decode tok/s). Run from the repo root with .whl carried; JSON and logs under $OUT. BATCHED_ARGS adds to
# bench.batched (e.g. "--set GEMV_INPUT=planar"); BATCHED_S=0 or DECODE_S=0 skips a part.
set -uo pipefail
source bench/h200_env.sh || exit 1
if [ "${BATCHED_S:-330}" != 0 ]; then
  timeout -s INT -k 15 "${BATCHED_S:-330}" python3 -m bench.batched --chats "${CHATS:-1,8,32}" --new-tokens 128 \
    ${BATCHED_ARGS:-} --out "$OUT/batched-table.json" > "$OUT/batched-table.log" 2>&1
  echo "batched rc=$?"; grep -iE "Traceback|Error" "$OUT/batched-table.log" | cut -c1-300 | head -6
  grep -E '"(recipe|phase)"' "$OUT/batched-table.log" | cut -c1-300 | tail -8
fi
if [ "${DECODE_S:-200}" != 0 ]; then
  timeout -s INT -k 15 "${DECODE_S:-200}" python3 -m bench.decode --random llama-2-7b --quantization nf4 \
    --prompts 512 --new-tokens 128 --variants best --budget-s $(( ${DECODE_S:-200} - 50 )) --work-dir /tmp/bench \
    --out "$OUT/decode.json" > "$OUT/decode.log" 2>&1
  echo "decode rc=$?"; tail -12 "$OUT/decode.log" | cut -c1-300
fi
