"""The CPU batch runner: a reply as the row of llm_core.fast.cpu.CPUDecoder's static KV cache, its prompt prefilled in
chunks between the loop's turns and stepped by the decoder's compiled step; llm_core.engine.scheduler drives it, as it
drives the eager and fast runners. Knows nothing about text or Gradio.

A row's life:

    submitted (prompt + max new tokens within the static cache, else refused at once: CPUDecoder.check_reply) -->
    admitted when the row is free --> CPUDecoder.start (the prompt tokens the prefix cache holds are not prefilled)
    --> one chunk of prefill_chunk_tokens per advance_prefills (the loop drops a stopped row between chunks) --> the
    first token --> decode_step: one step, its token to the request --> the row ends (EOS, length, Stop, error): its
    KV bytes recorded, the prefix cache committed (a clean end, or a Stop after a token) or forgotten (an error, a
    Stop inside the prefill), its request finished.

One row (ROWS): on 2 cores batching does not pay (docs/cpu.md), and the decoder has one static cache. The rows are
lists all the same, so a decoder with a cache of several rows could give more.
"""

from __future__ import annotations

import threading
import time
import weakref
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from ..errors import GenerationError
from ..streams import QueuedReply
from .fast_runner import BatchStats
from .runners import BoundRunner, grad_off

if TYPE_CHECKING:
    from ..fast.cpu import CPUDecoder, CPUReply

ROWS = 1  # replies decoded at once: the decoder's one static cache


@dataclass
class _Row:
    request: QueuedReply
    reply: CPUReply  # the decoder's state of this reply


class CPURunner(BoundRunner):
    """The BatchRunner (llm_core.engine.runners) over CPUDecoder (see the module docstring). The decoder is held by a
    weak reference, as the eager runner holds its model: an engine dropped without close() frees it, and the loop
    then ends."""

    label = "The CPU decode loop"
    thread_name = "cpu-decode"
    shutdown_message = "The model was unloaded or the demo is shutting down; this reply was stopped."
    max_overtakes = 0  # strict arrival order: every request admitted fits the cache
    admission_prefill_tokens: int | None = None  # prefill is chunked between turns instead (advance_prefills)

    def __init__(self, decoder: CPUDecoder, *, prefill_chunk_tokens: int | None) -> None:
        self._decoder_ref = weakref.ref(decoder)
        self.prefill_chunk_tokens = prefill_chunk_tokens  # None: the prompt in one pass
        self._rows: list[_Row] = []  # decoding
        self._prefilling: list[_Row] = []  # in admission order

    @property
    def decoder(self) -> CPUDecoder:
        return self.held(self._decoder_ref)

    @property
    def max_batch_size(self) -> int:
        return ROWS

    # --- what the scheduler asks -------------------------------------------------------------------------------------
    def new_request(self, prompt_ids: list[int], options: Any, max_new_tokens: int, stop_event: threading.Event,
                    record: Any) -> QueuedReply:
        """A request; GenerationError when its prompt + max new tokens exceed the static cache. Its EOS ids are the
        generation config's now (read per reply, as generate reads them)."""
        decoder = self.decoder
        decoder.check_reply(len(prompt_ids), int(max_new_tokens))
        request = QueuedReply(prompt_ids, options, max_new_tokens, stop_event, record)
        request.eos_token_ids = frozenset(decoder.loaded.eos_token_ids)
        return request

    def new_stats(self) -> BatchStats:
        return BatchStats(slots=ROWS, slot_tokens=int(self.decoder.max_cache_len))

    def snapshot(self, stats: BatchStats, waiting: int) -> BatchStats:
        decoder = self._decoder_ref()
        return replace(stats, waiting=waiting, active=len(self._rows), prefilling=len(self._prefilling),
                       kv_held_bytes=decoder.cache_bytes if decoder is not None else 0,
                       rows_by_bucket=dict(stats.rows_by_bucket))

    def count_wait(self, stats: BatchStats, reason: str) -> bool:
        stats.waited_for_slot += 1  # the row was taken ("row": every request admitted fits the cache)
        return True

    def warm(self) -> None:
        """Nothing on the caller's thread: the first reply allocates the cache and compiles the step on the loop's
        thread, the one thread whose OpenMP team decodes (docs/cpu.md: a second team halves the speed)."""

    def resize(self, slot_tokens: int) -> None:
        raise GenerationError("The CPU path's KV cache is sized when its decoder is built, not resized.")

    def loop_mode(self) -> AbstractContextManager[None]:
        return grad_off()  # the mode the decoder's graphs were compiled in: no recompile

    def usable(self) -> bool:
        return self._decoder_ref() is not None

    def decoding(self) -> bool:
        return bool(self._rows)

    def busy(self) -> bool:
        return self.decoding() or bool(self._prefilling)

    def has_free_row(self) -> bool:
        return len(self._rows) + len(self._prefilling) < ROWS

    def fits(self, request: QueuedReply) -> bool:
        return True  # the cache was checked at submit (new_request); a free row is all it needs

    def admit(self, request: QueuedReply) -> None:
        """The row: the decoder taken for this reply (CPUDecoder.start); it prefills from advance_prefills on."""
        options = request.options
        try:
            reply = self.decoder.start(request.prompt_ids, options, request.max_new_tokens,
                                       min_new_tokens=options.min_new_tokens, eos_ids=request.eos_token_ids or ())
        except Exception as exc:  # noqa: BLE001 - this request only
            self.host.finish(request, "error", exc)
            return
        with self.host.cond:
            self._prefilling.append(_Row(request, reply))

    def advance_prefills(self) -> None:
        """One chunk of the oldest prefilling row (so Stop is honoured between chunks); a row whose prompt is in has
        its first token and decodes."""
        if not self._prefilling:
            return
        row = self._prefilling[0]
        stats = self.host.stats
        try:
            token = self.decoder.prefill_chunk(row.reply, self.prefill_chunk_tokens)
        except Exception as exc:  # noqa: BLE001 - this request only
            self._end_row(row, "error", exc)
            return
        stats.prefill_chunks += 1
        if token is None:
            return
        stats.prefills += 1
        with self.host.cond:
            self._prefilling.remove(row)
            self._rows.append(row)
        self._deliver(row, token)

    def decode_step(self) -> None:
        """One step of every decoding row (each its own call: one row today), its token delivered."""
        rows = list(self._rows)
        t0 = time.perf_counter()
        tokens: list[tuple[_Row, int]] = []
        for row in rows:
            try:
                tokens.append((row, self.decoder.step(row.reply)))
            except Exception as exc:  # noqa: BLE001 - this request only
                self._end_row(row, "error", exc)
        self.host.stats.count_step(len(rows), len(rows), time.perf_counter() - t0)
        for row, token in tokens:
            self._deliver(row, token)

    def drop_stopped_rows(self) -> None:
        for row in [r for r in (*self._rows, *self._prefilling) if r.request.stop_event.is_set()]:
            self._end_row(row, "stopped")

    def fail_all(self, exc: BaseException) -> None:
        for row in [*self._rows, *self._prefilling]:
            self._end_row(row, "error", exc)

    def take_all(self) -> list[QueuedReply]:
        rows = [*self._rows, *self._prefilling]
        self._rows.clear()
        self._prefilling.clear()
        decoder = self._decoder_ref()
        for row in rows:  # the decoder given back, nothing of a half-written cache kept
            if decoder is not None:
                decoder.fail(row.reply)
        return [row.request for row in rows]

    # --- rows --------------------------------------------------------------------------------------------------------
    def _deliver(self, row: _Row, token: int) -> None:
        """The row's new token to its request; the row ends with it on EOS or length, or when Stop was pressed."""
        request = row.request
        reason = self.host.deliver(request, token, len(row.reply.out))
        if reason is None and request.stop_event.is_set():
            reason = "stopped"
        if reason:
            self._end_row(row, reason)

    def _end_row(self, row: _Row, reason: str, error: BaseException | None = None) -> None:
        """The row leaves: its record filled (KV rows written, prompt tokens from the cache), the decoder given back
        (the prefix committed after a token, else forgotten), its request finished."""
        request, reply = row.request, row.reply
        with self.host.cond:
            for rows in (self._rows, self._prefilling):
                if row in rows:
                    rows.remove(row)
        decoder = self._decoder_ref()
        if decoder is not None:
            record = request.record
            if record is not None:
                record.nbytes = reply.rows_used * decoder.kv_bytes_per_token()
                record.cached_prompt_tokens = reply.cached_tokens
            if error is None and reply.out:
                decoder.finish(reply)
            else:
                decoder.fail(reply)
        self.host.finish(request, reason, error)
