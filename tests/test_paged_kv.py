"""The paged KV pool of the batched fast path (KV_LAYOUT=paged): the Triton decode attention reading K/V through a
block table (under Triton's interpreter, in its own process) equals today's contiguous kernel on the same rows and
the torch reference, for the bf16, int8 and int4 row formats, blocks of 16/32/64 tokens, lengths crossing block
boundaries and shuffled tables; then, on CPU with the embedded model (eager step), paged replies equal slot
replies token for token, a lone reply may outgrow one slot, a repeated prefix comes from the cache
(cached_prompt_tokens exact, tokens unchanged) and a full pool makes rows wait instead of failing. GPU-only
checks are marked."""

from __future__ import annotations

import os

import pytest
import torch

from llm_core.fast import kvquant
from llm_core.fast.batched import attention_rows
from llm_core.fast.kernels.attention import gather_blocks
from llm_core.fast.layer import LayerSpec

try:
    from llm_core.fast.kernels import attention
except ImportError:  # pragma: no cover
    attention = None  # type: ignore[assignment]

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
needs_interpreter = pytest.mark.skipif(not INTERPRETED or attention is None or attention.triton is None,
                                       reason="runs in its own process with TRITON_INTERPRET=1 (see below)")
HEAD_DIM, KV_HEADS, GROUPS = 32, 2, 2
# the combinations the interpreter runs: every block size in fp32, every row format at one of them
KERNEL_CASES = [("fp32", 16), ("fp32", 32), ("fp32", 64), ("bf16", 16), ("int8", 32), ("int4", 16)]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def paged_case(fmt: str, page: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """q (3, Hq, D); a pool of K/V blocks (num_blocks, page, Hkv, row) in the format; each row's block table
    (3, 8) int32 a shuffled, disjoint choice of blocks, the unused entries naming a block of large values that no
    read may touch; pos (3,): lengths 1, one past a block, three blocks and a bit."""
    g = torch.Generator().manual_seed(seed)
    width, num_blocks = 8, 26
    dtype = torch.bfloat16 if fmt == "bf16" else torch.float32
    q = torch.randn(3, KV_HEADS * GROUPS, HEAD_DIM, generator=g).to(dtype)
    k = torch.randn(num_blocks, page, KV_HEADS, HEAD_DIM, generator=g) * 2
    v = torch.randn(num_blocks, page, KV_HEADS, HEAD_DIM, generator=g)
    scratch = num_blocks - 1
    k[scratch], v[scratch] = 1e4, 1e4  # an over-read would dominate the output
    if fmt == "int8":
        k, v = kvquant.quantize_rows(k), kvquant.quantize_rows(v)
    elif fmt == "int4":
        k, v = kvquant.quantize_rows4(k), kvquant.quantize_rows4(v)
    else:
        k, v = k.to(dtype), v.to(dtype)
    pos = torch.tensor([0, page, 3 * page + 5])
    order = torch.randperm(scratch, generator=g).tolist()
    table = torch.full((3, width), scratch, dtype=torch.int32)
    for b, p in enumerate(pos.tolist()):
        used = p // page + 1
        table[b, :used] = torch.tensor(order[:used], dtype=torch.int32)
        order = order[used:]
    return q, k, v, table, pos


def _spec(attention_kind: str = "matmul") -> LayerSpec:
    return LayerSpec(KV_HEADS * GROUPS, KV_HEADS, HEAD_DIM, HEAD_DIM ** -0.5, 1e-6, 1e-6, None, (), True,
                     attention_kind)


def test_torch_paged_attention_equals_the_slot_attention_over_the_gathered_blocks() -> None:
    """The CPU form of the paged read (gather by block table) is the slot form over each row's blocks in order:
    equal to attention_rows over those rows laid out as slots, bit for bit, whatever the blocks' order in the
    pool; and the gather puts position i of row b at table[b, i // page], offset i % page."""
    q, k, v, table, pos = paged_case("fp32", 16)
    paged = attention_rows(_spec(), q, k, v, pos, table)
    slots_k, slots_v = gather_blocks(k, table), gather_blocks(v, table)
    assert torch.equal(paged, attention_rows(_spec(), q, slots_k, slots_v, pos))
    b, i = 2, 37
    assert torch.equal(slots_k[b, i], k[int(table[b, i // 16]), i % 16])


@needs_interpreter
@pytest.mark.parametrize(("fmt", "page"), KERNEL_CASES)
def test_interpreted_paged_kernel_equals_the_contiguous_kernel_and_the_reference(fmt: str, page: int,
                                                                                 monkeypatch: pytest.MonkeyPatch
                                                                                 ) -> None:
    """The paged kernel over shuffled blocks = the contiguous kernel over the same rows gathered into slots, bit for
    bit (one loop body, the same splits), and = the torch reference within the format's rounding (fp32 and the
    quantized rows with an fp32 query: 1e-5; a bf16 query: 2e-2, as the contiguous kernel's own test allows)."""
    from tests.triton_interp import exact_bf16

    exact_bf16(monkeypatch)
    q, k, v, table, pos = paged_case(fmt, page)
    scale = HEAD_DIM ** -0.5
    got = torch.ops.llm_core.decode_attention_paged(q, k, v, table, pos, scale)
    contiguous = torch.ops.llm_core.decode_attention_rows(q, gather_blocks(k, table), gather_blocks(v, table), pos,
                                                          scale)
    assert torch.equal(got, contiguous)
    want = attention_rows(_spec(), q.float(), k if kvquant.is_quantized(k) else k.float(),
                          v if kvquant.is_quantized(v) else v.float(), pos, table)
    assert _rel(got.reshape(want.shape), want) <= (2e-2 if fmt == "bf16" else 1e-5), fmt


@pytest.mark.skipif(INTERPRETED or attention is None or attention.triton is None,
                    reason="the suite's own process starts the interpreter's (needs the triton package)")
def test_the_interpreted_kernel_tests_pass_in_a_child_process() -> None:
    """TRITON_INTERPRET is read when Triton is imported: the interpreted tests above run in a child pytest."""
    from tests.triton_interp import run_interpreted_tests

    run = run_interpreted_tests(__file__)
    assert run.returncode == 0 and f"{len(KERNEL_CASES)} passed" in run.stdout, run.stdout[-3000:] + run.stderr[-2000:]


@pytest.mark.skipif(attention is None or attention.triton is None, reason="needs the triton package")
@pytest.mark.parametrize(("rows", "page"), [("bf16", 16), ("int8", 32), ("int4", 64)])
def test_paged_kernel_compiles_for_hopper(rows: str, page: int) -> None:
    """Compile (not run) the paged split kernel for sm_90 on CPU: bf16 query, each row format, a block size each."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if INTERPRETED:
        pytest.skip("compiles in the suite's own process")
    cache = {"bf16": "*bf16", "int8": "*i8", "int4": "*u8"}[rows]
    signature = {"q_ptr": "*bf16", "k_ptr": cache, "v_ptr": cache, "table_ptr": "*i32", "pos_ptr": "*i64",
                 "o_ptr": "*fp32", "m_ptr": "*fp32", "l_ptr": "*fp32", "scale": "fp32", "chunk": "i32",
                 "stride_b": "i32", "stride_l": "i32", "stride_h": "i32", "stride_t": "i32", "B": "i32"}
    constexprs = dict(HKV=8, G=4, GP=16, D=128, BLOCK_L=64, IEEE=False, INT8=rows == "int8", INT4=rows == "int4",
                      GROUP4=16, PAGE=page)
    signature.update({name: "constexpr" for name in constexprs})
    attention.triton.compile(ASTSource(fn=attention._attn_paged_split_kernel, signature=signature,
                                       constexprs=constexprs), target=GPUTarget("cuda", 90, 32))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4"])
@pytest.mark.parametrize("page", [16, 32, 64])
def test_gpu_paged_kernel_equals_the_contiguous_kernel(fmt: str, page: int) -> None:
    """On CUDA: the paged kernel over shuffled blocks = the contiguous kernel over the same rows, bit for bit."""
    q, k, v, table, pos = (t.cuda() for t in paged_case(fmt, page, seed=3))
    scale = HEAD_DIM ** -0.5
    got = torch.ops.llm_core.decode_attention_paged(q, k, v, table, pos, scale)
    want = torch.ops.llm_core.decode_attention_rows(q, gather_blocks(k, table), gather_blocks(v, table), pos, scale)
    assert torch.equal(got, want)
