"""Admission: how many replies may be in an engine at once, per-person limits and fair turns. Knows nothing about
models, tokens or Gradio."""

from __future__ import annotations

import collections
import contextlib
import itertools
import threading
import time
from collections.abc import Callable, Iterator

from ..errors import BusyError


class _Ticket:
    """One request's place among a ReplySlots' waiting requests."""

    def __init__(self, slots: ReplySlots, session_id: str, arrival: int, cancel: threading.Event | None,
                 group: str | None = None) -> None:
        self.slots, self.session_id, self.arrival, self.cancel = slots, session_id, arrival, cancel
        self.group = group  # replies of one group (the n choices of one API request) count as one request
        self.ready = False  # waiting for a slot (False while the request is still being tokenized)
        self.running = False

    def wait(self, on_wait: Callable[[int], None] | None = None) -> None:
        """Block until this request's fair turn, then hold a slot. Raises ReplyStopped if Stop comes first.
        `on_wait(ahead)` is called whenever the number of requests that go before this one changes."""
        self.slots._wait_turn(self, on_wait)


class SessionSlots:
    """At most one running reply per person (or session), none waiting: what a remote engine (llm_core.engine.remote)
    allows each; a second request while one runs is refused with BusyError (HTTP 429 on the /v1 API)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._busy: set[str] = set()

    @contextlib.contextmanager
    def hold(self, session_id: str) -> Iterator[None]:
        with self._lock:
            if session_id in self._busy:
                raise BusyError("A reply is already being written in this session. Wait for it to finish or "
                                "press Stop, then send again.")
            self._busy.add(session_id)
        try:
            yield
        finally:
            with self._lock:
                self._busy.discard(session_id)

    def busy(self, session_id: str) -> bool:
        with self._lock:
            return session_id in self._busy


class ReplySlots:
    """How many replies may be in the engine at once, and who gets the next free one.

    `with slots:` takes one of `n` slots (n = 1 is a plain lock: the serial engine); `with slots.exclusive():` waits
    until no reply runs and keeps new ones out (e.g. to unload). `with slots.ticket(person, cancel) as t:` is how a
    chat request enters: at most one running and `session_max_waiting` waiting requests per person (the key
    llm_core.security.person_of gives: a login, or an address without AUTH; more are refused at once with
    BusyError); `t.wait()` takes a slot when it is this request's turn: the waiting request of the person served
    least recently goes first, so a person who floods the engine, from any number of tabs or clients, delays
    another by at most one reply per slot. A set `cancel` event (Stop) ends the wait with ReplyStopped.
    `slots.ticket(person, cancel, group)`: the tickets of one group are one request of the person (counted once
    against the limit); once one of them runs, the others run beside it as slots free up, ahead of other waiting
    requests, each in a slot of its own (so a group larger than the free slots never waits for itself)."""

    def __init__(self, n: int = 1, *, session_max_waiting: int = 1) -> None:
        self.n = int(n)
        self.session_max_waiting = int(session_max_waiting)
        self._cond = threading.Condition()
        self._free = self.n
        self._exclusive_waiting = 0
        self._running: collections.Counter[str] = collections.Counter()  # running replies per session
        self._running_groups: collections.Counter[tuple[str, str]] = collections.Counter()  # per (session, group)
        self._held_requests: collections.Counter[tuple[str, object]] = collections.Counter()  # tickets per request
        self._waiting: list[_Ticket] = []
        self._last_start: dict[str, int] = {}  # session -> number of its latest start (sessions with tickets only)
        self._starts = itertools.count()
        self._arrivals = itertools.count()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        deadline = None if timeout is None or timeout < 0 else time.monotonic() + timeout
        with self._cond:
            while self._free == 0 or self._exclusive_waiting:
                if not blocking:
                    return False
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
            self._free -= 1
            return True

    def release(self) -> None:
        with self._cond:
            self._free += 1
            self._cond.notify_all()

    def locked(self) -> bool:
        with self._cond:
            return self._free == 0

    def __enter__(self) -> ReplySlots:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._cond:
            self._exclusive_waiting += 1
            try:
                while self._free < self.n:
                    self._cond.wait()
                self._free = 0
            finally:
                self._exclusive_waiting -= 1
        try:
            yield
        finally:
            with self._cond:
                self._free = self.n
                self._cond.notify_all()

    # --- per-session admission and fair turns ---------------------------------------------------------------------
    def waiting(self, session_id: str | None = None) -> int:
        """Requests waiting for a slot (of one session, or of all)."""
        with self._cond:
            return sum(1 for t in self._waiting if session_id is None or t.session_id == session_id)

    @contextlib.contextmanager
    def ticket(self, session_id: str, cancel: threading.Event | None = None, group: str | None = None
               ) -> Iterator[_Ticket]:
        with self._cond:
            ticket = _Ticket(self, session_id, next(self._arrivals), cancel, group)
            request = (session_id, group if group is not None else ticket)
            held = sum(1 for key in self._held_requests if key[0] == session_id)
            if not self._held_requests[request] and held >= 1 + self.session_max_waiting:
                raise BusyError(
                    "This user already has a reply being written" + (
                        f" and {held - 1} waiting" if held > 1 else "") + " (the limit per user is "
                    f"{1 + self.session_max_waiting}, across tabs and API clients). Wait for it to finish or press "
                    "Stop, then send again.", retry_after_s=1)
            self._held_requests[request] += 1
            self._waiting.append(ticket)
        try:
            yield ticket
        finally:
            with self._cond:
                self._held_requests[request] -= 1
                if self._held_requests[request] <= 0:
                    del self._held_requests[request]
                if ticket in self._waiting:
                    self._waiting.remove(ticket)
                if ticket.running:
                    self._free += 1
                    self._running[session_id] -= 1
                    if self._running[session_id] <= 0:
                        del self._running[session_id]
                    if group is not None:
                        self._running_groups[(session_id, group)] -= 1
                        if self._running_groups[(session_id, group)] <= 0:
                            del self._running_groups[(session_id, group)]
                if not self._running[session_id] and not any(t.session_id == session_id for t in self._waiting):
                    self._running.pop(session_id, None)
                    self._last_start.pop(session_id, None)
                self._cond.notify_all()

    def _wait_turn(self, ticket: _Ticket, on_wait: Callable[[int], None] | None = None) -> None:
        from ..errors import ReplyStopped

        shown = -1
        with self._cond:
            ticket.ready = True
            self._cond.notify_all()
            while not self._is_next(ticket):
                if ticket.cancel is not None and ticket.cancel.is_set():
                    raise ReplyStopped("Stopped before it started: the request was still waiting for its turn, so "
                                       "nothing was generated. The conversation is unchanged.")
                ahead = self._ahead(ticket)
                if on_wait is not None and ahead != shown:
                    shown = ahead
                    on_wait(ahead)
                self._cond.wait(0.05 if ticket.cancel is not None or on_wait else None)  # Stop sets an Event
            self._waiting.remove(ticket)
            ticket.running = True
            self._free -= 1
            self._running[ticket.session_id] += 1
            if ticket.group is not None:
                self._running_groups[(ticket.session_id, ticket.group)] += 1
            self._last_start[ticket.session_id] = next(self._starts)
            self._cond.notify_all()

    def _joins_running_group(self, t: _Ticket) -> bool:
        """Whether `t` belongs to a group of which a reply runs, and everything its person runs is of that group."""
        running = self._running_groups[(t.session_id, t.group)] if t.group is not None else 0
        return running > 0 and running == self._running[t.session_id]

    def _key(self, t: _Ticket) -> tuple[int, int]:
        """Turn order: the person served least recently first; a running group's other replies before anyone."""
        return (-2 if self._joins_running_group(t) else self._last_start.get(t.session_id, -1)), t.arrival

    def _ahead(self, ticket: _Ticket) -> int:
        """Requests that will take a slot before `ticket`: the replies running now count as one ahead per slot
        when all slots are busy, then waiting requests that go first."""
        mine = self._key(ticket)
        before = sum(1 for t in self._waiting if t is not ticket and t.ready and self._key(t) < mine)
        busy = self._running[ticket.session_id] and not self._joins_running_group(ticket)
        return before + (1 if self._free <= 0 or busy else 0)

    def _is_next(self, ticket: _Ticket) -> bool:
        if self._free <= 0 or self._exclusive_waiting:
            return False
        eligible = [t for t in self._waiting if t.ready and (not self._running[t.session_id]
                                                              or self._joins_running_group(t))]
        if not eligible:
            return False
        return min(eligible, key=self._key) is ticket
