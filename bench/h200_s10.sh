#!/usr/bin/env bash
# Device calls of 2026-12-07's fifth session (issue 24): the web app under 8-32 concurrent chats, and the int8 KV
# cache at 32 chats. Run from the repo root with the slim wheels in .whl (`bash bench/gpu_wheels.sh` builds .whl-gpu:
# bitsandbytes, our transformers pin, Gradio's server and the packages it needs that the device lacks, llguidance;
# carry [".whl-gpu"] and start with `mkdir -p .whl && cp .whl-gpu/*.whl .whl/;`). Records under $OUT:
#   app-load-<N>.json   PARTS=app: bench.app_load --chats $APP_CHATS (default 8,32) --intervals $INTERVALS (default
#                       0,0.05; INTERVAL/CAP adds a UI_MAX_UPDATES_PER_S), $PAIRS pairs, each under the bench.host_probe
#                       variants $HOST (default: default): the app's own server and engine in one process,
#                       gradio_client sessions in $PROCS client processes; $TURNS turns a chat (default 1; each later
#                       message $TURN_TOKENS tokens, default 64, sent with the history the page gave back)
#   attn-<N>.json       PARTS=attn: bench.attention_rows --sweep at $ATTN_ROWS rows (default 8,16,32; every launch probed
#                       at the last of them) over $ATTN_TOKENS tokens (default 576,1024,2048,4096), budget $ATTN_S s
#   kv-<mode>-<N>.json  PARTS=kv: bench.batched --chats $KV_CHATS (default 32) with KV_CACHE=<mode> for each of $KV
# CKPT the checkpoint (written when missing); N the file number.
set -uo pipefail
source bench/h200_env.sh || exit 1
CKPT=${CKPT:-/tmp/l2-ckpt}
PARTS=" ${PARTS:-app kv} "
N=${N:-1}
if [[ $PARTS == *" attn "* ]]; then
  ROWS=${ATTN_ROWS:-8,16,32}
  timeout -s INT -k 15 $(( ${ATTN_S:-170} + 60 )) python3 -m bench.attention_rows --sweep --sweep-rows "$ROWS" \
    --probe-rows "${ROWS##*,}" --sweep-tokens "${ATTN_TOKENS:-576,1024,2048,4096}" --probe-tokens 1024 \
    --budget-s "${ATTN_S:-170}" --out "$OUT/attn-$N.json" > "$OUT/attn-$N.log" 2>&1
  echo "attn rc=$?"; tail -48 "$OUT/attn-$N.log" | cut -c1-300
fi
if [[ $PARTS == *" app "* ]]; then
  timeout -s INT -k 15 "${APP_S:-300}" python3 -m bench.app_load --random llama-2-7b --ckpt $CKPT \
    --chats "${APP_CHATS:-8,32}" --intervals "${INTERVALS:-0,0.05}" --pairs "${PAIRS:-2}" --new-tokens 128 \
    --prompt-tokens 512 --turns "${TURNS:-1}" --turn-tokens "${TURN_TOKENS:-64}" --client-procs "${PROCS:-8}" --host-variants "${HOST:-default}" --out "$OUT/app-load-$N.json" > "$OUT/app-load-$N.log" 2>&1
  echo "app rc=$?"; grep -E "^\{'|Traceback|Error" "$OUT/app-load-$N.log" | head -24 | cut -c1-400
fi
if [[ $PARTS == *" kv "* ]]; then
  for mode in ${KV:-int8 bf16}; do
    timeout -s INT -k 15 "${KV_S:-150}" python3 -m bench.batched --no-reference --chats "${KV_CHATS:-32}" \
      --new-tokens 128 --ckpt $CKPT --set KV_CACHE=$mode --out "$OUT/kv-$mode-$N.json" > "$OUT/kv-$mode-$N.log" 2>&1
    echo "kv $mode rc=$?"
    python3 - "$OUT/kv-$mode-$N.json" <<'P'
import json, sys
for r in json.load(open(sys.argv[1]))["records"]:
    sp = r.get("step_profile") or {}
    print({k: r.get(k) for k in ("phase", "concurrent_chats", "aggregate_decode_tokens_per_s", "per_chat_decode_tokens_per_s",
                                 "ttft_p95_s", "kv_cache_bytes_per_chat", "warmup_s") if r.get(k) is not None},
          "step_ms", round(sp.get("mean_step_s", 0) * 1e3, 2))
P
    grep -iE "Traceback|Error" "$OUT/kv-$mode-$N.log" | head -4 | cut -c1-300
  done
fi
