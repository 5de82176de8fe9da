"""NF4 matmul for 1-32 activation rows over weights repacked once into the tensor cores' own fragment order.

y (M, N) = x (M, K) @ dequantize(W).T, M <= 32, where W is bitsandbytes NF4 (blocksize a multiple of 64, fp32 or
double-quantized absmax, read in place) and the 4-bit codes are repacked (`repack`: the same bytes' worth, the same
codes bit for bit) so that each thread of a warp loads, with one 16-byte load, the codes of exactly the four
`mma.sync.m16n8k16` A fragments it holds for one 64-wide quant block of a 16-row weight tile (Marlin's idea, for
NF4's table instead of int4's arithmetic decode).

Why (issue 24, docs/fast_decode.md): nf4_mm, the small-M kernel over bitsandbytes' own layout, spends ~6.8
instructions a weight at 8 rows and reads the weights at ~0.4 of the copy bandwidth, most of it decoding into
Triton's dot operand layout; the one-token GEMV spends ~5.6 on CUDA-core multiply-adds. Here a thread decodes a
word straight into the four bf16x2 registers of an A fragment (the register-table `prmt` lookup of
nf4_gemv.unpack8_asm), multiplies them by its two rows' block scales (one bf16x2 multiply each) and hands them to
`mma.sync` with the activations as the B fragment (n = 8: 8 rows a tile, 1-4 tiles, no padding to 16; the tiles
share the decode): no shared memory, no layout conversion, 4.4-6.2 instructions a weight. The arithmetic is
nf4_mm's scale16 form (bf16 level times bf16 absmax, rounded once, as bitsandbytes' own 4-bit kernels do),
accumulated in fp32 by the tensor cores.

Repacked layout, (N/16, K/64, 32, 4) int32: tile T (weight rows 16T..16T+15), 64-wide block b, lane l = 4g + t,
k step s. An mma sums over its 16 k in any order, so the k of each step need not be consecutive: as long as the
weights (A) and the activations (B) take the same order, lane (g, t) may hold the 8 activation pairs 8t..8t+7 of the
block (k = 64b + 16t + 2u + e, u = 2s + h), contiguous in x: two 16-byte loads. The PTX ISA's fragments
("Matrix fragments for mma.m16n8k16") then ask of word (T, b, l, s) four bytes, byte p = 2h + r holding rows
g + 8r at k = 64b + 16t + 4s + 2h and the next k, the even k in the high nibble (bitsandbytes' order, what
unpack8_asm decodes into one bf16x2 register, even k in the low half):
  p = 0: row g,     k 16t + 4s + 0, + 1   (A fragment register a0: the step's k 2t, 2t+1)
  p = 1: row g + 8, k 16t + 4s + 0, + 1   (a1)
  p = 2: row g,     k 16t + 4s + 2, + 3   (a2: the step's k 2t+8, 2t+9)
  p = 3: row g + 8, k 16t + 4s + 2, + 3   (a3)
and of the activations b0 = x row g at k 16t + 4s + 0, + 1 and b1 = at + 2, + 3. Lane (g, t)'s accumulators c0,
c1, c2, c3 are y rows 2t, 2t + 1 at weight rows g (c0, c1) and g + 8 (c2, c3).

Program (16-row tile, K split): WARPS warps, warp w taking every WARPS-th 64-block of the split's range; the warps'
sums are added at the end (a reduction through shared memory, once), the splits by nf4_mm.sum_splits.

Status: checked on CPU (the repack and the fragment mapping against the PTX ISA's layout through the PTX emulator of
tests/test_nf4_frag.py, the kernel compiled for sm_90 in every form) and timed on an H100
(bench/results/2026-12-07-s7-h100.md, -s8-h100.md): 73.6 µs a Llama-2-7B layer at 8 rows with its loads ahead
(depth 2, early) against nf4_mm's 100.6; slower than nf4_mm at 32 rows. The engine uses it with NF4_FRAG=on or
auto (off by default: it holds a second copy of the codes).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from .nf4_gemv import sm_count, table_bytes, triton, unpack8_asm
from .pdl import pdl_meta, release_dependents, wait_for_inputs

if triton is not None:
    import triton.language as tl

    from .nf4_gemv import block_scale

FRAG_MAX_ROWS = 32  # up to 4 n8 tiles of activation rows
QBLOCK = 64  # k per repacked block: 4 mma k steps of 16


@dataclass(frozen=True)
class FragConfig:
    """A launch: warps per program (each walks every warps-th 64-block of its split), K splits across programs,
    whether each warp loads the next block's words before decoding the current one (prefetch), and table_regs:
    the decode's 8 table words come from memory (frag_table) into ordinary registers once, at an address ptxas
    cannot prove uniform, instead of immediates that ptxas keeps in uniform registers and copies before every
    `prmt` (8 IMAD.U32 a word in the SASS; the same trick cut the one-token GEMV's instructions by 17% on
    2026-12-06 without changing its time, which was bound by stalls). scale_pairs: each block's scales read as one
    bf16 pair per (tile, block, g) made at load time (scale_pairs(): rows g and g + 8, exactly the bf16 the scale16
    arithmetic rounds the absmax to, so the same result bits) instead of decoding the double-quantized absmax twice
    a block (~40 instructions of ~190 a block in the sm_90 SASS), for 2 bytes a 64-block more than double quant's
    1 (+1.6% of the bytes read, +~100 MB for a 7B model)."""

    warps: int = 4
    split: int = 1
    prefetch: bool = True
    table_regs: bool = False  # the level table read into registers once (frag_table) instead of immediates
    scale_pairs: bool = False  # the block scales read as bf16 pairs made once (scale_pairs) instead of decoded
    depth: int = 1  # consecutive 64-blocks a warp takes per iteration (1, 2 or 4): that many loads in flight
    early: bool = False  # each block's scale pair and first row tile's activations loaded with its words
    warp_tiles: bool = False  # each warp its own weight tile over the whole K range (warps at the same blocks)
    stream: bool = False  # the words loaded evict-first from L1 and L2 (read once a step; the activations stay)


def default_config(n: int, k: int, sms: int = 132, m: int = 8) -> FragConfig:
    """A launch from the H100 sweeps of 2026-12-07 (bench/results/2026-12-07-s7-h100-frag-sweep.json and
    -s8-h100-frag-sweep.json, Llama-2-7B shapes): K split while the grid holds under 4 programs per SM and each warp
    keeps at least 4 blocks to walk (o and down: 4 splits; qkv and gate_up: none), 8 warps a program for the wide
    weights (N >= 8192) up to 8 rows, else 4; up to 8 rows also 2 blocks a warp an iteration with each block's scales
    and activations loaded with its words (depth 2, early: 73.6 against 79.9 µs a layer at 8 rows; at 32 rows they
    cost, and 16 rows was not swept with them). The forms (table_regs, scale_pairs) are the caller's: they need their
    buffers (the engine's op turns both on)."""
    tiles = n // 16
    blocks = k // QBLOCK
    split = 1
    while split < 16 and tiles * split < 4 * sms and blocks // (split * 2 * 4) >= 4:
        split *= 2
    few = m <= 8
    return FragConfig(warps=8 if few and n >= 8192 else 4, split=split, prefetch=True, depth=2 if few else 1,
                      early=few)


def repack(packed: torch.Tensor) -> torch.Tensor:
    """bitsandbytes' NF4 codes, packed (N, K/2) uint8 with the even k in the high nibble -> (N/16, K/64, 32, 4) int32
    in fragment order (the module's docstring): the same codes, moved. N a multiple of 16, K of 64."""
    n, k2 = packed.shape
    k = 2 * k2
    if packed.dtype != torch.uint8 or n % 16 or k % QBLOCK:
        raise ValueError(f"repack takes (N, K/2) uint8 codes with N a multiple of 16 and K of {QBLOCK}, "
                         f"not {tuple(packed.shape)} {packed.dtype}")
    # byte (row, k/2) -> its dimensions: row = 16 T + 8 r + g, k = 64 b + 16 t + 4 s + 2 h + e (e: the nibble)
    v = packed.reshape(n // 16, 2, 8, k // QBLOCK, 4, 4, 2)  # T, r, g, b, t, s, h (one byte holds e = 0, 1)
    v = v.permute(0, 3, 2, 4, 5, 6, 1)  # T, b, g, t, s, h, r: byte p = 2 h + r of word (T, b, lane 4g + t, s)
    return v.contiguous().view(n // 16, k // QBLOCK, 32, 16).view(torch.int32)


def unpack(frag: torch.Tensor) -> torch.Tensor:
    """repack's inverse: (N/16, K/64, 32, 4) int32 -> bitsandbytes' (N, K/2) uint8."""
    tiles, blocks = frag.shape[:2]
    v = frag.contiguous().view(torch.uint8).view(tiles, blocks, 8, 4, 4, 2, 2)  # T, b, g, t, s, h, r
    return v.permute(0, 6, 2, 1, 3, 4, 5).contiguous().view(tiles * 16, blocks * QBLOCK // 2)  # T, r, g, b, t, s, h


def frag_table(levels: Sequence[float], device: torch.device | str) -> torch.Tensor:
    """What FragConfig.table_regs reads: the register table's low words, its high words (nf4_gemv.table_bytes), a
    0 that hides the address from ptxas, as int32 (16 words: one 64-byte line). Made once per weight's owner."""
    lo, hi = table_bytes(list(levels))
    words = [v - (1 << 32) if v >= 1 << 31 else v for v in (*lo, *hi)] + [0] * 8
    return torch.tensor(words, dtype=torch.int32, device=device)


def scale_pairs(absmax: torch.Tensor, n: int, k: int, blocksize: int) -> torch.Tensor:
    """Per-block fp32 absmax (N * K / blocksize, decoded where double-quantized) -> (N/16, K/blocksize, 8) int32:
    word (tile, block, g) = bf16 scale of row 16 tile + g in its low half, of row + 8 in its high half
    (FragConfig.scale_pairs)."""
    check_shapes(n, k, blocksize)
    b16 = absmax.float().reshape(n // 16, 2, 8, k // blocksize).to(torch.bfloat16).view(torch.int16)
    lo, hi = (b16[:, r].to(torch.int32) & 0xFFFF for r in (0, 1))
    return (lo | hi << 16).transpose(1, 2).contiguous()


@functools.lru_cache(maxsize=16)
def frag_asm(code: tuple[float, ...], table_in: bool = False, pairs: bool = False) -> str:
    """PTX for one thread's part of a 64-block: words $4..$7 (k steps 0-3), its rows' fp32 block scales $8 (row g)
    and $9 (row g + 8), the activations $10..$17 (b0, b1 of each step) and the accumulators in $18..$21 -> out in
    $0..$3; table_in: the table's words in $22..$29 (frag_table's order) instead of immediates; pairs: $8 the two
    scales as a bf16 pair (scale_pairs: row g low, row g + 8 high; $9 unused). Each word:
    unpack8_asm's lookup into a0..a3, the scale rounded to bf16 multiplied in (fma with -0.0: the exact product
    rounded once), one mma.sync per step."""
    decode = unpack8_asm(list(code)).replace("$4", "%WORD%")
    for p in range(4):
        decode = decode.replace(f"${p}", f"a{p}")
    if table_in:
        def operand(mt: re.Match[str]) -> str:
            return f"mov.b32 {mt.group(1)}{mt.group(2)}, ${22 + int(mt.group(2)) + 4 * (mt.group(1) == 'H')};"

        decode = re.sub(r"mov\.b32 ([LH])(\d), 0x[0-9a-f]+;", operand, decode)
    scales = (["prmt.b32 sg, $8, 0, 0x1010;", "prmt.b32 sh, $8, 0, 0x3232;"] if pairs else
              ["cvt.rn.bf16x2.f32 sg, $8, $8;", "cvt.rn.bf16x2.f32 sh, $9, $9;"])
    lines = ["{", ".reg .b32 a0, a1, a2, a3, sg, sh, nz;", *scales, "mov.b32 nz, 0x80008000;"]
    for s in range(4):
        lines.append(decode.replace("%WORD%", f"${4 + s}"))
        lines += [f"fma.rn.bf16x2 a{p}, a{p}, {'sg' if p % 2 == 0 else 'sh'}, nz;" for p in range(4)]
        acc_in = "$18, $19, $20, $21" if s == 0 else "$0, $1, $2, $3"
        lines.append(f"mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {{$0, $1, $2, $3}}, {{a0, a1, a2, a3}}, "
                     f"{{${10 + 2 * s}, ${11 + 2 * s}}}, {{{acc_in}}};")
    lines.append("}")
    return "\n".join(lines)


def frag_constraints(table_in: bool = False, pairs: bool = False) -> str:
    """frag_asm's operand constraints: 4 fp32 out; 4 words, 2 scales (fp32, or the pair twice as b32), 8 activation
    pairs, 4 fp32 accumulators in; table_in: 8 table words."""
    ins = ["r"] * 4 + (["r"] * 2 if pairs else ["f"] * 2) + ["r"] * 8 + ["f"] * 4 + (["r"] * 8 if table_in else [])
    return "=f,=f,=f,=f," + ",".join(ins)


if triton is not None:

    @triton.jit
    def _load_table_regs(table_ptr):
        """frag_table's 8 words, one register each, loaded at table + 4 * (thread index AND the 0 after them): an
        address ptxas cannot prove uniform, so it keeps them in ordinary registers."""
        zero = tl.load(table_ptr + 8)
        addr = table_ptr.to(tl.int64, bitcast=True)
        return tl.inline_asm_elementwise(
            "{\n.reg .u32 t;\n.reg .u64 o, a;\nmov.u32 t, %tid.x;\nand.b32 t, t, $9;\nmul.wide.u32 o, t, 4;\n"
            "add.u64 a, $8, o;\nld.global.nc.v4.u32 {$0, $1, $2, $3}, [a];\n"
            "ld.global.nc.v4.u32 {$4, $5, $6, $7}, [a+16];\n}",
            "=r,=r,=r,=r,=r,=r,=r,=r,l,r", [addr, zero], dtype=(tl.int32,) * 8, is_pure=True, pack=1)

    @triton.jit
    def _split4(v):
        """(T, 4) -> its 4 columns as (T,) (split takes the last dim: columns 0, 2 and 1, 3 first)."""
        even, odd = tl.split(tl.reshape(v, (v.shape[0], 2, 2)))
        v0, v2 = tl.split(even)
        v1, v3 = tl.split(odd)
        return v0, v1, v2, v3

    @triton.jit
    def _x_pairs(xp, xm):
        """A thread's 8 activation pairs of one n8 row tile and block (xp: the address of pair 8t of its row, (T,);
        xm its mask) as two (T, 4) loads of 16 bytes (one of 8 would be split over two threads by the load's
        layout)."""
        q = tl.arange(0, 4)
        xa = tl.load(xp[:, None] + q[None, :], mask=xm[:, None], other=0)
        xb = tl.load(xp[:, None] + 4 + q[None, :], mask=xm[:, None], other=0)
        return xa, xb

    @triton.jit
    def _tile_mma(ASM: tl.constexpr, CONSTRAINTS: tl.constexpr, TABLE: tl.constexpr, w0, w1, w2, w3, sg, sh, xa, xb,
                  c0, c1, c2, c3, t0, t1, t2, t3, t4, t5, t6, t7):
        """One n8 tile of activation rows (xa, xb: _x_pairs) through one 64-block: frag_asm. The word decode is the
        same for every tile of a step: ptxas computes it once (sm_90 SASS: a second tile adds ~17 instructions, not
        ~110)."""
        b00, b01, b10, b11 = _split4(xa)
        b20, b21, b30, b31 = _split4(xb)
        if TABLE:
            c0, c1, c2, c3 = tl.inline_asm_elementwise(
                ASM, CONSTRAINTS, [w0, w1, w2, w3, sg, sh, b00, b01, b10, b11, b20, b21, b30, b31, c0, c1, c2, c3,
                                   t0, t1, t2, t3, t4, t5, t6, t7],
                dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True, pack=1)
        else:
            c0, c1, c2, c3 = tl.inline_asm_elementwise(
                ASM, CONSTRAINTS, [w0, w1, w2, w3, sg, sh, b00, b01, b10, b11, b20, b21, b30, b31, c0, c1, c2, c3],
                dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True, pack=1)
        return c0, c1, c2, c3

    @triton.jit
    def _store_rows(s0, s1, s2, s3, n_lo, m0, ok, sid, M, N, y_ptr, part_ptr, bias_ptr, SPLIT: tl.constexpr,
                    HAS_BIAS: tl.constexpr):
        """y rows m0, m0 + 1 at weight rows n_lo (s0, s1) and n_lo + 8 (s2, s3) where ok: bf16 with the bias, or fp32
        partial sums of split sid."""
        if SPLIT == 1:
            if HAS_BIAS:
                s0 += tl.load(bias_ptr + n_lo, mask=ok, other=0).to(tl.float32)
                s1 += tl.load(bias_ptr + n_lo, mask=ok, other=0).to(tl.float32)
                s2 += tl.load(bias_ptr + n_lo + 8, mask=ok, other=0).to(tl.float32)
                s3 += tl.load(bias_ptr + n_lo + 8, mask=ok, other=0).to(tl.float32)
            tl.store(y_ptr + m0 * N + n_lo, s0.to(tl.bfloat16), mask=ok & (m0 < M))
            tl.store(y_ptr + (m0 + 1) * N + n_lo, s1.to(tl.bfloat16), mask=ok & (m0 + 1 < M))
            tl.store(y_ptr + m0 * N + n_lo + 8, s2.to(tl.bfloat16), mask=ok & (m0 < M))
            tl.store(y_ptr + (m0 + 1) * N + n_lo + 8, s3.to(tl.bfloat16), mask=ok & (m0 + 1 < M))
        else:
            base = part_ptr + sid * M * N
            tl.store(base + m0 * N + n_lo, s0, mask=ok & (m0 < M))
            tl.store(base + (m0 + 1) * N + n_lo, s1, mask=ok & (m0 + 1 < M))
            tl.store(base + m0 * N + n_lo + 8, s2, mask=ok & (m0 < M))
            tl.store(base + (m0 + 1) * N + n_lo + 8, s3, mask=ok & (m0 + 1 < M))

    @triton.jit
    def _store_tile(c0, c1, c2, c3, j: tl.constexpr, WARPS: tl.constexpr, WTILES: tl.constexpr, tile, tvalid, sid, M,
                    N, y_ptr, part_ptr, bias_ptr, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr):
        """n8 row tile j's sums: lane (g, t) stores y rows 8j + 2t, + 1 at weight rows 16 tile + g (c0, c1) and + 8
        (c2, c3). The warps' sums added first where they split the K range (tile a scalar); each warp's own where they
        take a weight tile each (WTILES: tile and tvalid per thread)."""
        if WTILES:
            lane = tl.arange(0, 32 * WARPS) % 32
            _store_rows(c0, c1, c2, c3, tile * 16 + lane // 4, 8 * j + 2 * (lane % 4), tvalid, sid, M, N, y_ptr,
                        part_ptr, bias_ptr, SPLIT, HAS_BIAS)
        else:
            s0 = tl.sum(tl.reshape(c0, (WARPS, 32)), axis=0)
            s1 = tl.sum(tl.reshape(c1, (WARPS, 32)), axis=0)
            s2 = tl.sum(tl.reshape(c2, (WARPS, 32)), axis=0)
            s3 = tl.sum(tl.reshape(c3, (WARPS, 32)), axis=0)
            ln = tl.arange(0, 32)
            _store_rows(s0, s1, s2, s3, tile * 16 + ln // 4, 8 * j + 2 * (ln % 4), ln >= 0, sid, M, N, y_ptr,
                        part_ptr, bias_ptr, SPLIT, HAS_BIAS)

    @triton.jit
    def _load_block(wp, sp_ptr, xp, xm, kb, kb_hi, BS: tl.constexpr, EARLY: tl.constexpr, STREAM: tl.constexpr):
        """What a thread loads of block kb before decoding it: its 4 words, (T, 4), one 16-byte load from its tile's
        words wp (zeros where kb >= kb_hi); with EARLY also the block's scale pair (its tile's at sp_ptr) and the
        first row tile's activations (_x_pairs at xp, mask xm), else zeros for them (_block loads them itself)."""
        valid = kb < kb_hi
        kbc = tl.where(valid, kb, 0)
        q = tl.arange(0, 4)
        if STREAM:  # read once a step: first out of L1 and L2 (the activations stay)
            wv = tl.load(wp[:, None] + kbc[:, None] * 128 + q[None, :], mask=valid[:, None], other=0,
                         eviction_policy="evict_first")
        else:
            wv = tl.load(wp[:, None] + kbc[:, None] * 128 + q[None, :], mask=valid[:, None], other=0)
        if EARLY:
            sp = tl.load(sp_ptr + (kbc * 64) // BS * 8, mask=valid, other=0)
            xa, xb = _x_pairs(xp + kbc * 32, valid & xm)
        else:
            sp = tl.zeros_like(kbc)
            xa, xb = tl.zeros_like(wv), tl.zeros_like(wv)
        return wv, sp, xa, xb

    @triton.jit
    def _block(ASM: tl.constexpr, CONSTRAINTS: tl.constexpr, TABLE: tl.constexpr, PAIRS: tl.constexpr,
               NT: tl.constexpr, BS: tl.constexpr, NESTED: tl.constexpr, EARLY: tl.constexpr, wv, sp, xa, xb, kb,
               kb_hi, sp_ptr, row_g, NBLK, absmax_ptr, q8_ptr, absmax2_ptr, offsets_ptr, code2_ptr, xp, xm0, xm1, xm2,
               xm3, XROWS, c00, c01, c02, c03, c10, c11, c12, c13, c20, c21, c22, c23, c30, c31, c32, c33,
               t0, t1, t2, t3, t4, t5, t6, t7):
        """One 64-block kb of the program's tile (_load_block's wv, sp, xa, xb, loaded before; nothing where kb >=
        kb_hi): the block's scales (sp where EARLY), then each of the NT n8 row tiles' activations (xp + 8 XROWS j:
        row tile j's, masks xm0..xm3; the first from xa, xb where EARLY) and mma (_tile_mma)."""
        valid = kb < kb_hi
        kbc = tl.where(valid, kb, 0)
        blk = (kbc * 64) // BS
        w0, w1, w2, w3 = _split4(wv)
        if PAIRS:  # both rows' bf16 scales in one word (the group's 4 lanes read the same one)
            sg = sp if EARLY else tl.load(sp_ptr + blk * 8, mask=valid, other=0)
            sh = sg
        else:
            sg = block_scale(row_g * NBLK + blk, valid, absmax_ptr, q8_ptr, absmax2_ptr, offsets_ptr, code2_ptr,
                             NESTED)
            sh = block_scale((row_g + 8) * NBLK + blk, valid, absmax_ptr, q8_ptr, absmax2_ptr, offsets_ptr,
                             code2_ptr, NESTED)
            sg = tl.where(valid, sg, 0.0)
            sh = tl.where(valid, sh, 0.0)
        xo = xp + kbc * 32  # the thread's 8 pairs 8t + u of the block, u = 2s + h: b0 / b1 of step s
        if not EARLY:
            xa, xb = _x_pairs(xo, valid & xm0)
        c00, c01, c02, c03 = _tile_mma(ASM, CONSTRAINTS, TABLE, w0, w1, w2, w3, sg, sh, xa, xb,
                                       c00, c01, c02, c03, t0, t1, t2, t3, t4, t5, t6, t7)
        if NT >= 2:
            ya, yb = _x_pairs(xo + 8 * XROWS, valid & xm1)
            c10, c11, c12, c13 = _tile_mma(ASM, CONSTRAINTS, TABLE, w0, w1, w2, w3, sg, sh, ya, yb,
                                           c10, c11, c12, c13, t0, t1, t2, t3, t4, t5, t6, t7)
        if NT >= 4:
            ya, yb = _x_pairs(xo + 16 * XROWS, valid & xm2)
            c20, c21, c22, c23 = _tile_mma(ASM, CONSTRAINTS, TABLE, w0, w1, w2, w3, sg, sh, ya, yb,
                                           c20, c21, c22, c23, t0, t1, t2, t3, t4, t5, t6, t7)
            ya, yb = _x_pairs(xo + 24 * XROWS, valid & xm3)
            c30, c31, c32, c33 = _tile_mma(ASM, CONSTRAINTS, TABLE, w0, w1, w2, w3, sg, sh, ya, yb,
                                           c30, c31, c32, c33, t0, t1, t2, t3, t4, t5, t6, t7)
        return c00, c01, c02, c03, c10, c11, c12, c13, c20, c21, c22, c23, c30, c31, c32, c33

    @triton.jit(do_not_specialize=["M"])
    def _nf4_frag_kernel(x_ptr, w_ptr, absmax_ptr, q8_ptr, absmax2_ptr, offsets_ptr, code2_ptr, bias_ptr, y_ptr,
                         part_ptr, table_ptr, spair_ptr, M, N, K, NBLK, BS: tl.constexpr, NESTED: tl.constexpr,
                         HAS_BIAS: tl.constexpr, ASM: tl.constexpr, CONSTRAINTS: tl.constexpr, WARPS: tl.constexpr,
                         SPLIT: tl.constexpr, STEPS: tl.constexpr, PREFETCH: tl.constexpr, TABLE: tl.constexpr,
                         PAIRS: tl.constexpr, NT: tl.constexpr, DEPTH: tl.constexpr = 1, EARLY: tl.constexpr = False,
                         WTILES: tl.constexpr = False, STREAM: tl.constexpr = False, PDL: tl.constexpr = False):
        """Program (tile, split): weight rows 16 tile .. + 15 over the split's 64-blocks, for NT (1, 2 or 4) n8
        tiles of activation rows (M <= 8 NT); x_ptr is x (M, K) bf16 seen as int32 pairs. Thread i of the program
        is lane i % 32 of warp i // 32 (one element per thread). Each iteration a warp takes DEPTH (1, 2 or 4)
        consecutive 64-blocks, the warps interleaved by DEPTH blocks; PREFETCH loads the next iteration's words
        (DEPTH 16-byte loads a thread) before the current ones are decoded."""
        T: tl.constexpr = 32 * WARPS
        sid = tl.program_id(1)
        tid = tl.arange(0, T)
        lane = tid % 32
        warp = tid // 32
        g = lane // 4
        t = lane % 4
        NB64 = K // 64
        per = tl.cdiv(NB64, SPLIT)
        kb_lo = sid * per
        kb_hi = tl.minimum(kb_lo + per, NB64)
        if WTILES:  # warp w: weight tile WARPS p + w over the whole range (none past N: an empty range)
            tile = tl.program_id(0) * WARPS + warp
            tvalid = tile < N // 16
            tile = tl.where(tvalid, tile, 0)
            kb_hi = tl.where(tvalid, kb_hi, kb_lo)
            woff = warp * 0  # every warp at the same blocks
        else:  # the program's one tile, its warps interleaved over the range
            tile = tl.program_id(0)
            tvalid = tid >= 0
            woff = warp
        WSTRIDE: tl.constexpr = 1 if WTILES else WARPS  # blocks between a warp's iterations, in DEPTH units
        # this thread's pointers: its tile's words (lane's 16 bytes of block 0), its rows' scale pairs (block 0),
        # activation row g's pair 8t (block 0; row tile j adds 8 j rows); row tile j's mask
        wp = w_ptr + (tile * NB64 * 32 + lane) * 4
        sp_ptr = spair_ptr + tile * NBLK * 8 + g
        xp = x_ptr + g * (K // 2) + 8 * t
        xm0, xm1, xm2, xm3 = g < M, g + 8 < M, g + 16 < M, g + 24 < M
        row_g = tile * 16 + g
        zf = tl.zeros((T,), tl.float32)
        c00, c01, c02, c03 = zf, zf, zf, zf
        c10, c11, c12, c13 = zf, zf, zf, zf
        c20, c21, c22, c23 = zf, zf, zf, zf
        c30, c31, c32, c33 = zf, zf, zf, zf
        z = tl.zeros((T,), tl.int32)
        # the bundles (_load_block) of the iteration's DEPTH blocks: words, scale pair, first row tile's activations
        kb = kb_lo + woff * DEPTH
        w0, s0, a0, b0 = _load_block(wp, sp_ptr, xp, xm0, kb, kb_hi, BS, EARLY, STREAM)
        w1, s1, a1, b1 = w0, s0, a0, b0
        w2, s2, a2, b2 = w0, s0, a0, b0
        w3, s3, a3, b3 = w0, s0, a0, b0
        if DEPTH >= 2:
            w1, s1, a1, b1 = _load_block(wp, sp_ptr, xp, xm0, kb + 1, kb_hi, BS, EARLY, STREAM)
        if DEPTH >= 4:
            w2, s2, a2, b2 = _load_block(wp, sp_ptr, xp, xm0, kb + 2, kb_hi, BS, EARLY, STREAM)
            w3, s3, a3, b3 = _load_block(wp, sp_ptr, xp, xm0, kb + 3, kb_hi, BS, EARLY, STREAM)
        t0, t1, t2, t3, t4, t5, t6, t7 = z, z, z, z, z, z, z, z
        if TABLE:
            t0, t1, t2, t3, t4, t5, t6, t7 = _load_table_regs(table_ptr)
            # the table words as tensors of the accumulators' shape
            t0, t1, t2, t3, t4, t5, t6, t7 = t0 + z, t1 + z, t2 + z, t3 + z, t4 + z, t5 + z, t6 + z, t7 + z
        wait_for_inputs(PDL)
        for i in range(STEPS):
            kb = kb_lo + (woff + i * WSTRIDE) * DEPTH
            nkb = kb + WSTRIDE * DEPTH
            if PREFETCH:  # the next iteration's bundles before this one's are decoded
                nw0, ns0, na0, nb0 = _load_block(wp, sp_ptr, xp, xm0, nkb, kb_hi, BS, EARLY, STREAM)
                if DEPTH >= 2:
                    nw1, ns1, na1, nb1 = _load_block(wp, sp_ptr, xp, xm0, nkb + 1, kb_hi, BS, EARLY, STREAM)
                if DEPTH >= 4:
                    nw2, ns2, na2, nb2 = _load_block(wp, sp_ptr, xp, xm0, nkb + 2, kb_hi, BS, EARLY, STREAM)
                    nw3, ns3, na3, nb3 = _load_block(wp, sp_ptr, xp, xm0, nkb + 3, kb_hi, BS, EARLY, STREAM)
            # one _block per block of the iteration, written out: a Triton kernel holds no array of register bundles
            (c00, c01, c02, c03, c10, c11, c12, c13, c20, c21, c22, c23, c30, c31, c32, c33) = _block(
                ASM, CONSTRAINTS, TABLE, PAIRS, NT, BS, NESTED, EARLY, w0, s0, a0, b0, kb, kb_hi, sp_ptr, row_g,
                NBLK, absmax_ptr, q8_ptr, absmax2_ptr, offsets_ptr, code2_ptr, xp, xm0, xm1, xm2, xm3, K // 2,
                c00, c01, c02, c03, c10, c11, c12, c13, c20, c21, c22, c23, c30, c31, c32, c33,
                t0, t1, t2, t3, t4, t5, t6, t7)
            if DEPTH >= 2:
                (c00, c01, c02, c03, c10, c11, c12, c13, c20, c21, c22, c23, c30, c31, c32, c33) = _block(
                    ASM, CONSTRAINTS, TABLE, PAIRS, NT, BS, NESTED, EARLY, w1, s1, a1, b1, kb + 1, kb_hi, sp_ptr, row_g,
                    NBLK, absmax_ptr, q8_ptr, absmax2_ptr, offsets_ptr, code2_ptr, xp, xm0, xm1, xm2, xm3, K // 2,
                    c00, c01, c02, c03, c10, c11, c12, c13, c20, c21, c22, c23, c30, c31, c32, c33,
                    t0, t1, t2, t3, t4, t5, t6, t7)
            if DEPTH >= 4:
                (c00, c01, c02, c03, c10, c11, c12, c13, c20, c21, c22, c23, c30, c31, c32, c33) = _block(
                    ASM, CONSTRAINTS, TABLE, PAIRS, NT, BS, NESTED, EARLY, w2, s2, a2, b2, kb + 2, kb_hi, sp_ptr, row_g,
                    NBLK, absmax_ptr, q8_ptr, absmax2_ptr, offsets_ptr, code2_ptr, xp, xm0, xm1, xm2, xm3, K // 2,
                    c00, c01, c02, c03, c10, c11, c12, c13, c20, c21, c22, c23, c30, c31, c32, c33,
                    t0, t1, t2, t3, t4, t5, t6, t7)
                (c00, c01, c02, c03, c10, c11, c12, c13, c20, c21, c22, c23, c30, c31, c32, c33) = _block(
                    ASM, CONSTRAINTS, TABLE, PAIRS, NT, BS, NESTED, EARLY, w3, s3, a3, b3, kb + 3, kb_hi, sp_ptr, row_g,
                    NBLK, absmax_ptr, q8_ptr, absmax2_ptr, offsets_ptr, code2_ptr, xp, xm0, xm1, xm2, xm3, K // 2,
                    c00, c01, c02, c03, c10, c11, c12, c13, c20, c21, c22, c23, c30, c31, c32, c33,
                    t0, t1, t2, t3, t4, t5, t6, t7)
            if PREFETCH:
                w0, s0, a0, b0 = nw0, ns0, na0, nb0
                if DEPTH >= 2:
                    w1, s1, a1, b1 = nw1, ns1, na1, nb1
                if DEPTH >= 4:
                    w2, s2, a2, b2 = nw2, ns2, na2, nb2
                    w3, s3, a3, b3 = nw3, ns3, na3, nb3
            else:
                w0, s0, a0, b0 = _load_block(wp, sp_ptr, xp, xm0, nkb, kb_hi, BS, EARLY, STREAM)
                if DEPTH >= 2:
                    w1, s1, a1, b1 = _load_block(wp, sp_ptr, xp, xm0, nkb + 1, kb_hi, BS, EARLY, STREAM)
                if DEPTH >= 4:
                    w2, s2, a2, b2 = _load_block(wp, sp_ptr, xp, xm0, nkb + 2, kb_hi, BS, EARLY, STREAM)
                    w3, s3, a3, b3 = _load_block(wp, sp_ptr, xp, xm0, nkb + 3, kb_hi, BS, EARLY, STREAM)
        release_dependents(PDL)
        _store_tile(c00, c01, c02, c03, 0, WARPS, WTILES, tile, tvalid, sid, M, N, y_ptr, part_ptr, bias_ptr, SPLIT,
                    HAS_BIAS)
        if NT >= 2:
            _store_tile(c10, c11, c12, c13, 1, WARPS, WTILES, tile, tvalid, sid, M, N, y_ptr, part_ptr, bias_ptr,
                        SPLIT, HAS_BIAS)
        if NT >= 4:
            _store_tile(c20, c21, c22, c23, 2, WARPS, WTILES, tile, tvalid, sid, M, N, y_ptr, part_ptr, bias_ptr,
                        SPLIT, HAS_BIAS)
            _store_tile(c30, c31, c32, c33, 3, WARPS, WTILES, tile, tvalid, sid, M, N, y_ptr, part_ptr, bias_ptr,
                        SPLIT, HAS_BIAS)


def row_tiles(m: int) -> int:
    """The kernel's n8 tiles of activation rows for m rows: 1, 2 or 4."""
    return 1 if m <= 8 else 2 if m <= 16 else 4


def launch_constexprs(n: int, k: int, blocksize: int, cfg: FragConfig, levels: Sequence[float], nested: bool,
                      has_bias: bool, m: int = 8) -> dict[str, Any]:
    """The kernel's constexpr arguments for a launch (nf4_frag passes them; the compile test uses the same)."""
    blocks = k // QBLOCK
    split = max(1, min(cfg.split, blocks))
    per = -(-blocks // split)
    return dict(BS=blocksize, NESTED=nested, HAS_BIAS=has_bias,
                ASM=frag_asm(tuple(float(v) for v in levels), cfg.table_regs, cfg.scale_pairs),
                CONSTRAINTS=frag_constraints(cfg.table_regs, cfg.scale_pairs), WARPS=cfg.warps,
                SPLIT=split, STEPS=-(-per // ((1 if cfg.warp_tiles else cfg.warps) * cfg.depth)),
                PREFETCH=cfg.prefetch, TABLE=cfg.table_regs, PAIRS=cfg.scale_pairs, NT=row_tiles(m), DEPTH=cfg.depth,
                EARLY=cfg.early, WTILES=cfg.warp_tiles, STREAM=cfg.stream)


def tiles_shape(n: int, k: int, blocksize: int) -> bool:
    """Whether the kernel tiles an (N, K) weight of this blocksize: N a multiple of 16, K and the blocksize of 64."""
    return not (n % 16 or k % QBLOCK or blocksize % QBLOCK)


def copy_bytes(n: int, k: int, blocksize: int) -> int:
    """Device bytes of what the kernel reads beside bitsandbytes' own tensors for an (N, K) weight: repack's codes
    (N K / 2), scale_pairs' words (2 bytes a block) and frag_table's 16 words; 0 where it does not tile the shape."""
    return n * k // 2 + 2 * (n * k // blocksize) + 64 if tiles_shape(n, k, blocksize) else 0


def check_shapes(n: int, k: int, blocksize: int) -> None:
    if not tiles_shape(n, k, blocksize):
        raise ValueError(f"the fragment-order NF4 kernel needs N a multiple of 16 and K and the blocksize of "
                         f"{QBLOCK}, not N {n}, K {k}, blocksize {blocksize}")


def nf4_frag(x: torch.Tensor, frag: torch.Tensor, blocksize: int, levels: Sequence[float], *,
             absmax: torch.Tensor | None = None,
             nested: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
             bias: torch.Tensor | None = None, config: FragConfig | None = None, pdl: bool = False,
             table: torch.Tensor | None = None, pairs: torch.Tensor | None = None) -> torch.Tensor:
    """x (M, K) bf16, 1 <= M <= 32 -> (M, N) bf16 = x @ W.T with W's codes in `frag` (repack) and its absmax as
    nf4_mm takes them (fp32 `absmax`, or `nested` = (q8, absmax2, offset per 256-block, code2)); `levels` the 16
    NF4 levels as host floats (the PTX's register table); `table`: frag_table(levels) on x's device, for a config
    with table_regs; `pairs`: scale_pairs(absmax) for a config with scale_pairs (absmax / nested then unused)."""
    from .nf4_mm import sum_splits

    if triton is None:
        raise RuntimeError("nf4_frag needs Triton")
    m, k = x.shape
    n = frag.shape[0] * 16
    check_shapes(n, k, blocksize)
    if frag.shape != (n // 16, k // QBLOCK, 32, 4) or frag.dtype != torch.int32:
        raise ValueError(f"frag must be repack()'s (N/16, K/64, 32, 4) int32 for K {k}, not {tuple(frag.shape)}")
    if x.dtype != torch.bfloat16 or not 1 <= m <= FRAG_MAX_ROWS:
        raise ValueError(f"nf4_frag reads 1-{FRAG_MAX_ROWS} bf16 rows, not {m} of {x.dtype}")
    cfg = config or default_config(n, k, sm_count(x.device.index) if x.is_cuda else 132, m)
    if cfg.depth not in (1, 2, 4):
        raise ValueError(f"FragConfig.depth is 1, 2 or 4 blocks, not {cfg.depth}")
    if cfg.table_regs and (table is None or table.dtype != torch.int32 or table.numel() < 16
                           or table.device != x.device):
        raise ValueError("a table_regs config needs table=frag_table(levels, device) on x's device")
    if cfg.scale_pairs and (pairs is None or pairs.shape != (n // 16, k // blocksize, 8)
                            or pairs.dtype != torch.int32 or pairs.device != x.device):
        raise ValueError("a scale_pairs config needs pairs=scale_pairs(absmax, N, K, blocksize) on x's device")
    meta = launch_constexprs(n, k, blocksize, cfg, levels, nested is not None, bias is not None, m)
    split = meta["SPLIT"]
    x = x.contiguous()
    y = torch.empty(m, n, dtype=torch.bfloat16, device=x.device)
    part = y if split == 1 else torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    q8, absmax2, offsets, code2 = nested if nested is not None else (y, y, y, y)
    programs = -(-n // (16 * cfg.warps)) if cfg.warp_tiles else n // 16
    _nf4_frag_kernel[(programs, split)](
        x.view(torch.int32), frag, absmax if absmax is not None else y, q8, absmax2, offsets, code2,
        bias if bias is not None else y, y, part, table if table is not None else y,
        pairs if pairs is not None else y, m, n, k, k // blocksize,
        num_warps=cfg.warps, **meta,
        **pdl_meta(pdl))
    if split > 1:
        sum_splits(part, bias, y, pdl)
    return y


def compile_without_device(m: int, n: int, k: int, blocksize: int, cfg: FragConfig, levels: Sequence[float],
                           nested: bool, has_bias: bool = False, arch: int = 90, pdl: bool = False) -> Any:
    """Compile (not run) the kernel for sm_`arch` on any machine, with nf4_frag's argument types and the launcher's
    16-divisibility (for the compile test and the SASS count)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    check_shapes(n, k, blocksize)
    meta = launch_constexprs(n, k, blocksize, cfg, levels, nested, has_bias, m)
    meta["PDL"] = pdl
    out = "*bf16"
    ints = {"M": m, "N": n, "K": k, "NBLK": k // blocksize}
    signature = {"x_ptr": "*i32", "w_ptr": "*i32", "absmax_ptr": out if nested else "*fp32", "q8_ptr": "*u8",
                 "absmax2_ptr": "*fp32", "offsets_ptr": "*fp32", "code2_ptr": "*fp32",
                 "bias_ptr": "*bf16" if has_bias else out, "y_ptr": out,
                 "part_ptr": "*fp32" if meta["SPLIT"] > 1 else out, "table_ptr": "*i32" if cfg.table_regs else out,
                 "spair_ptr": "*i32" if cfg.scale_pairs else out,
                 **{name: "i32" for name in ints}}
    names = list(_nf4_frag_kernel.arg_names)
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a, t in signature.items() if t.startswith("*")}
    attrs.update({(names.index(a),): [["tt.divisibility", 16]] for a, v in ints.items() if a != "M" and v % 16 == 0})
    signature.update({name: "constexpr" for name in meta})
    return triton.compile(ASTSource(fn=_nf4_frag_kernel, signature=signature, constexprs=meta, attrs=attrs),
                          target=GPUTarget("cuda", arch, 32), options={"num_warps": cfg.warps})


if triton is not None:

    @torch.library.custom_op(
        "llm_core::nf4_frag", mutates_args=(),
        schema="(Tensor x, Tensor frag, Tensor table, Tensor pairs, Tensor? bias, int blocksize, float[] levels, "
               "bool pdl=False) -> Tensor")
    def _nf4_frag_op(x: torch.Tensor, frag: torch.Tensor, table: torch.Tensor, pairs: torch.Tensor,
                     bias: torch.Tensor | None, blocksize: int, levels: Sequence[float], pdl: bool = False
                     ) -> torch.Tensor:
        """The kernel as one opaque op for torch.compile and CUDA graphs, as the engine holds a linear with
        NF4_FRAG=on (pack.frag_of): its default_config with the table in registers and the scale pairs."""
        n, k = frag.shape[0] * 16, x.shape[-1]
        cfg = replace(default_config(n, k, sm_count(x.device.index) if x.is_cuda else 132, x.shape[0]),
                      table_regs=True, scale_pairs=True)
        return nf4_frag(x, frag, blocksize, levels, bias=bias, config=cfg, pdl=pdl, table=table, pairs=pairs)

    @_nf4_frag_op.register_fake
    def _(x: torch.Tensor, frag: torch.Tensor, *args: Any) -> torch.Tensor:
        return x.new_empty(x.shape[0], frag.shape[0] * 16)
