#!/usr/bin/env bash
# Device calls of 2026-12-07's second session (issue 24): the small-M NF4 kernel's K splits summed inside its launch
# (MMConfig.fuse_splits, the library's default now) against the second kernel (_sum_splits) it replaces. Run from
# the repo root with .whl carried; records under $OUT:
#   gpu-tests.txt          tests/test_nf4_mm.py's GPU tests of the in-launch sum and the CUDA-graph op, and the
#                          batched step's GPU test (rows equal the batch of one, kernels on)
#   small-m-fused.json     bench.small_m --fused: per Llama-2-7B linear and M, the launch rule summed by a second
#                          kernel and in the launch, and the in-launch sum over more tiles and splits (PDL launches)
#   batched-{S}-{n}.json   bench.batched --chats $CHATS (default 8,32) through ChatEngine, S = fused (in the launch
#                          at every row count: the library's rule until 2026-12-07's third session) | kernel
#                          (--mm-split-sum kernel); PROFILE_CHATS=N adds --profile-chats N to the runs
# PARTS (default "tests smallm batched") picks the stages; SUMS (default "fused") the batched runs in order (a name
# given twice runs twice: "fused kernel kernel fused"); PAIR the first run's number; CKPT the checkpoint (written
# when missing).
set -uo pipefail
source bench/h200_env.sh || exit 1
CKPT=${CKPT:-/tmp/l2-ckpt}
PARTS=" ${PARTS:-tests smallm batched} "
[[ $PARTS != *" tests "* ]] || { timeout -s INT -k 15 "${TESTS_S:-150}" python3 -m pytest -q -m gpu -rA \
  -p no:cacheprovider tests/test_nf4_mm.py tests/test_batched_fast.py -k "${TESTS_K:-in_launch or cuda_graph or batched_rows}" \
  > "$OUT/gpu-tests.txt" 2>&1
echo "tests rc=$?"; grep -E "^(FAILED|ERROR)|^E |passed|failed" "$OUT/gpu-tests.txt" | head -14 | cut -c1-300; }
[[ $PARTS != *" smallm "* ]] || { timeout -s INT -k 15 "${SMALLM_S:-220}" python3 -m bench.small_m --fused \
  --archs llama-2-7b --ms "${MS:-2,4,8,16,32}" --budget-s "${SMALLM_BUDGET_S:-170}" --out "$OUT/small-m-fused.json" \
  > "$OUT/small-m-fused.log" 2>&1
echo "small_m rc=$?"; grep -vE "Warning|warn" "$OUT/small-m-fused.log" | tail -40 | cut -c1-250; }
declare -A seen=()
batched() {  # $1 = fused | kernel; the k-th run of a name writes batched-<name>-<PAIR + k - 1>
  seen[$1]=$(( ${seen[$1]:-0} + 1 ))
  local n=$(( ${PAIR:-1} + ${seen[$1]} - 1 )) extra=""
  [ "${PROFILE_CHATS:-0}" = 0 ] || extra="--profile-chats $PROFILE_CHATS"
  timeout -s INT -k 15 "${BATCHED_S:-170}" python3 -m bench.batched --no-reference --chats "${CHATS:-8,32}" \
    --new-tokens 128 --ckpt $CKPT --mm-split-sum $1 $extra --out "$OUT/batched-$1-$n.json" \
    > "$OUT/batched-$1-$n.log" 2>&1
  echo "batched $1 rc=$?"
  python3 - "$OUT/batched-$1-$n.json" <<'P'
import json, sys
for r in json.load(open(sys.argv[1]))["records"]:
    sp = r.get("step_profile") or {}
    print({k: r.get(k) for k in ("phase", "what", "concurrent_chats", "aggregate_decode_tokens_per_s",
                                 "per_chat_decode_tokens_per_s", "ttft_p95_s", "warmup_s", "slot_notes")
           if r.get(k) is not None}, "step_ms", round(sp.get("mean_step_s", 0) * 1e3, 2))
    if r.get("what") == "profile-arrivals":
        steps = sp.get("decode_steps") or 1
        print("  per decode step, us:", [(k["name"][:40], k["calls"], round(k["us"] / steps, 1))
                                        for k in r.get("device_kernels", [])[:12]])
P
  grep -iE "Traceback|Error" "$OUT/batched-$1-$n.log" | head -4 | cut -c1-300
}
if [[ $PARTS == *" batched "* ]]; then
  for s in ${SUMS:-fused}; do batched "$s"; done
fi
