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
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem,power.limit --format=csv \
  > "$OUT/nvidia-smi.csv" 2>&1
python3 -c "import torch, transformers, bitsandbytes, triton; print('versions', torch.__version__, \
transformers.__version__, bitsandbytes.__version__, triton.__version__, torch.cuda.get_device_name())"
if [[ $BENCH == *.py ]]; then run=(python3 "$BENCH"); else run=(python3 -m "$BENCH"); fi
timeout "${BENCH_TIMEOUT:-560}" "${run[@]}" "$@" --work-dir /tmp/bench --out "$OUT/$BENCH_OUT" \
  2>&1 | tee "$OUT/log.txt"
