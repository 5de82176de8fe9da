"""The batched fast path (llm_core.fast.batched) forced on CPU (eager) with the embedded model: rows equal their reply
alone token for token while rows join and leave, Stop halts one row only, admission refuses only what can never fit
a slot and queues the rest, and the 8-session gradio_client load test runs on it. GPU-only checks are marked."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from llm_core.engine.chat import ChatEngine, ReplyUpdate
from llm_core.engine.fast_runner import FastRunner
from llm_core.engine.scheduler import Scheduler
from llm_core.engine.startup import PathBuilder
from llm_core.errors import ContextBudgetError
from llm_core.fast.batched import (
    BATCH_BUCKETS,
    SlotDecoder,
    attention_rows,
    batch_bucket,
    layer_rows,
)
from llm_core.fast.rows import pick_rows_plan
from llm_core.sampling import SamplingOptions
from tests.conftest import drain, make_settings, run_threads

SYSTEM = "You are a helpful assistant."


def wait_until(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout_s:.0f} s waiting for {what}"
        time.sleep(0.05)

FP32 = {"QUANTIZATION": "none", "COMPUTE_DTYPE": "float32"}
SLOTS = {"DECODE_PATH": "fast", "KV_LAYOUT": "slots"}  # the batched fast loop on fixed slots
PROMPTS = [
    "Hi!",
    "Name three colours of the rainbow.",
    "Write two sentences about a lighthouse keeper who waits every night for a ship that never comes.",
    "What is 12 times 12?",
    "Describe a quiet morning in a small town.",
]
MAX_NEW = [14, 5, 10, 7, 9]  # different lengths: rows leave at different steps, and a late one takes a freed slot


@pytest.fixture(scope="module")
def fast_batched(fp32_engine: ChatEngine) -> Iterator[ChatEngine]:
    """The fp32 reference model (same weights object as `fp32_engine`) served by the batched fast loop, 4 slots
    (KV_LAYOUT=slots: these tests are about the slots; tests/test_paged_kv.py serves the paged pool)."""
    engine = ChatEngine(fp32_engine.loaded, make_settings(**FP32, **SLOTS, MAX_BATCH_SIZE="4"))
    assert engine.backend.name == "fast-batched"
    yield engine
    engine.fast_scheduler.close()


def staggered(engine: ChatEngine, prompts: list[str], max_new: list[int], delay_s: float,
              controls: list[Any] | None = None, **options: Any) -> dict[int, ReplyUpdate]:
    """Each prompt from its own thread, the i-th after i * delay_s; returns the final updates. `controls`: each
    reply's own RowControl (one per prompt: a control holds one reply's state, e.g. its logprobs)."""
    out: dict[int, ReplyUpdate] = {}

    def ask(i: int) -> Callable[[], None]:
        def run() -> None:
            time.sleep(delay_s * i)
            own = {} if controls is None else {"control": controls[i]}
            gen = engine.request_options(max_new_tokens=max_new[i], **options, **own)
            out[i] = drain(engine.stream_chat(prompts[i], [], gen=gen, system_prompt=SYSTEM))
        return run

    run_threads([ask(i) for i in range(len(prompts))])
    return out


def test_every_row_equals_its_reply_alone_while_rows_join_and_leave(fp32_engine: ChatEngine,
                                                                   fast_batched: ChatEngine) -> None:
    """5 replies of different lengths on 4 slots, arriving 0.3 s apart: rows join a running batch, leave it at
    different steps (idle slots inside the batch bucket), the fifth waits for a slot and reuses a freed one; each
    row's greedy tokens are the plain path's reply alone (transformers' generate, fp32), token for token."""
    alone = [drain(fp32_engine.stream_chat(p, [], gen=fp32_engine.request_options(max_new_tokens=n),
                                           system_prompt=SYSTEM)) for p, n in zip(PROMPTS, MAX_NEW, strict=True)]
    scheduler = fast_batched.fast_scheduler
    before = scheduler.snapshot()
    together = staggered(fast_batched, PROMPTS, MAX_NEW, 0.3)
    per_token = scheduler.runner.decoder.kv_bytes_per_token()
    for i, reference in enumerate(alone):
        got = together[i]
        assert got.token_ids == reference.token_ids, f"prompt {i} differs from its reply alone"
        assert got.text == reference.text
        stats = got.stats
        assert stats.decode_path == "fast-batched" and stats.new_tokens == len(reference.token_ids)
        assert stats.ttft_s and stats.ttft_s > 0 and stats.finish_reason == reference.stats.finish_reason
        # the request's own KV: its prompt and every token fed back (the last one never is)
        assert stats.kv_cache_bytes == (stats.prompt_tokens + stats.new_tokens - 1) * per_token
    after = scheduler.snapshot()
    assert after.max_rows_in_step >= 3  # they really shared decode steps
    assert after.prefills - before.prefills == len(PROMPTS) and after.active == 0 and after.errors == 0


@pytest.mark.parametrize("kv_cache", ["bf16", "int8"])
def test_newcomers_prefilled_together_equal_their_replies_alone(fp32_engine: ChatEngine, fast_batched: ChatEngine,
                                                                kv_cache: str) -> None:
    """Four prompts of different lengths reaching an idle loop at once are prefilled in one padded pass
    (SlotDecoder.prefill_rows: fewer prefill passes than prompts), and each reply's greedy tokens equal that prompt
    served alone by the same loop, token for token; with the fp32 slots and with int8 ones (KV_CACHE=int8)."""
    from llm_core.streams import Finished

    own = kv_cache != "bf16"
    engine = ChatEngine(fp32_engine.loaded, make_settings(**FP32, **SLOTS, MAX_BATCH_SIZE="4",
                                                          KV_CACHE=kv_cache)) if own else fast_batched
    scheduler = engine.fast_scheduler
    options = SamplingOptions.of(engine.request_options(max_new_tokens=8, min_new_tokens=8, repetition_penalty=1.05))
    prompts = [engine.prepare(p, [], gen=engine.request_options(max_new_tokens=8), history_turns=0,
                              system_prompt=SYSTEM).input_ids[0].tolist() for p in PROMPTS[:4]]
    assert len({len(p) for p in prompts}) > 1  # padding matters

    def tokens(request: Any) -> list[int]:
        out: list[int] = []
        while True:
            item = request.items.get(timeout=120)
            if isinstance(item, Finished):
                assert item.reason in ("eos", "length"), item
                return out
            out.append(item)

    try:
        alone = [tokens(scheduler.submit(p, options, 8, threading.Event())) for p in prompts]
        before = scheduler.snapshot()
        with scheduler._cond:  # all four are waiting before the loop admits any: one idle admission
            requests = [scheduler.submit(p, options, 8, threading.Event()) for p in prompts]
        together = [tokens(r) for r in requests]
        after = scheduler.snapshot()
    finally:
        if own:
            scheduler.close()
    assert together == alone
    assert after.prefills - before.prefills == 4 and after.prefill_chunks - before.prefill_chunks < 4


def test_stop_of_one_row_leaves_the_other_rows_tokens_unchanged(fp32_engine: ChatEngine,
                                                                fast_batched: ChatEngine) -> None:
    gen = fast_batched.request_options(max_new_tokens=16)
    prompts = ["Count from one to fifty in words.", "Write a short poem about rain.", "List ten animals."]
    alone = [drain(fp32_engine.stream_chat(p, [], gen=gen, system_prompt=SYSTEM)) for p in prompts]
    streams = [fast_batched.stream_chat(p, [], gen=gen, system_prompt=SYSTEM, request_id=f"row-{i}")
               for i, p in enumerate(prompts)]
    for s in streams:
        next(s)  # each has its first token: all three are rows of the batch
    assert fast_batched.stop("row-0")
    results = [drain(s) for s in streams]
    assert results[0].stats.finish_reason == "stopped" and results[0].stats.new_tokens < 16
    assert results[0].token_ids == alone[0].token_ids[:len(results[0].token_ids)]  # halted, never diverged
    for got, reference in zip(results[1:], alone[1:], strict=True):
        assert got.token_ids == reference.token_ids and got.stats.finish_reason == reference.stats.finish_reason
    wait_until(lambda: fast_batched.fast_scheduler.snapshot().active == 0, 10, "the batch to drain")


def _serve(decoder: Any, prompts: list[list[int]], budgets: list[int], options: list[SamplingOptions], *,
           overlap: bool, eos: tuple[int, ...] = (), layout: str = "slots", events: list[str] | None = None
           ) -> list[list[int]]:
    """The prompts (token ids) admitted together on 4 fresh rows of a FastRunner, each streamed to its end.
    `events`: filled with "run" per launched step and "token" per token delivered, in order."""
    rows = SlotDecoder(decoder, slots=4, slot_tokens=128, layout=layout)
    runner = FastRunner(rows, overlap=overlap)
    scheduler = Scheduler(runner, eos_token_ids=list(eos))
    if events is not None:
        run_step, deliver = rows.run_step, scheduler.deliver

        def spy_run(*args: Any) -> None:
            events.append("run")
            run_step(*args)

        def spy_deliver(*args: Any) -> Any:
            events.append("token")
            return deliver(*args)

        rows.run_step = spy_run  # type: ignore[method-assign]
        scheduler.deliver = spy_deliver  # type: ignore[method-assign]
    try:
        with scheduler._cond:  # admitted together: one batch from the first step
            requests = [scheduler.submit(p, o, n, threading.Event()) for p, n, o in zip(prompts, budgets, options,
                                                                                        strict=True)]
        return [list(scheduler.stream(r)) for r in requests]
    finally:
        scheduler.close()


@pytest.mark.parametrize("layout", ["slots", "paged"])
def test_overlapped_steps_stream_the_tokens_of_steps_read_one_at_a_time(fast_batched: ChatEngine,
                                                                       layout: str) -> None:
    """With overlap (the default) each step is launched before the previous step's tokens are read: the replies are
    token for token those of the loop that reads every step before the next, for rows of different budgets, an EOS
    that ends a row early, and min_new_tokens, whose ban on EOS must lift at the same step in both loops (one row
    is allowed EOS exactly at the step that picks it, another is banned there and runs on). The overlapped loop
    launches a step while an earlier one's tokens are unread."""
    decoder = fast_batched.backend.decoder
    greedy = SamplingOptions(repetition_penalty=1.0)
    prompts = [list(range(500 + 30 * i, 520 + 30 * i)) for i in range(4)]
    budgets = [12, 5, 12, 12]
    plain = _serve(decoder, prompts, budgets, [greedy] * 4, overlap=False, layout=layout)
    eos = plain[0][3]  # row 0's fourth token, taken as EOS: row 0 ends at its first occurrence
    first = plain[0].index(eos)
    prompts[2] = prompts[3] = prompts[0]
    options = [greedy, greedy, SamplingOptions(repetition_penalty=1.0, min_new_tokens=first + 1),
               SamplingOptions(repetition_penalty=1.0, min_new_tokens=first)]
    events: list[str] = []
    together = _serve(decoder, prompts, budgets, options, overlap=True, eos=(eos,), layout=layout, events=events)
    one_at_a_time = _serve(decoder, prompts, budgets, options, overlap=False, eos=(eos,), layout=layout)
    assert together == one_at_a_time
    assert together[0] == together[3] == plain[0][:first + 1]  # ended by EOS; row 3's ban lifted just in time
    banned = together[2]  # EOS banned at its step: another token there, and the row runs on
    assert len(banned) > first + 1 and banned[:first] == plain[0][:first] and banned[first] != eos
    assert together[1] == plain[1]  # a short budget: ends by length, untouched by the others
    launched_ahead = any(events[i:i + 2] == ["run", "run"] for i in range(len(events) - 1))
    assert launched_ahead, events


def test_an_overlapped_row_ended_by_eos_keeps_one_logprob_per_streamed_token(fast_batched: ChatEngine) -> None:
    """A row with logprobs (its output control picks its tokens on the host) that EOS ends while the next step is
    already launched: that step's pick is dropped with its token, so the reply has exactly one logprob per token it
    streamed, as in the loop that reads each step first, and the same logprobs."""
    from llm_core.constraints import OutputSpec, RowControl

    decoder = fast_batched.backend.decoder
    greedy = SamplingOptions(repetition_penalty=1.0)
    prompts = [list(range(500, 520)), list(range(530, 550))]
    plain = _serve(decoder, prompts, [12, 12], [greedy] * 2, overlap=False)
    eos = plain[0][3]
    got = {}
    for overlap in (True, False):
        control = RowControl(OutputSpec(top_logprobs=2))
        options = [SamplingOptions(repetition_penalty=1.0, control=control), greedy]
        tokens = _serve(decoder, prompts, [12, 12], options, overlap=overlap, eos=(eos,))
        assert tokens[0] == plain[0][:plain[0].index(eos) + 1]  # ended by EOS, the other row running on
        assert [lp.token_id for lp in control.logprobs] == tokens[0]
        got[overlap] = control.logprobs
    assert got[True] == got[False]


def test_overlapped_rows_that_fill_their_slot_never_step_past_it(fast_batched: ChatEngine) -> None:
    """Prompt + budget exactly a slot's 128 positions, on two neighbouring slots: with overlap a row whose last
    token is in flight sits the next step out (it would write position 128, past its slot), so both replies are
    whole and equal the loop that reads every step first."""
    decoder = fast_batched.backend.decoder
    greedy = SamplingOptions(repetition_penalty=1.0)
    prompts = [list(range(900, 1000)), list(range(1100, 1110))]
    budgets = [28, 118]  # 100 + 28 and 10 + 118: both end at the slot's last position
    events: list[str] = []
    together = _serve(decoder, prompts, budgets, [greedy] * 2, overlap=True, events=events)
    assert together == _serve(decoder, prompts, budgets, [greedy] * 2, overlap=False)
    assert [len(t) for t in together] == budgets
    assert events.count("run") == max(budgets) - 1  # the first token is prefill's; no step after the last one


def test_admission_refuses_only_what_cannot_fit_a_slot_and_queues_the_rest(fast_batched: ChatEngine) -> None:
    """2 slots of 64 tokens, no EOS: prompt + max new = 64 fits exactly and runs to its length; 65 is refused at
    once; three that fit arrive together: two decode, the third waits for a slot, and all three complete."""
    decoder = fast_batched.backend.decoder
    scheduler = Scheduler(FastRunner(SlotDecoder(decoder, slots=2, slot_tokens=64)), eos_token_ids=[])
    try:
        greedy = SamplingOptions(repetition_penalty=1.0)
        exact = scheduler.submit(list(range(100, 148)), greedy, 16, threading.Event())
        assert len(list(scheduler.stream(exact))) == 16
        with pytest.raises(ContextBudgetError, match="KV slot"):
            scheduler.submit(list(range(100, 149)), greedy, 16, threading.Event())
        requests = [scheduler.submit(list(range(200 + 10 * i, 230 + 10 * i)), greedy, 8, threading.Event())
                    for i in range(3)]
        outputs = [list(scheduler.stream(r)) for r in requests]
        assert [len(o) for o in outputs] == [8, 8, 8]
        snap = scheduler.snapshot()
        assert snap.waited_for_slot == 1 and snap.max_rows_in_step == 2 and snap.errors == 0
    finally:
        scheduler.close()


def test_sampling_rows_with_a_seed_are_reproducible_beside_other_rows(fast_batched: ChatEngine) -> None:
    sampling = {"do_sample": True, "temperature": 0.9, "top_k": 40, "seed": 7}
    gen = fast_batched.request_options(max_new_tokens=8, **sampling)
    first = drain(fast_batched.stream_chat("Tell me a fact about owls.", [], gen=gen, system_prompt=SYSTEM))
    together = staggered(fast_batched, ["Tell me a fact about owls.", "Name a river."], [8, 8], 0.0, **sampling)
    assert together[0].token_ids == first.token_ids  # its own generator, whatever the neighbour does
    greedy = drain(fast_batched.stream_chat("Tell me a fact about owls.", [], system_prompt=SYSTEM,
                                            gen=fast_batched.request_options(max_new_tokens=8, do_sample=False)))
    assert greedy.token_ids != first.token_ids  # it really sampled


def test_slots_are_sized_by_the_memory_plan_and_fit_the_history(fast_batched: ChatEngine) -> None:
    slots = fast_batched.fast_scheduler.runner.decoder
    assert slots.slots == 4 and fast_batched.max_concurrent_replies == 4
    assert fast_batched.context_limit == slots.slot_tokens <= fast_batched.loaded.context_length
    assert slots.slot_tokens % 16 == 0 and slots.slot_tokens >= 256
    assert fast_batched.memory_facts.static_kv_tokens == slots.slots * slots.slot_tokens


def test_slots_are_sized_by_measurement_and_the_profile_leaves_no_trace(fp32_engine: ChatEngine,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 16 on issue 17's sizing: the batch's worst moment (one slot's last prefill chunk at the end of a full
    slot, then a step with every slot decoding) runs on the slots and leaves no trace in the next reply; sized by a
    simulated card (CUDA reads the allocator's peak there: fixed bytes + the slots' bytes per slot token, out of
    memory above the cap), the slots shrink until that peak fits the budget, and the engine's context limit, memory
    facts and reason follow. Where not even 256 tokens per slot fit, the error says to lower MAX_BATCH_SIZE."""
    from llm_core.memory.plan import MEASURED_SAFETY_BYTES

    engine = ChatEngine(fp32_engine.loaded, make_settings(**FP32, **SLOTS, MAX_BATCH_SIZE="2"))
    scheduler = engine.fast_scheduler
    slots = scheduler.runner.decoder
    try:
        engine._replan(lambda start: start.size_fast_slots(lambda _m: None))  # warms the slots; CPU: no measurement
        gen = engine.request_options(max_new_tokens=8)
        before = drain(engine.stream_chat("Name a colour.", [], gen=gen, system_prompt=SYSTEM)).text
        profile = slots.profile_worst_reply(engine.prefill_chunk_tokens)
        assert profile["tokens"] == slots.slot_tokens and profile["slots"] == 2 and not slots.active.any()
        assert drain(engine.stream_chat("Name a colour.", [], gen=gen, system_prompt=SYSTEM)).text == before
        with pytest.raises(Exception, match="sized before it starts"):  # the loop is running now
            scheduler.resize_slots(512)
    finally:
        scheduler.close()

    engine = ChatEngine(fp32_engine.loaded, make_settings(**FP32, **SLOTS, MAX_BATCH_SIZE="2"))
    scheduler, slots = engine.fast_scheduler, engine.fast_scheduler.runner.decoder
    per_slot_token = slots.slots * slots.kv_bytes_per_token()
    budget = engine.memory_budget.budget_bytes
    planned = slots.slot_tokens
    fixed = budget - MEASURED_SAFETY_BYTES - per_slot_token * (planned // 2)  # room for about half the plan
    sizes: list[int] = []

    def simulated(chunk: int | None) -> dict[str, int]:
        sizes.append(slots.slot_tokens)
        peak = fixed + per_slot_token * slots.slot_tokens
        if peak > budget + 64 * 2**20:
            raise torch.cuda.OutOfMemoryError("simulated")
        return {"peak_reserved_bytes": peak, "peak_allocated_bytes": peak, "tokens": slots.slot_tokens, "slots": 2}

    monkeypatch.setattr(slots, "profile_worst_reply", simulated)
    try:
        slots.warmup()
        engine._replan(lambda start: start.measure_fast_slots(lambda _m: None))
        assert sizes[0] == planned and slots.slot_tokens < planned
        assert fixed + per_slot_token * slots.slot_tokens <= budget - MEASURED_SAFETY_BYTES
        assert slots.slot_tokens >= 0.85 * (planned // 2)
        assert engine.context_limit == slots.slot_tokens == scheduler.snapshot().slot_tokens
        assert engine.memory_facts.static_kv_tokens == 2 * slots.slot_tokens
        assert f"{slots.slot_tokens:,} tokens, sized by measurement" in engine.backend.reason
        done = drain(engine.stream_chat("Name a colour.", [], gen=engine.request_options(max_new_tokens=4),
                                        system_prompt=SYSTEM))
        assert done.done and done.stats.new_tokens > 0
    finally:
        scheduler.close()

    engine = ChatEngine(fp32_engine.loaded, make_settings(**FP32, DECODE_PATH="fast", MAX_BATCH_SIZE="2"))
    slots = engine.fast_scheduler.runner.decoder
    budget = engine.memory_budget.budget_bytes  # this engine's own: on CPU the budget follows the free RAM right now
    full = {"peak_reserved_bytes": budget * 2, "peak_allocated_bytes": budget, "tokens": 0, "slots": 2}
    monkeypatch.setattr(slots, "profile_worst_reply", lambda chunk: full)
    slots.warmup()
    with pytest.raises(ContextBudgetError, match="MAX_BATCH_SIZE"):
        engine._replan(lambda start: start.measure_fast_slots(lambda _m: None))


def test_a_slot_resize_whose_graphs_no_longer_capture_counts_as_out_of_memory(fp32_engine: ChatEngine,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Graphs captured at the old slot length but not at the new one (the capture ran out of memory, which the
    capture itself only notes): SlotDecoder.resize raises OutOfMemoryError, so the sizing shrinks instead of keeping
    slots whose steps would run without graphs, and the notes do not claim the graphs are off."""
    engine = ChatEngine(fp32_engine.loaded, make_settings(**FP32, **SLOTS, MAX_BATCH_SIZE="2"))
    slots = engine.fast_scheduler.runner.decoder

    def capture() -> None:  # stands in for the CUDA capture: fits up to 512-token slots
        if slots.slot_tokens <= 512:
            slots._graphs[1] = object()
        else:
            slots.notes.append("batched CUDA graphs off (OutOfMemoryError)")

    monkeypatch.setattr(slots, "_capture", capture)
    slots.use_graphs = True
    slots.resize(512)
    assert slots._graphs and slots.slot_tokens == 512
    with pytest.raises(torch.cuda.OutOfMemoryError):
        slots.resize(1024)
    assert not any("graphs off" in n for n in slots.notes)
    slots.resize(256)
    assert slots._graphs and slots.slot_tokens == 256 and slots.k is not None and slots.k.shape[2] == 256
    slots._graphs.clear()
    slots.use_graphs = False


def test_each_batch_bucket_takes_its_fastest_rows_kernel_and_dequantize_and_matmul_wins_ties() -> None:
    """The start-up pick from timings {bucket: {kernel: µs}}: the fastest per bucket; a tie goes to dequantize +
    matmul; a batch takes its bucket's kernel, dequantize + matmul beyond the last bucket or with no timings."""
    plan = pick_rows_plan({2: {"mm": 50, "bnb": 60, "dequant": 400}, 4: {"mm": 70, "bnb": 60, "dequant": 410},
                           8: {"mm": 420, "dequant": 420}, 32: {"bnb": 300}})
    assert plan.kernels == ((2, "mm"), (4, "bnb"), (8, "dequant"), (32, "bnb"))
    assert [plan.kernel_for(b) for b in (2, 3, 4, 5, 8, 9, 32, 33)] == ["mm", "bnb", "bnb", "dequant", "dequant",
                                                                       "bnb", "bnb", "dequant"]
    assert plan.mm_max == 2 and pick_rows_plan({}).kernel_for(2) == "dequant"


def test_a_batched_layer_without_the_rows_kernel_dequantizes_one_fused_part_at_a_time(
        nf4_engine: ChatEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    """Batches above rows_max (or with the kernel off) take dequantize + matmul; for the fused q/k/v and gate/up of
    NF4 weights it runs per part (llm_core.fast.rows.fused_rows calls llm_core.fast.layer.linear_prefill_parts: the
    weight temporary is one part's),
    with the same outputs as one matmul over the fused weight."""
    import llm_core.fast.rows as rows_module
    from llm_core.fast import layer as fast_layer

    engine = ChatEngine(nf4_engine.loaded, make_settings(DECODE_PATH="fast", MAX_BATCH_SIZE="2"))
    slots = engine.fast_scheduler.runner.decoder
    try:
        slots.allocate()
        f = slots.fast
        spec, w = f._layer_specs[0], f._layer_weights[0]
        assert spec.fused
        calls: list[int] = []
        real_parts = fast_layer.linear_prefill_parts

        def counting(s: Any, x: torch.Tensor, ts: Any, gemm: bool = True) -> Any:
            assert not gemm  # the step's rows: dequantize + matmul, never the prefill's GEMM
            calls.append(len(s.splits))
            return real_parts(s, x, ts, gemm)

        monkeypatch.setattr(rows_module, "linear_prefill_parts", counting)
        g = torch.Generator().manual_seed(0)
        h = torch.randn(2, spec.n_heads * spec.head_dim, generator=g).to(f.dtype)
        cos, sin = f._arch.rotary(h[:, None], torch.tensor([[3], [5]]))
        pos, last = torch.tensor([3, 5]), torch.tensor([3, 5])
        kc, vc = slots.k[0, :2], slots.v[0, :2]
        out = layer_rows(spec, h, h, cos[:, 0], sin[:, 0], pos, last, kc, vc, w, rows_max=0)
        assert sorted(calls) == [2, 3]  # gate/up and q/k/v, each per part
        monkeypatch.setattr(rows_module, "linear_prefill_parts",
                            lambda s, x, ts, gemm=True: fast_layer.linear_prefill(s, x, ts, gemm).split(
                                list(s.splits), dim=-1))
        fused = layer_rows(spec, h, h, cos[:, 0], sin[:, 0], pos, last, kc, vc, w, rows_max=0)
        assert all(torch.equal(a, b) for a, b in zip(out, fused, strict=True))  # the same rows, the same sums
    finally:
        engine.fast_scheduler.close()


def test_batch_buckets_cover_every_row_count() -> None:
    assert [batch_bucket(r, 32) for r in (1, 2, 3, 5, 8, 9, 17, 32)] == [1, 2, 4, 8, 8, 16, 32, 32]
    assert batch_bucket(3, 3) == 3 and BATCH_BUCKETS[-1] == 32


def test_row_attention_reads_each_row_up_to_its_own_position() -> None:
    """attention_rows equals the one-row attention of each row over its own prefix."""
    from llm_core.fast.layer import LayerSpec, decode_attention

    torch.manual_seed(0)
    spec = LayerSpec(4, 2, 16, 0.25, 1e-6, 1e-6, None, (), True, "matmul")
    q = torch.randn(3, 4, 16)
    k, v = torch.randn(3, 40, 2, 16), torch.randn(3, 40, 2, 16)
    pos = torch.tensor([0, 17, 39])
    rows = attention_rows(spec, q, k, v, pos)
    for b in range(3):
        one = decode_attention(spec, q[b], k[b], v[b], pos[b:b + 1])
        torch.testing.assert_close(rows[b:b + 1], one)


@pytest.fixture(scope="module")
def fast_batched_nf4(nf4_engine: ChatEngine) -> Iterator[ChatEngine]:
    """The demo's default model (nf4) on the batched fast path with MAX_BATCH_SIZE=8."""
    engine = ChatEngine(nf4_engine.loaded, make_settings(DECODE_PATH="fast", MAX_BATCH_SIZE="8"))
    yield engine
    engine.fast_scheduler.close()


def test_eight_gradio_sessions_run_on_the_batched_fast_path(fast_batched_nf4: ChatEngine) -> None:
    from tests.test_concurrency import eight_sessions_each_get_their_own_chat, launch  # imports gradio

    assert fast_batched_nf4.backend.name == "fast-batched" and fast_batched_nf4.max_concurrent_replies == 8
    demo, url = launch(fast_batched_nf4)
    try:
        eight_sessions_each_get_their_own_chat(url, "fast-batched", fast_batched_nf4.fast_scheduler.snapshot)
    finally:
        demo.close()


def test_bench_smoke_records_the_issue_fields_for_both_recipes(tmp_path: Any) -> None:
    import json

    from bench import batched

    out = tmp_path / "batched.json"
    assert batched.main(["--smoke", "--out", str(out), "--ckpt", str(tmp_path / "ckpt"), "--mixed", "4",
                         "--mixed-over-s", "0.3"]) == 0
    doc = json.loads(out.read_text())
    mixed = [r for r in doc["records"] if r.get("what") == "mixed"]
    runs = [r for r in doc["records"] if "recipe" in r and r.get("what") != "mixed"]
    # the mixed load: 4 chats of 48..384 prompt tokens arriving over 0.3 s, every one answered in full
    assert len(mixed) == 1 and mixed[0]["completed"] == 4 and mixed[0]["new_tokens"] == [8, 8, 8, 8]
    assert mixed[0]["arrivals_s"] == [0.0, 0.1, 0.2, 0.3] and mixed[0]["ttft_p95_s"] > 0
    assert sorted((r["recipe"], r["concurrent_chats"]) for r in runs) == [
        ("ours", 1), ("ours", 3), ("transformers-generate", 1), ("transformers-generate", 3)]
    for r in runs:
        for key in ("model", "quantization", "aggregate_decode_tokens_per_s", "per_chat_decode_tokens_per_s",
                    "ttft_p50_s", "ttft_p95_s", "peak_vram_bytes", "device", "versions", "command"):
            assert key in r, (r["recipe"], key)
        assert r["aggregate_decode_tokens_per_s"] > 0 and r["per_chat_decode_tokens_per_s"]["min"] > 0
    ours3 = next(r for r in runs if r["recipe"] == "ours" and r["concurrent_chats"] == 3)
    assert ours3["completed"] == 3 and ours3["new_tokens"] == [8, 8, 8]  # min_new_tokens: every reply full length
    assert ours3["step_profile"]["max_rows_in_step"] == 3


def test_bench_host_variants_probe_each_phase_and_leave_the_process_as_it_was(tmp_path: Any) -> None:
    """--host-variants: each phase runs under each host setting in turn and records its probe (the loop's host time
    per part, one deliver per token, collections); afterwards the collector is unfrozen and enabled, the switch
    interval is back, and nothing of the probe is left patched on the objects it wrapped."""
    import gc
    import json
    import sys

    from bench import batched, host_probe

    out = tmp_path / "batched.json"
    interval = sys.getswitchinterval()
    assert batched.main(["--smoke", "--out", str(out), "--ckpt", str(tmp_path / "ckpt"), "--chats", "3",
                         "--no-reference", "--host-variants",
                         ",".join([*host_probe.HOST_VARIANTS, "reply-worker+whole-decode"])]) == 0
    runs = [r for r in json.loads(out.read_text())["records"] if r.get("recipe") == "ours"]
    assert [r["host"] for r in runs] == [*host_probe.HOST_VARIANTS, "reply-worker+whole-decode"]
    for r in runs:
        assert r["completed"] == 3
        host = r["host_probe"]["host"]
        assert host["deliver"]["calls"] == 3 * 8  # every token of the 3 replies of 8, the first (prefill's) included
        assert host["decode_step"]["calls"] >= 7 and host["run_step"]["calls"] >= 7
        assert "gpu" not in r["host_probe"]  # CPU: no device events
    assert gc.isenabled() and gc.get_freeze_count() == 0 and sys.getswitchinterval() == interval
    from llm_core.engine import streamer

    assert streamer.incremental_decoder.__module__ == "llm_core.engine.streamer"  # whole-decode put it back
    with pytest.raises(ValueError, match="host variant"):
        with host_probe.host_variant("fast"):
            pass


def test_the_mixed_load_spans_short_and_long_prompts_in_a_fixed_interleave() -> None:
    from bench.batched import mixed_load

    lengths, offsets = mixed_load(8, 3.0, 4000)
    assert sorted(lengths) == lengths[::2] + lengths[1::2][::-1]  # short ones rising, long ones falling
    assert min(lengths) == 128 and max(lengths) == 4000 and len(set(lengths)) == 8
    assert offsets[0] == 0.0 and offsets[-1] == 3.0 and offsets == sorted(offsets)
    assert mixed_load(1, 3.0, 4000) == ([128], [0.0])


# --- GPU ------------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("quantization,frag", [("nf4", "off"), ("nf4", "on"), ("none", "off")])
def test_gpu_batched_rows_equal_the_batch_of_one_and_the_kernels_are_on(tmp_path: Any, quantization: str,
                                                                         frag: str) -> None:
    """On CUDA (compiled step, one graph per batch bucket), a random llama with head_dim 64: 4 greedy replies
    together equal each reply served alone by the same engine (a batch of 1), token for token, for their first 8
    tokens (the rows kernels sum in another order than the one-row kernels, so later tokens may part where two
    logits tie within bf16 rounding); the NF4 rows kernel passed its warm-up check. NF4_FRAG=on: nf4_frag is a
    candidate too, checked and timed at each bucket."""
    from bench.harness import make_random_checkpoint

    shape = dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=8,
                 num_key_value_heads=4, vocab_size=1024, rope_theta=10000.0, rms_norm_eps=1e-5)
    ckpt = make_random_checkpoint(shape, tmp_path / "ckpt", torch.device("cuda"), 2048, tokenizer="chatml")
    engine = ChatEngine.load(make_settings(MODEL_ID=str(ckpt), DEVICE="cuda", DECODE_PATH="fast",
                                           MAX_BATCH_SIZE="4", QUANTIZATION=quantization, NF4_FRAG=frag))
    slots = engine.fast_scheduler.runner.decoder
    assert slots.use_graphs and sorted(slots._graphs) == [1, 2, 4], slots.notes
    if quantization == "nf4":  # nf4_mm checked, then every candidate timed at each bucket: each takes its fastest
        note = next(n for n in slots.notes if n.startswith("NF4 rows kernels per batch"))
        assert "2 rows mm" in note and sorted(slots.rows_timings_us) == [2, 4], slots.notes
        assert ("frag" in slots.rows_timings_us[2]) == (frag == "on"), slots.notes
        assert all(t[k] == min(t.values()) for t, (_, k) in zip(slots.rows_timings_us.values(),
                                                                 slots.rows_max.kernels, strict=True))
    else:
        assert not slots.rows_kernel, slots.notes
    gen = engine.request_options(max_new_tokens=16, min_new_tokens=16, repetition_penalty=1.0)
    alone = [drain(engine.stream_chat(p, [], gen=gen, system_prompt=SYSTEM)) for p in PROMPTS[:4]]
    together = staggered(engine, PROMPTS[:4], [16] * 4, 0.0, min_new_tokens=16, repetition_penalty=1.0)
    for i, reference in enumerate(alone):
        assert together[i].token_ids[:8] == reference.token_ids[:8], (i, slots.notes)
    assert engine.fast_scheduler.snapshot().max_rows_in_step == 4
    engine.fast_scheduler.close()


def test_the_panel_says_a_batched_replys_peak_is_the_batchs() -> None:
    """Replies overlap on the batched path, so the peak shown is the batch's during this reply, with how many
    replies were decoding at that moment; a reply served alone shows no such note."""
    from llm_core.metrics import ReplyStats
    from ui.stats import format_stats

    base = dict(model="m", quantization="nf4", kv_cache="bf16", prompt_tokens=10, new_tokens=5,
                peak_vram_allocated_bytes=5 * 2**30, peak_vram_reserved_bytes=6 * 2**30, predicted_peak_bytes=2**30)
    batched = format_stats(ReplyStats(**base, peak_batch_rows=3))
    assert "the batch's, 3 replies decoding at that peak" in batched
    assert "the batch's" not in format_stats(ReplyStats(**base))


def test_slots_that_do_not_fit_at_start_up_fall_back_to_the_eager_batch(fp32_engine: ChatEngine,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Start-up never fails for weights that fit: when the measured sizing finds no room for the batched fast
    path's slots (DECODE_PATH=auto), its loop and slots are released and transformers' forward batches the replies,
    with the reason in the model panel; with DECODE_PATH=fast the error stands."""
    def no_room(*_a: Any) -> None:
        raise ContextBudgetError("The fast decode path does not fit a useful KV cache (simulated).")

    from dataclasses import replace

    # DECODE_PATH=fast builds the batched fast path on CPU; then the setting reads auto, as on a GPU where auto
    # chose that path
    engine = ChatEngine(fp32_engine.loaded, make_settings(**FP32, DECODE_PATH="fast", MAX_BATCH_SIZE="2"))
    assert engine.backend.name == "fast-batched"
    engine.settings = replace(engine.settings, model=replace(engine.settings.model, decode_path="auto"))
    monkeypatch.setattr(PathBuilder, "size_fast_slots", no_room)  # what warm-up runs for the slots
    engine.warmup()
    assert engine.backend.name == "batched" and engine.fast_scheduler is None
    assert "no room for the batched fast path's KV slots" in engine.backend.reason
    assert engine.max_concurrent_replies == 2
    done = drain(engine.stream_chat("Name a colour.", [], gen=engine.request_options(max_new_tokens=4),
                                    system_prompt=SYSTEM))
    assert done.done and done.stats.new_tokens > 0

    strict = ChatEngine(fp32_engine.loaded, make_settings(**FP32, DECODE_PATH="fast", MAX_BATCH_SIZE="2"))
    try:
        with pytest.raises(ContextBudgetError, match="simulated"):
            strict.warmup()
    finally:
        strict.fast_scheduler.close()
