#!/usr/bin/env bash
# Device-run driver (H200 through the workplace's `run` tool; see docs/fast_decode.md). Installs the carried
# bitsandbytes wheel (.whl/, git-ignored), records the machine, runs a benchmark under a wall-clock limit; the JSON,
# the log and nvidia-smi's view land in $OUT.
#   bash bench/h200.sh --random llama-2-7b ...         python -m bench.decode ... -> $OUT/decode.json
#   BENCH=bench.compare_bench BENCH_OUT=compare.json bash bench/h200.sh --random llama-2-7b
#                                                      that script instead (a module name works too) -> $OUT/compare.json
# The benchmark gets the arguments, then --work-dir /tmp/bench --out "$OUT/$BENCH_OUT".
set -uo pipefail
OUT=${OUT:-/tmp/out}
BENCH=${BENCH:-bench.decode}
BENCH_OUT=${BENCH_OUT:-decode.json}
source bench/h200_env.sh || exit 1
if [[ $BENCH == *.py ]]; then run=(python3 "$BENCH"); else run=(python3 -m "$BENCH"); fi
timeout "${BENCH_TIMEOUT:-560}" "${run[@]}" "$@" --work-dir /tmp/bench --out "$OUT/$BENCH_OUT" \
  2>&1 | tee "$OUT/log.txt"
