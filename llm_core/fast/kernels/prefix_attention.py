"""A later prefill chunk's attention read straight from the paged KV pool (Triton): S new queries at positions
start..start+S-1 over every key 0..start+S-1 of one sequence, causal (query i sees keys up to start + i), K/V read
through the sequence's block table in the pool's own row format (bf16/fp32 rows, or int8 rows of
llm_core.fast.kvquant with their scales applied per row after the dots, as the decode kernel does).

Why: today the paged prefill (llm_core.fast.batched.SlotDecoder.prefill) copies a row's whole prefix out of the pool
into a contiguous temporary per layer, dequantizes it (int8) into another, expands grouped K/V heads (GQA) into a
third, and runs flash attention over 8 K/V heads at a time (layer.PREFIX_HEADS, to bound those temporaries on small
cards). At a 1,024-token chunk (the small-card default) that is 64 programs a call on a 132-SM card: half of it idle,
and the copies repeat for every chunk. This kernel reads the pool in place, no temporary, every head in one launch.

Opt-in until timed: PREFIX_ATTENTION=paged routes the batched path's later prefill chunks through it (the custom op
torch.ops.llm_core.prefix_attention_paged, whose CPU form is the torch reference below); the default stays the
gather + flash path until `python -m bench.prefix_attention --paged` and bench.multiturn on a GPU say it is faster
(docs/prefix_cache.md). Developed on CPU under Triton's interpreter (tests/test_prefix_attention.py).

Program (query block m, K/V head h): BLOCK_M rows, each a (query, query head) pair of the G query heads that share
K/V head h, online softmax (exp2) over key blocks of BLOCK_N up to the block's last query position: each key tile
is read (and int8 rows converted) once for the whole group. The blocks before the chunk's first query need no mask;
the causal mask is applied only from there.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from ...errors import GenerationError
from ..kvquant import dequantize_rows, is_quantized
from .attention import gather_blocks, row_alignment, triton

if triton is not None:
    import triton.language as tl

    from .attention import _int8_rows

    LOG2E = 1.4426950408889634

    @triton.jit
    def _prefix_block(q, acc, m_i, l_i, off, qpos, hi, scale_log2, k_ptr, v_ptr, table_ptr, h, stride_b, stride_l,
                      stride_h, d, D: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr, IEEE: tl.constexpr,
                      INT8: tl.constexpr, ALIGN: tl.constexpr, MASKED: tl.constexpr):
        """One key block [off, off + BLOCK_N) of the online softmax for every query row. MASKED: the block may hold
        keys some query must not see (at or after the chunk's start) or keys past `hi`; else every key is seen."""
        kj = off + tl.arange(0, BLOCK_N)
        kmask = kj < hi
        block = tl.load(table_ptr + kj // PAGE, mask=kmask, other=0)
        rows = tl.multiple_of(block.to(tl.int64) * stride_b + (kj % PAGE) * stride_l + h * stride_h, ALIGN)
        if INT8:  # codes into the dot, each key row's scale on its score (llm_core.fast.kvquant)
            k, k_scale = _int8_rows(k_ptr, rows, d, kmask, D, ALIGN)
            k = k.to(q.dtype)
        else:
            k = tl.load(k_ptr + rows[:, None] + d[None, :], mask=kmask[:, None], other=0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        if INT8:
            s = s * (k_scale * scale_log2)[None, :]
        else:
            s = s * scale_log2
        if MASKED:
            seen = (kj[None, :] <= qpos[:, None]) & kmask[None, :]
            s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite: key 0 is seen by every query
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if INT8:  # each value row's scale on its weight
            v, v_scale = _int8_rows(v_ptr, rows, d, kmask, D, ALIGN)
            v = v.to(q.dtype)
            p = p * v_scale[None, :]
        else:
            v = tl.load(v_ptr + rows[:, None] + d[None, :], mask=kmask[:, None], other=0.0)
        if IEEE:
            pv = tl.dot(p, v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        return acc * alpha[:, None] + pv, m_new, l_i

    # start and S change with every chunk: unspecialized, one compile serves them all (specialized, Triton compiled a
    # variant per divisibility by 16 of each, inside the replies: 1.0-1.1 s TTFT at turns 1-2 on an H100, 2026-12-06)
    @triton.jit(do_not_specialize=["start", "S"])
    def _prefix_attention_kernel(q_ptr, k_ptr, v_ptr, table_ptr, out_ptr, start, S, scale_log2,
                                 stride_qs, stride_qh, stride_os, stride_oh, stride_b, stride_l, stride_h,
                                 G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
                                 BLOCK_N: tl.constexpr, PAGE: tl.constexpr, IEEE: tl.constexpr, INT8: tl.constexpr,
                                 ALIGN: tl.constexpr):
        """Program (query block mb, K/V head h): BLOCK_M rows = BLOCK_M // GP queries x the GP (G rounded up to a
        power of two) query heads h*G.. sharing K/V head h, so each key tile is read (and int8 rows converted) once
        for the whole group. Keys before the chunk's first query (< start, rounded down to a tile) are seen by every
        query: that loop has no mask; the rest (the chunk's own keys) is masked causally."""
        mb = tl.program_id(0)
        h = tl.program_id(1)
        QM: tl.constexpr = BLOCK_M // GP
        r = tl.arange(0, BLOCK_M)
        qi = mb * QM + r // GP
        g = r % GP
        qmask = (qi < S) & (g < G)
        hq = h * G + g
        d = tl.arange(0, D)
        q = tl.load(q_ptr + qi[:, None] * stride_qs + hq[:, None] * stride_qh + d[None, :], mask=qmask[:, None],
                    other=0.0)
        qpos = start + qi
        m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, D), tl.float32)
        hi = tl.minimum(start + (mb + 1) * QM, start + S)  # keys the block's last real query sees
        full = (start // BLOCK_N) * BLOCK_N  # keys [0, full) lie before every query of the chunk
        for off in range(0, full, BLOCK_N):
            acc, m_i, l_i = _prefix_block(q, acc, m_i, l_i, off, qpos, hi, scale_log2, k_ptr, v_ptr, table_ptr, h,
                                          stride_b, stride_l, stride_h, d, D, BLOCK_N, PAGE, IEEE, INT8, ALIGN, False)
        for off in range(full, hi, BLOCK_N):
            acc, m_i, l_i = _prefix_block(q, acc, m_i, l_i, off, qpos, hi, scale_log2, k_ptr, v_ptr, table_ptr, h,
                                          stride_b, stride_l, stride_h, d, D, BLOCK_N, PAGE, IEEE, INT8, ALIGN, True)
        out = acc / l_i[:, None]
        tl.store(out_ptr + qi[:, None] * stride_os + hq[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=qmask[:, None])

PREFIX_BLOCK_M = 64  # query rows per program: queries x the query heads of one K/V head (rounded up to a power of two)
PREFIX_BLOCK_N = 64  # keys per inner step


def prefix_attention_paged(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor, start: int,
                           scale: float, *, block_m: int = PREFIX_BLOCK_M, block_n: int = PREFIX_BLOCK_N,
                           num_warps: int = 4, num_stages: int | None = None) -> torch.Tensor:
    """q (S, Hq, D) at positions start..start+S-1; k/v (num_blocks, page, Hkv, row) the pool (rows of the query's
    dtype, or int8 rows of kvquant); table (max_blocks,) int32: the sequence's blocks, covering positions up to
    start + S - 1 (the chunk's own K/V already written there) -> (S, Hq, D) in q's dtype. block_m: query rows per
    program, each a (query, query head) pair of one K/V head's group (at least the group, rounded up to a power of
    two); block_n: keys per step."""
    if triton is None:
        raise GenerationError("the paged prefix attention needs Triton")
    seq, hq, dim = q.shape
    _, page, hkv, _ = k.shape
    if k.dtype == torch.uint8:
        raise GenerationError("the paged prefix attention reads bf16 or int8 rows, not int4")
    if k.stride() != v.stride() or k.stride(3) != 1 or q.stride(2) != 1:
        raise GenerationError("the paged prefix attention expects K and V pools laid out alike, head_dim contiguous")
    if hq % hkv or table.dtype != torch.int32 or table.dim() != 1 or table.stride(0) != 1:
        raise GenerationError("the paged prefix attention takes Hq a multiple of Hkv and one int32 block table row")
    if -(-(start + seq) // page) > table.numel():
        raise GenerationError(f"the block table ({table.numel()} blocks of {page}) does not reach position "
                              f"{start + seq - 1}")
    out = torch.empty(seq, hq, dim, dtype=q.dtype, device=q.device)
    if seq == 0:
        return out
    groups = hq // hkv
    gp = triton.next_power_of_2(groups)
    rows = max(block_m, gp, 16)  # a tensor-core dot takes 16 rows at least
    launch: dict[str, Any] = dict(G=groups, GP=gp, D=dim, BLOCK_M=rows, BLOCK_N=block_n, PAGE=page,
                                  IEEE=q.dtype == torch.float32, INT8=k.dtype == torch.int8,
                                  ALIGN=row_alignment(k), num_warps=num_warps)
    if num_stages is not None:
        launch["num_stages"] = num_stages
    grid = (triton.cdiv(seq, rows // gp), hkv)
    _prefix_attention_kernel[grid](q, k, v, table, out, start, seq, scale * LOG2E, q.stride(0), q.stride(1),
                                   out.stride(0), out.stride(1), k.stride(0), k.stride(1), k.stride(2), **launch)
    return out


def prefix_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor, start: int,
                               scale: float) -> torch.Tensor:
    """The torch form of prefix_attention_paged, in fp32: the sequence's rows gathered by its table (int8 rows
    dequantized), each K/V head repeated for its query heads, causal softmax with query i at position start + i."""
    seq, hq, dim = q.shape
    end = start + seq
    blocks = table[None, :-(-end // k.shape[1])]  # the blocks holding positions 0..end-1, not the whole table
    keys = gather_blocks(k, blocks)[0, :end]
    values = gather_blocks(v, blocks)[0, :end]
    if is_quantized(keys):
        keys, values = dequantize_rows(keys, torch.float32), dequantize_rows(values, torch.float32)
    groups = hq // keys.shape[1]
    keys = keys.float().repeat_interleave(groups, dim=1)  # (end, Hq, D)
    values = values.float().repeat_interleave(groups, dim=1)
    scores = torch.einsum("shd,thd->hst", q.float(), keys) * scale
    seen = torch.arange(end)[None, :] <= torch.arange(start, end)[:, None]
    probs = torch.softmax(scores.masked_fill(~seen.to(scores.device), float("-inf")), dim=-1)
    return torch.einsum("hst,thd->shd", probs, values).to(q.dtype).contiguous()


@torch.library.custom_op("llm_core::prefix_attention_paged", mutates_args=(),
                         schema="(Tensor q, Tensor k, Tensor v, Tensor table, SymInt start, float scale) -> Tensor")
def _prefix_attention_paged_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor, start: int,
                               scale: float) -> torch.Tensor:
    """The paged prefill's later-chunk attention (llm_core.fast.layer.layer_prefill_paged): the Triton kernel on CUDA
    (and under Triton's interpreter), the torch reference elsewhere."""
    if triton is not None and (q.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
        return prefix_attention_paged(q, k, v, table, start, scale)
    return prefix_attention_reference(q, k, v, table, start, scale)


@_prefix_attention_paged_op.register_fake
def _(q: torch.Tensor, *args: Any) -> torch.Tensor:
    return q.new_empty(q.shape)  # contiguous, as both forms return it (q itself may be a transposed view)
