#!/usr/bin/env bash
# Builds .whl-gpu: the wheels a device call carries to run the app itself (bench.app_load, bench/h200_s10.sh) on the
# GPU machine, whose image has torch 2.11 + cu130 and transformers 5.17 but no Gradio. Python 3.12 x86_64 wheels,
# pinned as requirements.txt and the dev machine's .venv; bitsandbytes without its CUDA 11/12 libraries and Gradio
# without its browser frontend (bench/slim_wheel.py), so that all of it (~37 MB) fits the 64 MiB a call may carry.
# Run from the repo root on the dev machine (needs the package registries); then carry [".whl-gpu"] and start the
# command with `mkdir -p .whl && cp .whl-gpu/*.whl .whl/;`.
set -euo pipefail
OUT=${1:-.whl-gpu}
RAW=$(mktemp -d)
trap 'rm -rf "$RAW"' EXIT
PLATFORMS=(--platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_24_x86_64
           --platform manylinux_2_28_x86_64 --platform manylinux_2_31_x86_64 --platform any)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${PLATFORMS[@]}" \
  -d "$RAW" bitsandbytes==0.50.2 transformers==5.24.0 gradio==6.31.0 gradio_client==2.7.2 hf-gradio==0.4.1 \
  fastapi==0.165.0 starlette==1.10.0 uvicorn==0.55.0 pydantic==2.14.4 pydantic_core==2.50.5 orjson==3.13.0 \
  python-multipart==0.0.34 pydub==0.25.1 semantic-version==2.10.0 tomlkit==0.14.0 groovy==0.1.2 safehttpx==0.1.7 \
  brotli==1.2.1 annotated-types==0.8.0 annotated-doc==0.0.7 typing-inspection==0.4.5 opentelemetry-api==1.45.3 \
  pytz==2026.6 llguidance==1.9.1
rm -rf "$OUT" && mkdir -p "$OUT"
PY=${PYTHON:-.venv/bin/python}
"$PY" -m bench.slim_wheel "$RAW"/bitsandbytes-*.whl "$OUT" --drop 'bitsandbytes/libbitsandbytes_cuda1[12]*'
"$PY" -m bench.slim_wheel "$RAW"/gradio-6.31.0-*.whl "$OUT" --drop 'gradio/templates/frontend/assets/*' \
  'gradio/templates/frontend/static/*' 'gradio/templates/node/*' 'gradio/media_assets/*'
find "$RAW" -name '*.whl' ! -name 'bitsandbytes-*' ! -name 'gradio-6*' -exec cp {} "$OUT"/ \;
du -sh "$OUT"
