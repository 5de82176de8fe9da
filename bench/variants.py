"""Every fast-path configuration the decode benchmark measures beside the product's default ("auto"): the
ablations behind docs/fast_decode.md. Product code carries none of these choices as defaults; they are
FastDecodeOptions values the benchmark passes in."""

from __future__ import annotations

from llm_core.fast import FastDecodeOptions

# Steps of the fast path measured on NF4 (each a FastDecodeOptions); the fastest becomes "ours".
NF4_VARIANTS: dict[str, FastDecodeOptions] = {
    "auto": FastDecodeOptions(),  # what the demo runs: kernel timed at start-up, fused, double quant kept, prefill
    # from CUDA graphs
    "auto-eagerprefill": FastDecodeOptions(compile_prefill=False),
    "auto-compiledprefill": FastDecodeOptions(prefill_graph_tokens=0),  # prefill compiled, launched per reply
    "nf4-fused-dq": FastDecodeOptions(gemv="nf4", fuse=True, absmax="keep"),
    "nf4-fused-dqoff": FastDecodeOptions(gemv="nf4", fuse=True, absmax="fp32"),
    "bnb-unfused-dq": FastDecodeOptions(gemv="bnb", fuse=False, absmax="keep"),
    "bnb-fused-dq-requant": FastDecodeOptions(gemv="bnb", fuse=True, absmax="requant"),
    "bnb-fused-dqoff": FastDecodeOptions(gemv="bnb", fuse=True, absmax="fp32"),
    "torch-fused-dq": FastDecodeOptions(gemv="torch", fuse=True, absmax="keep"),
    "torch-fused-dqoff": FastDecodeOptions(gemv="torch", fuse=True, absmax="fp32"),
    "torch-unfused-dq": FastDecodeOptions(gemv="torch", fuse=False, absmax="keep"),
    "bnb-fused-dq-requant-torchattn": FastDecodeOptions(gemv="bnb", fuse=True, absmax="requant", attention="torch"),
}
DENSE_VARIANTS: dict[str, FastDecodeOptions] = {
    "auto": FastDecodeOptions(),  # what the demo runs: cuBLAS or llm_core.dense_gemv timed at start-up, fused
    "dense-fused-triton": FastDecodeOptions(fuse=True, dense_gemv="triton"),
    "auto-compiledprefill": FastDecodeOptions(prefill_graph_tokens=0),
    "dense-fused-cublas": FastDecodeOptions(fuse=True, dense_gemv="cublas"),
    "dense-fused-cublas-torchattn": FastDecodeOptions(fuse=True, dense_gemv="cublas", attention="torch"),
}
INT8_VARIANTS: dict[str, FastDecodeOptions] = {  # int8 layers always take llm_core.dense_gemv with row scales
    "auto": FastDecodeOptions(),
    "auto-compiledprefill": FastDecodeOptions(prefill_graph_tokens=0),
}
