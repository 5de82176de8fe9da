"""The runners: what produces the tokens of one prepared prompt (transformers' generate, the fast path's static
cache), behind the DecodeBackend interface the engine streams from; and BatchRunner, what the one batch scheduler
(llm_core.engine.scheduler) drives: eager_runner (transformers' forward), fast_runner (the fast path's slots or
paged pool) and cpu_runner (the CPU path's static cache). Knows nothing of history, text or Gradio."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from ..config import GenerationSettings
from ..errors import GenerationError
from ..history import FittedHistory
from ..memory.kv_cache import cache_kwarg, make_cache, prefill_in_chunks
from ..types import LoadedModel
from .plain_prefix import PlainPrefixCache

if TYPE_CHECKING:
    from ..streams import QueuedReply


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


class RowHost(Protocol):
    """What a BatchRunner calls back on its scheduler (llm_core.engine.scheduler.Scheduler), on the loop thread."""

    eos_token_ids: frozenset[int]
    stats: Any  # the runner's counters (new_stats), live

    @property
    def cond(self) -> threading.Condition: ...

    def finish(self, request: QueuedReply, reason: str, error: BaseException | None = None) -> None: ...

    def deliver(self, request: QueuedReply, token: int, new_tokens: int, min_new_tokens: int = 0) -> str | None: ...

    def requeue_first(self, request: QueuedReply) -> None: ...


class BoundRunner:
    """A BatchRunner's link to its scheduler: Scheduler.__init__ calls bind(), the runner reads `host`."""

    _bound: RowHost | None = None

    def bind(self, host: RowHost) -> None:
        self._bound = host

    @property
    def host(self) -> RowHost:
        assert self._bound is not None, "bind() the runner to its scheduler first"
        return self._bound

    @staticmethod
    def held(ref: Callable[[], Any]) -> Any:
        """What a runner holds by weak reference (the eager runner's model, the CPU runner's decoder), or the error
        its reply ends with once the engine dropped it."""
        target = ref()
        if target is None:
            raise GenerationError("The model was unloaded; this reply was stopped.")
        return target


@contextmanager
def grad_off() -> Iterator[None]:
    """The mode a compiled decoder's warm-up ran in, so no step recompiles: autograd off, not inference mode (the
    fast and CPU runners' loop_mode)."""
    with torch.inference_mode(False), torch.no_grad():
        yield


class BatchRunner(Protocol):
    """The rows of one batch and the device work on them, driven by the scheduler's loop thread: how a row's KV is
    held (a left-padded DynamicCache row, a static slot, paged blocks), how it is prefilled (whole at admission or in
    chunks between steps), how a step is run and measured. The scheduler owns the queue and the order; a runner ends
    its own rows (record, release, then host.finish). Row lists change under host.cond (snapshot reads them)."""

    label: str  # "The batch scheduler": the start of its loop's error messages
    thread_name: str
    shutdown_message: str  # what replies still running are told when the loop ends
    max_overtakes: int  # how often a waiting request may be overtaken by a later one that fits (0: strict FIFO)
    admission_prefill_tokens: int | None  # prompt tokens one admission round may prefill (None: no bound)

    @property
    def max_batch_size(self) -> int: ...

    def bind(self, host: RowHost) -> None: ...

    def new_request(self, prompt_ids: list[int], options: Any, max_new_tokens: int, stop_event: threading.Event,
                    record: Any) -> QueuedReply:
        """A request, or the error for one this runner could never hold (its KV over the budget or a slot)."""

    def new_stats(self) -> Any: ...

    def snapshot(self, stats: Any, waiting: int) -> Any:
        """A copy of `stats` with the live figures (rows, KV, `waiting` queued); under host.cond."""

    def count_wait(self, stats: Any, reason: str) -> bool:
        """Count a request that waits for `reason` ("row": none free, "memory": its KV does not fit); False when
        this runner keeps no counter for it (the request may be counted later for another reason)."""

    def warm(self) -> None:
        """Ready the device before the loop starts (the fast runner: allocate the slots, compile, capture)."""

    def resize(self, slot_tokens: int) -> None:
        """A new slot length before the loop starts (Scheduler.resize_slots; runners with fixed slots)."""

    def loop_mode(self) -> AbstractContextManager[Any]:
        """The autograd mode the loop runs in (the fast runner: its warm-up's, so no step recompiles)."""

    def usable(self) -> bool:
        """False once the loop must end (the eager runner's model was unloaded)."""

    def busy(self) -> bool:
        """Rows decoding or prefilling."""

    def decoding(self) -> bool: ...

    def has_free_row(self) -> bool: ...

    def fits(self, request: QueuedReply) -> bool:
        """Whether `request` can take a row now (its KV within the budget, its blocks free); no side effect."""

    def admit(self, request: QueuedReply) -> None:
        """Give `request` a row (outside host.cond): prefill and join (eager) or start its chunked prefill (fast)."""

    def advance_prefills(self) -> None:
        """Prefill chunks between decode steps; rows whose prompt is in pick their first token and decode."""

    def decode_step(self) -> None:
        """One step for every decoding row: each row's token delivered (host.deliver), rows that end released."""

    def drop_stopped_rows(self) -> None:
        """Rows whose request's stop_event is set leave (finished as stopped)."""

    def fail_all(self, exc: BaseException) -> None:
        """A step raised out of the runner: end every row with an error, keep the runner usable."""

    def take_all(self) -> list[QueuedReply]:
        """The loop ends: every row's request, the rows dropped (the scheduler finishes them); under host.cond."""


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
        processors, criteria = gen.control.hf_hooks() if gen.control is not None else (None, None)
        kwargs: dict[str, Any] = dict(
            input_ids=prepared.input_ids, attention_mask=prepared.attention_mask,
            max_new_tokens=gen.max_new_tokens, do_sample=gen.do_sample,
            repetition_penalty=gen.repetition_penalty, streamer=streamer, use_cache=True,
            stopping_criteria=StoppingCriteriaList([c for c in (criteria, stop) if c is not None]),
            pad_token_id=_pad_id(self.loaded), logits_processor=[processors] if processors is not None else None,
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


def _pad_id(loaded: LoadedModel) -> int | None:
    pad = loaded.tokenizer.pad_token_id
    if pad is None:
        eos = loaded.eos_token_ids
        pad = min(eos) if eos else None
    return pad
