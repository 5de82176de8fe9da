"""The decode step's linear kernels picked at start-up (GEMV=auto, DENSE_GEMV=auto): each candidate packs the first
layer's real (fused) weights and is timed as the step runs them, inside a CUDA graph; the fastest is kept. The
FastDecoder calls pick_gemv / pick_dense_gemv while it builds its plan and keeps the timings for describe()."""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from .kernels.nf4_gemv import AVAILABLE as NF4_KERNEL_AVAILABLE  # importing it registers torch.ops.llm_core.nf4_gemv
from .layer import linear_decode
from .options import DENSE_GEMV_KERNELS, FastDecodeOptions
from .pack import PackedLinear, pack_linears
from .support import is_dense_linear
from .timing import time_in_cuda_graph

if TYPE_CHECKING:
    from .generate import FastDecoder

log = logging.getLogger(__name__)


def layer_groups(layer: Any, fuse: bool) -> list[list[Any]]:
    """A decoder layer's linears in the step's order, grouped as they are packed: q/k/v and gate/up fused or not."""
    attn, mlp = layer.self_attn, layer.mlp
    if fuse:
        return [[attn.q_proj, attn.k_proj, attn.v_proj], [attn.o_proj], [mlp.gate_proj, mlp.up_proj],
                [mlp.down_proj]]
    return [[attn.q_proj], [attn.k_proj], [attn.v_proj], [attn.o_proj], [mlp.gate_proj], [mlp.up_proj],
            [mlp.down_proj]]


def pick_gemv(decoder: FastDecoder) -> str:
    """The 4-bit kernel: each candidate timed on the first layer's real (fused) weights; the fastest is kept,
    bitsandbytes' if none runs (the timings land in decoder.gemv_timings_us). Dense weights and CPU never get
    here."""
    if decoder.loaded.settings.quantization != "nf4":
        return "bnb"
    groups = layer_groups(decoder._arch.layers[0], decoder.options.fuse)
    candidates = ["bnb"] + (["nf4"] if NF4_KERNEL_AVAILABLE and decoder.dtype == torch.bfloat16 else [])
    timings = decoder.gemv_timings_us = time_linears(
        decoder, groups, {cand: (replace(decoder.options, gemv=cand), cand) for cand in candidates})
    return min(timings, key=lambda k: timings[k]) if timings else "bnb"


def pick_dense_gemv(decoder: FastDecoder) -> str:
    """cuBLAS or llm_core.dense_gemv for unquantized weights, timed on the first layer's dense (fused) linears,
    or on the lm_head where the layers are quantized; the faster is kept (cuBLAS if the Triton kernel fails; the
    timings land in decoder.dense_gemv_timings_us). Only reached on CUDA with Triton (resolved() picks cublas
    elsewhere)."""
    a, opts = decoder._arch, decoder.options
    groups = [g for g in layer_groups(a.layers[0], opts.fuse) if all(is_dense_linear(m) for m in g)]
    groups = groups or [[h] for h in [a.lm_head] if is_dense_linear(h)]
    if not groups:  # quantized layers and an int8 lm_head: no dense weight left to run
        return "cublas"
    timings = decoder.dense_gemv_timings_us = time_linears(
        decoder, groups, {cand: (replace(opts, dense_gemv=cand), opts.gemv)
                          for cand in DENSE_GEMV_KERNELS[:2]})  # cublas, triton
    return min(timings, key=lambda k: timings[k]) if timings else "cublas"


def time_linears(decoder: FastDecoder, groups: list[list[Any]],
                 candidates: dict[str, tuple[FastDecodeOptions, str]]) -> dict[str, float]:
    """Microseconds per call of `groups` packed as each candidate's (options, 4-bit kernel), as the decode step
    runs them: inside a CUDA graph (no Python launch costs), after warm-up calls that compile and autotune
    Triton kernels outside the capture. A candidate that fails is logged and left out."""
    timings: dict[str, float] = {}
    for cand, (opts, gemv) in candidates.items():
        try:
            packed = [pack_linears(g, opts, gemv) for g in groups]
            xs = [torch.randn(1, p.spec.k, dtype=decoder.dtype, device=decoder.device) for p in packed]

            def layer(packed: list[PackedLinear] = packed, xs: list[torch.Tensor] = xs) -> None:
                for p, x in zip(packed, xs, strict=True):
                    linear_decode(p.spec, x, p.tensors)

            timings[cand] = round(time_in_cuda_graph(layer, decoder.device, reps=10, replays=5, warmups=3), 2)
        except Exception as exc:  # noqa: BLE001 - a candidate that cannot run is simply not chosen
            log.warning("kernel %s unavailable: %s", cand, exc)
    return timings
