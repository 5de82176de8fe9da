#!/usr/bin/env bash
# One device call (<= 9.5 min): LAUNCH_OVERLAP (programmatic dependent launch of the decode kernels,
# llm_core.fast.kernels.pdl) through ChatEngine. Run from the repo root with .whl carried (bitsandbytes,
# transformers). Records under $OUT:
#   gpu-tests-pdl.txt        the decode step with the overlap against without (tests/test_pdl.py -m gpu)
#   batched-{off,auto}.json  bench.batched (Llama-2-7B shape, NF4, 512-token prompts, $NEW new tokens, chats
#                            $CHATS), LAUNCH_OVERLAP=off then auto (on, on sm_90), one engine each, same machine
set -uo pipefail
source bench/h200_env.sh || exit 1
python3 -c "import torch._inductor.config as c; print('inductor enable_pdl:', hasattr(c.triton, 'enable_pdl'))"
timeout -s INT -k 15 "${TESTS_S:-70}" python3 -m pytest -q -m gpu -rA --tb=short -p no:cacheprovider \
  tests/test_pdl.py > "$OUT/gpu-tests-pdl.txt" 2>&1
echo "tests rc=$?"; grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|^E |passed|failed" "$OUT/gpu-tests-pdl.txt" | head -12 | cut -c1-300
for mode in ${MODES:-off auto}; do
  timeout -s INT -k 15 "${BATCHED_S:-200}" python3 -m bench.batched --no-reference --chats "${CHATS:-1,8}" \
    --new-tokens "${NEW:-128}" --set LAUNCH_OVERLAP=$mode --out "$OUT/batched-$mode.json" > "$OUT/batched-$mode.log" 2>&1
  echo "batched $mode rc=$?"; grep -E '"(recipe|phase)"' "$OUT/batched-$mode.log" | cut -c1-330 | tail -6
done
