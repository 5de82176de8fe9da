#!/usr/bin/env bash
# One device call (<= 9 min): every GPU-marked test, in two groups with their own time limits, so a hang in one
# group still leaves the other's record. Run from the repo root with .whl carried (bitsandbytes, transformers);
# records under $OUT: gpu-tests-kernels.txt, gpu-tests-engine.txt (-rA: every test's outcome and message).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
python3 -c "import torch, transformers, bitsandbytes, triton; print('versions', torch.__version__, transformers.__version__, bitsandbytes.__version__, triton.__version__, torch.cuda.get_device_name())" | tee "$OUT/versions.txt"
run() {  # name, seconds, test files...
  local name=$1 limit=$2; shift 2
  timeout "$limit" python3 -m pytest -q -m gpu -rA -p no:cacheprovider "$@" > "$OUT/gpu-tests-$name.txt" 2>&1
  echo "$name rc=$?"; grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|^E |passed|failed" "$OUT/gpu-tests-$name.txt" | cut -c1-300 | head -60
}
run kernels 210 tests/test_nf4_gemv.py tests/test_dense_gemv.py tests/test_nf4_mm.py tests/test_int8_tables.py \
  tests/test_kv_int4.py
# the /v1 feature tests need gradio, uvicorn and openai, absent there: their CUDA half is tests/test_constrained_gpu.py
run engine 300 tests/test_fast_decode.py tests/test_batched_fast.py tests/test_paged_kv.py tests/test_prefix_cache.py \
  tests/test_cards.py tests/test_constrained_gpu.py
