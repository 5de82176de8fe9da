#!/usr/bin/env bash
# One device call (<= 5.5 min): the structured-output mask's cost on the CUDA fast path at batch 1 and 8, through
# ChatEngine with default settings, a random-weight Llama-2-7B shape (NF4) carrying the embedded model's tokenizer
# (49,152 ids: the mask's work scales with the vocabulary). Carry .whl (bitsandbytes, transformers, llguidance,
# jsonschema and its three needs) and .tok (the tokenizer, tokenizer.json gzipped). JSON under $OUT.
set -uo pipefail
source bench/h200_env.sh || exit 1
mkdir -p /tmp/tok && cp .tok/*.json .tok/*.jinja /tmp/tok/ && gunzip -c .tok/tokenizer.json.gz > /tmp/tok/tokenizer.json
for batch in 1 8; do
  DECODE_PATH=fast MAX_BATCH_SIZE=$batch timeout "${STRUCTURED_LIMIT_S:-150}" python3 -m bench.structured \
    --random llama-2-7b --tokenizer /tmp/tok --ckpt /tmp/structured-ckpt --replies 16 --unmasked 8 --max-tokens 48 \
    --concurrent "$batch" --out "$OUT/structured-batch$batch.json" > "$OUT/structured-batch$batch.log" 2>&1
  echo "batch $batch rc=$?"; grep -E "valid_percent|tokens_per_s|mask_ms|decode_path|peak_batch|Error|Traceback" \
    "$OUT/structured-batch$batch.log" | head -12
done
