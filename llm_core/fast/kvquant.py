"""The fast path's int8 KV cache rows: pure torch, used eagerly on CPU, inside compiled layers, and as the reference
for the Triton decode attention kernel's int8 form (llm_core.fast.kernels.attention).

A cache row is one (token, KV head): head_dim int8 codes, then one int8 exponent e (the row's scale is 2^(e/8)),
then zero padding to ROW_PAD bytes so rows stay 16-byte aligned for vector loads. Per row:
    e     = ceil(8 * log2(amax / 127)), clamped to [-128, 127]     (amax = max |x| over the row's head_dim values)
    codes = round(x / 2^(e/8)), clamped to [-127, 127]
The scale is a power of 2^(1/8), so it needs no bit-cast to store in an int8 tensor (compiles to plain arithmetic)
and costs at most 9% of the code range: the worst rounding error is 2^(e/8)/2 <= amax * 2^(1/8) / 254 per value.
Bytes per row: head_dim + 16 (144 for head_dim 128: 1.78x fewer than bf16).
"""

from __future__ import annotations

import torch

from ..memory.model import STATIC_INT8_ROW_PAD as ROW_PAD

SCALE_STEPS_PER_OCTAVE = 8.0


def row_bytes(head_dim: int) -> int:
    return head_dim + ROW_PAD


def is_quantized(cache: torch.Tensor) -> bool:
    return cache.dtype == torch.int8


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """x (..., D) float -> int8 (..., D + ROW_PAD): codes, exponent, zero padding."""
    xf = x.float()
    amax = xf.abs().amax(-1, keepdim=True)
    e = torch.ceil(SCALE_STEPS_PER_OCTAVE * torch.log2(amax / 127.0)).clamp(-128.0, 127.0)
    codes = torch.round(xf * torch.exp2(-e / SCALE_STEPS_PER_OCTAVE)).clamp(-127.0, 127.0)
    pad = torch.zeros((*x.shape[:-1], ROW_PAD - 1), dtype=torch.int8, device=x.device)
    return torch.cat([codes.to(torch.int8), e.to(torch.int8), pad], dim=-1)


def dequantize_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 (..., D + ROW_PAD) -> (..., D) in dtype (the products in fp32, then rounded once)."""
    d = rows.shape[-1] - ROW_PAD
    scale = torch.exp2(rows[..., d:d + 1].float() / SCALE_STEPS_PER_OCTAVE)
    return (rows[..., :d].float() * scale).to(dtype)


def to_cache(x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """What to write into `cache` for new K or V rows x (..., D): x itself, or its int8 rows."""
    return quantize_rows(x) if is_quantized(cache) else x


def from_cache(cache: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows as (..., D) values: the cache itself, or its rows dequantized (a temporary)."""
    return dequantize_rows(cache, dtype) if is_quantized(cache) else cache
