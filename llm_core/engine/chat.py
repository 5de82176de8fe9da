"""The chat engine: fit_history -> encode_chat -> start_stream -> iterate -> stats. Knows nothing about Gradio.

Generation runs on one of the engine's long-lived worker threads feeding a `TextIteratorStreamer` with a
timeout; the caller iterates text updates. Stop sets a per-request event checked by a stopping criterion, so
the worker really halts. A worker exception is re-raised in the caller as a GenerationError (OutOfMemoryError
after freeing memory); a stalled worker raises after `stream_timeout_s`. Nothing can wait forever.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch
from transformers import StoppingCriteria, StoppingCriteriaList, TextIteratorStreamer

from ..config import GenerationSettings, Settings, canonical_kv_cache
from ..errors import (
    ContextBudgetError,
    GenerationError,
    InputError,
    LLMCoreError,
    OutOfMemoryError,
    SettingsError,
)
from ..history import FittedHistory, Turn, build_messages, clean_text, clean_turns, fit_history
from ..loading import LoadedModel, Progress, load_model
from ..memory.device import OOMInjector, PeakMeter, device_allocated_bytes, free_memory, is_oom_error
from ..memory.kv_cache import cache_bytes, cache_kwarg, make_cache, prefill_in_chunks
from ..memory.model import (
    STATIC_KV_LAYOUTS,
    MemoryBudget,
    ModelMemoryFacts,
    ReplyPlan,
    human_bytes,
    max_context_tokens,
    plan_reply,
    predict_peak_bytes,
    refit_reserve,
    require_fit,
    resident_extra_bytes,
)
from ..memory.plan import FAST_CACHE_ADVICE, MIN_FAST_CACHE_TOKENS
from ..metrics import ReplyStats, TokenClock
from .plain_prefix import PlainPrefixCache
from .prefix_cache import PrefixCache
from .serving import BatchScheduler, ReplySlots, RowKV

log = logging.getLogger(__name__)

# How long the caller waits for the worker to wind down after a stop or an error.
_JOIN_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class ReplyUpdate:
    """One step of a streamed reply: the text so far and the numbers so far (final when done is True)."""

    text: str
    stats: ReplyStats
    done: bool = False
    token_ids: tuple[int, ...] = ()  # the generated ids, on the final update only


@dataclass(frozen=True)
class PreparedPrompt:
    """A request ready for a backend: the prompt ids and the generation settings resolved for it (max_new_tokens
    is what the memory plan allows, min_new_tokens at most that), so no backend chooses between two values."""

    fitted: FittedHistory
    input_ids: torch.Tensor  # (1, prompt_tokens) on the model's device
    attention_mask: torch.Tensor  # (1, prompt_tokens)
    gen: GenerationSettings
    notes: tuple[str, ...] = ()
    kv_cache: str = "bf16"
    predicted: Any = None  # memory.PeakPrediction for prompt + max_new_tokens
    context_fit_tokens: int | None = None  # prompt tokens that fit the memory budget with this max_new_tokens


class _StopOnEvent(StoppingCriteria):
    """Halts `generate` between steps once the request's stop event is set; `on_step` runs after every step."""

    def __init__(self, event: threading.Event, on_step: Callable[[], None] | None = None) -> None:
        self.event = event
        self.on_step = on_step

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        if self.on_step is not None:
            self.on_step()
        return torch.full((input_ids.shape[0],), self.event.is_set(), dtype=torch.bool, device=input_ids.device)


class _TimedStreamer(TextIteratorStreamer):
    """TextIteratorStreamer that also stamps every generated token id on a TokenClock as it arrives."""

    def __init__(self, tokenizer: Any, clock: TokenClock, timeout_s: float) -> None:
        super().__init__(tokenizer, skip_prompt=True, timeout=timeout_s, skip_special_tokens=True)
        self.clock = clock

    def put(self, value: torch.Tensor) -> None:
        if not (self.skip_prompt and self.next_tokens_are_prompt):
            self.clock.on_tokens(value.reshape(-1).tolist())
        super().put(value)


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


class DecodeBackend(Protocol):
    """The loop that produces tokens for one prepared prompt: plain `generate`, the fast static-cache path, or the
    batch scheduler. `run` streams token ids into `streamer` until EOS, prepared.gen.max_new_tokens or `stop_event`.
    `make_cache` gives the object whose bytes the stats report; `cache_at_start`: whether run() needs it passed in
    (the fast path's is its static cache, viewed only for the final stats, so the view costs nothing in TTFT).
    `run` returns the prompt tokens whose KV came from a cache instead of the prefill (None or 0: none)."""

    name: str
    reason: str
    cache_at_start: bool

    def run(self, prepared: PreparedPrompt, streamer: Any, stop_event: threading.Event, cache: Any
            ) -> int | None: ...

    def make_cache(self) -> Any: ...


@dataclass
class PlainBackend:
    """transformers' `generate` with a dynamic (or quantized/offloaded) cache; chunked prefill when configured."""

    loaded: LoadedModel
    reason: str
    prefill_chunk_tokens: int | None
    check_oom: Callable[[str], None]  # the engine's OOM injector, read at each call (tests swap it)
    prefix: PlainPrefixCache | None = None  # PREFIX_CACHE: the kept DynamicCache (claimed by ChatEngine._stream)
    name: str = "plain"
    cache_at_start: bool = True

    def make_cache(self) -> Any:
        return make_cache("bf16", self.loaded.model)

    def run(self, prepared: PreparedPrompt, streamer: Any, stop_event: threading.Event, cache: Any) -> int:
        prefix = self.prefix if self.prefix is not None and self.prefix.owns(cache) else None
        if prefix is None:
            self._generate(prepared, streamer, stop_event, cache)
            return 0
        ids: list[int] | None = None
        try:
            prompt = prepared.input_ids[0].tolist() if bool(prepared.attention_mask.all()) else []
            cached = prefix.begin(cache, prompt)
            ids = self._generate(prepared, streamer, stop_event, cache)
            return cached
        finally:
            prefix.release(stop_event, ids)  # ids None: an error, the cache is dropped

    def _generate(self, prepared: PreparedPrompt, streamer: Any, stop_event: threading.Event, cache: Any
                  ) -> list[int]:
        """generate's returned ids (prompt + new) of the one row."""
        model, gen = self.loaded.model, prepared.gen
        self.check_oom("prefill")
        chunk = self.prefill_chunk_tokens
        if cache is not None and chunk and prepared.input_ids.shape[-1] > chunk:
            prefill_in_chunks(model, prepared.input_ids, cache, chunk)  # activation peak ~ chunk, not prompt
        stop = _StopOnEvent(stop_event, on_step=lambda: self.check_oom("decode"))
        kwargs: dict[str, Any] = dict(
            input_ids=prepared.input_ids, attention_mask=prepared.attention_mask,
            max_new_tokens=gen.max_new_tokens, do_sample=gen.do_sample,
            repetition_penalty=gen.repetition_penalty, streamer=streamer, use_cache=True,
            stopping_criteria=StoppingCriteriaList([stop]), pad_token_id=_pad_id(self.loaded),
        )
        if cache is not None:
            kwargs[cache_kwarg(model)] = cache
        if gen.min_new_tokens:
            kwargs["min_new_tokens"] = gen.min_new_tokens
        if gen.do_sample:
            kwargs.update(temperature=gen.temperature, top_p=gen.top_p, top_k=gen.top_k)
            if gen.seed is not None:
                torch.manual_seed(gen.seed)
        else:  # greedy: neutralise sampling defaults from the model's generation_config
            kwargs.update(temperature=None, top_p=None, top_k=None)
        return [int(i) for i in model.generate(**kwargs)[0].tolist()]


@dataclass
class FastBackend:
    """llm_core.fast: static KV cache, compiled step replayed as CUDA graphs (eager on CPU)."""

    decoder: Any  # llm_core.fast.FastDecoder (imported lazily: the fast path is optional)
    reason: str
    name: str = "fast"
    cache_at_start: bool = False

    def make_cache(self) -> Any:
        return self.decoder.cache

    def run(self, prepared: PreparedPrompt, streamer: Any, stop_event: threading.Event, cache: Any) -> int:
        gen = prepared.gen
        info: dict[str, int] = {}
        self.decoder.generate(prepared.input_ids, prepared.attention_mask, gen, streamer, stop_event,
                              gen.max_new_tokens, min_new_tokens=gen.min_new_tokens, info=info)
        return info.get("cached_prompt_tokens", 0)


class ChatEngine:
    """Holds one loaded model for the life of the process and serves streamed chat replies, one at a time."""

    def __init__(self, loaded: LoadedModel, settings: Settings) -> None:
        self.loaded = loaded
        self.settings = settings
        # Replies in the engine at once: 1 (serial), or MAX_BATCH_SIZE when batching; per session one running and
        # SESSION_MAX_WAITING waiting, served least-recently-served session first.
        self._lock = ReplySlots(1, session_max_waiting=settings.server.session_max_waiting)
        self._workers = WorkerThreads(1)
        self._tokenizer_lock = threading.Lock()
        self._fit_lock = threading.Lock()
        self._fit_cache: dict[tuple[ModelMemoryFacts, int, int, str, int | None], int] = {}
        self._stops: dict[str, list[threading.Event]] = {}  # session -> stop events of its running/waiting requests
        self._stops_lock = threading.Lock()
        self.oom_injector = OOMInjector()  # tests arm it to prove OOM recovery; never fires otherwise
        self.memory_facts = ModelMemoryFacts.from_loaded(loaded)
        budget = settings.memory.budget_bytes
        self.memory_budget = MemoryBudget(budget, "VRAM_BUDGET") if budget else MemoryBudget.from_device(
            loaded.device, settings.memory.margin_bytes)
        self._kv_choice = self._choose_kv_cache()  # (KV_CACHE as resolved, the sentence that says why)
        self._prefill_chunk_tokens = self._resolve_prefill_chunk_tokens()  # PREFILL_CHUNK_TOKENS (None = one pass)
        # PREFIX_CACHE: each single-reply path keeps the ids whose KV its cache holds and prefills only the rest
        self._prefix_cache = settings.memory.prefix_cache
        self._plain_prefix = PlainPrefixCache(loaded.model) if self._prefix_cache else None
        self.backend: DecodeBackend = self._plain_backend(
            "DECODE_PATH=plain" if settings.model.decode_path == "plain" else "")
        self._plain = self.backend  # quantized/offloaded KV caches always run on the plain path
        self.scheduler: BatchScheduler | None = None
        self.fast_scheduler: Any = None  # llm_core.fast.batched.FastBatchScheduler when the fast path batches
        self._fast_profile: dict[str, int] | None = None  # CUDA fast path: the start-up memory profile
        self._prefill_graph_tokens = 0  # resolved PREFILL_GRAPH_TOKENS (the fast path's; 0 elsewhere)
        self._held_free_bytes = 0  # CUDA fast path: graph pools + fragments, reserved but free (measured)
        self._reply_s_ema: float | None = None  # seconds a reply takes end to end, averaged (for wait estimates)
        self._plain_facts = self.memory_facts  # the memory facts of plain generate (restored on a fallback)
        self._allocated_before_decode = device_allocated_bytes(loaded.device)  # resident_extra_bytes measured from here
        self._configure_decode()

    # --- construction --------------------------------------------------------------------------
    @classmethod
    def load(cls, settings: Settings, progress: Progress | None = None, *, warmup: bool = True) -> ChatEngine:
        from ..fit import check_weights_fit

        check_weights_fit(settings)  # weights that cannot fit the budget: said before anything is loaded
        engine = cls(load_model(settings.model, progress), settings)
        if warmup:
            engine.warmup(progress)
        return engine

    def _plain_backend(self, reason: str) -> PlainBackend:
        return PlainBackend(self.loaded, reason, self._prefill_chunk_tokens,
                            lambda point: self.oom_injector.check(point), self._plain_prefix)

    def _select_backend(self) -> None:
        mode = self.settings.model.decode_path
        if mode == "plain":
            return
        weights = self.loaded.extra.get("cpu_weights")
        if weights is not None:  # loaded for the CPU path (DECODE_PATH auto/cpu on CPU): llm_core.fast.cpu
            from .cpu_backend import cpu_backend

            self.backend = cpu_backend(self.loaded, weights, self._fast_cache_tokens(),
                                       self._prefill_chunk_tokens, prefix_cache=self._prefix_cache)
            return
        try:
            from .. import fast
        except ImportError as exc:  # the fast path is optional: the plain path always works
            if mode == "fast":
                raise SettingsError(f"DECODE_PATH=fast, but the fast decode path is unavailable: {exc}") from exc
            self.backend = self._plain_backend(f"fast path unavailable: {exc}")
            return
        ok, reason = fast.fast_path_support(self.loaded)
        if not ok and mode == "auto":
            self.backend = self._plain_backend(reason)
            return
        if not ok and mode == "fast" and self.loaded.device.type == "cuda":
            raise SettingsError(f"DECODE_PATH=fast cannot run here: {reason}. Use DECODE_PATH=auto.")
        if not ok:  # DECODE_PATH=fast off CUDA: the same loop, eager (tests and debugging)
            ok, why = fast.fast_path_support(self.loaded, allow_cpu=True)
            if not ok:
                raise SettingsError(f"DECODE_PATH=fast cannot run here: {why}. Use DECODE_PATH=auto.")
            reason = (f"DECODE_PATH=fast on {self.loaded.device.type.upper()}: static KV cache, eager decode loop "
                      "(no compile, no CUDA graphs)")
        self._prefill_graph_tokens = self._resolve_prefill_graph_tokens()
        options = fast.FastDecodeOptions(prefill_graph_tokens=self._prefill_graph_tokens,
                                         prefill_chunk_tokens=self._prefill_chunk_tokens,
                                         kv_cache=self._fast_kv_cache)
        plain_facts = self.memory_facts
        try:
            cache_tokens = self._fast_cache_tokens()
        except ContextBudgetError as exc:  # weights fit, but not beside a useful static cache: plain generate
            if mode == "fast":
                raise
            self.memory_facts = plain_facts
            self.backend = self._plain_backend(f"no room for the fast path's KV cache: {exc}")
            return
        decoder = fast.FastDecoder(self.loaded, max_cache_len=cache_tokens, options=options,
                                   prefix_cache=PrefixCache() if self._prefix_cache else None)
        if self._fast_kv_cache != "bf16":
            kv = self._fast_kv_cache
            reason += f"; KV cache {kv} ({STATIC_KV_LAYOUTS[kv]}), read by the decode attention kernel"
        quantization = self.loaded.settings.quantization
        if quantization in ("nf4", "none"):  # which kernel runs, and the start-up timing behind the choice
            nf4 = quantization == "nf4"
            timings = decoder.gemv_timings_us if nf4 else decoder.dense_gemv_timings_us
            timed = ", ".join(f"{k} {v:.0f} µs" for k, v in timings.items())
            reason += (f"; 4-bit kernel: {decoder.options.gemv}" if nf4 else
                       f"; matrix-vector kernel: {decoder.options.dense_gemv}") + (
                f" (per layer: {timed})" if timed else "")
        elif quantization == "int8":
            reason += ("; int8 weights read by a Triton matrix-vector kernel with their row scales, activations "
                       "kept in float16 (weight-only: no LLM.int8 activation quantization or outlier split)")
        self.backend = FastBackend(decoder, reason)
        # Warm-up allocates the whole static cache (max_cache_len): predictions count that block, not a growing one;
        # the prefill dequantizes fused gate/up weights.
        self.memory_facts = replace(self.memory_facts, static_kv_tokens=int(decoder.max_cache_len),
                                    static_kv_cache=self._fast_kv_cache,
                                    resident_extra_bytes=self._cache_plan.resident_extra_bytes)

    def _choose_kv_cache(self) -> tuple[str, str]:
        """KV_CACHE resolved for this engine: auto is decided where the start-up sizes the fast path's cache
        (llm_core.memory.plan.choose_kv_cache) on CUDA; the plain and CPU paths keep bf16 for auto."""
        from ..memory.plan import choose_kv_cache

        model = self.settings.model
        return choose_kv_cache(self.settings.generation.kv_cache, replace(self.memory_facts, fast_prefill=True),
                               self.memory_budget.budget_bytes, max_new_tokens=self.settings.generation.max_new_tokens,
                               prefill_chunk_tokens=self.settings.memory.prefill_chunk_tokens,
                               prefill_graph_tokens=model.prefill_graph_tokens,
                               fast_path=self.loaded.device.type == "cuda" and model.decode_path != "plain")

    @property
    def _fast_kv_cache(self) -> str:
        """The fast path's static cache: KV_CACHE as resolved (so int8/int4 chats keep the graphed step); bf16 for
        offload, whose replies run on the plain path."""
        kv = self._kv_choice[0]
        return kv if kv in ("bf16", "int8", "int4") else "bf16"

    @property
    def kv_cache_reason(self) -> str:
        """One sentence for the Model panel: which KV cache replies get by default, and why."""
        from ..memory.plan import AUTO_ON_PLAIN

        if self.backend.name in ("fast", "fast-batched") or self.settings.generation.kv_cache != "auto":
            return self._kv_choice[1]
        return AUTO_ON_PLAIN

    @property
    def kv_cache(self) -> str:
        """The KV cache a reply asking for auto gets: the fast path's, else bf16 where KV_CACHE=auto."""
        if self.backend.name in ("fast", "fast-batched"):
            return self._kv_choice[0]
        return "bf16" if self.settings.generation.kv_cache == "auto" else self._kv_choice[0]

    def _fast_serves(self, kv_cache: str) -> bool:
        """Whether a reply with this KV cache mode runs on the fast path (its static cache is of that mode)."""
        return self.backend.name in ("fast", "fast-batched") and kv_cache == self._fast_kv_cache

    def _backend_for(self, kv_cache: str) -> DecodeBackend:
        """The fast path for the KV mode of its static cache, the plain path for other modes; other backends
        (plain, batched) serve the bf16 cache themselves."""
        if self.backend.name in ("fast", "fast-batched"):
            return self.backend if self._fast_serves(kv_cache) else self._plain
        return self.backend if kv_cache == "bf16" else self._plain

    def _resolve_prefill_chunk_tokens(self) -> int | None:
        from ..memory.plan import resolve_prefill_chunk_tokens

        return resolve_prefill_chunk_tokens(
            self.settings.memory.prefill_chunk_tokens, replace(self.memory_facts, fast_prefill=True),
            self.memory_budget.budget_bytes, max_new_tokens=self.settings.generation.max_new_tokens,
            kv_cache=self._fast_kv_cache)

    @property
    def memory_plan(self) -> str:
        """One line for the Model panel: the memory budget and where it comes from, the fast path's KV cache (and
        whether start-up measured it), and how long prompts are prefilled."""
        parts = [f"budget {human_bytes(self.memory_budget.budget_bytes)} ({self.memory_budget.source})"]
        decoder = getattr(self.backend, "decoder", None)
        slots = self.fast_scheduler.decoder if self.fast_scheduler is not None else None
        if slots is not None:
            parts.append(f"{slots.slots} KV slots of {slots.slot_tokens:,} tokens")
        elif decoder is not None and getattr(decoder, "max_cache_len", None):
            parts.append(f"KV cache {int(decoder.max_cache_len):,} tokens")
        if self._fast_profile:
            parts[-1] += f", sized by measurement (peak {human_bytes(self._fast_profile['peak_reserved_bytes'])})"
        chunk = self._prefill_chunk_tokens
        parts.append(f"long prompts prefilled in {chunk:,}-token chunks" if chunk else "prompts prefilled in one pass")
        return "; ".join(parts) + ". " + self.kv_cache_reason

    @property
    def prefill_chunk_tokens(self) -> int | None:
        """Long prompts are prefilled in chunks of this many tokens (None: in one pass): PREFILL_CHUNK_TOKENS, or
        what auto resolved it to for this model, card and KV mode."""
        return self._prefill_chunk_tokens

    def _resolve_prefill_graph_tokens(self) -> int:
        from ..memory.plan import resolve_prefill_graph_tokens

        return resolve_prefill_graph_tokens(
            self.settings.model.prefill_graph_tokens, replace(self.memory_facts, fast_prefill=True),
            self.memory_budget.budget_bytes, max_new_tokens=self.settings.generation.max_new_tokens,
            prefill_chunk_tokens=self._prefill_chunk_tokens, kv_cache=self._fast_kv_cache)

    def _fast_cache_tokens(self, resident_extra_bytes: int | None = None) -> int:
        """The fast path's static KV cache, allocated once at warm-up: the most tokens for which a reply filling
        it (prompt + the default reply length) fits the budget beside the weights, the largest prefill chunk, the
        graph pools and the allocator reserve (llm_core.memory.plan); never beyond the model's context."""
        from ..memory.plan import require_cache, static_cache_plan

        self.memory_facts = replace(self.memory_facts, fast_prefill=True)  # its prefill dequantizes int8 too
        plan = static_cache_plan(self.memory_facts, self.memory_budget.budget_bytes,
                                 max_new_tokens=self.settings.generation.max_new_tokens,
                                 prefill_chunk_tokens=self._prefill_chunk_tokens,
                                 kv_cache=self._fast_kv_cache, resident_extra_bytes=resident_extra_bytes,
                                 prefill_graph_tokens=self._prefill_graph_tokens)
        self._cache_plan = require_cache(plan, self.memory_facts)
        return plan.tokens

    @property
    def fast_memory_profile(self) -> dict[str, int] | None:
        """CUDA fast path: the start-up measurement that sized its KV cache (peak reserved/allocated bytes of the
        worst reply the cache allows, and its tokens); None elsewhere (the plan's arithmetic is the bound there)."""
        return dict(self._fast_profile) if self._fast_profile else None

    @property
    def fast_decoder(self) -> Any | None:
        """The llm_core.fast FastDecoder when the fast path serves replies, else None."""
        return self.backend.decoder if isinstance(self.backend, FastBackend) else None

    @property
    def context_limit(self) -> int:
        """Tokens one reply (prompt + new tokens) may span: the model's context, or the fast path's cache."""
        decoder = getattr(self.backend, "decoder", None)  # the fast or CPU path's static cache
        if decoder is not None:
            return min(self.loaded.context_length, int(decoder.max_cache_len))
        return self.loaded.context_length

    def _configure_decode(self) -> None:
        """Batched decoding (llm_core.engine.serving) when MAX_BATCH_SIZE resolves above 1 and the model allows it;
        else one reply at a time on the plain or fast path."""
        from .serving import batching_support, resolve_max_batch_size

        loaded = self.loaded
        size = resolve_max_batch_size(self.settings.server.max_batch_size, loaded.device,
                                      self.settings.model.decode_path, self.settings.server.is_shared)
        selected = False
        if size > 1 and self.settings.model.decode_path != "plain" and loaded.extra.get("cpu_weights") is None:
            self._select_backend()  # the fast path, when it serves this model here, batches every reply itself
            selected = True
            if isinstance(self.backend, FastBackend):
                self._serve_fast_batched(size)
                return
        ok, why = batching_support(loaded.model) if size > 1 else (False, "")
        if not ok:
            if not selected:
                self._select_backend()
            if why:
                self.backend.reason = "; ".join(filter(None, [self.backend.reason, f"batching off: {why}"]))
            return
        self._serve_eager_batched(size)

    def _serve_eager_batched(self, size: int, note: str = "") -> None:
        """Concurrent replies batched by llm_core.engine.serving's scheduler over transformers' forward (models or
        cards the batched fast path does not serve)."""
        from .serving import BatchedBackend, default_kv_budget_bytes

        loaded = self.loaded
        self.scheduler = BatchScheduler.for_model(
            loaded.model, max_batch_size=size,
            kv_budget_bytes=default_kv_budget_bytes(loaded, size, self.memory_budget.budget_bytes, self.memory_facts),
            cache_dtype=loaded.compute_dtype, eos_token_ids=sorted(loaded.eos_token_ids),
            cache_kwarg=cache_kwarg(loaded.model))
        self.backend = BatchedBackend(self.scheduler, "; ".join(filter(None, [
            f"MAX_BATCH_SIZE={size}: concurrent replies share one decode batch", note])))
        self._lock = ReplySlots(size, session_max_waiting=self.settings.server.session_max_waiting)
        self._workers.grow(size)

    def _serve_fast_batched(self, size: int) -> None:
        """Replace the single-reply fast backend by the batched fast loop: `size` KV slots (at most 32) of the
        largest length s (<= the context) for which llm_core.memory.plan.static_cache_plan still fits a reply filling
        one slot with the other slots' blocks held as resident; fewer slots when s would be under
        MIN_FAST_CACHE_TOKENS."""
        from ..fast.batched import MAX_SLOTS, FastBatchScheduler, SlotDecoder
        from ..memory.plan import MIN_FAST_CACHE_TOKENS, fast_resident_estimate, static_cache_plan
        from .serving import FastBatchedBackend

        fast = self.backend
        assert isinstance(fast, FastBackend)
        decoder = fast.decoder
        context = int(self.loaded.context_length)
        per_token = int(decoder.kv_bytes_per_token())
        chunk = self._prefill_chunk_tokens

        def fits(slots: int, tokens: int) -> bool:
            others = (slots - 1) * tokens * per_token  # the other slots' blocks, resident beside this reply's
            plan = static_cache_plan(
                self.memory_facts, self.memory_budget.budget_bytes,
                max_new_tokens=min(self.settings.generation.max_new_tokens, tokens - 1),
                prefill_chunk_tokens=chunk, kv_cache=self._fast_kv_cache,
                resident_extra_bytes=fast_resident_estimate(self.memory_facts, 0, tokens) + others)
            return plan.tokens >= tokens

        def longest(slots: int) -> int:
            lo, hi = 0, context // 16  # in units of 16 tokens
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if fits(slots, mid * 16):
                    lo = mid
                else:
                    hi = mid - 1
            return lo * 16

        slots = min(size, MAX_SLOTS)
        slot_tokens = longest(slots)
        while slots > 1 and slot_tokens < min(MIN_FAST_CACHE_TOKENS, context):
            slots //= 2
            slot_tokens = longest(slots)
        if slot_tokens < min(MIN_FAST_CACHE_TOKENS, context):
            raise ContextBudgetError(
                f"The memory budget leaves no room for even one {MIN_FAST_CACHE_TOKENS}-token KV slot of the batched "
                "fast path beside the weights. Use a smaller model, QUANTIZATION=nf4, KV_CACHE=int8 or a "
                "larger VRAM_BUDGET.")
        decoder.max_cache_len = slot_tokens  # the engine fits every history to one slot (context_limit)
        decoder.prefix_cache = None  # its own cache serves no reply now: the slots do
        scheduler = FastBatchScheduler(SlotDecoder(decoder, slots=slots, slot_tokens=slot_tokens),
                                       eos_token_ids=sorted(self.loaded.eos_token_ids))
        self._fast_batched_reason = (fast.reason, size)
        self.backend = FastBatchedBackend(scheduler, decoder, _fast_batched_reason(fast.reason, size, slots,
                                                                                   slot_tokens))
        self.fast_scheduler = scheduler
        self.memory_facts = replace(self.memory_facts, static_kv_tokens=slots * slot_tokens,
                                    static_kv_cache=self._fast_kv_cache,
                                    resident_extra_bytes=fast_resident_estimate(self.memory_facts, 0, slot_tokens))
        self._lock = ReplySlots(slots, session_max_waiting=self.settings.server.session_max_waiting)
        self._workers.grow(slots)

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

    def warmup(self, progress: Progress | None = None) -> float:
        """Run once at start-up (never per request): first-call costs (kernel repacking, compile) happen here."""
        say = progress or (lambda _m: None)
        say(f"Warming up ({self.backend.name} decode path)…")
        t0 = time.perf_counter()
        decoder = self.fast_decoder
        measured = decoder is not None and self.loaded.device.type == "cuda"
        if decoder is not None:
            try:
                self._warm_fast_decoder(decoder, say)
                self._measure_fast_resident(decoder)
                if measured:
                    self._profile_fast_cache(decoder, say)
                else:
                    self._fit_fast_cache(self.settings.generation.max_new_tokens, say)
            except ContextBudgetError as exc:  # weights fit, the fast path's cache does not: plain generate serves
                if self.settings.model.decode_path != "auto":
                    raise
                self._fall_back_to_plain(decoder, exc)
                decoder, measured = None, False
        if self.fast_scheduler is not None:  # the batched fast path: its slots, sized by measurement on CUDA
            try:
                self._size_fast_slots(say)
            except ContextBudgetError as exc:  # start-up never fails for weights that fit: the eager batch serves
                if self.settings.model.decode_path != "auto":
                    raise
                self._fall_back_to_eager_batch(exc)
        start = getattr(self.backend, "warmup", None)  # the batched fast loop: slots, compile, graphs
        if start is not None:
            start()
        gen = replace(self.settings.generation, max_new_tokens=2, do_sample=False)
        for _ in self.stream_chat("Hi", [], gen=gen, history_turns=0, system_prompt=None):
            pass
        if decoder is not None:
            self._measure_fast_resident(decoder)
            # unmeasured (CPU): what the warm-up reply taught the reserve re-plans the cache now, not in a reply;
            # a recapture leaves its own fragments, so re-plan until the split holds
            for _ in range(0 if measured else 3):
                if not self._fit_fast_cache(self.settings.generation.max_new_tokens, say):
                    break
        warmup_s = time.perf_counter() - t0
        self.loaded.report = replace(self.loaded.report, warmup_s=round(warmup_s, 3),
                                     decode_path=self.backend.name, decode_path_reason=self.backend.reason,
                                     memory_plan=self.memory_plan)
        say(f"Ready ({warmup_s:.1f} s warm-up).")
        return warmup_s

    def _size_fast_slots(self, say: Callable[[str], None]) -> None:
        """Warm the batched fast path's slots (compile, graphs) before its loop starts; on CUDA then size them by
        measurement as the single-reply cache is (issue 17, built on for issue 16): SlotDecoder.profile_worst_reply
        runs one slot's last prefill chunk at the end of a full slot and a step with every slot decoding, and
        size_cache_by_measurement re-sizes the slot length until that peak fits the budget. The slot count stays;
        when not even MIN_FAST_CACHE_TOKENS per slot fit, ContextBudgetError says to lower MAX_BATCH_SIZE (and with
        DECODE_PATH=auto, warmup() then serves the eager batch instead: _fall_back_to_eager_batch)."""
        slots = self.fast_scheduler.decoder
        if slots.k is None:
            slots.warmup()
        if self.loaded.device.type == "cuda":
            self._measure_fast_slots(say)

    def _measure_fast_slots(self, say: Callable[[str], None]) -> None:
        scheduler = self.fast_scheduler
        slots = scheduler.decoder

        def resize(tokens: int) -> None:
            say(f"Sizing the {slots.slots} KV slots from measured memory: {slots.slot_tokens:,} -> {tokens:,} "
                "tokens each…")
            scheduler.resize_slots(tokens)

        try:
            self._fast_profile = self._size_by_measurement(
                lambda: int(slots.slot_tokens), resize, lambda: slots.profile_worst_reply(self._prefill_chunk_tokens),
                slots.slots * slots.kv_bytes_per_token())
        except ContextBudgetError as exc:
            raise ContextBudgetError(f"{exc} With MAX_BATCH_SIZE={slots.slots} the batch's KV slots share it: lower "
                                     "MAX_BATCH_SIZE.") from None
        slots.fast.max_cache_len = slots.slot_tokens  # the context one reply may span (FastBatchedBackend.decoder)
        self.memory_facts = replace(self.memory_facts, static_kv_tokens=slots.slots * slots.slot_tokens)
        base, size = self._fast_batched_reason
        self.backend.reason = _fast_batched_reason(base, size, slots.slots, slots.slot_tokens, measured=True)
        log.info("batched fast path: %d KV slots of %d tokens; worst step's peak reserved %s of %s", slots.slots,
                 slots.slot_tokens, human_bytes(self._fast_profile["peak_reserved_bytes"]),
                 human_bytes(self.memory_budget.budget_bytes))

    def _fall_back_to_eager_batch(self, exc: Exception) -> None:
        """The batched fast path's slots do not fit (measured at start-up): its loop, slots and graphs are released
        and transformers' forward batches the replies (llm_core.engine.serving), with the reason in the model
        panel."""
        log.warning("batched fast path released at start-up: %s", exc)
        scheduler = self.fast_scheduler
        size = scheduler.decoder.slots
        scheduler.close()
        slots = scheduler.decoder
        slots._graphs.clear()
        slots.k = slots.v = None
        self.fast_scheduler = None
        self._fast_profile = None
        self.memory_facts = self._plain_facts
        free_memory(self.loaded.device)
        self._serve_eager_batched(size, f"no room for the batched fast path's KV slots on this card: {exc}")

    def _fall_back_to_plain(self, decoder: Any, exc: Exception) -> None:
        """Start-up never fails for a model whose weights fit: when the fast path's cache cannot fit beside them
        (found while warming up or measuring), its cache and graphs are released and plain generate serves, with
        the reason in the model panel."""
        log.warning("fast path released at start-up: %s", exc)
        decoder.release()
        self.backend = self._plain_backend(f"no room for the fast path's KV cache on this card: {exc}")
        self.memory_facts = self._plain_facts
        self._fast_profile = None
        self._prefill_graph_tokens = self._held_free_bytes = 0
        free_memory(self.loaded.device)

    def _warm_fast_decoder(self, decoder: Any, say: Callable[[str], None]) -> None:
        """decoder.warmup(); a CUDA OOM there (the planned cache, its graphs and the prefill's working memory did
        not fit after all: the plan is an estimate) shrinks the cache by a third and tries again, twice."""
        for attempt in range(3):
            try:
                decoder.warmup()
                return
            except torch.cuda.OutOfMemoryError as exc:
                traceback.clear_frames(exc.__traceback__)
                free_memory(self.loaded.device)
                tokens = int(decoder.max_cache_len) * 2 // 3 // 16 * 16
                if attempt == 2 or tokens < MIN_FAST_CACHE_TOKENS:
                    raise ContextBudgetError(
                        f"The fast decode path ran out of memory while warming up with a KV cache of "
                        f"{decoder.max_cache_len:,} tokens in a budget of "
                        f"{human_bytes(self.memory_budget.budget_bytes)}. {FAST_CACHE_ADVICE}") from None
                say(f"Out of memory while warming up: retrying with a KV cache of {tokens:,} tokens…")
                log.warning("fast path warm-up OOM with %d cache tokens; retrying with %d",
                            decoder.max_cache_len, tokens)
                decoder.max_cache_len = tokens

    def _profile_fast_cache(self, decoder: Any, say: Callable[[str], None]) -> None:
        """CUDA: size the fast path's static cache by measurement, not prediction (issue 17; vLLM sizes its KV cache
        the same way): llm_core.memory.plan.size_cache_by_measurement over the decoder's worst-reply profile. The
        final cache is the per-reply bound: a reply whose prompt + new tokens fit the cache fits the card."""
        def resize(tokens: int) -> None:
            say(f"Sizing the KV cache from measured memory: {decoder.cache_len:,} -> {tokens:,} tokens…")
            decoder.max_cache_len = tokens
            decoder.resize_cache(tokens, strict=True)

        self._fast_profile = self._size_by_measurement(lambda: int(decoder.cache_len), resize,
                                                       decoder.profile_worst_reply, decoder.cache_bytes_per_token)
        self.memory_facts = replace(self.memory_facts, static_kv_tokens=decoder.cache_len)
        log.info("fast path KV cache: %d tokens; worst reply's peak reserved %s of %s", decoder.cache_len,
                 human_bytes(self._fast_profile["peak_reserved_bytes"]), human_bytes(self.memory_budget.budget_bytes))

    def _size_by_measurement(self, current: Callable[[], int], resize: Callable[[int], None],
                             profile: Callable[[], dict[str, int]], bytes_per_token: int) -> dict[str, int]:
        """llm_core.memory.plan.size_cache_by_measurement over `profile` (the worst moment at the current size; a
        CUDA OOM there counts as over), re-sizing with `resize`; leaves the size it keeps in place and returns its
        profile."""
        from ..memory.plan import size_cache_by_measurement

        profiles: dict[int, dict[str, int]] = {}
        allocated = True  # False after a re-size that ran out of memory part-way: the next size is allocated anew

        def measure(tokens: int) -> int | None:
            nonlocal allocated
            try:
                if tokens != current() or not allocated:
                    log.info("KV cache re-sized from measurement: %d -> %d tokens", current(), tokens)
                    allocated = False
                    resize(tokens)  # may itself run out of memory (the cache, or capturing its graphs)
                    allocated = True
                profiles[tokens] = profile()
            except torch.cuda.OutOfMemoryError as exc:
                traceback.clear_frames(exc.__traceback__)
                free_memory(self.loaded.device)
                return None
            return profiles[tokens]["peak_reserved_bytes"]

        tokens = size_cache_by_measurement(measure, current(), bytes_per_token, self.memory_budget.budget_bytes,
                                           int(self.loaded.context_length))
        if tokens != current() or not allocated:  # the last size measured was not the one kept
            if measure(tokens) is None:
                raise ContextBudgetError(f"The KV cache of {tokens:,} tokens that fitted at start-up did not fit when "
                                         f"allocated again. {FAST_CACHE_ADVICE}")
        return profiles[tokens]

    def _measure_fast_resident(self, decoder: Any) -> None:
        """What the fast path holds beyond weights and cache, after giving back every cached block the allocator
        can: its buffers and graph pools, plus the fragments that empty_cache cannot return (free blocks inside
        segments still in use; ~1 GiB after warm-up under an 8 GiB cap on the H200, bench/results/
        2026-12-01-h200-cards.json): no reply can count on them, so they are planned as held."""
        if self.loaded.device.type != "cuda":
            return
        torch.cuda.empty_cache()
        after = device_allocated_bytes(self.loaded.device)
        if after is not None and self._allocated_before_decode is not None:
            pools = decoder.graph_pool_idle_bytes()
            fragments = max(0, _cached_free_bytes(self.loaded.device) - pools)
            self._held_free_bytes = pools + fragments  # planned as resident: see _final_stats
            self.memory_facts = replace(self.memory_facts, resident_extra_bytes=resident_extra_bytes(
                self.memory_facts, self._allocated_before_decode, after, pools + fragments))

    def _fit_fast_cache(self, max_new_tokens: int, say: Callable[[str], None] | None = None) -> bool:
        """Re-plan the static cache with the facts as they are now (measured resident bytes, learned reserve) and
        shrink it when a reply filling it would no longer fit the budget: a recapture of its graphs, never a
        compile. Memoized on the facts: costs a dict lookup when nothing changed."""
        decoder = self.fast_decoder
        if decoder is None:
            return False
        key = (self.memory_facts, max_new_tokens)
        if getattr(self, "_cache_fitted_for", None) == key:
            return False
        from ..memory.plan import static_cache_plan

        plan = static_cache_plan(self.memory_facts, self.memory_budget.budget_bytes, max_new_tokens=max_new_tokens,
                                 prefill_chunk_tokens=self._prefill_chunk_tokens,
                                 kv_cache=self._fast_kv_cache,
                                 resident_extra_bytes=self.memory_facts.resident_extra_bytes,
                                 prefill_graph_tokens=self._prefill_graph_tokens)
        tokens = max(plan.tokens, min(decoder.cache_len, 2 * max_new_tokens + 16))  # keep room for a short reply
        resized = tokens < decoder.cache_len
        if resized:
            if say is not None:
                say(f"Re-sizing the KV cache from {decoder.cache_len:,} to {tokens:,} tokens for the measured memory…")
            log.info("fast path KV cache re-planned: %d -> %d tokens", decoder.cache_len, tokens)
            decoder.max_cache_len = tokens
            decoder.resize_cache(tokens)
            self.memory_facts = replace(self.memory_facts, static_kv_tokens=decoder.cache_len)
            self._measure_fast_resident(decoder)
        self._cache_fitted_for = (self.memory_facts, max_new_tokens)
        return resized

    @property
    def report(self) -> Any:
        return self.loaded.report

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """Hold the engine with no reply running (e.g. to unload it)."""
        with self._lock.exclusive():
            yield

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

    def _encode(self, messages: list[dict[str, str]], memo: dict[Any, Any] | None = None) -> Any:
        """The chat template applied and tokenized. `memo` is one request's: fitting the history counts the same
        lists that the prompt is then encoded from (one tokenization each, not two). Nothing outlives the request,
        so a refused prompt's encoding is never kept."""
        key = tuple((m["role"], m["content"]) for m in messages)
        encoded = memo.get(key) if memo is not None else None
        if encoded is None:
            with self._tokenizer_lock:  # concurrent requests share one tokenizer (not thread-safe)
                encoded = self.loaded.tokenizer.apply_chat_template(
                    messages, add_generation_prompt=True, return_dict=True, return_tensors="pt"
                )
            if memo is not None:
                memo[key] = encoded
        return encoded

    def prepare(self, message: str, turns: list[Turn], *, gen: GenerationSettings, history_turns: int,
                system_prompt: str | None) -> PreparedPrompt:
        """fit_history + encode_chat: the prompt for this request within the context budget."""
        kv = self.kv_cache if gen.kv_cache == "auto" else gen.kv_cache
        fast = self._fast_serves(kv)
        measured = fast and self._fast_profile is not None  # the cache is the memory bound (_profile_fast_cache)
        if fast and not measured:  # the reserve learned from earlier replies may ask for a smaller cache: re-plan
            self._fit_fast_cache(self.settings.generation.max_new_tokens)
        context = self.context_limit if fast else self.loaded.context_length
        budget_tokens = context - gen.max_new_tokens
        if budget_tokens <= 0:
            raise InputError(f"max_new_tokens ({gen.max_new_tokens:,}) leaves no room for a prompt in the "
                             f"{context:,}-token context; lower it.")
        memo: dict[Any, Any] = {}

        def count(messages: list[dict[str, str]]) -> int:
            return int(self._encode(messages, memo)["input_ids"].shape[-1])

        fitted = fit_history(system_prompt, turns, message, max_turns=history_turns,
                             budget_tokens=budget_tokens, count_tokens=count)
        # Memory guard: predict this reply's peak; drop more old turns, then lower max_new_tokens, else refuse.
        self.oom_injector.check("plan")
        chunk = self._prefill_chunk_tokens
        newest_only = count(build_messages(system_prompt, [], message)) if fitted.kept_turns else (
            fitted.prompt_tokens)  # what can never be dropped: system prompt + newest message
        if measured:  # fits the cache, so fits the card: the start-up profile measured the worst such reply
            predicted = predict_peak_bytes(self.memory_facts, fitted.prompt_tokens, gen.max_new_tokens, kv,
                                           prefill_chunk_tokens=chunk)
            # the graph pools' and fragments' bytes are reserved, never allocated: as reserve, so that the panel's
            # predicted allocated peak compares with torch's allocated one
            held = self._held_free_bytes
            predicted = replace(predicted, reserve_bytes=predicted.reserve_bytes + held)
            plan = ReplyPlan(True, fitted.prompt_tokens, gen.max_new_tokens, predicted, "",
                             budget_bytes=self.memory_budget.budget_bytes)
        else:
            plan = require_fit(plan_reply(self.memory_facts, self.memory_budget.budget_bytes, fitted.prompt_tokens,
                                          gen.max_new_tokens, kv, min_prompt_tokens=newest_only,
                                          prefill_chunk_tokens=chunk))
        if plan.trims_prompt:
            fitted = fit_history(system_prompt, turns, message, max_turns=history_turns,
                                 budget_tokens=plan.allowed_prompt_tokens, count_tokens=count)
        encoded = self._encode(fitted.messages, memo)
        device = self.loaded.device
        switched = "" if fast or self.backend.name not in ("fast", "fast-batched") else (
            f"KV cache {kv} asked for this reply: the plain path serves it, not the fast path (whose cache is "
            f"{self._fast_kv_cache}).")
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
                    on_wait: Callable[[int], None] | None = None) -> Iterator[ReplyUpdate]:
        """Stream a reply to `message` after `history`. Yields ReplyUpdate; the last one has done=True.
        `request_id` is what Stop names (a browser session); `person` is whom admission and fair turns count the
        request for (llm_core.security.person_of; unset: the request_id).

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
            with self._lock.ticket(person or request_id, stop_event) as ticket:  # refused when the person is full
                try:
                    prepared = self.prepare(text, history, gen=gen, history_turns=history_turns,
                                            system_prompt=system_prompt)
                except Exception as exc:  # OOM while tokenizing/planning: same recovery as in the worker
                    if not is_oom_error(exc):
                        raise
                    raise self._translate(exc) from exc
                ticket.wait(on_wait)
                yield from self._stream(prepared, stop_event, start_s)
        finally:
            with self._stops_lock:
                events = self._stops.get(request_id, [])
                if stop_event in events:
                    events.remove(stop_event)
                if not events:
                    self._stops.pop(request_id, None)

    def _stream(self, prepared: PreparedPrompt, stop_event: threading.Event, start_s: float
                ) -> Iterator[ReplyUpdate]:
        loaded, gen = self.loaded, prepared.gen
        clock = TokenClock(start_s)
        streamer = _TimedStreamer(loaded.tokenizer, clock, gen.stream_timeout_s)
        peak = PeakMeter(loaded.device)
        report = loaded.report
        backend = self._backend_for(prepared.kv_cache)
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
        if backend is self._plain:  # the kept cache when it serves this reply (run() gives it back), else a new one
            claimed = self._plain_prefix.claim(stop_event) if self._plain_prefix and prepared.kv_cache == "bf16" \
                else None
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
                if self._plain_prefix is not None:
                    self._plain_prefix.release(stop_event, None)

        cached_free = _cached_free_bytes(loaded.device)
        if not getattr(backend, "measures_peak", False):  # overlapping replies: the backend records each one's peak
            peak.start()
        worker_done = self._workers.submit(work)
        reply = ""
        try:
            try:
                for chunk in streamer:
                    reply += chunk
                    yield ReplyUpdate(reply, self._live_stats(stats, clock))
            except Exception as exc:  # queue.Empty: no token within stream_timeout_s
                if errors:
                    cache = None  # drop the KV cache before recovering memory
                    raise self._translate(errors[0]) from None
                stop_event.set()
                raise GenerationError(
                    f"No new token for {gen.stream_timeout_s:.0f} s; the reply was stopped. Try again, or "
                    "lower max new tokens."
                ) from exc
            worker_done.wait(_JOIN_TIMEOUT_S)
            if errors:
                cache = None  # drop the KV cache before recovering memory
                raise self._translate(errors[0]) from None
            stats = replace(stats, cached_prompt_tokens=cached[0] if cached else 0)
            final = self._final_stats(stats, clock, peak, cache, stop_event, prepared, loaded, backend,
                                          cached_free)
            yield ReplyUpdate(reply, final, done=True, token_ids=tuple(clock.token_ids))
        finally:
            stop_event.set()  # the consumer went away (Stop, disconnect, error): halt the worker too
            worker_done.wait(_JOIN_TIMEOUT_S)

    def _live_stats(self, stats: ReplyStats, clock: TokenClock) -> ReplyStats:
        return replace(stats, **clock.snapshot())

    def _final_stats(self, stats: ReplyStats, clock: TokenClock, peak: PeakMeter, cache: Any,
                     stop_event: threading.Event, prepared: PreparedPrompt, loaded: LoadedModel,
                     backend: DecodeBackend, cached_free: int = 0) -> ReplyStats:
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
        profiled = backend.name == "fast" and self._fast_profile is not None  # bounded by measurement instead
        if reserved and prepared.predicted is not None and not profiled:  # learn the allocator's reserve
            # Blocks already cached and free when the reply started (warm-up's, an earlier longer reply's) are in
            # the reserved peak without being this reply's doing, and the allocator frees them before it would
            # fail: left out, or one long reply (or the warm-up) would inflate every later plan (issue 17).
            releasable = max(0, cached_free - self._held_free_bytes)  # pools, fragments: counted
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
            if self._plain_prefix is not None:  # the kept KV goes first (the static caches' ids are already forgotten)
                self._plain_prefix.drop()
            free_memory(self.loaded.device)
            return OutOfMemoryError(
                "The device ran out of memory during this reply. Memory was freed and the conversation kept; "
                "lower max new tokens or the history length and try again."
            )
        return GenerationError(f"Generation failed: {type(exc).__name__}: {str(exc)[:300]}")


def _fast_batched_reason(base: str, size: int, slots: int, slot_tokens: int, *, measured: bool = False) -> str:
    sized = ", sized by measurement" if measured else ""
    return (f"{base}; batched: MAX_BATCH_SIZE={size}, {slots} KV slots of {slot_tokens:,} tokens{sized} (every "
            "reply is a row of one decode step)")


def _cached_free_bytes(device: torch.device) -> int:
    """CUDA: bytes the caching allocator holds free (reserved - allocated) right now; 0 elsewhere."""
    if device.type != "cuda":
        return 0
    return max(0, torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))


def _pad_id(loaded: LoadedModel) -> int | None:
    pad = loaded.tokenizer.pad_token_id
    if pad is None:
        eos = loaded.eos_token_ids
        pad = min(eos) if eos else None
    return pad
