"""One-token NF4 matrix-vector product in Triton, reading bitsandbytes' own 4-bit layout in place.

y (1, N) = x (1, K) @ W.T, where W (N, K) is bitsandbytes NF4: `packed` (N, K/2) uint8 with the element of even
k in the high nibble, one absmax per `blocksize` elements, stored either as fp32 or double-quantized (uint8 index
into `code2`, times a per-256-block scale, plus an offset). Nothing is copied or repacked: the kernel reads the
packed bytes as int32 words (8 weights each) and decodes the nested absmax itself, so the plain path keeps using
the same bytes.

Why a kernel of our own: bitsandbytes' one-token kernel is 83% of a decode step and reads only about 1.1 TB/s
on an H200 (a quarter of its copy bandwidth). Nsight Compute shows why, for it and for a first Triton design
that gathered the 16 NF4 levels from L1 (bench/gemv_ablation.py): the L1 pipe is ~85-90% busy with table
lookups while DRAM is 11-23% busy. Here the table lives in registers (see `dot8_asm`: byte permutes, no memory
traffic), two levels at a time are multiplied and added with one bf16x2 instruction, each program owns BLOCK_N
rows and streams BLOCK_B quant blocks per row per step, the block scale is applied once per block, and each
row's sum is taken once at the end.

Measured (bench/results/2026-11-30-h200-gemv.json, runs E-G, H200, Llama-2-7B shapes, weights from HBM): 75.4 us
per layer against 102.3 for bitsandbytes' gemm_4bit with double quant; the fp32-math variant (math="fp32") 99.4.
Relative L2 error against x @ dequantize(W).T: 0.0037 (bitsandbytes 0.0036). The fast path's `auto` times both
kernels at start-up and keeps the faster.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch

try:  # Triton ships with CUDA builds of PyTorch; CPU-only installs have no such kernel
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

from .pdl import pdl_meta, prefetch_weight_rows, release_dependents, wait_for_inputs  # noqa: E402 - after the optional Triton import

AVAILABLE = triton is not None
AUTOTUNER: Any = None  # the GEMV's autotuner; what it picked per shape: llm_core.fast.kernels.tuning.tuned_pick


def sm_count(index: int | None = None) -> int:
    """The streaming multiprocessors of CUDA device `index` (default: the current one), 0 without CUDA."""
    if not torch.cuda.is_available():
        return 0
    return _sms(torch.cuda.current_device() if index is None else index)


@functools.lru_cache(maxsize=8)
def _sms(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def words_view(packed: torch.Tensor) -> torch.Tensor | None:
    """(N, K/2) uint8 -> (N, K/8) int32 view of the same bytes, or None where the layout does not allow it."""
    n, k2 = packed.shape
    if k2 % 4 or packed.stride(1) != 1 or packed.stride(0) != k2 or packed.data_ptr() % 16:
        return None
    return packed.view(torch.int32)


def planar_pairs(x: torch.Tensor) -> torch.Tensor:
    """x (1, K) bf16 -> the same values in the order the kernel's XPLANAR form reads: as int32 pairs, pair p of word j
    (activations 8j + 2p and 8j + 2p + 1) at p * K/8 + j, so that each of a word's 4 pairs is a plane of K/8. Plain
    torch views and one copy (no bit casts): inductor folds it into the kernel that computes x."""
    k = x.shape[-1]
    if x.dim() != 2 or x.shape[0] != 1 or k % 8 or x.dtype != torch.bfloat16:
        raise ValueError(f"planar_pairs takes one bf16 row of a multiple of 8, not {tuple(x.shape)} {x.dtype}")
    return x.reshape(k // 8, 4, 2).transpose(0, 1).contiguous().view(1, k)


def table_bytes(code: list[float]) -> tuple[list[int], list[int]]:
    """The 16 NF4 levels as bf16 (round to nearest even, as bitsandbytes' kernels hold them), split into low and
    high bytes, each packed little-endian into four 32-bit words: what `prmt` looks up."""
    bits = torch.tensor(code, dtype=torch.float32).to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF
    lo = [int(v) & 0xFF for v in bits.tolist()]
    hi = [int(v) >> 8 for v in bits.tolist()]

    def words(b: list[int]) -> list[int]:
        return [b[i] | b[i + 1] << 8 | b[i + 2] << 16 | b[i + 3] << 24 for i in range(0, 16, 4)]

    return words(lo), words(hi)


ASM_MATH = ("bf16x2", "fp32")  # dot8_asm's two forms; bf16x2 is the default
MATH = (*ASM_MATH, "levels")  # how a word is dotted: one of dot8_asm's forms or "levels" (no PTX: each level gathered
# from a 16-entry table in memory, fp32 products; slow, but Triton's interpreter runs it, so the CPU tests check the
# kernel's indexing, masks, prefetch and planes)


def dot8_asm(code: list[float], math: str = "bf16x2") -> str:
    """PTX: one int32 word of 8 NF4 indices ($1) dotted with the 8 matching bf16 activations (4 bf16 pairs,
    $2..$5) into one fp32 ($0). The table lives in registers: `prmt` picks bytes of the level table by the low
    3 bits of 4 indices at once, twice (levels 0-7 and 8-15), and `lop3` keeps the right one per index by its
    bit 3 (a byte mask built by `prmt`'s sign-replicate mode).

    math="bf16x2" (default): a byte permute turns the looked-up bytes into two bf16 levels lined up with an
    activation pair, and `fma.rn.bf16x2` multiplies and adds both halves at once; each half sums the word's 4
    products in bf16 (one rounding per product-and-add; bitsandbytes' kernel also rounds every product to bf16),
    and the two halves are added in fp32. About 3.5 instructions per weight.
    math="fp32": every level and activation widened to fp32 (a shift or a mask) and one fp32 `fma` per weight:
    exact products, about 6 instructions per weight."""
    if math not in ASM_MATH:
        raise ValueError(f"dot8_asm's math is one of {ASM_MATH}, got {math!r}")
    lo, hi = table_bytes(code)
    consts = "".join(f"mov.b32 L{i}, {lo[i]:#010x}; mov.b32 H{i}, {hi[i]:#010x};\n" for i in range(4))
    regs = ".reg .b32 L0, L1, L2, L3, H0, H1, H2, H3, s7, t, m, la, lb, ha, hb, lo, hi, r"
    select = """prmt.b32 la, L0, L1, {s};
prmt.b32 lb, L2, L3, {s};
prmt.b32 ha, H0, H1, {s};
prmt.b32 hb, H2, H3, {s};
lop3.b32 lo, la, lb, {m}, 0xD8;
lop3.b32 hi, ha, hb, {m}, 0xD8;
"""  # 4 indices (selector nibbles {s}, bit-3 byte mask {m}) -> their levels' low bytes in lo, high bytes in hi
    if math == "bf16x2":
        # All 8 indices: s7 = low 3 bits of each (low half: indices 0-3, s7h: 4-7); masks m / mh replicate bit 3
        # of each index (the sign of byte i of w << 4 or of w) into a byte. Word byte p = (high nibble: weight
        # 2p, low nibble: weight 2p + 1), so lo/hi byte 2p + 1 is weight 2p's level: 0x4051 / 0x6273 put weight
        # 2p's level in the low half, as the activation pair holds weight 2p.
        pair = "prmt.b32 r, lo, hi, {sel};\nfma.rn.bf16x2 acc2, r, {x}, acc2;\n"
        body = ("and.b32 s7, $1, 0x77777777;\nshr.u32 s7h, s7, 16;\nshl.b32 t, $1, 4;\n"
                "prmt.b32 m, t, $1, 0xD9C8;\nprmt.b32 mh, t, $1, 0xFBEA;\n"
                + select.format(s="s7", m="m") + pair.format(sel="0x4051", x="$2") + pair.format(sel="0x6273", x="$3")
                + select.format(s="s7h", m="mh") + pair.format(sel="0x4051", x="$4")
                + pair.format(sel="0x6273", x="$5")
                + "shl.b32 f0, acc2, 16;\nand.b32 f1, acc2, 0xFFFF0000;\nadd.f32 acc, f0, f1;\n")
        return ("{\n" + regs + ", s7h, mh, acc2;\n.reg .f32 acc, f0, f1;\n" + consts
                + "mov.b32 acc2, 0;\n" + body + "mov.b32 $0, acc;\n}")
    lookup = "and.b32 s7, {s}, 0x7777;\nshl.b32 t, {s}, 4;\nprmt.b32 m, t, {s}, 0xD9C8;\n" + select.format(
        s="s7", m="m")
    pair = """prmt.b32 r, lo, hi, {sel};
and.b32 fv, r, 0xFFFF0000;
shl.b32 fx, {x}, 16;
fma.rn.f32 acc, fv, fx, acc;
shl.b32 fv, r, 16;
and.b32 fx, {x}, 0xFFFF0000;
fma.rn.f32 acc, fv, fx, acc;
"""  # one byte of the word (2 indices, high nibble first) times one bf16 pair (low half first)

    def half(s: str, x0: str, x1: str) -> str:
        return lookup.format(s=s) + pair.format(sel="0x5140", x=x0) + pair.format(sel="0x7362", x=x1)

    return ("{\n" + regs + ", w2;\n.reg .f32 acc, fv, fx;\n" + consts + "mov.f32 acc, 0f00000000;\n"
            + half("$1", "$2", "$3") + "shr.u32 w2, $1, 16;\n" + half("w2", "$4", "$5") + "mov.b32 $0, acc;\n}")


if triton is not None:

    @triton.jit
    def _dot8_levels(w, x0, x1, x2, x3, levels_ptr):
        """What dot8_asm computes, in Triton ops (math="levels"): word w's 8 NF4 indices (byte p: weight 2p in the
        high nibble, 2p + 1 in the low one) dotted with the bf16 pairs x0..x3 (pair p: weight 2p in the low half),
        each level gathered from levels_ptr, products and sum in fp32."""
        acc = tl.zeros(w.shape, dtype=tl.float32)
        for p in tl.static_range(4):
            byte = (w >> (8 * p)) & 0xFF
            xp = x0 if p == 0 else (x1 if p == 1 else (x2 if p == 2 else x3))
            even = (xp << 16).to(tl.float32, bitcast=True)
            odd = ((xp >> 16) << 16).to(tl.float32, bitcast=True)
            acc += tl.load(levels_ptr + (byte >> 4)) * even + tl.load(levels_ptr + (byte & 15)) * odd
        return acc

    @triton.jit
    def _masked_load(ptr, mask, other, MASKED: tl.constexpr):
        """tl.load with the mask where MASKED, without it (every lane in range) where not: no predicate, no fill."""
        if MASKED:
            return tl.load(ptr, mask=mask, other=other)
        return tl.load(ptr)

    @triton.jit
    def _gemv_step_loads(x_ptr, w_ptr, absmax_ptr, q8_ptr, rows, rmask, b0, KW: tl.constexpr, NBLK: tl.constexpr,
                         WPB: tl.constexpr, NESTED: tl.constexpr, XVEC: tl.constexpr, XPLANAR: tl.constexpr,
                         BLOCK_B: tl.constexpr, EVEN_N: tl.constexpr, EVEN_B: tl.constexpr):
        """The global loads of one step (quant blocks b0 .. b0 + BLOCK_B of `rows`): the weight words (rows, blocks,
        words), each word's 4 activation pairs x0..x3 (see the kernel's XVEC / XPLANAR) and the raw block scales
        (the double-quant byte or the fp32 absmax). Blocks past the row come back as zeros (EVEN_B: there are none;
        EVEN_N: every row is in range)."""
        blks = b0 + tl.arange(0, BLOCK_B)
        bmask = blks < NBLK
        words = blks[:, None] * WPB + tl.arange(0, WPB)[None, :]  # (BLOCK_B, WPB) word index within a row
        m3 = rmask[:, None, None] & bmask[None, :, None]
        MASK3: tl.constexpr = not (EVEN_N and EVEN_B)
        w = _masked_load(w_ptr + rows[:, None, None] * KW + words[None, :, :], m3, 0, MASK3)
        if XPLANAR:  # plane p at p * KW: each plane's tile has the words' own shape and layout (no conversion)
            xw = x_ptr + (rows * 0)[:, None, None] + words[None, :, :]
            x0 = _masked_load(xw, m3, 0, not EVEN_B)  # every row's address is in range: only blocks need the mask
            x1 = _masked_load(xw + KW, m3, 0, not EVEN_B)
            x2 = _masked_load(xw + 2 * KW, m3, 0, not EVEN_B)
            x3 = _masked_load(xw + 3 * KW, m3, 0, not EVEN_B)
        elif XVEC:
            xq = _masked_load(x_ptr + (words * 4)[:, :, None] + tl.arange(0, 4)[None, None, :],
                              bmask[:, None, None], 0, not EVEN_B)
            xa, xb = tl.split(tl.reshape(xq, (BLOCK_B, WPB, 2, 2)))  # last index 2a + b: xa = b 0, xb = b 1
            x0, x2 = tl.split(xa)
            x1, x3 = tl.split(xb)
            x0, x1, x2, x3 = x0[None, :, :], x1[None, :, :], x2[None, :, :], x3[None, :, :]
        else:
            xo = words * 4
            xm2 = bmask[:, None]
            x0 = _masked_load(x_ptr + xo, xm2, 0, not EVEN_B)[None, :, :]
            x1 = _masked_load(x_ptr + xo + 1, xm2, 0, not EVEN_B)[None, :, :]
            x2 = _masked_load(x_ptr + xo + 2, xm2, 0, not EVEN_B)[None, :, :]
            x3 = _masked_load(x_ptr + xo + 3, xm2, 0, not EVEN_B)[None, :, :]
        blk = rows[:, None] * NBLK + blks[None, :]
        m2 = rmask[:, None] & bmask[None, :]
        if NESTED:
            raw = _masked_load(q8_ptr + blk, m2, 0, MASK3).to(tl.int32)
        else:
            raw = _masked_load(absmax_ptr + blk, m2, 0.0, MASK3)
        return w, x0, x1, x2, x3, raw

    @triton.jit
    def _write_y(y, rows, rmask, bias_ptr, y_ptr, HAS_BIAS: tl.constexpr, EVEN_N: tl.constexpr):
        """The output rows: fp32 row sums y (+ the bias) stored in y's dtype (no mask where EVEN_N)."""
        if HAS_BIAS:
            y += _masked_load(bias_ptr + rows, rmask, 0.0, not EVEN_N).to(tl.float32)
        if EVEN_N:
            tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty))
        else:
            tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=rmask)

    @triton.jit
    def _nf4_gemv_kernel(x_ptr, w_ptr, absmax_ptr, q8_ptr, absmax2_ptr, offsets_ptr, code2_ptr, levels_ptr, bias_ptr,
                         y_ptr, N,
                         KW: tl.constexpr, NBLK: tl.constexpr, WPB: tl.constexpr, NESTED: tl.constexpr,
                         HAS_BIAS: tl.constexpr, ASM: tl.constexpr, XVEC: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_B: tl.constexpr, PREFETCH: tl.constexpr = False, XPLANAR: tl.constexpr = False,
                         EVEN_N: tl.constexpr = False, EVEN_B: tl.constexpr = False, PDL: tl.constexpr = False,
                         EARLY: tl.constexpr = False):
        """Program p: rows [p*BLOCK_N, (p+1)*BLOCK_N), BLOCK_B quant blocks (WPB int32 words each) per step.
        ASM: dot8_asm's PTX, or "" for math="levels" (levels_ptr: the 16 levels in fp32; a dummy otherwise).
        x_ptr is the bf16 activation row read as int32 pairs: pair 4j + p holds weights 8j + 2p (low half) and
        8j + 2p + 1 (high half); word j's byte p holds their indices as (high nibble, low nibble).
        XVEC: a word's 4 activation pairs are read with one 16-byte load and split, not 4 separate loads.
        XPLANAR: x_ptr holds the pairs in planes instead (planar_pairs: pair p of word j at p * KW + j), so each
        plane loads as a tile of the words' own shape and layout: no shared-memory conversion of the activations
        (and its barriers) in the loop, for one redundant load per row a thread holds.
        PREFETCH: each step issues the next step's loads (weights, activations, block scales) into registers before
        it decodes its own, so their memory latency hides behind a step of arithmetic; costs the registers of one
        more step. (Triton's own pipeline, `tl.range(num_stages=2 or 3)`, cp.async copies through shared memory,
        was slower for every tile on an H100: docs/fast_decode.md.)
        EVEN_N / EVEN_B (set by the launcher from the shapes): N is a multiple of BLOCK_N / NBLK of BLOCK_B, so the
        loads go unmasked (the prefetch past the last step wraps to the first, its loads unused).
        PDL: launched as a programmatic dependent launch (llm_core.fast.kernels.pdl). EARLY (with PDL): before the
        wait, the program's first weight tile is prefetched into the L2 (weights are never written during a step),
        so its DRAM latency overlaps the kernel before this one."""
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rmask = rows < N
        if EARLY:
            prefetch_weight_rows(w_ptr, rows, rmask, KW, 0, BLOCK_B * WPB)
        wait_for_inputs(PDL)
        bi = tl.arange(0, BLOCK_B)
        acc = tl.zeros((BLOCK_N, BLOCK_B), dtype=tl.float32)
        if PREFETCH:
            w, x0, x1, x2, x3, raw = _gemv_step_loads(x_ptr, w_ptr, absmax_ptr, q8_ptr, rows, rmask, 0, KW, NBLK, WPB,
                                                      NESTED, XVEC, XPLANAR, BLOCK_B, EVEN_N, EVEN_B)
        for b0 in range(0, NBLK, BLOCK_B):
            if PREFETCH:
                w_now, x0_now, x1_now, x2_now, x3_now, raw_now = w, x0, x1, x2, x3, raw
                b_next = b0 + BLOCK_B
                if EVEN_B:  # unmasked: past the last step, load the first again (unused)
                    b_next = b_next % NBLK
                w, x0, x1, x2, x3, raw = _gemv_step_loads(x_ptr, w_ptr, absmax_ptr, q8_ptr, rows, rmask, b_next,
                                                          KW, NBLK, WPB, NESTED, XVEC, XPLANAR, BLOCK_B, EVEN_N,
                                                          EVEN_B)
            else:
                w_now, x0_now, x1_now, x2_now, x3_now, raw_now = _gemv_step_loads(
                    x_ptr, w_ptr, absmax_ptr, q8_ptr, rows, rmask, b0, KW, NBLK, WPB, NESTED, XVEC, XPLANAR, BLOCK_B,
                    EVEN_N, EVEN_B)
            if ASM == "":  # math="levels": no PTX (the interpreter's form)
                part = _dot8_levels(w_now, x0_now, x1_now, x2_now, x3_now, levels_ptr)
            else:
                part = tl.inline_asm_elementwise(ASM, "=r,r,r,r,r,r", [w_now, x0_now, x1_now, x2_now, x3_now],
                                                 dtype=tl.float32, is_pure=True, pack=1)
            dot = tl.sum(part, axis=2)
            if NESTED:
                blks = b0 + bi
                blk = rows[:, None] * NBLK + blks[None, :]
                m2 = rmask[:, None] & (blks < NBLK)[None, :]
                masked: tl.constexpr = not (EVEN_N and EVEN_B)
                scale = (tl.load(code2_ptr + raw_now) * _masked_load(absmax2_ptr + blk // 256, m2, 0.0, masked)
                         + _masked_load(offsets_ptr + blk // 256, m2, 0.0, masked))
            else:
                scale = raw_now
            acc += dot * scale
        release_dependents(PDL)
        _write_y(tl.sum(acc, axis=1), rows, rmask, bias_ptr, y_ptr, HAS_BIAS, EVEN_N)

    # (BLOCK_N, BLOCK_B, warps, PREFETCH); the tiles that were fastest plain (on an H100, bench/gemv_bench.py
    # --sweep, 2026-12-06 fourth session) also with their next step's loads in registers
    PREFETCH_TILES = ((8, 16, 4), (4, 16, 4), (16, 8, 4), (8, 8, 4), (8, 8, 2))
    CONFIGS = [(4, 4, 4, False), (4, 8, 4, False), (8, 4, 4, False), (8, 8, 8, False), (8, 4, 8, False),
               (16, 4, 8, False), (4, 16, 8, False), (2, 8, 4, False), (16, 2, 4, False), (8, 2, 4, False),
               (8, 8, 4, False), (4, 16, 4, False), (16, 4, 4, False), (16, 8, 4, False), (8, 16, 4, False),
               (16, 8, 8, False),  # above: 1-8 words per thread per step
               *[(bn, bb, w, True) for bn, bb, w in PREFETCH_TILES]]

    def gemv_configs(tiles: Sequence[tuple[int, int, int, bool]]) -> list[Any]:
        """(BLOCK_N, BLOCK_B, warps, PREFETCH) tuples -> the autotuner's triton.Configs (the module's autotuner
        over CONFIGS; bench/batched.py --gemv-configs narrows one process's to a subset)."""
        return [triton.Config({"BLOCK_N": bn, "BLOCK_B": bb, "PREFETCH": pf}, num_warps=w) for bn, bb, w, pf in tiles]

    _even = triton.heuristics({"EVEN_N": lambda a: a["N"] % a["BLOCK_N"] == 0,
                               "EVEN_B": lambda a: a["NBLK"] % a["BLOCK_B"] == 0})(_nf4_gemv_kernel)
    _tuned = triton.autotune(configs=gemv_configs(CONFIGS),
                             key=["N", "KW", "WPB", "NESTED", "ASM", "XVEC", "XPLANAR"])(_even)
    AUTOTUNER = _tuned


@functools.lru_cache(maxsize=8)
def _asm_for(code: tuple[float, ...], math: str) -> str:
    return dot8_asm(list(code), math)


def nf4_gemv(x: torch.Tensor, words: torch.Tensor, blocksize: int, code: Sequence[float], *,
             absmax: torch.Tensor | None = None,
             nested: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
             bias: torch.Tensor | None = None, config: tuple[int, ...] | None = None,
             math: str = "bf16x2", xvec: bool = True, compiled: list[Any] | None = None,
             pdl: bool = False, early: bool = False, planar: bool = False) -> torch.Tensor:
    """x (1, K) bf16 -> (1, N) bf16. `words` from words_view(); absmax fp32 (N*K/blocksize) or nested = (q8,
    absmax2, offset per 256-block, code2); `code` the 16 NF4 levels as host floats (a tensor here would sync,
    and break graph capture). `config` = (BLOCK_N, BLOCK_B, num_warps[, PREFETCH]) skips autotuning;
    `math` see dot8_asm and MATH ("levels": tests only; it copies the levels to the device per call, no graphs);
    `xvec` see the kernel; `compiled` (diagnostics) receives the compiled kernel (its PTX/SASS in .asm); `pdl`
    launches it as a programmatic dependent launch (sm_90+, llm_core.fast.kernels.pdl); `early` (with pdl) prefetches
    each program's first weight tile before the wait (bench/gemv_bench.py times it; the engine serves it with
    LAUNCH_OVERLAP=early); `planar`: x is given as planar_pairs(x) (the kernel's XPLANAR form)."""
    launch = pdl_meta(pdl, early)
    if triton is None:
        raise RuntimeError("Triton is not installed")
    n, kw = words.shape
    if (absmax is None) == (nested is None):
        raise ValueError("give exactly one of absmax and nested")
    wpb = blocksize // 8
    if blocksize % 8 or wpb & (wpb - 1) or kw % wpb:
        raise ValueError(f"blocksize {blocksize} does not fit the kernel")
    if x.dtype != torch.bfloat16:
        raise ValueError(f"the NF4 kernel reads bf16 activations, not {x.dtype}")
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    dummy = y
    q8, absmax2, offsets, code2 = nested if nested is not None else (dummy, dummy, dummy, dummy)
    host = tuple(float(v) for v in code)
    levels = torch.tensor(host, device=x.device) if math == "levels" else dummy
    args: tuple[Any, ...] = (x.contiguous().view(torch.int32), words, absmax if absmax is not None else dummy, q8,
                             absmax2, offsets, code2, levels, bias if bias is not None else dummy, y, n)
    flags = {"KW": kw, "NBLK": kw // wpb, "WPB": wpb, "NESTED": nested is not None, "HAS_BIAS": bias is not None,
             "ASM": "" if math == "levels" else _asm_for(host, math),
             "XVEC": bool(xvec), "XPLANAR": bool(planar), **launch}
    if config is not None:
        if len(config) not in (3, 4):
            raise ValueError(f"config is (BLOCK_N, BLOCK_B, num_warps[, PREFETCH]), not {config}")
        bn, bb, warps, prefetch = (*config, False)[:4]
        kernel = _nf4_gemv_kernel[(triton.cdiv(n, bn),)](*args, **flags, BLOCK_N=bn, BLOCK_B=bb, PREFETCH=prefetch,
                                                         EVEN_N=n % bn == 0, EVEN_B=(kw // wpb) % bb == 0,
                                                         num_warps=warps)
    else:
        kernel = _tuned[lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)](*args, **flags)
    if compiled is not None:
        compiled.append(kernel)
    return y


def _op_operands(packed: torch.Tensor, absmax: torch.Tensor, q8: torch.Tensor, absmax2: torch.Tensor,
                 offsets: torch.Tensor, code2: torch.Tensor, nested: bool) -> tuple[torch.Tensor, dict[str, Any]]:
    """A custom op's tensors as the kernels take them: packed's int32 words, and absmax or the nested parts."""
    words = words_view(packed)
    if words is None:
        raise ValueError("packed NF4 rows are not 16-byte aligned int32 words")
    return words, ({"nested": (q8, absmax2, offsets, code2)} if nested else {"absmax": absmax})


_OP_SCHEMA = ("(Tensor x, Tensor packed, Tensor absmax, Tensor q8, Tensor absmax2, Tensor offsets, Tensor code2, "
              "Tensor? bias, int blocksize, bool nested, float[] code, bool pdl=False, bool early=False, "
              "bool planar=False) -> Tensor")


def _register_op(name: str, kernel: Callable[..., torch.Tensor], rows_of: Callable[[torch.Tensor], int]) -> Any:
    """`kernel` as one opaque op llm_core::<name> for torch.compile and CUDA graphs; packed is bitsandbytes'
    (N, K/2); the op's fake output is (rows_of(x), N)."""

    @torch.library.custom_op(f"llm_core::{name}", mutates_args=(), schema=_OP_SCHEMA)
    def op(x: torch.Tensor, packed: torch.Tensor, absmax: torch.Tensor, q8: torch.Tensor, absmax2: torch.Tensor,
           offsets: torch.Tensor, code2: torch.Tensor, bias: torch.Tensor | None, blocksize: int, nested: bool,
           code: Sequence[float], pdl: bool = False, early: bool = False, planar: bool = False) -> torch.Tensor:
        words, scales = _op_operands(packed, absmax, q8, absmax2, offsets, code2, nested)
        return kernel(x, words, blocksize, code, bias=bias, pdl=pdl, early=early, planar=planar, **scales)

    @op.register_fake
    def _(x: torch.Tensor, packed: torch.Tensor, *args: Any) -> torch.Tensor:
        return x.new_empty(rows_of(x), packed.shape[0])

    return op


if triton is not None:
    _nf4_gemv_op = _register_op("nf4_gemv", nf4_gemv, lambda x: 1)


# --- a few rows at once (the batched fast path) ------------------------------------------------------------------


def unpack8_asm(code: list[float]) -> str:
    """PTX: one int32 word of 8 NF4 indices ($4) -> its 8 levels as four bf16x2 words ($0..$3): word p holds the
    level of weight 2p in its low half and of weight 2p + 1 in its high half. The same register-table lookup as
    dot8_asm (bf16x2), without the multiply: the rows kernel below feeds the levels to tensor-core dots."""
    lo, hi = table_bytes(code)
    consts = "".join(f"mov.b32 L{i}, {lo[i]:#010x}; mov.b32 H{i}, {hi[i]:#010x};\n" for i in range(4))
    select = ("prmt.b32 la, L0, L1, {s};\nprmt.b32 lb, L2, L3, {s};\nprmt.b32 ha, H0, H1, {s};\n"
              "prmt.b32 hb, H2, H3, {s};\nlop3.b32 lo, la, lb, {m}, 0xD8;\nlop3.b32 hi, ha, hb, {m}, 0xD8;\n")
    return ("{\n.reg .b32 L0, L1, L2, L3, H0, H1, H2, H3, s7, s7h, t, m, mh, la, lb, ha, hb, lo, hi;\n" + consts
            + "and.b32 s7, $4, 0x77777777;\nshr.u32 s7h, s7, 16;\nshl.b32 t, $4, 4;\n"
            + "prmt.b32 m, t, $4, 0xD9C8;\nprmt.b32 mh, t, $4, 0xFBEA;\n"
            + select.format(s="s7", m="m") + "prmt.b32 $0, lo, hi, 0x4051;\nprmt.b32 $1, lo, hi, 0x6273;\n"
            + select.format(s="s7h", m="mh") + "prmt.b32 $2, lo, hi, 0x4051;\nprmt.b32 $3, lo, hi, 0x6273;\n}")


if triton is not None:

    @triton.jit
    def _bf16_pair(r):
        """int32 holding two bf16 -> (low, high) as fp32 (exact: a bf16 is the top half of an fp32)."""
        return (r << 16).to(tl.float32, bitcast=True), ((r >> 16) << 16).to(tl.float32, bitcast=True)

    @triton.jit
    def tile_rows(N, M, BLOCK_N: tl.constexpr, MP: tl.constexpr):
        """Program (n tile, k split) of a rows kernel -> its weight rows (BLOCK_N,) and activation rows (MP,), with
        their in-range masks, and the split index."""
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        mi = tl.arange(0, MP)
        return rows, rows < N, mi, mi < M, tl.program_id(1)

    @triton.jit
    def block_scale(blk, mask, absmax_ptr, q8_ptr, absmax2_ptr, offsets_ptr, code2_ptr, NESTED: tl.constexpr):
        """Quant block indices (any shape) -> their absmax in fp32: read as is, or double-quantized as
        code2[q8] * absmax2[blk // 256] + offset[blk // 256]."""
        if NESTED:  # if/else, not an early return: Triton 3.6 types both returns, and absmax_ptr is a dummy then
            code = tl.load(code2_ptr + tl.load(q8_ptr + blk, mask=mask, other=0).to(tl.int32))
            scale = code * tl.load(absmax2_ptr + blk // 256, mask=mask, other=0.0) + tl.load(
                offsets_ptr + blk // 256, mask=mask, other=0.0)
        else:
            scale = tl.load(absmax_ptr + blk, mask=mask, other=0.0)
        return scale

    @triton.jit
    def _dot_word_planes(acc, r, xbase, PLANE: tl.constexpr, xm, scale):
        """acc + the dots of x planes PLANE and PLANE + 1 with the two bf16 levels one unpacked register holds."""
        a, b = _bf16_pair(r)
        acc += tl.dot(tl.load(xbase + PLANE, mask=xm, other=0.0), tl.trans((a * scale).to(tl.bfloat16)))
        acc += tl.dot(tl.load(xbase + PLANE + 1, mask=xm, other=0.0), tl.trans((b * scale).to(tl.bfloat16)))
        return acc

    @triton.jit
    def _nf4_rows_kernel(x_ptr, w_ptr, absmax_ptr, q8_ptr, absmax2_ptr, offsets_ptr, code2_ptr, bias_ptr, y_ptr, M, N,
                         K: tl.constexpr, KW: tl.constexpr, WPB: tl.constexpr, NESTED: tl.constexpr,
                         HAS_BIAS: tl.constexpr, ASM: tl.constexpr, MP: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_W: tl.constexpr, SPLIT: tl.constexpr):
        """y (M, N) += x (M, K) @ W.T over one K range: program (n tile, split) decodes each weight of its tile once
        (levels from registers, block scale applied in fp32, rounded to bf16 as dequantize_4bit does) and feeds
        all M rows through tensor-core dots. Weight k = 8j + q sits in word j; instead of interleaving the 8 decoded
        planes back into k order, x is read in the same 8 planes (x[:, 8j + q]): the dot is order-free.
        y is fp32, zeroed before (SPLIT > 1 adds partial sums atomically)."""
        rows, rmask, mi, mmask, pid_k = tile_rows(N, M, BLOCK_N, MP)
        jj = tl.arange(0, BLOCK_W)
        per_split = tl.cdiv(KW, SPLIT * BLOCK_W) * BLOCK_W
        w_lo = pid_k * per_split
        w_hi = tl.minimum(w_lo + per_split, KW)
        acc = tl.zeros((MP, BLOCK_N), dtype=tl.float32)
        for w0 in range(w_lo, w_hi, BLOCK_W):
            wj = w0 + jj
            wmask = wj < w_hi
            m2 = rmask[:, None] & wmask[None, :]
            words = tl.load(w_ptr + rows[:, None] * KW + wj[None, :], mask=m2, other=0)
            blk = rows[:, None] * (KW // WPB) + (wj // WPB)[None, :]
            scale = block_scale(blk, m2, absmax_ptr, q8_ptr, absmax2_ptr, offsets_ptr, code2_ptr, NESTED)
            r0, r1, r2, r3 = tl.inline_asm_elementwise(ASM, "=r,=r,=r,=r,r", [words],
                                                       dtype=(tl.int32, tl.int32, tl.int32, tl.int32),
                                                       is_pure=True, pack=1)
            xm = mmask[:, None] & wmask[None, :]
            xbase = x_ptr + mi[:, None] * K + wj[None, :] * 8
            acc = _dot_word_planes(acc, r0, xbase, 0, xm, scale)
            acc = _dot_word_planes(acc, r1, xbase, 2, xm, scale)
            acc = _dot_word_planes(acc, r2, xbase, 4, xm, scale)
            acc = _dot_word_planes(acc, r3, xbase, 6, xm, scale)
        if HAS_BIAS:
            if pid_k == 0:
                acc += tl.load(bias_ptr + rows, mask=rmask, other=0.0).to(tl.float32)[None, :]
        out = y_ptr + mi[:, None] * N + rows[None, :]
        omask = mmask[:, None] & rmask[None, :]
        if SPLIT == 1:
            tl.store(out, acc, mask=omask)
        else:
            tl.atomic_add(out, acc, mask=omask)

    ROWS_CONFIGS = [(bn, bw, s, w) for bn in (32, 64) for bw in (16, 32) for s in (1, 2, 4) for w in (4,)]
    _rows_tuned = triton.autotune(
        configs=[triton.Config({"BLOCK_N": bn, "BLOCK_W": bw, "SPLIT": s}, num_warps=w)
                 for bn, bw, s, w in ROWS_CONFIGS],
        key=["N", "KW", "WPB", "NESTED", "MP"], reset_to_zero=["y_ptr"])(_nf4_rows_kernel)


@functools.lru_cache(maxsize=8)
def _unpack_asm_for(code: tuple[float, ...]) -> str:
    return unpack8_asm(list(code))


ROWS_MAX = 32  # the rows kernel's largest M (the batched fast path's largest batch bucket)


def rows_shapes(x: torch.Tensor, words: torch.Tensor, absmax: torch.Tensor | None, nested: Any
                ) -> tuple[int, int, int, int]:
    """(M, K, N, K/8) of a rows kernel's call, after the checks every rows kernel makes first."""
    if triton is None:
        raise RuntimeError("Triton is not installed")
    if (absmax is None) == (nested is None):
        raise ValueError("give exactly one of absmax and nested")
    return int(x.shape[0]), int(x.shape[1]), int(words.shape[0]), int(words.shape[1])


def nf4_rows(x: torch.Tensor, words: torch.Tensor, blocksize: int, code: Sequence[float], *,
             absmax: torch.Tensor | None = None,
             nested: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
             bias: torch.Tensor | None = None, config: tuple[int, int, int, int] | None = None,
             pdl: bool = False, early: bool = False, planar: bool = False) -> torch.Tensor:
    """x (M, K) bf16, 1 <= M <= ROWS_MAX -> (M, N) bf16 = x @ dequantize(W).T, each weight read once for all rows.
    Arguments as nf4_gemv; `config` = (BLOCK_N, BLOCK_W, SPLIT, num_warps) skips autotuning. The engine serves
    rows with llm_core.nf4_mm; this older kernel stays for bench/small_m.py and has no PDL form."""
    if pdl or early or planar:
        raise ValueError("the older NF4 rows kernel has no PDL or planar form; llm_core.nf4_mm has the PDL one")
    m, k, n, kw = rows_shapes(x, words, absmax, nested)
    wpb = blocksize // 8
    if blocksize % 8 or wpb & (wpb - 1) or kw % wpb or kw * 8 != k:
        raise ValueError(f"blocksize {blocksize} / K {k} do not fit the kernel")
    if x.dtype != torch.bfloat16 or not 1 <= m <= ROWS_MAX:
        raise ValueError(f"the NF4 rows kernel reads 1-{ROWS_MAX} bf16 rows, not {m} of {x.dtype}")
    y = torch.zeros(m, n, dtype=torch.float32, device=x.device)
    q8, absmax2, offsets, code2 = nested if nested is not None else (y, y, y, y)
    args: tuple[Any, ...] = (x.contiguous(), words, absmax if absmax is not None else y, q8, absmax2, offsets, code2,
                             bias if bias is not None else y, y, m, n)
    flags = {"K": k, "KW": kw, "WPB": wpb, "NESTED": nested is not None, "HAS_BIAS": bias is not None,
             "ASM": _unpack_asm_for(tuple(float(v) for v in code)), "MP": max(16, triton.next_power_of_2(m))}
    if config is not None:
        bn, bw, split, warps = config
        _nf4_rows_kernel[(triton.cdiv(n, bn), split)](*args, **flags, BLOCK_N=bn, BLOCK_W=bw, SPLIT=split,
                                                      num_warps=warps)
    else:
        _rows_tuned[lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), meta["SPLIT"])](*args, **flags)
    return y.to(x.dtype)


if triton is not None:
    _nf4_rows_op = _register_op("nf4_rows", nf4_rows, lambda x: x.shape[0])
