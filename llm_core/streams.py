"""A reply's tokens between the batch scheduler's thread (llm_core.engine.scheduler.Scheduler, whatever its runner)
and the request's thread: the scheduler thread puts token ids (int) on the request's `items` queue and finally a
`Finished`; the request's thread reads them with `token_batches` (every id queued by then at each read) or `stream`
(one by one)."""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from .errors import GenerationError

MAX_HOLD_S = 1.0  # a reader's longest sleep between reads (hold_off)


def hold_off(hold: Callable[[], float] | None, ended: threading.Event) -> None:
    """A reader's pause between two reads of a reply: hold() seconds (at most MAX_HOLD_S; none when hold is None or
    says 0), cut short when `ended` is set (the reply's last text must not wait)."""
    wait = hold() if hold is not None else 0.0
    if wait > 0:
        ended.wait(min(wait, MAX_HOLD_S))


class TokenTimeout(Exception):
    """No token of a reply came within the reader's timeout (TokenStreams.token_batches)."""


@dataclass(frozen=True)
class Finished:
    """The last item of a request's token queue."""

    reason: str  # eos | length | stopped | error
    error: BaseException | None = None


class QueuedReply:
    """One reply in the batch scheduler: the scheduler thread puts its token ids (int) and finally a Finished on
    `items`, and fills `record` (llm_core.engine.serving.RowKV: its KV bytes, peaks) before the Finished."""

    _ids = itertools.count()

    def __init__(self, prompt_ids: list[int], options: Any, max_new_tokens: int, stop_event: threading.Event,
                 record: Any = None) -> None:
        self.id = next(self._ids)
        self.prompt_ids = prompt_ids
        self.options = options
        self.max_new_tokens = int(max_new_tokens)
        self.stop_event = stop_event
        self.record = record
        self.items: queue.SimpleQueue[int | Finished] = queue.SimpleQueue()
        # when each token was delivered (perf_counter, the scheduler thread; appended before the token is queued): a
        # reader that takes several ids at once stamps each at its delivery, not at the read
        self.delivered_s: list[float] = []
        self.arrived_s = time.perf_counter()
        self.counted_wait = False  # counted once in the scheduler's waiting statistics
        self.overtaken = 0  # admissions of later requests while this one waited (bounded: runner.max_overtakes)
        self.finished: Finished | None = None
        self.ended = threading.Event()  # set with the Finished: wakes a reader that holds off between reads
        self.eos_token_ids: frozenset[int] | None = None  # the ids that end this reply (None: its scheduler's)

    @property
    def kv_tokens(self) -> int:
        """Tokens this reply may hold in the cache at most (prompt + every new token)."""
        return len(self.prompt_ids) + self.max_new_tokens


class TokenStreams:
    """Mixin for a scheduler with `submit(prompt_ids, options, max_new_tokens, stop_event, record) -> request` (the
    request has an `items` queue) and a `_loop_running()` check; `fatal_error` is what stopped its loop, if any."""

    fatal_error: BaseException | None = None
    _cond: threading.Condition  # guards _waiting, the queue the loop thread admits from
    _waiting: Any
    stats: Any  # the scheduler's counters (errors among them)

    @property
    def alive(self) -> bool:
        raise NotImplementedError

    def submit(self, prompt_ids: list[int], options: Any, max_new_tokens: int, stop_event: threading.Event,
               record: Any = None) -> Any:
        raise NotImplementedError

    def _loop_running(self) -> bool:
        raise NotImplementedError

    def _finish(self, request: Any, reason: str, error: BaseException | None = None) -> None:
        """End a request once: its Finished goes on its queue (an error counted in the scheduler's `stats`)."""
        if request.finished is None:
            request.finished = Finished(reason, error)
            if error is not None:
                self.stats.errors += 1
            request.items.put(request.finished)
            request.ended.set()

    def _enqueue(self, request: Any, stopped: str) -> Any:
        """Queue a checked request for the loop thread (the scheduler's `_cond`, `_waiting` and `alive`); raise
        GenerationError(stopped) when its loop has ended."""
        with self._cond:
            if not self.alive:
                raise GenerationError(stopped)
            self._waiting.append(request)
            self._cond.notify_all()
        return request

    def token_batches(self, request: Any, timeout_s: float | None = None, poll_s: float = 0.25,
                      hold: Callable[[], float] | None = None) -> Iterator[list[int]]:
        """Yield the request's token ids as the scheduler produces them, as lists: each read takes every id queued by
        then (a reader that fell behind catches up in one go); raise its error; end when it finishes. timeout_s:
        raise TokenTimeout when no id came for that long (None: wait while the loop runs).

        hold: after each read, how many seconds the reader has no use for the next ids (a page that shows a reply
        at most every so often: ui.common.UpdatePacer.remaining). The reader then sleeps that long, or until the
        request ends, instead of waking for every token; the ids queued meanwhile come in one read, each still
        stamped at its delivery (`delivered_s`). The end is read at once: a hold never delays the last ids."""
        last = time.perf_counter()
        while True:
            try:
                item = request.items.get(timeout=poll_s if timeout_s is None else min(poll_s, timeout_s))
            except queue.Empty:
                if not self._loop_running():
                    raise GenerationError("The batch decode loop stopped while this reply was running.") from \
                        self.fatal_error
                if timeout_s is not None and time.perf_counter() - last >= timeout_s:
                    raise TokenTimeout(f"no token for {timeout_s:.0f} s") from None
                continue
            last = time.perf_counter()
            batch: list[int] = []
            while not isinstance(item, Finished):
                batch.append(item)
                try:
                    item = request.items.get_nowait()
                except queue.Empty:
                    break
            if batch:
                yield batch
            if isinstance(item, Finished):
                if item.error is not None:
                    raise item.error
                return
            hold_off(hold, request.ended)

    def stream(self, request: Any, poll_s: float = 0.25) -> Iterator[int]:
        """Yield the request's token ids one by one as the scheduler produces them; raise its error; end when it
        finishes."""
        for batch in self.token_batches(request, None, poll_s):
            yield from batch
