#!/usr/bin/env bash
# Device-run driver (H200 through the workplace's `run` tool; see docs/fast_decode.md). Installs the carried
# bitsandbytes wheel (.whl/, git-ignored), records the machine, runs `python -m llm_core.bench "$@"` under a
# wall-clock limit; the JSON, the log and nvidia-smi's view land in $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem,power.limit --format=csv \
  > "$OUT/nvidia-smi.csv" 2>&1
python3 -c "import torch, transformers, bitsandbytes, triton; print('versions', torch.__version__, \
transformers.__version__, bitsandbytes.__version__, triton.__version__, torch.cuda.get_device_name())"
timeout "${BENCH_TIMEOUT:-560}" python3 -m llm_core.bench "$@" --work-dir /tmp/bench --out "$OUT/decode.json" \
  2>&1 | tee "$OUT/log.txt"
