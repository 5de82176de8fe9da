"""A reply's token ids -> its text, on the reply's own thread: `TimedStreamer` stamps each id on the reply's TokenClock
as it comes and passes on its text, decoded incrementally (`incremental_decoder`: tokenizers' DecodeStream) where
that gives tokenizer.decode's text. Fed by the engine's worker (single-reply backends: `put`) or by the reply's
thread itself (scheduled rows: `put_ids`, then `texts`); `held_texts` reads a worker's text at most every so often."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from transformers import TextIteratorStreamer

from ..metrics import TokenClock
from ..streams import hold_off


def incremental_decoder(tokenizer: Any) -> Any | None:
    """A `tokenizers.decoders.DecodeStream` for `tokenizer` (each token's new text in O(1), incomplete UTF-8 held back
    until its character is whole), or None where it would not give tokenizer.decode's text: a slow tokenizer, or one
    that cleans up tokenization spaces (" ." -> "."), which only a decode of the whole text does."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or not getattr(tokenizer, "is_fast", False) or getattr(
            tokenizer, "clean_up_tokenization_spaces", False):
        return None
    try:
        from tokenizers.decoders import DecodeStream
    except ImportError:  # pragma: no cover - tokenizers older than 0.21
        return None
    return DecodeStream(skip_special_tokens=True)


class TimedStreamer(TextIteratorStreamer):
    """TextIteratorStreamer that also stamps every generated token id on a TokenClock as it arrives, and passes on each
    token's text as it comes.

    With a fast tokenizer the text comes from `incremental_decoder` (O(1) per token; the base class decodes every id
    since the last newline again at each token, and holds symbols back until the next space). Otherwise the base
    class's decoding, and `every_token` (structured output: JSON is mostly symbols, so a compact value would arrive
    in one piece at the end) passes on each token's text except an incomplete character (decoded as U+FFFD).
    `put_ids` and `texts` are for a reader that feeds the streamer on its own thread (ChatEngine's scheduled
    replies); `held_texts` for one that reads a worker's text at most every so often."""

    def __init__(self, tokenizer: Any, clock: TokenClock, timeout_s: float, *, every_token: bool = False) -> None:
        super().__init__(tokenizer, skip_prompt=True, timeout=timeout_s, skip_special_tokens=True)
        self.clock = clock
        self.every_token = every_token
        self._decoder = incremental_decoder(tokenizer)
        self._ended = threading.Event()  # set by end(): wakes a reader holding off between reads

    def put(self, value: torch.Tensor) -> None:
        if self.skip_prompt and self.next_tokens_are_prompt:
            super().put(value)  # the prompt: skipped
            return
        self.put_ids(value.reshape(-1).tolist())

    def put_ids(self, ids: list[int], times: list[float] | None = None) -> None:
        """Generated token ids: stamped on the clock (at `times`, their delivery, where given), their text passed on."""
        self.clock.on_tokens(ids, times)
        if self._decoder is not None:
            backend = self.tokenizer._tokenizer
            text = "".join(chunk for chunk in (self._decoder.step(backend, i) for i in ids) if chunk)
            if text:
                self.on_finalized_text(text)
            return
        if not self.every_token:
            super().put(torch.tensor(ids))
            return
        self.token_cache.extend(ids)  # one decode per token, as the base class does; end() flushes the rest
        text = str(self.tokenizer.decode(self.token_cache, **self.decode_kwargs))
        if len(text) > self.print_len and not text.endswith("\ufffd"):
            self.on_finalized_text(text[self.print_len:])
            self.print_len = len(text)

    def end(self) -> None:
        if self._decoder is not None:  # nothing held back but an incomplete character, which never completes now
            self.next_tokens_are_prompt = True
            self.text_queue.put(self.stop_signal, timeout=self.timeout)
        else:
            super().end()
        self._ended.set()

    def held_texts(self, hold: Callable[[], float]) -> Iterator[str]:
        """The text as iterating gives it (raising queue.Empty after `timeout` without any), but read at most once
        per hold: after each read the reader sleeps hold() seconds, or until end(), and the next read joins every
        piece queued meanwhile (the same text in fewer pieces; each token was timed on the clock as it came)."""
        while True:
            item = self.text_queue.get(timeout=self.timeout)
            pieces: list[str] = []
            while item is not self.stop_signal:
                pieces.append(item)
                try:
                    item = self.text_queue.get_nowait()
                except queue.Empty:
                    break
            if any(pieces):
                yield "".join(pieces)
            if item is self.stop_signal:
                return
            hold_off(hold, self._ended)

    def texts(self) -> Iterator[str]:
        """The text passed on so far and not yet read, without waiting (the reader that feeds put_ids)."""
        while True:
            try:
                text = self.text_queue.get_nowait()
            except queue.Empty:
                return
            if text is not self.stop_signal and text:
                yield text
