"""The prefill's NF4 matmul, chosen at start-up: llm_core.nf4_gemm (weights decoded in registers, no bf16 copy) for
prompt chunks up to the rows where it timed faster, bitsandbytes' dequantize_4bit then a bf16 matmul above them.

Why a choice and not a switch: dequantize + matmul writes and reads a bf16 copy of each weight part (2.5 bytes per
weight of traffic, the part's size of working memory: 90 MB for Llama-2-7B's gate, which the KV cache pays for on a
small card) but its matmul is cuBLAS; the fused kernel saves the copy and spends CUDA-core instructions on every
weight tile of every row tile. Which wins depends on the chunk's rows and the card, so FastDecoder times both on the
first layer's NF4 parts inside CUDA graphs at PICK_ROWS (llm_core.fast.linear_pick.pick_prefill_gemm) and keeps
nf4_gemm up to the largest timed row count below which it never lost (LinSpec.prefill_gemm_max; 0: dequantize +
matmul everywhere). The dispatch on a chunk's rows happens inside one opaque op (torch.ops.llm_core.nf4_prefill), so
the compiled prefill keeps its one dynamic shape class.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from .kernels.nf4_mm import triton

log = logging.getLogger(__name__)

PICK_ROWS = (64, 256, 1024, 2048)  # prompt rows the start-up pick times (graph buckets, a chunk, the default chunk)
ALL_ROWS = 1 << 30  # prefill_gemm_max when nf4_gemm won at every timed row count
MAX_REL_ERROR = 0.02  # nf4_gemm against dequantize + matmul (bf16 weights and products: ~3e-3 measured on CPU)


def gemm_rows_limit(timings: Mapping[int, Mapping[str, float]]) -> int:
    """The rows up to which nf4_gemm serves: the largest timed row count such that it was no slower than dequantize
    + matmul there and at every smaller timed count; ALL_ROWS when it never lost; 0 when it lost at the first."""
    limit = 0
    ordered = sorted(timings)
    for i, rows in enumerate(ordered):
        t = timings[rows]
        if "gemm" not in t or "dequant" not in t or t["gemm"] > t["dequant"]:
            break
        limit = ALL_ROWS if i == len(ordered) - 1 else rows
    return limit


def prefill_nf4(x: torch.Tensor, packed: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor,
                bias: torch.Tensor | None, blocksize: int, levels: Sequence[float], gemm_max: int) -> torch.Tensor:
    """x (M, K) -> (M, N): nf4_gemm ("asm" decode on CUDA) for M <= gemm_max, else dequantize_4bit + F.linear.
    packed (N, K/2) uint8 rows of one part, absmax (N * K / blocksize) fp32."""
    m, k = x.shape
    n = packed.shape[0]
    if m <= gemm_max and triton is not None:
        from .kernels.nf4_gemv import words_view
        from .kernels.nf4_mm import nf4_gemm

        words = words_view(packed)
        if words is not None:
            decode = "asm" if x.is_cuda else "gather"
            return nf4_gemm(x, words, blocksize, code, absmax=absmax, bias=bias, decode=decode, levels=levels)
    w = torch.ops.bitsandbytes.dequantize_4bit(packed.reshape(-1, 1), absmax, blocksize, "nf4", [n, k], x.dtype)
    return F.linear(x, w, bias)


if triton is not None:

    @torch.library.custom_op(
        "llm_core::nf4_prefill", mutates_args=(),
        schema="(Tensor x, Tensor packed, Tensor absmax, Tensor code, Tensor? bias, int blocksize, float[] levels, "
               "int gemm_max) -> Tensor")
    def _nf4_prefill_op(x: torch.Tensor, packed: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor,
                        bias: torch.Tensor | None, blocksize: int, levels: Sequence[float], gemm_max: int
                        ) -> torch.Tensor:
        """prefill_nf4 as one opaque op (the compiled prefill and its CUDA graphs see one call, whatever the rows)."""
        return prefill_nf4(x, packed, absmax, code, bias, blocksize, levels, gemm_max)

    @_nf4_prefill_op.register_fake
    def _(x: torch.Tensor, packed: torch.Tensor, *args: Any) -> torch.Tensor:
        return x.new_empty(x.shape[0], packed.shape[0])
