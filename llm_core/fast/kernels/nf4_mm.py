"""Small-M NF4 matmul in Triton: y (M, N) = x (M, K) @ dequantize(W).T for 1 <= M <= 32 rows, every 4-bit weight
read from memory once for all rows, bitsandbytes' own layout read in place (nothing repacked, nothing extra held).

W is bitsandbytes NF4 as the fast path packs it (llm_core.fast.pack): `words` (N, K/8) int32, a view of the
(N, K/2) uint8 bytes, 8 weights per word; byte p of word j holds k = 8j + 2p in its high nibble and 8j + 2p + 1 in
its low nibble. One absmax per `blocksize` consecutive k of a row, fp32 or double-quantized (uint8 index into
`code2`, times a per-256-block scale, plus that block's offset): the fused q/k/v and gate/up weights are their
parts' rows concatenated, each part keeping its own second-level scales, which the per-256-block offsets carry.

Program (n tile, k split) walks its K range in BLOCK_K steps: loads a (BLOCK_N, BLOCK_K/8) tile of words
(128-byte rows at BLOCK_K = 256), decodes it to (BLOCK_N, BLOCK_K) levels in k order, multiplies each quant block by
its absmax in fp32 and rounds to bf16 (what dequantize_4bit writes), and feeds all rows through one tensor-core dot
(DOT) or, for M <= 4, broadcast multiply-adds on the CUDA cores (no 16-row padding of the MMA).

Decoding the 16 NF4 levels (DECODE):
  "gather": `tl.gather` from the 16-entry level table (GemLite's pattern for its 4-bit tables); runs everywhere,
            the Triton interpreter on CPU included.
  "asm":    the table held in registers and looked up by byte permutes (`prmt`), 8 weights per few instructions
            (llm_core.fast.kernels.nf4_gemv.unpack8_asm); CUDA only (inline PTX).

Split-K (SPLIT > 1, for grids that would otherwise leave multiprocessors idle: N = 4096 at BLOCK_N = 64 is 64
programs for 132 SMs): each split writes fp32 partial sums to its own slice of a (SPLIT, M, N) buffer, and they are
summed in a fixed split order and written as bf16 (+ bias), so the result is the same bits on every run (the
start-up pick's accuracy check and the tests compare exact reruns; atomic adds into a zeroed fp32 output would not
be, and need a zeroing and a conversion launch). Who sums:
  MMConfig.fuse_splits with a counters buffer (default_config's choice at 5-16 rows, FUSE_ROWS; pack_linears gives
  every NF4 linear one): the last program of each n tile to finish, found by an atomic count per tile, sums that
  tile's partials inside the same launch (_finish_splits), and leaves its counter at zero for the next launch: no
  second kernel (the 2026-12-05 profile of the 8-row step: 128 _sum_splits launches per step, 0.22 ms of its 4.6);
  otherwise: a second small kernel, _sum_splits.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .nf4_gemv import rows_shapes, sm_count, triton, unpack8_asm
from .pdl import pdl_meta, prefetch_weight_rows, release_dependents, wait_for_inputs

if triton is not None:
    import triton.language as tl

    from .nf4_gemv import block_scale, tile_rows

MM_MAX = 32  # the largest M the kernel serves (the batched fast path's largest batch bucket)
FUSE_ROWS = (5, 16)  # default_config sums the K splits inside the launch for this many rows (its docstring says why)
DECODES = ("gather", "asm")


@dataclass(frozen=True)
class MMConfig:
    """One launch shape: tile sizes (BLOCK_N weight rows x BLOCK_K inputs per step), K splits, warps, pipeline
    stages, and whether the rows go through a tensor-core dot (False: CUDA-core multiply-adds, M <= 4 only).

    Loop forms (False: the older form, kept selectable; docs/fast_decode.md "Fewer instructions per weight"):
      even:    no per-element masks in the K loop where the shape allows it (K a multiple of BLOCK_K, so every
               split's range is whole steps; N a multiple of BLOCK_N); the same result bits.
      xvec:    activation rows clamped to M - 1 instead of masked (the padding rows' outputs are never stored) and
               the K mask made uniform over 8 inputs, so x loads as 16-byte vectors; the same result bits.
      scale16: the block scale rounded to bf16 and applied to bf16 pairs (`mul.rn.bf16x2` inside the "asm" decode,
               the same bf16 arithmetic in "gather"): one rounding more than dequantize_4bit's fp32 product,
               as bitsandbytes' own 4-bit kernels do (bf16 absmax times bf16 level).
      asm_scale: (without scale16) the "asm" decode takes the fp32 block scale and hands out bf16 weights: the
               older arithmetic and the same bits (bf16 level widened, fp32 product, rounded to bf16), but the
               weights reach the dot in bf16 from the asm ("gather": no effect).
      fuse_splits: (split > 1) the splits are summed inside the launch by each tile's last program, where the call
               passes a counters buffer (nf4_mm's `counters`); the same bits as the _sum_splits kernel."""

    block_n: int = 64
    block_k: int = 256
    split: int = 1
    warps: int = 4
    stages: int = 3
    dot: bool = True
    even: bool = False
    xvec: bool = False
    scale16: bool = False
    asm_scale: bool = False
    fuse_splits: bool = False

    def as_list(self) -> list[int]:
        return [self.block_n, self.block_k, self.split, self.warps, self.stages, int(self.dot), int(self.even),
                int(self.xvec), int(self.scale16), int(self.asm_scale), int(self.fuse_splits)]

    @classmethod
    def from_list(cls, v: Sequence[int]) -> MMConfig:
        """The inverse of as_list; a shorter list (from before the loop forms or the fused split sum) keeps the
        older forms."""
        flags = [bool(f) for f in v[6:11]] + [False] * (11 - max(6, len(v)))
        return cls(int(v[0]), int(v[1]), int(v[2]), int(v[3]), int(v[4]), bool(v[5]), *flags)

    def replace(self, **kw: Any) -> MMConfig:
        return dataclasses.replace(self, **kw)


def default_config(m: int, n: int, k: int, sms: int = 132) -> MMConfig:
    """A launch shape for (M, N, K) without tuning, fit to the H100 sweep of 2026-12-05
    (bench/results/2026-12-05-s3-h100-small-m.json: 4 linears x 2 models x M = 1..32, 127 variants each): 64 x 128
    tiles, 4 warps, 3 pipeline stages and the loop forms even + xvec + scale16 (712 -> 435 loop instructions on
    sm_90, bench/nf4_mm_sass.py) for every M; K split in two at least, then again while the grid holds fewer than
    1.5 programs per SM or a program would walk more than 16 K steps (N = 4096, K = 4096: 4 splits; K = 11008: 8;
    N = 12288 or 22016: 2). Over the sweep this rule is within 4% of the best config per layer at every M (one linear
    at most 14% off: Llama-2-7B qkv at M = 1); per Llama-2-7B layer at M = 8 it takes 101.7 µs against 143.4 for the
    earlier rule (32 x 256 tiles without the forms).

    The splits are summed inside the launch (fuse_splits, where the caller passes counters) for 5-16 rows only:
    through ChatEngine on an H100 the decode step's device time was 0.97x with it at 8 rows but 1.04x at 2, 4 and 32
    rows (bench/results/2026-12-07-s3-h100.md); 16 rows was not run through the engine and goes with 8 (per linear,
    in the start-up pick's timing, both lose 3-4% to the second kernel; at 32 the loss is 15%)."""
    block_n, block_k = 64, 128
    tiles = -(-n // block_n)
    steps = max(1, k // block_k)
    split = 2 if steps >= 4 else 1
    while split < 8 and steps // (split * 2) >= 2 and (tiles * split < 1.5 * sms or steps / split > 16):
        split *= 2
    return MMConfig(block_n=block_n, block_k=block_k, split=split, warps=4, stages=3, dot=True, even=True, xvec=True,
                    scale16=True, fuse_splits=FUSE_ROWS[0] <= m <= FUSE_ROWS[1])


if triton is not None:

    @triton.jit
    def _k_order(p0, p1, p2, p3, p4, p5, p6, p7, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """Eight (BLOCK_N, BLOCK_K/8) planes, plane q holding weight k = 8j + q of word j -> (BLOCK_N, BLOCK_K)."""
        # join nests the planes as [..., i1, i2, i3] with q = 4 i1 + 2 i2 + i3, so the reshape puts k = 8j + q
        a = tl.join(tl.join(p0, p4), tl.join(p2, p6))
        b = tl.join(tl.join(p1, p5), tl.join(p3, p7))
        return tl.reshape(tl.join(a, b), (BLOCK_N, BLOCK_K))

    @triton.jit
    def _decode_levels(w, table, asm_code, DECODE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """w (BLOCK_N, BLOCK_K/8) int32 words -> (BLOCK_N, BLOCK_K) fp32 NF4 levels in k order."""
        if DECODE == "asm":
            r0, r1, r2, r3 = tl.inline_asm_elementwise(asm_code, "=r,=r,=r,=r,r", [w],
                                                       dtype=(tl.int32, tl.int32, tl.int32, tl.int32),
                                                       is_pure=True, pack=1)
            # r_p holds weight 8j + 2p in its low bf16 half and 8j + 2p + 1 in its high half; a bf16 is the top
            # half of an fp32, so each half widens exactly by a shift or a mask
            p0, p1 = (r0 << 16).to(tl.float32, bitcast=True), (r0 & -65536).to(tl.float32, bitcast=True)
            p2, p3 = (r1 << 16).to(tl.float32, bitcast=True), (r1 & -65536).to(tl.float32, bitcast=True)
            p4, p5 = (r2 << 16).to(tl.float32, bitcast=True), (r2 & -65536).to(tl.float32, bitcast=True)
            p6, p7 = (r3 << 16).to(tl.float32, bitcast=True), (r3 & -65536).to(tl.float32, bitcast=True)
            return _k_order(p0, p1, p2, p3, p4, p5, p6, p7, BLOCK_N, BLOCK_K)
        else:
            q = tl.arange(0, 8)
            shift = (q // 2) * 8 + (1 - q % 2) * 4  # k = 8j + q: byte q // 2, high nibble for even q
            idx = (w[:, :, None] >> shift[None, None, :]) & 0xF
            flat = tl.reshape(idx, (BLOCK_N * BLOCK_K,))
            return tl.reshape(tl.gather(table, flat, 0), (BLOCK_N, BLOCK_K))

    @triton.jit
    def _dequantize(w, scale, table, asm_code, DECODE: tl.constexpr, SCALE16: tl.constexpr, ASM_SCALE: tl.constexpr,
                    BS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """Words (BLOCK_N, BLOCK_K/8) and their blocks' fp32 absmax (BLOCK_N, BLOCK_K/BS) -> the bf16 weights
        (BLOCK_N, BLOCK_K) in k order. SCALE16 False: level times absmax in fp32, rounded to bf16
        (dequantize_4bit's value); True: bf16 level times bf16 absmax, rounded to bf16 (bitsandbytes' kernels).
        ASM_SCALE (or SCALE16) with "asm": the asm applies the scale and hands out bf16."""
        if (SCALE16 or ASM_SCALE) and DECODE == "asm":
            # one scale per word (a word's 8 weights are in one block): the asm multiplies the decoded pairs by it
            # (as bf16x2 or in fp32, _asm_for) and hands out the 8 bf16 weights
            sw = tl.reshape(tl.broadcast_to(scale[:, :, None], (BLOCK_N, BLOCK_K // BS, BS // 8)),
                            (BLOCK_N, BLOCK_K // 8))
            p0, p1, p2, p3, p4, p5, p6, p7 = tl.inline_asm_elementwise(
                asm_code, "=h,=h,=h,=h,=h,=h,=h,=h,r,r", [w, sw], dtype=(tl.bfloat16,) * 8, is_pure=True, pack=1)
            wv = _k_order(p0, p1, p2, p3, p4, p5, p6, p7, BLOCK_N, BLOCK_K)
        else:
            lv = _decode_levels(w, table, asm_code, DECODE, BLOCK_N, BLOCK_K)
            scale_k = tl.reshape(tl.broadcast_to(scale[:, :, None], (BLOCK_N, BLOCK_K // BS, BS)),
                                 (BLOCK_N, BLOCK_K))
            if SCALE16:  # the product of two bf16 is exact in fp32, so this rounds once, as the bf16x2 multiply
                wv = (lv.to(tl.bfloat16).to(tl.float32) * scale_k.to(tl.bfloat16).to(tl.float32)).to(tl.bfloat16)
            else:
                wv = (lv * scale_k).to(tl.bfloat16)  # dequantize_4bit's value: fp32 product rounded to bf16
        return wv

    @triton.jit
    def _all_true(SIZE: tl.constexpr):
        return tl.full((SIZE,), 1, tl.int1)

    @triton.jit
    def _finish_splits(offs, rows, rmask, omask, M, N, part_ptr, count_ptr, bias_ptr, y_ptr, HAS_BIAS: tl.constexpr,
                       SPLIT: tl.constexpr):
        """Split-K's end inside the launch, in every program (n tile t, split s), after it stored its fp32 partial
        sums at part[s, :M, tile] (offs: their offsets within one split's (M, N)): count in counters[t]; the
        program that counts SPLIT - 1 before it (the last of its tile to get here) reads the tile's SPLIT partials
        in split order 0, 1, ... (the sum, and so its bits, do not depend on which program came last: _sum_splits'
        order), adds the bias, stores y (bf16) and resets counters[t] to 0 for the next launch.

        Memory ordering: the partial stores come from many threads and the counter's atomic from one (Triton
        issues a scalar atomic in one thread and broadcasts its result through shared memory), so a CTA barrier
        first orders every thread's stores before that thread's release (acq_rel, gpu scope: cumulative over what
        the barrier made it observe). The last program's acquire half makes the other programs' partials visible
        to its thread, and the broadcast's barrier passes that on to the CTA's other threads; their loads go to
        the L2 (.cg), past any L1 line. The reset needs no ordering within the launch (every program of the tile
        has counted); the next launch on the stream (or its PDL wait) sees it."""
        tile = tl.program_id(0)
        tl.debug_barrier()
        done = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if done == SPLIT - 1:
            y = tl.load(part_ptr + offs, mask=omask, other=0.0, cache_modifier=".cg")
            for s in tl.static_range(1, SPLIT):
                y += tl.load(part_ptr + s * M * N + offs, mask=omask, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                y += tl.load(bias_ptr + rows, mask=rmask, other=0.0).to(tl.float32)[None, :]
            tl.store(y_ptr + offs, y.to(tl.bfloat16), mask=omask)
            tl.atomic_xchg(count_ptr + tile, 0, sem="relaxed", scope="gpu")

    @triton.jit(do_not_specialize=["M"])  # one compile for every M of a row bucket (M = 1 and 16 | M included)
    def _nf4_mm_kernel(x_ptr, w_ptr, absmax_ptr, q8_ptr, absmax2_ptr, offsets_ptr, code2_ptr, code_ptr, bias_ptr,
                       y_ptr, part_ptr, count_ptr, M, N, K, KW, NBLK, BS: tl.constexpr, NESTED: tl.constexpr,
                       HAS_BIAS: tl.constexpr, DECODE: tl.constexpr, ASM: tl.constexpr, MP: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr, DOT: tl.constexpr,
                       STAGES: tl.constexpr, EVEN_K: tl.constexpr = False, EVEN_N: tl.constexpr = False,
                       XVEC: tl.constexpr = False, SCALE16: tl.constexpr = False, ASM_SCALE: tl.constexpr = False,
                       TILE_M: tl.constexpr = False, PDL: tl.constexpr = False, EARLY: tl.constexpr = False,
                       FUSE: tl.constexpr = False):
        """Program (n tile, split): y[:, tile] over one K range. SPLIT == 1: y (M, N) bf16 with bias; else
        part_ptr is the (SPLIT, M, N) fp32 partial-sum buffer, and FUSE: each tile's last program sums them into y
        (_finish_splits; count_ptr: one int32 counter per n tile, zero before the launch and after it), or not
        FUSE: _sum_splits finishes (y unwritten here). EVEN_K: K is a multiple of BLOCK_K (every
        split's range is whole steps, no K masks); EVEN_N: N a multiple of BLOCK_N (no row masks in the loop);
        XVEC, SCALE16, ASM_SCALE: MMConfig's xvec, scale16, asm_scale. TILE_M (nf4_gemm, SPLIT 1): program (m tile,
        n tile) over MP rows of x from m tile * MP; the m tiles of one weight tile are launched side by side, so the
        weight tile is read from memory once and from the L2 for the others. PDL: a programmatic dependent launch
        (llm_core.fast.kernels.pdl); EARLY (with PDL): the program's first weight tile prefetched into the L2 before
        the wait (weights are never written during a step)."""
        if TILE_M:
            rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
            rmask = rows < N
            mi = tl.program_id(0) * MP + tl.arange(0, MP)
            mmask = mi < M
            pid_k = 0
        else:
            rows, rmask, mi, mmask, pid_k = tile_rows(N, M, BLOCK_N, MP)
        kk = tl.arange(0, BLOCK_K)
        wj = tl.arange(0, BLOCK_K // 8)
        bj = tl.arange(0, BLOCK_K // BS)
        per_split = tl.cdiv(K, SPLIT * BLOCK_K) * BLOCK_K
        k_lo = pid_k * per_split
        k_hi = tl.minimum(k_lo + per_split, K)
        if EARLY:
            prefetch_weight_rows(w_ptr, rows, rmask, KW, k_lo // 8, BLOCK_K // 8)
        wait_for_inputs(PDL)
        if XVEC:
            k_hi = tl.multiple_of(k_hi, 8)  # K and every split's start are multiples of BS >= 8 (the wrapper checks)
            xrows = tl.minimum(mi, M - 1)  # padding rows read row M - 1 again; their outputs are not stored
            xrmask = _all_true(MP)
        else:
            xrows = mi
            xrmask = mmask
        nmask = _all_true(BLOCK_N) if EVEN_N else rmask
        table = tl.load(code_ptr + tl.arange(0, 16))
        acc = tl.zeros((MP, BLOCK_N), dtype=tl.float32)
        for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=STAGES):
            wcol = k0 // 8 + wj
            blk = k0 // BS + bj
            kcol = k0 + kk
            if EVEN_K:
                wkmask = _all_true(BLOCK_K // 8)
                bkmask = _all_true(BLOCK_K // BS)
                xkmask = _all_true(BLOCK_K)
            else:
                wkmask = wcol * 8 < k_hi
                bkmask = blk * BS < k_hi
                xkmask = kcol < k_hi
            w = tl.load(w_ptr + rows[:, None] * KW + wcol[None, :], mask=nmask[:, None] & wkmask[None, :], other=0)
            flat = rows[:, None] * NBLK + blk[None, :]  # (BLOCK_N, BLOCK_K / BS) quant block index
            scale = block_scale(flat, nmask[:, None] & bkmask[None, :], absmax_ptr, q8_ptr, absmax2_ptr,
                                offsets_ptr, code2_ptr, NESTED)
            wv = _dequantize(w, scale, table, ASM, DECODE, SCALE16, ASM_SCALE, BS, BLOCK_N, BLOCK_K)
            xt = tl.load(x_ptr + xrows[:, None] * K + kcol[None, :], mask=xrmask[:, None] & xkmask[None, :],
                         other=0.0)
            if DOT:
                acc += tl.dot(xt, tl.trans(wv))
            else:
                acc += tl.sum(xt.to(tl.float32)[:, None, :] * wv.to(tl.float32)[None, :, :], axis=2)
        release_dependents(PDL)
        omask = mmask[:, None] & rmask[None, :]
        if SPLIT == 1:
            if HAS_BIAS:
                acc += tl.load(bias_ptr + rows, mask=rmask, other=0.0).to(tl.float32)[None, :]
            tl.store(y_ptr + mi[:, None] * N + rows[None, :], acc.to(tl.bfloat16), mask=omask)
        else:
            offs = mi[:, None] * N + rows[None, :]
            tl.store(part_ptr + pid_k * M * N + offs, acc, mask=omask)
            if FUSE:
                _finish_splits(offs, rows, rmask, omask, M, N, part_ptr, count_ptr, bias_ptr, y_ptr, HAS_BIAS, SPLIT)

    @triton.jit
    def _sum_splits(p_ptr, bias_ptr, y_ptr, MN, N, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
                    BLOCK: tl.constexpr, PDL: tl.constexpr = False):
        """y (M, N) bf16 = sum over s of p[s] (SPLIT, M, N) fp32, in split order, + bias."""
        wait_for_inputs(PDL)
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = i < MN
        acc = tl.load(p_ptr + i, mask=mask, other=0.0)
        for s in tl.static_range(1, SPLIT):
            acc += tl.load(p_ptr + s * MN + i, mask=mask, other=0.0)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + i % N, mask=mask, other=0.0).to(tl.float32)
        release_dependents(PDL)
        tl.store(y_ptr + i, acc.to(tl.bfloat16), mask=mask)


@functools.lru_cache(maxsize=8)
def _asm_for(code: tuple[float, ...], scale: str = "") -> str:
    """The "asm" decode's PTX: unpack8_asm (word $4 -> four bf16x2 pairs $0..$3), or that lookup followed by the
    block scale ($8 the word, $9 its fp32 scale; the 8 bf16 weights out as $0..$7, weight 2p the low half of pair
    p): scale "bf16" rounds it once to a bf16x2 pair and multiplies it into each level pair (fma with -0.0: the
    exact product rounded once, sm_80 and later); "fp32" widens each level, multiplies in fp32 and rounds the pair
    to bf16 (the older path's bits)."""
    text = unpack8_asm(list(code))
    if not scale:
        return text
    body = text.replace("$4", "$8")
    for p in range(4):
        body = body.replace(f"${p}", f"o{p}")
    if scale == "bf16":
        head = "cvt.rn.bf16x2.f32 sc, $9, $9;\nmov.b32 nz, 0x80008000;\n"
        pair = "fma.rn.bf16x2 o{p}, o{p}, sc, nz;\n"
    elif scale == "fp32":
        head = ""
        pair = ("shl.b32 fl, o{p}, 16;\nand.b32 fh, o{p}, 0xffff0000;\nmul.rn.f32 fl, fl, $9;\n"
                "mul.rn.f32 fh, fh, $9;\ncvt.rn.bf16x2.f32 o{p}, fh, fl;\n")
    else:
        raise ValueError(f"scale must be '', 'bf16' or 'fp32', got {scale!r}")
    tail = head + "".join(pair.format(p=p) + f"mov.b32 {{${2 * p}, ${2 * p + 1}}}, o{p};\n" for p in range(4))
    return "{\n.reg .b32 o0, o1, o2, o3, sc, nz, fl, fh;\n" + body + "\n" + tail + "}"


def launch_constexprs(m: int, n: int, k: int, blocksize: int, cfg: MMConfig, decode: str,
                      levels: Sequence[float] | None, nested: bool, has_bias: bool, tile_m: int = 0
                      ) -> dict[str, Any]:
    """The kernel's constexpr arguments for a launch (what nf4_mm passes; bench/nf4_mm_sass.py compiles with the
    same): the K step at least one quant block, the splits no more than the steps, the loop forms where the shape
    allows them. tile_m > 0: nf4_gemm's tiles of that many x rows (one split)."""
    if tile_m:
        meta = launch_constexprs(m, n, k, blocksize, cfg.replace(split=1, dot=True), decode, levels, nested,
                                 has_bias)
        return meta | {"MP": int(tile_m), "TILE_M": True}
    block_k = max(cfg.block_k, blocksize)
    split = max(1, min(cfg.split, -(-k // block_k)))
    scale = "bf16" if cfg.scale16 else "fp32" if cfg.asm_scale else ""
    asm = _asm_for(tuple(float(v) for v in levels), scale) if decode == "asm" and levels is not None else ""
    return dict(BS=blocksize, NESTED=nested, HAS_BIAS=has_bias, DECODE=decode, ASM=asm,
                MP=max(16, triton.next_power_of_2(m)) if cfg.dot else triton.next_power_of_2(m),
                BLOCK_N=cfg.block_n, BLOCK_K=block_k, SPLIT=split, DOT=cfg.dot, STAGES=cfg.stages,
                EVEN_K=cfg.even and k % block_k == 0, EVEN_N=cfg.even and n % cfg.block_n == 0, XVEC=cfg.xvec,
                SCALE16=cfg.scale16, ASM_SCALE=cfg.asm_scale, TILE_M=False, FUSE=cfg.fuse_splits and split > 1)


def compile_without_device(m: int, n: int, k: int, blocksize: int, cfg: MMConfig, decode: str,
                           levels: Sequence[float] | None, nested: bool, has_bias: bool = False,
                           arch: int = 90, divisibility: bool = True, tile_m: int = 0, pdl: bool = False,
                           early: bool = False) -> Any:
    """Compile (not run) the kernel for sm_`arch` on any machine, with the argument types nf4_mm passes (with
    double quant the absmax pointer is the output buffer standing in; split > 1 writes fp32 partial sums, with
    fuse_splits into y through an int32 counters buffer) and the
    16-divisibility Triton's launcher specializes on (torch's buffers are 16-byte aligned; N, K, K/8, K/blocksize
    where they divide; divisibility=False: none, as the first SASS counts in docs/fast_decode.md were taken). For
    the compile test and bench/nf4_mm_sass.py. pdl: the programmatic-dependent-launch form (kernels.pdl)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    meta = launch_constexprs(m, n, k, blocksize, cfg, decode, levels, nested, has_bias, tile_m)
    meta["PDL"], meta["EARLY"] = pdl, early
    out = "*bf16"  # what the wrapper passes for unused pointers (y)
    ints = {"M": m, "N": n, "K": k, "KW": k // 8, "NBLK": k // blocksize}
    signature = {"x_ptr": "*bf16", "w_ptr": "*i32", "absmax_ptr": out if nested else "*fp32", "q8_ptr": "*u8",
                 "absmax2_ptr": "*fp32", "offsets_ptr": "*fp32", "code2_ptr": "*fp32", "code_ptr": "*fp32",
                 "bias_ptr": "*bf16" if has_bias else out, "y_ptr": out,
                 "part_ptr": "*fp32" if meta["SPLIT"] > 1 else out, "count_ptr": "*i32" if meta["FUSE"] else out,
                 **{name: "i32" for name in ints}}
    names = list(_nf4_mm_kernel.arg_names)
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a, t in signature.items() if t.startswith("*")}
    attrs.update({(names.index(a),): [["tt.divisibility", 16]] for a, v in ints.items() if a != "M" and v % 16 == 0})
    if not divisibility:
        attrs = {}
    signature.update({name: "constexpr" for name in meta})
    return triton.compile(ASTSource(fn=_nf4_mm_kernel, signature=signature, constexprs=meta, attrs=attrs),
                          target=GPUTarget("cuda", arch, 32), options={"num_warps": cfg.warps})


def nf4_mm(x: torch.Tensor, words: torch.Tensor, blocksize: int, code: torch.Tensor, *,
           absmax: torch.Tensor | None = None,
           nested: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
           bias: torch.Tensor | None = None, config: MMConfig | None = None, decode: str = "gather",
           levels: Sequence[float] | None = None, compiled: list[Any] | None = None, pdl: bool = False,
           early: bool = False, counters: torch.Tensor | None = None) -> torch.Tensor:
    """x (M, K) bf16, 1 <= M <= MM_MAX -> (M, N) bf16 = x @ dequantize(W).T (+ bias). `words` (N, K/8) int32 from
    nf4_gemv.words_view(); `code` the 16 NF4 levels as an fp32 tensor on x's device (what "gather" reads); absmax
    fp32 (N * K / blocksize) or nested = (q8, absmax2, offset per 256-block, code2); `levels` the same 16 levels as
    host floats (what "asm" builds its register table from; a tensor there would sync); `config` the launch
    (default_config when None); `compiled` (diagnostics) receives the compiled kernel; `pdl`: both launches as
    programmatic dependent launches (sm_90+, llm_core.fast.kernels.pdl); `early` (with pdl): each program's first
    weight tile prefetched before the wait (bench/small_m.py times it; the engine with LAUNCH_OVERLAP=early).
    `counters`: int32 on x's device, at least one per n tile (N / 16 + 1 covers every config; pack_linears makes
    one per NF4 linear, mm_counters), all zero; with it a split config with fuse_splits sums its splits inside the
    launch and leaves the counters at zero again. Calls sharing a counters buffer must not overlap (kernels on one
    stream run in order; a PDL launch waits before it counts). Without it the splits are summed by _sum_splits."""
    launch = pdl_meta(pdl, early)
    m, k, n, kw = rows_shapes(x, words, absmax, nested)
    if blocksize < 8 or blocksize & (blocksize - 1) or k % blocksize or kw * 8 != k:
        raise ValueError(f"blocksize {blocksize} / K {k} do not fit the kernel")
    if x.dtype != torch.bfloat16 or not 1 <= m <= MM_MAX:
        raise ValueError(f"the NF4 small-M kernel reads 1-{MM_MAX} bf16 rows, not {m} of {x.dtype}")
    if decode not in DECODES:
        raise ValueError(f"decode must be one of {DECODES}, got {decode!r}")
    cfg = config or default_config(m, n, k, sm_count(x.device.index) if x.is_cuda else 132)
    if not cfg.dot and m > 4:
        cfg = cfg.replace(dot=True)
    if decode == "asm" and levels is None:
        raise ValueError("decode='asm' needs the levels as host floats")
    tiles = triton.cdiv(n, cfg.block_n)
    if counters is None:
        cfg = cfg.replace(fuse_splits=False)
    elif counters.dtype != torch.int32 or counters.device != x.device or counters.numel() < tiles:
        raise ValueError(f"counters must be int32 on {x.device} with at least {tiles} entries")
    meta = launch_constexprs(m, n, k, blocksize, cfg, decode, levels, nested is not None, bias is not None)
    split = meta["SPLIT"]
    x = x.contiguous()
    y = torch.empty(m, n, dtype=torch.bfloat16, device=x.device)
    part = y if split == 1 else torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    q8, absmax2, offsets, code2 = nested if nested is not None else (y, y, y, y)
    kernel = _nf4_mm_kernel[(tiles, split)](
        x, words, absmax if absmax is not None else y, q8, absmax2, offsets, code2, code,
        bias if bias is not None else y, y, part, counters if meta["FUSE"] else y, m, n, k, kw, k // blocksize,
        num_warps=cfg.warps, **meta, **launch)
    if compiled is not None:
        compiled.append(kernel)
    if split > 1 and not meta["FUSE"]:
        sum_splits(part, bias, y, pdl)
    return y


def sum_splits(part: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor, pdl: bool = False) -> None:
    """y (M, N) bf16 = the (SPLIT, M, N) fp32 partial sums added in split order, + bias (_sum_splits' launch;
    nf4_mm's and nf4_frag's K splits)."""
    split, m, n = part.shape
    block = 1024
    _sum_splits[(triton.cdiv(m * n, block),)](part, bias if bias is not None else y, y, m * n, n, SPLIT=split,
                                              HAS_BIAS=bias is not None, BLOCK=block, num_warps=4, **pdl_meta(pdl))


def mm_counters(n: int, device: torch.device | str) -> torch.Tensor:
    """A zeroed int32 counters buffer for nf4_mm's in-launch split sum over an N-row weight: one per n tile of
    BLOCK_N 16 or more (every tensor-core config; nf4_mm refuses a call whose tiles outnumber it), owned by whoever
    owns the weight (pack_linears: one per NF4 linear)."""
    return torch.zeros(n // 16 + 1, dtype=torch.int32, device=device)


GEMM_SMALL_ROWS = 128  # nf4_gemm takes 64-row tiles up to this many rows (GemmConfig.for_rows)


@dataclass(frozen=True)
class GemmConfig:
    """nf4_gemm's launch: (BLOCK_M x-rows, BLOCK_N weight rows, BLOCK_K inputs) tiles, warps, pipeline stages;
    the loop forms even and xvec where the shape allows; scale16 as MMConfig's (bf16 level x bf16 absmax, as
    bitsandbytes' own 4-bit kernels round), else the weights rounded as dequantize_4bit rounds them (fp32 product).
    Why scale16 by default: compiled for sm_90 (bench/nf4_mm_sass.py's count, 128 x 128 x 128, 8 warps), the main
    loop issues 428 instructions per thread and K step with it, 558 without, against the ~980 cycles its 8 wgmma
    take at the H100's dense bf16 rate: with it the decode fits under the tensor cores' time."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 128
    warps: int = 8
    stages: int = 3
    scale16: bool = True

    def as_mm(self) -> MMConfig:
        return MMConfig(self.block_n, self.block_k, 1, self.warps, self.stages, True, even=True, xvec=True,
                        scale16=self.scale16, asm_scale=not self.scale16)

    @staticmethod
    def for_rows(m: int) -> GemmConfig:
        """nf4_gemm's default launch for m rows, from the H100 sweep (bench/results/2026-12-05-s4-h100-prefill-
        gemm.json, Llama-2-7B and Llama-3-8B, each linear's best tile): 64 x 64 x 128 tiles with 4 warps at 64 rows
        (1.7-2.3x faster than 128 x 128 x 128 with 8 warps there), 128 x 128 x 64 with 4 warps from 256 rows (best
        or within 4% of the best for 17 of 20 linears and row counts, 1.2-1.4x faster than 128 x 128 x 128)."""
        if m <= GEMM_SMALL_ROWS:
            return GemmConfig(64, 64, 128, 4, 3)
        return GemmConfig(128, 128, 64, 4, 3)


def nf4_gemm(x: torch.Tensor, words: torch.Tensor, blocksize: int, code: torch.Tensor, *,
             absmax: torch.Tensor | None = None,
             nested: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
             bias: torch.Tensor | None = None, config: GemmConfig | None = None, decode: str = "gather",
             levels: Sequence[float] | None = None) -> torch.Tensor:
    """x (M, K) bf16, any M >= 1 -> (M, N) bf16 = x @ dequantize(W).T (+ bias), each weight tile decoded in
    registers and fed to the tensor cores (a prompt's prefill without the dequantized bf16 copy of W that
    dequantize_4bit writes and the matmul reads back: 2.5 bytes per weight of traffic and the part's size in working
    memory). Arguments as nf4_mm; `config` GemmConfig (default: GemmConfig.for_rows(M); bench/prefill_gemm.py sweeps
the tiles against dequantize + matmul)."""
    m, k, n, kw = rows_shapes(x, words, absmax, nested)
    if blocksize < 8 or blocksize & (blocksize - 1) or k % blocksize or kw * 8 != k:
        raise ValueError(f"blocksize {blocksize} / K {k} do not fit the kernel")
    if x.dtype != torch.bfloat16 or m < 1:
        raise ValueError(f"the NF4 GEMM reads bf16 rows, not {m} of {x.dtype}")
    if decode not in DECODES or (decode == "asm" and levels is None):
        raise ValueError(f"decode must be one of {DECODES} (asm with the levels as host floats), got {decode!r}")
    cfg = config or GemmConfig.for_rows(m)
    mmc = cfg.as_mm()
    meta = launch_constexprs(m, n, k, blocksize, mmc, decode, levels, nested is not None, bias is not None,
                             tile_m=cfg.block_m)
    x = x.contiguous()
    y = torch.empty(m, n, dtype=torch.bfloat16, device=x.device)
    q8, absmax2, offsets, code2 = nested if nested is not None else (y, y, y, y)
    _nf4_mm_kernel[(triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n))](
        x, words, absmax if absmax is not None else y, q8, absmax2, offsets, code2, code,
        bias if bias is not None else y, y, y, y, m, n, k, kw, k // blocksize, num_warps=cfg.warps, **meta)
    return y


def nf4_mm_reference(x: torch.Tensor, packed: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor,
                     blocksize: int, bias: torch.Tensor | None = None, scale16: bool = False) -> torch.Tensor:
    """The kernel's arithmetic in torch: packed (N, K/2) uint8 (high nibble first), absmax (N * K / blocksize)
    fp32 -> levels * absmax in fp32 (scale16: both rounded to bf16 first, MMConfig.scale16), rounded to x's
    dtype, then x @ W.T with fp32 accumulation (+ bias)."""
    n = packed.shape[0]
    idx = torch.stack(((packed >> 4) & 0xF, packed & 0xF), dim=-1).reshape(n, -1).long()
    levels, scale = code.float(), absmax.float()
    if scale16:
        levels, scale = levels.bfloat16().float(), scale.bfloat16().float()
    w = levels[idx].view(n, -1, blocksize) * scale.view(n, -1, 1)
    y = x.float() @ w.reshape(n, -1).to(x.dtype).float().T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


if triton is not None:

    @torch.library.custom_op(
        "llm_core::nf4_mm", mutates_args=(),
        schema="(Tensor x, Tensor packed, Tensor absmax, Tensor q8, Tensor absmax2, Tensor offsets, Tensor code2, "
               "Tensor code, Tensor? bias, int blocksize, bool nested, float[] levels, str decode, int[] config, "
               "bool pdl=False, bool early=False, Tensor? counters=None) -> Tensor")
    def _nf4_mm_op(x: torch.Tensor, packed: torch.Tensor, absmax: torch.Tensor, q8: torch.Tensor,
                   absmax2: torch.Tensor, offsets: torch.Tensor, code2: torch.Tensor, code: torch.Tensor,
                   bias: torch.Tensor | None, blocksize: int, nested: bool, levels: Sequence[float], decode: str,
                   config: Sequence[int], pdl: bool = False, early: bool = False,
                   counters: torch.Tensor | None = None) -> torch.Tensor:
        """The kernel as one opaque op for torch.compile and CUDA graphs; packed is bitsandbytes' (N, K/2);
        config = MMConfig.as_list() or empty for default_config; counters: the linear's (mm_counters), for the
        in-launch split sum (the kernel leaves them as it found them: zero, so the op mutates nothing)."""
        from .nf4_gemv import words_view

        words = words_view(packed)
        if words is None:
            raise ValueError("packed NF4 rows are not 16-byte aligned int32 words")
        cfg = MMConfig.from_list(config) if config else None
        if nested:
            return nf4_mm(x, words, blocksize, code, nested=(q8, absmax2, offsets, code2), bias=bias, config=cfg,
                          decode=decode, levels=levels, pdl=pdl, early=early, counters=counters)
        return nf4_mm(x, words, blocksize, code, absmax=absmax, bias=bias, config=cfg, decode=decode, levels=levels,
                      pdl=pdl, early=early, counters=counters)

    @_nf4_mm_op.register_fake
    def _(x: torch.Tensor, packed: torch.Tensor, *args: Any) -> torch.Tensor:
        return x.new_empty(x.shape[0], packed.shape[0])
