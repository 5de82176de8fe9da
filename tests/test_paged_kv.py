"""The paged KV pool of the batched fast path (KV_LAYOUT=paged): the Triton decode attention reading K/V through a
block table (under Triton's interpreter, in its own process) equals today's contiguous kernel on the same rows and
the torch reference, for the bf16, int8 and int4 row formats, blocks of 16/32/64 tokens, lengths crossing block
boundaries and shuffled tables; then, on CPU with the embedded model (eager step), paged replies equal slot
replies token for token, a lone reply may outgrow one slot, a repeated prefix comes from the cache
(cached_prompt_tokens exact, tokens unchanged) and a full pool makes rows wait instead of failing. GPU-only
checks are marked."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from llm_core.engine.chat import ChatEngine
from llm_core.engine.fast_runner import FastRunner
from llm_core.engine.scheduler import Scheduler
from llm_core.errors import ContextBudgetError
from llm_core.fast import kvquant
from llm_core.fast.batched import SlotDecoder, attention_rows
from llm_core.fast.kernels.attention import gather_blocks
from llm_core.fast.layer import LayerSpec
from llm_core.fast.slot_warmup import WARM_GROUP_LENGTHS
from llm_core.sampling import SamplingOptions
from tests.conftest import drain, make_settings
from tests.test_batched_fast import FP32, MAX_NEW, PROMPTS, staggered

try:
    from llm_core.fast.kernels import attention
except ImportError:  # pragma: no cover
    attention = None  # type: ignore[assignment]

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
needs_interpreter = pytest.mark.skipif(not INTERPRETED or attention is None or attention.triton is None,
                                       reason="runs in its own process with TRITON_INTERPRET=1 (see below)")
HEAD_DIM, KV_HEADS, GROUPS = 32, 2, 2
# the combinations the interpreter runs: every block size in fp32, every row format at one of them
GREEDY = SamplingOptions(repetition_penalty=1.0)
KERNEL_CASES = [("fp32", 16), ("fp32", 32), ("fp32", 64), ("bf16", 16), ("int8", 32), ("int4", 16)]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def paged_case(fmt: str, page: int, seed: int = 0, lengths: tuple[int, ...] | None = None,
               width: int = 8) -> tuple[torch.Tensor, ...]:
    """q (3, Hq, D); a pool of K/V blocks (num_blocks, page, Hkv, row) in the format; each row's block table
    (3, width) int32 a shuffled, disjoint choice of blocks, the unused entries naming a block of large values that
    no read may touch; pos (3,): the rows' last positions, lengths - 1 (default lengths: 1, one past a block,
    three blocks and a bit)."""
    g = torch.Generator().manual_seed(seed)
    pos = torch.tensor([n - 1 for n in lengths] if lengths else [0, page, 3 * page + 5])
    used = [p // page + 1 for p in pos.tolist()]
    num_blocks = max(26, sum(used) + 1)
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
    order = torch.randperm(scratch, generator=g).tolist()
    table = torch.full((3, width), scratch, dtype=torch.int32)
    for b, n in enumerate(used):
        table[b, :n] = torch.tensor(order[:n], dtype=torch.int32)
        order = order[n:]
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
                 "o_ptr": "*fp32", "m_ptr": "*fp32", "l_ptr": "*fp32", "scale": "fp32",
                 "stride_b": "i32", "stride_l": "i32", "stride_h": "i32", "stride_t": "i32", "B": "i32"}
    constexprs = dict(HKV=8, G=4, GP=16, D=128, BLOCK_L=64, IEEE=False, INT8=rows == "int8", INT4=rows == "int4",
                      GROUP4=16, PAGE=page, ALIGN={"bf16": 16, "int8": 4, "int4": 16}[rows], PDL=False)
    signature.update({name: "constexpr" for name in constexprs})
    attention.triton.compile(ASTSource(fn=attention._attn_paged_split_kernel, signature=signature,
                                       constexprs=constexprs), target=GPUTarget("cuda", 90, 32))


@pytest.mark.skipif(attention is None or attention.triton is None, reason="needs the triton package")
@pytest.mark.parametrize("paged", [False, True])
def test_int8_rows_of_head_dim_plus_4_bytes_are_copied_in_words(paged: bool) -> None:
    """The int8 cache's rows are head_dim + 4 bytes (kvquant), so a row's start is 4-byte aligned and the strides
    are not multiples of 16, which Triton specializes on. Compiled for sm_90 as the launcher specializes it (16-byte
    aligned buffers; the strides that divide by 16 marked so), the decode attention kernel must still fetch the codes
    with asynchronous word copies: told nothing (ALIGN=1) it loaded them a byte at a time, without the copy pipeline,
    and decoded at 55 tok/s at 8.9k tokens on an H100 (bench/results/2026-12-05-h100-cards-8gib-rowpad4-unaligned.json).
    With the codes in words, each row's exponent byte was still a synchronous byte load per step (paged int8 + 4 rows
    84 µs against 56 for bf16 at 9k tokens, bench/results/2026-12-05-s3-h100-attention-rows.json)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if INTERPRETED:
        pytest.skip("compiles in the suite's own process")
    row = 128 + 4
    rows = torch.zeros(2, 16, 8, row, dtype=torch.int8)  # (blocks or slots, tokens, KV heads, row)
    align = attention.row_alignment(rows)
    assert align == 4
    table = {"table_ptr": "*i32"} if paged else {}
    signature = {"q_ptr": "*bf16", "k_ptr": "*i8", "v_ptr": "*i8", **table, "pos_ptr": "*i64", "o_ptr": "*fp32",
                 "m_ptr": "*fp32", "l_ptr": "*fp32", "scale": "fp32", "stride_b": "i32", "stride_l": "i32",
                 "stride_h": "i32", **({"stride_t": "i32"} if paged else {}), "B": "i32"}
    strides = dict(zip(("stride_b", "stride_l", "stride_h"), rows.stride()[:3], strict=True)) | {"stride_t": 64}
    constexprs = dict(HKV=8, G=4, GP=16, D=128, BLOCK_L=64, IEEE=False, INT8=True, INT4=False, GROUP4=16,
                      **({"PAGE": 16} if paged else {}), ALIGN=align, PDL=False)
    fn = attention._attn_paged_split_kernel if paged else attention._attn_rows_split_kernel
    names = list(signature)
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a, t in signature.items() if t.startswith("*")}
    attrs.update({(names.index(a),): [["tt.divisibility", 16]] for a, v in strides.items()
                  if a in names and v % 16 == 0})
    signature.update({name: "constexpr" for name in constexprs})
    ptx = attention.triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                                   target=GPUTarget("cuda", 90, 32)).asm["ptx"]
    assert "cp.async" in ptx  # the codes go through the copy pipeline
    # and so do the rows' exponents, read as the low byte of a word: a byte load (cp.async copies 4 bytes at least)
    # was a synchronous load in every step of the loop
    assert ptx.count("ld.global.b8") == 0, ptx.count("ld.global.b8")


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


# --- the paged pool in the batched fast path (CPU, embedded model, eager step) ----------------------------------

SYSTEM = "You are a helpful assistant."


def _tokens(scheduler: Any, request: Any) -> list[int]:
    return list(scheduler.stream(request))


def _alone(decoder: Any, prompt: list[int], max_new: int) -> list[int]:
    """The prompt served alone by a slot-layout loop with one slot that holds it whole (the reference)."""
    scheduler = Scheduler(FastRunner(SlotDecoder(decoder, slots=1, slot_tokens=256)), eos_token_ids=[])
    try:
        return _tokens(scheduler, scheduler.submit(prompt, GREEDY, max_new, threading.Event()))
    finally:
        scheduler.close()


@pytest.fixture(scope="module")
def paged_engine(fp32_engine: ChatEngine) -> Iterator[ChatEngine]:
    """The fp32 model on the batched fast loop with KV_LAYOUT=paged, 4 rows."""
    engine = ChatEngine(fp32_engine.loaded, make_settings(**FP32, DECODE_PATH="fast", MAX_BATCH_SIZE="4",
                                                          KV_LAYOUT="paged"))
    assert engine.backend.name == "fast-batched" and engine.fast_scheduler.runner.decoder.paged
    yield engine
    engine.fast_scheduler.close()


def test_paged_rows_equal_their_reply_alone_while_rows_join_and_leave(fp32_engine: ChatEngine,
                                                                      paged_engine: ChatEngine) -> None:
    """5 replies of different lengths on 4 paged rows, arriving 0.3 s apart (rows join a running batch, leave at
    different steps, the fifth waits for a row): each row's greedy tokens are the plain path's reply alone, token
    for token; the engine's context limit is the whole pool's, not one slot's (up to the model's context)."""
    alone = [drain(fp32_engine.stream_chat(p, [], gen=fp32_engine.request_options(max_new_tokens=n),
                                           system_prompt=SYSTEM)) for p, n in zip(PROMPTS, MAX_NEW, strict=True)]
    scheduler = paged_engine.fast_scheduler
    decoder = scheduler.runner.decoder
    before = scheduler.snapshot()
    together = staggered(paged_engine, PROMPTS, MAX_NEW, 0.3)
    for i, reference in enumerate(alone):
        assert together[i].token_ids == reference.token_ids, f"prompt {i} differs from its reply alone"
        assert together[i].stats.decode_path == "fast-batched"
    after = scheduler.snapshot()
    assert after.max_rows_in_step >= 3 and after.errors == 0 and after.prefills - before.prefills == len(PROMPTS)
    assert after.kv_layout == "paged" and after.free_blocks == after.pool_blocks  # every block back, unheld
    assert decoder.reply_tokens == decoder.num_blocks * decoder.block_size == decoder.slots * decoder.slot_tokens
    # a lone reply may span the pool (here capped by the model's context, which one CPU slot already holds)
    assert paged_engine.context_limit == min(decoder.reply_tokens, paged_engine.loaded.context_length)


def test_newcomers_sharing_a_short_cached_prefix_are_prefilled_together(paged_engine: ChatEngine) -> None:
    """Four prompts arriving together at an idle loop, each starting with a 16-token block that an earlier reply
    left cached (as the chat template's first block is shared by every chat): one padded pass prefills all four
    (FastRunner._recomputable: the short prefix computed again, its shared block not written), not one pass per
    prompt. Each reply equals its prompt served alone, none counts cached tokens it recomputed, and a later prompt
    still takes the shared block back and gets its reply alone."""
    scheduler = paged_engine.fast_scheduler
    decoder = paged_engine.backend.decoder
    shared = list(range(300, 320))  # a full 16-token block, then 4 tokens of a partial one
    prompts = [shared + list(range(400 + 50 * i, 400 + 50 * i + n)) for i, n in enumerate((60, 75, 90, 66))]
    expected = [_alone(decoder, p, 6) for p in prompts]
    _tokens(scheduler, scheduler.submit(shared + list(range(900, 960)), GREEDY, 4, threading.Event()))
    before = scheduler.snapshot()
    with scheduler._cond:  # all four wait before the loop admits any
        requests = [scheduler.submit(p, GREEDY, 6, threading.Event()) for p in prompts]
    got = [_tokens(scheduler, r) for r in requests]
    after = scheduler.snapshot()
    assert got == expected
    assert after.prefills - before.prefills == 4 and after.prefill_chunks - before.prefill_chunks == 1
    assert [r.cached_prompt_tokens for r in requests] == [0, 0, 0, 0]
    last = shared + list(range(700, 740))
    request = scheduler.submit(last, GREEDY, 6, threading.Event())
    assert _tokens(scheduler, request) == _alone(decoder, last, 6) and request.cached_prompt_tokens == 16


def test_int8_rows_prefilled_together_equal_each_prompt_alone(fp32_engine: ChatEngine) -> None:
    """KV_CACHE=int8 on the paged pool: four prompts reaching an idle loop together are written to their blocks
    straight from one padded pass (only the real positions, quantized row by row), and each reply equals its prompt
    served alone from a one-slot int8 loop, token for token."""
    engine = ChatEngine(fp32_engine.loaded, make_settings(**FP32, DECODE_PATH="fast", MAX_BATCH_SIZE="4",
                                                          KV_LAYOUT="paged", KV_CACHE="int8"))
    scheduler = engine.fast_scheduler
    try:
        decoder = engine.backend.decoder
        prompts = [list(range(200 + 40 * i, 200 + 40 * i + n)) for i, n in enumerate((37, 52, 61, 44))]
        expected = [_alone(decoder, p, 6) for p in prompts]
        before = scheduler.snapshot()
        with scheduler._cond:  # all four wait before the loop admits any
            requests = [scheduler.submit(p, GREEDY, 6, threading.Event()) for p in prompts]
        got = [_tokens(scheduler, r) for r in requests]
        assert got == expected
        assert scheduler.snapshot().prefill_chunks - before.prefill_chunks == 1
        assert scheduler.runner.decoder.paged and scheduler.runner.decoder.k.dtype == torch.int8
        # the loop's timeline: the one group pass of 4 rows first, then the decode steps, in order
        timeline = scheduler.snapshot().timeline
        assert [(op, rows) for op, rows, _, _ in timeline[:2]] == [("prefill_rows", 4), ("run_step", 4)]
        assert {op for op, _, _, _ in timeline[1:]} == {"run_step"}
        assert all(a0 <= a1 <= b0 for (_, _, a0, a1), (_, _, b0, _) in zip(timeline[:-1], timeline[1:], strict=True))
    finally:
        scheduler.close()


def test_paged_rows_equal_slot_rows_token_for_token(paged_engine: ChatEngine) -> None:
    """The same four prompts arriving together on 2 rows (two wait and take the rows the first two free), once on
    slots and once on a paged pool of the same bytes: the same tokens for every prompt."""
    decoder = paged_engine.backend.decoder
    prompts = [list(range(100 + 37 * i, 100 + 37 * i + n)) for i, n in enumerate((40, 23, 61, 9))]
    out = {}
    for layout in ("slots", "paged"):
        scheduler = Scheduler(FastRunner(SlotDecoder(decoder, slots=2, slot_tokens=128, layout=layout)),
                              eos_token_ids=[])
        try:
            with scheduler._cond:
                requests = [scheduler.submit(p, GREEDY, n, threading.Event())
                            for p, n in zip(prompts, (12, 5, 9, 14), strict=True)]
            out[layout] = [_tokens(scheduler, r) for r in requests]
        finally:
            scheduler.close()
    assert out["paged"] == out["slots"]


def test_a_lone_paged_reply_may_outgrow_one_slot(paged_engine: ChatEngine) -> None:
    """2 rows of 64 tokens' worth: on slots a 60-token prompt + 40 new tokens is refused (more than one slot); on the
    paged pool of the same bytes (128 tokens) it runs to its length, equal to the prompt served alone."""
    decoder = paged_engine.backend.decoder
    prompt = list(range(200, 260))
    slots = Scheduler(FastRunner(SlotDecoder(decoder, slots=2, slot_tokens=64)), eos_token_ids=[])
    paged = Scheduler(FastRunner(SlotDecoder(decoder, slots=2, slot_tokens=64, layout="paged")), eos_token_ids=[])
    try:
        with pytest.raises(ContextBudgetError, match="KV slot"):
            slots.submit(prompt, GREEDY, 40, threading.Event())
        got = _tokens(paged, paged.submit(prompt, GREEDY, 40, threading.Event()))
        with pytest.raises(ContextBudgetError, match="KV pool"):
            paged.submit(prompt, GREEDY, 69, threading.Event())  # 129 tokens: more than the pool
    finally:
        slots.close()
        paged.close()
    assert got == _alone(decoder, prompt, 40)


def test_a_repeated_prefix_comes_from_the_pool_and_gives_the_same_tokens(paged_engine: ChatEngine) -> None:
    """On a fresh pool: a 70-token prompt (cold: nothing cached); the same prompt again reuses its 4 full blocks
    (64 tokens; the last token is always recomputed); a prompt sharing its first 50 tokens reuses 3 (48). Each
    reply equals its prompt served cold, token for token; with PREFIX_CACHE off nothing is reused."""
    decoder = paged_engine.backend.decoder
    first = list(range(300, 370))
    other = first[:50] + list(range(900, 925))
    cold = {tuple(p): _alone(decoder, p, 10) for p in (first, other)}
    for caching, expected in ((True, [0, 64, 48]), (False, [0, 0, 0])):
        scheduler = Scheduler(FastRunner(SlotDecoder(decoder, slots=2, slot_tokens=128, layout="paged"),
                                         prefix_cache=caching), eos_token_ids=[])
        try:
            requests, outputs = [], []
            for prompt in (first, first, other):
                requests.append(scheduler.submit(prompt, GREEDY, 10, threading.Event()))
                outputs.append(_tokens(scheduler, requests[-1]))
        finally:
            scheduler.close()
        assert [r.cached_prompt_tokens for r in requests] == expected, caching
        assert outputs == [cold[tuple(first)], cold[tuple(first)], cold[tuple(other)]], caching


def test_the_reply_stats_say_how_many_prompt_tokens_came_from_the_pool(paged_engine: ChatEngine) -> None:
    """Through ChatEngine: asked twice, the second reply's stats count every full block of its prompt but the last
    token as cached (whatever earlier replies left in the pool), and its tokens equal the first reply's."""
    gen = paged_engine.request_options(max_new_tokens=6)
    message = "Say something kind about the sea, in one sentence, please."
    one = drain(paged_engine.stream_chat(message, [], gen=gen, system_prompt=SYSTEM))
    two = drain(paged_engine.stream_chat(message, [], gen=gen, system_prompt=SYSTEM))
    block = paged_engine.fast_scheduler.runner.decoder.block_size
    assert two.stats.cached_prompt_tokens == (two.stats.prompt_tokens - 1) // block * block > 0
    assert two.token_ids == one.token_ids


def test_a_full_pool_makes_rows_wait_not_fail(paged_engine: ChatEngine) -> None:
    """A pool of 8 blocks of 16 tokens, two replies admitted together (60 + 60 and 40 + 30 tokens: 190 > 128). The
    younger row finds no block for position 48 and sits out steps; when the older one also wants a block, the
    younger is preempted (its KV released) and waits at the head of the queue for blocks, then resumes from what it
    streamed. Both complete with the tokens each gives alone, and nothing fails."""
    decoder = paged_engine.backend.decoder
    long_prompt, short_prompt = list(range(400, 460)), list(range(600, 640))
    scheduler = Scheduler(FastRunner(SlotDecoder(decoder, slots=2, slot_tokens=64, layout="paged"), prefix_cache=False),
                          eos_token_ids=[])
    try:
        with scheduler._cond:
            older = scheduler.submit(long_prompt, GREEDY, 60, threading.Event())
            younger = scheduler.submit(short_prompt, GREEDY, 30, threading.Event())
        got = [_tokens(scheduler, older), _tokens(scheduler, younger)]
        snap = scheduler.snapshot()
    finally:
        scheduler.close()
    assert snap.pool_blocks == 8 and snap.paused_rows >= 1 and snap.preempted == 1 and snap.waited_for_blocks == 1
    assert snap.errors == 0 and snap.free_blocks == 8
    assert got == [_alone(decoder, long_prompt, 60), _alone(decoder, short_prompt, 30)]


def test_blocks_appended_for_several_rows_land_where_set_blocks_puts_them(paged_engine: ChatEngine) -> None:
    """append_blocks (a step's grown rows in one copy and one scatter) leaves the device table exactly as writing
    each row's whole block list with set_blocks does; ids past the table's width are dropped as set_blocks drops
    them; an empty list writes nothing."""
    decoder = paged_engine.backend.decoder
    one, each = (SlotDecoder(decoder, slots=3, slot_tokens=64, layout="paged") for _ in range(2))
    width = one.num_blocks  # 12 blocks of 16 tokens
    tables = {0: [5, 2], 1: list(range(width - 1)), 2: [7]}
    for rows in (one, each):
        for slot, ids in tables.items():
            rows.set_blocks(slot, ids)
    grown = [(0, 2, [9, 1]), (1, width - 1, [11, 3]), (2, 1, [4])]  # row 1's second new id is past the width
    one.append_blocks(grown)
    for slot, _, ids in grown:
        each.set_blocks(slot, tables[slot] + ids)
    assert torch.equal(one.table, each.table)
    assert one.table[1, -1].item() == 11 and one.table[0, :4].tolist() == [5, 2, 9, 1]
    before = one.table.clone()
    one.append_blocks([])
    assert torch.equal(one.table, before)


def test_rows_crossing_into_new_blocks_in_one_step_are_written_together(paged_engine: ChatEngine) -> None:
    """Three rows whose prompts end at the same position cross into a new block at the same steps: each such step
    writes the device table once for all of them (append_blocks), never a row at a time (set_blocks is only
    admission's), and every row still gets the tokens it gets alone."""
    decoder = paged_engine.backend.decoder
    rows = SlotDecoder(decoder, slots=3, slot_tokens=64, layout="paged")
    calls: list[list[int]] = []
    append = rows.append_blocks

    def spy(grown: Any) -> None:
        if grown:
            calls.append(sorted(slot for slot, _, _ in grown))
        append(grown)

    rows.append_blocks = spy  # type: ignore[method-assign]
    prompts = [list(range(700 + 20 * i, 712 + 20 * i)) for i in range(3)]  # 12 tokens each: block 1 at position 16
    scheduler = Scheduler(FastRunner(rows, prefix_cache=False), eos_token_ids=[])
    try:
        with scheduler._cond:  # admitted together: the rows step in lockstep
            requests = [scheduler.submit(p, GREEDY, 24, threading.Event()) for p in prompts]
        got = [_tokens(scheduler, r) for r in requests]
        admitted = scheduler.snapshot()
    finally:
        scheduler.close()
    assert admitted.errors == 0
    assert calls == [[0, 1, 2], [0, 1, 2]]  # positions 16 and 32: one write per crossing, every row in it
    assert got == [_alone(decoder, p, 24) for p in prompts]


def _leaves_no_trace(rows: SlotDecoder, action: Callable[[], Any]) -> Any:
    """Run `action` between two replies of the same prompt on `rows`: afterwards every row is idle with a table
    naming only the scratch block, and the reply has the tokens it had before. Returns what `action` returned."""
    prompt = list(range(500, 530))
    scheduler = Scheduler(FastRunner(rows, prefix_cache=False), eos_token_ids=[])
    try:
        before = _tokens(scheduler, scheduler.submit(prompt, GREEDY, 12, threading.Event()))
        scheduler.close()
        out = action()
        assert not rows.active.any() and bool((rows.table == rows.num_blocks).all())
        scheduler = Scheduler(FastRunner(rows, prefix_cache=False), eos_token_ids=[])
        after = _tokens(scheduler, scheduler.submit(prompt, GREEDY, 12, threading.Event()))
    finally:
        scheduler.close()
    assert after == before
    return out


def test_the_paged_worst_reply_profile_spans_the_pool_and_leaves_no_trace(paged_engine: ChatEngine) -> None:
    """The start-up measurement's worst moment on the pool (one row's last prefill chunk at the end of the whole
    pool, then a step with every row at its end): it reports the pool's length, and afterwards every row is idle with
    a table naming only the scratch block, and a reply's tokens are what they were before it."""
    rows = SlotDecoder(paged_engine.backend.decoder, slots=2, slot_tokens=64, layout="paged")
    profile = _leaves_no_trace(rows, lambda: rows.profile_worst_reply(32))
    assert profile["tokens"] == 128 and profile["slots"] == 2


def test_warming_the_group_prefill_runs_it_and_leaves_no_trace(paged_engine: ChatEngine) -> None:
    """The start-up warm-up of the group prefill (newcomers arriving together): it runs prefill_rows on two rows of
    unequal lengths once per WARM_GROUP_LENGTHS, leaves every row idle with a table naming only the scratch block,
    and a reply afterwards has the tokens it had before. Where two rows of its length cannot be had (one row; a slot
    shorter than the warm prompt) it does nothing and says so."""
    decoder = paged_engine.backend.decoder
    rows = SlotDecoder(decoder, slots=2, slot_tokens=256, layout="paged")
    calls: list[list[int]] = []
    run = rows.prefill_rows

    def counted(slots: Any, ids: Any, keep: Any = None) -> Any:
        calls.append([int(i.numel()) for i in ids])
        return run(slots, ids, keep)

    def warm() -> bool:
        rows.prefill_rows = counted  # type: ignore[method-assign]
        try:
            return rows._warm_prefill_rows()
        finally:
            del rows.prefill_rows

    assert _leaves_no_trace(rows, warm) is True
    assert calls == [[n, n - 1] for n in WARM_GROUP_LENGTHS]
    for lone in (SlotDecoder(decoder, slots=1, slot_tokens=256, layout="paged"),
                 SlotDecoder(decoder, slots=2, slot_tokens=64, layout="slots")):
        lone.allocate()
        assert lone._warm_prefill_rows() is False


def test_the_compiled_group_prefill_equals_the_eager_one_and_compiles_once(paged_engine: ChatEngine) -> None:
    """The group prefill compiled (as start-up compiles it where the prefill compiles): three prompts give the
    eager pass's last hidden states and K/V blocks; its code never loops over a whole layer's pool (an in-place
    scatter of the real rows, as the compiled step's write); a later group of four rows of other lengths runs the same
    graph (rows, length and positions symbolic: no compile inside a user's reply)."""
    from torch._inductor.utils import run_and_get_code

    decoder = paged_engine.backend.decoder
    rows = SlotDecoder(decoder, slots=4, slot_tokens=128, layout="paged")
    rows.allocate()
    per = rows.num_blocks // 4
    for slot in range(4):
        rows.set_blocks(slot, range(slot * per, (slot + 1) * per))
    three = [torch.arange(500 + 30 * i, 500 + 30 * i + n) for i, n in enumerate((40, 57, 33))]
    eager = rows.prefill_rows([0, 1, 2], three)
    eager_k, eager_v = rows.k.clone(), rows.v.clone()
    rows.k.zero_()
    rows.v.zero_()
    torch._dynamo.reset()
    rows._make_rows_functions(compiled=True)
    compiled, code = run_and_get_code(rows.prefill_rows, [0, 1, 2], three)
    for a, b in zip(compiled, eager, strict=True):
        assert torch.allclose(a, b, atol=2e-4, rtol=1e-4)
    assert torch.allclose(rows.k, eager_k, atol=2e-4) and torch.allclose(rows.v, eager_v, atol=2e-4)
    pool = rows.k[0].numel()
    assert not [line for src in code for line in src.splitlines() if f"{pool}L" in line or f" {pool})" in line]
    four = [torch.arange(700 + 20 * i, 700 + 20 * i + n) for i, n in enumerate((21, 75, 48, 66))]
    with torch._dynamo.config.patch(error_on_recompile=True):
        out = rows.prefill_rows([0, 1, 2, 3], four)
    rows._make_rows_functions(compiled=False)
    for a, b in zip(out, rows.prefill_rows([0, 1, 2, 3], four), strict=True):
        assert torch.allclose(a, b, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("length,keep", [(30, 0), (64, 0), (65, 0), (70, 16)])
def test_a_whole_prompt_prefilled_padded_writes_what_the_unpadded_prefill_writes(paged_engine: ChatEngine,
                                                                                 length: int, keep: int) -> None:
    """The padded whole-prompt prefill (llm_core.fast.prefill_graphs, what the CUDA graphs replay), run eagerly: its
    last hidden state and every K/V row it writes into the row's blocks equal SlotDecoder.prefill's from position 0
    (fp32), for lengths inside, at and past a 64-token bucket. It writes nothing else but the scratch block: the
    pool's other blocks, and with `keep` the blocks of a cached prefix that other rows hold, keep their bytes."""
    decoder = paged_engine.backend.decoder
    rows = SlotDecoder(decoder, slots=2, slot_tokens=128, layout="paged", prefill_graph_tokens=128)
    assert rows.prefill_graphs is not None and rows.prefill_serves(length) and not rows.prefill_serves(129)
    rows.allocate()
    ids = (torch.arange(length) * 11 + 5) % decoder._arch.vocab
    blocks = [6, 2, 9, 4, 11][:-(-length // rows.block_size)]  # shuffled: positions go through the table
    with torch.no_grad():
        rows.set_blocks(0, blocks)
        want = rows.prefill(0, ids, 0)
        want_k, want_v = rows.k[:, blocks].clone(), rows.v[:, blocks].clone()
        sentinel = 7.0
        rows.k.fill_(sentinel)
        rows.v.fill_(sentinel)
        got = rows.prefill_whole(0, ids, keep)
    close = dict(rtol=1e-4, atol=1e-4)  # fp32: the padded matmuls are other shapes, blocked and rounded otherwise
    assert torch.allclose(got, want, **close)
    kept = keep // rows.block_size  # whole blocks of the cached prefix: not written
    for pool, expected in ((rows.k, want_k), (rows.v, want_v)):
        assert bool((pool[:, blocks[:kept]] == sentinel).all())
        for j, block in enumerate(blocks[kept:], start=kept):
            n = min(rows.block_size, length - j * rows.block_size)  # the last block's rows past the prompt: unwritten
            assert torch.allclose(pool[:, block, :n], expected[:, j, :n], **close), block
            assert bool((pool[:, block, n:] == sentinel).all())
        others = [b for b in range(rows.num_blocks) if b not in blocks]
        assert bool((pool[:, others] == sentinel).all())


def test_a_lone_newcomer_takes_one_padded_prefill_even_past_the_step_budget(paged_engine: ChatEngine) -> None:
    """With whole-prompt prefill graphs (run eagerly here) a newcomer's prompt is one pass, also when it joins rows
    that are decoding and is longer than the prefill budget of a step (200 tokens against 64: before, 4 chunks,
    the running rows stalling for each): its reply and the running one equal each prompt alone, token for token;
    a prompt past the graphs' lengths is prefilled in chunks as before."""
    decoder = paged_engine.backend.decoder
    first, second, longer = list(range(100, 140)), list(range(500, 700)), list(range(800, 1000))
    expected = [_alone(decoder, first, 40), _alone(decoder, second, 6)]
    rows = SlotDecoder(decoder, slots=2, slot_tokens=256, layout="paged", prefill_graph_tokens=256)
    scheduler = Scheduler(FastRunner(rows, prefill_tokens_per_step=64), eos_token_ids=[])
    try:
        running = scheduler.submit(first, GREEDY, 40, threading.Event())
        stream = scheduler.stream(running)
        got_first = [next(stream) for _ in range(3)]  # decoding now
        before = scheduler.snapshot()
        newcomer = scheduler.submit(second, GREEDY, 6, threading.Event())
        got_second = _tokens(scheduler, newcomer)
        got_first += list(stream)
        mid = scheduler.snapshot()
    finally:
        scheduler.close()
    assert [got_first, got_second] == expected
    assert mid.prefill_chunks - before.prefill_chunks == 1 and mid.errors == 0
    rows = SlotDecoder(decoder, slots=2, slot_tokens=256, layout="paged", prefill_graph_tokens=128)
    scheduler = Scheduler(FastRunner(rows, prefill_tokens_per_step=64), eos_token_ids=[])
    try:
        before = scheduler.snapshot()
        got = _tokens(scheduler, scheduler.submit(longer, GREEDY, 4, threading.Event()))
        after = scheduler.snapshot()
    finally:
        scheduler.close()
    assert got == _alone(decoder, longer, 4) and after.prefill_chunks - before.prefill_chunks == 1  # idle: one pass


def test_without_group_prefill_newcomers_take_one_padded_prefill_each(paged_engine: ChatEngine) -> None:
    """FastRunner(group_prefill=False), what `bench.batched --prefill each` times against the group pass: four
    prompts reaching an idle loop together are prefilled one padded pass each (no group pass), and each reply
    equals its prompt alone."""
    decoder = paged_engine.backend.decoder
    prompts = [list(range(100 + 41 * i, 100 + 41 * i + n)) for i, n in enumerate((40, 23, 61, 9))]
    rows = SlotDecoder(decoder, slots=4, slot_tokens=128, layout="paged", prefill_graph_tokens=128)
    scheduler = Scheduler(FastRunner(rows, group_prefill=False), eos_token_ids=[])
    try:
        before = scheduler.snapshot()
        with scheduler._cond:
            requests = [scheduler.submit(p, GREEDY, 6, threading.Event()) for p in prompts]
        got = [_tokens(scheduler, r) for r in requests]
        after = scheduler.snapshot()
    finally:
        scheduler.close()
    assert got == [_alone(decoder, p, 6) for p in prompts]
    assert after.prefills - before.prefills == 4 and after.prefill_chunks - before.prefill_chunks == 4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_paged_rows_from_graphs_equal_the_batch_of_one_and_reuse_a_prefix(tmp_path: Any) -> None:
    """On CUDA with KV_LAYOUT=paged (compiled step, one graph per batch bucket reading the static block table), a
    random llama with head_dim 64, NF4: the graphs are captured; 4 greedy replies together equal each alone for their
    first 8 tokens (as the slot test allows); a repeated prompt reports its full blocks as cached and the same
    first 8 tokens."""
    from bench.harness import make_random_checkpoint

    shape = dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=8,
                 num_key_value_heads=4, vocab_size=1024, rope_theta=10000.0, rms_norm_eps=1e-5)
    ckpt = make_random_checkpoint(shape, tmp_path / "ckpt", torch.device("cuda"), 2048, tokenizer="chatml")
    engine = ChatEngine.load(make_settings(MODEL_ID=str(ckpt), DEVICE="cuda", DECODE_PATH="fast",
                                           MAX_BATCH_SIZE="4", QUANTIZATION="nf4", KV_LAYOUT="paged"))
    slots = engine.fast_scheduler.runner.decoder
    try:
        assert slots.paged and slots.use_graphs and sorted(slots._graphs) == [1, 2, 4], slots.notes
        gen = engine.request_options(max_new_tokens=16, min_new_tokens=16, repetition_penalty=1.0)
        alone = [drain(engine.stream_chat(p, [], gen=gen, system_prompt=SYSTEM)) for p in PROMPTS[:4]]
        together = staggered(engine, PROMPTS[:4], [16] * 4, 0.0, min_new_tokens=16, repetition_penalty=1.0)
        for i, reference in enumerate(alone):
            assert together[i].token_ids[:8] == reference.token_ids[:8], (i, slots.notes)
            block = slots.block_size
            assert together[i].stats.cached_prompt_tokens == (reference.stats.prompt_tokens - 1) // block * block
        assert engine.fast_scheduler.snapshot().max_rows_in_step == 4
    finally:
        engine.fast_scheduler.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_paged_prefill_graphs_equal_the_compiled_prefill(tmp_path: Any) -> None:
    """On CUDA with KV_LAYOUT=paged, a random llama (head_dim 64, NF4): start-up captures one whole-prompt prefill
    graph per 64 tokens up to PREFILL_GRAPH_TOKENS; replayed for prompts of 30, 64 and 65 tokens, its last hidden
    state and the K/V rows it writes to shuffled blocks match the compiled prefill's (bf16: relative error < 2%,
    the other GEMM shapes' rounding), and a reply through the engine runs on them."""
    from bench.harness import make_random_checkpoint

    shape = dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=8,
                 num_key_value_heads=4, vocab_size=1024, rope_theta=10000.0, rms_norm_eps=1e-5)
    ckpt = make_random_checkpoint(shape, tmp_path / "ckpt", torch.device("cuda"), 2048, tokenizer="chatml")
    engine = ChatEngine.load(make_settings(MODEL_ID=str(ckpt), DEVICE="cuda", DECODE_PATH="fast", MAX_BATCH_SIZE="4",
                                           QUANTIZATION="nf4", KV_LAYOUT="paged", PREFILL_GRAPH_TOKENS="256"))
    slots = engine.fast_scheduler.runner.decoder
    try:
        assert slots.prefill_graphs is not None and slots.prefill_graphs.captured == [64, 128, 192, 256], slots.notes
        reply = drain(engine.stream_chat("Hello there!", [], gen=engine.request_options(max_new_tokens=4),
                                         system_prompt=SYSTEM))
        assert len(reply.token_ids) == 4 and engine.fast_scheduler.snapshot().errors == 0
        engine.fast_scheduler.close()
        blocks = [7, 3, 11, 5, 9]

        def rel(a: torch.Tensor, b: torch.Tensor) -> float:
            return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-6))

        with torch.no_grad():
            for length in (30, 64, 65):
                ids = ((torch.arange(length) * 11 + 5) % 1024).cuda()
                used = blocks[:-(-length // slots.block_size)]
                slots.set_blocks(0, used)
                want = slots.prefill(0, ids, 0)
                want_k = torch.cat([slots.k[:, b] for b in used], dim=1)[:, :length].clone()
                slots.k.zero_()
                got = slots.prefill_whole(0, ids, 0)
                got_k = torch.cat([slots.k[:, b] for b in used], dim=1)[:, :length]
                assert rel(got, want) < 0.02 and rel(got_k, want_k) < 0.02, length
        torch.cuda.synchronize()
    finally:
        engine.fast_scheduler.close()


@torch.library.custom_op("llm_core_test::read_pool", mutates_args=())
def _read_pool(q: torch.Tensor, pool: torch.Tensor) -> torch.Tensor:
    """Stands for the paged attention op: an opaque kernel that reads the pool after the step's write."""
    return q + pool[0, 0].sum()


@_read_pool.register_fake
def _(q: torch.Tensor, pool: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(q)


def test_the_compiled_paged_write_touches_only_the_written_rows() -> None:
    """The decode step writes each row's new K/V into the pool and then an opaque kernel reads the pool. Compiled
    by Inductor, that write must stay an in-place scatter of B rows: written through a flattened view of the pool
    (the first form), Inductor copied the whole pool around it, per K and V, every layer and step (the paged step
    ran ~6x slower than the slots one on the H200). The pool is a layer of a stacked tensor, as the decoder's is."""
    from torch._inductor.utils import run_and_get_code

    from llm_core.fast.batched import write_paged_rows

    layers, blocks, block_size, heads, dim = 2, 256, 16, 2, 64
    numel = blocks * block_size * heads * dim

    def step(pool: torch.Tensor, dest: torch.Tensor, rows: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        write_paged_rows(pool, (dest // block_size, dest % block_size), rows)
        return _read_pool(q, pool)

    stacked = torch.zeros(layers, blocks, block_size, heads, dim)
    dest = torch.tensor([3, 40, 77, 4095])
    rows, q = torch.randn(4, heads, dim), torch.randn(heads, dim)
    torch._dynamo.reset()
    _, code = run_and_get_code(torch.compile(step, fullgraph=True), stacked[1], dest, rows, q)
    whole_pool_loops = [line for src in code for line in src.splitlines()
                        if f"{numel}L" in line or f" {numel})" in line]
    assert not whole_pool_loops, whole_pool_loops[:3]
    expected = torch.zeros_like(stacked)
    expected[1].view(-1, heads, dim)[dest] = rows
    assert torch.equal(stacked, expected)
