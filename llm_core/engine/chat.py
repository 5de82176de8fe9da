"""The chat engine, the request path only: admit -> prepare (history -> budget -> ids) -> submit -> stream -> stats.
Knows nothing about Gradio.

What serves the replies is a DecodePath that start-up returned (llm_core.engine.startup: select, warm up, size by
measurement, fall back); ChatEngine holds it as `path` and swaps it whole (a re-plan of the fast path's cache is a new
path). The runners behind DecodeBackend are llm_core.engine.runners.

A reply of the one scheduler (the batched fast path, the eager batch, the CPU path: serving.ScheduledBackend) is a
row of its loop: the caller's own thread queues it and reads its token ids from the scheduler, and a streamer
(`streamer.TimedStreamer`, incremental decoding) stamps them and turns them into text. The single-reply backends (plain
`generate`, the fast path's single loop) run on one of the engine's long-lived worker threads feeding that streamer,
with a timeout; the caller iterates text updates. Stop sets a per-request event (the scheduler drops the row; a
stopping criterion halts `generate`). A reply's error is re-raised in the caller as a GenerationError
(OutOfMemoryError after freeing memory); no token within `stream_timeout_s` stops the reply with an error. Nothing can
wait forever.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from ..config import GenerationSettings, Settings, canonical_kv_cache
from ..errors import (
    GenerationError,
    InputError,
    LLMCoreError,
    OutOfMemoryError,
    SettingsError,
)
from ..history import Turn, build_messages, clean_text, clean_turns, fit_history
from ..loading import Progress, load_model
from ..memory.budget import ReplyPlan, max_context_tokens, plan_reply, refit_reserve, require_fit
from ..memory.device import OOMInjector, PeakMeter, cached_free_bytes, free_memory, is_oom_error
from ..memory.kv_cache import cache_bytes, make_cache
from ..memory.model import ModelMemoryFacts, human_bytes, predict_peak_bytes
from ..metrics import ReplyStats, TokenClock
from ..streams import TokenTimeout
from ..types import LoadedModel
from .admission import ReplySlots
from .runners import DecodeBackend, PreparedPrompt
from .scheduler import Scheduler
from .serving import RowKV, ScheduledBackend
from .startup import (
    DecodePath,
    PathBuilder,
    memory_budget_for,
    replan,
    select_decode_path,
    warm_decode_path,
)
from .streamer import TimedStreamer

if TYPE_CHECKING:
    from .eager_runner import EagerRunner
    from .fast_runner import FastRunner

log = logging.getLogger(__name__)

# A request's own prompt rendering: the message list history fitting built -> {"input_ids", "attention_mask"}.
RenderPrompt = Callable[[list[dict[str, str]]], Any]
# How long the caller waits for the worker to wind down after a stop or an error.
_JOIN_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class ReplyUpdate:
    """One step of a streamed reply: the text so far and the numbers so far (final when done is True)."""

    text: str
    stats: ReplyStats
    done: bool = False
    token_ids: tuple[int, ...] = ()  # the generated ids, on the final update only


class WorkerThreads:
    """Long-lived daemon threads that run generation work, one reply each at a time. Threads are kept rather than
    started per reply because CUDA libraries keep per-thread state (cuBLAS handles and workspaces, the current
    device) that a fresh thread sets up again before its first token. Started on first use. Not a
    ThreadPoolExecutor: its threads are joined at interpreter exit, so one stalled reply would block shutdown; these
    are daemon threads, and `running` counts busy ones for the UI."""

    def __init__(self, size: int, name: str = "generate") -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._size, self._name = size, name
        self._threads: list[threading.Thread] = []
        self._start_lock = threading.Lock()
        self._running = 0

    @property
    def running(self) -> int:
        """Jobs running now (idle threads don't count)."""
        with self._start_lock:
            return self._running

    def grow(self, size: int) -> None:
        with self._start_lock:
            self._size = max(self._size, size)

    @contextlib.contextmanager
    def occupied(self) -> Iterator[None]:
        """Count a reply that runs on its caller's thread among the running jobs (`running`: what the UI shows)."""
        with self._start_lock:
            self._running += 1
        try:
            yield
        finally:
            with self._start_lock:
                self._running -= 1

    def submit(self, fn: Callable[[], None]) -> threading.Event:
        """Run fn on a worker thread; the returned event is set when it has returned (or raised)."""
        done = threading.Event()

        def job() -> None:
            with self._start_lock:
                self._running += 1
            try:
                fn()
            finally:
                with self._start_lock:
                    self._running -= 1
                done.set()

        with self._start_lock:
            while len(self._threads) < self._size:
                t = threading.Thread(target=self._loop, name=f"{self._name}-{len(self._threads)}", daemon=True)
                t.start()
                self._threads.append(t)
        self._jobs.put(job)
        return done

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                job()
            except Exception:  # noqa: BLE001 - jobs relay their own errors to the caller; the thread must live on
                logging.getLogger(__name__).exception("generation worker job failed")
            finally:  # a finished job's closure holds its reply's engine, model, KV cache and prompt: while this
                del job  # thread waits for the next one, that must not keep an unloaded model's memory alive


class ChatEngine:
    """Holds one loaded model for the life of the process and serves streamed chat replies from its DecodePath."""

    path: DecodePath  # what start-up chose (llm_core.engine.startup); replaced whole, never piece by piece
    memory_facts: ModelMemoryFacts  # the path's facts, then the allocator's reserve each reply teaches (refit_reserve)

    def __init__(self, loaded: LoadedModel, settings: Settings) -> None:
        self.loaded = loaded
        self.settings = settings
        # Replies in the engine at once: 1 (serial), or what the path serves at once (MAX_BATCH_SIZE, the fast path's
        # slots); per session one running and SESSION_MAX_WAITING waiting, served least-recently-served session first.
        self._lock = ReplySlots(1, session_max_waiting=settings.server.session_max_waiting)
        self._workers = WorkerThreads(1)
        self._path_lock = threading.RLock()  # a re-plan and its swap; the memory facts a reply refits
        self._tokenizer_lock = threading.Lock()
        self._fit_lock = threading.Lock()
        self._fit_cache: dict[tuple[ModelMemoryFacts, int, int, str, int | None], int] = {}
        self._stops: dict[str, list[threading.Event]] = {}  # session -> stop events of its running/waiting requests
        self._stops_lock = threading.Lock()
        self.oom_injector = OOMInjector()  # tests arm it to prove OOM recovery; never fires otherwise
        self.memory_budget = memory_budget_for(loaded, settings)
        self._reply_s_ema: float | None = None  # seconds a reply takes end to end, averaged (for wait estimates)
        # what serves, planned from arithmetic; warmup() warms, measures and may replace it
        self._adopt(select_decode_path(loaded, settings, self.memory_budget,
                                       lambda point: self.oom_injector.check(point)))

    # --- construction --------------------------------------------------------------------------
    @classmethod
    def load(cls, settings: Settings, progress: Progress | None = None, *, warmup: bool = True) -> ChatEngine:
        from ..fit import check_weights_fit

        check_weights_fit(settings)  # weights that cannot fit the budget: said before anything is loaded
        engine = cls(load_model(settings.model, progress), settings)
        if warmup:
            engine.warmup(progress)
        return engine

    def warmup(self, progress: Progress | None = None) -> float:
        """Run once at start-up (never per request): llm_core.engine.startup.warm_decode_path warms the path up
        (kernel repacking, compile, graphs), sizes its KV cache and falls back where it does not fit; the path it
        returns serves from then on. Returns the seconds it took (also in the load report)."""
        say = progress or (lambda _m: None)
        say(f"Warming up ({self.backend.name} decode path)…")
        t0 = time.perf_counter()
        self._adopt(warm_decode_path(self.path, self.loaded, self.settings, self.memory_budget, self.memory_facts,
                                     self._warm_reply, say))
        warmup_s = time.perf_counter() - t0
        self.loaded.report = replace(self.loaded.report, warmup_s=round(warmup_s, 3))
        self._report_path()
        say(f"Ready ({warmup_s:.1f} s warm-up).")
        return warmup_s

    def _report_path(self) -> None:
        """The Model panel's view of the path serving now: after warm-up, and again after a re-plan."""
        path = self.path
        self.loaded.report = replace(self.loaded.report, decode_path=path.name, decode_path_reason=path.reason,
                                     memory_plan=self.memory_plan, startup_notes=path.startup_notes)

    def _warm_reply(self, path: DecodePath) -> tuple[DecodePath, ModelMemoryFacts]:
        """warm_decode_path's reply: two greedy tokens on `path`, through the whole request path; the path and the
        memory facts as the reply left them."""
        self._adopt(path)
        gen = replace(self.settings.generation, max_new_tokens=2, do_sample=False)
        for _ in self.stream_chat("Hi", [], gen=gen, history_turns=0, system_prompt=None):
            pass
        return self.path, self.memory_facts

    def _adopt(self, path: DecodePath) -> None:
        """Serve from `path` (what start-up or a re-plan returned): one swap under the path lock; the engine's memory
        facts start over from the path's, and the reply slots follow the replies it serves at once."""
        with self._path_lock:
            if path.replies != self._lock.n:  # only at start-up: no reply holds a slot yet
                self._lock = ReplySlots(path.replies, session_max_waiting=self.settings.server.session_max_waiting)
                self._workers.grow(path.replies)
            self.path = path
            self.memory_facts = path.facts

    def _replan(self, step: Callable[[PathBuilder], object]) -> None:
        """A start-up step (a startup.PathBuilder method) run again on the path as it is, with the memory facts as
        they are now; the path it leaves is swapped in whole."""
        with self._path_lock:
            self._adopt(replan(self.path, self.loaded, self.settings, self.memory_budget, self.memory_facts, step))
            self._report_path()

    def _refit_fast_cache(self, max_new_tokens: int) -> None:
        """The one re-plan after start-up: the reserve learned from replies may ask for a smaller static cache
        (PathBuilder.fit_fast_cache: a recapture, never a compile). A comparison when nothing changed."""
        with self._path_lock:
            path = self.path
            if path.fast_decoder is None or path.fitted_for == (self.memory_facts, max_new_tokens):
                return
            self._replan(lambda builder: builder.fit_fast_cache(max_new_tokens))

    # --- what start-up chose (read-only views of the path) ----------------------------------------------------------
    @property
    def backend(self) -> DecodeBackend:
        """What serves the replies of the default KV mode (the path's)."""
        return self.path.backend

    @property
    def scheduler(self) -> Scheduler[EagerRunner] | None:
        """The batch scheduler when transformers' forward batches the replies, else None."""
        return self.path.scheduler

    @property
    def fast_scheduler(self) -> Scheduler[FastRunner] | None:
        """The batch scheduler when the fast path batches the replies, else None."""
        return self.path.fast_scheduler

    @property
    def kv_cache_reason(self) -> str:
        """One sentence for the Model panel: which KV cache replies get by default, and why."""
        return self.path.kv_cache_reason

    @property
    def kv_cache(self) -> str:
        """The KV cache a reply asking for auto gets: the fast path's, else bf16 where KV_CACHE=auto."""
        return self.path.kv_cache

    @property
    def memory_plan(self) -> str:
        """One line for the Model panel: the memory budget and where it comes from, the fast path's KV cache (and
        whether start-up measured it), and how long prompts are prefilled."""
        path = self.path
        parts = [f"budget {human_bytes(self.memory_budget.budget_bytes)} ({self.memory_budget.source})"]
        decoder = getattr(path.backend, "decoder", None)
        slots = path.fast_scheduler.runner.decoder if path.fast_scheduler is not None else None
        if slots is not None:
            parts.append(f"{slots.slots} KV slots of {slots.slot_tokens:,} tokens")
        elif decoder is not None and getattr(decoder, "max_cache_len", None):
            parts.append(f"KV cache {int(decoder.max_cache_len):,} tokens")
        if path.profile:
            parts[-1] += f", sized by measurement (peak {human_bytes(path.profile['peak_need_bytes'])})"
        chunk = path.prefill_chunk_tokens
        parts.append(f"long prompts prefilled in {chunk:,}-token chunks" if chunk else "prompts prefilled in one pass")
        return "; ".join(parts) + ". " + path.kv_cache_reason

    @property
    def prefill_chunk_tokens(self) -> int | None:
        """Long prompts are prefilled in chunks of this many tokens (None: in one pass): PREFILL_CHUNK_TOKENS, or
        what auto resolved it to for this model, card and KV mode."""
        return self.path.prefill_chunk_tokens

    @property
    def fast_memory_profile(self) -> dict[str, int] | None:
        """CUDA fast path: the start-up measurement that sized its KV cache (peak reserved/allocated bytes of the
        worst reply the cache allows, and its tokens); None elsewhere (the plan's arithmetic is the bound there)."""
        profile = self.path.profile
        return dict(profile) if profile else None

    @property
    def fast_decoder(self) -> Any | None:
        """The llm_core.fast FastDecoder when the fast path serves replies, else None."""
        return self.path.fast_decoder

    @property
    def context_limit(self) -> int:
        """Tokens one reply (prompt + new tokens) may span: the model's context, or the fast path's cache."""
        decoder = getattr(self.backend, "decoder", None)  # the fast or CPU path's static cache
        if decoder is not None:
            return min(self.loaded.context_length, int(decoder.max_cache_len))
        return self.loaded.context_length

    @property
    def generating(self) -> int:
        """Replies whose generation work is still running on a worker thread."""
        return self._workers.running

    def waiting(self, session_id: str | None = None) -> int:
        """Requests admitted and waiting for their turn (of one session, or of all)."""
        return self._lock.waiting(session_id)

    def wait_estimate_s(self, ahead: int) -> float | None:
        """About how long a request with `ahead` requests before it waits for its turn: the measured reply time
        (an average of the last replies' end-to-end seconds) per round of max_concurrent_replies. None before any
        reply was measured."""
        if self._reply_s_ema is None or ahead <= 0:
            return None if self._reply_s_ema is None else 0.0
        rounds = -(-int(ahead) // max(1, self.max_concurrent_replies))
        return rounds * self._reply_s_ema

    @property
    def max_concurrent_replies(self) -> int:
        """Replies served at once (the batch size when batching, else 1): the UI's queue concurrency."""
        return self._lock.n

    @property
    def report(self) -> Any:
        return self.loaded.report

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """Hold the engine with no reply running (e.g. to unload it)."""
        with self._lock.exclusive():
            yield

    def close(self) -> None:
        """Stop the scheduler loops: a loop's thread holds its runner (the packed weights, the KV slots or pool, the
        CUDA graphs, the CPU path's decoder), so an engine dropped with its loop running keeps all of that alive and
        a second model loaded after it runs out of memory. Requests still queued end with an error. Idempotent;
        EnginePool.unload calls it, and so should anyone who drops an engine and goes on in the same process."""
        for scheduler in self.path.loops:
            scheduler.close()

    # --- requests ------------------------------------------------------------------------------
    def request_options(self, **options: Any) -> GenerationSettings:
        """Per-request generation options on top of the configured defaults, validated (InputError if bad)."""
        unknown = set(options) - set(GenerationSettings.__dataclass_fields__)
        if unknown:
            raise InputError(f"Unknown generation option(s): {', '.join(sorted(unknown))}.")
        clean = {k: v for k, v in options.items() if v is not None}
        for key in ("max_new_tokens", "min_new_tokens", "top_k", "seed"):
            value = clean.get(key)
            if isinstance(value, float) and value.is_integer():
                clean[key] = int(value)
            elif value is not None and not isinstance(value, int) or isinstance(value, bool):
                raise InputError(f"{key} must be a whole number, got {value!r}.")
        for key in ("temperature", "top_p", "repetition_penalty"):
            if key in clean and (isinstance(clean[key], bool) or not isinstance(clean[key], (int, float))):
                raise InputError(f"{key} must be a number, got {clean[key]!r}.")
        if "do_sample" in clean and not isinstance(clean["do_sample"], bool):
            raise InputError(f"do_sample must be true or false, got {clean['do_sample']!r}.")
        try:
            if "kv_cache" in clean:  # an old alias (dynamic, quantized) named as its mode
                clean["kv_cache"] = canonical_kv_cache(clean["kv_cache"], "kv_cache")
            return replace(self.settings.generation, **clean).validate()
        except SettingsError as exc:
            raise InputError(str(exc).replace("MAX_NEW_TOKENS", "max_new_tokens")) from None

    def count_tokens(self, messages: list[dict[str, str]]) -> int:
        return int(self._encode(messages)["input_ids"].shape[-1])

    def encode_messages(self, messages: list[dict[str, str]]) -> Any:
        """The chat template applied and tokenized, as a reply's prompt is (input_ids, attention_mask)."""
        return self._encode(messages)

    def _encode(self, messages: list[dict[str, str]], memo: dict[Any, Any] | None = None, raw: bool = False,
                render: RenderPrompt | None = None) -> Any:
        """The chat template applied and tokenized (`render`: the request's own rendering of these messages).
        `memo` is one request's: fitting the history counts the same lists that the prompt is then encoded from (one
        tokenization each, not two). Nothing outlives the request, so a refused prompt's encoding is never kept."""
        key = (raw, *((m["role"], m["content"]) for m in messages))
        encoded = memo.get(key) if memo is not None else None
        if encoded is None:
            with self._tokenizer_lock:  # concurrent requests share one tokenizer (not thread-safe)
                if render is not None:
                    encoded = render(messages)
                elif raw:
                    encoded = self.loaded.tokenizer(messages[-1]["content"], return_tensors="pt")
                else:
                    encoded = self.loaded.tokenizer.apply_chat_template(
                        messages, add_generation_prompt=True, return_dict=True, return_tensors="pt")
            if memo is not None:
                memo[key] = encoded
        return encoded

    def prepare(self, message: str, turns: list[Turn], *, gen: GenerationSettings, history_turns: int,
                system_prompt: str | None, raw_prompt: bool = False,
                render_prompt: RenderPrompt | None = None) -> PreparedPrompt:
        """fit_history + encode_chat: the prompt for this request within the context budget (raw_prompt: the
        message as text to continue, no chat template, no history; render_prompt: see stream_chat)."""
        path = self.path
        kv = path.kv_cache if gen.kv_cache == "auto" else gen.kv_cache
        fast = path.serves_fast(kv)
        measured = fast and path.profile is not None  # the cache is the memory bound (PathBuilder.profile_fast_cache)
        if fast and not measured:  # the reserve learned from earlier replies may ask for a smaller cache: re-plan
            self._refit_fast_cache(self.settings.generation.max_new_tokens)
            path = self.path
        context = self.context_limit if fast else self.loaded.context_length
        budget_tokens = context - gen.max_new_tokens
        if budget_tokens <= 0:
            raise InputError(f"max_new_tokens ({gen.max_new_tokens:,}) leaves no room for a prompt in the "
                             f"{context:,}-token context; lower it.")
        memo: dict[Any, Any] = {}

        def count(messages: list[dict[str, str]]) -> int:
            return int(self._encode(messages, memo, raw_prompt, render_prompt)["input_ids"].shape[-1])

        step = self.settings.chat.history_trim_step
        steps = {"turn_step": max(1, round(history_turns * step)), "token_step": int(budget_tokens * step)}
        fitted = fit_history(system_prompt, turns, message, max_turns=history_turns,
                             budget_tokens=budget_tokens, count_tokens=count, **steps)
        # Memory guard: predict this reply's peak; drop more old turns, then lower max_new_tokens, else refuse.
        self.oom_injector.check("plan")
        chunk = path.prefill_chunk_tokens
        newest_only = count(build_messages(system_prompt, [], message)) if fitted.kept_turns else (
            fitted.prompt_tokens)  # what can never be dropped: system prompt + newest message
        if measured:  # fits the cache, so fits the card: the start-up profile measured the worst such reply
            predicted = predict_peak_bytes(self.memory_facts, fitted.prompt_tokens, gen.max_new_tokens, kv,
                                           prefill_chunk_tokens=chunk)
            # the graph pools' and fragments' bytes are reserved, never allocated: as reserve, so that the panel's
            # predicted allocated peak compares with torch's allocated one
            held = path.held_free_bytes
            predicted = replace(predicted, reserve_bytes=predicted.reserve_bytes + held)
            plan = ReplyPlan(True, fitted.prompt_tokens, gen.max_new_tokens, predicted, "",
                             budget_bytes=self.memory_budget.budget_bytes)
        else:
            plan = require_fit(plan_reply(self.memory_facts, self.memory_budget.budget_bytes, fitted.prompt_tokens,
                                          gen.max_new_tokens, kv, min_prompt_tokens=newest_only,
                                          prefill_chunk_tokens=chunk))
        if plan.trims_prompt:
            fitted = fit_history(system_prompt, turns, message, max_turns=history_turns,
                                 budget_tokens=plan.allowed_prompt_tokens, count_tokens=count, **steps)
        encoded = self._encode(fitted.messages, memo, raw_prompt, render_prompt)
        device = self.loaded.device
        switched = path.switch_note(kv)  # a KV mode the serving path's cache does not hold: said, not silent
        notes = tuple(n for n in (fitted.describe(), plan.message, switched) if n)
        fit_tokens = budget_tokens if measured else self._context_fit(plan.allowed_new_tokens, kv, chunk)
        allowed = plan.allowed_new_tokens
        resolved = replace(gen, max_new_tokens=allowed, min_new_tokens=min(gen.min_new_tokens, allowed))
        return PreparedPrompt(fitted, encoded["input_ids"].to(device), encoded["attention_mask"].to(device),
                              resolved, notes, kv, plan.predicted,
                              min(fit_tokens, budget_tokens))

    def _context_fit(self, max_new_tokens: int, kv_cache: str, chunk: int | None) -> int:
        """The context meter's bound (a bisection over the predictor), memoized: it runs before every first token
        and depends only on these and the engine's fixed budget."""
        facts = self.memory_facts  # replaced (not mutated) when the reserve is refitted after an OOM
        key = (facts, self.memory_budget.budget_bytes, max_new_tokens, kv_cache, chunk)
        with self._fit_lock:
            if key not in self._fit_cache:
                if len(self._fit_cache) > 256:
                    self._fit_cache.clear()
                self._fit_cache[key] = max_context_tokens(facts, key[1], max_new_tokens, kv_cache,
                                                          prefill_chunk_tokens=chunk)
            return self._fit_cache[key]

    def stop(self, request_id: str | None) -> bool:
        """Halt the reply running for `request_id` (e.g. a browser session) and drop its requests still waiting for
        their turn. True if there was one."""
        if request_id is None:
            return False
        with self._stops_lock:
            events = list(self._stops.get(request_id, ()))
        for event in events:
            event.set()
        return bool(events)

    def clean_message(self, message: Any) -> str:
        """The user message as the model gets it: control characters and lone surrogates out, size checked."""
        return clean_text(message, max_chars=self.settings.chat.max_message_chars)

    def stream_chat(self, message: Any, history: list[Turn], *, gen: GenerationSettings | None = None,
                    history_turns: int | None = None, system_prompt: str | None = "",
                    request_id: str | None = None, person: str | None = None,
                    on_wait: Callable[[int], None] | None = None, raw_prompt: bool = False,
                    render_prompt: RenderPrompt | None = None, group: str | None = None,
                    hold: Callable[[], float] | None = None) -> Iterator[ReplyUpdate]:
        """Stream a reply to `message` after `history` (raw_prompt: a continuation of `message` as plain text, no
        chat template, system prompt or history). Yields ReplyUpdate; the last one has done=True.
        `request_id` is what Stop names (a browser session); `person` is whom admission and fair turns count the
        request for (llm_core.security.person_of; unset: the request_id). `render_prompt` replaces the chat template
        for this request: it gets each message list the history fitting tries (system prompt, kept turns, newest
        message) and returns its encoding (input_ids, attention_mask), e.g. with tools. Replies of one `group` (the
        n choices of one API request) count as one request of the person and may run at once. `hold()`: seconds the
        caller has no use for a next update, asked after each (a page that shows a reply every so often: ui.common.
        UpdatePacer.remaining); the reply's thread (a scheduled row's or a worker-fed one's) sleeps meanwhile instead of
        waking for every token, and the next update carries every token since (each still timed at its delivery). The
        last update is never held.

        Order: text cleaned and size-checked (nothing tokenized yet) -> the session admitted (or refused: too many
        of its requests already in) -> the prompt fitted and tokenized, outside the engine's slots -> a fair turn
        (`on_wait(ahead)` told how many requests go first while it waits) -> the reply. Stop while waiting ends it
        with ReplyStopped."""
        start_s = time.perf_counter()
        gen = gen or self.settings.generation
        chat = self.settings.chat
        history_turns = chat.history_turns if history_turns is None else history_turns
        text = self.clean_message(message)
        if system_prompt is not None:
            system_prompt = clean_text(system_prompt, field="system prompt", max_chars=chat.max_system_prompt_chars,
                                       allow_empty=True) or chat.system_prompt
        history = clean_turns(history, max_chars=chat.max_history_chars)
        if isinstance(history_turns, bool) or not isinstance(history_turns, int) or history_turns < 0:
            raise InputError(f"history_turns must be a whole number of 0 or more, got {history_turns!r}.")
        request_id = request_id or uuid.uuid4().hex
        stop_event = threading.Event()
        with self._stops_lock:
            self._stops.setdefault(request_id, []).append(stop_event)
        try:
            with self._lock.ticket(person or request_id, stop_event, group) as ticket:  # refused: the person is full
                try:
                    prepared = self.prepare(text, [] if raw_prompt else history, gen=gen, raw_prompt=raw_prompt,
                                            history_turns=history_turns, system_prompt=None if raw_prompt else
                                            system_prompt, render_prompt=render_prompt)
                except Exception as exc:  # OOM while tokenizing/planning: same recovery as in the worker
                    if not is_oom_error(exc):
                        raise
                    raise self._translate(exc) from exc
                ticket.wait(on_wait)
                yield from self._stream(prepared, stop_event, start_s, hold)
        finally:
            with self._stops_lock:
                events = self._stops.get(request_id, [])
                if stop_event in events:
                    events.remove(stop_event)
                if not events:
                    self._stops.pop(request_id, None)

    def _stream(self, prepared: PreparedPrompt, stop_event: threading.Event, start_s: float,
                hold: Callable[[], float] | None = None) -> Iterator[ReplyUpdate]:
        loaded, gen = self.loaded, prepared.gen
        if gen.control is not None:  # grammar, penalties, logprobs: fresh for this reply's token budget
            gen.control.start(gen.max_new_tokens)
        clock = TokenClock(start_s)
        streamer = TimedStreamer(loaded.tokenizer, clock, gen.stream_timeout_s,
                                  every_token=gen.control is not None and gen.control.spec.json)
        peak = PeakMeter(loaded.device)
        report = loaded.report
        path = self.path
        backend = path.backend_for(prepared.kv_cache)
        plain_prefix = path.plain_prefix
        stats = ReplyStats(
            model=report.model, revision=report.revision, quantization=report.quantization,
            quantization_requested=report.quantization_requested,
            double_quant=report.double_quant, kv_cache=prepared.kv_cache,
            compute_dtype=report.compute_dtype, attention=report.attention, decode_path=backend.name,
            device=report.device_name, versions=dict(report.versions),
            prompt_tokens=int(prepared.input_ids.shape[-1]), weights_bytes=report.weights_bytes,
            dropped_turns=prepared.fitted.dropped_turns, notes=list(prepared.notes),
            predicted_peak_bytes=prepared.predicted.peak_allocated_bytes if prepared.predicted else None,
            memory_budget_bytes=self.memory_budget.budget_bytes, context_fit_tokens=prepared.context_fit_tokens,
        )
        if backend is path.plain:  # the kept cache when it serves this reply (run() gives it back), else a new one
            claimed = plain_prefix.claim(stop_event) if plain_prefix and prepared.kv_cache == "bf16" else None
            cache = claimed if claimed is not None else make_cache(
                prepared.kv_cache, self.loaded.model, capacity_tokens=stats.prompt_tokens + gen.max_new_tokens)
        else:
            cache = backend.make_cache() if backend.cache_at_start else None  # else _final_stats makes it
        errors: list[BaseException] = []
        cached: list[int] = []

        def work() -> None:
            try:
                with torch.inference_mode():
                    cached.append(int(backend.run(prepared, streamer, stop_event, cache) or 0))
            except BaseException as exc:  # relayed to the caller below, never swallowed
                errors.append(exc)
                streamer.end()
            finally:  # the kept plain cache, if run() did not give it back (it was replaced): dropped
                if plain_prefix is not None:
                    plain_prefix.release(stop_event, None)

        cached_free = cached_free_bytes(loaded.device)
        if not getattr(backend, "measures_peak", False):  # overlapping replies: the backend records each one's peak
            peak.start()
        worker_done: threading.Event | None = None
        scheduled: Generator[str, None, None] | None = None
        if isinstance(backend, ScheduledBackend):  # a row of the scheduler: read on this thread, no worker between
            scheduled = self._scheduled_texts(backend, prepared, streamer, stop_event, cache, cached, hold)
            chunks: Iterator[str] = scheduled
        else:
            worker_done = self._workers.submit(work)
            chunks = iter(streamer) if hold is None else streamer.held_texts(hold)
        reply = ""
        try:
            try:
                for chunk in chunks:
                    reply += chunk
                    yield ReplyUpdate(reply, self._live_stats(stats, clock))
            except Exception as exc:  # queue.Empty / TokenTimeout: no token within stream_timeout_s
                if worker_done is None and not isinstance(exc, TokenTimeout):
                    errors.append(exc)  # the scheduled reply's own error
                if errors:
                    cache = None  # drop the KV cache before recovering memory
                    raise self._translate(errors[0]) from None
                stop_event.set()
                raise GenerationError(
                    f"No new token for {gen.stream_timeout_s:.0f} s; the reply was stopped. Try again, or "
                    "lower max new tokens."
                ) from exc
            if worker_done is not None:
                worker_done.wait(_JOIN_TIMEOUT_S)
            if errors:
                cache = None  # drop the KV cache before recovering memory
                raise self._translate(errors[0]) from None
            stats = replace(stats, cached_prompt_tokens=cached[0] if cached else 0)
            final = self._final_stats(stats, clock, peak, cache, stop_event, prepared, loaded, backend, path,
                                      cached_free)
            if gen.control is not None:
                final = replace(final, **gen.control.stats_fields())
            yield ReplyUpdate(reply, final, done=True, token_ids=tuple(clock.token_ids))
        finally:
            stop_event.set()  # the consumer went away (Stop, disconnect, error): halt the worker or the row too
            if worker_done is not None:
                worker_done.wait(_JOIN_TIMEOUT_S)
            elif scheduled is not None:
                scheduled.close()  # its reply counted out of `generating` now, not when it is collected

    def _scheduled_texts(self, backend: ScheduledBackend, prepared: PreparedPrompt, streamer: TimedStreamer,
                         stop_event: threading.Event, cache: Any, cached: list[int],
                         hold: Callable[[], float] | None = None) -> Generator[str, None, None]:
        """A reply of a scheduled backend (the batched fast path, the eager batch, the CPU path) read on the reply's
        own thread: its token ids straight from the scheduler's queue (every id queued by then in one read), stamped
        at their delivery (a read that takes several does not bunch their times) and decoded by the streamer here.
        No worker thread in between: with one per reply, 32 replies woke 64 threads a step, and the scheduler's
        thread waited for the GIL behind them (bench/results/2026-12-07-s3-h100.md).
        `hold`: the reader sleeps between reads while the caller has no use for the text (stream_chat).
        Raises the reply's error, or TokenTimeout after stream_timeout_s without a token."""
        with self._workers.occupied():
            for _ in backend.feed(prepared, streamer, stop_event, cache, prepared.gen.stream_timeout_s, hold):
                yield from streamer.texts()
            streamer.end()
            yield from streamer.texts()
            cached.append(backend.cached_tokens(cache))

    def _live_stats(self, stats: ReplyStats, clock: TokenClock) -> ReplyStats:
        return replace(stats, **clock.snapshot())

    def _final_stats(self, stats: ReplyStats, clock: TokenClock, peak: PeakMeter, cache: Any,
                     stop_event: threading.Event, prepared: PreparedPrompt, loaded: LoadedModel,
                     backend: DecodeBackend, path: DecodePath, cached_free: int = 0) -> ReplyStats:
        timing = clock.snapshot()
        count, rate = timing["new_tokens"], timing["decode_tokens_per_s"]
        if loaded.device.type == "cuda":
            torch.cuda.synchronize(loaded.device)
        end_to_end_s = time.perf_counter() - clock.start_s
        last = self._reply_s_ema
        self._reply_s_ema = end_to_end_s if last is None else 0.8 * last + 0.2 * end_to_end_s
        eos_ids = loaded.eos_token_ids
        if stop_event.is_set():
            reason = "stopped"
        elif clock.token_ids and clock.token_ids[-1] in eos_ids:
            reason = "eos"
        else:
            reason = "length" if count >= prepared.gen.max_new_tokens else "eos"
        if isinstance(cache, RowKV):  # batched: this reply's row of the shared cache
            kv = cache.nbytes
        else:
            kv = cache_bytes(cache if cache is not None else backend.make_cache()) or None
        measured = peak.stop().reply_fields()
        if isinstance(cache, RowKV) and cache.peak_allocated_bytes is not None:  # the batch's peak in this reply
            measured = {"peak_vram_allocated_bytes": cache.peak_allocated_bytes,
                        "peak_vram_reserved_bytes": cache.peak_reserved_bytes}
        if isinstance(cache, RowKV) and cache.peak_batch_rows is not None:
            measured["peak_batch_rows"] = cache.peak_batch_rows
        reserved = measured.get("peak_vram_reserved_bytes")
        profiled = backend.name == "fast" and path.profile is not None  # bounded by measurement instead
        if reserved and prepared.predicted is not None and not profiled:  # learn the allocator's reserve
            # Blocks already cached and free when the reply started (warm-up's, an earlier longer reply's) are in
            # the reserved peak without being this reply's doing, and the allocator frees them before it would
            # fail: left out, or one long reply (or the warm-up) would inflate every later plan.
            releasable = max(0, cached_free - path.held_free_bytes)  # pools, fragments: counted
            with self._path_lock:  # not lost to a re-plan swapping the path (and the facts) in between
                self.memory_facts = refit_reserve(self.memory_facts, prepared.predicted, reserved - releasable)
        return replace(
            stats, **timing, end_to_end_s=end_to_end_s,
            kv_cache_bytes=kv, finish_reason=reason,
            decode_bandwidth_bytes_per_s=(rate * loaded.report.weights_bytes) if rate else None,
            **measured,
        )

    def _translate(self, exc: BaseException) -> LLMCoreError:
        if isinstance(exc, LLMCoreError):
            return exc
        if is_oom_error(exc):
            traceback.clear_frames(exc.__traceback__)  # the failed step's frames still hold activations
            plain_prefix = self.path.plain_prefix
            if plain_prefix is not None:  # the kept KV goes first (the static caches' ids are already forgotten)
                plain_prefix.drop()
            free_memory(self.loaded.device)
            return OutOfMemoryError(
                "The device ran out of memory during this reply. Memory was freed and the conversation kept; "
                "lower max new tokens or the history length and try again."
            )
        return GenerationError(f"Generation failed: {type(exc).__name__}: {str(exc)[:300]}")

