#!/usr/bin/env bash
# One device call (<= 9.5 min): the one-token NF4 kernel with its next step's loads prefetched into registers
# (nf4_gemv PREFETCH). Run from the repo root with .whl carried. Parts (each on unless set to 0), in this order:
#   ENGINE  batched-{plain,all}.json / .log: bench.batched through ChatEngine (Llama-2-7B shape, NF4, 512-token
#           prompts, $NEW new tokens, chats $CHATS, default settings): the GEMV autotuner limited to the configs
#           without prefetch (the kernel as it was), then all of them (the library's default); one engine each
#   TESTS   gpu-tests-gemv.txt: tests/test_nf4_gemv.py + tests/test_pdl.py -m gpu (each form against dequantize +
#           matmul; the PDL forms' bits; the probe)
#   BENCH   gemv.json / .log: bench.gemv_bench (SWEEP=1: --sweep): bitsandbytes and ours autotuned, with and
#           without PDL, per linear of each arch, weights >> L2 in one CUDA graph
set -uo pipefail
source bench/h200_env.sh || exit 1
if [ "${ENGINE:-1}" = 1 ]; then
  for which in plain all; do
    timeout -s INT -k 15 "${BATCHED_S:-190}" python3 -m bench.batched --no-reference --chats "${CHATS:-1,8}" \
      --new-tokens "${NEW:-128}" --gemv-configs "$which" --out "$OUT/batched-$which.json" > "$OUT/batched-$which.log" 2>&1
    echo "batched $which rc=$?"; grep -E '"(recipe|phase)"' "$OUT/batched-$which.log" | cut -c1-300 | tail -4
  done
fi
if [ "${TESTS:-1}" = 1 ]; then
  timeout -s INT -k 15 "${TESTS_S:-170}" python3 -m pytest -q -m gpu -rA --tb=short -p no:cacheprovider \
    tests/test_nf4_gemv.py tests/test_pdl.py > "$OUT/gpu-tests-gemv.txt" 2>&1
  echo "tests rc=$?"; grep -E "^(FAILED|ERROR)|^E |passed|failed" "$OUT/gpu-tests-gemv.txt" | head -12 | cut -c1-300
fi
if [ "${BENCH:-1}" = 1 ]; then
  timeout -s INT -k 15 "${BENCH_S:-150}" python3 -m bench.gemv_bench $([ "${SWEEP:-0}" = 1 ] && echo --sweep) \
    --budget-s "${BUDGET_S:-120}" --arch ${ARCHS:-llama-2-7b llama-3-8b} \
    --kernels "${KERNELS:-bnb_gemm_4bit_nested,ours_nested,ours_nested_pdl}" --out "$OUT/gemv.json" > "$OUT/gemv.log" 2>&1
  echo "gemv bench rc=$?"
  python3 - "$OUT/gemv.json" <<'PY'
import json, sys, collections
d = json.load(open(sys.argv[1]))
per = collections.defaultdict(dict)
for r in d["records"]:
    if "us_per_call" in r:
        per[(r["arch"], r["kernel"])][r["shape"]] = r["us_per_call"]
    elif "error" in r:
        print("ERR", r["arch"], r["shape"], r["kernel"], r["error"][:150])
for (arch, k), shapes in sorted(per.items(), key=lambda kv: (kv[0][0], sum(kv[1].values()))):
    print(f"{arch:11s} {k:32s} " + " ".join(f"{s}={v:5.1f}" for s, v in shapes.items()) + f" sum={sum(shapes.values()):5.1f}")
for r in d["records"]:
    if r.get("tuned_config") and r["kernel"] == "ours_nested":
        print("tuned", r["arch"], r["shape"], r["tuned_config"])
print("copy bandwidth", d.get("copy_bandwidth_bytes_per_s"), "wall", d.get("wall_s"), d.get("stopped"))
PY
fi
