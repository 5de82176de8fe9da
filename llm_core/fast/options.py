"""How the decode step is built: FastDecodeOptions and the choices it resolves on a device."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch

from ..config import DEFAULT_PREFILL_GRAPH_TOKENS, GEMV_INPUTS, LAUNCH_OVERLAPS, NF4_FRAGS, PREFIX_ATTENTIONS
from ..errors import GenerationError
from .kernels.attention import triton
from .kernels.dense_gemv import AVAILABLE as _DENSE_KERNEL_AVAILABLE  # registers torch.ops.llm_core.dense_gemv
from .kernels.nf4_gemv import AVAILABLE as _NF4_KERNEL_AVAILABLE  # importing it registers torch.ops.llm_core.nf4_gemv
from .kernels.pdl import pdl_support

GEMV_KERNELS = ("bnb", "nf4", "torch")
DENSE_GEMV_KERNELS = ("cublas", "triton")
ABSMAX_MODES = ("keep", "fp32", "requant")
PREFILL_BUCKET_TOKENS = 64  # padded prefill lengths: multiples of this (FastDecodeOptions.prefill_graph_tokens)


@dataclass(frozen=True)
class FastDecodeOptions:
    """How the decode step is built. Defaults pick the fastest measured choice (see docs/fast_decode.md)."""

    # 4-bit matrix-vector kernel: auto (time bnb and nf4 on the first layer at start-up inside a CUDA graph, keep
    # the faster) | nf4 (llm_core.nf4_gemv: Triton, NF4 table in registers; bf16 activations, CUDA only) | bnb
    # (bitsandbytes' gemm_4bit) | torch (the dequantize-and-sum formula in torch ops: the reference the kernels are
    # tested against, not a product choice). Earlier Triton kernels that read the table from L1 were slower than bnb
    # and were removed once nf4 replaced them (docs/fast_decode.md).
    gemv: str = "auto"
    fuse: bool = True  # q/k/v -> one linear and gate/up -> one linear
    absmax: str = "keep"  # keep: double quant as loaded (read in-kernel) | fp32: double quant off | requant
    attention: str = "auto"  # auto | triton (split-K flash-decoding, reads rows <= pos only) | torch
    # Unquantized weights at one token: auto (time cublas and triton on the first layer at start-up inside a CUDA
    # graph, keep the faster) | cublas (F.linear) | triton (llm_core.dense_gemv: no split-K; CPU runs its torch
    # reference). int8 weights always take llm_core.dense_gemv (with row scales): cuBLAS has no int8-weight x
    # half-activation product. (Measured and dropped: an inductor reduction per linear, and norms/SiLU/residual adds
    # folded into the kernel as prologues, 248.3 vs 256.6 tok/s bf16 on the H200; docs/fast_decode.md.)
    dense_gemv: str = "auto"
    compile_backend: str = "inductor"  # "eager"/"aot_eager" only for tracing tests
    prefill_chunk_tokens: int | None = None  # split long prompts to flatten the prefill's memory peak
    compile_prefill: bool = True  # prefill layer compiled too (dynamic prompt length); eager if compiling fails
    # Prompts up to this many tokens are prefilled right-padded to a multiple of PREFILL_BUCKET_TOKENS, from one
    # CUDA graph per bucket captured at warm-up (0 = off; CPU runs the padded form eagerly). Why: the compiled
    # prefill is host-launch-bound (H200, Llama-2-7B, 512 tokens: 11.1 ms bf16 / 19.0 ms NF4 of kernels back to
    # back, 17-28 / 21-43 ms to launch them; bench/results/2026-11-30-h200-prefill-probe.json), so TTFT is the
    # host's launch time and inherits its jitter. Causal attention keeps the real tokens blind to the padding, whose
    # K/V rows beyond the prompt are overwritten by the decode before any step reads them. Measured with graphs:
    # 10.8 / 18.4 ms, no spread (2026-11-30-h200-prefill-probe.json, run 2). Cost: the graphs' memory pool holds the
    # largest bucket's activations for good (FastDecoder.graph_pool_idle_bytes; counted by the memory guard).
    prefill_graph_tokens: int = DEFAULT_PREFILL_GRAPH_TOKENS
    # Prompt attention (SDPA) backends on CUDA: "flash" = flash / memory-efficient / math, never cuDNN, whose
    # per-shape execution plans live in a per-thread cache (every new prompt length, and every thread, would build
    # one inside the reply) | "auto" = PyTorch's own choice. PyTorch 2.11 already picks flash attention here
    # (bench/results/2026-11-30-h200-ttft-probe.json); "flash" keeps it so whatever a later version prefers.
    prefill_attention: str = "flash"
    # The static KV cache: bf16 (the compute dtype) | int8 (per token and KV head, llm_core.fast.kvquant; 1.94x the
    # tokens per byte at head_dim 128) | int4 (rotated, per group of 16; 3.2x), read by the decode attention kernel
    kv_cache: str = "bf16"
    # The prefill's NF4 matmul: auto (time llm_core.nf4_gemm against dequantize + matmul per chunk size at start-up,
    # CUDA only: llm_core.fast.prefill_gemm) | off (dequantize + matmul, as bitsandbytes does)
    prefill_gemm: str = "auto"
    # A later prefill chunk of the batched path's paged pool: gather (copy the row's prefix out of its blocks, then
    # dequantize and flash-attend it PREFIX_HEADS K/V heads at a time) | paged (read the pool in place:
    # llm_core.fast.kernels.prefix_attention; int4 rows keep gather) | split (gather, then attend the prefix's whole
    # PREFIX_SPLIT_BUCKET-key buckets without a mask, by cuDNN's attention where it runs, and the rest with the
    # chunk's own keys causally; merged by log-sum-exp: layer._split_prefix_attention). Opt-in: paged was slower
    # than gather for int8 rows on an H100 (2026-12-06, docs/prefix_cache.md); split (in buckets, H100 2026-12-07)
    # is 0.85x gather at turn 9 of a 2k-token-message chat but slower at turns 3-4, and its first use in a process
    # stalls 2.4-5.8 s (bench/results/2026-12-07-h100.md).
    prefix_attention: str = "gather"
    # Programmatic dependent launch (CUDA sm_90+, llm_core.fast.kernels.pdl): each kernel of the compiled decode
    # step (ours and inductor's) starts while the one before it finishes and waits on the device where it reads that
    # one's output. auto = on where the GPU and the Triton/PyTorch installed can (resolved to "on" or "off") | early
    # (auto, and each 4-bit matmul prefetches its first weight tile before its wait; resolved to "early" or "off") |
    # off.
    launch_overlap: str = "auto"
    # The one-token NF4 kernel's activations: plain | planar (GEMV_INPUT: permuted into planes by the op before it,
    # where that op is inductor's; llm_core.nf4_gemv's XPLANAR form); planar since timed (docs/fast_decode.md)
    gemv_input: str = "planar"
    # The batched step's NF4 rows over a second copy of the codes in mma fragment order (NF4_FRAG, nf4_frag): off | on
    # (CUDA with Triton; resolved to off elsewhere) | auto (the engine's start-up resolves it to on or off: here it is
    # off). Off by default here: it holds a second copy of the codes.
    nf4_frag: str = "off"

    @property
    def overlaps(self) -> bool:
        """Resolved to launch the decode kernels as programmatic dependent launches (LAUNCH_OVERLAP on or early)."""
        return self.launch_overlap in ("on", "early")

    def resolved(self, device: torch.device, head_dim: int, pdl: tuple[bool, str] | None = None
                 ) -> FastDecodeOptions:
        """The choices made for `device`; `pdl`: what kernels.pdl.pdl_support said there, where the caller already
        asked (its probe launches kernels), else asked here when the overlap is wanted."""
        if self.gemv not in ("auto", *GEMV_KERNELS):
            raise GenerationError(f"Unknown gemv kernel {self.gemv!r}; choose one of {', '.join(GEMV_KERNELS)}.")
        if self.dense_gemv not in ("auto", *DENSE_GEMV_KERNELS):
            raise GenerationError(f"Unknown dense gemv {self.dense_gemv!r}; choose one of "
                                  f"{', '.join(DENSE_GEMV_KERNELS)}.")
        if self.prefill_attention not in ("flash", "auto"):
            raise GenerationError(f"Unknown prefill attention {self.prefill_attention!r}; choose flash or auto.")
        if self.kv_cache not in ("bf16", "int8", "int4"):
            raise GenerationError(f"Unknown fast-path KV cache {self.kv_cache!r}; choose bf16, int8 or int4.")
        if self.kv_cache == "int4" and (head_dim < 32 or head_dim & (head_dim - 1)):
            raise GenerationError(f"KV_CACHE=int4 needs a head_dim that is a power of two of at least 32 (its "
                                  f"Hadamard rotation and groups of 32), not {head_dim}; use KV_CACHE=int8.")
        if self.prefix_attention not in PREFIX_ATTENTIONS:
            raise GenerationError(f"Unknown prefix attention {self.prefix_attention!r}; choose gather, paged or split.")
        if self.prefill_gemm not in ("auto", "off"):
            raise GenerationError(f"Unknown prefill GEMM {self.prefill_gemm!r}; choose auto or off.")
        if self.launch_overlap not in (*LAUNCH_OVERLAPS, "on"):
            raise GenerationError(f"Unknown launch overlap {self.launch_overlap!r}; choose auto, early or off.")
        if self.gemv_input not in GEMV_INPUTS:
            raise GenerationError(f"Unknown GEMV input {self.gemv_input!r}; choose plain or planar.")
        if self.nf4_frag not in NF4_FRAGS:
            raise GenerationError(f"Unknown NF4_FRAG {self.nf4_frag!r}; choose auto, off or on.")
        if self.absmax not in ABSMAX_MODES:
            raise GenerationError(f"Unknown absmax mode {self.absmax!r}; choose one of {', '.join(ABSMAX_MODES)}.")
        triton_ok = triton is not None and (device.type == "cuda" or _triton_interpreter())
        gemv = self.gemv
        if gemv == "nf4" and not (_NF4_KERNEL_AVAILABLE and device.type == "cuda"):  # PTX inside: CUDA only
            gemv = "bnb"
        if gemv == "auto" and (device.type != "cuda" or not triton_ok):
            gemv = "bnb"  # on CPU: the same kernel as the plain path
        dense = self.dense_gemv
        if dense == "auto" and not (device.type == "cuda" and _DENSE_KERNEL_AVAILABLE):
            dense = "cublas"  # CPU: F.linear
        attention = self.attention
        pow2 = head_dim >= 16 and head_dim & (head_dim - 1) == 0
        if attention == "auto":
            attention = "triton" if triton_ok and pow2 else "torch"
        if attention == "triton" and not (triton_ok and pow2):
            attention = "torch"
        overlap = "off"
        if self.launch_overlap != "off" and (pdl if pdl is not None else pdl_support(device))[0]:
            overlap = "early" if self.launch_overlap == "early" else "on"
        # PTX inside: CUDA only; auto is the engine's start-up's to resolve (llm_core.memory.plan.resolve_nf4_frag)
        frag = "on" if self.nf4_frag == "on" and device.type == "cuda" and triton is not None else "off"
        return replace(self, gemv=gemv, attention=attention, dense_gemv=dense, launch_overlap=overlap, nf4_frag=frag)


def _triton_interpreter() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"
