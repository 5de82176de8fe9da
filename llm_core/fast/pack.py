"""pack_weights: the model's linears as the decode step reads them; q/k/v and gate/up fused, read in place."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from .kernels.nf4_mm import mm_counters
from .options import FastDecodeOptions
from .support import Unsupported, int8_row_scale, is_dense_linear, is_int8_linear, is_int8_table, is_nf4_linear

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LinSpec:
    """Static description of one (possibly fused) linear; its tensors travel separately, in this order:
    dense: (w,) | nf4 absmax=fp32: (packed, absmax) | nf4 absmax=nested: (packed, q8, absmax2, offsets, code2,
    offset_scalar); then code and the small-M kernel's split counters (nf4: nf4_mm.mm_counters), then with `frag`
    the fragment-order codes, their level table and scale pairs (nf4_frag.repack, frag_table, scale_pairs), then bias
    if any."""

    fmt: str  # dense | nf4 | int8 (tensors: (w int8, row scale fp32 = SCB / 127))
    absmax: str  # none | fp32 | nested
    n: int
    k: int
    blocksize: int
    splits: tuple[int, ...]
    bias: bool
    gemv: str  # dense | dense-triton | int8 | bnb | nf4 | torch (the reference formula)
    uniform_offset: bool  # nested with one offset (what bitsandbytes' own kernel can read)
    levels: tuple[float, ...] = ()  # the 16 NF4 levels on the host (llm_core.nf4_gemv builds its kernel from them)
    # nf4: prompt chunks up to this many rows prefilled by llm_core.nf4_gemm, longer ones (and 0: all) by
    # dequantize + matmul (the start-up pick: llm_core.fast.prefill_gemm)
    prefill_gemm_max: int = 0
    # its decode kernel (llm_core.nf4_gemv, nf4_mm) launched as a programmatic dependent launch (FastDecodeOptions.
    # launch_overlap; llm_core.fast.kernels.pdl)
    pdl: bool = False
    # with pdl: its 4-bit kernel prefetches its first weight tile before the wait (LAUNCH_OVERLAP=early)
    early: bool = False
    # gemv nf4: the decode step hands its kernel the activations in planes (GEMV_INPUT=planar; nf4_gemv.planar_pairs)
    planar: bool = False
    # nf4: its codes also in mma fragment order, with the level table and the bf16 scale pairs, after the counters
    # (NF4_FRAG=on; llm_core.nf4_frag: the batched step's rows kernel "frag")
    frag: bool = False


@dataclass
class PackedLinear:
    spec: LinSpec
    tensors: list[torch.Tensor]
    note: str = ""

    @property
    def nbytes(self) -> int:
        seen: set[int] = set()
        total = 0
        for t in self.tensors:
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
        return total


def _nf4_parts(module: Any) -> dict[str, Any]:
    """The NF4 tensors of a bitsandbytes Linear4bit, as views of its own storage (no copy)."""
    module.support_avx512bf16_for_cpu = False  # keep bnb's generic layout on CPU (its AVX repack is lossy)
    weight, qs = module.weight, module.weight.quant_state
    if getattr(qs, "packing_format_for_cpu", False):
        from bitsandbytes.functional import _convert_weight_packed_for_cpu_inverse

        log.info("Linear4bit weights were repacked for CPU; restoring the generic layout (absmax requantized).")
        weight.data, qs = _convert_weight_packed_for_cpu_inverse(weight.data, qs)
        weight.quant_state = module.quant_state = qs
    n, k = int(qs.shape[0]), int(qs.shape[1])
    packed = weight.data.view(torch.uint8).reshape(n, k // 2)
    parts: dict[str, Any] = {"n": n, "k": k, "blocksize": int(qs.blocksize), "packed": packed,
                             "code": qs.code.float(), "bias": module.bias}
    if qs.nested:
        nb = n * k // qs.blocksize
        nb2 = qs.state2.absmax.numel()
        offset = qs.offset.float().reshape(())
        parts.update(q8=qs.absmax.view(-1), absmax2=qs.state2.absmax.float().view(-1),
                     code2=qs.state2.code.float(), offset_scalar=offset, offsets=offset.repeat(nb2), nb=nb)
        assert qs.state2.blocksize == 256, "bitsandbytes nests absmax in blocks of 256"
    else:
        parts.update(absmax=qs.absmax.float().view(n, k // qs.blocksize))
    return parts


def nested_absmax_fp32(q8: torch.Tensor, absmax2: torch.Tensor, offsets: torch.Tensor, code2: torch.Tensor
                    ) -> torch.Tensor:
    """Exact dequantization of double-quantized absmax: code2[q8] * absmax2[block] + offset[block] (fp32, flat)."""
    codes = code2[q8.to(torch.int32)]
    if q8.numel() % 256 == 0:  # every second-level block full: one multiply-add per 256-row
        return torch.addcmul(offsets[:, None], codes.view(-1, 256), absmax2[:, None]).view(-1)
    idx = torch.arange(q8.numel(), device=q8.device) // 256
    return codes * absmax2[idx] + offsets[idx]


def _parts_absmax_fp32(p: dict[str, Any]) -> torch.Tensor:
    if "absmax" in p:
        return p["absmax"].reshape(-1)
    return nested_absmax_fp32(p["q8"], p["absmax2"], p["offsets"], p["code2"])


def pack_linears(modules: Sequence[Any], opts: FastDecodeOptions, gemv: str, planar_input: bool = False
                 ) -> PackedLinear:
    """One linear from one module, or a fused one from several sharing the input (rows concatenated). `gemv` is
    the 4-bit kernel; unquantized weights use opts.dense_gemv, int8 ones llm_core.dense_gemv with row scales. Its
    decode kernel is a programmatic dependent launch where opts.launch_overlap resolved to "on" or "early".
    `planar_input`: the op before it is one of inductor's, which can write the activations in planes for free, so
    with opts.gemv_input "planar" an NF4 kernel reads them so."""
    packed = _pack_linears(modules, opts, gemv)
    if opts.overlaps:
        packed.spec = replace(packed.spec, pdl=True, early=opts.launch_overlap == "early")
    if planar_input and opts.gemv_input == "planar" and packed.spec.gemv == "nf4":
        packed.spec = replace(packed.spec, planar=True)
        packed.note = packed.note or "NF4 one-token kernel reads its activations in planes (GEMV_INPUT=planar)"
    if opts.nf4_frag == "on" and packed.spec.fmt == "nf4" and packed.spec.levels:
        _add_fragment_order(packed)
    return packed


def frag_copy_bytes(model: Any) -> int:
    """The device bytes NF4_FRAG adds to `model` before it is packed (what _add_fragment_order makes): for each NF4
    linear the kernel tiles, its 4-bit codes once more (N K / 2), a bf16 scale pair per 16-row tile and block (2
    bytes a block) and the level table (64 bytes). Fused projections are counted part by part."""
    from .kernels.nf4_frag import copy_bytes

    states = [m.weight.quant_state for m in model.modules() if is_nf4_linear(m)]
    return sum(copy_bytes(int(qs.shape[0]), int(qs.shape[1]), int(qs.blocksize)) for qs in states)


def _add_fragment_order(packed: PackedLinear) -> None:
    """NF4_FRAG=on: the linear's codes repacked into mma fragment order, the level table and the bf16 scale pairs
    (llm_core.nf4_frag), inserted before the bias; counted with the weights (PackedLinear.nbytes). Shapes the
    kernel cannot tile (N not a multiple of 16, K or the blocksize not of 64) keep nf4_mm."""
    from .kernels import nf4_frag

    s, ts = packed.spec, packed.tensors
    if not nf4_frag.tiles_shape(s.n, s.k, s.blocksize):
        return
    extra = [nf4_frag.repack(ts[0]), nf4_frag.frag_table(s.levels, ts[0].device),
             nf4_frag.scale_pairs(absmax_2d(s, ts), s.n, s.k, s.blocksize)]
    at = len(ts) - int(s.bias)
    packed.tensors = [*ts[:at], *extra, *ts[at:]]
    packed.spec = replace(s, frag=True)


def _pack_linears(modules: Sequence[Any], opts: FastDecodeOptions, gemv: str) -> PackedLinear:
    splits = tuple(int(m.out_features) for m in modules)
    if any(is_int8_table(m) for m in modules):  # the int8 lm_head: its table's tensors, read in place
        if len(modules) != 1:
            raise Unsupported("an int8 token table is not fused with other linears")
        q, scale = modules[0].table.q, modules[0].table.scale
        return PackedLinear(LinSpec("int8", "none", int(q.shape[0]), int(q.shape[1]), 0, splits, False, "int8",
                                    False), [q, scale])
    dense, int8 = all(is_dense_linear(m) for m in modules), all(is_int8_linear(m) for m in modules)
    if dense or int8:
        weights = [m.weight.data for m in modules]
        if len(modules) == 1:
            w = weights[0].detach()
        else:
            w = torch.cat([t.detach() for t in weights], 0)
            _rebind_dense(modules, w)
        tensors = [w]
        if int8:
            tensors.append(torch.cat([int8_row_scale(m) for m in modules]))
        has_bias = any(m.bias is not None for m in modules)
        if has_bias:
            dtype = next(m.bias.dtype for m in modules if m.bias is not None)
            tensors.append(torch.cat([m.bias.detach() if m.bias is not None else
                                      torch.zeros(s, dtype=dtype, device=w.device)
                                      for m, s in zip(modules, splits, strict=True)]))
        kernel = "int8" if int8 else "dense-triton" if opts.dense_gemv == "triton" else "dense"
        spec = LinSpec("int8" if int8 else "dense", "none", int(w.shape[0]), int(w.shape[1]), 0, splits, has_bias,
                        kernel, False)
        return PackedLinear(spec, tensors)
    if not all(is_nf4_linear(m) for m in modules):
        raise Unsupported("a fused projection mixes quantized and plain weights")
    parts = [_nf4_parts(m) for m in modules]
    k, bs = parts[0]["k"], parts[0]["blocksize"]
    if any(p["k"] != k or p["blocksize"] != bs for p in parts):
        raise Unsupported("fused projections differ in input size or block size")
    n = sum(p["n"] for p in parts)
    nested_all = all("q8" in p for p in parts)
    note = ""
    if len(parts) == 1:
        packed = parts[0]["packed"]
    else:
        packed = torch.cat([p["packed"] for p in parts], 0)
        _rebind_nf4(modules, packed)
    mode = opts.absmax
    if mode == "keep" and nested_all and len(parts) > 1 and any(p["nb"] % 256 for p in parts[:-1]):
        mode, note = "fp32", "nested absmax not 256-aligned across fused parts: dequantized to fp32 (exact)"
    if mode == "keep" and not nested_all:
        mode = "fp32"
    if gemv == "bnb" and mode == "keep" and len(parts) > 1:
        mode, note = "requant", "bitsandbytes' kernel reads one absmax offset: fused absmax requantized"
    code = parts[0]["code"]
    levels = tuple(float(v) for v in code.tolist())
    bias_list = [p["bias"] for p in parts]
    has_bias = any(b is not None for b in bias_list)
    # the split counters nf4_mm needs to sum its K splits inside one launch, one buffer per linear (so the decode
    # steps of two engines on one GPU never share one): ~N / 16 int32, counted with the weights
    tail: list[torch.Tensor] = [code, mm_counters(n, code.device)]
    if has_bias:
        dtype = next(b for b in bias_list if b is not None).dtype
        tail.append(torch.cat([b.detach() if b is not None else torch.zeros(p["n"], dtype=dtype, device=code.device)
                               for b, p in zip(bias_list, parts, strict=True)]))
    if mode == "fp32":
        absmax = torch.cat([_parts_absmax_fp32(p) for p in parts]).view(n, k // bs)
        spec = LinSpec("nf4", "fp32", n, k, bs, splits, has_bias, gemv, False, levels)
        return PackedLinear(spec, [packed, absmax, *tail], note)
    if mode == "requant":
        from bitsandbytes.functional import quantize_blockwise

        absmax = torch.cat([_parts_absmax_fp32(p) for p in parts])
        offset = absmax.mean()
        q8, state2 = quantize_blockwise(absmax - offset, blocksize=256)
        nb2 = state2.absmax.numel()
        tensors = [packed, q8.view(-1), state2.absmax.float(), offset.repeat(nb2), state2.code.float(),
                   offset.reshape(())]
        spec = LinSpec("nf4", "nested", n, k, bs, splits, has_bias, gemv, True, levels)
        return PackedLinear(spec, [*tensors, *tail], note or "absmax requantized after fusing")
    # keep: exact nested absmax; fused parts are 256-aligned so each keeps its own second-level scale and offset
    q8 = parts[0]["q8"] if len(parts) == 1 else torch.cat([p["q8"] for p in parts])
    absmax2 = parts[0]["absmax2"] if len(parts) == 1 else torch.cat([p["absmax2"] for p in parts])
    offsets = parts[0]["offsets"] if len(parts) == 1 else torch.cat([p["offsets"] for p in parts])
    if len(parts) > 1:
        _rebind_nested_absmax(modules, q8, absmax2)
    uniform = len(parts) == 1
    spec = LinSpec("nf4", "nested", n, k, bs, splits, has_bias, gemv, uniform, levels)
    return PackedLinear(spec, [packed, q8, absmax2, offsets, parts[0]["code2"], parts[0]["offset_scalar"], *tail], note)


def _rebind_dense(modules: Sequence[Any], fused: torch.Tensor) -> None:
    """Point each module's weight at its rows of the fused tensor, so the plain path shares the bytes (int8 layers:
    also the copies bitsandbytes' matmul reads, weight.CB before the first forward and state.CB after it)."""
    start = 0
    for m in modules:
        rows = m.weight.shape[0]
        part = fused[start:start + rows]
        m.weight.data = part
        if is_int8_linear(m):
            if getattr(m.weight, "CB", None) is not None:
                m.weight.CB = part
            if getattr(m.state, "CB", None) is not None:
                m.state.CB = part
        start += rows


def _rebind_nf4(modules: Sequence[Any], fused_packed: torch.Tensor) -> None:
    start = 0
    for m in modules:
        rows = int(m.weight.quant_state.shape[0])
        storage_dtype = m.weight.data.dtype
        m.weight.data = fused_packed[start:start + rows].reshape(-1, 1).view(storage_dtype)
        start += rows


def _rebind_nested_absmax(modules: Sequence[Any], q8: torch.Tensor, absmax2: torch.Tensor) -> None:
    """Point each module's double-quantized block scales (quant_state.absmax, and state2.absmax where it is already
    fp32) at its slice of the fused copies, so they are held once, not twice (Llama-3-8B: ~70 MB of 8-bit scales)."""
    q8_start = a2_start = 0
    for m in modules:
        qs = m.weight.quant_state
        nb, nb2 = qs.absmax.numel(), qs.state2.absmax.numel()
        if qs.absmax.dtype == q8.dtype:
            qs.absmax = q8[q8_start:q8_start + nb].view(qs.absmax.shape)
        if qs.state2.absmax.dtype == absmax2.dtype:
            qs.state2.absmax = absmax2[a2_start:a2_start + nb2].view(qs.state2.absmax.shape)
        q8_start, a2_start = q8_start + nb, a2_start + nb2


# --- kernels -------------------------------------------------------------------------------------------------


def absmax_2d(spec: LinSpec, ts: Sequence[torch.Tensor]) -> torch.Tensor:
    """(n, k / blocksize) fp32 block scales, dequantized from the nested form where needed."""
    if spec.absmax == "fp32":
        return ts[1]
    return nested_absmax_fp32(ts[1], ts[2], ts[3], ts[4]).view(spec.n, spec.k // spec.blocksize)


def code_of(spec: LinSpec, ts: Sequence[torch.Tensor]) -> torch.Tensor:
    return ts[2] if spec.absmax == "fp32" else ts[6]


def counters_of(spec: LinSpec, ts: Sequence[torch.Tensor]) -> torch.Tensor:
    """An NF4 linear's split counters for nf4_mm (LinSpec's tensor order)."""
    return ts[3] if spec.absmax == "fp32" else ts[7]


def frag_of(spec: LinSpec, ts: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An NF4 linear's fragment-order codes, level table and scale pairs (LinSpec.frag; LinSpec's tensor order)."""
    if not spec.frag:
        raise ValueError("this linear has no fragment-order codes (NF4_FRAG=off or a shape nf4_frag cannot tile)")
    at = 4 if spec.absmax == "fp32" else 8
    return ts[at], ts[at + 1], ts[at + 2]


def bias_of(spec: LinSpec, ts: Sequence[torch.Tensor]) -> torch.Tensor | None:
    return ts[-1] if spec.bias else None
