"""The fast path's quantized KV cache rows (int8 and int4): pure torch, used eagerly on CPU, inside compiled layers,
and as the reference for the Triton decode attention kernel's quantized forms (llm_core.fast.kernels.attention).

int8 (an int8 tensor). A cache row is one (token, KV head): head_dim int8 codes, then one int8 exponent e (the row's
scale is 2^(e/8)), then zero padding to ROW_PAD bytes so rows stay 4-byte aligned (16-byte rows cost 12.5% of the
cache at head_dim 128 for wider loads; 4-byte loads still coalesce across a warp). Per row:
    e     = ceil(8 * log2(amax / 127)), clamped to [-128, 127]     (amax = max |x| over the row's head_dim values)
    codes = round(x / 2^(e/8)), clamped to [-127, 127]
The scale is a power of 2^(1/8), so it needs no bit-cast to store in an int8 tensor (compiles to plain arithmetic)
and costs at most 9% of the code range: the worst rounding error is 2^(e/8)/2 <= amax * 2^(1/8) / 254 per value.
Bytes per row: head_dim + 4 (132 for head_dim 128: 1.94x fewer than bf16).

int4 (a uint8 tensor). The row is first rotated by the normalized Walsh-Hadamard matrix H (orthogonal and its own
inverse), which spreads the few large key channels over all of them (as QuaRot does), so per-token groups quantize
keys without KIVI's per-channel scales and full-precision residual window; values take the same rotation. Then per
group of INT4_GROUP rotated values xr, asymmetric over [lo, hi] = [min(xr, 0), max(xr, 0)]:
    e     = ceil(8 * log2((hi - lo) / 15)) + 128, clamped to [0, 255]   (a uint8; the step is 2^((e-128)/8))
    z     = round(-lo / step), clamped to [0, 15]                         (the zero point, a uint8)
    codes = round(xr / step) + z, clamped to [0, 15], a nibble each (element 2j low, 2j+1 high); xr ~ (code - z) step
Row: head_dim / 2 packed bytes, the groups' exponents, then their zero points, zero padding to a multiple of 16 (80
bytes for head_dim 128: 3.2x fewer than bf16, 1.8x fewer than int8). The worst rounding error is half a step per
rotated value. Attention needs no un-rotation of K: q.k = (Hq).(Hk); the kernel rotates the query and un-rotates its
output (a sum of rotated V rows). Measured on the embedded model: bench/kv_quality.py, docs/memory.md.
"""

from __future__ import annotations

import torch

from ..memory.model import STATIC_INT4_GROUP as INT4_GROUP
from ..memory.model import STATIC_INT8_ROW_PAD as ROW_PAD
from ..memory.model import static_row_bytes

SCALE_STEPS_PER_OCTAVE = 8.0
INT4_LEVELS = 15
INT4_EXP_BIAS = 128


def row_bytes(head_dim: int, kv_cache: str = "int8") -> int:
    return static_row_bytes(kv_cache, head_dim)


def cache_layout(kv_cache: str, head_dim: int, dtype: torch.dtype) -> tuple[int, torch.dtype]:
    """(last dimension, dtype) of a static cache tensor for this KV cache mode: bf16 rows are the compute dtype."""
    if kv_cache == "int8":
        return row_bytes(head_dim, "int8"), torch.int8
    if kv_cache == "int4":
        return row_bytes(head_dim, "int4"), torch.uint8
    return head_dim, dtype


def is_quantized(cache: torch.Tensor) -> bool:
    return cache.dtype in (torch.int8, torch.uint8)


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


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """x (..., D) -> x @ H in fp32, H the normalized Sylvester Walsh-Hadamard matrix (D a power of two; symmetric and
    orthogonal, so hadamard(hadamard(x)) == x up to rounding): log2(D) butterfly stages of views, no matrix."""
    d = x.shape[-1]
    lead = x.shape[:-1]
    y = x.float()
    h = 1
    while h < d:
        y = y.reshape(*lead, d // (2 * h), 2, h)
        a, b = y[..., 0, :], y[..., 1, :]
        y = torch.stack((a + b, a - b), dim=-2)
        h *= 2
    return y.reshape(*lead, d) * d ** -0.5


def quantize_rows4(x: torch.Tensor) -> torch.Tensor:
    """x (..., D) float -> uint8 (..., row_bytes(D, "int4")): packed rotated codes, exponents, zero points, padding."""
    d, lead = x.shape[-1], x.shape[:-1]
    groups = d // INT4_GROUP
    xr = hadamard(x).reshape(*lead, groups, INT4_GROUP)
    lo, hi = xr.amin(-1, keepdim=True).clamp(max=0.0), xr.amax(-1, keepdim=True).clamp(min=0.0)
    e = torch.ceil(SCALE_STEPS_PER_OCTAVE * torch.log2((hi - lo) / INT4_LEVELS)).clamp(-INT4_EXP_BIAS,
                                                                                       255 - INT4_EXP_BIAS)
    inv = torch.exp2(-e / SCALE_STEPS_PER_OCTAVE)
    z = torch.round(-lo * inv).clamp(0.0, INT4_LEVELS)
    codes = (torch.round(xr * inv) + z).clamp(0.0, INT4_LEVELS).reshape(*lead, d // 2, 2)
    packed = (codes[..., 0] + 16 * codes[..., 1]).to(torch.uint8)
    meta = torch.cat([e[..., 0] + INT4_EXP_BIAS, z[..., 0]], dim=-1).to(torch.uint8)
    pad = torch.zeros((*lead, row_bytes(d, "int4") - d // 2 - 2 * groups), dtype=torch.uint8, device=x.device)
    return torch.cat([packed, meta, pad], dim=-1)


def dequantize_rows4_rotated(rows: torch.Tensor, head_dim: int) -> torch.Tensor:
    """uint8 int4 rows (..., R) -> the rotated values (..., D) in fp32 (what the kernel multiplies)."""
    d, groups = head_dim, head_dim // INT4_GROUP
    packed = rows[..., :d // 2].to(torch.int32)
    codes = torch.stack((packed & 15, packed >> 4), dim=-1).reshape(*rows.shape[:-1], groups, INT4_GROUP)
    meta = rows[..., d // 2:d // 2 + 2 * groups].float()
    step = torch.exp2((meta[..., :groups] - INT4_EXP_BIAS) / SCALE_STEPS_PER_OCTAVE)[..., None]
    return ((codes.float() - meta[..., groups:, None]) * step).reshape(*rows.shape[:-1], d)


def int4_head_dim(row: int) -> int:
    """head_dim of int4 rows of `row` bytes (a power of two: FastDecodeOptions allows no other)."""
    return next(d for d in (2 ** i for i in range(5, 13)) if row_bytes(d, "int4") == row)


def dequantize_rows4(rows: torch.Tensor, dtype: torch.dtype, head_dim: int | None = None) -> torch.Tensor:
    """uint8 int4 rows -> (..., D) in dtype, rotated back (fp32 throughout, rounded once)."""
    d = head_dim or int4_head_dim(rows.shape[-1])
    return hadamard(dequantize_rows4_rotated(rows, d)).to(dtype)


def to_cache(x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """What to write into `cache` for new K or V rows x (..., D): x itself, or its int8 / int4 rows."""
    if cache.dtype == torch.uint8:
        return quantize_rows4(x)
    return quantize_rows(x) if cache.dtype == torch.int8 else x


def from_cache(cache: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows as (..., D) values: the cache itself, or its rows dequantized (a temporary)."""
    if cache.dtype == torch.uint8:
        return dequantize_rows4(cache, dtype)
    return dequantize_rows(cache, dtype) if cache.dtype == torch.int8 else cache
