"""One-token matrix-vector product for unquantized (bf16/fp16) or int8 weights in Triton, with the decode step's
neighbours folded in.

y (1, N) = epilogue(prologue(x) @ W.T * row_scale + bias), W (N, K) row-major, in one kernel and without splitting K:

- `row_scale` (fp32, one per row): int8 weights with per-row absmax scales (bitsandbytes' LLM.int8 layout: W =
  CB * SCB / 127; pass SCB / 127). The int8 values are widened in registers and multiplied with the activations
  as they are (weight-only int8: no activation quantization), so each weight byte is read once.

- prologue `norm`: x is the residual stream h and the kernel applies the layer's RMSNorm on the fly,
  y = rstd(h) * sum_k W[n, k] * g[k] * h[k]: every program also sums h**2 over its pass over K (h is 8-16 KB and
  comes from L2), so the norm's own kernel is gone. transformers rounds the normed input to the weights' dtype
  before the matmul; here it stays fp32 (one rounding fewer).
- prologue `glu`: x is the fused gate/up projection's output (1, 2K) and the kernel forms silu(gate) * up per
  element, rounded as the eager ops round it (the MLP's down projection; no separate SiLU-and-multiply kernel).
- epilogue `residual`: y = residual + y, each rounded to the output dtype as `h + linear(x)` rounds.

Why: cuBLAS's one-token kernels (nvjet, sm90) split K for the 4096-row projections of a 7B model, which costs a
reduction kernel and a memcpy node per call, and a bf16 decode step also runs two RMSNorm kernels and a SiLU
kernel per layer (bench/results/2026-11-30-h200-step-profile.json: 0.31 ms of a 4.55 ms step outside the matmuls
and the attention). Each program owns BLOCK_N rows, streams BLOCK_K columns per step into an fp32 (BLOCK_N,
BLOCK_K) accumulator and sums each row once at the end.

On CPU (and without Triton) `dense_gemv_reference` computes the same thing with torch ops; the custom op uses
it there, so the fused decode layer runs in CPU tests too.
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

AVAILABLE = triton is not None
AUTOTUNER: Any = None  # the GEMV's autotuner; what it picked per shape: llm_core.fast.kernels.tuning.tuned_pick


def dense_gemv_reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
                         residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
                         eps: float = 1e-6, glu: bool = False, row_scale: torch.Tensor | None = None) -> torch.Tensor:
    """What the kernel computes, in torch ops (fp32 accumulation): x (1, K) or (1, 2K) with glu -> (1, N)."""
    k = w.shape[1]
    xf = x.float().reshape(-1)
    if glu:
        gate, up = x.reshape(-1)[:k], x.reshape(-1)[k:]
        xf = (F.silu(gate.float()).to(x.dtype).float() * up.float()).to(x.dtype).float()
    scale = None
    if norm_weight is not None:
        scale = torch.rsqrt(xf.pow(2).mean() + eps)
        xf = xf * norm_weight.float()
    y = w.float() @ xf
    if scale is not None:
        y = y * scale
    if row_scale is not None:
        y = y * row_scale.float()
    if bias is not None:
        y = y + bias.float()
    y = y.to(x.dtype)
    if residual is not None:
        y = (residual.reshape(-1).float() + y.float()).to(x.dtype)
    return y.view(1, -1)


if triton is not None:

    @triton.jit
    def _dense_gemv_kernel(x_ptr, w_ptr, bias_ptr, res_ptr, g_ptr, s_ptr, y_ptr, N, eps, K: tl.constexpr,
                           GLU: tl.constexpr, NORM: tl.constexpr, HAS_BIAS: tl.constexpr, RESID: tl.constexpr,
                           SCALED: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr):
        """Program p: rows [p*BLOCK_N, (p+1)*BLOCK_N), BLOCK_K columns per step."""
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rmask = rows < N
        cols0 = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        ss = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + cols0
            cmask = cols < K
            if EVEN_K:
                xv = tl.load(x_ptr + cols).to(tl.float32)
            else:
                xv = tl.load(x_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
            if GLU:  # silu(gate) rounded to the activation dtype, times up, rounded again (the eager ops' roundings)
                if EVEN_K:
                    up = tl.load(x_ptr + K + cols).to(tl.float32)
                else:
                    up = tl.load(x_ptr + K + cols, mask=cmask, other=0.0).to(tl.float32)
                act = (xv * tl.sigmoid(xv)).to(x_ptr.dtype.element_ty).to(tl.float32)
                xv = (act * up).to(x_ptr.dtype.element_ty).to(tl.float32)
            if NORM:
                ss += xv * xv
                if EVEN_K:
                    xv = xv * tl.load(g_ptr + cols).to(tl.float32)
                else:
                    xv = xv * tl.load(g_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
            offs = rows.to(tl.int64)[:, None] * K + cols[None, :]  # N*K may pass 2**31 (large vocabularies)
            if EVEN_K:
                w = tl.load(w_ptr + offs, mask=rmask[:, None], other=0.0, eviction_policy="evict_first")
            else:
                w = tl.load(w_ptr + offs, mask=rmask[:, None] & cmask[None, :], other=0.0,
                            eviction_policy="evict_first")
            acc += w.to(tl.float32) * xv[None, :]
        y = tl.sum(acc, axis=1)
        if NORM:
            y = y * tl.rsqrt(tl.sum(ss, axis=0) / K + eps)
        if SCALED:
            y = y * tl.load(s_ptr + rows, mask=rmask, other=0.0)
        if HAS_BIAS:
            y += tl.load(bias_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
        y = y.to(y_ptr.dtype.element_ty)
        if RESID:
            y = (tl.load(res_ptr + rows, mask=rmask, other=0.0).to(tl.float32) + y.to(tl.float32)).to(
                y_ptr.dtype.element_ty)
        tl.store(y_ptr + rows, y, mask=rmask)

    # (BLOCK_N, BLOCK_K, num_warps): 8-32 KB of weights per program and step
    CONFIGS = [(4, 512, 4), (8, 512, 4), (4, 1024, 4), (8, 1024, 8), (16, 512, 8), (2, 2048, 8), (16, 256, 4),
               (1, 4096, 8)]
    _tuned = triton.heuristics({"EVEN_K": lambda a: a["K"] % a["BLOCK_K"] == 0})(
        _dense_gemv_kernel)
    _tuned = triton.autotune(
        configs=[triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w) for bn, bk, w in CONFIGS],
        key=["N", "K", "GLU", "NORM", "RESID", "SCALED"])(_tuned)  # Triton adds the arguments' dtypes to the key
    AUTOTUNER = _tuned


def dense_gemv(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
               residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
               glu: bool = False, row_scale: torch.Tensor | None = None, *, config: tuple[int, int, int] | None = None,
               compiled: list[Any] | None = None) -> torch.Tensor:
    """x (1, K) (glu: (1, 2K)) -> (1, N) in x's dtype, on the GPU with Triton. w: x's dtype, or int8 with
    `row_scale` (N,) fp32. `config` = (BLOCK_N, BLOCK_K, num_warps) skips autotuning; `compiled` (diagnostics)
    receives the compiled kernel."""
    if triton is None:
        raise RuntimeError("Triton is not installed")
    n, k = w.shape
    if x.numel() != (2 * k if glu else k):
        raise ValueError(f"x has {x.numel()} elements; the weight takes {k}{' (x2 with glu)' if glu else ''}")
    if w.stride(1) != 1 or w.stride(0) != k:
        raise ValueError("the weight must be contiguous (N, K)")
    if (w.dtype == torch.int8) != (row_scale is not None):
        raise ValueError("int8 weights take a row_scale, and only they do")
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    args = (x.contiguous(), w, bias if bias is not None else y, residual.contiguous() if residual is not None else y,
            norm_weight if norm_weight is not None else y,
            row_scale.float().contiguous() if row_scale is not None else y, y, n, float(eps))
    flags = {"K": k, "GLU": bool(glu), "NORM": norm_weight is not None, "HAS_BIAS": bias is not None,
             "RESID": residual is not None, "SCALED": row_scale is not None}
    if config is not None:
        bn, bk, warps = config
        kernel = _dense_gemv_kernel[(triton.cdiv(n, bn),)](*args, **flags, EVEN_K=k % bk == 0, BLOCK_N=bn,
                                                           BLOCK_K=bk, num_warps=warps)
    else:
        kernel = _tuned[lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)](*args, **flags)
    if compiled is not None:
        compiled.append(kernel)
    return y


@torch.library.custom_op(
    "llm_core::dense_gemv", mutates_args=(),
    schema="(Tensor x, Tensor w, Tensor? bias, Tensor? residual, Tensor? norm_weight, float eps, bool glu, "
           "Tensor? row_scale=None) -> Tensor")
def _dense_gemv_op(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor | None,
                   norm_weight: torch.Tensor | None, eps: float, glu: bool,
                   row_scale: torch.Tensor | None = None) -> torch.Tensor:
    """One opaque op for torch.compile and CUDA graphs: the Triton kernel on CUDA, the torch reference elsewhere."""
    if triton is not None and x.device.type == "cuda":
        return dense_gemv(x, w, bias, residual, norm_weight, eps, glu, row_scale)
    return dense_gemv_reference(x, w, bias, residual, norm_weight, eps, glu, row_scale)


@_dense_gemv_op.register_fake
def _(x: torch.Tensor, w: torch.Tensor, *args: Any) -> torch.Tensor:
    return x.new_empty(1, w.shape[0])
