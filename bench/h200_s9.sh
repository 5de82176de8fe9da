#!/usr/bin/env bash
# Device calls of 2026-12-07's third session (issue 24): what the host costs the batched loop through ChatEngine.
# Run from the repo root with .whl carried; records under $OUT:
#   gpu-tests.txt   PARTS=tests: the batched step's and the paged pool's GPU tests (the engine's loop, overlap on)
#   host-<n>.json   bench.batched --chats $CHATS (default 8,32) with every phase under each of $VARIANTS in turn
#                   (bench.host_probe: default, blocks-per-row, switch-0.5ms, gc-freeze, gc-off), $REPEATS times, in
#                   one process: per phase the collections, the scheduler thread's time in the loop's parts, and the
#                   device's step and idle time between steps (CUDA events around each replay)
#   batched-<S>-<n>.json  PARTS=batched: bench.batched --chats $CHATS --mm-split-sum S for S in $SUMS
# CKPT the checkpoint (written when missing); N the file number.
set -uo pipefail
source bench/h200_env.sh || exit 1
CKPT=${CKPT:-/tmp/l2-ckpt}
PARTS=" ${PARTS:-host} "
summary() {
  python3 - "$1" <<'P'
import json, sys
for r in json.load(open(sys.argv[1]))["records"]:
    sp, hp = r.get("step_profile") or {}, r.get("host_probe") or {}
    gpu, host = hp.get("gpu") or {}, hp.get("host") or {}
    print({k: r.get(k) for k in ("phase", "concurrent_chats", "host", "aggregate_decode_tokens_per_s", "ttft_p95_s",
                                 "warmup_s") if r.get(k) is not None},
          "step_ms", round(sp.get("mean_step_s", 0) * 1e3, 2), "gpu", {k: gpu.get(k) for k in (
              "step_ms_median", "idle_ms_median", "idle_ms_total", "busy_ms_total")},
          "idle>5", gpu.get("idle_over_5ms", [])[:8],
          "host", {k: (v["total_ms"], v["median_ms"], v["max_ms"]) for k, v in host.items()},
          "gc", {g: (v["count"], v["total_ms"], v["max_ms"]) for g, v in (hp.get("gc") or {}).items()},
          hp.get("python", ""))
P
}
N=${N:-1}
[[ $PARTS != *" tests "* ]] || { timeout -s INT -k 15 "${TESTS_S:-150}" python3 -m pytest -q -m gpu -rA \
  -p no:cacheprovider tests/test_batched_fast.py tests/test_paged_kv.py -k "${TESTS_K:-batched_rows or paged}" \
  > "$OUT/gpu-tests.txt" 2>&1
echo "tests rc=$?"; grep -E "^(FAILED|ERROR)|^E |passed|failed" "$OUT/gpu-tests.txt" | head -14 | cut -c1-300; }
[[ $PARTS != *" host "* ]] || {
  timeout -s INT -k 15 "${HOST_S:-320}" python3 -m bench.batched --no-reference --chats "${CHATS:-8,32}" \
    --new-tokens 128 --ckpt $CKPT --host-variants "${VARIANTS:-default,blocks-per-row,switch-0.5ms,gc-freeze}" \
    --host-repeats "${REPEATS:-2}" --out "$OUT/host-$N.json" > "$OUT/host-$N.log" 2>&1
  echo "host rc=$?"; summary "$OUT/host-$N.json"
  grep -iE "Traceback|Error" "$OUT/host-$N.log" | head -4 | cut -c1-300; }
if [[ $PARTS == *" batched "* ]]; then
  for s in ${SUMS:-fused}; do
    timeout -s INT -k 15 "${BATCHED_S:-150}" python3 -m bench.batched --no-reference --chats "${CHATS:-2,4}" \
      --new-tokens 128 --ckpt $CKPT --mm-split-sum $s --out "$OUT/batched-$s-$N.json" > "$OUT/batched-$s-$N.log" 2>&1
    echo "batched $s rc=$?"; summary "$OUT/batched-$s-$N.json"
    grep -iE "Traceback|Error" "$OUT/batched-$s-$N.log" | head -4 | cut -c1-300
    N=$((N + 1))
  done
fi
