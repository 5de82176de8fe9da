"""The decode step's linear kernels picked at start-up (GEMV=auto, DENSE_GEMV=auto): each candidate packs the first
layer's real (fused) weights and is timed as the step runs them, inside a CUDA graph; the fastest is kept. The
FastDecoder calls pick_gemv / pick_dense_gemv while it builds its plan, then pick_prefill_gemm (the prefill's NF4
matmul per chunk size, llm_core.fast.prefill_gemm), and keeps the timings for describe()."""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

import torch

from .kernels.nf4_gemv import AVAILABLE as NF4_KERNEL_AVAILABLE  # importing it registers torch.ops.llm_core.nf4_gemv
from .kernels.nf4_gemv import triton
from .layer import _split_linears, linear_decode, linear_prefill_parts
from .options import DENSE_GEMV_KERNELS, FastDecodeOptions
from .pack import PackedLinear, pack_linears
from .prefill_gemm import ALL_ROWS, MAX_REL_ERROR, PICK_ROWS, gemm_rows_limit
from .support import Arch, is_dense_linear
from .timing import time_in_cuda_graph

log = logging.getLogger(__name__)


def layer_groups(layer: Any, fuse: bool) -> list[list[Any]]:
    """A decoder layer's linears in the step's order, grouped as they are packed: q/k/v and gate/up fused or not."""
    attn, mlp = layer.self_attn, layer.mlp
    if fuse:
        return [[attn.q_proj, attn.k_proj, attn.v_proj], [attn.o_proj], [mlp.gate_proj, mlp.up_proj],
                [mlp.down_proj]]
    return [[attn.q_proj], [attn.k_proj], [attn.v_proj], [attn.o_proj], [mlp.gate_proj], [mlp.up_proj],
            [mlp.down_proj]]


def pick_gemv(arch: Arch, options: FastDecodeOptions, quantization: str, dtype: torch.dtype, device: torch.device
              ) -> tuple[str, dict[str, float]]:
    """The 4-bit kernel and each candidate's time (µs): each timed on the first layer's real (fused) weights; the
    fastest is kept, bitsandbytes' if none runs. Dense weights and CPU never get here."""
    if quantization != "nf4":
        return "bnb", {}
    groups = layer_groups(arch.layers[0], options.fuse)
    candidates = ["bnb"] + (["nf4"] if NF4_KERNEL_AVAILABLE and dtype == torch.bfloat16 else [])
    timings = time_linears(groups, {cand: (replace(options, gemv=cand), cand) for cand in candidates}, dtype, device)
    return (min(timings, key=lambda k: timings[k]) if timings else "bnb"), timings


def pick_dense_gemv(arch: Arch, options: FastDecodeOptions, dtype: torch.dtype, device: torch.device
                    ) -> tuple[str, dict[str, float]]:
    """cuBLAS or llm_core.dense_gemv for unquantized weights, and each one's time (µs), timed on the first layer's
    dense (fused) linears, or on the lm_head where the layers are quantized; the faster is kept (cuBLAS if the
    Triton kernel fails). Only reached on CUDA with Triton (resolved() picks cublas elsewhere)."""
    groups = [g for g in layer_groups(arch.layers[0], options.fuse) if all(is_dense_linear(m) for m in g)]
    groups = groups or [[h] for h in [arch.lm_head] if is_dense_linear(h)]
    if not groups:  # quantized layers and an int8 lm_head: no dense weight left to run
        return "cublas", {}
    timings = time_linears(groups, {cand: (replace(options, dense_gemv=cand), options.gemv)
                                    for cand in DENSE_GEMV_KERNELS[:2]}, dtype, device)  # cublas, triton
    return (min(timings, key=lambda k: timings[k]) if timings else "cublas"), timings


def time_linears(groups: list[list[Any]], candidates: dict[str, tuple[FastDecodeOptions, str]], dtype: torch.dtype,
                 device: torch.device) -> dict[str, float]:
    """Microseconds per call of `groups` packed as each candidate's (options, 4-bit kernel), as the decode step
    runs them: inside a CUDA graph (no Python launch costs), after warm-up calls that compile and autotune
    Triton kernels outside the capture. A candidate that fails is logged and left out."""
    timings: dict[str, float] = {}
    for cand, (opts, gemv) in candidates.items():
        try:
            packed = [pack_linears(g, opts, gemv) for g in groups]
            xs = [torch.randn(1, p.spec.k, dtype=dtype, device=device) for p in packed]

            def layer(packed: list[PackedLinear] = packed, xs: list[torch.Tensor] = xs) -> None:
                for p, x in zip(packed, xs, strict=True):
                    linear_decode(p.spec, x, p.tensors)

            timings[cand] = round(time_in_cuda_graph(layer, device, reps=10, replays=5, warmups=3), 2)
        except Exception as exc:  # noqa: BLE001 - a candidate that cannot run is simply not chosen
            log.warning("kernel %s unavailable: %s", cand, exc)
    return timings


def pick_prefill_gemm(decoder: Any) -> dict[int, dict[str, float]]:
    """FastDecoder at start-up (CUDA, NF4 layers, bf16, Triton): time the first layer's NF4 linears, as the prefill
    runs them part by part, with nf4_gemm and with dequantize + matmul inside CUDA graphs at PICK_ROWS rows, after
    checking nf4_gemm's output against dequantize + matmul; set every NF4 LinSpec's prefill_gemm_max to
    gemm_rows_limit and rebuild the layer functions when it is above 0. Returns the timings (µs per layer's NF4
    linears), {} where nothing was timed; says what it chose in decoder.notes."""
    spec = decoder._layer_specs[0]
    nf4 = [i for i, s in enumerate(spec.linears) if s.fmt == "nf4" and s.levels]
    if not nf4 or decoder.dtype != torch.bfloat16 or decoder.device.type != "cuda" or triton is None:
        return {}
    lins = _split_linears(spec, decoder._layer_weights[0])
    trial = {i: replace(spec.linears[i], prefill_gemm_max=ALL_ROWS) for i in nf4}
    try:
        worst = 0.0
        for i in nf4:
            x = torch.randn(PICK_ROWS[0], spec.linears[i].k, dtype=torch.bfloat16, device=decoder.device)
            got = torch.cat(linear_prefill_parts(trial[i], x, lins[i]), dim=-1).float()
            ref = torch.cat(linear_prefill_parts(spec.linears[i], x, lins[i]), dim=-1).float()
            worst = max(worst, float((got - ref).norm() / ref.norm().clamp_min(1e-6)))
        if worst >= MAX_REL_ERROR:
            decoder.notes.append(f"prefill NF4 GEMM off: relative error {worst:.3f} vs dequantize + matmul")
            return {}
        timings: dict[int, dict[str, float]] = {}
        for rows in PICK_ROWS:
            xs = {i: torch.randn(rows, spec.linears[i].k, dtype=torch.bfloat16, device=decoder.device) for i in nf4}
            timings[rows] = {}
            for name, specs in (("gemm", trial), ("dequant", {i: spec.linears[i] for i in nf4})):
                def run(specs: dict[int, Any] = specs, xs: dict[int, torch.Tensor] = xs) -> None:
                    for i in nf4:
                        linear_prefill_parts(specs[i], xs[i], lins[i])

                timings[rows][name] = round(time_in_cuda_graph(run, decoder.device, reps=3, replays=3, warmups=2), 1)
            del xs
    except Exception as exc:  # noqa: BLE001 - dequantize + matmul always works; say why it serves
        log.warning("prefill NF4 GEMM unavailable: %s: %s", type(exc).__name__, exc)
        decoder.notes.append(f"prefill NF4 GEMM off ({type(exc).__name__}: {str(exc)[:120]})")
        return {}
    limit = gemm_rows_limit(timings)
    shown = "; ".join(f"{r} rows gemm {t['gemm']:.0f}, dequant {t['dequant']:.0f} µs" for r, t in timings.items())
    served = "every chunk" if limit == ALL_ROWS else f"chunks up to {limit:,} rows" if limit else "no chunk"
    decoder.notes.append(f"prefill NF4 GEMM for {served} (first layer's NF4 linears: {shown}; relative error "
                         f"{worst:.4f})")
    if limit:
        adopt_prefill_gemm(decoder, limit)
    return timings


def adopt_prefill_gemm(decoder: Any, limit: int) -> None:
    """Every NF4 linear of every layer takes nf4_gemm up to `limit` prompt rows; the layer functions are rebuilt
    (one compiled function per distinct layer spec, as before)."""
    distinct: dict[Any, Any] = {}
    specs = []
    for spec in decoder._layer_specs:
        linears = tuple(replace(s, prefill_gemm_max=limit) if s.fmt == "nf4" else s for s in spec.linears)
        new = replace(spec, linears=linears)
        specs.append(distinct.setdefault(new, new))
    decoder._layer_specs = specs
    decoder._make_functions()
