"""Triton split-K decode attention (flash-decoding): one query token over the cache rows up to its position, read from
each row's own slot or, paged, through a block table from a pool of blocks (one loop body for both: _attn_split)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ...errors import GenerationError
from ...memory.model import STATIC_INT4_GROUP as INT4_GROUP

QUANTIZED_DTYPES = (torch.int8, torch.uint8)  # the int8 and int4 rows of llm_core.fast.kvquant

try:  # the decode attention kernel needs Triton (shipped with CUDA builds of PyTorch); CPU-only installs skip it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

from .pdl import pdl_meta, release_dependents, wait_for_inputs  # noqa: E402 - after the optional Triton import

if triton is not None:

    @triton.jit
    def _quantized_rows(ptr, row, d, lmask, D: tl.constexpr, INT4: tl.constexpr, GROUP4: tl.constexpr,
                        ALIGN: tl.constexpr, BLOCK_L: tl.constexpr):
        """Cache rows at element offsets `row` (BLOCK_L,) dequantized to fp32 (BLOCK_L, D) (llm_core.fast.kvquant):
        int8 = D codes and the exponent of a 2^(e/8) scale at byte D; INT4 = D/2 bytes of nibbles (element 2j low),
        then per GROUP4 values a biased exponent, then per GROUP4 values a zero point (the values Hadamard-rotated).
        Rows that start 4-byte aligned (ALIGN >= 4) read the int8 exponent as the low byte of the 32-bit word at
        byte D (the row's zero padding above it): a word load goes through the asynchronous copy pipeline with the
        codes, where a lone byte load (cp.async copies 4 bytes at least) stalled every step of the loop on its
        latency (paged int8 rows on an H100: 84 µs against 56 for bf16 rows of twice the bytes, 9k tokens)."""
        if INT4:  # each byte, exponent and zero point loaded once, contiguous per row, and widened in registers
            NG: tl.constexpr = D // GROUP4
            j = tl.arange(0, D // 2)
            packed = tl.load(ptr + row[:, None] + j[None, :], mask=lmask[:, None], other=0).to(tl.int32)
            code = tl.reshape(tl.join(packed & 15, packed >> 4), (BLOCK_L, D))  # element 2j low nibble, 2j + 1 high
            g = tl.arange(0, NG)
            meta = ptr + row[:, None] + D // 2 + g[None, :]
            step = tl.exp2((tl.load(meta, mask=lmask[:, None], other=128).to(tl.float32) - 128.0) * 0.125)
            zero = tl.load(meta + NG, mask=lmask[:, None], other=0).to(tl.float32)
            step = tl.reshape(tl.broadcast_to(step[:, :, None], (BLOCK_L, NG, GROUP4)), (BLOCK_L, D))
            zero = tl.reshape(tl.broadcast_to(zero[:, :, None], (BLOCK_L, NG, GROUP4)), (BLOCK_L, D))
            x = (code.to(tl.float32) - zero) * step
        else:
            codes = tl.load(ptr + row[:, None] + d[None, :], mask=lmask[:, None], other=0)
            if ALIGN >= 4:  # little-endian: byte D is the word's low byte; shifted up and back, its sign kept
                word = tl.load((ptr + row + D).to(tl.pointer_type(tl.int32)), mask=lmask, other=0)
                e = ((word << 24) >> 24).to(tl.float32)
            else:
                e = tl.load(ptr + row + D, mask=lmask, other=0).to(tl.float32)
            scale = tl.exp2(e * 0.125)
            x = codes.to(tl.float32) * scale[:, None]
        return x

    @triton.jit
    def _int8_rows(ptr, row, d, lmask, D: tl.constexpr, ALIGN: tl.constexpr):
        """int8 cache rows at element offsets `row` (BLOCK_L,): their D int8 codes (the caller converts them to the
        query's dtype: exact, |code| <= 127) and each row's scale 2^(e/8) in fp32 (BLOCK_L,) (0 for masked rows), to
        apply per row after the dot (llm_core.fast.kvquant; the exponent word as _quantized_rows reads it)."""
        codes = tl.load(ptr + row[:, None] + d[None, :], mask=lmask[:, None], other=0)
        if ALIGN >= 4:
            word = tl.load((ptr + row + D).to(tl.pointer_type(tl.int32)), mask=lmask, other=0)
            e = ((word << 24) >> 24).to(tl.float32)
        else:
            e = tl.load(ptr + row + D, mask=lmask, other=0).to(tl.float32)
        return codes, tl.where(lmask, tl.exp2(e * 0.125), 0.0)

    @triton.jit
    def _hadamard(x, D: tl.constexpr, IEEE: tl.constexpr):
        """x (M, D) fp32 -> x @ H (fp32), H the normalized Walsh-Hadamard matrix (H[i, j] = (-1)^popcount(i & j) /
        sqrt(D), built in registers). Off IEEE the product runs in bf16 on the exact +-1 signs, x split into a bf16
        high and low part (about 16 mantissa bits)."""
        i = tl.arange(0, D)
        bits = i[:, None] & i[None, :]
        bits = bits ^ (bits >> 8)
        bits = bits ^ (bits >> 4)
        bits = bits ^ (bits >> 2)
        bits = bits ^ (bits >> 1)
        sign = (1 - 2 * (bits & 1)).to(tl.float32)
        if IEEE:
            y = tl.dot(x, sign, input_precision="ieee")
        else:
            hi = x.to(tl.bfloat16)
            lo = (x - hi.to(tl.float32)).to(tl.bfloat16)
            sign16 = sign.to(tl.bfloat16)
            y = tl.dot(hi, sign16) + tl.dot(lo, sign16)
        return y * (1.0 / tl.sqrt(D * 1.0))

    @triton.jit
    def _attn_combine_kernel(o_ptr, m_ptr, l_ptr, out_ptr, nsplit, HQ: tl.constexpr, D: tl.constexpr,
                             SP: tl.constexpr, PDL: tl.constexpr = False):
        """Flash-decoding, step 2: merge the splits of one query head (log-sum-exp weights)."""
        wait_for_inputs(PDL)
        r = tl.program_id(0)
        sp = tl.arange(0, SP)
        smask = sp < nsplit
        m = tl.load(m_ptr + sp * HQ + r, mask=smask, other=float("-inf"))
        lsum = tl.load(l_ptr + sp * HQ + r, mask=smask, other=0.0)
        w = tl.exp(m - tl.max(m, axis=0))
        d = tl.arange(0, D)
        o = tl.load(o_ptr + (sp[:, None] * HQ + r) * D + d[None, :], mask=smask[:, None], other=0.0)
        release_dependents(PDL)
        out = tl.sum(o * w[:, None], axis=0) / tl.sum(lsum * w, axis=0)
        tl.store(out_ptr + r * D + d, out.to(out_ptr.dtype.element_ty))

    @triton.jit
    def _attn_split(q_ptr, k_ptr, v_ptr, table_ptr, b, h, sp, length, o_ptr, m_ptr, l_ptr, scale, stride_b,
                    stride_l, stride_h, stride_t, B, HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr,
                    D: tl.constexpr, BLOCK_L: tl.constexpr, IEEE: tl.constexpr, INT8: tl.constexpr,
                    INT4: tl.constexpr, GROUP4: tl.constexpr, PAGE: tl.constexpr, ALIGN: tl.constexpr,
                    PDL: tl.constexpr):
        """Flash-decoding, step 1, for program (row b, kv head h, split s): row b's G query heads over its cache
        rows [s*chunk, min((s+1)*chunk, length)); writes unnormalized output, running max and sum. chunk is row b's
        own: its length over the grid's splits, in whole BLOCK_L steps, so every split of a short row works too (a
        chunk fixed by the captured capacity left a 640-token row in one split of 17 over a 32k pool: 2.5x the time
        of the same row in a 4k slot on the H200). PAGE = 0: row b's
        own slot at b*stride_b; PAGE > 0: position i lives in block table[b, i // PAGE] (int32, row stride stride_t)
        at offset i % PAGE, stride_b then being one block's. Rows past length are never read; a split past it reads
        nothing and leaves (m=-inf, l=0, o=0), which the combine weighs 0. INT8: each row is D int8 codes and, at
        byte D, the exponent e of its scale 2^(e/8) (llm_core.fast.kvquant); the codes go into the dots as they are and
        the scales onto each row's score (K) and weight (V), not onto every element. INT4: rows of
        rotated values (kvquant.quantize_rows4): the query is rotated first and the output rotated back. ALIGN: the
        elements every row start is a multiple of (the strides' common power of two, at most 16), told to the compiler:
        a stride it was not told divides by 16 (an int8 row of D + 4 bytes) otherwise loads a byte at a time.
        PDL: launched as a programmatic dependent launch (llm_core.fast.kernels.pdl); the kernels calling this wait
        before reading pos."""
        hq = HKV * G
        gi = tl.arange(0, GP)
        d = tl.arange(0, D)
        qmask = gi < G
        q = tl.load(q_ptr + (b * hq + h * G + gi)[:, None] * D + d[None, :], mask=qmask[:, None], other=0.0)
        if INT4:
            q = _hadamard(q.to(tl.float32), D, IEEE).to(q.dtype)
        m_i = tl.full((GP,), float("-inf"), tl.float32)
        l_i = tl.zeros((GP,), tl.float32)
        acc = tl.zeros((GP, D), tl.float32)
        chunk = tl.cdiv(tl.cdiv(length, tl.num_programs(2)), BLOCK_L) * BLOCK_L
        start = sp * chunk
        end = tl.minimum(start + chunk, length)
        base = b.to(tl.int64) * stride_b
        for off in range(start, end, BLOCK_L):
            li = off + tl.arange(0, BLOCK_L)
            lmask = li < end
            if PAGE > 0:  # the block table names each position's block: no row of the pool is assumed contiguous
                block = tl.load(table_ptr + b.to(tl.int64) * stride_t + li // PAGE, mask=lmask, other=0)
                rows = block.to(tl.int64) * stride_b + (li % PAGE) * stride_l + h * stride_h
            else:
                rows = base + li * stride_l + h * stride_h
            rows = tl.multiple_of(rows, ALIGN)
            if INT8:  # codes straight into the dot, each row's scale on its score: no per-element multiply
                k, k_scale = _int8_rows(k_ptr, rows, d, lmask, D, ALIGN)
                k = k.to(q.dtype)
            elif INT4:
                k = _quantized_rows(k_ptr, rows, d, lmask, D, INT4, GROUP4, ALIGN, BLOCK_L).to(q.dtype)
            else:
                k = tl.load(k_ptr + rows[:, None] + d[None, :], mask=lmask[:, None], other=0.0)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            if INT8:
                s = s * k_scale[None, :]
            s = tl.where(lmask[None, :], s * scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            pw = p
            if INT8:  # each row's V scale on its weight
                v, v_scale = _int8_rows(v_ptr, rows, d, lmask, D, ALIGN)
                v = v.to(q.dtype)
                pw = p * v_scale[None, :]
            elif INT4:
                v = _quantized_rows(v_ptr, rows, d, lmask, D, INT4, GROUP4, ALIGN, BLOCK_L).to(q.dtype)
            else:
                v = tl.load(v_ptr + rows[:, None] + d[None, :], mask=lmask[:, None], other=0.0)
            if IEEE:
                pv = tl.dot(pw, v, input_precision="ieee")
            else:
                pv = tl.dot(pw.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        release_dependents(PDL)
        if INT4:
            acc = _hadamard(acc, D, IEEE)
        row = (sp * B + b) * hq + h * G + gi  # partials laid out (split, row, query head)
        tl.store(o_ptr + row[:, None] * D + d[None, :], acc, mask=qmask[:, None])
        tl.store(m_ptr + row, m_i, mask=qmask)
        tl.store(l_ptr + row, l_i, mask=qmask)

    @triton.jit
    def _attn_rows_split_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, o_ptr, m_ptr, l_ptr, scale, stride_b, stride_l,
                                stride_h, B, HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
                                BLOCK_L: tl.constexpr, IEEE: tl.constexpr, INT8: tl.constexpr,
                                INT4: tl.constexpr, GROUP4: tl.constexpr, ALIGN: tl.constexpr,
                                PDL: tl.constexpr = False):
        """Step 1 over each row's own cache slot (B, L, Hkv, row) up to pos[b] (_attn_split); rows after pos are
        never read, whatever the captured bucket length. One decode (the single-row path) is this with B = 1."""
        wait_for_inputs(PDL)
        b = tl.program_id(0)
        length = tl.load(pos_ptr + b).to(tl.int32) + 1
        _attn_split(q_ptr, k_ptr, v_ptr, k_ptr, b, tl.program_id(1), tl.program_id(2), length, o_ptr, m_ptr, l_ptr,
                    scale, stride_b, stride_l, stride_h, 0, B, HKV, G, GP, D, BLOCK_L, IEEE, INT8, INT4,
                    GROUP4, 0, ALIGN, PDL)

    @triton.jit
    def _attn_paged_split_kernel(q_ptr, k_ptr, v_ptr, table_ptr, pos_ptr, o_ptr, m_ptr, l_ptr, scale, stride_b,
                                 stride_l, stride_h, stride_t, B, HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr,
                                 D: tl.constexpr, BLOCK_L: tl.constexpr, IEEE: tl.constexpr, INT8: tl.constexpr,
                                 INT4: tl.constexpr, GROUP4: tl.constexpr, PAGE: tl.constexpr, ALIGN: tl.constexpr,
                                 PDL: tl.constexpr = False):
        """Step 1 over a pool of blocks (num_blocks, PAGE, Hkv, row), row b's positions 0..pos[b] through its block
        table (B, max_blocks) int32 (_attn_split)."""
        wait_for_inputs(PDL)
        b = tl.program_id(0)
        length = tl.load(pos_ptr + b).to(tl.int32) + 1
        _attn_split(q_ptr, k_ptr, v_ptr, table_ptr, b, tl.program_id(1), tl.program_id(2), length, o_ptr, m_ptr,
                    l_ptr, scale, stride_b, stride_l, stride_h, stride_t, B, HKV, G, GP, D, BLOCK_L, IEEE,
                    INT8, INT4, GROUP4, PAGE, ALIGN, PDL)

    def _attend_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, scale: float,
                     table: torch.Tensor | None = None, launch: AttentionLaunch | None = None,
                     pdl: bool = False) -> torch.Tensor:
        """q (B, Hq, D); pos (B,) int64 -> (B, Hq, D). table None: k/v (B, T, Hkv, row), each row's own cache slot;
        else k/v (num_blocks, block_size, Hkv, row), a pool read through table (B, max_blocks) int32. launch: the
        split kernel's launch (AttentionLaunch); None takes attention_launch's for the row format and row count
        (what the custom ops do; bench/attention_rows.py --sweep passes others). pdl: every launch a programmatic
        dependent launch (sm_90+, llm_core.fast.kernels.pdl)."""
        _, page, hkv, dim = k.shape
        rows = q.shape[0]
        length = page if table is None else table.shape[1] * page  # the split plan is fixed per captured shape
        if k.dtype in QUANTIZED_DTYPES:  # rows of codes + their scales + padding (llm_core.fast.kvquant)
            dim = q.shape[2]
        hq = q.shape[1]
        if launch is None:
            launch = attention_launch(row_format(k), rows, k.device)
        nsplit = _attention_splits(length, rows * hkv, k.device, launch.programs_per_sm, launch.block_l)
        o = torch.empty(nsplit, rows * hq, dim, dtype=torch.float32, device=q.device)
        m = torch.empty(nsplit, rows * hq, dtype=torch.float32, device=q.device)
        lsum = torch.empty(nsplit, rows * hq, dtype=torch.float32, device=q.device)
        if k.stride() != v.stride() or k.stride(3) != 1:
            raise GenerationError("decode attention expects K and V caches laid out alike, head_dim contiguous")
        groups = hq // hkv
        shapes: dict[str, Any] = dict(
            HKV=hkv, G=groups, GP=max(16, triton.next_power_of_2(groups)), D=dim, BLOCK_L=launch.block_l,
            IEEE=q.dtype == torch.float32, INT8=k.dtype == torch.int8, INT4=k.dtype == torch.uint8, GROUP4=INT4_GROUP,
            ALIGN=row_alignment(k), num_warps=launch.num_warps, **pdl_meta(pdl))
        if launch.num_stages is not None:  # None: Triton's default (3 for CUDA in Triton 3.9)
            shapes["num_stages"] = launch.num_stages
        if table is None:
            _attn_rows_split_kernel[(rows, hkv, nsplit)](
                q.contiguous(), k, v, pos, o, m, lsum, scale, k.stride(0), k.stride(1), k.stride(2), rows,
                **shapes)
        else:
            if page not in PAGED_BLOCK_SIZES or table.dtype != torch.int32 or table.stride(1) != 1:
                raise GenerationError(f"paged decode attention takes blocks of {PAGED_BLOCK_SIZES} tokens and an "
                                      f"int32 block table, not {page}-token blocks and a {table.dtype} table")
            _attn_paged_split_kernel[(rows, hkv, nsplit)](
                q.contiguous(), k, v, table, pos, o, m, lsum, scale, k.stride(0), k.stride(1), k.stride(2),
                table.stride(0), rows, **shapes, PAGE=page)
        out = torch.empty(rows * hq, dim, dtype=q.dtype, device=q.device)
        _attn_combine_kernel[(rows * hq,)](o, m, lsum, out, nsplit, HQ=rows * hq, D=dim,
                                           SP=triton.next_power_of_2(nsplit), **pdl_meta(pdl))
        return out.view(rows, hq, dim)

    @torch.library.custom_op("llm_core::decode_attention_paged", mutates_args=(),
                             schema="(Tensor q, Tensor k, Tensor v, Tensor table, Tensor pos, float scale, "
                                    "bool pdl=False) -> Tensor")
    def _decode_attention_paged_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor,
                                   pos: torch.Tensor, scale: float, pdl: bool = False) -> torch.Tensor:
        """The paged batched fast path's attention: q (B, Hq, D); k/v (num_blocks, block_size, Hkv, row); table
        (B, max_blocks) int32; pos (B,) -> (B, Hq, D). pdl: programmatic dependent launches."""
        return _attend_rows(q, k, v, pos, scale, table, pdl=pdl)

    @_decode_attention_paged_op.register_fake
    def _(q: torch.Tensor, *args: Any) -> torch.Tensor:
        return torch.empty_like(q)

    @torch.library.custom_op("llm_core::decode_attention_rows", mutates_args=(),
                             schema="(Tensor q, Tensor k, Tensor v, Tensor pos, float scale, bool pdl=False) -> Tensor")
    def _decode_attention_rows_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor,
                                  scale: float, pdl: bool = False) -> torch.Tensor:
        """The batched fast path's attention: q (B, Hq, D); k/v (B, T, Hkv, row); pos (B,) -> (B, Hq, D)."""
        return _attend_rows(q, k, v, pos, scale, pdl=pdl)

    @torch.library.custom_op("llm_core::decode_attention", mutates_args=(),
                             schema="(Tensor q, Tensor k, Tensor v, Tensor pos, float scale, bool pdl=False) -> Tensor")
    def _decode_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor,
                             scale: float, pdl: bool = False) -> torch.Tensor:
        """One decode: q (Hq, D); k/v (T, Hkv, row); pos (1,) int64 -> (Hq, D), as one row of the batched form."""
        return _attend_rows(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), pos.reshape(1), scale,
                            pdl=pdl).view(q.shape)

    @_decode_attention_op.register_fake
    def _(q: torch.Tensor, *args: Any) -> torch.Tensor:
        return torch.empty_like(q)

    @_decode_attention_rows_op.register_fake
    def _(q: torch.Tensor, *args: Any) -> torch.Tensor:
        return torch.empty_like(q)


ATTENTION_BLOCK = 64  # cache rows per inner step of the Triton decode attention (AttentionLaunch's default)
PAGED_BLOCK_SIZES = (16, 32, 64)  # tokens per block of the paged pool the kernel reads (a constexpr each)
ROW_FORMATS = ("bf16", "int8", "int4")  # the cache's row formats; "bf16" stands for any floating rows


@dataclass(frozen=True)
class AttentionLaunch:
    """How the split kernel of the decode attention is launched: block_l cache rows per inner step (a power of two,
    at least 16: tl.dot's smallest tile; any multiple or fraction of a paged block works, positions go through the
    table one by one), num_warps and num_stages (None: Triton's default) of the compiled kernel, and about
    programs_per_sm programs per SM over rows * kv heads * splits (_attention_splits). The default is the launch
    before the sweep (bench/attention_rows.py --sweep): int8 rows ran at 1.1 TB/s where bf16 rows ran at 2.6, so
    one launch for every format and row count was not the best one."""

    block_l: int = ATTENTION_BLOCK
    num_warps: int = 4
    num_stages: int | None = None
    programs_per_sm: int = 4

    def __post_init__(self) -> None:
        def power_of_two(n: int, lo: int, hi: int) -> bool:
            return type(n) is int and lo <= n <= hi and n & (n - 1) == 0

        problems = []
        if not power_of_two(self.block_l, 16, 256):
            problems.append(f"block_l {self.block_l!r} (a power of two from 16 to 256)")
        if not power_of_two(self.num_warps, 1, 16):
            problems.append(f"num_warps {self.num_warps!r} (a power of two from 1 to 16)")
        if self.num_stages is not None and not (type(self.num_stages) is int and 1 <= self.num_stages <= 8):
            problems.append(f"num_stages {self.num_stages!r} (None or 1 to 8)")
        if not (type(self.programs_per_sm) is int and 1 <= self.programs_per_sm <= 32):
            problems.append(f"programs_per_sm {self.programs_per_sm!r} (1 to 32)")
        if problems:
            raise GenerationError("invalid decode attention launch: " + ", ".join(problems))


LAUNCH_ROW_BUCKETS = (1, 8, 64)  # a launch per row count up to each; more rows take the last one's
# (row format, rows bucket) -> the split kernel's launch on Hopper (sm_90: H100, H200), where the numbers come from:
# `python -m bench.attention_rows --sweep` on an H100 (paged 16-token blocks, 32 KV heads, head_dim 128, 2k-26k
# tokens): its JSON's `suggested` entry per format and row count (the lowest geometric mean of the time over the
# lengths, relative to the default launch). Until measured, each entry is the launch before the sweep.
ATTENTION_LAUNCHES: dict[tuple[str, int], AttentionLaunch] = {
    ("bf16", 1): AttentionLaunch(block_l=64, num_warps=2, num_stages=4, programs_per_sm=4),  # 0.924x
    ("bf16", 8): AttentionLaunch(block_l=32, num_warps=4, num_stages=None, programs_per_sm=4),  # 0.962x
    ("bf16", 64): AttentionLaunch(),
    ("int8", 1): AttentionLaunch(block_l=64, num_warps=2, num_stages=2, programs_per_sm=8),  # 0.829x
    ("int8", 8): AttentionLaunch(block_l=64, num_warps=2, num_stages=2, programs_per_sm=2),  # 0.864x
    ("int8", 64): AttentionLaunch(),
    ("int4", 1): AttentionLaunch(block_l=32, num_warps=2, num_stages=2, programs_per_sm=8),  # 0.817x
    ("int4", 8): AttentionLaunch(block_l=64, num_warps=2, num_stages=4, programs_per_sm=2),  # 0.784x
    ("int4", 64): AttentionLaunch(),
}
LAUNCH_TABLE_ARCH = 9  # the CUDA compute capability (major) the table was measured on


def row_format(cache: torch.Tensor) -> str:
    """The row format of a K/V cache (ROW_FORMATS): int8 and int4 rows by their dtype (llm_core.fast.kvquant), any
    floating rows "bf16" (fp32 under the interpreter)."""
    return {torch.int8: "int8", torch.uint8: "int4"}.get(cache.dtype, "bf16")


def attention_launch(fmt: str, rows: int, device: torch.device) -> AttentionLaunch:
    """The decode attention's launch for `rows` query rows over a cache of row format `fmt` on `device`: the table
    entry of the smallest rows bucket holding them (ATTENTION_LAUNCHES). The table holds on Hopper, where it was
    measured, and off CUDA (the interpreter runs what the GPU runs, so the CPU tests cover its launches); other GPUs
    keep the default launch, which no sweep there has beaten yet."""
    if fmt not in ROW_FORMATS or type(rows) is not int or rows < 1:
        raise GenerationError(f"no decode attention launch for {rows!r} rows of format {fmt!r} (one of {ROW_FORMATS})")
    if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] != LAUNCH_TABLE_ARCH:
        return AttentionLaunch()
    bucket = next((b for b in LAUNCH_ROW_BUCKETS if rows <= b), LAUNCH_ROW_BUCKETS[-1])
    return ATTENTION_LAUNCHES.get((fmt, bucket), AttentionLaunch())


def gather_blocks(pool: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """The torch reference of the paged read: pool (num_blocks, block_size, Hkv, row) and table (B, max_blocks) ->
    each row's positions in order, (B, max_blocks * block_size, Hkv, row) (a copy)."""
    blocks = pool[table.long()]
    return blocks.reshape(table.shape[0], -1, *pool.shape[2:])


def row_alignment(cache: torch.Tensor) -> int:
    """The largest power of two, at most 16, that divides every stride of `cache` (in elements): what each cache
    row's start is a multiple of (torch's buffers start 16-byte aligned)."""
    align = 16
    while align > 1 and any(s % align for s in cache.stride()[:-1]):
        align //= 2
    return align


def _attention_splits(length: int, kv_heads: int, device: torch.device, programs_per_sm: int = 4,
                      block_l: int = ATTENTION_BLOCK) -> int:
    """Splits per (row, kv head) so that kv_heads * splits is about programs_per_sm programs per SM, at most one per
    block_l rows of the capacity `length` (fixed per captured shape); each row divides its own length among them in
    whole block_l steps (_attn_split). Off CUDA (the interpreter) the device counts as 8 SMs."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8
    target = max(1, -(-programs_per_sm * sms // kv_heads))
    return min(target, -(-length // block_l))


def round_up(n: int, multiple: int) -> int:
    """n rounded up to a multiple of `multiple`."""
    return -(-n // multiple) * multiple
