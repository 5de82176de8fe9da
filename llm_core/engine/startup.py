"""Start-up of the decode path: which backend serves (plain, fast, CPU, batched), its warm-up, the KV cache sized
by measurement and the fall-backs when it does not fit. Runs once at load (and re-plans the static cache when the
measured facts change); the request path (llm_core.engine.chat) only reads what it chose.

DecodeStartup is ChatEngine's start-up half: ChatEngine inherits it and owns the state it sets (the attributes
declared below, created in ChatEngine.__init__)."""

from __future__ import annotations

import logging
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from ..config import Settings
from ..errors import ContextBudgetError, SettingsError
from ..loading import Progress
from ..memory.budget import MemoryBudget
from ..memory.device import OOMInjector, device_allocated_bytes, free_memory
from ..memory.kv_cache import cache_kwarg
from ..memory.model import STATIC_KV_LAYOUTS, ModelMemoryFacts, human_bytes, resident_extra_bytes
from ..memory.plan import FAST_CACHE_ADVICE, MIN_FAST_CACHE_TOKENS
from ..prefix_cache import PrefixCache
from ..types import LoadedModel
from .admission import ReplySlots
from .eager_runner import EagerRunner
from .plain_prefix import PlainPrefixCache
from .runners import DecodeBackend, FastBackend, PlainBackend
from .scheduler import Scheduler

if TYPE_CHECKING:
    from .fast_runner import FastRunner

log = logging.getLogger(__name__)


class DecodeStartup:
    """Selects, warms up and sizes the decode path; see the module docstring."""

    loaded: LoadedModel
    settings: Settings
    backend: DecodeBackend
    memory_facts: ModelMemoryFacts
    memory_budget: MemoryBudget
    oom_injector: OOMInjector
    scheduler: Scheduler[EagerRunner] | None
    fast_scheduler: Scheduler[FastRunner] | None
    _lock: ReplySlots
    _workers: Any
    _prefill_chunk_tokens: int | None
    _prefix_cache: bool
    _plain_prefix: PlainPrefixCache | None
    _fast_profile: dict[str, int] | None
    _prefill_graph_tokens: int
    _held_free_bytes: int
    _plain_facts: ModelMemoryFacts
    _allocated_before_decode: int | None

    if TYPE_CHECKING:  # defined by ChatEngine
        @property
        def _fast_kv_cache(self) -> str: ...
        @property
        def fast_decoder(self) -> Any | None: ...
        @property
        def memory_plan(self) -> str: ...
        def stream_chat(self, *args: Any, **kwargs: Any) -> Iterator[Any]: ...

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

    def _resolve_prefill_chunk_tokens(self) -> int | None:
        from ..memory.plan import resolve_prefill_chunk_tokens

        return resolve_prefill_chunk_tokens(
            self.settings.memory.prefill_chunk_tokens, replace(self.memory_facts, fast_prefill=True),
            self.memory_budget.budget_bytes, max_new_tokens=self.settings.generation.max_new_tokens,
            kv_cache=self._fast_kv_cache)

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

    def _configure_decode(self) -> None:
        """Batched decoding (llm_core.engine.scheduler) when MAX_BATCH_SIZE resolves above 1 and the model allows it;
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
        """Concurrent replies batched by llm_core.engine.scheduler's loop over transformers' forward (models or
        cards the batched fast path does not serve)."""
        from .serving import BatchedBackend, default_kv_budget_bytes

        loaded = self.loaded
        runner = EagerRunner.for_model(
            loaded.model, max_batch_size=size,
            kv_budget_bytes=default_kv_budget_bytes(loaded, size, self.memory_budget.budget_bytes, self.memory_facts),
            cache_dtype=loaded.compute_dtype, cache_kwarg=cache_kwarg(loaded.model))
        self.scheduler = Scheduler(runner, eos_token_ids=sorted(loaded.eos_token_ids))
        self.scheduler.start()
        self.backend = BatchedBackend(self.scheduler, "; ".join(filter(None, [
            f"MAX_BATCH_SIZE={size}: concurrent replies share one decode batch", note])))
        self._lock = ReplySlots(size, session_max_waiting=self.settings.server.session_max_waiting)
        self._workers.grow(size)

    def _serve_fast_batched(self, size: int) -> None:
        """Replace the single-reply fast backend by the batched fast loop: `size` KV slots (at most 32) of the
        largest length s (<= the context) for which llm_core.memory.plan.static_cache_plan still fits a reply filling
        one slot with the other slots' blocks held as resident; fewer slots when s would be under
        MIN_FAST_CACHE_TOKENS."""
        from ..fast.batched import MAX_SLOTS, SlotDecoder
        from ..memory.plan import MIN_FAST_CACHE_TOKENS, fast_resident_estimate, static_cache_plan
        from .fast_runner import FastRunner
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
        decoder.prefix_cache = None  # its own cache serves no reply now: the slots do
        rows = SlotDecoder(decoder, slots=slots, slot_tokens=slot_tokens, layout=self.settings.memory.kv_layout)
        decoder.max_cache_len = rows.reply_tokens  # the engine fits every history to one slot, or the pool
        scheduler = Scheduler(FastRunner(rows, prefix_cache=self._prefix_cache),
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
        measurement as the single-reply cache is: SlotDecoder.profile_worst_reply
        runs one slot's last prefill chunk at the end of a full slot and a step with every slot decoding, and
        size_cache_by_measurement re-sizes the slot length until that peak fits the budget. The slot count stays;
        when not even MIN_FAST_CACHE_TOKENS per slot fit, ContextBudgetError says to lower MAX_BATCH_SIZE (and with
        DECODE_PATH=auto, warmup() then serves the eager batch instead: _fall_back_to_eager_batch)."""
        assert self.fast_scheduler is not None
        slots = self.fast_scheduler.runner.decoder
        if slots.k is None:
            slots.warmup()
        if self.loaded.device.type == "cuda":
            self._measure_fast_slots(say)

    def _measure_fast_slots(self, say: Callable[[str], None]) -> None:
        scheduler = self.fast_scheduler
        assert scheduler is not None
        slots = scheduler.runner.decoder

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
        slots.fast.max_cache_len = slots.reply_tokens  # the context one reply may span (FastBatchedBackend.decoder)
        self.memory_facts = replace(self.memory_facts, static_kv_tokens=slots.slots * slots.slot_tokens)
        base, size = self._fast_batched_reason
        self.backend.reason = _fast_batched_reason(base, size, slots.slots, slots.slot_tokens, measured=True)
        log.info("batched fast path: %d KV slots of %d tokens; worst step's peak reserved %s of %s", slots.slots,
                 slots.slot_tokens, human_bytes(self._fast_profile["peak_reserved_bytes"]),
                 human_bytes(self.memory_budget.budget_bytes))

    def _fall_back_to_eager_batch(self, exc: Exception) -> None:
        """The batched fast path's slots do not fit (measured at start-up): its loop, slots and graphs are released
        and transformers' forward batches the replies (llm_core.engine.eager_runner), with the reason in the model
        panel."""
        log.warning("batched fast path released at start-up: %s", exc)
        scheduler = self.fast_scheduler
        assert scheduler is not None
        size = scheduler.runner.decoder.slots
        scheduler.close()
        slots = scheduler.runner.decoder
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
        """CUDA: size the fast path's static cache by measurement, not prediction (as vLLM sizes its KV cache):
        llm_core.memory.plan.size_cache_by_measurement over the decoder's worst-reply profile. The final cache is the
        per-reply bound: a reply whose prompt + new tokens fit the cache fits the card."""
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


def _fast_batched_reason(base: str, size: int, slots: int, slot_tokens: int, *, measured: bool = False) -> str:
    sized = ", sized by measurement" if measured else ""
    return (f"{base}; batched: MAX_BATCH_SIZE={size}, {slots} KV slots of {slot_tokens:,} tokens{sized} (every "
            "reply is a row of one decode step)")


def _cached_free_bytes(device: torch.device) -> int:
    """CUDA: bytes the caching allocator holds free (reserved - allocated) right now; 0 elsewhere."""
    if device.type != "cuda":
        return 0
    return max(0, torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
