"""The paged prefix attention (llm_core.fast.kernels.prefix_attention): a later prefill chunk's queries over every key
of their sequence, read through its block table from the pool in place. Under Triton's interpreter (its own process)
the kernel equals the torch reference for fp32, bf16 and int8 rows, grouped K/V heads, blocks of 16/32/64 tokens,
chunks that start at 0, mid-block and past several blocks, and lengths that are not multiples of its tiles, without
reading a position past the chunk; the reference itself equals the engine's masked prefill attention over the
gathered rows (llm_core.fast.layer); the kernel compiles for sm_90 (bf16 and int8 rows)."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from llm_core.engine.chat import ChatEngine
from llm_core.errors import GenerationError
from llm_core.fast import kvquant
from llm_core.fast.batched import SlotDecoder
from llm_core.fast.kernels.attention import gather_blocks
from llm_core.fast.layer import LayerSpec, _prefill_attention
from llm_core.history import Turn
from tests.conftest import drain, make_settings

try:
    from llm_core.fast.kernels import prefix_attention as pa
except ImportError:  # pragma: no cover
    pa = None  # type: ignore[assignment]

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
HAS_TRITON = pa is not None and pa.triton is not None
needs_interpreter = pytest.mark.skipif(not INTERPRETED or not HAS_TRITON,
                                       reason="runs in its own process with TRITON_INTERPRET=1 (see below)")
HEAD_DIM, KV_HEADS, GROUPS = 32, 2, 2
# (row format, page, start, new tokens, query heads per K/V head): a first chunk, one starting mid-block, one past
# several blocks; S < a tile; groups of 1, 2, 3 (not a power of two: padded rows) and 4
KERNEL_CASES = [("fp32", 16, 0, 37, 2), ("fp32", 32, 21, 30, 2), ("fp32", 64, 70, 9, 2), ("bf16", 16, 35, 29, 2),
                ("int8", 16, 40, 25, 2), ("int8-bf16", 32, 0, 40, 2), ("fp32", 16, 50, 23, 3), ("fp32", 32, 33, 17, 1),
                ("int8", 16, 67, 30, 4)]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def prefix_case(fmt: str, page: int, start: int, seq: int, seed: int = 0, groups: int = GROUPS
                ) -> tuple[torch.Tensor, ...]:
    """q (seq, Hq, D); a pool (num_blocks, page, Hkv, row) in the format whose blocks hold the sequence's positions
    0..start+seq-1 in shuffled order (its table's unused entries and the last block's positions past the chunk hold
    1e4: any read of them would dominate the output); the table (max_blocks,) int32."""
    g = torch.Generator().manual_seed(seed)
    end = start + seq
    used = -(-end // page)
    num_blocks = used + 6
    dtype = torch.bfloat16 if fmt in ("bf16", "int8-bf16") else torch.float32
    q = torch.randn(seq, KV_HEADS * groups, HEAD_DIM, generator=g).to(dtype)
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
@pytest.mark.parametrize(("fmt", "page", "start", "seq", "groups"), KERNEL_CASES)
def test_interpreted_prefix_attention_equals_the_reference(fmt: str, page: int, start: int, seq: int, groups: int,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel over the shuffled pool = the torch reference (fp32 rows and int8 rows with an fp32 query: 1e-5; a
    bf16 query: 2e-2, the decode kernel's bound), and no read past the chunk (those rows hold 1e4); 16 query rows a
    program, so a group of 3 or 4 heads shares each program's key tiles among 4-5 queries."""
    from tests.triton_interp import exact_bf16

    exact_bf16(monkeypatch)
    q, k, v, table = prefix_case(fmt, page, start, seq, groups=groups)
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
    constexprs = dict(G=4, GP=4, D=128, BLOCK_M=64, BLOCK_N=64, PAGE=16, IEEE=False, INT8=rows == "int8",
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


# --- wired in: PREFIX_ATTENTION=paged on the batched path's paged pool (CPU: the op's torch form) -------------------


def _engine(fp32_engine: ChatEngine, mode: str, kv_cache: str) -> ChatEngine:
    return ChatEngine(fp32_engine.loaded, make_settings(QUANTIZATION="none", COMPUTE_DTYPE="float32",
                                                        DECODE_PATH="fast", MAX_BATCH_SIZE="2", KV_LAYOUT="paged",
                                                        KV_CACHE=kv_cache, PREFIX_ATTENTION=mode))


@pytest.mark.parametrize("kv_cache", ["bf16", "int8"])
def test_later_chunks_read_in_place_equal_the_gathered_prefix(fp32_engine: ChatEngine, kv_cache: str,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A 100-token prompt prefilled in three chunks (0-40, 40-75, 75-100) into shuffled blocks: with
    PREFIX_ATTENTION=paged the chunks after the first never gather the prefix (layer_prefill_paged reads the pool),
    and each chunk's last hidden state and every K/V row written equal the gather path's (fp32 rows; int8 rows as
    the values they hold, within a code step's rounding)."""
    engines = {mode: _engine(fp32_engine, mode, kv_cache) for mode in ("gather", "paged")}
    try:
        results = {}
        for mode, engine in engines.items():
            rows = SlotDecoder(engine.backend.decoder, slots=2, slot_tokens=128, layout="paged")
            assert rows.reads_pool_in_place == (mode == "paged")
            rows.allocate()
            blocks = [11, 3, 7, 0, 9, 5, 14]
            rows.set_blocks(0, blocks)
            if mode == "paged":
                def first_chunk_only(pool: Any, slot: int, start: int, end: int, gathered: Any = rows._gathered) -> Any:
                    if start:
                        pytest.fail("a later chunk gathered its prefix")
                    return gathered(pool, slot, start, end)

                monkeypatch.setattr(rows, "_gathered", first_chunk_only)
            ids = (torch.arange(100) * 13 + 7) % engine.backend.decoder._arch.vocab
            hidden = [rows.prefill(0, ids[a:b], a) for a, b in ((0, 40), (40, 75), (75, 100))]
            keys = kvquant.from_cache(rows.k[:, blocks], torch.float32)
            values = kvquant.from_cache(rows.v[:, blocks], torch.float32)
            results[mode] = hidden, keys, values
        # fp32 rows: the same values up to summation order. int8 rows: the attention differs by ~2e-7 as in fp32
        # (measured at layer 0), but a later layer's K/V row rounds that difference to a whole code step now and then
        # (2^(1/8)/254 of the row's largest value), so its values differ by ~3e-3 of their norm
        bound = 1e-5 if kv_cache == "bf16" else 1e-2
        for got, want in zip(results["paged"][0], results["gather"][0], strict=True):
            assert _rel(got, want) <= bound
        for got, want in zip(results["paged"][1:], results["gather"][1:], strict=True):
            assert _rel(got, want) <= bound
    finally:
        for engine in engines.values():
            engine.close()


def test_a_chat_turn_after_a_cached_prefix_is_the_same_reply_read_in_place(fp32_engine: ChatEngine) -> None:
    """Through ChatEngine (what the app runs), PREFIX_ATTENTION=paged: a second turn's prompt comes from the pool
    but its last tokens (cached_prompt_tokens > 0), and both turns' greedy replies equal the default engine's."""
    replies = {}
    for mode in ("gather", "paged"):
        engine = _engine(fp32_engine, mode, "bf16")
        try:
            gen = engine.request_options(max_new_tokens=8, repetition_penalty=1.0)
            first = drain(engine.stream_chat("Name three rivers of Europe and one fact about each.", [], gen=gen))
            history = [Turn("Name three rivers of Europe and one fact about each.", first.text)]
            second = drain(engine.stream_chat("Which of them is the longest?", history, gen=gen))
            assert second.stats.cached_prompt_tokens > 0, mode
            replies[mode] = first.token_ids, second.token_ids
        finally:
            engine.close()
    assert replies["paged"] == replies["gather"]


def test_the_in_place_chunk_compiles_once_for_every_start_and_length(fp32_engine: ChatEngine,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """layer_prefill_paged compiled (as the CUDA fast path compiles its prefill; Inductor on CPU here): two later
    chunks at different starts and lengths (what start-up's _warm_prefill runs) leave start and length symbolic, so a
    third chunk of another start and length runs without compiling inside a reply; each equals the eager chunk."""
    engine = _engine(fp32_engine, "paged", "bf16")
    try:
        decoder = engine.backend.decoder
        ids = (torch.arange(120) * 13 + 7) % decoder._arch.vocab
        chunks = ((0, 30), (30, 61), (61, 89), (89, 120))

        def run(compiled: bool) -> list[torch.Tensor]:
            rows = SlotDecoder(decoder, slots=2, slot_tokens=128, layout="paged")
            rows.allocate()
            rows.set_blocks(0, [6, 2, 9, 4, 11, 0, 13, 1])
            if compiled:
                rows.compile = True
                rows._make_prefix_functions()
                assert rows._prefix_fns[0] is not rows._prefix_eager_fns[0]
                monkeypatch.setattr(decoder, "_prefill_compiled_ok", True)  # prefill() takes the compiled layers
            out = [rows.prefill(0, ids[a:b], a) for a, b in chunks[:3]]
            with torch._dynamo.config.patch(error_on_recompile=compiled):
                out.append(rows.prefill(0, ids[chunks[3][0]:chunks[3][1]], chunks[3][0]))
            return out

        eager = run(False)
        torch._dynamo.reset()
        for got, want in zip(run(True), eager, strict=True):
            assert _rel(got, want) <= 1e-4
    finally:
        engine.close()
