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


def ptx_value(tok: str, regs: dict[str, int]) -> int:
    """An operand's 32-bit pattern: a register of `regs`, a 0x / 0f (fp32 bits) constant or a decimal."""
    tok = tok.strip()
    if tok.startswith("0f"):
        return int(tok[2:], 16)
    if tok.startswith("0x"):
        return int(tok, 16)
    return regs[tok] if tok in regs else int(tok)


def ptx_op(op: str, a: list[int]) -> int:
    """One PTX instruction of the kernels' inline asm on 32-bit patterns (the result, not yet masked)."""
    if op.startswith("mov."):
        return a[0]
    if op == "and.b32":
        return a[0] & a[1]
    if op == "shl.b32":
        return a[0] << a[1]
    if op == "shr.u32":
        return a[0] >> a[1]
    if op == "prmt.b32":
        return _prmt(*a)
    if op == "lop3.b32":
        return _lop3(*a)
    if op == "fma.rn.f32":
        return _f2b(_b2f(a[0]) * _b2f(a[1]) + _b2f(a[2]))
    if op == "fma.rn.bf16x2":
        return _fma_bf16x2(*a)
    if op == "add.f32":
        return _f2b(_b2f(a[0]) + _b2f(a[1]))
    if op == "cvt.rn.bf16x2.f32":  # d = {cvt(a) high half, cvt(b) low half}
        return (_f2b(_round_bf16(_b2f(a[0]))) >> 16) << 16 | _f2b(_round_bf16(_b2f(a[1]))) >> 16
    raise AssertionError(f"unexpected instruction {op}")


def run_ptx(asm: str, regs: dict[str, int]) -> float:
    """Execute the straight-line PTX of dot8_asm; regs holds $1.. as 32-bit patterns; returns $0 as fp32."""
    for line in asm.splitlines():
        for stmt in line.split(";"):
            stmt = stmt.strip()
            if not stmt or stmt.startswith(("{", "}", ".reg")):
                continue
            op, rest = stmt.split(None, 1)
            dst, *srcs = [o.strip() for o in rest.split(",")]
            regs[dst] = ptx_op(op, [ptx_value(s, regs) for s in srcs]) & MASK
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


def test_the_gemv_interpreter_tests_pass_in_their_own_process() -> None:
    """TRITON_INTERPRET is read when Triton is imported, so the interpreter tests above run in a child process."""
    from tests.triton_interp import check_interpreted_tests

    check_interpreted_tests(__file__, nf4_gemv.triton)
