"""The memory guard inside the engine: plans every reply against a budget, trims, lowers, refuses, recovers."""

from __future__ import annotations

import collections
import re
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from llm_core.engine.chat import ChatEngine
from llm_core.errors import ContextBudgetError, OutOfMemoryError
from llm_core.history import Turn, build_messages
from llm_core.memory.budget import MemoryBudget
from llm_core.memory.model import predict_peak_bytes


def last(iterable: Any) -> Any:
    return collections.deque(iterable, maxlen=1)[0]


LONG_TURNS = [Turn(f"Tell me fact number {i}. " + "please " * 300, f"Fact {i}: " + "indeed " * 300)
              for i in range(3)]  # ~600 tokens per turn


@pytest.fixture
def engine(fp32_engine: ChatEngine) -> Iterator[ChatEngine]:
    """The fp32 engine with its budget restored after each test."""
    budget, facts = fp32_engine.memory_budget, fp32_engine.memory_facts
    yield fp32_engine
    fp32_engine.memory_budget, fp32_engine.memory_facts = budget, facts


def budget_for(engine: ChatEngine, prompt_tokens: int, new_tokens: int) -> MemoryBudget:
    pred = predict_peak_bytes(engine.memory_facts, prompt_tokens, new_tokens, "bf16",
                              prefill_chunk_tokens=engine.prefill_chunk_tokens)
    return MemoryBudget(pred.total_bytes, "test")


def test_every_reply_carries_a_prediction_a_budget_and_a_context_meter(engine: ChatEngine) -> None:
    done = last(engine.stream_chat("Hello!", [], gen=engine.request_options(max_new_tokens=4)))
    stats = done.stats
    assert stats.memory_budget_bytes == engine.memory_budget.budget_bytes
    assert stats.predicted_peak_bytes and stats.predicted_peak_bytes > stats.weights_bytes
    assert stats.context_fit_tokens and stats.prompt_tokens <= stats.context_fit_tokens <= 8192 - 4


def test_guard_drops_old_turns_before_a_reply_that_would_exceed_the_budget(engine: ChatEngine) -> None:
    gen = engine.request_options(max_new_tokens=8)
    full = engine.count_tokens(build_messages(engine.settings.chat.system_prompt, LONG_TURNS, "Summarise."))
    engine.memory_budget = budget_for(engine, full - 700, 8)  # room for about one turn fewer
    done = last(engine.stream_chat("Summarise.", LONG_TURNS, gen=gen, history_turns=10))
    assert done.stats.dropped_turns >= 1 and done.stats.prompt_tokens <= full - 700
    assert done.stats.new_tokens <= 8
    assert any("memory budget" in n for n in done.stats.notes)
    assert any("oldest turn" in n for n in done.stats.notes)


def test_guard_lowers_max_new_tokens_when_dropping_turns_is_not_enough(engine: ChatEngine) -> None:
    base = engine.count_tokens(build_messages(engine.settings.chat.system_prompt, [], "Write a poem."))
    engine.memory_budget = budget_for(engine, base, 5)
    done = last(engine.stream_chat("Write a poem.", LONG_TURNS, gen=engine.request_options(max_new_tokens=200),
                                   history_turns=10))
    note = next(n for n in done.stats.notes if "max_new_tokens was lowered from 200 to " in n)
    allowed = int(re.search(r"lowered from 200 to (\d+)", note).group(1))  # type: ignore[union-attr]

    def peak(new: int) -> int:
        return predict_peak_bytes(engine.memory_facts, base, new, "bf16",
                                  prefill_chunk_tokens=engine.prefill_chunk_tokens).total_bytes

    budget = engine.memory_budget.budget_bytes
    assert 5 <= allowed < 200 and peak(allowed) <= budget < peak(allowed + 1)  # the most that fits
    assert done.stats.dropped_turns == 3 and done.stats.new_tokens <= allowed


def test_a_message_that_cannot_fit_even_alone_is_refused_clearly(engine: ChatEngine) -> None:
    engine.memory_budget = MemoryBudget(engine.memory_facts.weights_bytes + 1024, "test")
    with pytest.raises(ContextBudgetError, match="does not fit in memory.*The conversation is kept"):
        last(engine.stream_chat("Hello", LONG_TURNS))


@pytest.mark.parametrize("point", ["plan", "prefill", "decode"])
def test_injected_oom_is_reported_memory_freed_and_the_next_reply_works(engine: ChatEngine, point: str) -> None:
    gen = engine.request_options(max_new_tokens=6)
    with engine.oom_injector.armed_for(point), pytest.raises(OutOfMemoryError, match="conversation kept"):
        last(engine.stream_chat("Hello", [Turn("Hi", "Hello!")], gen=gen))
    assert engine.oom_injector.fired[-1] == point
    after = last(engine.stream_chat("Hello", [Turn("Hi", "Hello!")], gen=gen))
    assert after.done and after.stats.new_tokens > 0


def test_quantized_kv_cache_reply_uses_less_cache_memory(engine: ChatEngine) -> None:
    prompt = "Explain photosynthesis in detail. " * 250  # ~1.5k tokens: storage, not scratch, dominates
    dense = last(engine.stream_chat(prompt, [], gen=engine.request_options(max_new_tokens=24)))
    quant = last(engine.stream_chat(prompt, [], gen=engine.request_options(max_new_tokens=24, kv_cache="int8")))
    assert quant.stats.kv_cache == "int8" and quant.stats.decode_path == "plain"
    assert quant.done and quant.stats.new_tokens > 0
    per_token_dense = dense.stats.kv_cache_bytes / (dense.stats.prompt_tokens + dense.stats.new_tokens - 1)
    per_token_quant = quant.stats.kv_cache_bytes / (quant.stats.prompt_tokens + quant.stats.new_tokens - 1)
    assert per_token_quant < 0.5 * per_token_dense


def _live_tensor_bytes(exclude: set[int]) -> int:
    """Bytes of every storage a live torch tensor holds, each storage once, leaving out `exclude` (data pointers)."""
    import gc
    import warnings

    seen: dict[int, int] = {}
    with warnings.catch_warnings():  # isinstance() on deprecated module attributes among the objects warns
        warnings.simplefilter("ignore")
        objects = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]
    from torch._subclasses.fake_tensor import FakeTensor

    for obj in objects:
        if not obj.is_meta and not isinstance(obj, FakeTensor):  # compile's fake tensors hold no memory
            try:
                storage = obj.untyped_storage()
                ptr = storage.data_ptr()
            except (RuntimeError, NotImplementedError):  # fake tensors of torch.compile's caches, other subclasses
                continue
            if ptr and ptr not in exclude:
                seen[ptr] = storage.nbytes()
    return sum(seen.values())


def test_injected_oom_frees_the_replys_memory_even_while_the_error_is_held(engine: ChatEngine) -> None:
    """After an OOM in the first decode step of a ~2,000-token prompt (its KV cache ~90 MB in fp32, its prefill
    scratch several times that), no tensor of the reply is left alive, although the caller still holds the error
    (as pytest.raises and Gradio do): the failed step's frames were cleared. Counted as the bytes of live tensors
    (not RSS, which malloc arenas and tokenizer buffers move by tens of MB from run to run)."""
    import gc

    from llm_core.memory.device import free_memory
    from llm_core.memory.model import kv_bytes_per_token

    prompt = "Explain photosynthesis in detail, step by step. " * 200
    gen = engine.request_options(max_new_tokens=8)
    model = engine.loaded.model
    weights = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    last(engine.stream_chat(prompt, [], gen=engine.request_options(max_new_tokens=1)))  # one-time caches paid
    free_memory(engine.loaded.device)
    gc.collect()
    before = _live_tensor_bytes(weights)
    with engine.oom_injector.armed_for("decode"), pytest.raises(OutOfMemoryError) as held:
        last(engine.stream_chat(prompt, [], gen=gen))
    prompt_tokens = engine.count_tokens([{"role": "user", "content": prompt}])
    kv_bytes = prompt_tokens * kv_bytes_per_token(engine.loaded.model.config, engine.loaded.compute_dtype)
    gc.collect()
    grown = _live_tensor_bytes(weights) - before
    assert held.value is not None and prompt_tokens > 1_600
    assert held.value.__traceback__ is not None  # the error is still held, with its traceback
    assert grown < 0.1 * kv_bytes, (grown, kv_bytes)
