"""llm_core.nf4_gemv: the register-table NF4 kernel.

On CPU there is no Triton and no PTX, so the kernel's core, the PTX of `dot8_asm`, runs here under a small
emulator of the instructions it uses (prmt, lop3, shl/shr/and, fma in fp32 or bf16x2, add): every word of 8
indices must dot with 8 activations exactly as the bf16-rounded NF4 levels do, with the roundings each variant
states. The kernel itself runs in the GPU tests (marked `gpu`).
"""

from __future__ import annotations

import math
import os
import struct
from typing import Any

import pytest
import torch

from bench.probes import forced_scores
from llm_core.fast import FastDecodeOptions, FastDecoder
from llm_core.fast.kernels import nf4_gemv

NF4 = [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
       -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
       0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0]
MASK = 0xFFFFFFFF


def _f2b(f: float) -> int:
    return int(struct.unpack("<I", struct.pack("<f", f))[0])


def _b2f(b: int) -> float:
    return float(struct.unpack("<f", struct.pack("<I", b & MASK))[0])


def _prmt(a: int, b: int, c: int) -> int:
    pool = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    out = 0
    for i in range(4):
        sel = (c >> (4 * i)) & 0xF
        byte = pool[sel & 7]
        if sel & 8:  # sign-replicate mode
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * i)
    return out


def _lop3(a: int, b: int, c: int, lut: int) -> int:
    out = 0
    for bit in range(32):
        idx = (((a >> bit) & 1) << 2) | (((b >> bit) & 1) << 1) | ((c >> bit) & 1)
        out |= ((lut >> idx) & 1) << bit
    return out


def _round_bf16(v: float) -> float:
    """Round to the nearest bf16, ties to even, in one step (normal range)."""
    if v == 0.0:
        return 0.0
    m, e = math.frexp(v)  # v = m * 2**e, 0.5 <= |m| < 1; bf16 keeps 8 significant bits
    return round(m * 256) * 2.0 ** (e - 8)  # m * 256 is exact; round() ties to even


def _bf16_bits(v: float) -> int:
    return _f2b(v) >> 16  # v is already a bf16 value: its fp32 pattern has 16 zero low bits


def _fma_bf16x2(a: int, b: int, c: int) -> int:
    out = 0
    for lane in (0, 16):
        fa, fb, fc = (_b2f(((r >> lane) & 0xFFFF) << 16) for r in (a, b, c))
        out |= _bf16_bits(_round_bf16(fa * fb + fc)) << lane  # exact in float64, then one rounding
    return out


def run_ptx(asm: str, regs: dict[str, int]) -> float:
    """Execute the straight-line PTX of dot8_asm; regs holds $1.. as 32-bit patterns; returns $0 as fp32 (and
    leaves every register written in regs)."""

    def value(tok: str) -> int:
        tok = tok.strip()
        if tok.startswith("0f"):
            return int(tok[2:], 16)
        if tok.startswith("0x"):
            return int(tok, 16)
        return regs[tok] if tok in regs else int(tok)

    for line in asm.splitlines():
        for stmt in line.split(";"):
            stmt = stmt.strip()
            if not stmt or stmt.startswith(("{", "}", ".reg")):
                continue
            op, rest = stmt.split(None, 1)
            dst, *srcs = [o.strip() for o in rest.split(",")]
            a = [value(s) for s in srcs]
            if op.startswith("mov."):
                r = a[0]
            elif op == "and.b32":
                r = a[0] & a[1]
            elif op == "shl.b32":
                r = a[0] << a[1]
            elif op == "shr.u32":
                r = a[0] >> a[1]
            elif op == "prmt.b32":
                r = _prmt(*a)
            elif op == "lop3.b32":
                r = _lop3(*a)
            elif op == "fma.rn.f32":
                r = _f2b(_b2f(a[0]) * _b2f(a[1]) + _b2f(a[2]))
            elif op == "fma.rn.bf16x2":
                r = _fma_bf16x2(*a)
            elif op == "add.f32":
                r = _f2b(_b2f(a[0]) + _b2f(a[1]))
            else:
                raise AssertionError(f"unexpected instruction {op}")
            regs[dst] = r & MASK
    return _b2f(regs["$0"])


def test_level_table_bytes_are_the_bf16_levels() -> None:
    lo, hi = nf4_gemv.table_bytes(NF4)
    want = torch.tensor(NF4).to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF
    for q in range(16):
        byte_lo = (lo[q // 4] >> (8 * (q % 4))) & 0xFF
        byte_hi = (hi[q // 4] >> (8 * (q % 4))) & 0xFF
        assert byte_lo | byte_hi << 8 == int(want[q])


def _word_cases() -> list[tuple[list[int], torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    words = [[q] * 8 for q in range(16)] + [torch.randint(0, 16, (8,), generator=g).tolist() for _ in range(150)]
    return [(nib, torch.randn(8, generator=g).to(torch.bfloat16)) for nib in words]


def _run_word(asm: str, nib: list[int], x: torch.Tensor) -> float:
    # bitsandbytes' layout: byte p holds weight 2p in its high nibble and weight 2p + 1 in its low nibble
    word = sum(((nib[2 * p] << 4) | nib[2 * p + 1]) << (8 * p) for p in range(4))
    xb = (x.view(torch.int16).to(torch.int32) & 0xFFFF).tolist()
    pairs = [xb[2 * p] | xb[2 * p + 1] << 16 for p in range(4)]
    return run_ptx(asm, {"$1": word, "$2": pairs[0], "$3": pairs[1], "$4": pairs[2], "$5": pairs[3]})


def test_dot8_ptx_dots_every_nibble_with_its_activation() -> None:
    """fp32 math: exact products, fp32 sum."""
    asm = nf4_gemv.dot8_asm(NF4, "fp32")
    levels = torch.tensor(NF4).to(torch.bfloat16).float().tolist()
    for nib, x in _word_cases():
        got = _run_word(asm, nib, x)
        want = sum(levels[nib[e]] * float(x[e]) for e in range(8))
        assert abs(got - want) <= 1e-5 * (1 + abs(want)), (nib, got, want)


def test_dot8_bf16x2_ptx_pairs_each_level_with_its_activation_and_rounds_as_stated() -> None:
    """bf16x2 math (the default): even weights accumulate in the low half, odd weights in the high half, each a
    chain of 4 fused multiply-adds rounded to bf16, the halves added in fp32. The expected value is computed
    independently here; a level paired with the wrong activation, or a wrong rounding, changes it."""
    asm = nf4_gemv.dot8_asm(NF4)
    levels = torch.tensor(NF4).to(torch.bfloat16).float().tolist()
    worst = 0.0
    for nib, x in _word_cases():
        got = _run_word(asm, nib, x)
        halves = []
        for first in (0, 1):
            acc = 0.0
            for e in range(first, 8, 2):
                acc = _round_bf16(levels[nib[e]] * float(x[e]) + acc)
            halves.append(acc)
        want = float(torch.tensor(halves[0], dtype=torch.float32) + torch.tensor(halves[1], dtype=torch.float32))
        assert got == want, (nib, got, want)
        exact = sum(levels[nib[e]] * float(x[e]) for e in range(8))
        worst = max(worst, abs(got - exact) / (sum(abs(levels[nib[e]] * float(x[e])) for e in range(8)) + 1e-30))
    assert worst <= 2 ** -8, worst  # the roundings stay within bf16 precision of the products' magnitude


@pytest.mark.parametrize("rows", [1, 2, 4])
def test_dot_rows_ptx_gives_each_row_the_bits_of_dot8_alone(rows: int) -> None:
    """The several-rows form decodes a word once and runs each row's bf16x2 chain on the same level pairs: row r's
    output ($r) equals dot8_asm's for that row by itself, bit for bit (any row's activations paired with another
    row's or the wrong levels, or another rounding, would differ)."""
    one, multi = nf4_gemv.dot8_asm(NF4), nf4_gemv.dot_rows_asm(NF4, rows)
    g = torch.Generator().manual_seed(rows)
    for nib, _ in _word_cases()[:60]:
        word = sum(((nib[2 * p] << 4) | nib[2 * p + 1]) << (8 * p) for p in range(4))
        xs = [torch.randn(8, generator=g).to(torch.bfloat16) for _ in range(rows)]
        regs = {f"${rows}": word}
        for r, x in enumerate(xs):
            xb = (x.view(torch.int16).to(torch.int32) & 0xFFFF).tolist()
            for p in range(4):
                regs[f"${rows + 1 + 4 * r + p}"] = xb[2 * p] | xb[2 * p + 1] << 16
        run_ptx(multi, regs)
        for r, x in enumerate(xs):
            assert _b2f(regs[f"${r}"]) == _run_word(one, nib, x), (rows, r, nib)


def test_dot_rows_refuses_more_rows_than_the_kernel_takes() -> None:
    with pytest.raises(ValueError, match="rows"):
        nf4_gemv.dot_rows_asm(NF4, nf4_gemv.GEMV_ROWS_MAX + 1)


def test_dot8_refuses_an_unknown_math() -> None:
    with pytest.raises(ValueError, match="math"):
        nf4_gemv.dot8_asm(NF4, "fp16")


def test_planar_pairs_put_pair_p_of_word_j_at_plane_p() -> None:
    """The XPLANAR form reads pair p of word j (activations 8j + 2p, 8j + 2p + 1) at p * K/8 + j."""
    x = torch.randn(1, 4096).to(torch.bfloat16)
    flat, planes = x.view(torch.int32)[0], nf4_gemv.planar_pairs(x).view(torch.int32)[0]
    kw = 4096 // 8
    for j in (0, 1, 7, 300, kw - 1):
        for p in range(4):
            assert planes[p * kw + j] == flat[4 * j + p]
    assert torch.equal(nf4_gemv.planar_pairs(x).sort().values, x.sort().values)  # a permutation of the same values
    with pytest.raises(ValueError, match="multiple of 8"):
        nf4_gemv.planar_pairs(torch.zeros(1, 12, dtype=torch.bfloat16))


def test_words_view_shares_the_bytes_and_refuses_odd_layouts() -> None:
    packed = torch.randint(0, 256, (6, 32), dtype=torch.uint8)
    words = nf4_gemv.words_view(packed)
    assert words is not None and words.shape == (6, 8) and words.data_ptr() == packed.data_ptr()
    assert nf4_gemv.words_view(packed[:, :30]) is None  # rows not contiguous
    assert nf4_gemv.words_view(torch.zeros(4, 6, dtype=torch.uint8)) is None  # K/2 not a multiple of 4


def test_cpu_options_never_select_the_cuda_kernel() -> None:
    assert FastDecodeOptions(gemv="nf4").resolved(torch.device("cpu"), 64).gemv == "bnb"
    assert FastDecodeOptions().resolved(torch.device("cpu"), 64).gemv == "bnb"  # auto -> bnb on CPU


# --- GPU only ------------------------------------------------------------------------------------------------

needs_kernel = pytest.mark.skipif(not (torch.cuda.is_available() and nf4_gemv.AVAILABLE),
                                  reason="needs CUDA and Triton")


def _scales(qs: Any, nested: bool) -> dict[str, Any]:
    """nf4_gemv's scale argument for a bitsandbytes quant state: nested=(q8, absmax2, offsets, code2) or absmax."""
    if nested:
        nb2 = qs.state2.absmax.numel()
        return {"nested": (qs.absmax.view(-1), qs.state2.absmax.float(), qs.offset.float().reshape(()).repeat(nb2),
                           qs.state2.code.float())}
    return {"absmax": qs.absmax.float().view(-1)}


def _quantized(n: int, k: int, nested: bool) -> tuple[torch.Tensor, Any]:
    import bitsandbytes.functional as bf

    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    return bf.quantize_4bit(w, blocksize=64, compress_statistics=nested, quant_type="nf4")


@pytest.mark.gpu
@needs_kernel
@pytest.mark.parametrize("nested", [True, False])
@pytest.mark.parametrize("shape", [(4096, 4096), (1000, 11008), (12288, 512)])
@pytest.mark.parametrize("variant", [{}, {"xvec": False, "config": (8, 16, 4)}, {"math": "fp32", "config": (8, 16, 4)},
                                     {"config": (16, 8, 4)}, {"pdl": True}, {"pdl": True, "early": True},
                                     {"config": (16, 8, 4, True)}, {"config": (8, 8, 2, True), "xvec": False},
                                     {"config": (4, 16, 4, True), "pdl": True, "early": True}, {"planar": True},
                                     {"planar": True, "config": (8, 16, 4, True), "pdl": True}],
                         ids=["default", "x4loads", "fp32", "16x8w4", "pdl", "pdl-early", "prefetch",
                              "prefetch-x4loads", "prefetch-pdl-early", "planar", "planar-prefetch-pdl"])
def test_kernel_matches_dequantize_then_matmul(nested: bool, shape: tuple[int, int], variant: dict[str, Any]) -> None:
    """As close to x @ dequantize_4bit(W).T (fp32) as bitsandbytes' own kernel is, over shapes whose rows and
    blocks are not multiples of the block shapes (masking), for each variant of the kernel."""
    import bitsandbytes.functional as bf

    n, k = shape
    packed, qs = _quantized(n, k, nested)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    want = x.float() @ bf.dequantize_4bit(packed, qs).float().T + bias.float()
    words = nf4_gemv.words_view(packed.view(torch.uint8).reshape(n, k // 2))
    assert words is not None
    code = tuple(qs.code.float().tolist())
    xin = nf4_gemv.planar_pairs(x) if variant.get("planar") else x  # the planar form reads x in planes
    if nested:
        nb2 = qs.state2.absmax.numel()
        state = (qs.absmax.view(-1), qs.state2.absmax.float(), qs.offset.float().reshape(()).repeat(nb2),
                 qs.state2.code.float())
        got = nf4_gemv.nf4_gemv(xin, words, 64, code, nested=state, bias=bias, **variant)
    else:
        got = nf4_gemv.nf4_gemv(xin, words, 64, code, absmax=qs.absmax.float().view(-1), bias=bias, **variant)
    theirs = bf.gemv_4bit(x, packed.t(), state=qs) + bias
    err = ((got.float() - want).norm() / want.norm()).item()
    their_err = ((theirs.float() - want).norm() / want.norm()).item()
    assert err <= max(2 * their_err, 5e-3), (err, their_err)


@pytest.mark.gpu
@needs_kernel
@pytest.mark.parametrize("shape", [(4096, 4096), (1000, 11008), (12288, 512)])
@pytest.mark.parametrize("config", [None, (8, 16, 4, True, 2), (8, 8, 4, True, 4), (16, 8, 4, False, 1)],
                         ids=["auto", "split2", "split4", "whole"])
def test_kernel_rows_and_splits_match_dequantize_then_matmul(shape: tuple[int, int], config: Any) -> None:
    """1-4 rows (the PTX of dot_rows_asm) and K splits summed inside the launch (the linear's counters), planar
    activations and a PDL launch as the engine runs them: each row within bitsandbytes' own error of
    x @ dequantize_4bit(W).T (fp32) + bias, each row of a several-row launch the bits of that row alone at the same
    launch, and the counters back at zero (auto: the autotuner with splits at one row, rows_config above)."""
    import bitsandbytes.functional as bf

    from llm_core.fast.kernels.nf4_mm import mm_counters

    n, k = shape
    packed, qs = _quantized(n, k, True)
    words = nf4_gemv.words_view(packed.view(torch.uint8).reshape(n, k // 2))
    assert words is not None
    code = tuple(qs.code.float().tolist())
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    deq = bf.dequantize_4bit(packed, qs).float()
    counters = mm_counters(n, "cuda")
    for m in (1, 2, 3, 4):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        want = x.float() @ deq.T + bias.float()

        def run(rows: torch.Tensor, config: Any = config) -> torch.Tensor:
            return nf4_gemv.nf4_gemv(nf4_gemv.planar_pairs(rows), words, 64, code, bias=bias, config=config,
                                     planar=True, pdl=True, counters=counters, **_scales(qs, True))

        got = run(x)
        torch.cuda.synchronize()
        assert not counters.any()
        theirs = torch.cat([bf.gemv_4bit(x[r:r + 1], packed.t(), state=qs) for r in range(m)]) + bias
        for r in range(m):
            err = ((got[r].float() - want[r]).norm() / want[r].norm()).item()
            their_err = ((theirs[r].float() - want[r]).norm() / want[r].norm()).item()
            assert err <= max(2 * their_err, 5e-3), (m, r, err, their_err)
            if m > 1 and config is not None:
                assert torch.equal(got[r], run(x[r:r + 1])[0]), (m, r)


def tiny_nf4_forced_case(tmp_path: Any) -> tuple[Any, torch.Tensor, list[int]]:
    """A random tiny llama in NF4 on CUDA (no download), a 200-token prompt and 16 tokens to force after it: what the
    decode-step comparisons teacher-force through FastDecoder (bench.probes.forced_scores)."""
    from bench.decode import load
    from bench.harness import make_random_checkpoint

    folder = make_random_checkpoint("tiny", tmp_path / "tiny", torch.device("cuda"), 1024)
    loaded = load(str(folder), "nf4", "cuda", tmp_path / "cache", "bfloat16")
    ids = torch.randint(3, 500, (1, 200), generator=torch.Generator().manual_seed(0)).cuda()
    forced = torch.randint(3, 500, (16,), generator=torch.Generator().manual_seed(1)).tolist()
    return loaded, ids, forced


@pytest.mark.gpu
@needs_kernel
def test_fast_path_with_the_kernel_matches_the_bnb_kernel_step(tmp_path: Any) -> None:
    """The decode step built on llm_core.nf4_gemv against the same step on bitsandbytes' kernel, teacher-forced
    (a random tiny llama, no download): scores agree within bf16 noise."""
    loaded, ids, forced = tiny_nf4_forced_case(tmp_path)
    scores = {}
    for gemv in ("bnb", "nf4"):
        decoder = FastDecoder(loaded, max_cache_len=512, options=FastDecodeOptions(gemv=gemv))
        assert decoder.options.gemv == gemv
        decoder.warmup()
        scores[gemv] = forced_scores(decoder, ids, forced)
        del decoder
    rel = ((scores["nf4"] - scores["bnb"]).norm(dim=-1) / scores["bnb"].norm(dim=-1)).max().item()
    assert rel <= 2e-2


@pytest.mark.skipif(nf4_gemv.triton is None, reason="needs the triton package (requirements-dev.txt)")
@pytest.mark.parametrize("nested", [True, False])
@pytest.mark.parametrize("split", [1, 4])
def test_rows_kernel_compiles_for_hopper(nested: bool, split: int) -> None:
    """Compile (not run) the M > 1 rows kernel for sm_90 on CPU with the argument types nf4_rows passes: its
    inline PTX and tensor-core dots must lower for the card users run it on."""
    from bitsandbytes.functional import get_4bit_type
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    code = tuple(float(v) for v in get_4bit_type("nf4", device="cpu").tolist())
    signature = {"x_ptr": "*bf16", "w_ptr": "*i32", "absmax_ptr": "*fp32", "q8_ptr": "*u8", "absmax2_ptr": "*fp32",
                 "offsets_ptr": "*fp32", "code2_ptr": "*fp32", "bias_ptr": "*bf16", "y_ptr": "*fp32", "M": "i32",
                 "N": "i32"}
    constexprs = dict(K=4096, KW=512, WPB=8, NESTED=nested, HAS_BIAS=not nested, ASM=nf4_gemv._unpack_asm_for(code),
                      MP=16, BLOCK_N=64, BLOCK_W=32, SPLIT=split)
    sig = {**signature, **{name: "constexpr" for name in constexprs}}
    kernel = nf4_gemv.triton.compile(ASTSource(fn=nf4_gemv._nf4_rows_kernel, signature=sig, constexprs=constexprs),
                                     target=GPUTarget("cuda", 90, 32))
    assert "mma" in kernel.asm["ptx"]  # the dots became tensor-core instructions


def test_tuned_pick_reads_the_config_an_autotuner_chose_for_a_shape() -> None:
    from types import SimpleNamespace

    from llm_core.fast.kernels.tuning import tuned_pick

    chosen = SimpleNamespace(kwargs={"BLOCK_N": 8, "BLOCK_B": 4, "SPLIT": 1}, num_warps=4)
    tuner = SimpleNamespace(cache={(4096, 512, "bf16"): chosen})
    assert tuned_pick(tuner, 4096, 512, ("BLOCK_N", "BLOCK_B")) == {"BLOCK_N": 8, "BLOCK_B": 4, "num_warps": 4}
    assert tuned_pick(tuner, 4096, 1024, ("BLOCK_N",)) is None  # not tuned for that shape yet
    assert tuned_pick(None, 4096, 512, ("BLOCK_N",)) is None  # no Triton
    # two forms of one shape (the key's other arguments differ): each form's own pick
    planar = SimpleNamespace(kwargs={"BLOCK_N": 16, "BLOCK_B": 8}, num_warps=2)
    tuner = SimpleNamespace(keys=["N", "KW", "XPLANAR"],
                            cache={(4096, 512, False, "bf16"): chosen, (4096, 512, True, "bf16"): planar})
    assert tuned_pick(tuner, 4096, 512, ("BLOCK_N",), XPLANAR=True) == {"BLOCK_N": 16, "num_warps": 2}
    assert tuned_pick(tuner, 4096, 512, ("BLOCK_N",), XPLANAR=False) == {"BLOCK_N": 8, "num_warps": 4}
    with pytest.raises(ValueError, match="not keys"):
        tuned_pick(tuner, 4096, 512, ("BLOCK_N",), PLANAR=True)


def test_the_gemv_input_setting_reaches_the_options_and_only_nf4_kernels_fed_by_inductor_read_planes() -> None:
    """GEMV_INPUT: planar by default; planar marks a packed NF4 linear on the nf4 kernel whose input the op before it
    writes (pack_linears' planar_input: every linear of a layer but the attention's output projection), and says so
    in a start-up note; other kernels and the attention-fed linear stay plain; unknown values are refused."""
    from llm_core.config import Settings
    from llm_core.errors import GenerationError, SettingsError
    from llm_core.fast.pack import pack_linears
    from tests.test_fast_decode import nf4_linear

    assert Settings.from_env(environ={}, env_file=None).model.gemv_input == "planar"
    assert Settings.from_env(environ={"GEMV_INPUT": "plain"}, env_file=None).model.gemv_input == "plain"
    with pytest.raises(SettingsError, match="GEMV_INPUT"):
        Settings.from_env(environ={"GEMV_INPUT": "tiled"}, env_file=None)
    with pytest.raises(GenerationError, match="GEMV input"):
        FastDecodeOptions(gemv_input="tiled").resolved(torch.device("cpu"), 64)
    lin = nf4_linear(64, 128, 0)
    planar = FastDecodeOptions(gemv_input="planar")
    fed = pack_linears([lin], planar, "nf4", planar_input=True)
    assert fed.spec.gemv == "nf4" and fed.spec.planar and "GEMV_INPUT=planar" in fed.note
    assert not pack_linears([lin], planar, "nf4", planar_input=False).spec.planar  # fed by the attention
    assert not pack_linears([lin], planar, "bnb", planar_input=True).spec.planar  # bitsandbytes' kernel
    assert pack_linears([lin], FastDecodeOptions(), "nf4", planar_input=True).spec.planar  # the default
    assert not pack_linears([lin], FastDecodeOptions(gemv_input="plain"), "nf4", planar_input=True).spec.planar


@pytest.mark.gpu
@needs_kernel
def test_gpu_the_decode_step_with_planar_gemv_input_gives_the_scores_of_plain(tmp_path: Any) -> None:
    """GEMV_INPUT=planar against plain on the nf4 kernel, teacher-forced through FastDecoder (compiled, CUDA graphs:
    inductor folds the permutation into the norm and SwiGLU kernels): the same scores within bf16 noise."""
    loaded, ids, forced = tiny_nf4_forced_case(tmp_path)
    scores = {}
    for layout in ("plain", "planar"):
        decoder = FastDecoder(loaded, max_cache_len=512, options=FastDecodeOptions(gemv="nf4", gemv_input=layout))
        decoder.warmup()
        planes = [s.planar for spec in decoder._layer_specs for s in spec.linears]
        assert planes == [layout == "planar" and i % 4 != 1 for i in range(len(planes))]  # all but o_proj
        scores[layout] = forced_scores(decoder, ids, forced)
        del decoder
    rel = ((scores["planar"] - scores["plain"]).norm(dim=-1) / scores["plain"].norm(dim=-1)).max().item()
    assert rel <= 1e-2


def test_planar_pairs_compile_into_the_kernel_before_them() -> None:
    """What the decode step runs under torch.compile: a norm, then planar_pairs; the compiled function gives the
    eager bits (the permutation is plain views and one copy, which inductor folds into the norm's store)."""

    def norm_then_planes(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)
        return nf4_gemv.planar_pairs((h * w).to(torch.bfloat16))

    x, w = torch.randn(1, 256), torch.randn(256)
    assert torch.equal(torch.compile(norm_then_planes, dynamic=False)(x, w), norm_then_planes(x, w))


# --- the kernel's indexing under Triton's interpreter (math="levels": no PTX) ------------------------------------


@pytest.fixture
def interpreter() -> None:
    if nf4_gemv.triton is None:
        pytest.skip("Triton is not installed")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the interpreter tests run in their own process: TRITON_INTERPRET=1 is read at Triton's import")


@pytest.mark.parametrize("nested", [True, False])
@pytest.mark.parametrize(("n", "k"), [(64, 1024), (40, 704)], ids=["even", "ragged"])
def test_interpreted_gemv_matches_dequantize_then_matmul_in_every_form(interpreter: None, nested: bool, n: int,
                                                                        k: int) -> None:
    """The one-token kernel's loads, masks, prefetch (with its wrap past the last step where the blocks divide),
    activation planes and block scales, run by the interpreter with the levels gathered in fp32 (math="levels"):
    every tile and form gives x @ dequantize_4bit(W).T (+ bias) to fp32 rounding. 64 x 1024: every tile divides
    (EVEN_N, EVEN_B); 40 x 704: 11 quant blocks and 40 rows, so neither does for most tiles."""
    import bitsandbytes.functional as bf

    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g) * 0.02
    packed, qs = bf.quantize_4bit(w.to(torch.bfloat16), blocksize=64, compress_statistics=nested, quant_type="nf4")
    want_w = bf.dequantize_4bit(packed, qs).float()
    x = torch.randn(1, k, generator=g).to(torch.bfloat16)
    bias = torch.randn(n, generator=g).to(torch.bfloat16)
    words = nf4_gemv.words_view(packed.view(torch.uint8).reshape(n, k // 2))
    assert words is not None
    code = tuple(qs.code.float().tolist())
    scales = _scales(qs, nested)
    want = x.float() @ want_w.T + bias.float()
    for config in [(8, 16, 4), (8, 16, 4, True), (4, 4, 2, True), (16, 2, 1), (8, 8, 2, True)]:
        for form in [{}, {"planar": True}, {"xvec": False}]:
            xin = nf4_gemv.planar_pairs(x) if form.get("planar") else x
            got = nf4_gemv.nf4_gemv(xin, words, 64, code, bias=bias, config=config, math="levels", **form, **scales)
            assert got.shape == (1, n) and got.dtype == torch.bfloat16
            err = ((got.float() - want).abs() / (want.abs() + 1)).max().item()
            assert err < 1e-2, (config, form, err)  # the output's bf16 rounding; a wrong index is off by far more


def _gemv_case(n: int, k: int, nested: bool) -> tuple[torch.Tensor, tuple[float, ...], dict[str, Any], torch.Tensor,
                                                       torch.Tensor, torch.Generator]:
    import bitsandbytes.functional as bf

    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g) * 0.02
    packed, qs = bf.quantize_4bit(w.to(torch.bfloat16), blocksize=64, compress_statistics=nested, quant_type="nf4")
    words = nf4_gemv.words_view(packed.view(torch.uint8).reshape(n, k // 2))
    assert words is not None
    bias = torch.randn(n, generator=g).to(torch.bfloat16)
    return words, tuple(qs.code.float().tolist()), _scales(qs, nested), bf.dequantize_4bit(packed, qs).float(), bias, g


@pytest.mark.parametrize(("n", "k", "nested"), [(64, 1024, False), (40, 704, True)], ids=["even", "ragged"])
def test_interpreted_gemv_rows_and_k_splits_match_each_row_alone(interpreter: None, nested: bool, n: int,
                                                                  k: int) -> None:
    """2 and 3 activation rows (MROWS 2 and 4: 3 rows read the last one twice and store it once) with K whole or
    split in 2 or 4 with the in-launch sum, one activation form each: each output row is the bits of that row run
    alone at the same launch (the same arithmetic per row), within bf16 rounding of x @ dequantize_4bit(W).T
    (+ bias), and the split counters are back at zero after every launch. 40 x 704: 11 quant blocks, so splits of
    8 + 3 and 4 + 4 + 3 blocks (masked steps), and 40 rows."""
    from llm_core.fast.kernels.nf4_mm import mm_counters

    words, code, scales, want_w, bias, g = _gemv_case(n, k, nested)
    counters = mm_counters(n, "cpu")
    launches: list[tuple[tuple[Any, ...], dict[str, Any]]] = [
        ((8, 4, 4), {}), ((8, 4, 4, True, 2), {"planar": True}), ((4, 2, 2, False, 4), {"xvec": False})]
    for m in (2, 3):
        x = torch.randn(m, k, generator=g).to(torch.bfloat16)
        want = x.float() @ want_w.T + bias.float()
        for config, form in launches:
            def run(rows: torch.Tensor, config: tuple[Any, ...] = config, form: dict[str, Any] = form
                    ) -> torch.Tensor:
                xin = nf4_gemv.planar_pairs(rows) if form.get("planar") else rows
                return nf4_gemv.nf4_gemv(xin, words, 64, code, bias=bias, config=config, math="levels",
                                         counters=counters, **form, **scales)

            got = run(x)
            assert got.shape == (m, n) and got.dtype == torch.bfloat16
            assert not counters.any(), (m, config, form)
            for r in (0, m - 1):  # the first row, and the last (at m = 3 the one read twice)
                assert torch.equal(got[r], run(x[r:r + 1])[0]), (m, r, config, form)
            err = ((got.float() - want).abs() / (want.abs() + 1)).max().item()
            assert err < 1e-2, (m, config, form, err)


def test_interpreted_gemv_splits_k_inside_the_launch_at_one_row(interpreter: None) -> None:
    """One row, K in 4 splits (what the autotuner of a call with counters may pick for o and down): the same result
    as the unsplit launch to fp32 rounding, a second launch the same bits, the counters at zero."""
    from llm_core.fast.kernels.nf4_mm import mm_counters

    words, code, scales, want_w, bias, g = _gemv_case(64, 1024, True)
    counters = mm_counters(64, "cpu")
    x = torch.randn(1, 1024, generator=g).to(torch.bfloat16)
    whole = nf4_gemv.nf4_gemv(x, words, 64, code, bias=bias, config=(8, 4, 4, True), math="levels", **scales)
    split = nf4_gemv.nf4_gemv(x, words, 64, code, bias=bias, config=(8, 4, 4, True, 4), math="levels",
                              counters=counters, **scales)
    assert not counters.any()
    assert torch.equal(split, nf4_gemv.nf4_gemv(x, words, 64, code, bias=bias, config=(8, 4, 4, True, 4),
                                                math="levels", counters=counters, **scales))
    assert ((split.float() - whole.float()).abs() <= whole.float().abs() * 2**-7 + 1e-3).all()


def test_interpreted_rows_linear_runs_the_gemv_with_its_linears_counters(interpreter: None) -> None:
    """The batched step's "gemv" rows kernel (llm_core.fast.rows.nf4_rows_linear) over a fused linear with a bias:
    the op hands the kernel the linear's counters and planar activations where the spec says so, and the result is
    the kernel's own over the same rows."""
    from llm_core.fast.pack import bias_of, counters_of, pack_linears
    from llm_core.fast.rows import nf4_rows_linear
    from tests.test_nf4_mm import nf4_linear

    mods = [nf4_linear(n, 512, seed=i + 1, bias=True) for i, n in enumerate((64, 32, 32))]
    p = pack_linears(mods, FastDecodeOptions(), "nf4")
    s, ts = p.spec, p.tensors
    x = torch.randn(3, 512, dtype=torch.bfloat16)
    calls: list[dict[str, Any]] = []
    real = nf4_gemv.nf4_gemv

    def spy(*args: Any, **kw: Any) -> torch.Tensor:
        calls.append(kw)
        return real(*args, **{**kw, "math": "levels"})  # the interpreter runs no inline PTX

    try:
        nf4_gemv.nf4_gemv = spy  # type: ignore[assignment]
        got = nf4_rows_linear("gemv", s, x, ts)
    finally:
        nf4_gemv.nf4_gemv = real  # type: ignore[assignment]
    counters = counters_of(s, ts)
    assert calls and calls[0]["counters"] is counters and not counters.any()
    words = nf4_gemv.words_view(ts[0])
    assert words is not None
    want = real(x, words, s.blocksize, s.levels, nested=(ts[1], ts[2], ts[3], ts[4]), bias=bias_of(s, ts),
                math="levels", counters=counters)
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="at most"):
        nf4_rows_linear("gemv", s, torch.randn(5, 512, dtype=torch.bfloat16), ts)


def test_gemv_refuses_rows_splits_and_math_it_cannot_run() -> None:
    x, words = torch.zeros(5, 64, dtype=torch.bfloat16), torch.zeros(4, 8, dtype=torch.int32)
    absmax = torch.ones(4)
    if nf4_gemv.triton is None:
        pytest.skip("Triton is not installed")
    with pytest.raises(ValueError, match="1-4 rows"):
        nf4_gemv.nf4_gemv(x, words, 64, NF4, absmax=absmax)
    with pytest.raises(ValueError, match="counters"):
        nf4_gemv.nf4_gemv(x[:1], words, 64, NF4, absmax=absmax, config=(4, 1, 1, False, 2))
    with pytest.raises(ValueError, match="bf16x2"):
        nf4_gemv.nf4_gemv(x[:2], words, 64, NF4, absmax=absmax, math="fp32")
    with pytest.raises(ValueError, match="rows"):
        nf4_gemv.planar_pairs(torch.zeros(5, 64, dtype=torch.bfloat16))


def test_rows_config_splits_only_small_grids_with_counters() -> None:
    """The several-rows launch: K split in 2 for o and down (4096 rows: 512 tiles of 8 on 132 SMs) when the caller
    has counters, never for gate_up (22016 rows) or without counters."""
    assert nf4_gemv.rows_config(2, 4096, 64, True)[4] == 2
    assert nf4_gemv.rows_config(4, 4096, 172, True)[4] == 2  # 11008 / 64 = 172 blocks: 88 + 84, the last step masked
    assert nf4_gemv.rows_config(2, 4096, 16, True)[4] == 1  # a split of 8 blocks would be one step
    assert nf4_gemv.rows_config(2, 22016, 64, True)[4] == 1
    assert nf4_gemv.rows_config(2, 4096, 64, False)[4] == 1


def test_the_gemv_interpreter_tests_pass_in_their_own_process() -> None:
    """TRITON_INTERPRET is read when Triton is imported, so the interpreter tests above run in a child process."""
    from tests.triton_interp import check_interpreted_tests

    check_interpreted_tests(__file__, nf4_gemv.triton)
