#!/usr/bin/env bash
# Device calls for the prefill work of 2026-12-05 (fourth session), untimed until then. GPU tests of the
# NF4 prefill GEMM and the paged pool's whole-prompt prefill graphs; the GEMM against dequantize + matmul
# (bench.prefill_gemm, within GEMM_S); then N chats through ChatEngine on the paged pool with the group pass and
# with one graph replay per prompt (bench.batched --prefill both, within BATCHED_S; the random checkpoint is
# written to /tmp/paged-ckpt once). Run from the repo root with .whl carried; JSON under $OUT.
# TESTS_S=0, GEMM_S=0 or BATCHED_S=0 skips a part; CHATS (default 1,8) and BATCHED_ARGS add to bench.batched.
# All three take ~12 min: over one call's 10, so two calls: "BATCHED_S=0 bash bench/h200_prefill.sh" (tests and
# the sweep, ~8 min), then "TESTS_S=0 GEMM_S=0 bash bench/h200_prefill.sh" (the chats, ~5 min).
set -uo pipefail
source bench/h200_env.sh || exit 1
if [ "${TESTS_S:-200}" != 0 ]; then
  timeout -s INT -k 15 "${TESTS_S:-200}" python3 -m pytest -q -m gpu -rA -p no:cacheprovider \
    -k "gemm or paged" tests/test_nf4_mm.py tests/test_paged_kv.py > "$OUT/prefill-gpu-tests.txt" 2>&1
  echo "tests rc=$?"; grep -E "^(FAILED|ERROR)|^E |passed|failed" "$OUT/prefill-gpu-tests.txt" | cut -c1-300 | head -20
fi
if [ "${GEMM_S:-240}" != 0 ]; then
  timeout -s INT -k 15 "${GEMM_S:-240}" python3 -m bench.prefill_gemm --out "$OUT/prefill-gemm.json" \
    --budget-s $(( ${GEMM_S:-240} - 40 )) ${GEMM_ARGS:-} 2>&1 | grep -v Warning | tee "$OUT/prefill-gemm.log" | cut -c1-300
fi
if [ "${BATCHED_S:-300}" != 0 ]; then
  timeout -s INT -k 15 "${BATCHED_S:-300}" python3 -m bench.batched --no-reference --chats "${CHATS:-1,8}" \
    --new-tokens 64 --kv-layout paged --prefill both --profile-chats 8 --ckpt /tmp/paged-ckpt ${BATCHED_ARGS:-} \
    --out "$OUT/batched-prefill.json" > "$OUT/batched-prefill.log" 2>&1
  echo "batched rc=$?"; grep -iE "Traceback|Error" "$OUT/batched-prefill.log" | cut -c1-300 | head -8
  python3 - "$OUT/batched-prefill.json" <<'P'
import json, sys
try:
    d = json.load(open(sys.argv[1]))
except (OSError, ValueError) as e:
    print("no json", e); raise SystemExit
for r in d["records"]:
    if r.get("phase") == "load":
        print("load", r.get("decode_path_reason", "")[:300], "prefill graphs", r.get("prefill_graphs"), r.get("slot_notes"))
    elif r.get("recipe") == "ours":
        print({k: r.get(k) for k in ("what", "prefill", "concurrent_chats", "aggregate_decode_tokens_per_s",
                                     "ttft_p50_s", "ttft_p95_s", "ttfts_s", "device_kernels_us")},
              (r.get("step_profile") or {}).get("prefill_chunks"))
        if r.get("what") == "profile-arrivals":
            print("   ", [(k["name"][:60], k["calls"], k["us"]) for k in r["device_kernels"][:8]])
P
fi
