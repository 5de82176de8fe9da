"""The token table and the lm_head in int8 (symmetric, one fp32 scale per vocab row) on the CUDA fast path.

Why: bitsandbytes quantizes the decoder's linears and leaves the embedding and the output layer in the compute
dtype: on Llama-3-8B (128,256 x 4096) that is 2 x 1.05 GB of bf16, more than a third of an 8 GiB card once the
4-bit linears are in. int8 rows halve them (llama.cpp stores the token table in 4-6 bits and the output layer in
6). A tied model (the embedded one) keeps ONE int8 table for both.

`quantize_token_tables` (at load, llm_core.loading) replaces the model's embedding and lm_head modules with
`TableEmbedding` / `TableHead` over an `Int8Table` and frees the half-precision weights, so everything reads the
int8 rows: the fast path's head (llm_core.dense_gemv with row scales at one row, llm_core.int8_mm for the batched
step's 2..32 rows), its embedding gathers (rows dequantized after the gather), and plain `generate` on the same
model (the modules' forward). The int8 tensors are module buffers, so the memory guard's weight count
(llm_core.memory.model.model_weights_bytes) sees them. Accuracy on the embedded model: docs/memory.md.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .kernels.dense_gemv import AVAILABLE as _DENSE_KERNEL_AVAILABLE
from .kernels.int8_mm import MAX_ROWS, int8_rows_reference

log = logging.getLogger(__name__)

QUANTIZE_CHUNK_ROWS = 8192  # rows quantized at once (Llama-3-8B: a 128 MB fp32 temporary, not a 2.1 GB one)


def quantize_rows_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w (N, K) -> (int8 (N, K), fp32 scale (N,)): symmetric per row, scale = absmax / 127, w ~ q * scale."""
    n = w.shape[0]
    q = torch.empty(w.shape, dtype=torch.int8, device=w.device)
    scale = torch.empty(n, dtype=torch.float32, device=w.device)
    for start in range(0, n, QUANTIZE_CHUNK_ROWS):
        part = w[start:start + QUANTIZE_CHUNK_ROWS].float()
        s = (part.abs().amax(-1) / 127).clamp_min(torch.finfo(torch.float32).tiny)
        q[start:start + QUANTIZE_CHUNK_ROWS] = torch.round(part / s[:, None]).clamp_(-127, 127).to(torch.int8)
        scale[start:start + QUANTIZE_CHUNK_ROWS] = s
        del part
    return q, scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The int8 rows as the compute dtype: q * scale rounded once."""
    return (q.float() * scale.float()[..., None]).to(dtype)


class Int8Table(nn.Module):
    """An int8 (vocab, hidden) table with its per-row scales, as buffers (counted with the model's weights)."""

    q: torch.Tensor
    scale: torch.Tensor

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> None:
        super().__init__()
        self.register_buffer("q", q, persistent=False)
        self.register_buffer("scale", scale, persistent=False)
        self.dtype = dtype  # the compute dtype rows and logits come out in

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [self.q, self.scale]


def embed_rows(ids: torch.Tensor, table: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """Token rows of a table given as [weight] (half precision) or [int8 rows, row scales] (dequantized after the
    gather, in `dtype`)."""
    if len(table) == 1:
        return F.embedding(ids, table[0])
    q, scale = table
    return (F.embedding(ids, q).float() * F.embedding(ids, scale[:, None])).to(dtype)


def int8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x (..., K) -> (..., N) in x's dtype over int8 rows: one row through llm_core.dense_gemv, up to MAX_ROWS through
    llm_core.int8_mm (each on the GPU with Triton), more (or off CUDA) dequantized a chunk of rows at a time."""
    flat = x.reshape(-1, x.shape[-1])
    m = flat.shape[0]
    if x.device.type == "cuda" and _DENSE_KERNEL_AVAILABLE and m == 1:
        y = torch.ops.llm_core.dense_gemv(flat, q, None, None, None, 0.0, False, scale)
    elif x.device.type == "cuda" and _DENSE_KERNEL_AVAILABLE and m <= MAX_ROWS:
        y = torch.ops.llm_core.int8_mm(flat, q, scale)
    else:
        y = int8_rows_reference(flat, q, scale)
    return y.view(*x.shape[:-1], q.shape[0])


class TableEmbedding(nn.Module):
    """The model's input embedding over an Int8Table: rows dequantized on lookup."""

    def __init__(self, table: Int8Table, padding_idx: int | None = None) -> None:
        super().__init__()
        self.table, self.padding_idx = table, padding_idx
        self.num_embeddings, self.embedding_dim = int(table.q.shape[0]), int(table.q.shape[1])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return embed_rows(ids, self.table.tensors, self.table.dtype)


class TableHead(nn.Module):
    """The model's lm_head over an Int8Table (weight-only int8: the activations stay in the compute dtype)."""

    def __init__(self, table: Int8Table) -> None:
        super().__init__()
        self.table = table
        self.out_features, self.in_features = int(table.q.shape[0]), int(table.q.shape[1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return int8_linear(x, self.table.q, self.table.scale)


def is_int8_table(module: Any) -> bool:
    return isinstance(module, (TableHead, TableEmbedding))


def table_tensors(embedding: Any) -> list[torch.Tensor]:
    """What embed_rows reads for a model's input embedding: [int8 rows, row scales] or [weight]."""
    if isinstance(embedding, TableEmbedding):
        return embedding.table.tensors
    return [embedding.weight.detach()]


def quantize_token_tables(model: Any) -> dict[str, Any]:
    """Replace a llama-family model's embedding and lm_head with int8 ones in place (one table when they are tied)
    and free their half-precision weights. Returns what was done, for the load report: {"tied", "bytes_before",
    "bytes_after"}. A model whose modules are not a plain nn.Embedding / nn.Linear without bias is left alone
    ({"skipped": why})."""
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    if is_int8_table(embed) and is_int8_table(head):
        return {"skipped": "already int8"}
    if type(embed) is not nn.Embedding or type(head) is not nn.Linear or head.bias is not None:
        return {"skipped": f"{type(embed).__name__} / {type(head).__name__} tables are not quantized"}
    tied = head.weight.data_ptr() == embed.weight.data_ptr()
    dtype = embed.weight.dtype
    before = embed.weight.numel() * embed.weight.element_size() * (1 if tied else 2)
    with torch.no_grad():
        head_table = Int8Table(*quantize_rows_int8(head.weight.detach()), dtype)
        head.weight = None  # the bf16 table goes as soon as its int8 copy exists (peak: one table + int8)
        model.set_output_embeddings(TableHead(head_table))
        del head
        embed_table = head_table if tied else Int8Table(*quantize_rows_int8(embed.weight.detach()), dtype)
        padding_idx = embed.padding_idx
        embed.weight = None
        model.set_input_embeddings(TableEmbedding(embed_table, padding_idx))
        del embed
    model.config.tie_word_embeddings = False  # nothing may re-tie the modules to a half-precision table
    text = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else None
    if text is not None and text is not model.config:
        text.tie_word_embeddings = False
    tables = [head_table] + ([] if tied else [embed_table])
    after = sum(t.q.numel() + t.scale.numel() * 4 for t in tables)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    log.info("Token table and lm_head quantized to int8 (%s): %d -> %d bytes", "tied" if tied else "untied",
             before, after)
    return {"tied": tied, "bytes_before": before, "bytes_after": after}
