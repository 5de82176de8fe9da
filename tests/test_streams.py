"""A reply's tokens on their way to text: llm_core.streams (the scheduler's queue, read in batches) and the engine's
streamer (llm_core.engine.streamer.TimedStreamer: each token stamped and decoded as it comes)."""

from __future__ import annotations

import queue
import threading
import time
from typing import Any

import pytest
import torch

from llm_core import streams
from llm_core.engine.streamer import TimedStreamer, incremental_decoder
from llm_core.errors import GenerationError
from llm_core.metrics import TokenClock
from llm_core.streams import Finished, QueuedReply, TokenStreams, TokenTimeout
from tests.conftest import MODEL_CACHE

TEXTS = ["Hello there! The quick brown fox jumps over the lazy dog.",
         "Ünïcödé wörds, emoji 😀🚀 and CJK 中文字符 in one line.\n  Indented: x = [1, 2, 3]; {\"a\": 1}",
         "Symbols ... !!! ??? --- *** ``` code ``` <tag> & more\n\n\nEnd."]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    """The embedded model's tokenizer (converted by the engine fixtures; loaded here without the model)."""
    from transformers import AutoTokenizer

    from llm_core.models import ensure_embedded_converted

    return AutoTokenizer.from_pretrained(str(ensure_embedded_converted(MODEL_CACHE)))


def _streamed(tok: Any, ids: list[int], step: int) -> tuple[str, TokenClock]:
    clock = TokenClock()
    streamer = TimedStreamer(tok, clock, 1.0)
    streamer.put(torch.tensor([[1, 2, 3]]))  # the prompt: skipped
    out = []
    for i in range(0, len(ids), step):
        streamer.put_ids(ids[i:i + step])
        out.extend(streamer.texts())
    streamer.end()
    out.extend(streamer.texts())
    return "".join(out), clock


@pytest.mark.parametrize("step", [1, 3])
def test_the_streamer_passes_on_the_text_decode_gives_one_or_several_tokens_at_a_time(tokenizer: Any,
                                                                                       step: int) -> None:
    """Fed ids one at a time or three at once (a reader catching up), with special tokens among them, the text
    passed on adds up to tokenizer.decode(ids, skip_special_tokens=True), every id is stamped on the clock, and a
    word's text arrives with its token, not at the next space."""
    assert incremental_decoder(tokenizer) is not None  # the embedded model's tokenizer is fast
    special = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for text in TEXTS:
        ids = tokenizer(text)["input_ids"] + [special]
        got, clock = _streamed(tokenizer, ids, step)
        assert got == tokenizer.decode(ids, skip_special_tokens=True)
        assert clock.token_ids == ids
    clock = TokenClock()
    streamer = TimedStreamer(tokenizer, clock, 1.0)
    streamer.put(torch.tensor([[1]]))
    streamer.put_ids(tokenizer("Hello")["input_ids"])
    assert "".join(streamer.texts()) == "Hello"  # TextStreamer would hold "Hello" back until the next space


def test_ids_read_together_keep_the_times_they_were_delivered(tokenizer: Any) -> None:
    """put_ids with the delivery times (what the engine passes for a read of several ids): the clock's first and last
    token are those times, so TTFT and decode tokens/s do not depend on when the reader woke."""
    clock = TokenClock(start_s=100.0)
    streamer = TimedStreamer(tokenizer, clock, 1.0)
    streamer.put(torch.tensor([[1]]))
    streamer.put_ids(tokenizer("one two three four")["input_ids"][:4], [100.5, 100.6, 100.7, 100.8])
    snap = clock.snapshot()
    assert snap["new_tokens"] == 4 and snap["ttft_s"] == pytest.approx(0.5)
    assert snap["decode_s"] == pytest.approx(0.3) and snap["decode_tokens_per_s"] == pytest.approx(10.0)


def test_an_incomplete_character_waits_for_its_last_byte(tokenizer: Any) -> None:
    """Byte-level tokens that split one character: nothing (no U+FFFD) is passed on until the character is whole."""
    ids = tokenizer("😀")["input_ids"]
    if len(ids) < 2:
        pytest.skip("this tokenizer has the emoji as one token")
    clock = TokenClock()
    streamer = TimedStreamer(tokenizer, clock, 1.0)
    streamer.put(torch.tensor([[1]]))
    streamer.put_ids(ids[:1])
    assert list(streamer.texts()) == []
    streamer.put_ids(ids[1:])
    assert "".join(streamer.texts()) == "😀"


def test_tokenizers_that_clean_up_spaces_keep_the_whole_text_decoding(tokenizer: Any) -> None:
    """A tokenizer whose decode cleans up tokenization spaces gets no incremental decoder (only a whole decode does
    that cleanup), and its streamer still passes on decode's text."""
    saved = tokenizer.clean_up_tokenization_spaces
    try:
        tokenizer.clean_up_tokenization_spaces = True
        assert incremental_decoder(tokenizer) is None
        ids = tokenizer(TEXTS[0])["input_ids"]
        got, _ = _streamed(tokenizer, ids, 1)
        assert got == tokenizer.decode(ids, skip_special_tokens=True)
    finally:
        tokenizer.clean_up_tokenization_spaces = saved


class _Loop(TokenStreams):
    """TokenStreams around a hand-fed queue: `running` says whether its loop is alive."""

    def __init__(self) -> None:
        self.running = True

    def _loop_running(self) -> bool:
        return self.running


def _request() -> QueuedReply:
    return QueuedReply([1, 2], None, 8, threading.Event())


def test_token_batches_take_every_id_queued_by_the_read_and_end_with_the_reply() -> None:
    loop, request = _Loop(), _request()
    for token in (5, 6, 7):
        request.items.put(token)
    batches = loop.token_batches(request, timeout_s=5.0)
    assert next(batches) == [5, 6, 7]
    request.items.put(8)
    request.items.put(Finished("length"))
    assert list(batches) == [[8]]
    assert list(loop.stream(_request_with([1, 2, Finished("eos")]))) == [1, 2]


def _request_with(items: list[Any]) -> QueuedReply:
    request = _request()
    for item in items:
        request.items.put(item)
    return request


def test_token_batches_raise_the_replys_error_after_its_ids() -> None:
    loop = _Loop()
    batches = loop.token_batches(_request_with([3, Finished("error", GenerationError("boom"))]), timeout_s=5.0)
    assert next(batches) == [3]
    with pytest.raises(GenerationError, match="boom"):
        next(batches)


def test_token_batches_give_up_after_the_timeout_and_when_the_loop_stops() -> None:
    loop, request = _Loop(), _request()
    t0 = time.perf_counter()
    with pytest.raises(TokenTimeout):
        next(loop.token_batches(request, timeout_s=0.3, poll_s=0.05))
    assert 0.25 <= time.perf_counter() - t0 < 2.0
    loop.running = False
    with pytest.raises(GenerationError, match="stopped"):
        next(loop.token_batches(request, timeout_s=None, poll_s=0.05))


def test_a_waiting_reader_gets_ids_queued_from_another_thread() -> None:
    loop, request = _Loop(), _request()
    got: queue.SimpleQueue[list[int]] = queue.SimpleQueue()

    def read() -> None:
        for batch in loop.token_batches(request, timeout_s=5.0, poll_s=0.05):
            got.put(batch)

    reader = threading.Thread(target=read)
    reader.start()
    time.sleep(0.1)
    request.items.put(9)
    assert got.get(timeout=2.0) == [9]
    request.items.put(Finished("length"))
    reader.join(2.0)
    assert not reader.is_alive()


def test_a_holding_reader_sleeps_between_reads_and_wakes_at_once_when_the_reply_ends(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """hold(): after each read the reader sleeps that long (a page that shows the reply every so often), so the ids
    queued meanwhile come in one read; the reply's end wakes it at once, whatever the hold."""
    monkeypatch.setattr(streams, "MAX_HOLD_S", 60.0)
    loop, request = _Loop(), _request()
    holds = [0.05, 60.0]
    asked: list[float] = []

    def hold() -> float:
        asked.append(holds[len(asked)])
        return asked[-1]

    batches = loop.token_batches(request, timeout_s=5.0, poll_s=0.05, hold=hold)
    request.items.put(1)
    assert next(batches) == [1]
    request.items.put(2)
    request.items.put(3)
    assert next(batches) == [2, 3]  # both after the first hold: one read, not two

    def produce() -> None:
        for token in (4, 5, 6):
            request.items.put(token)
            time.sleep(0.01)
        loop._finish(request, "length")

    threading.Thread(target=produce).start()
    t0 = time.perf_counter()
    assert list(batches) == [[4, 5, 6]]
    assert time.perf_counter() - t0 < 30.0  # woken by the end, not after the 60 s hold
    assert asked == [0.05, 60.0] and request.ended.is_set()
