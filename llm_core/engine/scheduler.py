"""The one continuous-batching loop: the queue of replies, the order they are admitted in, the loop thread, stop and
finish, the counters' snapshots. How a row's KV is held, prefilled and stepped is its runner's (runners.BatchRunner:
eager_runner over transformers, fast_runner over the fast path's slots, cpu_runner over the CPU path's static cache).
Knows nothing about text, torch or Gradio.

One background thread owns the device; request threads only queue work and read their tokens (llm_core.streams):

    waiting (FIFO) --admit: a free row (runner.has_free_row) and room for its KV (runner.fits); a waiting request is
    overtaken by a later one that fits at most runner.max_overtakes times, and at most runner.admission_prefill_tokens
    prompt tokens join per round when the runner prefills at admission--> runner.admit --> runner.advance_prefills
    (chunks between steps) --> runner.decode_step: one step for every row, each token to its request (deliver) -->
    a row that ends (EOS, length, Stop, error) leaves its runner, and its request finishes.
"""

from __future__ import annotations

import atexit
import itertools
import threading
import time
import weakref
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from ..errors import GenerationError, InputError
from ..streams import QueuedReply, TokenStreams

if TYPE_CHECKING:
    from .runners import BatchRunner

R = TypeVar("R", bound="BatchRunner")


class Scheduler(TokenStreams, Generic[R]):
    """Decodes every concurrent reply as a row of its runner's batch (see the module docstring).

    Thread-safe `submit` / `generate`; the loop thread starts at the first `start()` (submit calls it). A request the
    runner can never hold (its KV over the budget or a slot) is refused at once; one that fits waits its turn."""

    def __init__(self, runner: R, *, eos_token_ids: Sequence[int], name: str | None = None) -> None:
        self.runner = runner
        self.eos_token_ids = frozenset(int(e) for e in eos_token_ids)
        self._cond = threading.Condition()
        self._waiting: deque[QueuedReply] = deque()
        self._closed = False
        self.fatal_error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self._name = name or runner.thread_name
        runner.bind(self)
        self.stats = runner.new_stats()

    # --- public ------------------------------------------------------------------------------------------------------
    @property
    def max_batch_size(self) -> int:
        return self.runner.max_batch_size

    @property
    def cond(self) -> threading.Condition:
        """Guards the queue and the runner's row lists (snapshot reads them from other threads)."""
        return self._cond

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._closed

    def start(self) -> None:
        """Warm the runner (the fast path: allocate the slots, compile, capture) and start the loop. Idempotent."""
        with self._start_lock:  # held through the warm-up: the first replies may arrive on several threads at once
            if self._thread is not None:
                return
            self.runner.warm()
            thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
            with self._cond:
                self._thread = thread
            thread.start()
            _RUNNING.add(self)

    def resize_slots(self, slot_tokens: int) -> None:
        """runner.resize before the loop runs (the engine sizes the fast path's slots by measurement at start-up);
        the counters start over."""
        with self._start_lock:
            if self._thread is not None:
                raise GenerationError(f"{self.runner.label} is running: its KV slots are sized before it starts.")
            self.runner.resize(slot_tokens)
            self.stats = self.runner.new_stats()

    def submit(self, prompt_ids: list[int], options: Any, max_new_tokens: int, stop_event: threading.Event,
               record: Any = None) -> QueuedReply:
        """Queue a reply. Raises InputError / GenerationError / ContextBudgetError at once for one that could never
        be served (runner.new_request checks it)."""
        if not prompt_ids:
            raise InputError("The prompt is empty.")
        request = self.runner.new_request(list(prompt_ids), options, max_new_tokens, stop_event, record)
        self.start()
        return self._enqueue(request, f"{self.runner.label} has stopped; restart the demo.")

    def _loop_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def snapshot(self) -> Any:
        """The runner's counters now (SchedulerStats or BatchStats), queue and rows included."""
        with self._cond:
            return self.runner.snapshot(self.stats, len(self._waiting))

    def queue_position(self, request: QueuedReply) -> int | None:
        """Requests ahead of `request` in the queue (0 = next), None once it has a row."""
        with self._cond:
            for i, r in enumerate(self._waiting):
                if r is request:
                    return i
        return None

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the thread; requests still waiting or running end with a GenerationError."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout_s)

    # --- what a runner calls (scheduler thread only) -----------------------------------------------------------------
    def finish(self, request: QueuedReply, reason: str, error: BaseException | None = None) -> None:
        """End a request once (TokenStreams._finish): a runner calls it after its row has left."""
        self._finish(request, reason, error)

    def deliver(self, request: QueuedReply, token: int, new_tokens: int, min_new_tokens: int = 0) -> str | None:
        """Stream a row's new token (its `new_tokens`-th) to its request; the reason the row ends with it, if any:
        eos (once min_new_tokens are out: the fast path bans EOS until then, the eager one has no such minimum)
        or length. The request's own eos_token_ids, when set, replace the scheduler's."""
        request.delivered_s.append(time.perf_counter())
        request.items.put(token)
        eos = request.eos_token_ids if request.eos_token_ids is not None else self.eos_token_ids
        if token in eos and new_tokens >= min_new_tokens:
            return "eos"
        if new_tokens >= request.max_new_tokens:
            return "length"
        return None

    def requeue_first(self, request: QueuedReply) -> None:
        """A preempted row's request goes back to the head of the queue (it resumes from what it streamed)."""
        with self._cond:
            self._waiting.appendleft(request)

    # --- the loop (scheduler thread only) ----------------------------------------------------------------------------
    def _loop(self) -> None:
        runner = self.runner
        error: BaseException
        try:
            with runner.loop_mode():
                while True:
                    with self._cond:
                        if self._closed or not runner.usable():
                            break
                        if not runner.busy() and not self._waiting:
                            self._cond.wait(0.5)
                            continue
                    try:
                        self._drop_stopped()
                        self._admit()
                        working = runner.busy()  # rows to prefill or decode
                        runner.advance_prefills()
                        if runner.decoding():
                            runner.decode_step()
                        elif self._waiting and not working:  # no row, and the head does not fit: wait for a change
                            with self._cond:
                                self._cond.wait(0.02)
                    except Exception as exc:  # noqa: BLE001 - a failed step: fail the rows in it, keep serving
                        runner.fail_all(exc)
            error = GenerationError(runner.shutdown_message)
        except BaseException as exc:  # a bug in the loop itself: fail every reply rather than hang them
            self.fatal_error = exc
            error = GenerationError(f"{runner.label} failed: {type(exc).__name__}: {str(exc)[:300]}")
        with self._cond:
            self._closed = True
            pending = list(self._waiting) + runner.take_all()
            self._waiting.clear()
        for request in pending:
            self._finish(request, "error", error)

    def _drop_stopped(self) -> None:
        """Stop / disconnect: a waiting request leaves the queue, a running row leaves its runner."""
        with self._cond:
            for request in [r for r in self._waiting if r.stop_event.is_set()]:
                self._waiting.remove(request)
                self._finish(request, "stopped")
        self.runner.drop_stopped_rows()

    def _admit(self) -> None:
        """Admit waiting requests while a row is free, in arrival order but for overtakes (see the module
        docstring). A request left waiting is counted once, by what it waited for (a row or memory:
        runner.count_wait)."""
        runner = self.runner
        budget = runner.admission_prefill_tokens
        prefilled_tokens = 0
        while True:
            with self._cond:
                if not self._waiting:
                    return
                if not runner.has_free_row():
                    self._count_wait("row")
                    return
                candidate = None
                for position, request in enumerate(self._waiting):
                    if runner.fits(request):
                        candidate = request
                        for earlier in itertools.islice(self._waiting, position):
                            earlier.overtaken += 1
                        break
                    if request.overtaken >= runner.max_overtakes:
                        break  # nobody overtakes it any more: wait until it fits
                if candidate is None:
                    self._count_wait("memory")
                    return
                if budget is not None and prefilled_tokens and \
                        prefilled_tokens + len(candidate.prompt_ids) > budget:
                    return  # decode the running rows first; admit the rest next round
                self._waiting.remove(candidate)
            prefilled_tokens += len(candidate.prompt_ids)
            runner.admit(candidate)

    def _count_wait(self, reason: str) -> None:
        head = self._waiting[0]
        if not head.counted_wait and self.runner.count_wait(self.stats, reason):
            head.counted_wait = True


_RUNNING: weakref.WeakSet[Scheduler[Any]] = weakref.WeakSet()


def close_all() -> None:
    """Stop every loop thread (at interpreter exit, before torch is torn down under them)."""
    for scheduler in list(_RUNNING):
        scheduler.close(timeout_s=2.0)


atexit.register(close_all)
