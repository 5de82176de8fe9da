"""y (M, N) = x (M, K) @ (W int8 (N, K) * row_scale (N,)).T for a few rows (M <= 32), in Triton: weight-only int8.

Why: the batched decode step multiplies B = 2..32 rows by the int8 lm_head (llm_core.fast.tables). Dequantize +
matmul would write a half-precision copy of the whole table first (Llama-3-8B: 128,256 x 4096 x 2 B = 1.05 GB, in
the CUDA graph's pool for good), which is what the int8 table is there to save. Each program owns BLOCK_N rows of W,
streams BLOCK_K columns per step, widens the int8 values to x's dtype (exact: |q| <= 127) and multiplies on the
tensor cores with fp32 accumulation; the row scale is applied once per output at the end. Each weight byte is
read once for all M rows. One row takes llm_core.dense_gemv (the single-reply kernel, same arithmetic).

`int8_rows_reference` computes the same product with torch ops, a chunk of rows at a time (no whole-table copy);
the custom op runs it off CUDA, so the batched step runs in CPU tests too.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

try:  # Triton ships with CUDA builds of PyTorch; CPU-only installs have no such kernel
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

MAX_ROWS = 32  # the largest batch bucket
REFERENCE_CHUNK_ROWS = 8192  # rows of W dequantized at once by the torch form (Llama-3-8B: 64 MB in bf16)


def int8_rows_reference(x: torch.Tensor, w: torch.Tensor, row_scale: torch.Tensor,
                        chunk_rows: int = REFERENCE_CHUNK_ROWS) -> torch.Tensor:
    """x (M, K) -> (M, N) in x's dtype: W's rows dequantized to x's dtype a chunk at a time, then a matmul."""
    n = w.shape[0]
    parts = []
    for start in range(0, n, chunk_rows):
        rows = (w[start:start + chunk_rows].float() * row_scale[start:start + chunk_rows, None].float()).to(x.dtype)
        parts.append(F.linear(x, rows))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)


if triton is not None:

    @triton.jit
    def _int8_mm_kernel(x_ptr, w_ptr, s_ptr, y_ptr, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr):
        """Program p: output columns [p*BLOCK_N, (p+1)*BLOCK_N) for all M rows."""
        rows = tl.arange(0, BLOCK_M)
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rmask, cmask = rows < M, cols < N
        ks = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + ks
            kmask = kk < K
            x = tl.load(x_ptr + rows[:, None] * K + kk[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
            w = tl.load(w_ptr + cols.to(tl.int64)[:, None] * K + kk[None, :],  # N*K may pass 2**31
                        mask=cmask[:, None] & kmask[None, :], other=0, eviction_policy="evict_first")
            acc += tl.dot(x, tl.trans(w.to(x.dtype)))
        y = acc * tl.load(s_ptr + cols, mask=cmask, other=0.0)[None, :]
        tl.store(y_ptr + rows[:, None] * N + cols[None, :], y.to(y_ptr.dtype.element_ty),
                 mask=rmask[:, None] & cmask[None, :])

    # (BLOCK_N, BLOCK_K, num_warps, num_stages): 8-16 KB of int8 weights per program and step
    CONFIGS = [(64, 128, 4, 4), (128, 128, 4, 4), (64, 256, 4, 3), (128, 64, 4, 4)]
    _tuned = triton.autotune(
        configs=[triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=s) for bn, bk, w, s in CONFIGS],
        key=["N", "K", "BLOCK_M"])(_int8_mm_kernel)


def int8_mm(x: torch.Tensor, w: torch.Tensor, row_scale: torch.Tensor, *,
            config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """x (M, K) half precision, M <= MAX_ROWS -> (M, N) in x's dtype, with Triton. `config` = (BLOCK_N, BLOCK_K,
    num_warps, num_stages) skips autotuning."""
    if triton is None:
        raise RuntimeError("Triton is not installed")
    m, k = x.shape
    n = w.shape[0]
    if w.shape[1] != k or w.dtype != torch.int8:
        raise ValueError(f"the weight must be int8 ({n}, {k}), got {tuple(w.shape)} {w.dtype}")
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"int8_mm takes 1 to {MAX_ROWS} rows, got {m}")
    x = x.contiguous()
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_m = max(16, triton.next_power_of_2(m))  # tl.dot takes at least 16 rows
    scale = row_scale if row_scale.dtype == torch.float32 else row_scale.float()
    if config is not None:
        bn, bk, warps, stages = config
        _int8_mm_kernel[(triton.cdiv(n, bn),)](x, w, scale, y, m, n, k, BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=bk,
                                               num_warps=warps, num_stages=stages)
    else:
        _tuned[lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)](x, w, scale, y, m, n, k, BLOCK_M=block_m)
    return y


@torch.library.custom_op("llm_core::int8_mm", mutates_args=())
def _int8_mm_op(x: torch.Tensor, w: torch.Tensor, row_scale: torch.Tensor) -> torch.Tensor:
    """One opaque op for torch.compile and CUDA graphs: the Triton kernel on CUDA, the torch form elsewhere."""
    if triton is not None and x.device.type == "cuda" and x.shape[0] <= MAX_ROWS:
        return int8_mm(x, w, row_scale)
    return int8_rows_reference(x, w, row_scale)


@_int8_mm_op.register_fake
def _(x: torch.Tensor, w: torch.Tensor, row_scale: torch.Tensor) -> Any:
    return x.new_empty(x.shape[0], w.shape[0])
