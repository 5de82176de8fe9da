"""llm_core.nf4_mm: the small-M NF4 matmul (1 to 32 rows, each 4-bit weight read once for all rows).

On CPU the kernel runs under Triton's interpreter (TRITON_INTERPRET=1, with its bf16 dot and rounding made to
match the GPU's: tests/triton_interp.py) on small shapes that take the same code path as the real ones: several K
steps, ragged K (not a multiple of BLOCK_K) and ragged N (not a multiple of BLOCK_N), split-K, the tensor-core dot
and the CUDA-core form, fp32 and double-quantized absmax, and the fused q/k/v and gate/up layouts pack_linears
builds (parts' rows concatenated, each keeping its own second-level scale and offset).

Error bound: against bitsandbytes' own dequantize_4bit then an fp32 matmul, the relative L2 error is at most 1e-2
(the weights rounded to bf16 as dequantize_4bit does, and the output rounded to bf16: ~2e-3 measured); against
nf4_mm_reference (the kernel's own arithmetic in torch) the output is the same to one bf16 rounding of the fp32
sum (summation order), checked as |diff| <= 2^-7 |ref| + 1e-3 element-wise (MMConfig.scale16: against the
reference's scale16 form, level and absmax rounded to bf16 before their product; the other loop forms, even and
xvec, must give the same bits as the older loop). GPU tests (marked `gpu`) run every M and
both decodes on the device against the same references; the "asm" decode holds the levels rounded to bf16, so it
meets the 1e-2 bound against bitsandbytes (H200: 2.8e-3) but not the element-wise one.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from llm_core.fast import FastDecodeOptions
from llm_core.fast.kernels import nf4_mm as mm
from llm_core.fast.kernels.nf4_gemv import words_view
from llm_core.fast.pack import absmax_2d, bias_of, code_of, counters_of, pack_linears
from tests.test_fast_decode import dequantized, nf4_linear
from tests.triton_interp import exact_bf16

MS = (1, 2, 3, 8, 17, 32)
REL_BOUND = 1e-2


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.float() - ref.float()).norm() / ref.float().norm())


def _close_to_reference(got: torch.Tensor, ref: torch.Tensor) -> bool:
    g, r = got.float(), ref.float()
    return bool(((g - r).abs() <= r.abs() * 2.0**-7 + 1e-3).all())


def _packed(splits: tuple[int, ...], k: int, absmax: str, device: str = "cpu") -> tuple[Any, torch.Tensor]:
    """pack_linears over bitsandbytes NF4 linears of `splits` rows (one: a plain linear; several: fused) -> the
    packed linear and the dequantized fused weight (bitsandbytes' own dequantize, fp32)."""
    mods = [nf4_linear(n, k, seed=i + 1) for i, n in enumerate(splits)]
    ref_w = torch.cat([dequantized(m) for m in mods])
    if device != "cpu":
        mods = [m.to(device) for m in mods]
    p = pack_linears(mods, FastDecodeOptions(absmax=absmax), "nf4")
    return p, ref_w.to(device)


def _run(p: Any, x: torch.Tensor, config: Any = None, decode: str = "gather", kernel: Any = None) -> torch.Tensor:
    """`kernel` (default mm.nf4_mm; mm.nf4_gemm) over the packed linear p, its absmax as p holds it."""
    s, ts = p.spec, p.tensors
    words = words_view(ts[0])
    assert words is not None
    code = code_of(s, ts).to(x.device)
    absmax: dict[str, Any] = {"absmax": ts[1].reshape(-1)} if s.absmax == "fp32" else {
        "nested": (ts[1], ts[2], ts[3], ts[4])}
    return (kernel or mm.nf4_mm)(x, words, s.blocksize, code, config=config, decode=decode, levels=s.levels, **absmax)


# Small shapes, same code path: (fused part rows, K). K = 320 is 1.25 BLOCK_K steps at BLOCK_K = 256 (ragged);
# N = 80 and 48 + 48 + 48 are not multiples of BLOCK_N = 32 / 64 (ragged); the fused parts are 256-block aligned
# so double quant stays exact (pack_linears' "keep").
FAMILIES = {"plain": ((80,), 320), "qkv": ((64, 32, 32), 512), "gate_up": ((128, 128), 256), "down": ((48,), 1024)}
CONFIGS = {"dot": mm.MMConfig(32, 256, 1, 4, 2, True), "split3": mm.MMConfig(64, 128, 3, 4, 2, True),
           "cuda_cores": mm.MMConfig(16, 64, 2, 4, 2, False)}
# the loop forms (MMConfig.even / xvec / scale16 / asm_scale, the last a no-op in "gather") on: K = 256, 512 and
# 1024 are whole steps of 128 and 256 (EVEN_K taken), 320 is not; N = 80 and 48 are not whole tiles, 128 + 128
# is (EVEN_N taken at BLOCK_N = 32 / 64)
FORMS = {"dot+forms": mm.MMConfig(32, 256, 1, 4, 2, True, True, True, True),
         "split3+forms": mm.MMConfig(64, 128, 3, 4, 2, True, True, True, True),
         "cuda_cores+forms": mm.MMConfig(16, 64, 2, 4, 2, False, True, True, True),
         "dot+exact_forms": mm.MMConfig(32, 256, 1, 4, 2, True, True, True, False, True)}


@pytest.fixture
def interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    if mm.triton is None:
        pytest.skip("Triton is not installed")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the interpreter tests run in their own process: TRITON_INTERPRET=1 is read at Triton's import")
    exact_bf16(monkeypatch)


def _reference(p: Any, x: torch.Tensor, scale16: bool = False) -> torch.Tensor:
    absmax_flat = absmax_2d(p.spec, p.tensors).reshape(-1)
    return mm.nf4_mm_reference(x, p.tensors[0], absmax_flat, code_of(p.spec, p.tensors).to(x.device),
                               p.spec.blocksize, scale16=scale16)


def _cases(family: str, absmax: str) -> Any:
    """(packed linear, bitsandbytes' dequantized weight, x, the reference form's output) for every M in MS."""
    splits, k = FAMILIES[family]
    p, w = _packed(splits, k, absmax)
    for m in MS:
        x = torch.randn(m, k, dtype=torch.bfloat16)
        yield p, w, x, _reference(p, x)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("absmax", ["keep", "fp32"])
def test_reference_form_matches_bitsandbytes_dequantize_then_matmul(family: str, absmax: str) -> None:
    for p, w, x, ref in _cases(family, absmax):
        assert ref.shape == (x.shape[0], p.spec.n)
        assert _rel(ref, x.float() @ w.T) < REL_BOUND


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("absmax", ["keep", "fp32"])
def test_interpreted_kernel_matches_its_reference_and_bitsandbytes(interpreter: None, family: str,
                                                                   absmax: str) -> None:
    for p, w, x, ref in _cases(family, absmax):
        m = x.shape[0]
        ref16 = _reference(p, x, scale16=True)
        for name, cfg in {**CONFIGS, **FORMS}.items():
            if not cfg.dot and m > 4:
                continue
            got = _run(p, x, cfg)
            assert got.shape == (m, p.spec.n) and got.dtype == torch.bfloat16
            assert _close_to_reference(got, ref16 if cfg.scale16 else ref), (family, m, name)
            assert _rel(got, x.float() @ w.T) < REL_BOUND, (family, m, name)
            if name in FORMS:  # even, xvec and asm_scale change no bits
                older = cfg.replace(even=False, xvec=False, asm_scale=False)
                assert torch.equal(got, _run(p, x, older)), (family, m, name)


def test_interpreted_kernel_adds_the_bias_once_across_splits(interpreter: None) -> None:
    m_ = nf4_linear(80, 512, seed=3, bias=True)
    p = pack_linears([m_], FastDecodeOptions(), "nf4")
    x = torch.randn(5, 512, dtype=torch.bfloat16)
    ref = x.float() @ dequantized(m_).T + m_.bias.detach().float()
    for cfg in (CONFIGS["dot"], CONFIGS["split3"], FORMS["split3+forms"]):
        s, ts = p.spec, p.tensors
        words = words_view(ts[0])
        assert words is not None
        got = mm.nf4_mm(x, words, s.blocksize, code_of(s, ts), nested=(ts[1], ts[2], ts[3], ts[4]), bias=ts[-1],
                        config=cfg)
        assert _rel(got, ref) < REL_BOUND


def test_the_split_k_result_is_the_same_bits_on_every_run(interpreter: None) -> None:
    p, _ = _packed((64,), 1024, "keep")
    x = torch.randn(8, 1024, dtype=torch.bfloat16)
    first = _run(p, x, CONFIGS["split3"])
    assert torch.equal(first, _run(p, x, CONFIGS["split3"]))


def _fused(cfg: mm.MMConfig) -> mm.MMConfig:
    return cfg.replace(fuse_splits=True)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_interpreted_in_launch_split_sum_gives_the_second_kernels_bits_and_leaves_the_counters_at_zero(
        interpreter: None, family: str) -> None:
    """fuse_splits with the linear's counters (what the engine passes): each tile's last program sums the splits
    in split order, so y is the same bits as _sum_splits' (ragged N and K, fused layouts, M = 1..32, both loop
    forms, bias), every counter is back at zero after each launch, and a second launch gives the same bits."""
    splits, k = FAMILIES[family]
    p, w = _packed(splits, k, "keep")
    counters = counters_of(p.spec, p.tensors)
    assert counters.dtype == torch.int32 and not counters.any()
    for m in (1, 3, 8, 32):
        x = torch.randn(m, k, dtype=torch.bfloat16)
        for cfg in (CONFIGS["split3"], FORMS["split3+forms"], mm.MMConfig(16, 64, 4, 4, 2, True)):
            s, ts = p.spec, p.tensors
            words = words_view(ts[0])
            assert words is not None
            args = dict(nested=(ts[1], ts[2], ts[3], ts[4]), config=_fused(cfg), levels=s.levels)
            plain = mm.nf4_mm(x, words, s.blocksize, code_of(s, ts), **{**args, "config": cfg})
            got = mm.nf4_mm(x, words, s.blocksize, code_of(s, ts), counters=counters, **args)
            assert torch.equal(got, plain), (family, m, cfg)
            assert not counters.any(), (family, m, cfg)
            assert torch.equal(mm.nf4_mm(x, words, s.blocksize, code_of(s, ts), counters=counters, **args), got)
            assert _rel(got, x.float() @ w.T) < REL_BOUND
    bias_lin = nf4_linear(80, 512, seed=3, bias=True)
    pb = pack_linears([bias_lin], FastDecodeOptions(), "nf4")
    s, ts = pb.spec, pb.tensors
    words = words_view(ts[0])
    assert words is not None
    x = torch.randn(5, 512, dtype=torch.bfloat16)
    cfg = CONFIGS["split3"]
    kw = dict(nested=(ts[1], ts[2], ts[3], ts[4]), bias=bias_of(s, ts))
    plain = mm.nf4_mm(x, words, s.blocksize, code_of(s, ts), config=cfg, **kw)
    got = mm.nf4_mm(x, words, s.blocksize, code_of(s, ts), config=_fused(cfg), counters=counters_of(s, ts), **kw)
    assert torch.equal(got, plain)


@pytest.mark.parametrize("absmax", ["keep", "fp32"])
def test_interpreted_rows_linear_hands_the_kernel_its_linears_counters(interpreter: None, absmax: str) -> None:
    """The batched step's call (llm_core.fast.rows.nf4_rows_linear, "mm", the launch rule: 2 splits at K = 512) with
    both absmax layouts: the op finds the linear's counters where pack_linears put them (after the code, before the
    bias), sums in the launch, and gives the bits of the same rule summed by the second kernel."""
    from llm_core.fast.rows import nf4_rows_linear

    mods = [nf4_linear(n, 512, seed=i + 1, bias=True) for i, n in enumerate((64, 32, 32))]
    p = pack_linears(mods, FastDecodeOptions(absmax=absmax), "nf4")
    s, ts = p.spec, p.tensors
    x = torch.randn(6, 512, dtype=torch.bfloat16)
    cfg = mm.default_config(6, s.n, s.k)
    assert cfg.split > 1 and cfg.fuse_splits
    words = words_view(ts[0])
    assert words is not None
    scales: dict[str, Any] = {"absmax": ts[1].reshape(-1)} if s.absmax == "fp32" else {
        "nested": (ts[1], ts[2], ts[3], ts[4])}
    second = mm.nf4_mm(x, words, s.blocksize, code_of(s, ts), bias=bias_of(s, ts), config=cfg, decode="gather",
                       levels=s.levels, **scales)
    counters = counters_of(s, ts)
    calls: list[Any] = []
    real = mm.nf4_mm

    def spy(*args: Any, **kw: Any) -> torch.Tensor:
        calls.append(kw.get("counters"))
        return real(*args, **{**kw, "decode": "gather"})  # the interpreter runs no inline PTX

    try:
        mm.nf4_mm = spy  # type: ignore[assignment]
        got = nf4_rows_linear("mm", s, x, ts)
    finally:
        mm.nf4_mm = real  # type: ignore[assignment]
    assert calls and calls[0] is counters
    assert torch.equal(got, second)
    assert not counters.any()


def test_counters_that_do_not_fit_are_refused_and_none_falls_back_to_the_second_kernel() -> None:
    p, _ = _packed((80,), 320, "fp32")
    s, ts = p.spec, p.tensors
    words = words_view(ts[0])
    assert words is not None
    x = torch.randn(2, 320, dtype=torch.bfloat16)
    cfg = mm.MMConfig(16, 64, 2, 4, 2, True, fuse_splits=True)  # 5 tiles of 16 rows
    for bad in (torch.zeros(4, dtype=torch.int32), torch.zeros(8, dtype=torch.int64)):
        with pytest.raises(ValueError, match="counters"):
            mm.nf4_mm(x, words, s.blocksize, code_of(s, ts), absmax=ts[1].reshape(-1), config=cfg, counters=bad)
    assert counters_of(s, ts).numel() == 80 // 16 + 1  # one per tile at the smallest BLOCK_N


# nf4_gemm (a prompt's prefill, any M): small tiles so these shapes take several m tiles, ragged M (70, 33 rows
# against 32-row tiles), ragged N, several K steps, both absmax forms and the fused layouts
GEMM_CONFIGS = {"32x32x64": mm.GemmConfig(32, 32, 64, 4, 2), "16x64x128": mm.GemmConfig(16, 64, 128, 4, 2),
                "32x32x64-exact": mm.GemmConfig(32, 32, 64, 4, 2, scale16=False)}


def _gemm(p: Any, x: torch.Tensor, config: mm.GemmConfig, decode: str = "gather") -> torch.Tensor:
    return _run(p, x, config, decode, kernel=mm.nf4_gemm)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("absmax", ["keep", "fp32"])
def test_interpreted_gemm_matches_its_reference_and_bitsandbytes(interpreter: None, family: str, absmax: str
                                                                 ) -> None:
    """nf4_gemm over M tiles: each output row as the reference form computes it (scale16 or dequantize_4bit's
    rounding, as configured) and within the 1e-2 bound of bitsandbytes' dequantize then matmul; rows past M in the
    last tile are never written."""
    splits, k = FAMILIES[family]
    p, w = _packed(splits, k, absmax)
    for m in (1, 33, 70):
        x = torch.randn(m, k, dtype=torch.bfloat16)
        ref, ref16 = _reference(p, x), _reference(p, x, scale16=True)
        for name, cfg in GEMM_CONFIGS.items():
            got = _gemm(p, x, cfg)
            assert got.shape == (m, p.spec.n) and got.dtype == torch.bfloat16
            assert _close_to_reference(got, ref16 if cfg.scale16 else ref), (family, m, name)
            assert _rel(got, x.float() @ w.T) < REL_BOUND, (family, m, name)


@pytest.mark.skipif(mm.triton is None, reason="needs the triton package (requirements-dev.txt)")
@pytest.mark.parametrize("decode", mm.DECODES)
@pytest.mark.parametrize("scale16", [True, False])
def test_gemm_compiles_for_hopper_to_wgmma_without_spills(decode: str, scale16: bool) -> None:
    """Compiled (not run) for sm_90 at a prefill's shape (M = 512, Llama's 4096 x 4096, double quant), the default
    tiles reach the tensor cores through wgmma (Hopper's warp-group MMA, not the older mma.sync) and keep every
    value in registers (no local-memory loads or stores in the SASS)."""
    import re

    cfg = mm.GemmConfig(scale16=scale16)
    kern = mm.compile_without_device(512, 4096, 4096, 64, cfg.as_mm(), decode, _levels(), True, tile_m=cfg.block_m)
    assert "wgmma.mma_async" in kern.asm["ptx"] and "mma.sync" not in kern.asm["ptx"]
    assert not re.search(r"\b(STL|LDL)\b", kern.asm["sass"])


def test_interpreted_prefill_op_takes_the_gemm_up_to_its_rows_and_dequantize_past_them(interpreter: None) -> None:
    """torch.ops.llm_core.nf4_prefill (llm_core.fast.prefill_gemm): a chunk of up to gemm_max rows is nf4_gemm's
    result bit for bit, a longer one dequantize + matmul's; through linear_prefill_parts a fused q/k/v whose spec
    says prefill_gemm_max gives each part within the 1e-2 bound of the spec without it, and the batched step's rows
    (gemm=False) keep dequantize + matmul whatever the spec says."""
    from dataclasses import replace

    from llm_core.fast.layer import linear_prefill_parts

    p, _ = _packed((64, 32, 32), 512, "fp32")
    s, ts = p.spec, p.tensors
    words = words_view(ts[0])
    assert words is not None
    code = code_of(s, ts)
    absmax = ts[1].reshape(-1)
    for m, gemm_max in ((40, 64), (65, 64)):
        x = torch.randn(m, 512, dtype=torch.bfloat16)
        got = torch.ops.llm_core.nf4_prefill(x, ts[0], absmax, code, None, s.blocksize, list(s.levels), gemm_max)
        if m <= gemm_max:
            want = mm.nf4_gemm(x, words, s.blocksize, code, absmax=absmax, decode="gather")
        else:
            w = torch.ops.bitsandbytes.dequantize_4bit(ts[0].reshape(-1, 1), absmax, s.blocksize, "nf4", [s.n, 512],
                                                       x.dtype)
            want = torch.nn.functional.linear(x, w)
        assert torch.equal(got, want), (m, gemm_max)
    x = torch.randn(2, 20, 512, dtype=torch.bfloat16)  # (rows, length, K): the group prefill's shape
    plain = linear_prefill_parts(s, x, ts)
    fused = linear_prefill_parts(replace(s, prefill_gemm_max=1 << 30), x, ts)
    rows = linear_prefill_parts(replace(s, prefill_gemm_max=1 << 30), x, ts, gemm=False)
    assert [t.shape for t in fused] == [t.shape for t in plain] == [(2, 20, 64), (2, 20, 32), (2, 20, 32)]
    for a, b, c in zip(fused, plain, rows, strict=True):
        assert _rel(a, b) < REL_BOUND and torch.equal(c, b)


def test_the_rows_limit_is_where_the_gemm_stopped_winning() -> None:
    """gemm_rows_limit: nf4_gemm serves up to the largest timed row count at and below which it never lost; all rows
    when it won everywhere; none when it lost at the first (or was not timed there)."""
    from llm_core.fast.prefill_gemm import ALL_ROWS, gemm_rows_limit

    def timed(*pairs: tuple[float, float]) -> dict[int, dict[str, float]]:
        return {rows: {"gemm": g, "dequant": d} for rows, (g, d) in zip((64, 256, 1024, 2048), pairs, strict=False)}

    assert gemm_rows_limit(timed((1, 2), (3, 4), (10, 9), (20, 30))) == 256  # lost at 1024: not served from there
    assert gemm_rows_limit(timed((1, 2), (3, 3), (8, 9), (20, 30))) == ALL_ROWS
    assert gemm_rows_limit(timed((3, 2), (3, 4), (8, 9), (20, 30))) == 0
    assert gemm_rows_limit({64: {"dequant": 2.0}, 256: {"gemm": 1.0, "dequant": 2.0}}) == 0
    assert gemm_rows_limit({}) == 0


def test_adopting_the_gemm_sets_every_nf4_linear_and_keeps_one_spec_per_distinct_layer() -> None:
    """linear_pick.adopt_prefill_gemm: every NF4 LinSpec of every layer gets the limit, other formats keep theirs,
    layers that shared one spec (one compiled function) still share one, and the layer functions are rebuilt."""
    from dataclasses import replace
    from types import SimpleNamespace

    from llm_core.fast.layer import LayerSpec
    from llm_core.fast.linear_pick import adopt_prefill_gemm as adopt

    nf4 = _packed((64,), 128, "fp32")[0].spec
    dense = replace(nf4, fmt="dense", absmax="none", levels=())
    spec = LayerSpec(4, 2, 32, 0.1, 1e-5, 1e-5, None, (nf4, dense, nf4, nf4), True, "torch")
    rebuilt: list[bool] = []
    decoder = SimpleNamespace(_layer_specs=[spec, spec, spec], _make_functions=lambda: rebuilt.append(True))
    adopt(decoder, 512)
    specs = decoder._layer_specs
    assert len({id(s) for s in specs}) == 1 and rebuilt == [True]
    assert [s.prefill_gemm_max for s in specs[0].linears] == [512, 0, 512, 512]
    assert specs[0].linears[1] == dense


def test_shapes_and_rows_outside_the_kernel_are_refused() -> None:
    if mm.triton is None:
        pytest.skip("Triton is not installed")
    p, _ = _packed((80,), 320, "fp32")
    with pytest.raises(ValueError, match="1-32 bf16 rows"):
        _run(p, torch.randn(33, 320, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="1-32 bf16 rows"):
        _run(p, torch.randn(2, 320, dtype=torch.float32))
    with pytest.raises(ValueError, match="decode"):
        _run(p, torch.randn(2, 320, dtype=torch.bfloat16), decode="lut")


def test_default_config_splits_k_where_n_alone_gives_too_few_programs_or_k_is_long() -> None:
    # the H100 sweep's best splits (bench/results/2026-12-05-s3-h100-small-m.json) on 132 SMs
    assert mm.default_config(8, 4096, 4096).split == 4  # 64 tiles: 4 splits reach 1.5 programs per SM
    assert mm.default_config(8, 4096, 11008).split == 8  # 86 K steps: 8 splits keep a program to ~11
    assert mm.default_config(8, 12288, 4096).split == 2  # 192 tiles: enough programs at 2
    assert mm.default_config(8, 22016, 4096).split == 2
    assert mm.default_config(8, 4096, 4096, sms=28).split == 2  # a smaller GPU: fewer programs needed
    assert mm.default_config(2, 64, 256).split == 1  # two K steps: nothing to split
    cfg = mm.default_config(32, 12288, 4096)
    assert (cfg.block_n, cfg.block_k, cfg.even, cfg.xvec, cfg.scale16) == (64, 128, True, True, True)
    # the splits summed in the launch at 5-16 rows, by the second kernel at 1-4 and 32 (measured through the engine)
    assert [mm.default_config(m, 4096, 4096).fuse_splits for m in (1, 2, 4, 5, 8, 16, 17, 32)] == [
        False, False, False, True, True, True, False, False]
    cfg = mm.MMConfig(16, 128, 4, 8, 3, False, True, False, True, True, True)
    assert mm.MMConfig.from_list(cfg.as_list()) == cfg
    assert mm.MMConfig.from_list([16, 128, 4, 8, 3, 0]) == mm.MMConfig(16, 128, 4, 8, 3, False)  # the older lists
    assert mm.MMConfig.from_list(cfg.as_list()[:10]) == cfg.replace(fuse_splits=False)


# --- GPU ---------------------------------------------------------------------------------------------------------

@pytest.mark.skipif(mm.triton is None, reason="needs the triton package (requirements-dev.txt)")
@pytest.mark.parametrize(("nested", "split"), [(True, 1), (True, 2), (False, 1)])
@pytest.mark.parametrize("decode", mm.DECODES)
@pytest.mark.parametrize("forms", ["", "even", "xvec", "scale16", "asm_scale", "even+xvec+scale16",
                                   "even+xvec+scale16+fuse_splits"])
def test_kernel_compiles_for_hopper_with_the_pointers_the_wrapper_passes(nested: bool, split: int, decode: str,
                                                                         forms: str) -> None:
    """Compile (not run) for sm_90 on CPU, with the argument types nf4_mm gives the kernel: with double quant the
    absmax pointer is the bf16 output buffer standing in, so a helper that types both branches fails to compile
    (the interpreter accepts it). Every loop form, both decodes: the "asm" decode (inline PTX, assembled by ptxas
    here) never runs under the interpreter."""
    flags = {f: f in forms.split("+") for f in ("even", "xvec", "scale16", "asm_scale", "fuse_splits")}
    cfg = mm.MMConfig(32, 256, split, 4, 2, True, **flags)
    kern = mm.compile_without_device(8, 4096, 4096, 64, cfg, decode, _levels(), nested)
    assert kern.asm["cubin"]


@pytest.mark.skipif(mm.triton is None, reason="needs the triton package (requirements-dev.txt)")
def test_in_launch_split_sum_orders_its_stores_before_the_count_and_resets_after_the_sum() -> None:
    """The sm_90 PTX of the fused split form: after the main loop, the partials' stores, a CTA barrier, the
    acq_rel gpu-scope count, then (in the last program) L2 loads of the partials, y's stores and the counter's
    reset; the unfused split form has no atomic at all."""
    cfg = mm.default_config(8, 4096, 4096)
    ptx = mm.compile_without_device(8, 4096, 4096, 64, cfg, "asm", _levels(), True).asm["ptx"]
    tail = ptx[ptx.rindex("mma.sync"):]
    store = tail.index("st.global")  # the partials (after the accumulator's layout change through shared memory)
    count = tail.index("atom.global.gpu.acq_rel.add")
    assert store < tail.rindex("bar.sync", 0, count) < count
    sums = tail.index("ld.global.cg", count)
    assert sums < tail.index("st.global", sums) < tail.index("atom.global.gpu.relaxed.exch", sums)
    plain = mm.compile_without_device(8, 4096, 4096, 64, cfg.replace(fuse_splits=False), "asm", _levels(),
                                      True).asm["ptx"]
    assert "atom." not in plain


def _levels() -> list[float]:
    """The 16 NF4 levels as host floats, as the fast path's spec holds them."""
    p, _ = _packed((16,), 64, "fp32")
    return list(p.spec.levels)


needs_gpu = pytest.mark.skipif(not (torch.cuda.is_available() and mm.triton is not None),
                               reason="needs a CUDA GPU with Triton")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("decode", mm.DECODES)
@pytest.mark.parametrize("absmax", ["keep", "fp32"])
@pytest.mark.parametrize("shape", [((4096, 4096, 4096), 4096), ((11008, 11008), 4096), ((4096,), 11008)])
def test_gpu_kernel_matches_reference_at_every_m(decode: str, absmax: str, shape: tuple[tuple[int, ...], int]
                                                 ) -> None:
    splits, k = shape
    p, w = _packed(splits, k, absmax, device="cuda")
    for m in range(1, 33):
        x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
        ref, ref16 = _reference(p, x), _reference(p, x, scale16=True)
        for cfg in (None, *CONFIGS.values(), *FORMS.values()):
            if cfg is not None and not cfg.dot and m > 4:
                continue
            got = _run(p, x, cfg, decode)
            scale16 = (cfg or mm.default_config(m, p.spec.n, k)).scale16
            # "asm" holds the 16 levels rounded to bf16 (as bitsandbytes' own kernels do): without scale16 the same
            # bound vs bnb only; with it both decodes compute the scale16 reference's form
            assert (decode == "asm" and not scale16) or _close_to_reference(got, ref16 if scale16 else ref), (
                m, cfg, decode)
            if cfg is not None and not cfg.scale16 and (cfg.even or cfg.xvec or cfg.asm_scale):
                older = cfg.replace(even=False, xvec=False, asm_scale=False)  # the same bits as the older loop
                assert torch.equal(got, _run(p, x, older, decode)), (m, cfg, decode)
            assert _rel(got, x.float() @ w.T) < REL_BOUND, (m, cfg, decode)


@pytest.mark.gpu
@needs_gpu
def test_gpu_op_in_a_cuda_graph_matches_eager() -> None:
    p, _ = _packed((4096, 1024, 1024), 4096, "keep", device="cuda")
    s, ts = p.spec, p.tensors
    x = torch.randn(8, 4096, dtype=torch.bfloat16, device="cuda")
    args = (x, ts[0], ts[1], ts[1], ts[2], ts[3], ts[4], code_of(s, ts), None, s.blocksize, True, list(s.levels),
            "asm", [])
    eager = torch.ops.llm_core.nf4_mm(*args)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torch.ops.llm_core.nf4_mm(*args)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("pdl", [False, True])
@pytest.mark.parametrize("shape", [((4096,), 4096), ((4096,), 11008), ((11008, 11008), 4096)])
def test_gpu_in_launch_split_sum_gives_the_second_kernels_bits_eagerly_and_in_a_cuda_graph(
        pdl: bool, shape: tuple[tuple[int, ...], int]) -> None:
    """The engine's call (the linear's counters, default_config: 2-8 splits summed in the launch) against the same
    config summed by _sum_splits, at every M: the same bits, counters back at zero; then 16 such launches in a row
    captured in one CUDA graph and replayed twice give the eager bits each time (the counters reset in-launch)."""
    from llm_core.fast.kernels.pdl import pdl_support

    if pdl and not pdl_support(torch.device("cuda")):
        pytest.skip("no programmatic dependent launch here")
    splits, k = shape
    p, _ = _packed(splits, k, "keep", device="cuda")
    s, ts = p.spec, p.tensors
    counters = counters_of(s, ts)

    def op(x: torch.Tensor, fused: bool) -> torch.Tensor:
        return torch.ops.llm_core.nf4_mm(x, ts[0], ts[1], ts[1], ts[2], ts[3], ts[4], code_of(s, ts), None,
                                         s.blocksize, True, list(s.levels), "asm", [], pdl, False,
                                         counters if fused else None)

    for m in range(1, 33):
        x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
        assert mm.default_config(m, s.n, k, mm.sm_count(0)).split > 1
        assert torch.equal(op(x, True), op(x, False)), m
        assert not counters.any(), m
    xs = [torch.randn(8, k, dtype=torch.bfloat16, device="cuda") for _ in range(16)]
    eager = [op(x, False) for x in xs]
    op(xs[0], True)  # warm the launch outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [op(x, True) for x in xs]
    for _ in range(2):
        for o in outs:
            o.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(o, e) for o, e in zip(outs, eager, strict=True))
        assert not counters.any()


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("decode", mm.DECODES)
@pytest.mark.parametrize("shape", [((4096, 4096, 4096), 4096), ((11008, 11008), 4096), ((4096,), 11008)])
def test_gpu_gemm_matches_dequantize_then_matmul(decode: str, shape: tuple[tuple[int, ...], int]) -> None:
    """On CUDA, Llama-2-7B's fused shapes, prompts of 1, 100, 512 and 1,111 rows: nf4_gemm (the tiles by rows, the
    128 x 128 x 128 ones and a smaller one) within the 1e-2 bound of bitsandbytes' dequantize then matmul, and in a
    CUDA graph the same bits as eagerly."""
    splits, k = shape
    p, w = _packed(splits, k, "keep", device="cuda")
    for m in (1, 100, 512, 1111):
        x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
        for cfg in (mm.GemmConfig.for_rows(m), mm.GemmConfig(), mm.GemmConfig(64, 128, 64, 4, 4)):
            got = _gemm(p, x, cfg, decode)
            assert _rel(got, x.float() @ w.T) < REL_BOUND, (m, cfg, decode)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _gemm(p, x, mm.GemmConfig(), decode)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, _gemm(p, x, mm.GemmConfig(), decode))


@pytest.mark.gpu
@needs_gpu
def test_gpu_start_up_times_the_prefill_gemm_and_says_what_it_chose(tmp_path: Any) -> None:
    """On CUDA, a random llama in NF4 through ChatEngine: start-up timed nf4_gemm against dequantize + matmul at every
    pick size, the decoder's notes say what serves, every NF4 linear carries that limit, and a reply runs."""
    from bench.harness import make_random_checkpoint
    from llm_core.engine.chat import ChatEngine
    from llm_core.fast.prefill_gemm import PICK_ROWS, gemm_rows_limit
    from tests.conftest import drain, make_settings

    shape = dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=8,
                 num_key_value_heads=4, vocab_size=1024, rope_theta=10000.0, rms_norm_eps=1e-5)
    ckpt = make_random_checkpoint(shape, tmp_path / "ckpt", torch.device("cuda"), 2048, tokenizer="chatml")
    engine = ChatEngine.load(make_settings(MODEL_ID=str(ckpt), DEVICE="cuda", DECODE_PATH="fast",
                                           MAX_BATCH_SIZE="1", QUANTIZATION="nf4"))
    decoder = engine.backend.decoder
    timings = decoder.prefill_gemm_timings_us
    assert sorted(timings) == list(PICK_ROWS) and all(set(t) == {"gemm", "dequant"} for t in timings.values())
    assert any("prefill NF4 GEMM" in note for note in decoder.notes), decoder.notes
    limit = gemm_rows_limit(timings)
    assert {s.prefill_gemm_max for spec in decoder._layer_specs for s in spec.linears if s.fmt == "nf4"} == {limit}
    reply = drain(engine.stream_chat("Hello there!", [], gen=engine.request_options(max_new_tokens=4),
                                     system_prompt="You are brief."))
    assert len(reply.token_ids) == 4


def test_the_interpreter_tests_pass_in_their_own_process() -> None:
    """TRITON_INTERPRET is read when Triton is imported, so the suite's own process (GPU kernels compiled) runs
    the interpreter tests above in a child process with it set."""
    from tests.triton_interp import check_interpreted_tests

    check_interpreted_tests(__file__, mm.triton)
