#!/usr/bin/env bash
# The small-M NF4 matmul on the GPU: its GPU tests, then the sweep (bench/small_m.py). Run from the repo root with
# .whl carried (bench/h200_env.sh installs it); results under $OUT.
set -uo pipefail
source bench/h200_env.sh || exit 1
timeout "${TESTS_S:-170}" python3 -m pytest -q -m gpu -x -rfE -p no:cacheprovider ${TESTS:-tests/test_nf4_mm.py} > "$OUT/gpu-tests.txt" 2>&1
echo "tests rc=$?"
tail -15 "$OUT/gpu-tests.txt" | cut -c1-400
timeout "${SWEEP_S:-400}" python3 -m bench.small_m --out "$OUT/small-m.json" --budget-s "${BUDGET_S:-330}" ${SWEEP_ARGS:-} 2>&1 | tee "$OUT/sweep.log" | cut -c1-330
echo "sweep rc=$?"
