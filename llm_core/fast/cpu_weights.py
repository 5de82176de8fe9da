"""The CPU path's weights (llm_core.fast.cpu): every decoder linear quantized at load to torch's weight-only int4
(groups of GROUP_SIZE along the input, a scale and a float zero each) or int8 (per row), q/k/v and gate/up fused
into one matrix each, the tied lm_head/embedding int8 per row; the transformers modules re-pointed at row views of
the fused matrices, so plain `generate` runs on the same bytes. Why these formats: docs/cpu.md."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import GenerationError

GROUP_SIZE = 32  # int4 group along the input dimension: Q4_1's block
ACT_DTYPE = torch.bfloat16  # what torch's int4/int8 weight-only CPU kernels take (their fp32 forms are scalar loops)
# the lm_head's format for each weight format: see docs/cpu.md for the int4-vs-int8 head measurement
HEAD_FORMATS = {"int4": "int8", "int8": "int8", "dense": "dense"}


def quantize_int4(w: torch.Tensor, group: int = GROUP_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """w (N, K) float -> (packed (N, K/2) uint8 in torch's CPU int4 layout, scales_and_zeros (K/group, N, 2) bf16).
    Asymmetric: w ~ (q - 8) * scale + zero with q in 0..15, scale = (max - min) / 15, zero = min + 8 * scale."""
    n, k = w.shape
    g = w.float().view(n, k // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp_min(torch.finfo(torch.float32).tiny)
    q = torch.round((g - lo[..., None]) / scale[..., None]).clamp_(0, 15).to(torch.int32).view(n, k)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    sz = torch.stack([scale, lo + 8 * scale], dim=-1).transpose(0, 1).contiguous().to(ACT_DTYPE)
    return packed, sz


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w (N, K) -> (int8 (N, K), per-row scale (N,) bf16): symmetric, absmax / 127 per row."""
    wf = w.float()
    scale = (wf.abs().amax(-1) / 127).clamp_min(torch.finfo(torch.float32).tiny)
    q = torch.round(wf / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale.to(ACT_DTYPE)


@dataclass
class FusedWeights:
    """One (possibly fused) matrix in the CPU path's format; `splits` are the output rows of its parts."""

    fmt: str  # int4 | int8 | dense
    n: int
    k: int
    splits: tuple[int, ...]
    tensors: tuple[torch.Tensor, ...]  # int4: (packed, scales_and_zeros); int8: (w, scale); dense: (w,)

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., K) -> (..., N), in x's dtype (the product in bf16 for int4/int8)."""
        return fused_linear(self.fmt, x, self.tensors)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)


def fused_linear(fmt: str, x: torch.Tensor, ts: Sequence[torch.Tensor]) -> torch.Tensor:
    if fmt == "dense":
        return F.linear(x.to(ts[0].dtype), ts[0]).to(x.dtype)
    flat = x.reshape(-1, x.shape[-1]).to(ACT_DTYPE)
    if fmt == "int4":
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, ts[0], GROUP_SIZE, ts[1])
    else:
        y = torch._weight_int8pack_mm(flat, ts[0], ts[1])
    return y.to(x.dtype).view(*x.shape[:-1], y.shape[-1])


class CPULinear(nn.Module):
    """A transformers linear re-pointed at rows [start, stop) of a FusedWeights matrix. The int4 kernel reads its
    scales contiguously, so a row view of them would be read wrongly: it computes the fused product and keeps its
    rows (exactly the values the CPU decode step uses; the plain path is the reference, not the fast one)."""

    def __init__(self, fused: FusedWeights, start: int, stop: int) -> None:
        super().__init__()
        self.in_features, self.out_features = fused.k, stop - start
        self.fused, self.start, self.stop = fused, start, stop
        for i, t in enumerate(fused.tensors):  # counted by get_memory_footprint (the first module of a group)
            self.register_buffer(f"w{i}", t if start == 0 else t[:0], persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fused.linear(x)
        return y if self.stop - self.start == self.fused.n else y[..., self.start:self.stop]


class CPUEmbedding(nn.Module):
    """The token table read from the int8 lm_head (tied embeddings): rows dequantized on lookup, as llama.cpp reads
    its Q8_0 token table; one copy of the table serves both."""

    def __init__(self, head: FusedWeights, dtype: torch.dtype, padding_idx: int | None = None) -> None:
        super().__init__()
        self.head, self.dtype, self.padding_idx = head, dtype, padding_idx
        self.num_embeddings, self.embedding_dim = head.n, head.k

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return embed_rows(self.head, ids, self.dtype)


def embed_rows(head: FusedWeights, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if head.fmt == "int8":
        w, scale = head.tensors
        return (F.embedding(ids, w).to(dtype) * F.embedding(ids, scale[:, None]).to(dtype))
    return F.embedding(ids, head.tensors[0]).to(dtype)


def _quantize_group(modules: Sequence[nn.Linear], fmt: str) -> FusedWeights:
    w = torch.cat([m.weight.detach() for m in modules]) if len(modules) > 1 else modules[0].weight.detach()
    if any(getattr(m, "bias", None) is not None for m in modules):
        raise GenerationError("The CPU path does not implement linear layers with a bias.")
    n, k = w.shape
    if fmt == "int4":
        tensors: tuple[torch.Tensor, ...] = quantize_int4(w)
    elif fmt == "int8":
        tensors = quantize_int8(w)
    else:
        tensors = (w.contiguous(),)
    return FusedWeights(fmt, n, k, tuple(int(m.weight.shape[0]) for m in modules), tensors)


def _repoint(owner: nn.Module, names: Sequence[str], fused: FusedWeights) -> None:
    start = 0
    for name, rows in zip(names, fused.splits, strict=True):
        setattr(owner, name, CPULinear(fused, start, start + rows))
        start += rows


@dataclass
class CPUWeights:
    """What quantize_for_cpu made: per layer [qkv, o, gate_up, down], the lm_head, and the token table the embedding
    reads rows of (the head itself when it is int8 or dense and tied)."""

    fmt: str
    layers: list[list[FusedWeights]]
    head: FusedWeights
    embed: FusedWeights

    @property
    def nbytes(self) -> int:
        tables = [self.head] + ([self.embed] if self.embed is not self.head else [])
        return sum(f.nbytes for layer in self.layers for f in layer) + sum(t.nbytes for t in tables)


def quantize_for_cpu(model: Any, fmt: str, head_fmt: str | None = None) -> CPUWeights:
    """_quantize_for_cpu on a short-lived thread. Why: torch's GNU OpenMP keeps one thread team per calling thread; had
    the loading thread run these parallel ops, its team would outlive them beside the one the engine's worker thread
    decodes with, and with more OpenMP threads than cores libgomp stops spin-waiting: the same decoder measured 34-59
    tok/s on the worker thread against 92-105 with a single team (docs/cpu.md). A thread that exits frees its team."""
    out: dict[str, Any] = {}

    def work() -> None:
        try:
            out["weights"] = _quantize_for_cpu(model, fmt, head_fmt)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller below
            out["error"] = exc

    thread = threading.Thread(target=work, name="cpu-quantize")
    thread.start()
    thread.join()
    if "error" in out:
        raise out["error"]
    return out["weights"]


def _quantize_for_cpu(model: Any, fmt: str, head_fmt: str | None = None) -> CPUWeights:
    """Quantize a llama-family model's linears in place (int4 | int8 | dense = fuse only); the float originals are
    freed module by module. The lm_head takes `head_fmt` (default: HEAD_FORMATS[fmt]); the embedding reads an int8
    (dense for dense) table: the head's own when they are tied and it has that format, else one of its own."""
    inner = model.model
    layers: list[list[FusedWeights]] = []
    head_fmt = head_fmt or HEAD_FORMATS[fmt]
    with torch.no_grad():
        for layer in inner.layers:
            attn, mlp = layer.self_attn, layer.mlp
            qkv = _quantize_group([attn.q_proj, attn.k_proj, attn.v_proj], fmt)
            _repoint(attn, ("q_proj", "k_proj", "v_proj"), qkv)
            o = _quantize_group([attn.o_proj], fmt)
            _repoint(attn, ("o_proj",), o)
            gate_up = _quantize_group([mlp.gate_proj, mlp.up_proj], fmt)
            _repoint(mlp, ("gate_proj", "up_proj"), gate_up)
            down = _quantize_group([mlp.down_proj], fmt)
            _repoint(mlp, ("down_proj",), down)
            layers.append([qkv, o, gate_up, down])
        lm_head = model.get_output_embeddings()
        embed = model.get_input_embeddings()
        tied = lm_head.weight.data_ptr() == embed.weight.data_ptr()
        dtype = embed.weight.dtype
        table_fmt = "dense" if fmt == "dense" else "int8"
        head = _quantize_group([lm_head], head_fmt)
        table = head if tied and head_fmt == table_fmt else _quantize_group([embed], table_fmt)
        model.lm_head = CPULinear(head, 0, head.n)
        model.config.tie_word_embeddings = False  # nothing may re-tie the modules to a float table
        inner.embed_tokens = CPUEmbedding(table, dtype, getattr(embed, "padding_idx", None))
        if table is not head:
            inner.embed_tokens.register_buffer("w0", table.tensors[0], persistent=False)
            if len(table.tensors) > 1:
                inner.embed_tokens.register_buffer("w1", table.tensors[1], persistent=False)
        # What is left of the checkpoint (norms; embeddings for dense) may be views into transformers' memory map of
        # the weights file: give each its own copy, so the map (the whole file, resident once read) is released
        for param in model.parameters():
            param.data = param.data.clone()
    return CPUWeights(fmt, layers, head, table)
