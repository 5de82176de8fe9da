"""The paged prefix attention (llm_core.fast.kernels.prefix_attention): a later prefill chunk's queries over every key
of their sequence, read through its block table from the pool in place. Under Triton's interpreter (its own process)
the kernel equals the torch reference for fp32, bf16 and int8 rows, grouped K/V heads, blocks of 16/32/64 tokens,
chunks that start at 0, mid-block and past several blocks, and lengths that are not multiples of its tiles, without
reading a position past the chunk; the reference itself equals the engine's masked prefill attention over the
gathered rows (llm_core.fast.layer); the kernel compiles for sm_90 (bf16 and int8 rows)."""

from __future__ import annotations

import os

import pytest
import torch

from llm_core.errors import GenerationError
from llm_core.fast import kvquant
from llm_core.fast.kernels.attention import gather_blocks
from llm_core.fast.layer import LayerSpec, _prefill_attention

try:
    from llm_core.fast.kernels import prefix_attention as pa
except ImportError:  # pragma: no cover
    pa = None  # type: ignore[assignment]

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
HAS_TRITON = pa is not None and pa.triton is not None
needs_interpreter = pytest.mark.skipif(not INTERPRETED or not HAS_TRITON,
                                       reason="runs in its own process with TRITON_INTERPRET=1 (see below)")
HEAD_DIM, KV_HEADS, GROUPS = 32, 2, 2
# (row format, page, start, new tokens): a first chunk, one starting mid-block, one past several blocks; S < a tile
KERNEL_CASES = [("fp32", 16, 0, 37), ("fp32", 32, 21, 30), ("fp32", 64, 70, 9), ("bf16", 16, 35, 29),
                ("int8", 16, 40, 25), ("int8-bf16", 32, 0, 40)]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def prefix_case(fmt: str, page: int, start: int, seq: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """q (seq, Hq, D); a pool (num_blocks, page, Hkv, row) in the format whose blocks hold the sequence's positions
    0..start+seq-1 in shuffled order (its table's unused entries and the last block's positions past the chunk hold
    1e4: any read of them would dominate the output); the table (max_blocks,) int32."""
    g = torch.Generator().manual_seed(seed)
    end = start + seq
    used = -(-end // page)
    num_blocks = used + 6
    dtype = torch.bfloat16 if fmt in ("bf16", "int8-bf16") else torch.float32
    q = torch.randn(seq, KV_HEADS * GROUPS, HEAD_DIM, generator=g).to(dtype)
    k = torch.randn(num_blocks, page, KV_HEADS, HEAD_DIM, generator=g) * 2
    v = torch.randn(num_blocks, page, KV_HEADS, HEAD_DIM, generator=g)
    order = torch.randperm(num_blocks - 1, generator=g).tolist()
    scratch = num_blocks - 1
    table = torch.full((used + 3,), scratch, dtype=torch.int32)
    table[:used] = torch.tensor(order[:used], dtype=torch.int32)
    k[scratch], v[scratch] = 1e4, 1e4
    last, past = int(table[used - 1]), end - (used - 1) * page  # positions after the chunk in its last block
    k[last, past:], v[last, past:] = 1e4, 1e4
    if fmt.startswith("int8"):
        k, v = kvquant.quantize_rows(k), kvquant.quantize_rows(v)
    else:
        k, v = k.to(dtype), v.to(dtype)
    return q, k, v, table


def test_the_reference_is_the_engines_masked_prefill_attention_over_the_gathered_rows() -> None:
    """prefix_attention_reference = what the fast path's later chunk computes today (layer._prefill_attention with
    its bottom-right causal mask, over the rows gathered out of the pool and dequantized), for bf16-valued and int8
    rows and grouped K/V heads."""
    spec = LayerSpec(KV_HEADS * GROUPS, KV_HEADS, HEAD_DIM, HEAD_DIM ** -0.5, 1e-6, 1e-6, None, (), True, "matmul")
    for fmt in ("fp32", "int8"):
        start, seq = 40, 25
        q, k, v, table = prefix_case(fmt, 16, start, seq)
        end = start + seq
        rows_k, rows_v = gather_blocks(k, table[None])[0, :end], gather_blocks(v, table[None])[0, :end]
        keys = kvquant.from_cache(rows_k, torch.float32).transpose(0, 1)[None]  # (1, Hkv, T, D)
        values = kvquant.from_cache(rows_v, torch.float32).transpose(0, 1)[None]
        mask = torch.arange(end)[None, :] <= torch.arange(start, end)[:, None]
        engine = _prefill_attention(spec, q.transpose(0, 1)[None], keys, values, mask)  # (1, S, Hq * D)
        got = pa.prefix_attention_reference(q, k, v, table, start, spec.scale)  # type: ignore[union-attr]
        assert _rel(got.reshape(engine.shape), engine) <= 1e-5, fmt


@needs_interpreter
@pytest.mark.parametrize(("fmt", "page", "start", "seq"), KERNEL_CASES)
def test_interpreted_prefix_attention_equals_the_reference(fmt: str, page: int, start: int, seq: int,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel over the shuffled pool = the torch reference (fp32 rows and int8 rows with an fp32 query: 1e-5; a
    bf16 query: 2e-2, the decode kernel's bound), and no read past the chunk (those rows hold 1e4)."""
    from tests.triton_interp import exact_bf16

    exact_bf16(monkeypatch)
    q, k, v, table = prefix_case(fmt, page, start, seq)
    scale = HEAD_DIM ** -0.5
    got = pa.prefix_attention_paged(q, k, v, table, start, scale, block_m=16, block_n=16)  # type: ignore[union-attr]
    want = pa.prefix_attention_reference(q.float(), k if kvquant.is_quantized(k) else k.float(),  # type: ignore
                                         v if kvquant.is_quantized(v) else v.float(), table, start, scale)
    assert got.shape == q.shape and got.dtype == q.dtype
    assert got.float().abs().max() < 100  # an over-read of a 1e4 row would show here
    assert _rel(got, want) <= (2e-2 if q.dtype == torch.bfloat16 else 1e-5), fmt


@needs_interpreter
def test_interpreted_prefix_attention_refuses_what_it_cannot_read() -> None:
    """int4 rows, a table that does not reach the chunk's last position: refused with a message, nothing launched."""
    q, k, v, table = prefix_case("fp32", 16, 20, 10)
    with pytest.raises(GenerationError, match="does not reach position 29"):
        pa.prefix_attention_paged(q, k, v, table[:1], 20, 1.0)  # type: ignore[union-attr]
    k4 = kvquant.quantize_rows4(torch.randn(4, 16, KV_HEADS, HEAD_DIM))
    with pytest.raises(GenerationError, match="not int4"):
        pa.prefix_attention_paged(q, k4, k4, table, 20, 1.0)  # type: ignore[union-attr]


@pytest.mark.skipif(INTERPRETED or not HAS_TRITON,
                    reason="the suite's own process starts the interpreter's (needs the triton package)")
def test_the_interpreted_prefix_attention_tests_pass_in_a_child_process() -> None:
    """TRITON_INTERPRET is read when Triton is imported: the interpreted tests above run in a child pytest."""
    from tests.triton_interp import run_interpreted_tests

    run = run_interpreted_tests(__file__)
    assert run.returncode == 0 and f"{len(KERNEL_CASES) + 1} passed" in run.stdout, (
        run.stdout[-3000:] + run.stderr[-2000:])


@pytest.mark.skipif(not HAS_TRITON, reason="needs the triton package")
@pytest.mark.parametrize("rows", ["bf16", "int8"])
def test_prefix_attention_compiles_for_hopper(rows: str) -> None:
    """Compile (not run) the kernel for sm_90 on CPU at the shape it would serve: bf16 queries, head_dim 128,
    Llama-3's 4 query heads per K/V head, 64-query x 64-key tiles, 16-token blocks."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if INTERPRETED:
        pytest.skip("compiles in the suite's own process")
    cache = {"bf16": "*bf16", "int8": "*i8"}[rows]
    signature = {"q_ptr": "*bf16", "k_ptr": cache, "v_ptr": cache, "table_ptr": "*i32", "out_ptr": "*bf16",
                 "start": "i32", "S": "i32", "scale_log2": "fp32", "stride_qs": "i32", "stride_qh": "i32",
                 "stride_os": "i32", "stride_oh": "i32", "stride_b": "i32", "stride_l": "i32", "stride_h": "i32"}
    constexprs = dict(G=4, D=128, BLOCK_M=64, BLOCK_N=64, PAGE=16, IEEE=False, INT8=rows == "int8",
                      ALIGN={"bf16": 16, "int8": 4}[rows])
    signature.update({name: "constexpr" for name in constexprs})
    compiled = pa.triton.compile(ASTSource(fn=pa._prefix_attention_kernel, signature=signature,  # type: ignore
                                           constexprs=constexprs), target=GPUTarget("cuda", 90, 32))
    assert "mma" in compiled.asm["ptx"]  # the dots run on tensor cores


def test_the_bench_times_the_engines_own_later_chunk_attention() -> None:
    """bench.prefix_attention --paged times, as "the engine's path", the prefix gathered out of the pool, then
    dequantized and attended PREFIX_HEADS K/V heads at a time (here 2 groups of 8 of 16 K/V heads, int8 rows): the
    reference's values, so the comparison it records is against what SlotDecoder.prefill computes."""
    from bench.prefix_attention import PAGE, engine_prefix_attention

    heads = kv_heads = 16
    spec = LayerSpec(heads, kv_heads, HEAD_DIM, HEAD_DIM ** -0.5, 1e-6, 1e-6, None, (), True, "matmul")
    g = torch.Generator().manual_seed(1)
    start, seq = 3 * PAGE + 5, 20
    blocks = -(-(start + seq) // PAGE)
    k = kvquant.quantize_rows(torch.randn(blocks + 2, PAGE, kv_heads, HEAD_DIM, generator=g))
    v = kvquant.quantize_rows(torch.randn(blocks + 2, PAGE, kv_heads, HEAD_DIM, generator=g))
    table = torch.randperm(blocks + 2, generator=g)[:blocks].to(torch.int32)
    q = torch.randn(seq, heads, HEAD_DIM, generator=g)
    got = engine_prefix_attention(spec, q.transpose(0, 1)[None], k, v, table, start)
    want = pa.prefix_attention_reference(q, k, v, table, start, spec.scale)  # type: ignore[union-attr]
    assert _rel(got.reshape(want.shape), want) <= 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("rows", ["bf16", "int8"])
def test_gpu_prefix_attention_equals_the_reference(rows: str) -> None:
    """On the GPU at a real shape (32 query heads over 8 K/V heads, head_dim 128, 16-token blocks, 700 new tokens
    after 1,300 cached): the kernel at each launch bench.prefix_attention times = the fp32 reference within bf16's
    rounding (2e-2, the decode kernel's bound)."""
    from bench.prefix_attention import PAGED_LAUNCHES

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    start, seq, page = 1300, 700, 16
    blocks = -(-(start + seq) // page)
    k = torch.randn(blocks + 4, page, 8, 128, device=dev, generator=g)
    v = torch.randn(blocks + 4, page, 8, 128, device=dev, generator=g)
    k, v = (kvquant.quantize_rows(k), kvquant.quantize_rows(v)) if rows == "int8" else (k.bfloat16(), v.bfloat16())
    table = torch.randperm(blocks + 4, device=dev, generator=g)[:blocks].to(torch.int32)
    q = torch.randn(seq, 32, 128, device=dev, generator=g).bfloat16()
    want = pa.prefix_attention_reference(q.float(), k if rows == "int8" else k.float(),  # type: ignore[union-attr]
                                         v if rows == "int8" else v.float(), table, start, 128 ** -0.5)
    for launch in PAGED_LAUNCHES:
        got = pa.prefix_attention_paged(q, k, v, table, start, 128 ** -0.5, **launch)  # type: ignore[union-attr]
        assert _rel(got, want) <= 2e-2, launch
