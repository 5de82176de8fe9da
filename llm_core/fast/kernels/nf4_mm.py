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
programs for 132 SMs): each split writes fp32 partial sums to its own slice of a (SPLIT, M, N) buffer and one small
kernel sums them in a fixed order and writes bf16 (+ bias). Chosen over atomic adds into a zeroed fp32 output:
same number of extra launches or one fewer (atomics need the zeroing and a conversion), and the result is the same
bits on every run (the start-up pick's accuracy check and the tests compare exact reruns).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .nf4_gemv import rows_shapes, triton, unpack8_asm

if triton is not None:
    import triton.language as tl

    from .nf4_gemv import block_scale, tile_rows

MM_MAX = 32  # the largest M the kernel serves (the batched fast path's largest batch bucket)
DECODES = ("gather", "asm")


@dataclass(frozen=True)
class MMConfig:
    """One launch shape: tile sizes (BLOCK_N weight rows x BLOCK_K inputs per step), K splits, warps, pipeline
    stages, and whether the rows go through a tensor-core dot (False: CUDA-core multiply-adds, M <= 4 only)."""

    block_n: int = 64
    block_k: int = 256
    split: int = 1
    warps: int = 4
    stages: int = 3
    dot: bool = True

    def as_list(self) -> list[int]:
        return [self.block_n, self.block_k, self.split, self.warps, self.stages, int(self.dot)]

    @classmethod
    def from_list(cls, v: Sequence[int]) -> MMConfig:
        return cls(int(v[0]), int(v[1]), int(v[2]), int(v[3]), int(v[4]), bool(v[5]))


def default_config(m: int, n: int, k: int, sms: int = 132) -> MMConfig:
    """A launch shape for (M, N, K) without tuning, fit to the H200 sweep (bench/results/2026-12-01-h200-small-m-*):
    32 x 256 tiles with 4 warps up to 16 rows, 64 x 128 at 17-32 (the 32-row accumulator), 2 pipeline stages, and
    split-K until the grid holds ~2 programs per SM (N = 4096 gives 128 tiles of 32 rows for 132 SMs)."""
    block_n, block_k = (32, 256) if m <= 16 else (64, 128)
    tiles = -(-n // block_n)
    split = 1
    while tiles * split < 2 * sms and split < 8 and k // (block_k * split * 2) >= 2:
        split *= 2
    return MMConfig(block_n=block_n, block_k=block_k, split=split, warps=4, stages=2, dot=True)


@functools.lru_cache(maxsize=8)
def _sm_count(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


if triton is not None:

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
            # join nests the planes as [..., i1, i2, i3] with q = 4 i1 + 2 i2 + i3, so the reshape puts k = 8j + q
            a = tl.join(tl.join(p0, p4), tl.join(p2, p6))
            b = tl.join(tl.join(p1, p5), tl.join(p3, p7))
            return tl.reshape(tl.join(a, b), (BLOCK_N, BLOCK_K))
        else:
            q = tl.arange(0, 8)
            shift = (q // 2) * 8 + (1 - q % 2) * 4  # k = 8j + q: byte q // 2, high nibble for even q
            idx = (w[:, :, None] >> shift[None, None, :]) & 0xF
            flat = tl.reshape(idx, (BLOCK_N * BLOCK_K,))
            return tl.reshape(tl.gather(table, flat, 0), (BLOCK_N, BLOCK_K))

    @triton.jit(do_not_specialize=["M"])  # one compile for every M of a row bucket (M = 1 and 16 | M included)
    def _nf4_mm_kernel(x_ptr, w_ptr, absmax_ptr, q8_ptr, absmax2_ptr, offsets_ptr, code2_ptr, code_ptr, bias_ptr,
                       y_ptr, M, N, K, KW, NBLK, BS: tl.constexpr, NESTED: tl.constexpr, HAS_BIAS: tl.constexpr,
                       DECODE: tl.constexpr, ASM: tl.constexpr, MP: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, SPLIT: tl.constexpr, DOT: tl.constexpr, STAGES: tl.constexpr):
        """Program (n tile, split): y[:, tile] over one K range. SPLIT == 1: y (M, N) bf16 with bias; else y is the
        (SPLIT, M, N) fp32 partial-sum buffer and _sum_splits finishes."""
        rows, rmask, mi, mmask, pid_k = tile_rows(N, M, BLOCK_N, MP)
        kk = tl.arange(0, BLOCK_K)
        wj = tl.arange(0, BLOCK_K // 8)
        bj = tl.arange(0, BLOCK_K // BS)
        per_split = tl.cdiv(K, SPLIT * BLOCK_K) * BLOCK_K
        k_lo = pid_k * per_split
        k_hi = tl.minimum(k_lo + per_split, K)
        table = tl.load(code_ptr + tl.arange(0, 16))
        acc = tl.zeros((MP, BLOCK_N), dtype=tl.float32)
        for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=STAGES):
            wcol = k0 // 8 + wj
            wmask = rmask[:, None] & (wcol * 8 < k_hi)[None, :]
            w = tl.load(w_ptr + rows[:, None] * KW + wcol[None, :], mask=wmask, other=0)
            blk = k0 // BS + bj
            bmask = rmask[:, None] & (blk * BS < k_hi)[None, :]
            flat = rows[:, None] * NBLK + blk[None, :]  # (BLOCK_N, BLOCK_K / BS) quant block index
            scale = block_scale(flat, bmask, absmax_ptr, q8_ptr, absmax2_ptr, offsets_ptr, code2_ptr, NESTED)
            lv = _decode_levels(w, table, ASM, DECODE, BLOCK_N, BLOCK_K)
            scale_k = tl.reshape(tl.broadcast_to(scale[:, :, None], (BLOCK_N, BLOCK_K // BS, BS)), (BLOCK_N, BLOCK_K))
            wv = (lv * scale_k).to(tl.bfloat16)  # dequantize_4bit's value: fp32 product rounded to bf16
            kcol = k0 + kk
            xt = tl.load(x_ptr + mi[:, None] * K + kcol[None, :], mask=mmask[:, None] & (kcol < k_hi)[None, :],
                         other=0.0)
            if DOT:
                acc += tl.dot(xt, tl.trans(wv))
            else:
                acc += tl.sum(xt.to(tl.float32)[:, None, :] * wv.to(tl.float32)[None, :, :], axis=2)
        omask = mmask[:, None] & rmask[None, :]
        if SPLIT == 1:
            if HAS_BIAS:
                acc += tl.load(bias_ptr + rows, mask=rmask, other=0.0).to(tl.float32)[None, :]
            tl.store(y_ptr + mi[:, None] * N + rows[None, :], acc.to(tl.bfloat16), mask=omask)
        else:
            tl.store(y_ptr + pid_k * M * N + mi[:, None] * N + rows[None, :], acc, mask=omask)

    @triton.jit
    def _sum_splits(p_ptr, bias_ptr, y_ptr, MN, N, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
                    BLOCK: tl.constexpr):
        """y (M, N) bf16 = sum over s of p[s] (SPLIT, M, N) fp32, in split order, + bias."""
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = i < MN
        acc = tl.load(p_ptr + i, mask=mask, other=0.0)
        for s in tl.static_range(1, SPLIT):
            acc += tl.load(p_ptr + s * MN + i, mask=mask, other=0.0)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + i % N, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + i, acc.to(tl.bfloat16), mask=mask)


@functools.lru_cache(maxsize=8)
def _asm_for(code: tuple[float, ...]) -> str:
    return unpack8_asm(list(code))


def nf4_mm(x: torch.Tensor, words: torch.Tensor, blocksize: int, code: torch.Tensor, *,
           absmax: torch.Tensor | None = None,
           nested: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
           bias: torch.Tensor | None = None, config: MMConfig | None = None, decode: str = "gather",
           levels: Sequence[float] | None = None, compiled: list[Any] | None = None) -> torch.Tensor:
    """x (M, K) bf16, 1 <= M <= MM_MAX -> (M, N) bf16 = x @ dequantize(W).T (+ bias). `words` (N, K/8) int32 from
    nf4_gemv.words_view(); `code` the 16 NF4 levels as an fp32 tensor on x's device (what "gather" reads); absmax
    fp32 (N * K / blocksize) or nested = (q8, absmax2, offset per 256-block, code2); `levels` the same 16 levels as
    host floats (what "asm" builds its register table from; a tensor there would sync); `config` the launch
    (default_config when None); `compiled` (diagnostics) receives the compiled kernel."""
    m, k, n, kw = rows_shapes(x, words, absmax, nested)
    if blocksize < 8 or blocksize & (blocksize - 1) or k % blocksize or kw * 8 != k:
        raise ValueError(f"blocksize {blocksize} / K {k} do not fit the kernel")
    if x.dtype != torch.bfloat16 or not 1 <= m <= MM_MAX:
        raise ValueError(f"the NF4 small-M kernel reads 1-{MM_MAX} bf16 rows, not {m} of {x.dtype}")
    if decode not in DECODES:
        raise ValueError(f"decode must be one of {DECODES}, got {decode!r}")
    cfg = config or default_config(m, n, k, _sm_count(x.device.index or 0) if x.is_cuda else 132)
    if not cfg.dot and m > 4:
        cfg = MMConfig(cfg.block_n, cfg.block_k, cfg.split, cfg.warps, cfg.stages, True)
    block_k = max(cfg.block_k, blocksize)
    split = max(1, min(cfg.split, -(-k // block_k)))
    asm = ""
    if decode == "asm":
        if levels is None:
            raise ValueError("decode='asm' needs the levels as host floats")
        asm = _asm_for(tuple(float(v) for v in levels))
    x = x.contiguous()
    y = torch.empty(m, n, dtype=torch.bfloat16, device=x.device)
    out = y if split == 1 else torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    q8, absmax2, offsets, code2 = nested if nested is not None else (out, out, out, out)
    kernel = _nf4_mm_kernel[(triton.cdiv(n, cfg.block_n), split)](
        x, words, absmax if absmax is not None else out, q8, absmax2, offsets, code2, code,
        bias if bias is not None else out, out, m, n, k, kw, k // blocksize,
        BS=blocksize, NESTED=nested is not None, HAS_BIAS=bias is not None, DECODE=decode, ASM=asm,
        MP=max(16, triton.next_power_of_2(m)) if cfg.dot else triton.next_power_of_2(m), BLOCK_N=cfg.block_n,
        BLOCK_K=block_k, SPLIT=split, DOT=cfg.dot, STAGES=cfg.stages, num_warps=cfg.warps)
    if compiled is not None:
        compiled.append(kernel)
    if split > 1:
        block = 1024
        _sum_splits[(triton.cdiv(m * n, block),)](out, bias if bias is not None else out, y, m * n, n, SPLIT=split,
                                                  HAS_BIAS=bias is not None, BLOCK=block, num_warps=4)
    return y


def nf4_mm_reference(x: torch.Tensor, packed: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor,
                     blocksize: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel's arithmetic in torch: packed (N, K/2) uint8 (high nibble first), absmax (N * K / blocksize)
    fp32 -> levels * absmax in fp32, rounded to x's dtype, then x @ W.T with fp32 accumulation (+ bias)."""
    n = packed.shape[0]
    idx = torch.stack(((packed >> 4) & 0xF, packed & 0xF), dim=-1).reshape(n, -1).long()
    w = code.float()[idx].view(n, -1, blocksize) * absmax.float().view(n, -1, 1)
    y = x.float() @ w.reshape(n, -1).to(x.dtype).float().T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


if triton is not None:

    @torch.library.custom_op(
        "llm_core::nf4_mm", mutates_args=(),
        schema="(Tensor x, Tensor packed, Tensor absmax, Tensor q8, Tensor absmax2, Tensor offsets, Tensor code2, "
               "Tensor code, Tensor? bias, int blocksize, bool nested, float[] levels, str decode, int[] config) "
               "-> Tensor")
    def _nf4_mm_op(x: torch.Tensor, packed: torch.Tensor, absmax: torch.Tensor, q8: torch.Tensor,
                   absmax2: torch.Tensor, offsets: torch.Tensor, code2: torch.Tensor, code: torch.Tensor,
                   bias: torch.Tensor | None, blocksize: int, nested: bool, levels: Sequence[float], decode: str,
                   config: Sequence[int]) -> torch.Tensor:
        """The kernel as one opaque op for torch.compile and CUDA graphs; packed is bitsandbytes' (N, K/2);
        config = MMConfig.as_list() or empty for default_config."""
        from .nf4_gemv import words_view

        words = words_view(packed)
        if words is None:
            raise ValueError("packed NF4 rows are not 16-byte aligned int32 words")
        cfg = MMConfig.from_list(config) if config else None
        if nested:
            return nf4_mm(x, words, blocksize, code, nested=(q8, absmax2, offsets, code2), bias=bias, config=cfg,
                          decode=decode, levels=levels)
        return nf4_mm(x, words, blocksize, code, absmax=absmax, bias=bias, config=cfg, decode=decode, levels=levels)

    @_nf4_mm_op.register_fake
    def _(x: torch.Tensor, packed: torch.Tensor, *args: Any) -> torch.Tensor:
        return x.new_empty(x.shape[0], packed.shape[0])
