"""Fast decode path: a static KV cache and a compiled decode step replayed as CUDA graphs; knows nothing of chat.

It takes a `LoadedModel` and token ids, never text, settings files or the UI. The pipeline, named gpt-fast style:
`pack_weights -> prefill -> decode_step -> select -> stream`.

- pack_weights: the model's own tensors, read in place (no copy) from transformers modules; q/k/v and gate/up
  are fused into one linear each by concatenating their rows. For bitsandbytes NF4 the packed 4-bit data is
  concatenated exactly (blocks never straddle rows) and the transformers modules are re-pointed at views of the
  fused storage, so the plain path keeps working on the same bytes and memory is not doubled. Double-quantized
  absmax is kept exactly (per-256-block scale and offset) or, for bitsandbytes' kernel, requantized once.
- prefill: one pass over the prompt (SDPA causal attention), writes K/V into the static cache; on CUDA each
  layer is compiled with the prompt length dynamic (one compile for every length), eager if that fails.
- decode_step: a hand-written llama-family layer (RMSNorm, RoPE, cache write, attention, SwiGLU) compiled once
  with torch.compile(fullgraph=True), the attended length dynamic, then captured as one CUDA graph per length
  bucket at warm-up. Attention is a Triton split-K kernel that reads cache rows up to the live position only.
  Replaying a graph launches every kernel of all layers with no Python and no host sync.
- select: repetition penalty, min-new-tokens and greedy argmax run inside the graph; sampling (temperature, top-k,
  top-p, multinomial) runs eagerly on the device right after the replay, with a per-request generator.
- stream: each new token is copied into pinned host memory with an event; the host reads token i after it has
  queued step i+1 (a one-step lag), so the GPU never waits for Python and Stop halts after at most one step.

On CPU the same code runs eagerly (no compile, no graphs): that is what the token-equality test exercises.
"""

from __future__ import annotations

import bisect
import contextlib
import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from .config import DEFAULT_PREFILL_GRAPH_TOKENS, GenerationSettings
from .dense_gemv import AVAILABLE as _DENSE_KERNEL_AVAILABLE  # registers torch.ops.llm_core.dense_gemv
from .errors import GenerationError, OutOfMemoryError
from .loading import LoadedModel
from .nf4_gemv import AVAILABLE as _NF4_KERNEL_AVAILABLE  # importing it registers torch.ops.llm_core.nf4_gemv

log = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
UNSUPPORTED_ROPE_TYPES = ("dynamic", "longrope")  # they change inv_freq with the sequence length at run time
GEMV_KERNELS = ("bnb", "nf4", "torch")
DENSE_GEMV_KERNELS = ("cublas", "triton", "reduce")
ABSMAX_MODES = ("keep", "fp32", "requant")
MIN_BUCKET_TOKENS = 256
PREFILL_BUCKET_TOKENS = 64  # padded prefill lengths: multiples of this (FastDecodeOptions.prefill_graph_tokens)


# --- support -------------------------------------------------------------------------------------------------


def fast_path_support(loaded: LoadedModel, *, allow_cpu: bool = False) -> tuple[bool, str]:
    """(can run, reason shown in the model panel). False on CPU unless `allow_cpu`, on offloaded models, on
    quantization modes other than nf4/int8/none, and on architectures whose layers this module does not implement."""
    device = loaded.device
    if device.type != "cuda" and not allow_cpu:
        return False, "CPU: the fast path needs CUDA graphs; plain generate is used"
    if loaded.report.offloaded:
        return False, "layers are offloaded to CPU (MAX_MEMORY); the fast path needs every weight on the GPU"
    quant = loaded.settings.quantization
    if quant not in ("nf4", "int8", "none"):
        return False, f"QUANTIZATION={quant} is not supported by the fast path (nf4, int8 or none)"
    try:
        _Arch.from_model(loaded.model)
    except _Unsupported as exc:
        return False, str(exc)
    if device.type == "cuda":
        try:
            from torch.utils._triton import has_triton
        except ImportError:  # pragma: no cover - very old torch
            return False, "this PyTorch cannot report Triton support; torch.compile is unavailable"
        if not has_triton():
            return False, "Triton is not installed, so torch.compile cannot build the decode step"
    kind = {"nf4": "NF4", "int8": "int8 (weight-only)"}.get(quant, str(loaded.compute_dtype).removeprefix("torch."))
    return True, f"static KV cache + compiled {kind} decode step replayed as CUDA graphs"


class _Unsupported(Exception):
    """The model's structure is outside what the fast path implements (message is user-facing)."""


@dataclass
class _Arch:
    """The pieces of a llama-family transformers model the fast path reads (modules, not copies)."""

    model: Any
    embed: Any
    layers: list[Any]
    norm: Any
    rotary: Any
    lm_head: Any
    n_heads: int
    n_kv_heads: int
    head_dim: int
    hidden: int
    vocab: int
    qk_norm: bool

    @classmethod
    def from_model(cls, model: Any) -> _Arch:
        cfg = model.config
        model_type = getattr(cfg, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise _Unsupported(f"model type {model_type!r} is not implemented by the fast path "
                               f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
        layer_types = getattr(cfg, "layer_types", None) or []
        if any(t != "full_attention" for t in layer_types) or (
                getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", model_type == "mistral")):
            raise _Unsupported("sliding-window attention is not implemented by the fast path")
        rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
        rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
        if rope_type in UNSUPPORTED_ROPE_TYPES:
            raise _Unsupported(f"RoPE type {rope_type!r} changes with the sequence length; not supported")
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise _Unsupported(f"activation {cfg.hidden_act!r} is not implemented by the fast path (silu only)")
        inner: Any = getattr(model, "model", None)
        layers = list(getattr(inner, "layers", []) or [])
        if not layers or not all(hasattr(inner, a) for a in ("embed_tokens", "norm", "rotary_emb")):
            raise _Unsupported("the model does not have the llama layout (model.layers, norm, rotary_emb)")
        n_heads = int(cfg.num_attention_heads)
        n_kv = int(getattr(cfg, "num_key_value_heads", None) or n_heads)
        head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads)
        qk_norm = False
        for layer in layers:
            attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
            names = [(attn, "q_proj"), (attn, "k_proj"), (attn, "v_proj"), (attn, "o_proj"),
                     (mlp, "gate_proj"), (mlp, "up_proj"), (mlp, "down_proj"),
                     (layer, "input_layernorm"), (layer, "post_attention_layernorm")]
            if any(getattr(owner, name, None) is None for owner, name in names):
                raise _Unsupported("a decoder layer lacks the llama projections (q/k/v/o, gate/up/down)")
            qk_norm = hasattr(attn, "q_norm")
            for owner, name in names[:7]:
                _check_linear(getattr(owner, name))
        lm_head = model.get_output_embeddings()
        if lm_head is None:
            raise _Unsupported("the model has no output projection (lm_head)")
        _check_linear(lm_head)
        return cls(model, inner.embed_tokens, layers, inner.norm, inner.rotary_emb, lm_head, n_heads, n_kv, head_dim,
                   int(cfg.hidden_size), int(lm_head.weight.shape[0]) if not _is_bnb4(lm_head) else
                   int(lm_head.out_features), qk_norm)


def _is_bnb4(module: Any) -> bool:
    return type(module).__name__ in ("Linear4bit", "LinearNF4", "LinearFP4") and hasattr(module.weight, "quant_state")


def is_int8_linear(module: Any) -> bool:
    """bitsandbytes' LLM.int8 layer holding int8 weights (CB) and per-row scales (SCB)."""
    return type(module).__name__ == "Linear8bitLt" and module.weight.dtype == torch.int8


def _is_dense(module: Any) -> bool:
    return not (_is_bnb4(module) or is_int8_linear(module))


def _int8_scb(module: Any) -> torch.Tensor | None:
    """The per-row absmax of an int8 layer: on the weight until its first forward, then on its matmul state."""
    scb = getattr(module.weight, "SCB", None)
    return scb if scb is not None else getattr(module.state, "SCB", None)


def _int8_row_scale(module: Any) -> torch.Tensor:
    """SCB / 127 in fp32: the factor each int8 row is dequantized with (bitsandbytes' int8_vectorwise_dequant)."""
    scb = _int8_scb(module)
    if scb is None:
        raise _Unsupported("an int8 layer has no row scales (SCB)")
    return scb.float() / 127


def int8_weight_fp32(module: Any) -> torch.Tensor:
    """An LLM.int8 layer's weights as bitsandbytes dequantizes them (CB * SCB / 127), in fp32: what the fast path's
    int8 products compute with (the reference of its accuracy checks)."""
    return module.weight.data.float() * _int8_row_scale(module)[:, None]


def _check_linear(module: Any) -> None:
    if _is_bnb4(module):
        qs = module.weight.quant_state
        if qs is None or qs.quant_type != "nf4":
            raise _Unsupported("only NF4 4-bit weights are implemented by the fast path")
        if module.in_features % qs.blocksize or qs.blocksize % 2:
            raise _Unsupported(f"4-bit block size {qs.blocksize} does not divide the input size {module.in_features}")
        return
    if is_int8_linear(module):
        if module.state.has_fp16_weights or _int8_scb(module) is None or module.weight.dim() != 2:
            raise _Unsupported("int8 layers must hold quantized weights and row scales (inference mode)")
        return
    if not isinstance(module, torch.nn.Linear):
        raise _Unsupported(f"{type(module).__name__} layers are not implemented by the fast path")


# --- options -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FastDecodeOptions:
    """How the decode step is built. Defaults pick the fastest measured choice (see docs/fast_decode.md)."""

    # 4-bit matrix-vector kernel: auto (time bnb and nf4 on the first layer at start-up inside a CUDA graph, keep
    # the faster) | nf4 (llm_core.nf4_gemv: Triton, NF4 table in registers; bf16 activations, CUDA only) | bnb
    # (bitsandbytes' gemm_4bit) | torch (inductor-generated). Two earlier Triton kernels that read the table from
    # L1 (slower than bnb: bench/results/2026-11-30-h200-decode.json, runs 1-2) were removed once nf4 replaced them.
    gemv: str = "auto"
    fuse: bool = True  # q/k/v -> one linear and gate/up -> one linear
    absmax: str = "keep"  # keep: double quant as loaded (read in-kernel) | fp32: double quant off | requant
    attention: str = "auto"  # auto | triton (split-K flash-decoding, reads rows <= pos only) | torch
    # Unquantized weights at one token: auto (time cublas and triton on the first layer at start-up inside a CUDA
    # graph, keep the faster) | cublas (F.linear) | triton (llm_core.dense_gemv: no split-K; CPU runs its torch
    # reference) | reduce (an inductor-generated reduction; slower, kept for the record). int8 weights always take
    # llm_core.dense_gemv (with row scales): cuBLAS has no int8-weight x half-activation product
    dense_gemv: str = "auto"
    # With triton dense weights and fused projections: each layer's two RMSNorms, the SiLU-and-multiply and both
    # residual adds run inside the matrix-vector kernels (llm_core.dense_gemv prologues/epilogue), not as kernels.
    # Off by default: measured slower on an H200 (Llama-2-7B bf16: 248.3 vs 256.6 tok/s; each program redoes the
    # prologue over all of K, which costs more than the ~100 kernels per step it removes; 2026-11-30-h200-decode)
    gemv_prologues: bool = False
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

    def resolved(self, device: torch.device, head_dim: int) -> FastDecodeOptions:
        if self.gemv not in ("auto", *GEMV_KERNELS):
            raise GenerationError(f"Unknown gemv kernel {self.gemv!r}; choose one of {', '.join(GEMV_KERNELS)}.")
        if self.dense_gemv not in ("auto", *DENSE_GEMV_KERNELS):
            raise GenerationError(f"Unknown dense gemv {self.dense_gemv!r}; choose one of "
                                  f"{', '.join(DENSE_GEMV_KERNELS)}.")
        if self.prefill_attention not in ("flash", "auto"):
            raise GenerationError(f"Unknown prefill attention {self.prefill_attention!r}; choose flash or auto.")
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
        return replace(self, gemv=gemv, attention=attention, dense_gemv=dense)


def _triton_interpreter() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


# --- packed linears ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _LinSpec:
    """Static description of one (possibly fused) linear; its tensors travel separately, in this order:
    dense: (w,) | nf4 absmax=fp32: (packed, absmax) | nf4 absmax=nested: (packed, q8, absmax2, offsets, code2,
    offset_scalar); then code (nf4), then bias if any."""

    fmt: str  # dense | nf4 | int8 (tensors: (w int8, row scale fp32 = SCB / 127))
    absmax: str  # none | fp32 | nested
    n: int
    k: int
    blocksize: int
    splits: tuple[int, ...]
    bias: bool
    gemv: str  # dense | dense-reduce | dense-triton | int8 | bnb | nf4 | torch
    uniform_offset: bool  # nested with one offset (what bitsandbytes' own kernel can read)
    levels: tuple[float, ...] = ()  # the 16 NF4 levels on the host (llm_core.nf4_gemv builds its kernel from them)


@dataclass
class _Packed:
    spec: _LinSpec
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


def _nested_to_fp32(q8: torch.Tensor, absmax2: torch.Tensor, offsets: torch.Tensor, code2: torch.Tensor
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
    return _nested_to_fp32(p["q8"], p["absmax2"], p["offsets"], p["code2"])


def _pack_linears(modules: Sequence[Any], opts: FastDecodeOptions, gemv: str) -> _Packed:
    """One linear from one module, or a fused one from several sharing the input (rows concatenated). `gemv` is
    the 4-bit kernel; unquantized weights use opts.dense_gemv, int8 ones llm_core.dense_gemv with row scales."""
    splits = tuple(int(m.out_features) for m in modules)
    dense, int8 = all(_is_dense(m) for m in modules), all(is_int8_linear(m) for m in modules)
    if dense or int8:
        weights = [m.weight.data for m in modules]
        if len(modules) == 1:
            w = weights[0].detach()
        else:
            w = torch.cat([t.detach() for t in weights], 0)
            _rebind_dense(modules, w)
        tensors = [w]
        if int8:
            tensors.append(torch.cat([_int8_row_scale(m) for m in modules]))
        has_bias = any(m.bias is not None for m in modules)
        if has_bias:
            dtype = next(m.bias.dtype for m in modules if m.bias is not None)
            tensors.append(torch.cat([m.bias.detach() if m.bias is not None else
                                      torch.zeros(s, dtype=dtype, device=w.device)
                                      for m, s in zip(modules, splits, strict=True)]))
        kernel = "int8" if int8 else {"reduce": "dense-reduce", "triton": "dense-triton"}.get(opts.dense_gemv, "dense")
        spec = _LinSpec("int8" if int8 else "dense", "none", int(w.shape[0]), int(w.shape[1]), 0, splits, has_bias,
                        kernel, False)
        return _Packed(spec, tensors)
    if not all(_is_bnb4(m) for m in modules):
        raise _Unsupported("a fused projection mixes quantized and plain weights")
    parts = [_nf4_parts(m) for m in modules]
    k, bs = parts[0]["k"], parts[0]["blocksize"]
    if any(p["k"] != k or p["blocksize"] != bs for p in parts):
        raise _Unsupported("fused projections differ in input size or block size")
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
    tail: list[torch.Tensor] = [code]
    if has_bias:
        dtype = next(b for b in bias_list if b is not None).dtype
        tail.append(torch.cat([b.detach() if b is not None else torch.zeros(p["n"], dtype=dtype, device=code.device)
                               for b, p in zip(bias_list, parts, strict=True)]))
    if mode == "fp32":
        absmax = torch.cat([_parts_absmax_fp32(p) for p in parts]).view(n, k // bs)
        spec = _LinSpec("nf4", "fp32", n, k, bs, splits, has_bias, gemv, False, levels)
        return _Packed(spec, [packed, absmax, *tail], note)
    if mode == "requant":
        from bitsandbytes.functional import quantize_blockwise

        absmax = torch.cat([_parts_absmax_fp32(p) for p in parts])
        offset = absmax.mean()
        q8, state2 = quantize_blockwise(absmax - offset, blocksize=256)
        nb2 = state2.absmax.numel()
        tensors = [packed, q8.view(-1), state2.absmax.float(), offset.repeat(nb2), state2.code.float(),
                   offset.reshape(())]
        spec = _LinSpec("nf4", "nested", n, k, bs, splits, has_bias, gemv, True, levels)
        return _Packed(spec, [*tensors, *tail], note or "absmax requantized after fusing")
    # keep: exact nested absmax; fused parts are 256-aligned so each keeps its own second-level scale and offset
    q8 = parts[0]["q8"] if len(parts) == 1 else torch.cat([p["q8"] for p in parts])
    absmax2 = parts[0]["absmax2"] if len(parts) == 1 else torch.cat([p["absmax2"] for p in parts])
    offsets = parts[0]["offsets"] if len(parts) == 1 else torch.cat([p["offsets"] for p in parts])
    uniform = len(parts) == 1
    spec = _LinSpec("nf4", "nested", n, k, bs, splits, has_bias, gemv, uniform, levels)
    return _Packed(spec, [packed, q8, absmax2, offsets, parts[0]["code2"], parts[0]["offset_scalar"], *tail], note)


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


# --- kernels -------------------------------------------------------------------------------------------------


def _absmax_2d(spec: _LinSpec, ts: Sequence[torch.Tensor]) -> torch.Tensor:
    """(n, k / blocksize) fp32 block scales, dequantized from the nested form where needed."""
    if spec.absmax == "fp32":
        return ts[1]
    return _nested_to_fp32(ts[1], ts[2], ts[3], ts[4]).view(spec.n, spec.k // spec.blocksize)


def _code(spec: _LinSpec, ts: Sequence[torch.Tensor]) -> torch.Tensor:
    return ts[2] if spec.absmax == "fp32" else ts[6]


def _bias(spec: _LinSpec, ts: Sequence[torch.Tensor]) -> torch.Tensor | None:
    return ts[-1] if spec.bias else None


def nf4_matvec_torch(x: torch.Tensor, packed: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ W.T for one row x (1, K) and NF4 weights W (N, K), in torch ops that inductor fuses into a single
    reduction kernel: packed (N, K/2) uint8 (high nibble first), absmax (N, K/blocksize) fp32, code (16,) fp32."""
    n, k2 = packed.shape
    nblk = absmax.shape[1]
    per = k2 // nblk  # bytes per block
    p = packed.view(n, nblk, per)
    xf = x.float().view(nblk, per, 2)
    hi = code[(p >> 4).to(torch.int32)]
    lo = code[(p & 15).to(torch.int32)]
    y = ((hi * xf[:, :, 0] + lo * xf[:, :, 1]) * absmax[:, :, None]).sum(dim=(1, 2))
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).view(1, n)


try:  # the decode attention kernel needs Triton (shipped with CUDA builds of PyTorch); CPU-only installs skip it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

if triton is not None:

    @triton.jit
    def _attn_split_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, o_ptr, m_ptr, l_ptr, scale, chunk, stride_l, stride_h,
                           HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
                           BLOCK_L: tl.constexpr, IEEE: tl.constexpr):
        """Flash-decoding, step 1: program (kv head h, split s) attends the G query heads of h to cache rows
        [s*chunk, min((s+1)*chunk, pos+1)); writes unnormalized output, running max and sum. Rows after pos are
        never read, whatever the captured bucket length."""
        h = tl.program_id(0)
        sp = tl.program_id(1)
        length = tl.load(pos_ptr).to(tl.int32) + 1
        gi = tl.arange(0, GP)
        d = tl.arange(0, D)
        qmask = gi < G
        q = tl.load(q_ptr + (h * G + gi)[:, None] * D + d[None, :], mask=qmask[:, None], other=0.0)
        m_i = tl.full((GP,), float("-inf"), tl.float32)
        l_i = tl.zeros((GP,), tl.float32)
        acc = tl.zeros((GP, D), tl.float32)
        start = sp * chunk
        end = tl.minimum(start + chunk, length)
        for off in range(start, end, BLOCK_L):
            li = off + tl.arange(0, BLOCK_L)
            lmask = li < end
            kv = li[:, None] * stride_l + h * stride_h + d[None, :]
            k = tl.load(k_ptr + kv, mask=lmask[:, None], other=0.0)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = tl.where(lmask[None, :], s * scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(v_ptr + kv, mask=lmask[:, None], other=0.0)
            if IEEE:
                pv = tl.dot(p, v, input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        row = sp * (HKV * G) + h * G + gi
        tl.store(o_ptr + row[:, None] * D + d[None, :], acc, mask=qmask[:, None])
        tl.store(m_ptr + row, m_i, mask=qmask)
        tl.store(l_ptr + row, l_i, mask=qmask)

    @triton.jit
    def _attn_combine_kernel(o_ptr, m_ptr, l_ptr, out_ptr, nsplit, HQ: tl.constexpr, D: tl.constexpr,
                             SP: tl.constexpr):
        """Flash-decoding, step 2: merge the splits of one query head (log-sum-exp weights)."""
        r = tl.program_id(0)
        sp = tl.arange(0, SP)
        smask = sp < nsplit
        m = tl.load(m_ptr + sp * HQ + r, mask=smask, other=float("-inf"))
        lsum = tl.load(l_ptr + sp * HQ + r, mask=smask, other=0.0)
        w = tl.exp(m - tl.max(m, axis=0))
        d = tl.arange(0, D)
        o = tl.load(o_ptr + (sp[:, None] * HQ + r) * D + d[None, :], mask=smask[:, None], other=0.0)
        out = tl.sum(o * w[:, None], axis=0) / tl.sum(lsum * w, axis=0)
        tl.store(out_ptr + r * D + d, out.to(out_ptr.dtype.element_ty))

    @torch.library.custom_op("llm_core::decode_attention", mutates_args=(),
                             schema="(Tensor q, Tensor k, Tensor v, Tensor pos, float scale) -> Tensor")
    def _decode_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor,
                             scale: float) -> torch.Tensor:
        length, hkv, dim = k.shape
        hq = q.shape[0]
        chunk, nsplit = _attention_splits(length, hkv, k.device)
        o = torch.empty(nsplit, hq, dim, dtype=torch.float32, device=q.device)
        m = torch.empty(nsplit, hq, dtype=torch.float32, device=q.device)
        lsum = torch.empty(nsplit, hq, dtype=torch.float32, device=q.device)
        groups = hq // hkv
        if k.stride() != v.stride() or k.stride(2) != 1:
            raise GenerationError("decode attention expects K and V caches laid out alike, head_dim contiguous")
        _attn_split_kernel[(hkv, nsplit)](q.contiguous(), k, v, pos, o, m, lsum, scale, chunk, k.stride(0), k.stride(1),
                                          HKV=hkv, G=groups,
                                          GP=max(16, triton.next_power_of_2(groups)), D=dim,
                                          BLOCK_L=ATTENTION_BLOCK, IEEE=q.dtype == torch.float32)
        out = torch.empty(hq, dim, dtype=q.dtype, device=q.device)
        _attn_combine_kernel[(hq,)](o, m, lsum, out, nsplit, HQ=hq, D=dim, SP=triton.next_power_of_2(nsplit))
        return out

    @_decode_attention_op.register_fake
    def _(q: torch.Tensor, *args: Any) -> torch.Tensor:
        return torch.empty_like(q)


ATTENTION_BLOCK = 64  # cache rows per inner step of the Triton decode attention


def time_in_cuda_graph(fn: Callable[[], Any], device: torch.device | None = None, *, reps: int = 1,
                       replays: int = 20, warmups: int = 1) -> float:
    """Microseconds per call of `fn` as a decode step runs it: called `warmups` times eagerly (compile, autotune),
    then `reps` times captured in one CUDA graph, replayed once, then timed over `replays` replays. Python launch
    costs don't count. Used by the 4-bit kernel pick and the kernel benchmark."""
    for _ in range(warmups):
        fn()
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize(device)
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    stop.record()
    stop.synchronize()
    return start.elapsed_time(stop) * 1e3 / (replays * reps)


def _attention_splits(length: int, kv_heads: int, device: torch.device) -> tuple[int, int]:
    """(rows per split, splits) so that kv_heads * splits is about 4 programs per SM (fixed per bucket length)."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8
    target = max(1, -(-4 * sms // kv_heads))
    chunk = max(ATTENTION_BLOCK, _round_up(-(-length // target), ATTENTION_BLOCK))
    return chunk, -(-length // chunk)


def _linear_decode(spec: _LinSpec, x: torch.Tensor, ts: Sequence[torch.Tensor]) -> torch.Tensor:
    """x (1, K) -> (1, N) in the decode step."""
    if spec.fmt == "int8" or spec.gemv == "dense-triton":
        return _dense_gemv(spec, x, ts)
    if spec.fmt == "dense":
        if spec.gemv == "dense-reduce":  # one fused reduction kernel per linear (fp32 accumulate), not cuBLAS
            bias = _bias(spec, ts)
            y = (ts[0].float() * x.float()).sum(-1)
            return (y if bias is None else y + bias.float()).to(x.dtype).view(1, -1)
        return F.linear(x, ts[0], _bias(spec, ts))
    if spec.gemv == "bnb":
        packed = ts[0].view(-1, 1)
        if spec.absmax == "fp32":
            return torch.ops.bitsandbytes.gemm_4bit(x, packed, [spec.n, spec.k], ts[1].view(-1), spec.blocksize,
                                                    "nf4", _bias(spec, ts))
        if not spec.uniform_offset:
            return torch.ops.bitsandbytes.gemm_4bit(x, packed, [spec.n, spec.k], _absmax_2d(spec, ts).view(-1),
                                                    spec.blocksize, "nf4", _bias(spec, ts))
        return torch.ops.bitsandbytes.gemm_4bit(x, packed, [spec.n, spec.k], ts[2], spec.blocksize, "nf4",
                                                _bias(spec, ts), ts[1], ts[4], ts[5])
    if spec.gemv == "nf4":  # llm_core.nf4_gemv: NF4 table in registers, nested absmax read in place
        if spec.absmax == "fp32":
            return torch.ops.llm_core.nf4_gemv(x, ts[0], ts[1], ts[1], ts[1], ts[1], ts[1], _bias(spec, ts),
                                               spec.blocksize, False, list(spec.levels))
        return torch.ops.llm_core.nf4_gemv(x, ts[0], ts[1], ts[1], ts[2], ts[3], ts[4], _bias(spec, ts),
                                           spec.blocksize, True, list(spec.levels))
    return nf4_matvec_torch(x, ts[0], _absmax_2d(spec, ts), _code(spec, ts), _bias(spec, ts))


def _linear_prefill(spec: _LinSpec, x: torch.Tensor, ts: Sequence[torch.Tensor]) -> torch.Tensor:
    """x (..., K) -> (..., N) for many rows: dequantize once, then a dense matmul (what bitsandbytes does for 4-bit
    weights; for int8 it quantizes the activations instead, LLM.int8, which the fast path does not)."""
    if spec.fmt == "dense":
        return F.linear(x, ts[0], _bias(spec, ts))
    if spec.fmt == "int8":  # compiled: one kernel writes the scaled half-precision copy
        return F.linear(x, (ts[0].float() * ts[1][:, None]).to(x.dtype), _bias(spec, ts))
    absmax = _absmax_2d(spec, ts).reshape(-1)
    w = torch.ops.bitsandbytes.dequantize_4bit(ts[0].view(-1, 1), absmax, spec.blocksize, "nf4",
                                               [spec.n, spec.k], x.dtype)
    return F.linear(x, w, _bias(spec, ts))


def _dense_gemv(spec: _LinSpec, x: torch.Tensor, ts: Sequence[torch.Tensor], *, residual: torch.Tensor | None = None,
                norm: torch.Tensor | None = None, eps: float = 0.0, glu: bool = False) -> torch.Tensor:
    """llm_core.dense_gemv with its prologue (norm or glu) and residual epilogue; x (1, K) -> (1, N). int8 weights
    pass their row scales (the kernel widens the int8 rows in registers and scales each row once)."""
    row_scale = ts[1] if spec.fmt == "int8" else None
    return torch.ops.llm_core.dense_gemv(x, ts[0], _bias(spec, ts), residual, norm, eps, glu, row_scale)


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm, op for op (fp32 statistics, weight applied in the input dtype)."""
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


# --- the layer, in decode (one token) and prefill (the prompt) form ------------------------------------------


@dataclass(frozen=True)
class _LayerSpec:
    n_heads: int
    n_kv_heads: int
    head_dim: int
    scale: float
    eps_post: float
    eps_next: float  # of the norm in rest[1]: the next layer's input norm, or this layer's own (norm_in_gemv)
    qk_norm_eps: float | None
    linears: tuple[_LinSpec, ...]  # (qkv,) or (q, k, v); o; (gate_up,) or (gate, up); down
    fused: bool
    attention: str  # triton (custom kernel) | reduce (torch, written for inductor) | matmul (torch, eager)
    # Dense triton weights, fused projections: the layer takes and returns the residual stream un-normed; its input
    # norm (rest[1]) and post-attention norm run inside the qkv and gate/up kernels, SiLU-and-multiply inside the
    # down kernel, the residual adds in the o and down kernels' epilogues (llm_core.dense_gemv)
    norm_in_gemv: bool = False


def _split_linears(spec: _LayerSpec, w: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Cut the flat weight list of a layer into per-linear lists (the rest: norms, see _layer_weights)."""
    out, i = [], 0
    for lin in spec.linears:
        count = _tensor_count(lin)
        out.append(list(w[i:i + count]))
        i += count
    out.append(list(w[i:]))
    return out


def _tensor_count(lin: _LinSpec) -> int:
    base = {"dense": 1, "int8": 2}.get(lin.fmt) or (3 if lin.absmax == "fp32" else 7)
    return base + int(lin.bias)


def _project_qkv(spec: _LayerSpec, x: torch.Tensor, lins: list[list[torch.Tensor]],
                 linear: Callable[[_LinSpec, torch.Tensor, Sequence[torch.Tensor]], torch.Tensor]
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    if spec.fused:
        qkv = linear(spec.linears[0], x, lins[0])
        q, k, v = qkv.split(list(spec.linears[0].splits), dim=-1)
        return q, k, v, 1
    return (linear(spec.linears[0], x, lins[0]), linear(spec.linears[1], x, lins[1]),
            linear(spec.linears[2], x, lins[2]), 3)


def _mlp(spec: _LayerSpec, x: torch.Tensor, lins: list[list[torch.Tensor]], first: int,
         linear: Callable[[_LinSpec, torch.Tensor, Sequence[torch.Tensor]], torch.Tensor]) -> torch.Tensor:
    if spec.fused:
        gate, up = linear(spec.linears[first], x, lins[first]).split(list(spec.linears[first].splits), dim=-1)
        down = first + 1
    else:
        gate = linear(spec.linears[first], x, lins[first])
        up = linear(spec.linears[first + 1], x, lins[first + 1])
        down = first + 2
    return linear(spec.linears[down], F.silu(gate) * up, lins[down])


def _decode_attention(spec: _LayerSpec, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      pos: torch.Tensor) -> torch.Tensor:
    """One query token over the cache prefix. q (H, D); k/v_cache (L, Hkv, D), rows after pos masked -> (1, H*D).

    Compiled form: broadcast products and reductions in fp32 (no repeat_kv copy, no fp32 copy of the cache) that
    inductor fuses into a few kernels. Eager form (CPU): the same math as two batched matmuls."""
    if spec.attention == "triton":
        out = torch.ops.llm_core.decode_attention(q, k_cache, v_cache, pos, spec.scale)
        return out.reshape(1, spec.n_heads * spec.head_dim)
    groups = spec.n_heads // spec.n_kv_heads
    length = k_cache.shape[0]
    valid = torch.arange(length, device=q.device) <= pos  # (L,)
    if spec.attention == "reduce":
        qf = q.float().view(1, spec.n_kv_heads, groups, spec.head_dim)
        scores = (qf * k_cache.float()[:, :, None, :]).sum(-1) * spec.scale  # (L, Hkv, G)
        scores = scores.masked_fill(~valid[:, None, None], float("-inf"))
        probs = torch.softmax(scores, dim=0)
        out = (probs[..., None] * v_cache.float()[:, :, None, :]).sum(0)  # (Hkv, G, D)
    else:
        qf = q.float().view(spec.n_kv_heads, groups, spec.head_dim)
        scores = torch.matmul(qf, k_cache.float().permute(1, 2, 0)) * spec.scale  # (Hkv, G, L)
        probs = torch.softmax(scores.masked_fill(~valid, float("-inf")), dim=-1)
        out = torch.matmul(probs, v_cache.float().transpose(0, 1))  # (Hkv, G, D)
    return out.reshape(1, spec.n_heads * spec.head_dim).to(q.dtype)


def _layer_decode(spec: _LayerSpec, h: torch.Tensor, hn: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  pos: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, w: Sequence[torch.Tensor]
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """One decoder layer for one token. h: residual (1, H); hn: h after this layer's input norm; cos/sin (1, D);
    pos (1,) int64 position of the token; k/v_cache (L, Hkv, D) prefix of this layer's cache (written at pos).
    Returns (h, next layer's normed input) so the next input norm fuses with this layer's last residual add."""
    lins = _split_linears(spec, w)
    rest = lins[-1]  # [post_attention_layernorm.weight, next (or, norm_in_gemv, own input) norm weight, (q/k_norm)]
    if spec.norm_in_gemv:  # h arrives un-normed: the input norm is the qkv kernel's prologue (hn is not used)
        qkv = _dense_gemv(spec.linears[0], h, lins[0], norm=rest[1], eps=spec.eps_next)
        q, k, v = qkv.split(list(spec.linears[0].splits), dim=-1)
        used = 1
    else:
        q, k, v, used = _project_qkv(spec, hn, lins, _linear_decode)
    q = q.view(spec.n_heads, spec.head_dim)
    k = k.view(spec.n_kv_heads, spec.head_dim)
    v = v.view(spec.n_kv_heads, spec.head_dim)
    if spec.qk_norm_eps is not None:
        q, k = _rms(q, rest[2], spec.qk_norm_eps), _rms(k, rest[3], spec.qk_norm_eps)
    q = q * cos + _rotate_half(q) * sin
    k = k * cos + _rotate_half(k) * sin
    k_cache.index_copy_(0, pos, k[None])
    v_cache.index_copy_(0, pos, v[None])
    attn = _decode_attention(spec, q, k_cache, v_cache, pos)
    if spec.norm_in_gemv:
        h = _dense_gemv(spec.linears[1], attn, lins[1], residual=h)
        gate_up = _dense_gemv(spec.linears[2], h, lins[2], norm=rest[0], eps=spec.eps_post)
        h = _dense_gemv(spec.linears[3], gate_up, lins[3], residual=h, glu=True)
        return h, h
    h = h + _linear_decode(spec.linears[used], attn, lins[used])
    h = h + _mlp(spec, _rms(h, rest[0], spec.eps_post), lins, used + 1, _linear_decode)
    return h, _rms(h, rest[1], spec.eps_next)


def _layer_prefill(spec: _LayerSpec, h: torch.Tensor, hn: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   start: int, k_cache: torch.Tensor, v_cache: torch.Tensor, w: Sequence[torch.Tensor]
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The same layer over a chunk of S prompt tokens at positions start..start+S-1. h, hn (1, S, H);
    cos/sin (1, S, D); k/v_cache (L, Hkv, D) full cache of this layer."""
    lins = _split_linears(spec, w)
    rest = lins[-1]
    seq = h.shape[1]
    if spec.norm_in_gemv:  # the layer's own input norm (rest[1]); it returns h un-normed, as its decode form does
        hn = _rms(h, rest[1], spec.eps_next)
    q, k, v, used = _project_qkv(spec, hn, lins, _linear_prefill)
    q = q.view(1, seq, spec.n_heads, spec.head_dim)
    k = k.view(1, seq, spec.n_kv_heads, spec.head_dim)
    v = v.view(1, seq, spec.n_kv_heads, spec.head_dim)
    if spec.qk_norm_eps is not None:
        q, k = _rms(q, rest[2], spec.qk_norm_eps), _rms(k, rest[3], spec.qk_norm_eps)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (1, heads, S, D)
    c, s = cos[:, None], sin[:, None]
    q = q * c + _rotate_half(q) * s
    k = k * c + _rotate_half(k) * s
    k_cache[start:start + seq].copy_(k[0].transpose(0, 1))
    v_cache[start:start + seq].copy_(v[0].transpose(0, 1))
    groups = spec.n_heads // spec.n_kv_heads
    if start == 0:
        keys, values, mask, causal = k, v, None, True
    else:  # a later chunk attends to everything cached so far (bottom-right aligned causal mask)
        end = start + seq
        keys = k_cache[:end].transpose(0, 1)[None]
        values = v_cache[:end].transpose(0, 1)[None]
        mask = (torch.arange(end, device=h.device)[None, :] <= torch.arange(start, end, device=h.device)[:, None])
        causal = False
    if groups > 1 and h.device.type == "cuda":  # flash attention with grouped K/V: expand (as repeat_kv does)
        keys = keys[:, :, None].expand(-1, -1, groups, -1, -1).reshape(1, spec.n_heads, -1, spec.head_dim)
        values = values[:, :, None].expand(-1, -1, groups, -1, -1).reshape(1, spec.n_heads, -1, spec.head_dim)
        gqa: dict[str, Any] = {}
    else:
        gqa = {"enable_gqa": True} if groups > 1 else {}
    attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=causal, scale=spec.scale, **gqa)
    attn = attn.transpose(1, 2).reshape(1, seq, spec.n_heads * spec.head_dim)
    h = h + _linear_prefill(spec.linears[used], attn, lins[used])
    h = h + _mlp(spec, _rms(h, rest[0], spec.eps_post), lins, used + 1, _linear_prefill)
    return h, (h if spec.norm_in_gemv else _rms(h, rest[1], spec.eps_next))


@dataclass(frozen=True)
class _HeadSpec:
    lm: _LinSpec
    eps0: float
    norm: bool = False  # layers hand over the residual un-normed (norm_in_gemv): the head applies the final norm,
    eps_final: float = 0.0  # whose weight is the last of its tensors (inside the lm_head kernel when dense triton)


def _prologue(spec: _HeadSpec, rotary: Any, tok: torch.Tensor, pos: torch.Tensor, embed: torch.Tensor,
              norm0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """tok, pos (1,) -> residual h (1, H), first layer's normed input, cos/sin (1, D) from the model's own RoPE."""
    h = F.embedding(tok, embed)
    cos, sin = rotary(h[None], pos[None])
    return h, _rms(h, norm0, spec.eps0), cos[0], sin[0]


def _head(spec: _HeadSpec, hn: torch.Tensor, lm: Sequence[torch.Tensor], seen: torch.Tensor, penalty: torch.Tensor,
          eos_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Final-normed hidden (1, H) -> scores (1, V) fp32 after repetition penalty and min-new-tokens EOS ban (as
    transformers' processors compute them), and the greedy token (1,)."""
    if spec.norm:
        lm, final = lm[:-1], lm[-1]
        if spec.lm.gemv == "dense-triton":
            logits = _dense_gemv(spec.lm, hn, lm, norm=final, eps=spec.eps_final).float()
        else:
            logits = _linear_decode(spec.lm, _rms(hn, final, spec.eps_final), lm).float()
    else:
        logits = _linear_decode(spec.lm, hn, lm).float()
    penalized = torch.where(logits < 0, logits * penalty, logits / penalty)
    scores = torch.where(seen, penalized, logits) + eos_bias
    return scores, scores.argmax(-1)


# --- sampling (eager, after the graph) -----------------------------------------------------------------------


def sample_from_scores(scores: torch.Tensor, gen: GenerationSettings, generator: torch.Generator | None
                       ) -> torch.Tensor:
    """transformers' warpers in its order (temperature, top-k, top-p), then multinomial. scores (1, V) -> (1,)."""
    if gen.temperature != 1.0:
        scores = scores / gen.temperature
    if gen.top_k:
        top_k = min(gen.top_k, scores.shape[-1])
        kth = torch.topk(scores, top_k)[0][..., -1, None]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if gen.top_p < 1.0:
        sorted_logits, sorted_idx = torch.sort(scores, descending=False)
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        remove = cum <= (1 - gen.top_p)
        remove[..., -1:] = False
        scores = scores.masked_fill(remove.scatter(1, sorted_idx, remove), float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator).view(1)


# --- the decoder ---------------------------------------------------------------------------------------------


def bucket_list(cache_len: int) -> list[int]:
    """Attention lengths the decode step is captured for: every 256 tokens to 4k, 1k to 16k, then 4k; the last
    is the cache length. Decoding at position p uses the smallest bucket > p, so attention reads at most ~25%
    (short) / ~6% (long contexts) more cache rows than needed."""
    out, b = [], MIN_BUCKET_TOKENS
    while b < cache_len:
        out.append(b)
        b += 256 if b < 4096 else 1024 if b < 16384 else 4096
    out.append(cache_len)
    return out


@dataclass
class _KVLayer:
    keys: torch.Tensor
    values: torch.Tensor


@dataclass
class KVCacheView:
    """Read-only view of the static cache in the layout metrics.cache_bytes reads (`layers[i].keys/values`)."""

    layers: list[_KVLayer] = field(default_factory=list)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class FastDecoder:
    """Owns the static KV cache, packed weights, compiled step and captured graphs of one loaded model.

    One reply at a time (a lock). Building it re-points the model's q/k/v and gate/up weights at fused storage
    (same values); plain `model.generate` keeps working on the same model.
    """

    def __init__(self, loaded: LoadedModel, *, max_cache_len: int | None = None, compile: bool | None = None,
                 options: FastDecodeOptions | None = None) -> None:
        ok, reason = fast_path_support(loaded, allow_cpu=True)
        if not ok:
            raise GenerationError(f"The fast decode path cannot run for this model: {reason}.")
        self.loaded = loaded
        self.device = loaded.device
        quantized = loaded.settings.quantization in ("nf4", "int8")
        self.dtype = loaded.compute_dtype if quantized else _weights_dtype(loaded.model)
        self.compile = self.device.type == "cuda" if compile is None else compile
        self.use_graphs = self.compile and self.device.type == "cuda"
        self._arch = _Arch.from_model(loaded.model)
        self.options = (options or FastDecodeOptions()).resolved(self.device, self._arch.head_dim)
        self.reason = reason
        self.max_cache_len = int(max_cache_len or loaded.context_length)
        self._lock = threading.Lock()
        self.gemv_timings_us: dict[str, float] = {}  # start-up timing of each 4-bit kernel (auto)
        self.dense_gemv_timings_us: dict[str, float] = {}  # and of cuBLAS / llm_core.dense_gemv (dense_gemv=auto)
        if self.options.gemv == "nf4" and self.dtype != torch.bfloat16:  # the kernel reads bf16 activations
            self.options = replace(self.options, gemv="bnb")
        with torch.no_grad():
            if self.options.gemv == "auto":
                self.options = replace(self.options, gemv=self._pick_gemv())
            if self.options.dense_gemv == "auto":
                self.options = replace(self.options, dense_gemv=self._pick_dense_gemv())
            self._build_plan()
        vocab = self._arch.vocab
        dev = self.device
        self._tok = torch.zeros(1, dtype=torch.long, device=dev)
        self._pos = torch.zeros(1, dtype=torch.long, device=dev)
        self._seen = torch.zeros(vocab, dtype=torch.bool, device=dev)
        self._penalty = torch.ones((), dtype=torch.float32, device=dev)
        self._eos_bias = torch.zeros(vocab, dtype=torch.float32, device=dev)
        self._scores = torch.zeros(1, vocab, dtype=torch.float32, device=dev)
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None
        self._cache_len = 0
        self._buckets: list[int] = []
        self._graphs: dict[int, Any] = {}
        self._pool: Any = None
        self._host_tokens: torch.Tensor | None = None
        self._events: list[Any] = []
        self._cpu_tokens: dict[int, int] = {}
        self._compiled = False
        self.warmup_s: float | None = None
        self.compile_cache_loaded = False
        self.compile_s: float | None = None
        self.capture_s: float | None = None
        self.prefill_warm_s: float | None = None
        self._pf_graphs: dict[int, Any] = {}  # padded prefill: one CUDA graph per bucket length
        self._pf_pool: Any = None
        self._pf_ids: torch.Tensor | None = None  # static inputs / outputs of the padded prefill
        self._pf_pos: torch.Tensor | None = None
        self._pf_last = torch.zeros(1, dtype=torch.long, device=self.device)
        self._pf_scores = torch.zeros(1, self._arch.vocab, dtype=torch.float32, device=self.device)
        self._pf_tok = torch.zeros(1, dtype=torch.long, device=self.device)
        # The last reply's prefill, for diagnostics (prefill_timing): host clock reads, and CUDA events around it
        self._clock: dict[str, float] = {}
        self._prefill_events: tuple[Any, Any] | None = None

    # --- weights ---------------------------------------------------------------------------------------------
    def _layer_groups(self, layer: Any) -> list[list[Any]]:
        attn, mlp = layer.self_attn, layer.mlp
        if self.options.fuse:
            return [[attn.q_proj, attn.k_proj, attn.v_proj], [attn.o_proj], [mlp.gate_proj, mlp.up_proj],
                    [mlp.down_proj]]
        return [[attn.q_proj], [attn.k_proj], [attn.v_proj], [attn.o_proj], [mlp.gate_proj], [mlp.up_proj],
                [mlp.down_proj]]

    def _pick_gemv(self) -> str:
        """The 4-bit kernel: each candidate timed on the first layer's real (fused) weights; the fastest is kept,
        bitsandbytes' if none runs. Dense weights and CPU never get here."""
        if self.loaded.settings.quantization != "nf4":
            return "bnb"
        groups = self._layer_groups(self._arch.layers[0])
        candidates = ["bnb"] + (["nf4"] if _NF4_KERNEL_AVAILABLE and self.dtype == torch.bfloat16 else [])
        self.gemv_timings_us = self._time_linears(
            groups, {cand: (replace(self.options, gemv=cand), cand) for cand in candidates})
        timings = self.gemv_timings_us
        return min(timings, key=lambda k: timings[k]) if timings else "bnb"

    def _pick_dense_gemv(self) -> str:
        """cuBLAS or llm_core.dense_gemv for unquantized weights, timed on the first layer's dense (fused) linears,
        or on the lm_head where the layers are quantized; the faster is kept (cuBLAS if the Triton kernel fails). Only
        reached on CUDA with Triton (resolved() picks cublas elsewhere)."""
        groups = [g for g in self._layer_groups(self._arch.layers[0]) if all(_is_dense(m) for m in g)]
        groups = groups or [[self._arch.lm_head]]
        self.dense_gemv_timings_us = self._time_linears(
            groups, {cand: (replace(self.options, dense_gemv=cand), self.options.gemv)
                     for cand in DENSE_GEMV_KERNELS[:2]})  # cublas, triton
        timings = self.dense_gemv_timings_us
        return min(timings, key=lambda k: timings[k]) if timings else "cublas"

    def _time_linears(self, groups: list[list[Any]], candidates: dict[str, tuple[FastDecodeOptions, str]]
                      ) -> dict[str, float]:
        """Microseconds per call of `groups` packed as each candidate's (options, 4-bit kernel), as the decode step
        runs them: inside a CUDA graph (no Python launch costs), after warm-up calls that compile and autotune
        Triton kernels outside the capture. A candidate that fails is logged and left out."""
        timings: dict[str, float] = {}
        for cand, (opts, gemv) in candidates.items():
            try:
                packed = [_pack_linears(g, opts, gemv) for g in groups]
                xs = [torch.randn(1, p.spec.k, dtype=self.dtype, device=self.device) for p in packed]

                def layer(packed: list[_Packed] = packed, xs: list[torch.Tensor] = xs) -> None:
                    for p, x in zip(packed, xs, strict=True):
                        _linear_decode(p.spec, x, p.tensors)

                timings[cand] = round(time_in_cuda_graph(layer, self.device, reps=10, replays=5, warmups=3), 2)
            except Exception as exc:  # noqa: BLE001 - a candidate that cannot run is simply not chosen
                log.warning("kernel %s unavailable: %s", cand, exc)
        return timings

    def _build_plan(self) -> None:
        a, opts = self._arch, self.options
        gemv = opts.gemv
        attention = opts.attention if opts.attention == "triton" else ("reduce" if self.compile else "matmul")
        layer_specs: dict[_LayerSpec, _LayerSpec] = {}  # one instance per distinct spec: one compiled graph each
        self._layer_specs: list[_LayerSpec] = []
        self._layer_weights: list[list[torch.Tensor]] = []
        notes: set[str] = set()
        dense = all(_is_dense(m) for layer in a.layers for g in self._layer_groups(layer) for m in g)
        norm_in = opts.gemv_prologues and opts.fuse and dense and opts.dense_gemv == "triton"
        for i, layer in enumerate(a.layers):
            attn = layer.self_attn
            packed = [_pack_linears(g, opts, gemv) for g in self._layer_groups(layer)]
            notes.update(p.note for p in packed if p.note)
            next_norm = a.layers[i + 1].input_layernorm if i + 1 < len(a.layers) else a.norm
            if norm_in:  # each layer applies its own input norm; the head the final one
                next_norm = layer.input_layernorm
            rest = [layer.post_attention_layernorm.weight, next_norm.weight]
            qk_eps = None
            if a.qk_norm:
                rest += [attn.q_norm.weight, attn.k_norm.weight]
                qk_eps = float(_eps(attn.q_norm))
            spec = _LayerSpec(a.n_heads, a.n_kv_heads, a.head_dim, float(attn.scaling),
                              float(_eps(layer.post_attention_layernorm)), float(_eps(next_norm)), qk_eps,
                              tuple(p.spec for p in packed), opts.fuse, attention, norm_in)
            self._layer_specs.append(layer_specs.setdefault(spec, spec))
            self._layer_weights.append([t for p in packed for t in p.tensors] + [r.detach() for r in rest])
        lm = _pack_linears([a.lm_head], replace(opts, fuse=False), gemv)
        self._head_spec = _HeadSpec(lm.spec, float(_eps(a.layers[0].input_layernorm)), norm_in, float(_eps(a.norm)))
        self._lm_tensors = lm.tensors + ([a.norm.weight.detach()] if norm_in else [])
        self._embed = a.embed.weight.detach()
        self._norm0 = a.layers[0].input_layernorm.weight.detach()
        self.notes = sorted(notes)
        self._make_functions()

    def _make_functions(self) -> None:
        """Closures over static specs; compiled once each (all layers share one spec, hence one graph)."""
        head_spec, rotary = self._head_spec, self._arch.rotary

        def prologue(tok: torch.Tensor, pos: torch.Tensor, embed: torch.Tensor, norm0: torch.Tensor) -> Any:
            return _prologue(head_spec, rotary, tok, pos, embed, norm0)

        def head(hn: torch.Tensor, lm: list[torch.Tensor], seen: torch.Tensor, penalty: torch.Tensor,
                 eos_bias: torch.Tensor) -> Any:
            return _head(head_spec, hn, lm, seen, penalty, eos_bias)

        layer_fns: dict[int, Callable[..., Any]] = {}
        for spec in self._layer_specs:
            if id(spec) not in layer_fns:
                layer_fns[id(spec)] = _bind_layer(spec)
        prefill_fns: dict[int, Callable[..., Any]] = {}
        for spec in self._layer_specs:
            if id(spec) not in prefill_fns:
                prefill_fns[id(spec)] = _bind_prefill(spec)
        self._prologue_fn: Callable[..., Any] = prologue
        self._head_fn: Callable[..., Any] = head
        self._layer_fns: list[Callable[..., Any]] = [layer_fns[id(s)] for s in self._layer_specs]
        self._prefill_eager_fns: list[Callable[..., Any]] = [prefill_fns[id(s)] for s in self._layer_specs]
        self._prefill_fns = self._prefill_eager_fns
        self._prefill_compiled_ok = False
        if self.compile:
            compiled: dict[int, Callable[..., Any]] = {}
            self._prologue_fn = self._compile(prologue)
            self._head_fn = self._compile(head)
            self._layer_fns = [compiled.setdefault(id(fn), self._compile(fn)) for fn in self._layer_fns]
            if self.options.compile_prefill:
                self._prefill_fns = [compiled.setdefault(id(fn), self._compile(fn)) for fn in self._prefill_fns]
                self._prefill_compiled_ok = True

    def _compile(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        backend = self.options.compile_backend
        if backend == "inductor":
            # The NF4 code-table lookups index a 16-entry table with a 4-bit value: skip inductor's bounds asserts.
            return torch.compile(fn, fullgraph=True, options={"assert_indirect_indexing": False})
        return torch.compile(fn, fullgraph=True, backend=backend)

    @property
    def weights_bytes_per_token(self) -> int:
        """Bytes of weights the decode step reads per token (all linears, norms, lm_head; one embedding row)."""
        seen: set[int] = set()
        total = 0
        for tensors in [*self._layer_weights, self._lm_tensors]:
            for t in tensors:
                if t.data_ptr() not in seen:
                    seen.add(t.data_ptr())
                    total += t.numel() * t.element_size()
        return total + self._arch.hidden * self._embed.element_size()

    @property
    def norm_in_gemv(self) -> bool:
        """Whether the layers run their norms, SiLU and residual adds inside llm_core.dense_gemv."""
        return self._layer_specs[0].norm_in_gemv

    def kv_bytes_per_token(self) -> int:
        a = self._arch
        return 2 * len(a.layers) * a.n_kv_heads * a.head_dim * torch.tensor([], dtype=self.dtype).element_size()

    @property
    def cache(self) -> KVCacheView | None:
        if self._k is None or self._v is None:
            return None
        return KVCacheView([_KVLayer(self._k[i], self._v[i]) for i in range(self._k.shape[0])])

    @property
    def cache_len(self) -> int:
        return self._cache_len

    def describe(self) -> dict[str, Any]:
        spec = self._layer_specs[0]
        return {
            "options": asdict(self.options), "compiled": self.compile, "cuda_graphs": self.use_graphs,
            "linear_formats": [f"{s.fmt}/{s.absmax}/{s.gemv}" for s in spec.linears],
            "linears_per_layer": len(spec.linears), "notes": self.notes, "cache_len": self._cache_len,
            "buckets": len(self._buckets), "weights_bytes_per_token": self.weights_bytes_per_token,
            "kv_bytes_per_token": self.kv_bytes_per_token(), "warmup_s": self.warmup_s,
            "compile_s": self.compile_s, "capture_s": self.capture_s,
            "compile_cache_loaded": self.compile_cache_loaded, "gemv_timings_us": self.gemv_timings_us,
            "dense_gemv_timings_us": self.dense_gemv_timings_us,
            "prefill_compiled": self._prefill_compiled_ok, "prefill_warm_s": self.prefill_warm_s,
            "norm_in_gemv": self.norm_in_gemv, "prefill_graphs": sorted(self._pf_graphs),
            "graph_pool_idle_bytes": self.graph_pool_idle_bytes(),
        }

    def graph_pool_idle_bytes(self) -> int:
        """Device bytes the CUDA graph pools (decode steps, padded prefills) hold with no live tensor in them: kept
        for the replays, so no other allocation can use them, yet memory_allocated leaves them out. 0 off CUDA."""
        pools = {tuple(p) for p in (self._pool, self._pf_pool) if p is not None}
        if self.device.type != "cuda" or not pools:
            return 0
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        return sum(int(seg["total_size"]) - int(seg["allocated_size"]) for seg in torch.cuda.memory_snapshot()
                   if seg.get("device") == index and tuple(seg.get("segment_pool_id", ())) in pools)

    # --- cache, capture, warm-up -----------------------------------------------------------------------------
    def resize_cache(self, tokens: int) -> None:
        """Allocate the static cache for `tokens` (rounded up to 16) and capture its buckets; frees the old one."""
        tokens = _round_up(max(int(tokens), 1), 16)
        if tokens > self.max_cache_len:
            raise GenerationError(f"{tokens:,} tokens exceed the fast path's cache limit ({self.max_cache_len:,}).")
        with self._lock, torch.no_grad():
            self._allocate(tokens)

    def _allocate(self, tokens: int) -> None:
        a = self._arch
        self._graphs.clear()
        self._pf_graphs.clear()  # their pool goes with them: freed before the new cache is allocated
        self._pf_pool = None
        self._k = self._v = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        shape = (len(a.layers), tokens, a.n_kv_heads, a.head_dim)
        self._k = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self._v = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self._cache_len = tokens
        self._buckets = bucket_list(tokens)
        if self.device.type == "cuda":
            self._host_tokens = torch.zeros(tokens + 1, dtype=torch.long, pin_memory=True)
            self._events = [torch.cuda.Event() for _ in range(3)]
        if self.options.prefill_graph_tokens:
            top = _round_up(self.options.prefill_graph_tokens, PREFILL_BUCKET_TOKENS)
            self._pf_ids = torch.zeros(top, dtype=torch.long, device=self.device)
            self._pf_pos = torch.arange(top, device=self.device)
        if self.use_graphs:
            t0 = time.perf_counter()
            self._capture_all()
            try:
                self._capture_prefill()
            except Exception as exc:  # noqa: BLE001 - e.g. the compiled prefill failing: it has an eager fallback
                log.warning("Prefill graphs not captured: %s: %s", type(exc).__name__, exc)
                self.notes.append(f"prefill graphs off ({type(exc).__name__})")
                self._pf_graphs.clear()
                self._pf_ids = None
                self._sync()
            self.capture_s = round(time.perf_counter() - t0, 3)

    def warmup(self, cache_tokens: int | None = None) -> float:
        """Compile and capture everything a first reply needs: the cache for `cache_tokens` (default
        max_cache_len) and a graph for each of its attention buckets. Returns seconds."""
        t0 = time.perf_counter()
        with self._lock, torch.no_grad():
            cache_file = self._compile_cache_file()
            if self.compile and cache_file is not None and cache_file.is_file():
                self.compile_cache_loaded = _load_compile_artifacts(cache_file)
            if self.compile and not self._compiled:
                t1 = time.perf_counter()
                self._allocate_plain(_round_up(min(self.max_cache_len, MIN_BUCKET_TOKENS), 16))
                self._warm_step(self._cache_len)  # compiles prologue, layer(s), head with a dynamic length
                self._sync()
                self.compile_s = round(time.perf_counter() - t1, 3)
                self._compiled = True
            self._allocate(_round_up(min(cache_tokens or self.max_cache_len, self.max_cache_len), 16))
            self._warm_prefill_and_sampling()
            if self.compile and cache_file is not None:
                _save_compile_artifacts(cache_file)
        self.warmup_s = round(time.perf_counter() - t0, 3)
        return self.warmup_s

    def _allocate_plain(self, tokens: int) -> None:
        a = self._arch
        shape = (len(a.layers), tokens, a.n_kv_heads, a.head_dim)
        self._graphs.clear()
        self._k = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self._v = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self._cache_len = tokens
        self._buckets = bucket_list(tokens)

    def _warm_prefill_and_sampling(self) -> None:
        ids = torch.arange(min(8, self._cache_len - 2), device=self.device) % self._arch.vocab
        self._seen.zero_()
        t0 = time.perf_counter()
        try:
            scores, _ = self._prefill(ids)
        except Exception as exc:  # noqa: BLE001 - the eager prefill is always there; say why it is used
            if not self._prefill_compiled_ok:
                raise
            log.warning("Compiled prefill unavailable (%s: %s); the prefill runs eagerly.", type(exc).__name__, exc)
            self.notes.append(f"prefill eager: compiling it failed ({type(exc).__name__})")
            self._prefill_compiled_ok = False
            scores, _ = self._prefill(ids)
        self.prefill_warm_s = round(time.perf_counter() - t0, 3)
        sample_from_scores(scores, GenerationSettings(do_sample=True, top_k=50, top_p=0.9, temperature=0.7),
                           torch.Generator(device=self.device))
        self._sync()

    def _compile_cache_file(self) -> Path | None:
        if not self.compile or self.options.compile_backend != "inductor":
            return None
        try:
            from .models import default_cache_dir

            root = default_cache_dir(self.loaded.settings) / "compile"
        except Exception:  # noqa: BLE001 - the compile cache is an optimisation; never fail warm-up for it
            return None
        import transformers

        key = json.dumps({
            "torch": torch.__version__, "transformers": transformers.__version__,
            "config": self.loaded.model.config.to_json_string(use_diff=False),
            "options": asdict(self.options), "dtype": str(self.dtype),
            "device": torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu",
            "specs": repr(sorted({repr(s) for s in self._layer_specs})), "head": repr(self._head_spec),
        }, sort_keys=True)
        return root / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.bin"

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _views(self, bucket: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        assert self._k is not None and self._v is not None
        ks = [self._k[i, :bucket] for i in range(self._k.shape[0])]
        vs = [self._v[i, :bucket] for i in range(self._v.shape[0])]
        if self.compile:
            for t in (*ks, *vs):
                torch._dynamo.maybe_mark_dynamic(t, 0)
        return ks, vs

    def _step(self, bucket: int) -> None:
        """One decode step on the static buffers: feed _tok at _pos, write scores/next token, advance _pos."""
        ks, vs = self._views(bucket)
        self._seen.index_fill_(0, self._tok, True)
        h, hn, cos, sin = self._prologue_fn(self._tok, self._pos, self._embed, self._norm0)
        for fn, w, kc, vc in zip(self._layer_fns, self._layer_weights, ks, vs, strict=True):
            h, hn = fn(h, hn, cos, sin, self._pos, kc, vc, w)
        scores, nxt = self._head_fn(hn, self._lm_tensors, self._seen, self._penalty, self._eos_bias)
        self._scores.copy_(scores)
        self._tok.copy_(nxt)
        self._pos.add_(1)

    def _warm_step(self, bucket: int) -> None:
        self._tok.zero_()
        self._pos.zero_()
        self._step(bucket)

    def _capture_all(self) -> None:
        """Warm each bucket (first-call autotuning happens outside capture), then capture one graph per bucket."""
        self._pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for bucket in self._buckets:
                self._warm_step(bucket)
                self._warm_step(bucket)
        torch.cuda.current_stream(self.device).wait_stream(side)
        self._sync()
        for bucket in self._buckets:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                self._step(bucket)
            self._graphs[bucket] = graph
        self._sync()

    def _prefill_buckets(self) -> list[int]:
        """Padded prefill lengths that fit the cache (multiples of PREFILL_BUCKET_TOKENS, up to the option)."""
        top = min(self.options.prefill_graph_tokens, self._cache_len)
        return list(range(PREFILL_BUCKET_TOKENS, top + 1, PREFILL_BUCKET_TOKENS))

    def _capture_prefill(self) -> None:
        """One graph per padded prefill length, warmed twice first (outside capture) like the decode buckets. A
        length whose capture fails is left to the compiled prefill (and said in the notes)."""
        buckets = self._prefill_buckets()
        if not buckets:
            return
        self._pf_pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side), _prefill_attention_scope(self.options.prefill_attention, self.device):
            for bucket in buckets:
                self._pf_last.fill_(bucket - 1)
                self._padded_prefill(bucket)
                self._padded_prefill(bucket)
        torch.cuda.current_stream(self.device).wait_stream(side)
        self._sync()
        for bucket in buckets:
            graph = torch.cuda.CUDAGraph()
            try:
                with _prefill_attention_scope(self.options.prefill_attention, self.device), \
                        torch.cuda.graph(graph, pool=self._pf_pool):
                    self._padded_prefill(bucket)
            except Exception as exc:  # noqa: BLE001 - the compiled prefill still serves this length
                log.warning("Prefill graph for %d tokens not captured: %s: %s", bucket, type(exc).__name__, exc)
                self.notes.append(f"prefill graphs off from {bucket} tokens ({type(exc).__name__})")
                break
            self._pf_graphs[bucket] = graph
        self._sync()

    def _run_step(self, bucket: int) -> None:
        graph = self._graphs.get(bucket)
        if graph is not None:
            graph.replay()
        else:
            self._step(bucket)

    def _bucket_for(self, length: int) -> int:
        return self._buckets[bisect.bisect_left(self._buckets, length)]

    # --- prefill -----------------------------------------------------------------------------------------------
    def _prefill(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ids (P,) -> (scores (1, V), greedy token (1,)); fills cache rows 0..P-1. Marks prompt tokens as seen."""
        assert self._k is not None and self._v is not None
        total = ids.numel()
        self._seen.index_fill_(0, ids, True)
        chunk = self.options.prefill_chunk_tokens or total
        bucket = _round_up(total, PREFILL_BUCKET_TOKENS)
        if self._pf_ids is not None and chunk >= total and bucket in self._prefill_buckets():
            # right-padded to the bucket: static ids, the last real row picked on the device
            self._pf_ids[:total].copy_(ids)
            self._pf_ids[total:bucket].fill_(0)  # any id: causal attention keeps real rows blind to it
            self._pf_last.fill_(total - 1)
            graph = self._pf_graphs.get(bucket)
            if graph is not None:
                graph.replay()
            else:
                with _prefill_attention_scope(self.options.prefill_attention, self.device):
                    self._padded_prefill(bucket)
            return self._pf_scores, self._pf_tok
        with _prefill_attention_scope(self.options.prefill_attention, self.device):
            hn_last = self._prefill_layers(ids, total, chunk)
        return self._head_fn(hn_last, self._lm_tensors, self._seen, self._penalty, self._eos_bias)

    def _padded_prefill(self, bucket: int) -> None:
        """The prefill over _pf_ids[:bucket] on static buffers (capturable): cache rows 0..bucket-1, then the head on
        row _pf_last, into _pf_scores / _pf_tok."""
        assert self._pf_ids is not None and self._pf_pos is not None
        hn = self._prefill_pass(self._pf_ids[:bucket], self._pf_pos[:bucket], 0)
        last = hn[0].index_select(0, self._pf_last)  # (1, H): the last real token's row
        scores, nxt = self._head_fn(last, self._lm_tensors, self._seen, self._penalty, self._eos_bias)
        self._pf_scores.copy_(scores)
        self._pf_tok.copy_(nxt)

    def _prefill_layers(self, ids: torch.Tensor, total: int, chunk: int) -> torch.Tensor:
        hn_last = None
        for start in range(0, total, chunk):
            part = ids[start:start + chunk]
            pos = torch.arange(start, start + part.numel(), device=self.device)
            hn = self._prefill_pass(part, pos, start)
            hn_last = hn[:, -1].clone()  # (1, H) contiguous: the same input layout as the decode step
        assert hn_last is not None
        return hn_last

    def _prefill_pass(self, ids: torch.Tensor, pos: torch.Tensor, start: int) -> torch.Tensor:
        """Every layer over ids (S,) at positions pos (S,) = start..start+S-1: cache rows written; returns the
        last layer's hn (1, S, H) (un-normed h where the layers fuse their norms)."""
        assert self._k is not None and self._v is not None
        h = F.embedding(ids, self._embed)[None]
        cos, sin = self._arch.rotary(h, pos[None])
        hn = _rms(h, self._norm0, self._head_spec.eps0)
        fns = self._prefill_fns if self._prefill_compiled_ok and ids.numel() > 1 else self._prefill_eager_fns
        for i, (fn, w) in enumerate(zip(fns, self._layer_weights, strict=True)):
            if fns is self._prefill_fns:
                for t in (h, hn, cos, sin):
                    torch._dynamo.maybe_mark_dynamic(t, 1)
                for t in (self._k[i], self._v[i]):
                    torch._dynamo.maybe_mark_dynamic(t, 0)
            h, hn = fn(h, hn, cos, sin, start, self._k[i], self._v[i], w)
        return hn

    # --- generate --------------------------------------------------------------------------------------------
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, gen: GenerationSettings,
                 streamer: Any, stop_event: threading.Event, max_new_tokens: int, *,
                 min_new_tokens: int = 0) -> torch.Tensor:
        """Like model.generate for batch 1: returns (1, P+N) ids. streamer.put(prompt) first, then each new token
        as it is produced (one step behind the GPU), then streamer.end(), also on stop or error."""
        try:  # warm-up's grad mode whatever the caller's: tensors made under inference_mode carry other dispatch
            # keys, and dynamo would recompile the prefill, head and prologue inside the first reply
            with self._lock, torch.inference_mode(False), torch.no_grad():
                new = self._generate(input_ids, attention_mask, gen, streamer, stop_event, max_new_tokens,
                                     min_new_tokens)
            tail = torch.tensor([new], dtype=input_ids.dtype, device=input_ids.device).view(1, -1)
            return torch.cat([input_ids, tail], dim=1)
        except torch.cuda.OutOfMemoryError as exc:
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            raise OutOfMemoryError("The GPU ran out of memory in the fast decode path; lower max new tokens or the "
                                   "history length and try again.") from exc
        finally:
            if streamer is not None:
                streamer.end()

    def _prompt_ids(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        if input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise GenerationError(f"The fast decode path takes one prompt (batch 1), got {tuple(input_ids.shape)}.")
        ids = input_ids[0]
        if attention_mask is not None and not bool(attention_mask.all()):
            keep = attention_mask[0].bool()
            first = int(keep.nonzero()[0]) if bool(keep.any()) else ids.numel()
            if not bool(keep[first:].all()):
                raise GenerationError("The fast decode path supports left padding only.")
            ids = ids[first:]
        if ids.numel() == 0:
            raise GenerationError("The prompt is empty.")
        return ids.to(self.device)

    def _eos_ids(self) -> list[int]:
        eos = getattr(self.loaded.model.generation_config, "eos_token_id", None)
        if eos is None:
            eos = getattr(self.loaded.tokenizer, "eos_token_id", None)
        if eos is None:
            return []
        return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]

    def _generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, gen: GenerationSettings,
                  streamer: Any, stop_event: threading.Event, max_new_tokens: int, min_new_tokens: int
                  ) -> list[int]:
        clock = {"entry": time.perf_counter()}
        self._clock = clock
        ids = self._prompt_ids(input_ids, attention_mask)
        prompt_len, limit = ids.numel(), int(max_new_tokens)
        if limit < 1:
            raise GenerationError("max_new_tokens must be at least 1.")
        need = prompt_len + limit
        if need > self.max_cache_len:
            raise GenerationError(f"The prompt ({prompt_len:,} tokens) plus max new tokens ({limit:,}) exceed the "
                                  f"fast path's KV cache ({self.max_cache_len:,} tokens); shorten the history.")
        if need > self._cache_len:  # only after resize_cache() shrank it: allocation and capture, never compile
            log.warning("Fast decode cache grows to %d tokens inside a reply (capture only).", need)
            self._allocate(_round_up(need, 16))
        if streamer is not None:
            streamer.put(input_ids.cpu())
        eos = set(self._eos_ids())
        self._seen.zero_()
        self._penalty.fill_(float(gen.repetition_penalty))
        self._eos_bias.zero_()
        if min_new_tokens > 0 and eos:
            self._eos_bias[list(eos)] = float("-inf")
        generator = None
        if gen.do_sample:
            generator = torch.Generator(device=self.device)
            if gen.seed is not None:
                generator.manual_seed(int(gen.seed))
            else:
                generator.seed()
        events = self._prefill_events
        if events is None and self.device.type == "cuda":
            events = self._prefill_events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        clock["prefill_start"] = time.perf_counter()
        if events is not None:
            events[0].record()
        scores, nxt = self._prefill(ids)
        if events is not None:
            events[1].record()
        clock["prefill_launched"] = time.perf_counter()
        if gen.do_sample:
            nxt = sample_from_scores(scores, gen, generator)
        self._tok.copy_(nxt)
        self._pos.fill_(prompt_len)
        out: list[int] = []
        self._publish(0)
        for i in range(1, limit + 1):
            launched = i < limit and not stop_event.is_set()
            if launched:  # queue step i (it produces token i) before reading token i-1 back
                if min_new_tokens and i == min_new_tokens:
                    self._eos_bias.zero_()
                self._run_step(self._bucket_for(prompt_len + i))
                if gen.do_sample:
                    self._tok.copy_(sample_from_scores(self._scores, gen, generator))
                self._publish(i)
            token = self._collect(i - 1)
            out.append(token)
            if i == 1:
                clock["first_token"] = time.perf_counter()
            if streamer is not None:
                streamer.put(torch.tensor([token]))
            if token in eos or not launched or stop_event.is_set():
                break
        return out

    def _publish(self, index: int) -> None:
        """Start copying the current token (device) to the host; index = its place among the new tokens."""
        if self._host_tokens is not None and self.device.type == "cuda":
            self._host_tokens[index:index + 1].copy_(self._tok, non_blocking=True)
            self._events[index % len(self._events)].record()
        else:
            self._cpu_tokens[index] = int(self._tok.item())

    def _collect(self, index: int) -> int:
        if self._host_tokens is not None and self.device.type == "cuda":
            self._events[index % len(self._events)].synchronize()
            return int(self._host_tokens[index])
        return self._cpu_tokens.pop(index)

    # --- diagnostics (bench, tests) ----------------------------------------------------------------------------
    def prefill_timing(self) -> dict[str, float | None]:
        """Where the last reply's first token came from, in seconds (after it: the events have completed by then).
        entry_to_prefill_s: generate() entered -> prefill launch begins (prompt checks, streamer, buffers);
        prefill_launch_s: host time launching the prefill and head (waits inside count, e.g. a synchronizing op);
        prefill_gpu_s: device time from the prefill's first kernel to the head's last (CUDA events; None on CPU);
        first_token_s: generate() entered -> token 0 read back on the host."""
        c = self._clock
        if "prefill_launched" not in c:
            return {}
        gpu = None
        if self._prefill_events is not None:
            self._prefill_events[1].synchronize()
            gpu = self._prefill_events[0].elapsed_time(self._prefill_events[1]) / 1e3
        return {"entry_to_prefill_s": c["prefill_start"] - c["entry"],
                "prefill_launch_s": c["prefill_launched"] - c["prefill_start"], "prefill_gpu_s": gpu,
                "first_token_s": c["first_token"] - c["entry"] if "first_token" in c else None}

    def forced_scores(self, input_ids: torch.Tensor, forced: Sequence[int]) -> torch.Tensor:
        """Teacher forcing: scores (1 + len(forced), V) fp32 for the last prompt position and after feeding each
        forced token through the decode step (graphs on CUDA). Repetition penalty off; for logit agreement."""
        ids = self._prompt_ids(input_ids, None)
        need = ids.numel() + len(forced) + 1
        with self._lock, torch.no_grad():
            if need > self._cache_len:
                self._allocate(_round_up(need, 16))
            self._seen.zero_()
            self._penalty.fill_(1.0)
            self._eos_bias.zero_()
            rows = [self._prefill(ids)[0].clone()]
            self._pos.fill_(ids.numel())
            for j, token in enumerate(forced):
                self._tok.fill_(int(token))
                self._run_step(self._bucket_for(ids.numel() + j + 1))
                rows.append(self._scores.clone())
            return torch.cat(rows, 0)

    def time_decode_steps(self, context_tokens: int, steps: int) -> float:
        """Seconds per decode step (graph replays, no host reads) at a given context length; for the bench."""
        with self._lock, torch.no_grad():
            if context_tokens + steps > self._cache_len:
                self._allocate(_round_up(context_tokens + steps, 16))
            self._pos.fill_(context_tokens)
            self._sync()
            t0 = time.perf_counter()
            for i in range(steps):
                self._run_step(self._bucket_for(context_tokens + i + 1))
            self._sync()
            return (time.perf_counter() - t0) / steps


def _prefill_attention_scope(choice: str, device: torch.device) -> Any:
    """The SDPA backends the prefill may use (FastDecodeOptions.prefill_attention). Set around tracing and every
    call alike: a compiled prefill keeps the backend chosen when it was traced."""
    if choice == "auto" or device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def _bind_prefill(spec: _LayerSpec) -> Callable[..., Any]:
    def layer(h: torch.Tensor, hn: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, start: int,
              k_cache: torch.Tensor, v_cache: torch.Tensor, w: list[torch.Tensor]) -> Any:
        return _layer_prefill(spec, h, hn, cos, sin, start, k_cache, v_cache, w)

    return layer


def _bind_layer(spec: _LayerSpec) -> Callable[..., Any]:
    def layer(h: torch.Tensor, hn: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor,
              k_cache: torch.Tensor, v_cache: torch.Tensor, w: list[torch.Tensor]) -> Any:
        return _layer_decode(spec, h, hn, cos, sin, pos, k_cache, v_cache, w)

    return layer


def _eps(norm: Any) -> float:
    eps = getattr(norm, "variance_epsilon", None)
    return float(eps if eps is not None else getattr(norm, "eps", 1e-6))


def _weights_dtype(model: Any) -> torch.dtype:
    return next(p.dtype for p in model.parameters() if p.is_floating_point())


def _load_compile_artifacts(path: Path) -> bool:
    try:
        torch.compiler.load_cache_artifacts(path.read_bytes())
        return True
    except Exception as exc:  # noqa: BLE001 - a stale or foreign cache only costs a recompile
        log.warning("Ignoring compile cache %s: %s", path, exc)
        return False


def _save_compile_artifacts(path: Path) -> None:
    try:
        saved = torch.compiler.save_cache_artifacts()
        if saved is None:
            return
        data = saved[0]
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_bytes(data)
        tmp.replace(path)
    except Exception as exc:  # noqa: BLE001 - see above
        log.warning("Could not save the compile cache to %s: %s", path, exc)


def kv_cache_exact_bytes(config: Any, tokens: int, dtype: torch.dtype) -> int:
    """Bytes of a K+V cache for `tokens` positions of a llama-family config (what the seed's cache holds)."""
    heads = int(config.num_attention_heads)
    kv = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    return 2 * int(config.num_hidden_layers) * kv * head_dim * tokens * torch.tensor([], dtype=dtype).element_size()


__all__ = ["FastDecodeOptions", "FastDecoder", "KVCacheView", "bucket_list", "fast_path_support",
           "kv_cache_exact_bytes", "nf4_matvec_torch", "sample_from_scores", "time_in_cuda_graph"]
