"""Which kernel multiplies an NF4 linear by B > 1 rows in the batched decode step, per batch bucket; the start-up
pick (SlotDecoder._pick_rows_kernel) times the candidates and fills a RowsPlan. Knows nothing of slots or scheduling.

Kernels: "mm" llm_core.nf4_mm (each 4-bit weight read once for all rows, launch shape nf4_mm.default_config),
"frag" llm_core.nf4_frag over the codes' fragment-order copy (NF4_FRAG=on, LinSpec.frag; a linear without it takes
"mm"), "bnb" bitsandbytes' gemm_4bit op (its own small-M kernel or dequantize + cuBLAS, by its own dispatch),
"dequant" dequantize_4bit + matmul (correct on every device; fused q/k/v and gate/up one part at a time)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .kernels.nf4_mm import MM_MAX
from .layer import linear_decode, linear_prefill, linear_prefill_parts
from .pack import LinSpec, absmax_2d, bias_of, code_of, counters_of, frag_of

ROWS_KERNELS = ("mm", "bnb", "dequant")  # the pick's candidates; "frag" too where a linear has LinSpec.frag


@dataclass(frozen=True)
class RowsPlan:
    """{batch bucket: kernel} for NF4 linears over B > 1 rows; a batch of B rows takes the entry of the smallest
    bucket >= B, and "dequant" where there is none. Frozen and hashable: the compiled step closes over it."""

    kernels: tuple[tuple[int, str], ...] = ()

    def kernel_for(self, rows: int) -> str:
        for bucket, kernel in sorted(self.kernels):
            if rows <= bucket:
                return kernel
        return "dequant"

    @property
    def mm_max(self) -> int:
        """The largest bucket llm_core.nf4_mm serves (0: none), for the bench records."""
        return max((b for b, k in self.kernels if k == "mm"), default=0)


def kernel_for(plan: RowsPlan | int, rows: int) -> str:
    """A plan's kernel for `rows`; an int n means llm_core.nf4_mm for 2..n rows and dequantize + matmul above."""
    if isinstance(plan, RowsPlan):
        return plan.kernel_for(rows)
    return "mm" if rows <= plan else "dequant"


def pick_rows_plan(timings: dict[int, dict[str, float]]) -> RowsPlan:
    """From {bucket: {kernel: µs}}: the fastest kernel at each bucket (ties go to dequantize + matmul, which every
    device runs, then to bitsandbytes)."""
    order = {"dequant": 0, "bnb": 1, "mm": 2, "frag": 3}
    return RowsPlan(tuple((bucket, min(t, key=lambda k: (t[k], order.get(k, 3))))
                          for bucket, t in sorted(timings.items()) if t))


def nf4_rows_linear(kernel: str, spec: LinSpec, x: torch.Tensor, ts: Sequence[torch.Tensor]) -> torch.Tensor:
    """x (B, K) bf16 -> (B, N) through llm_core.nf4_frag ("frag", where the linear has the fragment-order codes; else
    as "mm"), llm_core.nf4_mm ("mm") or bitsandbytes' gemm_4bit ("bnb")."""
    bias = bias_of(spec, ts)
    if kernel == "frag" and spec.frag:
        frag, table, pairs = frag_of(spec, ts)
        return torch.ops.llm_core.nf4_frag(x, frag, table, pairs, bias, spec.blocksize, list(spec.levels), spec.pdl)
    if kernel in ("mm", "frag"):
        counters = counters_of(spec, ts)
        if spec.absmax == "fp32":
            return torch.ops.llm_core.nf4_mm(x, ts[0], ts[1], ts[1], ts[1], ts[1], ts[1], code_of(spec, ts), bias,
                                             spec.blocksize, False, list(spec.levels), "asm", [], spec.pdl,
                                             spec.early, counters)
        return torch.ops.llm_core.nf4_mm(x, ts[0], ts[1], ts[1], ts[2], ts[3], ts[4], code_of(spec, ts), bias,
                                         spec.blocksize, True, list(spec.levels), "asm", [], spec.pdl, spec.early,
                                         counters)
    if kernel != "bnb":
        raise ValueError(f"no rows kernel {kernel!r}")
    packed = ts[0].view(-1, 1)
    if spec.absmax == "nested" and spec.uniform_offset:
        return torch.ops.bitsandbytes.gemm_4bit(x, packed, [spec.n, spec.k], ts[2], spec.blocksize, "nf4", bias,
                                                ts[1], ts[4], ts[5])
    return torch.ops.bitsandbytes.gemm_4bit(x, packed, [spec.n, spec.k], absmax_2d(spec, ts).view(-1),
                                            spec.blocksize, "nf4", bias)


def linear_rows(spec: LinSpec, x: torch.Tensor, ts: Sequence[torch.Tensor], rows_max: RowsPlan | int = 0
                ) -> torch.Tensor:
    """x (B, K) -> (B, N): the single-reply kernel for one row; for more, NF4 through the plan's kernel for B
    (llm_core.fast.rows: llm_core.nf4_mm or bitsandbytes' gemm_4bit; an int n: nf4_mm for B <= n), cuBLAS (dense),
    or dequantize + matmul (NF4, int8: correct on every device)."""
    if x.shape[0] == 1:
        return linear_decode(spec, x, ts)
    if spec.fmt == "dense":
        return F.linear(x, ts[0], bias_of(spec, ts))
    kernel = kernel_for(rows_max, x.shape[0]) if spec.fmt == "nf4" and x.shape[0] <= MM_MAX else "dequant"
    if kernel != "dequant":
        return nf4_rows_linear(kernel, spec, x, ts)
    return linear_prefill(spec, x, ts, gemm=False)


def fused_rows(spec: LinSpec, x: torch.Tensor, ts: Sequence[torch.Tensor], rows_max: RowsPlan | int = 0
               ) -> Sequence[torch.Tensor]:
    """A fused linear (q/k/v, gate/up) over B rows, one output per part: as linear_rows, except that where that
    would dequantize + matmul, each part's weight is dequantized on its own (linear_prefill_parts)."""
    rows = x.shape[0]
    served = spec.fmt == "nf4" and rows <= MM_MAX and kernel_for(rows_max, rows) != "dequant"
    if rows > 1 and spec.fmt != "dense" and not served:
        return linear_prefill_parts(spec, x, ts, gemm=False)
    return linear_rows(spec, x, ts, rows_max).split(list(spec.splits), dim=-1)
