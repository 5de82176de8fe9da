"""One /v1 request's replies (its `Job`s): run as rows, then returned whole or as OpenAI's server-sent events.
No routes here (llm_core.web.openai_api has them).

`Rows` runs the replies on threads of their own: one thread (one reply after another) where the engine serves one
reply at a time, else as many as the engine batches, so the n choices of a request decode as rows of one batch. The
rows form one admission group: they count as one request of the person, and a row waits only for a free slot, never
for another row of its request (so n larger than the free slots cannot deadlock). Each row has its own request id, so
a stop sequence halts its row alone.
"""

from __future__ import annotations

import asyncio
import collections
import json
import queue
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from fastapi.concurrency import run_in_threadpool

from ..config import HISTORY_TURNS_RANGE
from ..engine.backend import ChatBackend
from ..engine.chat import ReplyUpdate
from ..errors import LLMCoreError
from ..streams import MAX_HOLD_S
from .openai_calls import ToolCallStream
from .openai_jobs import Job, Plan, chat_choice, text_choice, usage
from .openai_tools import chat_logprobs, completion_logprobs

FINISH_REASONS = {"eos": "stop", "length": "length", "stopped": "stop"}  # ReplyStats.finish_reason -> OpenAI's
DescribeError = Callable[[LLMCoreError], tuple[int, str, str | None]]


def error_body(message: str, type_: str, code: str | None = None, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class StopScanner:
    """Cuts streamed text at the first stop sequence; holds back the tail that could still become one."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1

    def cut(self, text: str) -> int | None:
        """Index where the first stop sequence starts in `text`, or None."""
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        return min(hits) if hits else None

    def safe_length(self, text: str) -> int:
        """How much of `text` may be sent now: nothing that could be the start of a stop sequence."""
        return max(0, len(text) - self.hold) if self.stops else len(text)


def row_width(engine: ChatBackend, jobs: int) -> int:
    """Replies of one request run at once: as many as a local engine batches (1 when it serves one at a time); a
    remote engine takes one reply per person at a time."""
    if getattr(engine, "loaded", None) is None:
        return 1
    return max(1, min(jobs, int(engine.max_concurrent_replies)))


def row_hold(stream: bool, stops: StopScanner) -> Callable[[], float] | None:
    """How long a row's thread may sleep between two reads of its reply (ChatEngine.stream_chat's `hold`). A whole
    response without stop sequences has nothing to look at before the reply ends, so its row reads the reply at most
    once a MAX_HOLD_S (the end wakes it at once) instead of once a token: fewer wakes taking the GIL from the
    decoder's thread, the same response. A stream, or stop sequences to look for, read every token."""
    if stream or stops.stops:
        return None
    return lambda: MAX_HOLD_S


class Rows:
    """A request's replies running on `width` threads; their updates in arrival order through `get()`. `hold`: what
    each row passes to stream_chat (row_hold)."""

    def __init__(self, engine: ChatBackend, jobs: list[Job], session: str, person: str, width: int,
                 hold: Callable[[], float] | None = None) -> None:
        self.engine, self.session, self.person, self.hold = engine, session, person, hold
        self._jobs = jobs
        self._todo = collections.deque(jobs)
        self._events: queue.SimpleQueue[tuple[Job, ReplyUpdate | None, BaseException | None]] = queue.SimpleQueue()
        self._cancelled = threading.Event()
        for k in range(width):
            threading.Thread(target=self._work, name=f"openai-rows-{k}", daemon=True).start()

    def row_id(self, job: Job) -> str:
        """What Stop names for one row."""
        return f"{self.session}/{job.index}"

    def _work(self) -> None:
        while not self._cancelled.is_set():
            try:
                job = self._todo.popleft()
            except IndexError:
                return
            stream: Iterator[ReplyUpdate] | None = None
            try:
                # The client sends what it wants in context: keep every turn the budget allows (drops are noted).
                stream = self.engine.stream_chat(job.message, job.turns, gen=job.gen,
                                                 history_turns=HISTORY_TURNS_RANGE[1], system_prompt=job.system_prompt,
                                                 request_id=self.row_id(job), person=self.person, raw_prompt=job.raw,
                                                 render_prompt=job.render, group=self.session, hold=self.hold)
                for update in stream:
                    self._events.put((job, update, None))
                    if self._cancelled.is_set():
                        self.engine.stop(self.row_id(job))  # halts the decode loop; the final update still comes
            except BaseException as exc:  # noqa: BLE001 - relayed to the request's reader by get()
                self._events.put((job, None, exc))
            finally:
                close = getattr(stream, "close", None)
                if close is not None:
                    close()  # the engine's clean-up: the row's slot is free for the next one

    def get(self) -> tuple[Job, ReplyUpdate]:
        """The next update of any row (blocks); a row's error is raised here."""
        job, update, error = self._events.get()
        if error is not None:
            raise error
        assert update is not None
        return job, update

    def stop(self, job: Job) -> None:
        self.engine.stop(self.row_id(job))

    def cancel(self) -> None:
        """Client gone or an error: rows not started never start, running ones halt."""
        self._cancelled.set()
        for job in self._jobs:
            self.engine.stop(self.row_id(job))


def _sse(data: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n".encode()


@dataclass
class _Choice:
    """One choice's streaming state: what was sent, where a stop sequence cut it, its tool-call reader."""

    job: Job
    sent: int = 0
    logged: int = 0
    cut: int | None = None
    started: bool = False
    calls: ToolCallStream | None = None


@dataclass
class Reply:
    """One request's choices, as a whole response or as server-sent events."""

    rows: Rows
    plan: Plan
    stops: StopScanner
    describe_error: DescribeError
    model_id: str
    text: bool  # /v1/completions (else chat)
    id: str
    created: int
    _choices: dict[int, _Choice] = field(default_factory=dict)

    def _final_text(self, final: ReplyUpdate) -> tuple[str, str]:
        cut = self.stops.cut(final.text)
        if cut is not None:
            return final.text[:cut], "stop"
        return final.text, FINISH_REASONS.get(final.stats.finish_reason, "stop")

    def whole(self, first: tuple[Job, ReplyUpdate]) -> dict[str, Any]:
        """Every row run to its end (a row stopped at its stop sequence); the response body."""
        finals: dict[int, ReplyUpdate] = {}
        stopped: set[int] = set()
        job, update = first
        try:
            while True:
                if update.done:
                    finals[job.index] = update
                    if len(finals) == len(self.plan.jobs):
                        break
                elif job.index not in stopped and self.stops.cut(update.text) is not None:
                    self.rows.stop(job)  # the engine still yields the row's final numbers
                    stopped.add(job.index)
                job, update = self.rows.get()
        except BaseException:
            self.rows.cancel()
            raise
        ordered = [finals[j.index] for j in self.plan.jobs]
        choices = []
        for job, final in zip(self.plan.jobs, ordered, strict=True):
            text, reason = self._final_text(final)
            choice = (text_choice if self.text else chat_choice)(self.plan, job, text, reason)
            if len(self.plan.jobs) > 1:
                choice["stats"] = final.stats.as_dict()
            choices.append(choice)
        return {"id": self.id, "object": "text_completion" if self.text else "chat.completion",
                "created": self.created, "model": self.model_id, "choices": choices, "usage": usage(ordered),
                "stats": ordered[0].stats.as_dict()}

    def _chunk(self, index: int, delta: dict[str, Any], finish: str | None = None, logprobs: Any = None,
               **extra: Any) -> bytes:
        if self.text:
            choice: dict[str, Any] = {"index": index, "text": delta.get("content", ""), "finish_reason": finish,
                                      "logprobs": logprobs}
        else:
            choice = {"index": index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
        return _sse({"id": self.id, "object": "text_completion" if self.text else "chat.completion.chunk",
                     "created": self.created, "model": self.model_id, "choices": [choice], **extra})

    def _logprobs(self, state: _Choice) -> Any:
        """The logprobs of the tokens made since the last chunk that carried some."""
        control = state.job.control
        if not self.plan.logprobs or control is None:
            return None
        entries = control.logprobs[state.logged:]
        if not entries:
            return None
        state.logged += len(entries)
        build = completion_logprobs if self.text else chat_logprobs
        return build(entries, self.plan.tokenizer, self.plan.eos_ids)

    async def events(self, first: tuple[Job, ReplyUpdate], include_usage: bool, leave: Callable[[], None]
                     ) -> AsyncIterator[bytes]:
        """Server-sent events in OpenAI's chunk format, the choices' chunks as their rows make them; each choice's
        last chunk carries its finish_reason and `stats`. Tool calls go out as `tool_calls` deltas: the name first,
        then the arguments in pieces as they are generated; no call markup reaches `content`."""
        finals: dict[int, ReplyUpdate] = {}
        job, update = first
        try:
            while True:
                for chunk in self._step(job, update):
                    yield chunk
                if update.done:
                    finals[job.index] = update
                    if len(finals) == len(self.plan.jobs):
                        break
                job, update = await run_in_threadpool(self.rows.get)
            if include_usage:
                yield _sse({"id": self.id, "object": "text_completion" if self.text else "chat.completion.chunk",
                            "created": self.created, "model": self.model_id, "choices": [],
                            "usage": usage([finals[j.index] for j in self.plan.jobs])})
            yield b"data: [DONE]\n\n"
        except LLMCoreError as exc:  # after the first token the status is sent: the error travels as an event
            status, type_, code = self.describe_error(exc)
            yield _sse(error_body(str(exc), type_, code) | {"status": status})
        finally:
            # Client gone, error or done: rows still running halt and release their slots (on their own threads).
            asyncio.get_running_loop().run_in_executor(None, self.rows.cancel)
            leave()

    def _step(self, job: Job, update: ReplyUpdate) -> list[bytes]:
        """The chunks one update of one choice adds."""
        state = self._choices.get(job.index)
        if state is None:
            calls = ToolCallStream(self.plan.tool_names, self.plan.call_format, self.plan.forced_call) if (
                self.plan.tool_names) else None
            state = self._choices[job.index] = _Choice(job, calls=calls)
        out: list[bytes] = []
        if not state.started and not self.text:
            out.append(self._chunk(job.index, {"role": "assistant", "content": ""}))
        state.started = True
        if state.cut is None:
            state.cut = self.stops.cut(update.text)
            if state.cut is not None:
                self.rows.stop(job)
        end = state.cut if state.cut is not None else (len(update.text) if update.done else
                                                       self.stops.safe_length(update.text))
        if state.calls is not None:
            deltas = [{"tool_calls": [d["tool_call"]]} if "tool_call" in d else d
                      for d in state.calls.feed(update.text[:end], done=update.done)]
        else:
            deltas = [{"content": update.text[state.sent:end]}] if end > state.sent else []
            state.sent = max(state.sent, end)
        for delta in deltas:
            out.append(self._chunk(job.index, delta, logprobs=self._logprobs(state)))
        if update.done:
            reason = "stop" if state.cut is not None else FINISH_REASONS.get(update.stats.finish_reason, "stop")
            if state.calls is not None and state.calls.calling:
                reason = "tool_calls"
            out.append(self._chunk(job.index, {}, reason, logprobs=self._logprobs(state),
                                   stats=update.stats.as_dict()))
        return out
