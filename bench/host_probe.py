"""What the host costs the batched decode loop (bench.batched --host-variants): garbage collections and GPU idle time
between steps, measured during a run, and host settings to try for the A/B in the same process.

StepProbe, installed around one bench phase:
  gc       every collection the interpreter ran (gc.callbacks): count, total and longest pause per generation, and
           the generation-1/2 ones with their start (ms from the phase start) and thread
  gpu      CUDA events around each of the runner's run_step calls (the graph replay): the device's time per step and
           its idle time between one step's end and the next one's start (the host's part of the step cadence).
           The end event is queued when the replay call returns, after the thread has the GIL back: where that takes
           longer than the device's step (the loop reading each step first, many reply threads), the step time
           includes the wait and the idle time misses it; with the runner's overlap the events are exact
  host     the scheduler thread's time in the loop's parts (the runner's decode_step, its run_step call, which
           includes getting the GIL back after the replay, _take_blocks, advance_prefills, and the scheduler's
           deliver): calls, total, median and longest, in ms

Host variants (a context manager each; "default" changes nothing):
  gc-freeze      gc.collect() then gc.freeze() before the phase, gc.unfreeze() after
  gc-off         gc.disable() during the phase, a collection after
  switch-0.5ms   sys.setswitchinterval(0.0005) during the phase (default 5 ms): a thread waiting for the GIL gets it
                 back sooner
  blocks-per-row the paged table written a row at a time when rows cross into new blocks (a tensor and a blocking
                 copy per row, as before 2026-12-07's third session) instead of SlotDecoder.append_blocks' one write
  no-overlap     FastRunner.overlap off: each step's tokens read and delivered before the next step is launched (as
                 before 2026-12-07's third session)
  reply-worker   each scheduled reply read by one of the engine's worker threads, which runs the backend's run() and
                 feeds the streamer, while the reply's thread waits on the streamer's text queue (two threads a reply,
                 as before 2026-12-07's fourth session) instead of the reply's own thread reading the scheduler
  whole-decode   the streamer decodes with transformers' TextStreamer (every id since the last newline decoded again
                 at each token, text held back to the next space; as before 2026-12-07's fourth session) instead of
                 the tokenizers library's incremental DecodeStream
  read-every-token  the engine's stream_chat called without the page's `hold`: the reply's thread wakes for every
                 token (as before 2026-12-07's sixth session) instead of sleeping until the page's next update is due
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch

HOST_VARIANTS = ("default", "gc-freeze", "gc-off", "switch-0.5ms", "blocks-per-row", "no-overlap", "reply-worker",
                 "whole-decode", "read-every-token")


@contextlib.contextmanager
def host_variant(name: str, runner: Any = None, engine: Any = None) -> Iterator[None]:
    """The host as `name` says (the module docstring) for the block; `runner`: the engine's FastRunner
    (blocks-per-row patches its decoder's append_blocks, no-overlap turns its overlap off), or None; `engine`: the
    ChatEngine (reply-worker patches how it reads its scheduled replies)."""
    if "+" in name:  # several at once: "reply-worker+whole-decode" is the reply path before 2026-12-07's fourth session
        with contextlib.ExitStack() as stack:
            for part in name.split("+"):
                stack.enter_context(host_variant(part, runner, engine))
            yield
        return
    if name not in HOST_VARIANTS:
        raise ValueError(f"host variant must be one of {HOST_VARIANTS}, got {name!r}")
    decoder = runner.decoder if runner is not None else None
    if name == "reply-worker" and engine is not None:
        engine._scheduled_texts = _via_worker(engine)
        try:
            yield
        finally:
            del engine._scheduled_texts
    elif name == "whole-decode":
        from llm_core.engine import streamer

        real = streamer.incremental_decoder
        streamer.incremental_decoder = lambda tokenizer: None  # type: ignore[assignment]
        try:
            yield
        finally:
            streamer.incremental_decoder = real  # type: ignore[assignment]
    elif name == "no-overlap" and runner is not None:
        before = runner.overlap
        runner.overlap = False
        try:
            yield
        finally:
            runner.overlap = before
    elif name == "blocks-per-row" and decoder is not None:

        def per_row(grown: Any) -> None:
            for slot, column, ids in grown:
                ids = list(ids)[:max(0, decoder.num_blocks - column)]
                if ids:
                    decoder.table[slot, column:column + len(ids)].copy_(torch.tensor(ids, dtype=torch.int32),
                                                                        non_blocking=False)

        decoder.append_blocks = per_row
        try:
            yield
        finally:
            del decoder.append_blocks
    elif name == "gc-freeze":
        gc.collect()
        gc.freeze()
        try:
            yield
        finally:
            gc.unfreeze()
    elif name == "gc-off":
        gc.disable()
        try:
            yield
        finally:
            gc.enable()
            gc.collect()
    elif name == "read-every-token" and engine is not None:
        stream_chat = engine.stream_chat

        def unheld(*args: Any, **kwargs: Any) -> Any:
            kwargs.pop("hold", None)
            return stream_chat(*args, **kwargs)

        engine.stream_chat = unheld
        try:
            yield
        finally:
            del engine.stream_chat
    elif name == "switch-0.5ms":
        before = sys.getswitchinterval()
        sys.setswitchinterval(0.0005)
        try:
            yield
        finally:
            sys.setswitchinterval(before)
    else:
        yield


def _via_worker(engine: Any) -> Any:
    """ChatEngine._scheduled_texts' stand-in for reply-worker: the backend's run() on one of the engine's worker
    threads feeds the streamer, and this thread iterates the streamer's text queue (its timeout raising queue.Empty)."""

    def texts(backend: Any, prepared: Any, streamer: Any, stop_event: Any, cache: Any, cached: list[int],
              hold: Any = None) -> Iterator[str]:  # hold: not used (the worker feeds every token)
        errors: list[BaseException] = []

        def work() -> None:
            try:
                with torch.inference_mode():
                    cached.append(int(backend.run(prepared, streamer, stop_event, cache) or 0))
            except BaseException as exc:  # noqa: BLE001 - relayed below
                errors.append(exc)
                streamer.end()

        done = engine._workers.submit(work)
        try:
            yield from streamer
        finally:
            done.wait(30.0)
        if errors:
            raise errors[0]

    return texts


class StepProbe:
    """Collections, the scheduler thread's time per part of the loop and the device's step and idle times during a
    `with` block (see the module docstring). `runner`: the engine's FastRunner, whose methods (and its decoder's
    run_step) are wrapped for the block, or None (collections only)."""

    def __init__(self, runner: Any = None) -> None:
        self.runner = runner
        self.host: dict[str, list[float]] = {}
        self._wrapped: list[tuple[Any, str]] = []
        self.t0 = 0.0
        self._starts: dict[int, float] = {}
        self.collections: list[tuple[int, float, float, str]] = []  # generation, start (s), pause (s), thread
        self.events: list[tuple[Any, Any]] = []
        self._lock = threading.Lock()

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        now = time.perf_counter()
        ident = threading.get_ident()
        if phase == "start":
            self._starts[ident] = now
            return
        start = self._starts.pop(ident, now)
        with self._lock:
            self.collections.append((int(info["generation"]), start, now - start, threading.current_thread().name))

    def __enter__(self) -> StepProbe:
        self.t0 = time.perf_counter()
        gc.callbacks.append(self._on_gc)
        runner = self.runner
        if runner is None:
            return self
        decoder = runner.decoder
        if torch.cuda.is_available():
            run_step = decoder.run_step

            def with_events(bucket: int, longest: int) -> None:
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record()
                run_step(bucket, longest)
                end.record()
                self.events.append((begin, end))

            decoder.run_step = with_events
            self._wrapped.append((decoder, "run_step"))
        for owner, name in ((runner, "decode_step"), (runner, "_take_blocks"), (runner, "advance_prefills"),
                            (runner.host, "deliver"), (decoder, "run_step")):
            self._time(owner, name)
        return self

    def _time(self, owner: Any, name: str) -> None:
        inner = getattr(owner, name)
        times = self.host.setdefault(name, [])

        def timed(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                times.append(time.perf_counter() - t)

        setattr(owner, name, timed)
        self._wrapped.append((owner, name))

    def __exit__(self, *exc: Any) -> None:
        gc.callbacks.remove(self._on_gc)
        for owner, name in reversed(self._wrapped):
            if name in vars(owner):
                delattr(owner, name)

    def summary(self) -> dict[str, Any]:
        by_gen: dict[int, list[float]] = {}
        for gen, _, pause, _ in self.collections:
            by_gen.setdefault(gen, []).append(pause)
        out: dict[str, Any] = {
            "gc": {str(g): {"count": len(p), "total_ms": round(sum(p) * 1e3, 2), "max_ms": round(max(p) * 1e3, 2)}
                   for g, p in sorted(by_gen.items())},
            "gc_older": [{"gen": g, "start_ms": round((s - self.t0) * 1e3, 1), "ms": round(p * 1e3, 2), "thread": t}
                         for g, s, p, t in self.collections if g >= 1][:60],
            "python": sys.version.split()[0],
            "host": {name: {"calls": len(t), "total_ms": round(sum(t) * 1e3, 1),
                            "median_ms": round(statistics.median(t) * 1e3, 3), "max_ms": round(max(t) * 1e3, 2)}
                     for name, t in self.host.items() if t}}
        if self.events:
            torch.cuda.synchronize()
            steps = [b.elapsed_time(e) for b, e in self.events]
            idle = [e0.elapsed_time(b1) for (_, e0), (b1, _) in zip(self.events, self.events[1:], strict=False)]
            out["gpu"] = {"steps": len(steps), "step_ms_median": round(statistics.median(steps), 3),
                          "idle_ms_median": round(statistics.median(idle), 3) if idle else None,
                          "idle_ms_total": round(sum(idle), 1), "busy_ms_total": round(sum(steps), 1),
                          "idle_over_5ms": [round(i, 1) for i in idle if i > 5.0][:40]}
        return out
