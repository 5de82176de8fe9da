"""The decode attention's launch (AttentionLaunch: rows per inner step, warps, pipeline stages, programs per SM), what
bench/attention_rows.py --sweep varies: under Triton's interpreter (in its own process) the paged and the slots
kernels launched otherwise than the default equal the torch reference for fp32, bf16, int8 and int4 rows, over
lengths that are no multiple of the inner step (splits past a row's end included), and each other bit for bit;
attention_launch names a valid launch for every row format and row count; an invalid launch is refused."""

from __future__ import annotations

import pytest
import torch

from llm_core.errors import GenerationError
from llm_core.fast import kvquant
from llm_core.fast.batched import attention_rows
from llm_core.fast.kernels.attention import (
    ATTENTION_LAUNCHES,
    LAUNCH_ROW_BUCKETS,
    ROW_FORMATS,
    AttentionLaunch,
    _attention_splits,
    attention_launch,
    gather_blocks,
)
from llm_core.fast.layer import LayerSpec
from tests.test_paged_kv import INTERPRETED, attention, needs_interpreter, paged_case

HEAD_DIM, KV_HEADS, GROUPS, PAGE, WIDTH = 32, 2, 2, 16, 12
LAUNCHES = {  # the interpreter ignores num_warps and num_stages, but the launch must pass them
    "l32-w2-pps2": AttentionLaunch(block_l=32, num_warps=2, programs_per_sm=2),
    "l128-w8-s2-pps16": AttentionLaunch(block_l=128, num_warps=8, num_stages=2, programs_per_sm=16),
    "l16-pps16": AttentionLaunch(block_l=16, num_stages=4, programs_per_sm=16),  # 12 splits, most past row 0's end
}
KERNEL_CASES = [(fmt, name) for fmt in ("fp32", "bf16", "int8", "int4") for name in LAUNCHES]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _spec() -> LayerSpec:
    return LayerSpec(KV_HEADS * GROUPS, KV_HEADS, HEAD_DIM, HEAD_DIM ** -0.5, 1e-6, 1e-6, None, (), True, "matmul")


def launch_case(fmt: str, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """tests/test_paged_kv.paged_case with 16-token blocks, tables (3, 12) and lengths 45, 101 and 151: no multiple
    of 16, 32, 64 or 128."""
    return paged_case(fmt, PAGE, seed, lengths=(45, 101, 151), width=WIDTH)


@needs_interpreter
@pytest.mark.parametrize(("fmt", "name"), KERNEL_CASES)
def test_interpreted_kernels_launched_otherwise_equal_the_reference(fmt: str, name: str,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The paged kernel over shuffled blocks with a non-default launch = the slots kernel with that launch over the
    same rows gathered, bit for bit (one loop body, the same splits), and = the torch reference within the format's
    rounding (as tests/test_paged_kv.py allows: 1e-5 with an fp32 query, 2e-2 with a bf16 one)."""
    from tests.triton_interp import exact_bf16

    exact_bf16(monkeypatch)
    launch = LAUNCHES[name]
    q, k, v, table, pos = launch_case(fmt)
    scale = HEAD_DIM ** -0.5
    got = attention._attend_rows(q, k, v, pos, scale, table, launch)
    slots = attention._attend_rows(q, gather_blocks(k, table), gather_blocks(v, table), pos, scale, launch=launch)
    assert torch.equal(got, slots)
    want = attention_rows(_spec(), q.float(), k if kvquant.is_quantized(k) else k.float(),
                          v if kvquant.is_quantized(v) else v.float(), pos, table)
    assert _rel(got.reshape(want.shape), want) <= (2e-2 if fmt == "bf16" else 1e-5), (fmt, name)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4"])
def test_gpu_table_launches_equal_the_reference_over_long_rows(fmt: str) -> None:
    """On CUDA, the launches the table picks (1 and 8 rows) over 3,000-6,000 cached tokens in 16-token blocks, a bf16
    query: within 2e-2 of the torch reference over the same rows (for int8 the codes and each row's scale enter the
    dots apart: the rounding moved, not the values)."""
    torch.manual_seed(0)
    for rows in (1, 8):
        lengths = [3000 + 377 * i for i in range(rows)]
        blocks = [-(-n // 16) for n in lengths]
        q = torch.randn(rows, KV_HEADS * GROUPS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(sum(blocks) + 1, 16, KV_HEADS, HEAD_DIM, device="cuda") * 2
        v = torch.randn_like(k)
        if fmt == "int8":
            k, v = kvquant.quantize_rows(k), kvquant.quantize_rows(v)
        elif fmt == "int4":
            k, v = kvquant.quantize_rows4(k), kvquant.quantize_rows4(v)
        else:
            k, v = k.bfloat16(), v.bfloat16()
        order = torch.randperm(sum(blocks), device="cuda").int()
        table = torch.full((rows, max(blocks)), sum(blocks), dtype=torch.int32, device="cuda")
        start = 0
        for b, n in enumerate(blocks):
            table[b, :n] = order[start:start + n]
            start += n
        pos = torch.tensor([n - 1 for n in lengths], device="cuda")
        got = torch.ops.llm_core.decode_attention_paged(q, k, v, table, pos, HEAD_DIM ** -0.5)
        want = attention_rows(_spec(), q.float(), k if kvquant.is_quantized(k) else k.float(),
                              v if kvquant.is_quantized(v) else v.float(), pos, table)
        assert _rel(got.reshape(want.shape), want) <= 2e-2, (fmt, rows)


@pytest.mark.skipif(INTERPRETED or attention is None or attention.triton is None,
                    reason="the suite's own process starts the interpreter's (needs the triton package)")
def test_the_interpreted_launch_tests_pass_in_a_child_process() -> None:
    """TRITON_INTERPRET is read when Triton is imported: the interpreted tests above run in a child pytest."""
    from tests.triton_interp import run_interpreted_tests

    run = run_interpreted_tests(__file__)
    assert run.returncode == 0 and f"{len(KERNEL_CASES)} passed" in run.stdout, run.stdout[-3000:] + run.stderr[-2000:]


def test_attention_launch_names_a_valid_launch_for_every_format_and_row_count(monkeypatch: pytest.MonkeyPatch
                                                                               ) -> None:
    """Every row format at 1..64 rows (and past the last bucket) gets a launch that validates, off CUDA and on a
    Hopper GPU the table's own; another GPU gets the default launch; every table entry is a valid launch."""
    assert set(ATTENTION_LAUNCHES) == {(fmt, b) for fmt in ROW_FORMATS for b in LAUNCH_ROW_BUCKETS}
    cpu = torch.device("cpu")
    for fmt in ROW_FORMATS:
        for rows in [*range(1, 65), 200]:
            launch = attention_launch(fmt, rows, cpu)
            assert launch == AttentionLaunch(**vars(launch))  # revalidates
            bucket = next((b for b in LAUNCH_ROW_BUCKETS if rows <= b), LAUNCH_ROW_BUCKETS[-1])
            assert launch == ATTENTION_LAUNCHES[(fmt, bucket)]
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert attention_launch("int8", 3, cuda) == ATTENTION_LAUNCHES[("int8", 8)]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert attention_launch("int8", 3, cuda) == AttentionLaunch()


@pytest.mark.parametrize("bad", [dict(block_l=48), dict(programs_per_sm=0), dict(block_l=8), dict(num_warps=3),
                                 dict(num_stages=0), dict(block_l=64.0)])
def test_an_invalid_launch_is_refused(bad: dict[str, object]) -> None:
    with pytest.raises(GenerationError, match="invalid decode attention launch"):
        AttentionLaunch(**bad)  # type: ignore[arg-type]


def test_attention_launch_refuses_an_unknown_format_or_no_rows() -> None:
    for fmt, rows in (("fp8", 1), ("int8", 0)):
        with pytest.raises(GenerationError, match="no decode attention launch"):
            attention_launch(fmt, rows, torch.device("cpu"))


def test_splits_follow_programs_per_sm_and_block_l() -> None:
    """Off CUDA the device counts as 8 SMs: programs_per_sm * 8 programs over rows * kv heads, at most one split per
    block_l rows of the capacity; the default arguments are the launch before AttentionLaunch."""
    cpu = torch.device("cpu")
    assert _attention_splits(9000, 2, cpu) == _attention_splits(9000, 2, cpu, 4, 64) == 16
    assert _attention_splits(9000, 2, cpu, 16, 64) == 64
    assert _attention_splits(9000, 3, cpu, 2, 128) == 6  # ceil(16 / 3)
    assert _attention_splits(200, 1, cpu, 16, 128) == 2  # capped by the capacity's 128-row steps
    assert _attention_splits(200, 1, cpu, 16, 16) == 13


@pytest.mark.skipif(attention is None or attention.triton is None, reason="needs the triton package")
@pytest.mark.parametrize("launch", [AttentionLaunch(block_l=32, num_warps=2, num_stages=2),
                                    AttentionLaunch(block_l=128, num_warps=8, num_stages=4)])
def test_int8_rows_stay_copied_in_words_at_other_launches(launch: AttentionLaunch) -> None:
    """Compiled for sm_90 as the launcher specializes it (tests/test_paged_kv.py), the paged kernel over int8 rows of
    head_dim + 4 bytes at the sweep's extreme launches still fetches codes and exponents through cp.async, no byte
    loads (the byte loads cost the int8 rows 1.5x the bf16 rows' time), in the H100's shared memory."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if INTERPRETED:
        pytest.skip("compiles in the suite's own process")
    rows = torch.zeros(2, 16, 32, 128 + 4, dtype=torch.int8)  # (blocks, tokens, KV heads, row)
    signature = {"q_ptr": "*bf16", "k_ptr": "*i8", "v_ptr": "*i8", "table_ptr": "*i32", "pos_ptr": "*i64",
                 "o_ptr": "*fp32", "m_ptr": "*fp32", "l_ptr": "*fp32", "scale": "fp32", "stride_b": "i32",
                 "stride_l": "i32", "stride_h": "i32", "stride_t": "i32", "B": "i32"}
    strides = dict(zip(("stride_b", "stride_l", "stride_h"), rows.stride()[:3], strict=True)) | {"stride_t": 64}
    constexprs = dict(HKV=32, G=1, GP=16, D=128, BLOCK_L=launch.block_l, IEEE=False, INT8=True, INT4=False,
                      GROUP4=16, PAGE=16, ALIGN=attention.row_alignment(rows), PDL=False)
    names = list(signature)
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a, t in signature.items() if t.startswith("*")}
    attrs.update({(names.index(a),): [["tt.divisibility", 16]] for a, v in strides.items() if v % 16 == 0})
    signature.update({name: "constexpr" for name in constexprs})
    kernel = attention.triton.compile(
        ASTSource(fn=attention._attn_paged_split_kernel, signature=signature, constexprs=constexprs, attrs=attrs),
        target=GPUTarget("cuda", 90, 32), options=dict(num_warps=launch.num_warps, num_stages=launch.num_stages))
    ptx = kernel.asm["ptx"]
    assert "cp.async" in ptx and ptx.count("ld.global.b8") == 0, ptx.count("ld.global.b8")
    assert kernel.metadata.shared <= 227 * 1024 and kernel.metadata.num_warps == launch.num_warps
