#!/usr/bin/env bash
# One device call (<= 9.5 min): is PREFIX_ATTENTION=paged (a later prefill chunk reading the paged pool in place,
# llm_core.fast.kernels.prefix_attention) faster than the default gather path? Run from the repo root with .whl
# carried (bitsandbytes, transformers). Records under $OUT:
#   gpu-tests-prefix.txt     the kernel against the reference on the GPU (tests/test_prefix_attention.py -m gpu)
#   prefix-paged.json        per layer: the engine's gather + dequantize + flash path against the kernel at four
#                            launches (bench.prefix_attention --paged)
#   multiturn-{gather,paged}.json  a chat of 2k-word messages through ChatEngine on an emulated 16 GiB card,
#                            Llama-2-7B shape (32 K/V heads, int8 KV there: where the gather path costs most), TTFT
#                            per turn with each PREFIX_ATTENTION (prefix reuse on, one engine each)
set -uo pipefail
source bench/h200_env.sh || exit 1
timeout -s INT -k 15 "${TESTS_S:-60}" python3 -m pytest -q -m gpu -rA -p no:cacheprovider \
  tests/test_prefix_attention.py > "$OUT/gpu-tests-prefix.txt" 2>&1
echo "tests rc=$?"; grep -E "^(PASSED|FAILED|ERROR)|^E |passed|failed" "$OUT/gpu-tests-prefix.txt" | head -12 | cut -c1-300
timeout -s INT -k 15 "${KERNEL_S:-120}" python3 -m bench.prefix_attention --paged --out "$OUT/prefix-paged.json" \
  > "$OUT/prefix-paged.log" 2>&1
echo "kernel bench rc=$?"; grep -E '^\{' "$OUT/prefix-paged.log" | python3 -c '
import json, sys
for line in sys.stdin:
    r = json.loads(line)
    best = min(((v, k) for k, v in r.items() if k.startswith("paged_kernel_") and k.endswith("_ms")), default=None)
    print(r["model"], r["rows"], r["new_tokens"], r["cached_tokens"], "engine", r.get("engine_gather_flash_ms"),
          "kernel best", best, "diff", r.get("max_abs_diff"))'
for mode in gather paged; do
  timeout -s INT -k 15 "${TURNS_S:-170}" python3 -m bench.multiturn --random llama-2-7b --max-positions 32768 \
    --card-gib 16 --message-tokens 2000 --turns 9 --new-tokens 64 --only-first --set PREFIX_ATTENTION=$mode \
    --out "$OUT/multiturn-$mode.json" > "$OUT/multiturn-$mode.log" 2>&1
  echo "multiturn $mode rc=$?"; grep -E '"kind": "(startup|turn)"' "$OUT/multiturn-$mode.log" | cut -c1-220
done
