# Sourced first by every bench/h200_*.sh (run from the repo root by the device tool, with .whl carried): installs the
# carried wheels (bitsandbytes, our transformers pin, ...) into /tmp/site, puts them and the tree on PYTHONPATH, and
# records the stack and the card in $OUT/versions.txt. Returns non-zero when the wheels do not install.
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || return 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
python3 -c "import torch, transformers, bitsandbytes, triton; print('versions', torch.__version__, \
transformers.__version__, bitsandbytes.__version__, triton.__version__, torch.cuda.get_device_name())" \
  | tee "$OUT/versions.txt"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem,power.limit --format=csv \
  >> "$OUT/versions.txt" 2>&1
