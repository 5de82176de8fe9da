#!/usr/bin/env bash
# (As run for issue 16: from /work/main with this worktree mirrored in .gpu/wt16; elsewhere, drop the cd.)
# Issue 16 on the GPU: the batched fast path's GPU tests, then bench.batched (1/8/32 chats, Llama-2-7B shape, NF4,
# 512 + 128, beside transformers' batched generate). Run from the repo root; results under $OUT.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
cd .gpu/wt16
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
python3 -c "import torch, transformers, bitsandbytes, triton; print('versions', torch.__version__, transformers.__version__, bitsandbytes.__version__, triton.__version__, torch.cuda.get_device_name())" | tee "$OUT/versions.txt"
timeout "${TESTS_S:-170}" python3 -m pytest -q -m gpu -x -rA -p no:cacheprovider tests/test_batched_fast.py > "$OUT/gpu-tests.txt" 2>&1
echo "tests rc=$?"
tail -25 "$OUT/gpu-tests.txt" | cut -c1-300
timeout "${BENCH_S:-280}" python3 -m bench.batched --out "$OUT/batched.json" > "$OUT/bench.log" 2>&1
echo "bench rc=$?"
grep -iE "warn|not captured|error|Traceback" "$OUT/bench.log" | cut -c1-300 | head -20
python3 - "$OUT/batched.json" <<'P'
import json, sys
d = json.load(open(sys.argv[1]))
for r in d["records"]:
    r = {k: v for k, v in r.items() if k not in ("versions", "command", "decode_path_reason")}
    print(json.dumps(r)[:900])
print(d.get("summary"))
P
