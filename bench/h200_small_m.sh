#!/usr/bin/env bash
# The small-M NF4 matmul on the GPU: its GPU tests, then the sweep (bench/small_m.py). Run from the tree's root
# (as run here: /work/main/.kwt, a copy of this worktree, after the wheels are installed on PYTHONPATH).
set -uo pipefail
python3 -c "import torch, bitsandbytes, triton; print('versions', torch.__version__, bitsandbytes.__version__, triton.__version__, torch.cuda.get_device_name())" | tee "$OUT/versions.txt"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv | tee -a "$OUT/versions.txt"
timeout "${TESTS_S:-170}" python3 -m pytest -q -m gpu -x -rfE -p no:cacheprovider ${TESTS:-tests/test_nf4_mm.py} > "$OUT/gpu-tests.txt" 2>&1
echo "tests rc=$?"
tail -15 "$OUT/gpu-tests.txt" | cut -c1-400
timeout "${SWEEP_S:-400}" python3 -m bench.small_m --out "$OUT/small-m.json" --budget-s "${BUDGET_S:-330}" ${SWEEP_ARGS:-} 2>&1 | tee "$OUT/sweep.log" | cut -c1-330
echo "sweep rc=$?"
