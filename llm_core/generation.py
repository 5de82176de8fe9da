"""The chat engine: fit_history -> encode_chat -> start_stream -> iterate -> stats. Knows nothing about Gradio.

Generation runs in a worker thread feeding a `TextIteratorStreamer` with a timeout; the caller iterates text
updates. Stop sets a per-request event checked by a stopping criterion, so the worker really halts. A worker
exception is re-raised in the caller as a GenerationError (OutOfMemoryError after freeing memory); a stalled
worker raises after `stream_timeout_s`. Nothing can wait forever.
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from transformers import StoppingCriteria, StoppingCriteriaList, TextIteratorStreamer

from .config import GenerationSettings, Settings
from .errors import GenerationError, InputError, LLMCoreError, OutOfMemoryError, SettingsError
from .history import FittedHistory, Turn, clean_text, fit_history
from .loading import LoadedModel, Progress, load_model
from .metrics import PeakMemory, ReplyStats, TokenClock, cache_bytes

# How long the caller waits for the worker thread to wind down after a stop or an error.
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
    fitted: FittedHistory
    input_ids: torch.Tensor  # (1, prompt_tokens) on the model's device
    attention_mask: torch.Tensor  # (1, prompt_tokens)
    max_new_tokens: int
    notes: tuple[str, ...] = ()


class _StopOnEvent(StoppingCriteria):
    """Halts `generate` between steps once the request's stop event is set."""

    def __init__(self, event: threading.Event) -> None:
        self.event = event

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
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


@dataclass
class DecodeBackend:
    """The loop that produces tokens: plain `model.generate`, or the fast static-cache path."""

    name: str
    reason: str
    run: Callable[..., Any]  # (prepared, gen, streamer, stop_event, cache) -> None
    make_cache: Callable[[], Any] = field(default=lambda: None)


class ChatEngine:
    """Holds one loaded model for the life of the process and serves streamed chat replies, one at a time."""

    def __init__(self, loaded: LoadedModel, settings: Settings) -> None:
        self.loaded = loaded
        self.settings = settings
        self._lock = threading.Lock()  # one reply on the device at a time
        self._stops: dict[str, threading.Event] = {}
        self._stops_lock = threading.Lock()
        self.backend = self._plain_backend("DECODE_PATH=plain" if settings.model.decode_path == "plain" else "")
        self._select_backend()

    # --- construction --------------------------------------------------------------------------
    @classmethod
    def load(cls, settings: Settings, progress: Progress | None = None, *, warmup: bool = True) -> ChatEngine:
        engine = cls(load_model(settings.model, progress), settings)
        if warmup:
            engine.warmup(progress)
        return engine

    def _plain_backend(self, reason: str) -> DecodeBackend:
        return DecodeBackend("plain", reason, self._run_plain, self._dynamic_cache)

    def _dynamic_cache(self) -> Any:
        from transformers import DynamicCache

        return DynamicCache(config=self.loaded.model.config)

    def _select_backend(self) -> None:
        mode = self.settings.model.decode_path
        if mode == "plain":
            return
        try:
            from . import fast_decode
        except ImportError as exc:  # the fast path is optional: the plain path always works
            if mode == "fast":
                raise SettingsError(f"DECODE_PATH=fast, but the fast decode path is unavailable: {exc}") from exc
            self.backend = self._plain_backend(f"fast path unavailable: {exc}")
            return
        ok, reason = fast_decode.fast_path_support(self.loaded)
        if not ok and mode == "auto":
            self.backend = self._plain_backend(reason)
            return
        if not ok and mode == "fast" and self.loaded.device.type == "cuda":
            raise SettingsError(f"DECODE_PATH=fast cannot run here: {reason}. Use DECODE_PATH=auto.")
        decoder = fast_decode.FastDecoder(self.loaded)

        def run_fast(prepared: PreparedPrompt, gen: GenerationSettings, streamer: Any,
                     stop_event: threading.Event, cache: Any) -> None:
            decoder.generate(prepared.input_ids, prepared.attention_mask, gen, streamer, stop_event,
                             prepared.max_new_tokens)

        self.backend = DecodeBackend("fast", reason, run_fast, lambda: getattr(decoder, "cache", None))
        self._fast_decoder = decoder

    def warmup(self, progress: Progress | None = None) -> float:
        """Run once at start-up (never per request): first-call costs (kernel repacking, compile) happen here."""
        say = progress or (lambda _m: None)
        say(f"Warming up ({self.backend.name} decode path)…")
        t0 = time.perf_counter()
        decoder = getattr(self, "_fast_decoder", None)
        if decoder is not None:
            decoder.warmup()
        gen = replace(self.settings.generation, max_new_tokens=2, do_sample=False)
        for _ in self.stream_chat("Hi", [], gen=gen, history_turns=0, system_prompt=None):
            pass
        warmup_s = time.perf_counter() - t0
        self.loaded.report = replace(self.loaded.report, warmup_s=round(warmup_s, 3),
                                     decode_path=self.backend.name, decode_path_reason=self.backend.reason)
        say(f"Ready ({warmup_s:.1f} s warm-up).")
        return warmup_s

    @property
    def report(self) -> Any:
        return self.loaded.report

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """Hold the engine with no reply running (e.g. to unload it)."""
        with self._lock:
            yield

    # --- requests ------------------------------------------------------------------------------
    def request_options(self, **options: Any) -> GenerationSettings:
        """Per-request generation options on top of the configured defaults, validated (InputError if bad)."""
        unknown = set(options) - set(GenerationSettings.__dataclass_fields__)
        if unknown:
            raise InputError(f"Unknown generation option(s): {', '.join(sorted(unknown))}.")
        clean = {k: v for k, v in options.items() if v is not None}
        for key in ("max_new_tokens", "top_k", "seed"):
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
            return replace(self.settings.generation, **clean).validate()
        except SettingsError as exc:
            raise InputError(str(exc).replace("MAX_NEW_TOKENS", "max_new_tokens")) from None

    def count_tokens(self, messages: list[dict[str, str]]) -> int:
        return int(self._encode(messages)["input_ids"].shape[-1])

    def _encode(self, messages: list[dict[str, str]]) -> Any:
        return self.loaded.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_dict=True, return_tensors="pt"
        )

    def prepare(self, message: str, turns: list[Turn], *, gen: GenerationSettings, history_turns: int,
                system_prompt: str | None) -> PreparedPrompt:
        """fit_history + encode_chat: the prompt for this request within the context budget."""
        budget_tokens = self.loaded.context_length - gen.max_new_tokens
        if budget_tokens <= 0:
            raise InputError(f"max_new_tokens ({gen.max_new_tokens:,}) leaves no room for a prompt in the "
                             f"{self.loaded.context_length:,}-token context; lower it.")
        fitted = fit_history(system_prompt, turns, message, max_turns=history_turns,
                             budget_tokens=budget_tokens, count_tokens=self.count_tokens)
        encoded = self._encode(fitted.messages)
        device = self.loaded.device
        note = fitted.describe()
        notes = (note,) if note else ()
        return PreparedPrompt(fitted, encoded["input_ids"].to(device), encoded["attention_mask"].to(device),
                              gen.max_new_tokens, notes)

    def stop(self, request_id: str | None) -> bool:
        """Halt the reply running for `request_id` (e.g. a browser session). True if one was running."""
        if request_id is None:
            return False
        with self._stops_lock:
            event = self._stops.get(request_id)
        if event is None:
            return False
        event.set()
        return True

    def stream_chat(self, message: Any, history: list[Turn], *, gen: GenerationSettings | None = None,
                    history_turns: int | None = None, system_prompt: str | None = "",
                    request_id: str | None = None) -> Iterator[ReplyUpdate]:
        """Stream a reply to `message` after `history`. Yields ReplyUpdate; the last one has done=True."""
        start_s = time.perf_counter()
        gen = gen or self.settings.generation
        history_turns = self.settings.chat.history_turns if history_turns is None else history_turns
        if system_prompt == "":
            system_prompt = self.settings.chat.system_prompt
        text = clean_text(message, max_chars=self.settings.chat.max_message_chars)
        if isinstance(history_turns, bool) or not isinstance(history_turns, int) or history_turns < 0:
            raise InputError(f"history_turns must be a whole number of 0 or more, got {history_turns!r}.")
        request_id = request_id or uuid.uuid4().hex
        with self._lock:
            prepared = self.prepare(text, history, gen=gen, history_turns=history_turns, system_prompt=system_prompt)
            yield from self._stream(prepared, gen, request_id, start_s)

    def _stream(self, prepared: PreparedPrompt, gen: GenerationSettings, request_id: str,
                start_s: float) -> Iterator[ReplyUpdate]:
        loaded = self.loaded
        stop_event = threading.Event()
        with self._stops_lock:
            self._stops[request_id] = stop_event
        clock = TokenClock(start_s)
        streamer = _TimedStreamer(loaded.tokenizer, clock, gen.stream_timeout_s)
        peak = PeakMemory(loaded.device)
        report = loaded.report
        stats = ReplyStats(
            model=report.model, revision=report.revision, quantization=report.quantization,
            double_quant=report.double_quant,
            compute_dtype=report.compute_dtype, attention=report.attention, decode_path=self.backend.name,
            device=report.device_name, versions=dict(report.versions),
            prompt_tokens=int(prepared.input_ids.shape[-1]), weights_bytes=report.weights_bytes,
            dropped_turns=prepared.fitted.dropped_turns, notes=list(prepared.notes),
        )
        cache = self.backend.make_cache()
        errors: list[BaseException] = []

        def work() -> None:
            try:
                with torch.inference_mode():
                    self.backend.run(prepared, gen, streamer, stop_event, cache)
            except BaseException as exc:  # relayed to the caller below, never swallowed
                errors.append(exc)
                streamer.end()

        peak.start()
        worker = threading.Thread(target=work, name=f"generate-{request_id[:8]}", daemon=True)
        worker.start()
        reply = ""
        try:
            try:
                for chunk in streamer:
                    reply += chunk
                    peak.sample()
                    yield ReplyUpdate(reply, self._live_stats(stats, clock))
            except Exception as exc:  # queue.Empty: no token within stream_timeout_s
                if errors:
                    raise self._translate(errors[0]) from errors[0]
                stop_event.set()
                raise GenerationError(
                    f"No new token for {gen.stream_timeout_s:.0f} s; the reply was stopped. Try again, or "
                    "lower max new tokens."
                ) from exc
            worker.join(_JOIN_TIMEOUT_S)
            if errors:
                raise self._translate(errors[0]) from errors[0]
            final = self._final_stats(stats, clock, peak, cache, stop_event, prepared, loaded)
            yield ReplyUpdate(reply, final, done=True, token_ids=tuple(clock.token_ids))
        finally:
            stop_event.set()  # the consumer went away (Stop, disconnect, error): halt the worker too
            worker.join(_JOIN_TIMEOUT_S)
            with self._stops_lock:
                if self._stops.get(request_id) is stop_event:
                    del self._stops[request_id]

    def _live_stats(self, stats: ReplyStats, clock: TokenClock) -> ReplyStats:
        return replace(stats, **clock.snapshot())

    def _final_stats(self, stats: ReplyStats, clock: TokenClock, peak: PeakMemory, cache: Any,
                     stop_event: threading.Event, prepared: PreparedPrompt, loaded: LoadedModel) -> ReplyStats:
        timing = clock.snapshot()
        count, rate = timing["new_tokens"], timing["decode_tokens_per_s"]
        if loaded.device.type == "cuda":
            torch.cuda.synchronize(loaded.device)
        end_to_end_s = time.perf_counter() - clock.start_s
        eos_ids = _eos_ids(loaded)
        if stop_event.is_set():
            reason = "stopped"
        elif clock.token_ids and clock.token_ids[-1] in eos_ids:
            reason = "eos"
        else:
            reason = "length" if count >= prepared.max_new_tokens else "eos"
        kv = cache_bytes(cache if cache is not None else self.backend.make_cache())
        return replace(
            stats, **timing, end_to_end_s=end_to_end_s,
            kv_cache_bytes=kv, finish_reason=reason,
            decode_bandwidth_bytes_per_s=(rate * loaded.report.weights_bytes) if rate else None,
            **peak.read(),
        )

    def _run_plain(self, prepared: PreparedPrompt, gen: GenerationSettings, streamer: Any,
                   stop_event: threading.Event, cache: Any) -> None:
        model = self.loaded.model
        kwargs: dict[str, Any] = dict(
            input_ids=prepared.input_ids, attention_mask=prepared.attention_mask,
            max_new_tokens=prepared.max_new_tokens, do_sample=gen.do_sample,
            repetition_penalty=gen.repetition_penalty, streamer=streamer, use_cache=True,
            stopping_criteria=StoppingCriteriaList([_StopOnEvent(stop_event)]),
            pad_token_id=_pad_id(self.loaded),
        )
        if cache is not None:
            kwargs[cache_kwarg_name(model)] = cache
        if gen.do_sample:
            kwargs.update(temperature=gen.temperature, top_p=gen.top_p, top_k=gen.top_k)
            if gen.seed is not None:
                torch.manual_seed(gen.seed)
        else:  # greedy: neutralise sampling defaults from the model's generation_config
            kwargs.update(temperature=None, top_p=None, top_k=None)
        model.generate(**kwargs)

    def _translate(self, exc: BaseException) -> LLMCoreError:
        if isinstance(exc, LLMCoreError):
            return exc
        if _is_oom(exc):
            free_device_memory(self.loaded.device)
            return OutOfMemoryError(
                "The device ran out of memory during this reply. Memory was freed and the conversation kept; "
                "lower max new tokens or the history length and try again."
            )
        return GenerationError(f"Generation failed: {type(exc).__name__}: {str(exc)[:300]}")


def cache_kwarg_name(model: Any) -> str:
    """transformers >= 5.2x names the KV-cache argument `cache`; earlier 5.x releases `past_key_values`."""
    return "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, (torch.cuda.OutOfMemoryError, MemoryError)) or (
        isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()
    )


def free_device_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _eos_ids(loaded: LoadedModel) -> set[int]:
    eos = getattr(loaded.model.generation_config, "eos_token_id", None)
    if eos is None:
        eos = loaded.tokenizer.eos_token_id
    return set(eos) if isinstance(eos, (list, tuple)) else {eos} if eos is not None else set()


def _pad_id(loaded: LoadedModel) -> int | None:
    pad = loaded.tokenizer.pad_token_id
    if pad is None:
        eos = _eos_ids(loaded)
        pad = min(eos) if eos else None
    return pad
