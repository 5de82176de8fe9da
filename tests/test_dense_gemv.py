"""llm_core.dense_gemv: the one-token matrix-vector op for unquantized or int8 (row-scaled) weights, with its
prologues (RMSNorm, SiLU-and-multiply) and residual epilogue.

On CPU the op is its torch reference; these tests pin that reference to the eager ops the decode layer would run
instead (the fused layer's token equality with generate is in test_fast_decode). The Triton kernel runs in the
GPU tests (marked `gpu`), against the reference, for even and uneven column steps, ragged row counts, bias, fp16
and every prologue.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from llm_core.fast import layer
from llm_core.fast.kernels import dense_gemv as dg


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(((a.float() - b.float()).norm() / b.float().norm()).item())


def _case(n: int, k: int, dtype: torch.dtype, device: str = "cpu", seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype).to(device),
        "x": torch.randn(1, k, generator=g).to(dtype).to(device),
        "gate_up": torch.randn(1, 2 * k, generator=g).to(dtype).to(device),
        "g": (1 + 0.1 * torch.randn(k, generator=g)).to(dtype).to(device),
        "bias": torch.randn(n, generator=g).to(dtype).to(device),
        "res": torch.randn(1, n, generator=g).to(dtype).to(device),
    }


def test_reference_norm_prologue_is_rmsnorm_then_linear() -> None:
    c = _case(48, 64, torch.float32)
    want = F.linear(layer.rms_norm(c["x"], c["g"], 1e-5), c["w"])
    got = dg.dense_gemv_reference(c["x"], c["w"], norm_weight=c["g"], eps=1e-5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # the eps is used: a huge one shrinks the output by the factor it puts in the norm
    small = dg.dense_gemv_reference(c["x"], c["w"], norm_weight=c["g"], eps=1e4)
    assert small.norm() < 0.1 * got.norm()


def test_reference_glu_prologue_is_silu_gate_times_up_then_linear() -> None:
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
        c = _case(40, 32, dtype)
        gate, up = c["gate_up"].split(32, dim=-1)
        want = F.linear(F.silu(gate) * up, c["w"])
        got = dg.dense_gemv_reference(c["gate_up"], c["w"], glu=True)
        assert got.dtype == dtype and got.shape == (1, 40)
        assert _rel(got, want) <= tol
        # swapping gate and up changes the result: the prologue reads the halves in the fused layer's order
        swapped = dg.dense_gemv_reference(torch.cat([up, gate], -1), c["w"], glu=True)
        assert _rel(swapped, want) > 0.1


def test_reference_bias_and_residual_epilogue() -> None:
    c = _case(24, 16, torch.float32)
    want = c["res"] + F.linear(c["x"], c["w"], c["bias"])
    got = dg.dense_gemv_reference(c["x"], c["w"], bias=c["bias"], residual=c["res"])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def _int8_case(n: int, k: int, dtype: torch.dtype, device: str = "cpu", seed: int = 0
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x, int8 weights, row scales SCB / 127, the same weights dequantized in fp32) as bitsandbytes stores them."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) / k ** 0.5
    scb = w.abs().amax(1)
    q = torch.round(w * 127 / scb[:, None]).to(torch.int8)
    scale = scb / 127
    x = torch.randn(1, k, generator=g).to(dtype)
    return x.to(device), q.to(device), scale.to(device), (q.float() * scale[:, None]).to(device)


def test_reference_row_scale_is_int8_dequantization_then_linear() -> None:
    x, q, scale, deq = _int8_case(24, 40, torch.float32)
    bias = torch.randn(24)
    got = dg.dense_gemv_reference(x, q, bias, row_scale=scale)
    torch.testing.assert_close(got, F.linear(x, deq, bias), rtol=1e-5, atol=1e-5)
    op = torch.ops.llm_core.dense_gemv(x.half(), q, None, None, None, 0.0, False, scale)
    assert op.dtype == torch.float16
    torch.testing.assert_close(op.float(), F.linear(x.half().float(), deq), rtol=2e-3, atol=2e-3)


def test_the_custom_op_runs_the_reference_on_cpu_and_traces() -> None:
    c = _case(8, 16, torch.float32)
    want = dg.dense_gemv_reference(c["x"], c["w"], c["bias"], c["res"], c["g"], 1e-6, False)
    got = torch.ops.llm_core.dense_gemv(c["x"], c["w"], c["bias"], c["res"], c["g"], 1e-6, False)
    torch.testing.assert_close(got, want)

    def step(x: torch.Tensor, w: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        return torch.ops.llm_core.dense_gemv(x, w, None, r, None, 0.0, False) * 2

    traced = torch.compile(step, fullgraph=True, backend="eager")(c["x"], c["w"], c["res"])
    torch.testing.assert_close(traced, 2 * (c["res"] + F.linear(c["x"], c["w"])))


def test_the_kernel_checks_its_input_sizes() -> None:
    if dg.triton is None:
        with pytest.raises(RuntimeError, match="Triton"):
            dg.dense_gemv(torch.zeros(1, 4), torch.zeros(2, 4))
        return
    with pytest.raises(ValueError, match="elements"):
        dg.dense_gemv(torch.zeros(1, 4), torch.zeros(2, 4), glu=True)
    with pytest.raises(ValueError, match="row_scale"):
        dg.dense_gemv(torch.zeros(1, 4), torch.zeros(2, 4, dtype=torch.int8))


# --- GPU ---------------------------------------------------------------------------------------------------------

needs_triton_gpu = pytest.mark.skipif(not (torch.cuda.is_available() and dg.triton is not None),
                                      reason="needs CUDA and Triton")


@pytest.mark.gpu
@needs_triton_gpu
@pytest.mark.parametrize(("n", "k", "config"), [(4096, 11008, None), (12288 + 3, 4096, None), (1000, 1000, (4, 512, 4)),
                                                (1000, 1000, (16, 256, 4)), (4096, 11008, (1, 4096, 8))])
@pytest.mark.parametrize("variant", ["plain", "bias", "norm", "glu", "residual", "norm+residual"])
def test_kernel_matches_the_reference_on_gpu(config: Any, n: int, k: int, variant: str) -> None:
    c = _case(n, k, torch.bfloat16, "cuda", seed=n + k)
    kw: dict[str, Any] = {}
    x = c["gate_up"] if variant == "glu" else c["x"]
    if variant == "bias":
        kw["bias"] = c["bias"]
    if "norm" in variant:
        kw.update(norm_weight=c["g"], eps=1e-5)
    if variant == "glu":
        kw["glu"] = True
    if "residual" in variant:
        kw["residual"] = c["res"]
    want = dg.dense_gemv_reference(x, c["w"], **kw)
    got = dg.dense_gemv(x, c["w"], config=config, **kw)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert _rel(got, want) <= 5e-3, (variant, config)


@pytest.mark.gpu
@needs_triton_gpu
def test_kernel_in_fp16_and_fp32_on_gpu() -> None:
    for dtype in (torch.float16, torch.float32):
        c = _case(2048, 4096, dtype, "cuda")
        want = dg.dense_gemv_reference(c["gate_up"], c["w"], glu=True, residual=c["res"])
        got = dg.dense_gemv(c["gate_up"], c["w"], glu=True, residual=c["res"])
        assert got.dtype == dtype and _rel(got, want) <= (5e-3 if dtype == torch.float16 else 1e-5)


@pytest.mark.gpu
@needs_triton_gpu
@pytest.mark.parametrize(("n", "k", "config"), [(12288, 4096, None), (4096, 11008, None), (1000, 1000, (4, 512, 4))])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_int8_kernel_matches_the_dequantized_weights_on_gpu(n: int, k: int, config: Any, dtype: torch.dtype) -> None:
    x, q, scale, deq = _int8_case(n, k, dtype, "cuda", seed=n)
    bias = torch.randn(n, device="cuda").to(dtype)
    want = F.linear(x.float(), deq, bias.float())
    got = dg.dense_gemv(x, q, bias, row_scale=scale, config=config)
    assert got.dtype == dtype and _rel(got, want) <= 5e-3
