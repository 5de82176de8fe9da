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
#   kv-<mode>-<N>.json  PARTS=kv: bench.batched --chats $KV_CHATS (default 32) with KV_CACHE=<mode> for each of $KV;
#                       with KV_TABLES="default sweep" also kv-<mode>-sweep-<N>.json, the attn part's suggestions
#                       for the rows buckets $KV_BUCKETS (default 64) put in ATTENTION_LAUNCHES
#   frag-*.txt/json     PARTS=frag: the GPU tests of llm_core.fast.kernels.nf4_frag (-gpu-tests.txt; pytest -k
#                       $FRAG_TESTS_K, default all), then (unless FRAG_S=0) bench.small_m
#                       --frag --frag-grid $FRAG_GRID (default all) for $FRAG_ARCHS (default llama-2-7b) at M = $FRAG_MS
#                       (default 1,2,4,8,16,32;
#                       -sweep.json, budget $FRAG_S s, default 300)
#   fragab-<i>-<mode>-<N>.json  PARTS=fragab: the batched engine's GPU test (NF4_FRAG off and on: rows equal the batch of
#                       one; -gpu-tests.txt), then bench.batched --chats $FRAG_CHATS (default 8,32) with NF4_FRAG off
#                       and on in the order $FRAG_AB (default "off on on off"; an entry on:depth=2,early=1 passes
#                       bench.batched --frag-config depth=2,early=1), all logs in fragab-<N>.log; with
#                       FRAG_PROFILE=n each run ends with n chats under torch.profiler (--profile-chats: kernels by time)
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
    --budget-s "${ATTN_S:-170}" --formats "${ATTN_FORMATS:-bf16,int8,int4}" --out "$OUT/attn-$N.json" > "$OUT/attn-$N.log" 2>&1
  echo "attn rc=$?"; tail -48 "$OUT/attn-$N.log" | cut -c1-300
fi
if [[ $PARTS == *" frag "* ]]; then
  [[ ${FRAG_TESTS_S:-150} == 0 ]] || timeout -s INT -k 15 "${FRAG_TESTS_S:-150}" python3 -m pytest -q -m gpu tests/test_nf4_frag.py -x \
    -k "${FRAG_TESTS_K:-gpu}" > "$OUT/frag-gpu-tests-$N.txt" 2>&1
  echo "frag tests rc=$?"; tail -15 "$OUT/frag-gpu-tests-$N.txt" | cut -c1-300
  [[ ${FRAG_S:-300} == 0 ]] || timeout -s INT -k 15 $(( ${FRAG_S:-300} + 60 )) python3 -m bench.small_m --frag --archs "${FRAG_ARCHS:-llama-2-7b}" \
    --ms "${FRAG_MS:-1,2,4,8,16,32}" --frag-grid "${FRAG_GRID:-all}" --budget-s "${FRAG_S:-300}" --out "$OUT/frag-sweep-$N.json" > "$OUT/frag-sweep-$N.log" 2>&1
  echo "frag sweep rc=$?"; tail -60 "$OUT/frag-sweep-$N.log" | cut -c1-300
fi
if [[ $PARTS == *" fragab "* ]]; then
  [[ ${FRAGAB_TESTS_S:-150} == 0 ]] || timeout -s INT -k 15 "${FRAGAB_TESTS_S:-150}" python3 -m pytest -q -m gpu tests/test_batched_fast.py \
    -k "batched_rows_equal" > "$OUT/fragab-gpu-tests-$N.txt" 2>&1
  echo "fragab tests rc=$?"; tail -6 "$OUT/fragab-gpu-tests-$N.txt" | cut -c1-300
  i=0
  for entry in ${FRAG_AB:-off on on off}; do
    i=$((i + 1))
    mode=${entry%%:*}; fields=""; [[ $entry == *:* ]] && fields=${entry#*:}
    tag=$mode${fields:+-${fields//[=,]/}}
    timeout -s INT -k 15 "${FRAGAB_S:-150}" python3 -m bench.batched --no-reference --chats "${FRAG_CHATS:-8,32}" \
      --new-tokens 128 --ckpt $CKPT --set NF4_FRAG=$mode ${fields:+--frag-config $fields} \
      ${FRAG_PROFILE:+--profile-chats $FRAG_PROFILE} --out "$OUT/fragab-$i-$tag-$N.json" >> "$OUT/fragab-$N.log" 2>&1
    echo "fragab $i $entry rc=$?"
    python3 - "$OUT/fragab-$i-$tag-$N.json" <<'P'
import json, sys
doc = json.load(open(sys.argv[1]))
for r in doc["records"]:
    sp = r.get("step_profile") or {}
    notes = [n for n in r.get("slot_notes") or [] if n.startswith("NF4 rows kernels")]
    print({k: r.get(k) for k in ("phase", "concurrent_chats", "aggregate_decode_tokens_per_s", "ttft_p95_s",
                                 "weights_bytes") if r.get(k) is not None}, "step_ms", round(sp.get("mean_step_s", 0) * 1e3, 2),
          notes[0][:400] if notes else "")
P
  done
  grep -iE "Traceback|Error" "$OUT/fragab-$N.log" | head -6 | cut -c1-300
fi
if [[ $PARTS == *" app "* ]]; then
  timeout -s INT -k 15 "${APP_S:-300}" python3 -m bench.app_load --random llama-2-7b --ckpt $CKPT \
    --chats "${APP_CHATS:-8,32}" --intervals "${INTERVALS:-0,0.05}" --pairs "${PAIRS:-2}" --new-tokens 128 \
    --prompt-tokens 512 --turns "${TURNS:-1}" --turn-tokens "${TURN_TOKENS:-64}" --client-procs "${PROCS:-8}" --host-variants "${HOST:-default}" --out "$OUT/app-load-$N.json" > "$OUT/app-load-$N.log" 2>&1
  echo "app rc=$?"; grep -E "^\{'|Traceback|Error" "$OUT/app-load-$N.log" | head -24 | cut -c1-400
fi
if [[ $PARTS == *" kv "* ]]; then
  for mode in ${KV:-int8 bf16}; do
    for table in ${KV_TABLES:-default}; do
      # KV_TABLES="default sweep": the second run takes the attn part's bucket suggestions (attn-$N.json) for the
      # rows buckets of KV_BUCKETS (default 64) through bench.batched --attention-launch: an A/B in one lease
      args=(); tag=$mode
      if [[ $table == sweep ]]; then
        tag=$mode-sweep
        mapfile -t args < <(python3 - "$OUT/attn-$N.json" "${KV_BUCKETS:-64}" <<'P'
import json, sys
buckets = {int(b) for b in sys.argv[2].split(",")}
for b in json.load(open(sys.argv[1])).get("buckets", []):
    if b["bucket"] in buckets and b["time_vs_default_geomean"] < 1:
        print(f"--attention-launch={b['arg']}")
P
)
        echo "kv $tag: ${args[*]:-no suggestion beats the default}"
      fi
      timeout -s INT -k 15 "${KV_S:-150}" python3 -m bench.batched --no-reference --chats "${KV_CHATS:-32}" \
        --new-tokens 128 --ckpt $CKPT --set KV_CACHE=$mode "${args[@]}" --out "$OUT/kv-$tag-$N.json" \
        > "$OUT/kv-$tag-$N.log" 2>&1
      echo "kv $tag rc=$?"
      python3 - "$OUT/kv-$tag-$N.json" <<'P'
import json, sys
for r in json.load(open(sys.argv[1]))["records"]:
    sp = r.get("step_profile") or {}
    print({k: r.get(k) for k in ("phase", "concurrent_chats", "aggregate_decode_tokens_per_s", "per_chat_decode_tokens_per_s",
                                 "ttft_p95_s", "kv_cache_bytes_per_chat", "warmup_s") if r.get(k) is not None},
          "step_ms", round(sp.get("mean_step_s", 0) * 1e3, 2))
P
      grep -iE "Traceback|Error" "$OUT/kv-$tag-$N.log" | head -4 | cut -c1-300
    done
  done
fi
# the device returns at most 8 files: past that, the logs travel as one archive
if [[ $(find "$OUT" -maxdepth 1 -type f | wc -l) -gt 8 ]]; then
  (cd "$OUT" && tar czf logs.tgz --remove-files ./*.log ./*.txt 2>/dev/null)
fi
if [[ $(find "$OUT" -maxdepth 1 -type f | wc -l) -gt 8 ]]; then
  (cd "$OUT" && tar czf results.tgz --remove-files ./*.json)
fi
ls "$OUT"
