"""LAUNCH_OVERLAP: programmatic dependent launch of the fast path's decode kernels (llm_core.fast.kernels.pdl).

On CPU: the kernels compiled for sm_90 carry the wait and the release only in their PDL form; the option resolves
off where PDL cannot run, the setting reaches the options, and packed linears carry the choice to their op. On a GPU
(marked): the decode step with the overlap gives the scores it gives without.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from llm_core.config import Settings
from llm_core.errors import GenerationError, SettingsError
from llm_core.fast import FastDecodeOptions
from llm_core.fast.kernels import attention, nf4_gemv, pdl
from llm_core.fast.kernels import nf4_mm as mm
from llm_core.fast.pack import pack_linears

needs_gdc = pytest.mark.skipif(not pdl.triton_has_gdc(), reason="needs a Triton with grid dependency control")
WAIT, RELEASE = "griddepcontrol.wait", "griddepcontrol.launch_dependents"
GEMV_SIGNATURE = {"x_ptr": "*i32", "w_ptr": "*i32", "absmax_ptr": "*fp32", "q8_ptr": "*u8", "absmax2_ptr": "*fp32",
                  "offsets_ptr": "*fp32", "code2_ptr": "*fp32", "levels_ptr": "*fp32", "bias_ptr": "*bf16",
                  "y_ptr": "*bf16", "N": "i32"}  # what nf4_gemv passes the one-token kernel


def _levels() -> tuple[float, ...]:
    from bitsandbytes.functional import get_4bit_type

    return tuple(float(v) for v in get_4bit_type("nf4", device="cpu").tolist())


def _compile(fn: Any, signature: dict[str, str], constexprs: dict[str, Any], warps: int = 4) -> str:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {**signature, **{name: "constexpr" for name in constexprs}}
    kernel = pdl.triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs),
                                target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    return str(kernel.asm["ptx"])


@needs_gdc
@pytest.mark.parametrize(("on", "early"), [(True, False), (False, False), (True, True)])
def test_the_gemv_waits_and_releases_only_in_its_pdl_form(on: bool, early: bool) -> None:
    signature = GEMV_SIGNATURE
    constexprs = dict(KW=512, NBLK=64, WPB=8, NESTED=True, HAS_BIAS=False, ASM=nf4_gemv._asm_for(_levels(), "bf16x2"),
                      XVEC=True, BLOCK_N=8, BLOCK_B=8, PREFETCH=False, XPLANAR=False, EVEN_N=False, EVEN_B=False,
                      PDL=on, EARLY=early)
    ptx = _compile(nf4_gemv._nf4_gemv_kernel, signature, constexprs)
    assert (WAIT in ptx, RELEASE in ptx) == (on, on)
    if on:  # the wait comes before the first load of the activations, the release after the main loop's loads
        assert ptx.index(WAIT) < ptx.index("ld.global") < ptx.index(RELEASE)
    # early: the first weight tile (8 rows x 64 words: 2 lines a row, one per thread) prefetched before the wait
    assert ("prefetch.global.L2" in ptx) == early
    if early:
        assert ptx.rindex("prefetch.global.L2") < ptx.index(WAIT)


@needs_gdc
@pytest.mark.parametrize("planar", [False, True])
def test_the_prefetching_gemv_loads_nothing_before_the_pdl_wait(planar: bool) -> None:
    """PREFETCH issues the first step's loads before the loop: they must come after the wait, or the first step
    would read activations the kernel before it has not written yet (plain and planar activations)."""
    signature = GEMV_SIGNATURE
    constexprs = dict(KW=512, NBLK=64, WPB=8, NESTED=True, HAS_BIAS=False, ASM=nf4_gemv._asm_for(_levels(), "bf16x2"),
                      XVEC=True, BLOCK_N=8, BLOCK_B=8, PREFETCH=True, XPLANAR=planar, EVEN_N=True, EVEN_B=True,
                      PDL=True, EARLY=False)
    ptx = _compile(nf4_gemv._nf4_gemv_kernel, signature, constexprs)
    assert ptx.index(WAIT) < ptx.index("ld.global") < ptx.index(RELEASE)


def test_the_kernels_refuse_an_early_prefetch_without_a_pdl_wait() -> None:
    x, words = torch.zeros(1, 64, dtype=torch.bfloat16), torch.zeros(4, 8, dtype=torch.int32)
    with pytest.raises(ValueError, match="pdl=True"):
        nf4_gemv.nf4_gemv(x, words, 64, _levels(), absmax=torch.ones(4), early=True)
    with pytest.raises(ValueError, match="pdl=True"):
        mm.nf4_mm(x, words, 64, torch.zeros(16), absmax=torch.ones(4), early=True)


@needs_gdc
@pytest.mark.parametrize(("on", "early"), [(True, False), (False, False), (True, True)])
def test_the_small_m_matmul_waits_and_releases_only_in_its_pdl_form(on: bool, early: bool) -> None:
    kernel = mm.compile_without_device(8, 4096, 4096, 64, mm.default_config(8, 4096, 4096), "asm", list(_levels()),
                                       True, pdl=on, early=early)
    ptx = kernel.asm["ptx"]
    assert (WAIT in ptx, RELEASE in ptx) == (on, on)
    if on:
        assert ptx.index(WAIT) < ptx.index("ld.global") < ptx.index(RELEASE)
    assert ("prefetch.global.L2" in ptx) == early
    if early:
        assert ptx.rindex("prefetch.global.L2") < ptx.index(WAIT)


@needs_gdc
@pytest.mark.parametrize("on", [True, False])
def test_the_paged_decode_attention_waits_and_releases_only_in_its_pdl_form(on: bool) -> None:
    signature = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "table_ptr": "*i32", "pos_ptr": "*i64",
                 "o_ptr": "*fp32", "m_ptr": "*fp32", "l_ptr": "*fp32", "scale": "fp32", "stride_b": "i32",
                 "stride_l": "i32", "stride_h": "i32", "stride_t": "i32", "B": "i32"}
    constexprs = dict(HKV=8, G=4, GP=16, D=128, BLOCK_L=64, IEEE=False, INT8=False, INT4=False, GROUP4=16, PAGE=16,
                      ALIGN=16, PDL=on)
    ptx = _compile(attention._attn_paged_split_kernel, signature, constexprs)
    assert (WAIT in ptx, RELEASE in ptx) == (on, on)
    if on:  # nothing, not even the row's length, is read before the wait
        assert ptx.index(WAIT) < ptx.index("ld.global") < ptx.index(RELEASE)
    combine = _compile(attention._attn_combine_kernel, {"o_ptr": "*fp32", "m_ptr": "*fp32", "l_ptr": "*fp32",
                                                        "out_ptr": "*bf16", "nsplit": "i32"},
                       dict(HQ=32, D=128, SP=16, PDL=on))
    assert (WAIT in combine, RELEASE in combine) == (on, on)


def test_the_overlap_resolves_off_where_pdl_cannot_run() -> None:
    cpu = torch.device("cpu")
    assert pdl.pdl_support(cpu) == (False, "PDL is a CUDA feature")
    assert FastDecodeOptions().launch_overlap == "auto"
    assert FastDecodeOptions().resolved(cpu, 64).launch_overlap == "off"
    assert FastDecodeOptions(launch_overlap="off").resolved(cpu, 64).launch_overlap == "off"
    assert FastDecodeOptions(launch_overlap="early").resolved(cpu, 64).launch_overlap == "off"
    with pytest.raises(GenerationError, match="launch overlap"):
        FastDecodeOptions(launch_overlap="sometimes").resolved(cpu, 64)
    assert pdl.compile_options(False) == {}
    assert pdl.compile_options(True) == ({"triton.enable_pdl": True} if pdl.inductor_has_pdl() else {})
    assert pdl.pdl_meta(False) == {} and pdl.pdl_meta(True) == {"PDL": True, "launch_pdl": True}


def test_the_setting_reaches_the_model_settings() -> None:
    assert Settings.from_env(environ={}, env_file=None).model.launch_overlap == "auto"
    assert Settings.from_env(environ={"LAUNCH_OVERLAP": "off"}, env_file=None).model.launch_overlap == "off"
    assert Settings.from_env(environ={"LAUNCH_OVERLAP": "early"}, env_file=None).model.launch_overlap == "early"
    with pytest.raises(SettingsError, match="LAUNCH_OVERLAP"):
        Settings.from_env(environ={"LAUNCH_OVERLAP": "always"}, env_file=None)


def test_packed_linears_carry_the_resolved_choice_to_their_op() -> None:
    lin = torch.nn.Linear(64, 32, bias=False)
    on = pack_linears([lin], FastDecodeOptions(launch_overlap="on", dense_gemv="cublas"), "bnb")
    early = pack_linears([lin], FastDecodeOptions(launch_overlap="early", dense_gemv="cublas"), "bnb")
    off = pack_linears([lin], FastDecodeOptions(launch_overlap="off", dense_gemv="cublas"), "bnb")
    auto = pack_linears([lin], FastDecodeOptions(dense_gemv="cublas"), "bnb")  # unresolved: not on
    assert (on.spec.pdl, early.spec.pdl, off.spec.pdl, auto.spec.pdl) == (True, True, False, False)
    assert (on.spec.early, early.spec.early, off.spec.early) == (False, True, False)
    assert on.spec.fmt == off.spec.fmt == "dense" and on.tensors[0].data_ptr() == off.tensors[0].data_ptr()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_the_decode_step_with_the_overlap_gives_the_scores_it_gives_without(tmp_path: Any) -> None:
    """A random tiny llama in NF4 (the nf4 GEMV and the Triton attention), teacher-forced through FastDecoder with
    LAUNCH_OVERLAP auto (on, on sm_90), early and off: the same scores within bf16 noise (the kernels are the same
    code; only the launch, the waits and the prefetch differ)."""
    from bench.probes import forced_scores
    from llm_core.fast import FastDecoder
    from tests.test_nf4_gemv import tiny_nf4_forced_case

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs sm_90 or newer")
    ok, why = pdl.pdl_support(torch.device("cuda"))  # the probe: a PDL kernel eagerly and in a CUDA graph
    assert ok, why
    loaded, ids, forced = tiny_nf4_forced_case(tmp_path)
    scores = {}
    for overlap in ("auto", "early", "off"):
        decoder = FastDecoder(loaded, max_cache_len=512, options=FastDecodeOptions(gemv="nf4",
                                                                                     launch_overlap=overlap))
        assert decoder.options.launch_overlap == {"auto": "on"}.get(overlap, overlap)
        decoder.warmup()
        scores[overlap] = forced_scores(decoder, ids, forced)
        del decoder
    for overlap in ("auto", "early"):
        rel = ((scores[overlap] - scores["off"]).norm(dim=-1) / scores["off"].norm(dim=-1)).max().item()
        assert rel <= 1e-2, (overlap, rel)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("m", [1, 8])
def test_gpu_the_pdl_forms_compute_the_same_bits(m: int) -> None:
    """The GEMV (m = 1) and nf4_mm (m = 8) at one launch configuration: plain, as PDL launches, and with the first
    weight tile prefetched before the wait, in a CUDA graph of several calls in a row (where the launches overlap):
    the same bits (only the launch and the waits differ)."""
    import bitsandbytes.functional as bf

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs sm_90 or newer")
    n, k = 4096, 4096
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    packed, qs = bf.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")
    words = nf4_gemv.words_view(packed.view(torch.uint8).reshape(n, k // 2))
    nb2 = qs.state2.absmax.numel()
    nested = (qs.absmax.view(-1), qs.state2.absmax.float(), qs.offset.float().reshape(()).repeat(nb2),
              qs.state2.code.float())
    levels = tuple(qs.code.float().tolist())
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    outs: dict[str, list[torch.Tensor]] = {}
    for name, launch in {"plain": {}, "pdl": {"pdl": True}, "early": {"pdl": True, "early": True}}.items():
        results: list[torch.Tensor] = []

        def calls(launch: dict[str, bool] = launch, results: list[torch.Tensor] = results) -> None:
            results.clear()
            for _ in range(4):
                if m == 1:
                    results.append(nf4_gemv.nf4_gemv(x, words, 64, levels, nested=nested, config=(8, 8, 4), **launch))
                else:
                    results.append(mm.nf4_mm(x, words, 64, qs.code.float(), nested=nested, decode="asm",
                                             levels=levels, **launch))

        calls()  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            calls()
        graph.replay()
        torch.cuda.synchronize()
        outs[name] = [r.clone() for r in results]  # while the graph (and its pool) is alive
    for name in ("pdl", "early"):
        assert all(torch.equal(a, b) for a, b in zip(outs[name], outs["plain"], strict=True)), name
