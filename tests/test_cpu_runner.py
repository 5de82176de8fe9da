"""The CPU path as a runner of the one scheduler (llm_core.engine.cpu_runner): replies through the engine equal
`generate` (fp32, greedy), they are rows of the scheduler's loop, Stop inside a chunked prefill ends the reply within
one chunk and leaves nothing reusable, two requests at once are served one after the other, and the prefix cache
still serves a second turn. Real embedded model, fp32 weights and cache."""

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from llm_core.engine.chat import ChatEngine
from llm_core.engine.cpu_runner import CPURunner
from llm_core.engine.scheduler import Scheduler
from llm_core.errors import GenerationError
from llm_core.history import Turn
from llm_core.sampling import SamplingOptions
from tests.conftest import drain, make_settings
from tests.test_cpu_path import PROMPTS, encode, reference

LONG = "Here is a list of fruit: " + ", ".join(["apple", "pear", "plum", "fig", "kiwi", "lime"] * 20) + \
    ". Which fruit comes first?"


@pytest.fixture(scope="module")
def cpu_fp32() -> Iterator[ChatEngine]:
    """The CPU path (DECODE_PATH=cpu) with dense fp32 weights and cache: the token-equality reference."""
    torch.manual_seed(0)
    engine = ChatEngine.load(make_settings(QUANTIZATION="none", COMPUTE_DTYPE="float32", DECODE_PATH="cpu"))
    assert engine.backend.name == "cpu"
    yield engine
    engine.close()


def scheduler_of(engine: ChatEngine) -> Scheduler[CPURunner]:
    scheduler = engine.backend.scheduler  # type: ignore[attr-defined]
    assert isinstance(scheduler, Scheduler) and isinstance(scheduler.runner, CPURunner)
    return scheduler


def reply(engine: ChatEngine, text: str, n: int, history: list[Turn] | None = None, *, penalty: float = 1.0,
          request_id: str | None = None) -> Any:
    gen = engine.request_options(max_new_tokens=n, repetition_penalty=penalty)
    return drain(engine.stream_chat(text, history or [], gen=gen, history_turns=8, system_prompt=None,
                                    request_id=request_id))


def generate_reference(engine: ChatEngine, ids: torch.Tensor, n: int, penalty: float) -> list[int]:
    """transformers' generate on the same fp32 weights, greedy, with the repetition penalty asked."""
    if penalty == 1.0:
        return reference(engine, ids, n)
    with torch.no_grad():
        out = engine.loaded.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                           do_sample=False, repetition_penalty=penalty, temperature=None,
                                           top_p=None, top_k=None, pad_token_id=2)
    return out[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("penalty", [1.0, 1.05])
def test_a_cpu_reply_through_the_scheduler_equals_generate_token_for_token(cpu_fp32: ChatEngine,
                                                                          penalty: float) -> None:
    for text in PROMPTS:
        cpu_fp32.backend.decoder.prefix_cache.invalidate()  # type: ignore[attr-defined]
        got = reply(cpu_fp32, text, 20, penalty=penalty)
        assert list(got.token_ids) == generate_reference(cpu_fp32, encode(cpu_fp32, text), 20, penalty)
        assert got.stats.decode_path == "cpu" and got.stats.new_tokens == len(got.token_ids)


def test_the_reply_is_a_row_of_the_scheduler_loop(cpu_fp32: ChatEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    scheduler = scheduler_of(cpu_fp32)
    assert scheduler in cpu_fp32.path.loops and scheduler.alive and scheduler.max_batch_size == 1
    decoder = cpu_fp32.backend.decoder  # type: ignore[attr-defined]
    threads: list[str] = []
    step = decoder.step

    def on_step(reply: Any) -> int:
        threads.append(threading.current_thread().name)
        return step(reply)

    monkeypatch.setattr(decoder, "step", on_step)
    before = scheduler.snapshot()
    got = reply(cpu_fp32, PROMPTS[0], 8)
    after = scheduler.snapshot()
    n = got.stats.new_tokens
    assert set(threads) == {"cpu-decode"} and len(threads) == n - 1  # every step on the loop's thread
    assert after.prefills - before.prefills == 1 and after.decode_steps - before.decode_steps == n - 1
    assert after.rows_decoded - before.rows_decoded == n - 1 and after.max_rows_in_step == 1
    assert (after.active, after.prefilling, after.waiting, after.slots) == (0, 0, 0, 1)
    rows = got.stats.prompt_tokens + n - 1  # the KV the reply wrote: the last token is never fed back
    assert got.stats.kv_cache_bytes == rows * decoder.kv_bytes_per_token()


def test_stop_inside_a_chunked_prefill_ends_within_one_chunk_and_nothing_is_reused(
        cpu_fp32: ChatEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    scheduler = scheduler_of(cpu_fp32)
    decoder = cpu_fp32.backend.decoder  # type: ignore[attr-defined]
    reply(cpu_fp32, "Name a fruit.", 4)  # the cache now holds a prompt that shares the chat template's start
    monkeypatch.setattr(scheduler.runner, "prefill_chunk_tokens", 16)
    chunks: list[int] = []
    prefill_chunk = decoder.prefill_chunk

    def stop_after_the_first_chunk(state: Any, chunk: int | None) -> int | None:
        token = prefill_chunk(state, chunk)
        chunks.append(state.prefilled)
        cpu_fp32.stop("long-prompt")  # pressed while the prompt is still being prefilled
        return token

    monkeypatch.setattr(decoder, "prefill_chunk", stop_after_the_first_chunk)
    before = scheduler.snapshot()
    stopped = reply(cpu_fp32, LONG, 8, request_id="long-prompt")
    after = scheduler.snapshot()
    prompt_tokens = stopped.stats.prompt_tokens
    assert prompt_tokens > 8 * 16  # many chunks long
    assert len(chunks) == 1 and chunks[0] < prompt_tokens  # the loop took the Stop before the next chunk
    assert (stopped.stats.finish_reason, stopped.stats.new_tokens) == ("stopped", 0)
    assert after.prefill_chunks - before.prefill_chunks == 1 and after.prefills == before.prefills
    assert decoder.prefix_cache.ids == ()  # the half-written cache is not reused
    monkeypatch.undo()
    again = reply(cpu_fp32, LONG, 8)
    assert again.stats.cached_prompt_tokens == 0
    assert list(again.token_ids) == reference(cpu_fp32, encode(cpu_fp32, LONG), 8)


def test_two_requests_at_once_are_served_one_after_the_other(cpu_fp32: ChatEngine,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Sent together straight to the scheduler (the engine's admission would queue the second itself): the second
    waits for the row, then both equal their reply alone."""
    scheduler = scheduler_of(cpu_fp32)
    decoder = cpu_fp32.backend.decoder  # type: ignore[attr-defined]
    events: list[tuple[str, int]] = []
    start, finish = decoder.start, decoder.finish

    def on_start(prompt: Any, *args: Any, **kwargs: Any) -> Any:
        events.append(("start", len(prompt)))
        return start(prompt, *args, **kwargs)

    def on_finish(state: Any) -> None:
        events.append(("finish", state.ids.numel()))
        finish(state)

    monkeypatch.setattr(decoder, "start", on_start)
    monkeypatch.setattr(decoder, "finish", on_finish)
    prompts = [encode(cpu_fp32, text) for text in PROMPTS]
    options = SamplingOptions(repetition_penalty=1.0)
    before = scheduler.snapshot()
    with decoder._lock:  # the loop waits for the decoder until both are queued: the second one must wait its turn
        requests = [scheduler.submit(ids[0].tolist(), options, 12, threading.Event()) for ids in prompts]
    got = [list(scheduler.stream(request)) for request in requests]
    after = scheduler.snapshot()
    for ids, tokens in zip(prompts, got, strict=True):
        decoder.prefix_cache.invalidate()
        assert tokens == reference(cpu_fp32, ids, 12)
    lengths = [ids.shape[1] for ids in prompts]
    assert events == [("start", lengths[0]), ("finish", lengths[0]), ("start", lengths[1]), ("finish", lengths[1])]
    assert after.waited_for_slot - before.waited_for_slot == 1 and after.max_rows_in_step == 1
    assert after.prefills - before.prefills == 2


def test_a_second_turn_reuses_the_cache_and_equals_a_cold_start(cpu_fp32: ChatEngine) -> None:
    decoder = cpu_fp32.backend.decoder  # type: ignore[attr-defined]
    decoder.prefix_cache.invalidate()
    first = reply(cpu_fp32, "Name three colours.", 10, penalty=1.05)
    history = [Turn("Name three colours.", first.text)]
    warm = reply(cpu_fp32, "And three animals?", 12, history, penalty=1.05)
    decoder.prefix_cache.invalidate()
    cold = reply(cpu_fp32, "And three animals?", 12, history, penalty=1.05)
    assert warm.stats.cached_prompt_tokens > 0 and cold.stats.cached_prompt_tokens == 0
    assert warm.token_ids == cold.token_ids and warm.stats.prompt_tokens == cold.stats.prompt_tokens


def test_a_request_over_the_cache_is_refused_at_once_and_the_loop_serves_on(cpu_fp32: ChatEngine) -> None:
    scheduler = scheduler_of(cpu_fp32)
    cache_tokens = cpu_fp32.backend.decoder.max_cache_len  # type: ignore[attr-defined]
    with pytest.raises(GenerationError, match="exceed the CPU path's KV cache"):
        scheduler.submit([1] * 8, SamplingOptions(), cache_tokens, threading.Event())
    assert scheduler.alive and scheduler.snapshot().waiting == 0
    assert reply(cpu_fp32, "Name a fruit.", 3).stats.new_tokens >= 1


def test_a_dropped_engine_lets_its_loop_end_and_its_decoder_go() -> None:
    """Without close(): the loop holds its decoder weakly, so dropping the engine frees the model and ends the loop."""
    engine = ChatEngine.load(make_settings(DECODE_PATH="cpu"))
    reply(engine, "Hi", 2)
    loop = scheduler_of(engine)
    thread = loop._thread
    decoder = weakref.ref(engine.backend.decoder)  # type: ignore[attr-defined]
    assert thread is not None and thread.is_alive()
    del engine
    gc.collect()
    assert decoder() is None
    thread.join(30)
    assert not thread.is_alive()
