"""Start-up of the decode path, never per request: select, warm up, size by measurement, fall back -> DecodePath.

select_decode_path picks what serves (plain, fast, CPU, batched) when the engine is built; warm_decode_path warms it
up, sizes its KV cache (by measurement on CUDA) and falls back where it does not fit. Each returns a frozen
DecodePath, the record of those choices, which ChatEngine (llm_core.engine.chat) reads and swaps whole. The one
re-plan after start-up (the fast path's static cache shrunk when the memory facts learned from replies change:
replan with PathBuilder.fit_fast_cache) returns a new DecodePath too. PathBuilder is one start-up's working state
(mutable until freeze()); only this module, ChatEngine's swaps and tests drive it."""

from __future__ import annotations

import logging
import traceback
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any

import torch

from ..config import Settings
from ..errors import ContextBudgetError, SettingsError
from ..memory.budget import MemoryBudget
from ..memory.device import device_allocated_bytes, free_memory, unreturnable_free_bytes
from ..memory.kv_cache import cache_kwarg
from ..memory.model import STATIC_KV_LAYOUTS, ModelMemoryFacts, human_bytes, resident_extra_bytes
from ..memory.plan import FAST_CACHE_ADVICE, MIN_FAST_CACHE_TOKENS
from ..prefix_cache import PrefixCache
from ..types import LoadedModel
from .eager_runner import EagerRunner
from .plain_prefix import PlainPrefixCache
from .runners import DecodeBackend, FastBackend, PlainBackend
from .scheduler import Scheduler
from .serving import FastBatchedBackend

if TYPE_CHECKING:
    from .fast_runner import FastRunner

log = logging.getLogger(__name__)

Say = Callable[[str], None]
FAST_NAMES = ("fast", "fast-batched")  # the backends whose static cache (or slots) hold one KV mode


@dataclass(frozen=True, eq=False)
class DecodePath:
    """What start-up chose, frozen: the engine never sets a piece of it, it swaps the whole record (a fall-back or a
    re-plan is a new DecodePath). The objects inside (a scheduler, a decoder) keep their own running state."""

    backend: DecodeBackend  # serves the replies of the default KV mode
    plain: PlainBackend  # plain generate with the KV mode a reply asks for: the modes `backend` does not hold
    kv_setting: str  # KV_CACHE as set (auto, or a mode)
    kv_choice: tuple[str, str]  # KV_CACHE as resolved for this model and budget, and the sentence that says why
    prefill_chunk_tokens: int | None  # PREFILL_CHUNK_TOKENS as resolved (None: one pass)
    prefix_cache: bool  # PREFIX_CACHE: each single-reply path prefills only what its cache does not hold
    plain_prefix: PlainPrefixCache | None  # the plain path's kept cache (PREFIX_CACHE)
    facts: ModelMemoryFacts  # the memory facts as this path left them (its static cache, what it holds resident)
    plain_facts: ModelMemoryFacts  # the memory facts of plain generate (restored on a fall-back)
    allocated_before_decode: int | None  # device bytes allocated before any decode path: resident bytes count from it
    scheduler: Scheduler[EagerRunner] | None = None  # when transformers' forward batches the replies
    fast_scheduler: Scheduler[FastRunner] | None = None  # when the fast path batches them
    replies: int = 1  # replies served at once (MAX_BATCH_SIZE when batching, the fast path's slots)
    prefill_graph_tokens: int = 0  # PREFILL_GRAPH_TOKENS as resolved (the fast path's; 0 elsewhere)
    profile: dict[str, int] | None = None  # CUDA fast path: the start-up measurement that sized its cache or slots
    held_free_bytes: int = 0  # CUDA fast path: graph pools + fragments, reserved but free (measured)
    batched_reason: tuple[str, int] | None = None  # batched fast path: the fast path's reason and MAX_BATCH_SIZE
    fitted_for: tuple[ModelMemoryFacts, int] | None = None  # the facts the static cache was last re-planned for
    notes: tuple[str, ...] = ()  # what start-up re-sized or released, in order

    @property
    def name(self) -> str:
        return self.backend.name

    @property
    def reason(self) -> str:
        """The model panel's sentence: why this path serves (the CPU runner adds a compile failure to it)."""
        return self.backend.reason

    @property
    def loops(self) -> list[Scheduler[Any]]:
        """Every scheduler loop this path runs (the eager or fast batch's, the CPU path's): each loop's thread holds
        its runner, so ChatEngine.close() stops them."""
        found = (self.scheduler, self.fast_scheduler, getattr(self.backend, "scheduler", None))
        return list({id(s): s for s in found if isinstance(s, Scheduler)}.values())

    @property
    def fast_kv_cache(self) -> str:
        """The fast path's static cache: KV_CACHE as resolved (so int8/int4 chats keep the graphed step); bf16 for
        offload, whose replies run on the plain path."""
        return _static_kv_cache(self.kv_choice[0])

    @property
    def kv_cache(self) -> str:
        """The KV cache a reply asking for auto gets: the fast path's, else bf16 where KV_CACHE=auto."""
        if self.name in FAST_NAMES:
            return self.kv_choice[0]
        return "bf16" if self.kv_setting == "auto" else self.kv_choice[0]

    @property
    def kv_cache_reason(self) -> str:
        """One sentence for the Model panel: which KV cache replies get by default, and why."""
        from ..memory.plan import AUTO_ON_PLAIN

        if self.name in FAST_NAMES or self.kv_setting != "auto":
            return self.kv_choice[1]
        return AUTO_ON_PLAIN

    @property
    def fast_decoder(self) -> Any | None:
        """The llm_core.fast FastDecoder when the single-reply fast path serves, else None."""
        return self.backend.decoder if isinstance(self.backend, FastBackend) else None

    @property
    def startup_notes(self) -> tuple[str, ...]:
        """What start-up noted, for the Model panel, each once and in order: the path's own notes (what it re-sized,
        compacted or released) and its decoders' (the kernels chosen or switched off, a compile or CUDA-graph
        fall-back), which would otherwise reach only the benchmark records."""
        slots = self.fast_scheduler.runner.decoder if self.fast_scheduler is not None else None
        found = list(self.notes)
        for decoder in (self.fast_decoder, getattr(slots, "fast", None), slots):
            found.extend(getattr(decoder, "notes", None) or ())
        return tuple(dict.fromkeys(n for n in found if n))

    def serves_fast(self, kv_cache: str) -> bool:
        """Whether a reply with this KV cache mode runs on the fast path (its static cache is of that mode)."""
        return self.name in FAST_NAMES and kv_cache == self.fast_kv_cache

    def backend_for(self, kv_cache: str) -> DecodeBackend:
        """The fast path for the KV mode of its static cache, the plain path for other modes; other backends
        (plain, batched, CPU) serve the bf16 cache themselves."""
        if self.name in FAST_NAMES:
            return self.backend if self.serves_fast(kv_cache) else self.plain
        return self.backend if kv_cache == "bf16" else self.plain

    def switch_note(self, kv_cache: str) -> str:
        """The reply's note when its KV mode moves it off the path that serves by default (the fast path, the CPU
        path, the batch): said, never silent (its stats say decode_path plain too)."""
        serving = self.backend_for(kv_cache)
        if serving is self.backend:
            return ""
        cache = self.fast_kv_cache if self.name in FAST_NAMES else "bf16"
        return (f"KV cache {kv_cache} asked for this reply: the {serving.name} path serves it, not the {self.name} "
                f"path (whose cache is {cache}).")


def memory_budget_for(loaded: LoadedModel, settings: Settings) -> MemoryBudget:
    """VRAM_BUDGET, else what the device has free after loading minus a margin (llm_core.memory.budget)."""
    budget = settings.memory.budget_bytes
    return MemoryBudget(budget, "VRAM_BUDGET") if budget else MemoryBudget.from_device(
        loaded.device, settings.memory.margin_bytes)


def select_decode_path(loaded: LoadedModel, settings: Settings, budget: MemoryBudget,
                       check_oom: Callable[[str], None]) -> DecodePath:
    """At construction: the KV mode, the prefill chunk and the backend (batched when MAX_BATCH_SIZE resolves above 1
    and the model allows it), planned from arithmetic; warm_decode_path then warms and measures it. `check_oom` is
    the engine's OOM injector, read at each call of the plain path (tests arm it)."""
    from ..memory.plan import choose_kv_cache, resolve_prefill_chunk_tokens

    facts = ModelMemoryFacts.from_loaded(loaded)
    model = settings.model
    kv_choice = choose_kv_cache(settings.generation.kv_cache, replace(facts, fast_prefill=True), budget.budget_bytes,
                                max_new_tokens=settings.generation.max_new_tokens,
                                prefill_chunk_tokens=settings.memory.prefill_chunk_tokens,
                                prefill_graph_tokens=model.prefill_graph_tokens,
                                fast_path=loaded.device.type == "cuda" and model.decode_path != "plain")
    chunk = resolve_prefill_chunk_tokens(
        settings.memory.prefill_chunk_tokens, replace(facts, fast_prefill=True), budget.budget_bytes,
        max_new_tokens=settings.generation.max_new_tokens, kv_cache=_static_kv_cache(kv_choice[0]))
    prefix = settings.memory.prefix_cache
    plain_prefix = PlainPrefixCache(loaded.model) if prefix else None
    plain = PlainBackend(loaded, "DECODE_PATH=plain" if model.decode_path == "plain" else "", chunk, check_oom,
                         plain_prefix)
    path = DecodePath(backend=plain, plain=plain, kv_setting=settings.generation.kv_cache, kv_choice=kv_choice,
                      prefill_chunk_tokens=chunk, prefix_cache=prefix, plain_prefix=plain_prefix, facts=facts,
                      plain_facts=facts, allocated_before_decode=device_allocated_bytes(loaded.device))
    builder = PathBuilder(path, loaded, settings, budget, facts)
    builder.configure_decode()
    builder.compact_weights()
    return builder.freeze()


def warm_decode_path(path: DecodePath, loaded: LoadedModel, settings: Settings, budget: MemoryBudget,
                     facts: ModelMemoryFacts, serve: Callable[[DecodePath], tuple[DecodePath, ModelMemoryFacts]],
                     say: Say) -> DecodePath:
    """Once at start-up (never per request): first-call costs (kernel repacking, compile, graphs) happen here, the
    fast path's cache or slots are sized (by measurement on CUDA) and, when they do not fit and DECODE_PATH=auto, it
    falls back (plain generate, the eager batch). `serve(path)` runs the warm-up reply on `path` and returns the path
    and memory facts as the reply left them; what that reply taught the reserve re-plans the cache (unmeasured: CPU).
    `facts`: the engine's memory facts now."""
    builder = PathBuilder(path, loaded, settings, budget, facts)
    decoder = builder.fast_decoder
    measured = decoder is not None and loaded.device.type == "cuda"
    if decoder is not None:
        try:
            builder.warm_fast_decoder(decoder, say)
            builder.measure_fast_resident(decoder)
            if measured:
                builder.profile_fast_cache(decoder, say)
            else:
                builder.fit_fast_cache(settings.generation.max_new_tokens, say)
        except ContextBudgetError as exc:  # weights fit, the fast path's cache does not: plain generate serves
            if settings.model.decode_path != "auto":
                raise
            builder.fall_back_to_plain(decoder, exc)
            decoder, measured = None, False
    if builder.fast_scheduler is not None:  # the batched fast path: its slots, sized by measurement on CUDA
        try:
            builder.size_fast_slots(say)
        except ContextBudgetError as exc:  # start-up never fails for weights that fit: the eager batch serves
            if settings.model.decode_path != "auto":
                raise
            builder.fall_back_to_eager_batch(exc)
    start = getattr(builder.backend, "warmup", None)  # the batched fast loop: slots, compile, graphs
    if start is not None:
        start()
    path, facts = serve(builder.freeze())
    if decoder is None:
        if path.fast_scheduler is None:
            return path
        builder = PathBuilder(path, loaded, settings, budget, facts)  # the batched fast path, after its first reply
        builder.measure_fast_resident(path.fast_scheduler.runner.decoder)
        return builder.freeze()
    builder = PathBuilder(path, loaded, settings, budget, facts)
    builder.measure_fast_resident(decoder)
    # unmeasured (CPU): what the warm-up reply taught the reserve re-plans the cache now, not in a reply; a recapture
    # leaves its own fragments, so re-plan until the split holds
    for _ in range(0 if measured else 3):
        if not builder.fit_fast_cache(settings.generation.max_new_tokens, say):
            break
    return builder.freeze()


def replan(path: DecodePath, loaded: LoadedModel, settings: Settings, budget: MemoryBudget, facts: ModelMemoryFacts,
           step: Callable[[PathBuilder], object]) -> DecodePath:
    """A new DecodePath: `step` (a PathBuilder method, e.g. fit_fast_cache) run from `path` with the memory facts as
    they are now."""
    builder = PathBuilder(path, loaded, settings, budget, facts)
    step(builder)
    return builder.freeze()


class PathBuilder:
    """One start-up's working state: the DecodePath's fields as they are being chosen (attributes of the same names),
    frozen by freeze(). Resumed from a path, with the engine's memory facts as they are now."""

    backend: DecodeBackend
    plain: PlainBackend
    kv_setting: str
    kv_choice: tuple[str, str]
    prefill_chunk_tokens: int | None
    prefix_cache: bool
    plain_prefix: PlainPrefixCache | None
    facts: ModelMemoryFacts
    plain_facts: ModelMemoryFacts
    allocated_before_decode: int | None
    scheduler: Scheduler[EagerRunner] | None
    fast_scheduler: Scheduler[FastRunner] | None
    replies: int
    prefill_graph_tokens: int
    profile: dict[str, int] | None
    held_free_bytes: int
    batched_reason: tuple[str, int] | None
    fitted_for: tuple[ModelMemoryFacts, int] | None
    notes: list[str]  # a tuple in the DecodePath

    def __init__(self, path: DecodePath, loaded: LoadedModel, settings: Settings, budget: MemoryBudget,
                 facts: ModelMemoryFacts) -> None:
        for field in fields(DecodePath):
            setattr(self, field.name, getattr(path, field.name))
        self.notes = list(path.notes)
        self.facts = facts
        self.loaded, self.settings, self.budget = loaded, settings, budget
        self._cache_plan: Any = None
        self.batch_slots = 1  # the slots the fast path will batch (configure_decode), for NF4_FRAG=auto
        self.frag_bytes = 0  # NF4_FRAG's copy of the codes where it is on (the slots' plan counts it)
        self.frag_reason = ""

    def freeze(self) -> DecodePath:
        values = {field.name: getattr(self, field.name) for field in fields(DecodePath)}
        return DecodePath(**{**values, "notes": tuple(self.notes)})

    @property
    def fast_kv_cache(self) -> str:
        return _static_kv_cache(self.kv_choice[0])

    @property
    def fast_decoder(self) -> Any | None:
        return self.backend.decoder if isinstance(self.backend, FastBackend) else None

    def _note(self, message: str, say: Say | None = None) -> None:
        self.notes.append(message)
        if say is not None:
            say(message)

    def compact_weights(self) -> None:
        """CUDA: lay the weights (and the fast path's packed copies) end to end again before anything records their
        addresses (llm_core.memory.compact: loading and packing leave holes the allocator cannot give back)."""
        if self.loaded.device.type != "cuda":
            return
        from ..memory.compact import compact_storages
        from ..memory.model import model_tensors

        decoder = self.fast_decoder
        if decoder is None and self.fast_scheduler is not None:
            decoder = self.fast_scheduler.runner.decoder.fast
        extra = decoder.device_tensors() if decoder is not None else []
        result = compact_storages([*model_tensors(self.loaded.model), *extra], self.loaded.device)
        if result.skipped or result.returned_bytes >= 64 * 2**20:
            self._note(result.describe() + ".")

    # --- selection (at construction) ---------------------------------------------------------------------------------
    def plain_backend(self, reason: str) -> PlainBackend:
        return PlainBackend(self.loaded, reason, self.prefill_chunk_tokens, self.plain.check_oom, self.plain_prefix)

    def select_backend(self) -> None:
        mode = self.settings.model.decode_path
        if mode == "plain":
            return
        weights = self.loaded.extra.get("cpu_weights")
        if weights is not None:  # loaded for the CPU path (DECODE_PATH auto/cpu on CPU): llm_core.fast.cpu
            from .cpu_backend import cpu_backend

            self.backend = cpu_backend(self.loaded, weights, self.fast_cache_tokens(),
                                       self.prefill_chunk_tokens, prefix_cache=self.prefix_cache)
            return
        try:
            from .. import fast
        except ImportError as exc:  # the fast path is optional: the plain path always works
            if mode == "fast":
                raise SettingsError(f"DECODE_PATH=fast, but the fast decode path is unavailable: {exc}") from exc
            self.backend = self.plain_backend(f"fast path unavailable: {exc}")
            return
        ok, reason = fast.fast_path_support(self.loaded)
        if not ok and mode == "auto":
            self.backend = self.plain_backend(reason)
            return
        if not ok and mode == "fast" and self.loaded.device.type == "cuda":
            raise SettingsError(f"DECODE_PATH=fast cannot run here: {reason}. Use DECODE_PATH=auto.")
        if not ok:  # DECODE_PATH=fast off CUDA: the same loop, eager (tests and debugging)
            ok, why = fast.fast_path_support(self.loaded, allow_cpu=True)
            if not ok:
                raise SettingsError(f"DECODE_PATH=fast cannot run here: {why}. Use DECODE_PATH=auto.")
            reason = (f"DECODE_PATH=fast on {self.loaded.device.type.upper()}: static KV cache, eager decode loop "
                      "(no compile, no CUDA graphs)")
        self.prefill_graph_tokens = self.resolve_prefill_graph_tokens()
        options = fast.FastDecodeOptions(prefill_graph_tokens=self.prefill_graph_tokens,
                                         prefill_chunk_tokens=self.prefill_chunk_tokens,
                                         kv_cache=self.fast_kv_cache,
                                         prefix_attention=self.settings.memory.prefix_attention,
                                         launch_overlap=self.settings.model.launch_overlap,
                                         gemv_input=self.settings.model.gemv_input,
                                         nf4_frag=self.resolve_nf4_frag())
        plain_facts = self.facts
        try:
            cache_tokens = self.fast_cache_tokens()
        except ContextBudgetError as exc:  # weights fit, but not beside a useful static cache: plain generate
            if mode == "fast":
                raise
            self.facts = plain_facts
            self.backend = self.plain_backend(f"no room for the fast path's KV cache: {exc}")
            return
        decoder = fast.FastDecoder(self.loaded, max_cache_len=cache_tokens, options=options,
                                   prefix_cache=PrefixCache() if self.prefix_cache else None)
        if self.fast_kv_cache != "bf16":
            kv = self.fast_kv_cache
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
        if self.frag_reason:
            reason += f"; {self.frag_reason}"
        self.backend = FastBackend(decoder, reason)
        # Warm-up allocates the whole static cache (max_cache_len): predictions count that block, not a growing one;
        # the prefill dequantizes fused gate/up weights.
        self.facts = replace(self.facts, static_kv_tokens=int(decoder.max_cache_len),
                             static_kv_cache=self.fast_kv_cache,
                             resident_extra_bytes=self._cache_plan.resident_extra_bytes)

    def resolve_nf4_frag(self) -> str:
        """NF4_FRAG for the fast decoder about to be built (llm_core.memory.plan.resolve_nf4_frag): auto is on for NF4
        weights on CUDA decoded in batches where the copy takes at most AUTO_FRAG_POOL_SHARE of the KV slots' tokens.
        Sets frag_bytes (the copy, counted by the slots' plan) and frag_reason (the model panel's words)."""
        from ..fast.batched import MAX_SLOTS
        from ..fast.pack import frag_copy_bytes
        from ..memory.plan import resolve_nf4_frag

        setting, loaded = self.settings.model.nf4_frag, self.loaded
        nf4 = loaded.settings.quantization == "nf4" and loaded.device.type == "cuda"
        copy = frag_copy_bytes(loaded.model) if nf4 and setting != "off" else 0
        mode, self.frag_reason = resolve_nf4_frag(
            setting, replace(self.facts, fast_prefill=True), self.budget.budget_bytes, copy_bytes=copy,
            slots=min(self.batch_slots, MAX_SLOTS), max_new_tokens=self.settings.generation.max_new_tokens,
            prefill_chunk_tokens=self.prefill_chunk_tokens, kv_cache=self.fast_kv_cache)
        self.frag_bytes = copy if mode == "on" else 0
        return mode

    def resolve_prefill_graph_tokens(self) -> int:
        from ..memory.plan import resolve_prefill_graph_tokens

        return resolve_prefill_graph_tokens(
            self.settings.model.prefill_graph_tokens, replace(self.facts, fast_prefill=True),
            self.budget.budget_bytes, max_new_tokens=self.settings.generation.max_new_tokens,
            prefill_chunk_tokens=self.prefill_chunk_tokens, kv_cache=self.fast_kv_cache)

    def batched_prefill_graph_tokens(self) -> int:
        """The batched path's whole-prompt prefill graphs (paged pool, llm_core.fast.prefill_graphs): up to
        PREFILL_GRAPH_TOKENS when set; auto: the default where memory does not bound the cache, and none on a card
        where it does (the small-card size there would take context from every chat for its pool, as the
        single-reply path's graphs do, and the batched path has done without them)."""
        from ..config import DEFAULT_PREFILL_GRAPH_TOKENS

        if self.settings.model.prefill_graph_tokens is not None:
            return int(self.settings.model.prefill_graph_tokens)
        return self.prefill_graph_tokens if self.prefill_graph_tokens >= DEFAULT_PREFILL_GRAPH_TOKENS else 0

    def fast_cache_tokens(self, resident_extra_bytes: int | None = None) -> int:
        """The fast path's static KV cache, allocated once at warm-up: the most tokens for which a reply filling
        it (prompt + the default reply length) fits the budget beside the weights, the largest prefill chunk, the
        graph pools and the allocator reserve (llm_core.memory.plan); never beyond the model's context."""
        from ..memory.plan import require_cache, static_cache_plan

        self.facts = replace(self.facts, fast_prefill=True)  # its prefill dequantizes int8 too
        plan = static_cache_plan(self.facts, self.budget.budget_bytes,
                                 max_new_tokens=self.settings.generation.max_new_tokens,
                                 prefill_chunk_tokens=self.prefill_chunk_tokens,
                                 kv_cache=self.fast_kv_cache, resident_extra_bytes=resident_extra_bytes,
                                 prefill_graph_tokens=self.prefill_graph_tokens)
        self._cache_plan = require_cache(plan, self.facts)
        return plan.tokens

    def configure_decode(self) -> None:
        """Batched decoding (llm_core.engine.scheduler) when MAX_BATCH_SIZE resolves above 1 and the model allows it;
        else one reply at a time on the plain or fast path."""
        from .serving import batching_support, resolve_max_batch_size

        loaded = self.loaded
        server = self.settings.server
        size = resolve_max_batch_size(server.max_batch_size, loaded.device, self.settings.model.decode_path,
                                      server.is_shared, self.settings.memory.kv_layout == "paged")
        selected = False
        if size > 1 and self.settings.model.decode_path != "plain" and loaded.extra.get("cpu_weights") is None:
            self.batch_slots = size  # NF4_FRAG=auto weighs the batched path's slots (resolve_nf4_frag)
            self.select_backend()  # the fast path, when it serves this model here, batches every reply itself
            selected = True
            if isinstance(self.backend, FastBackend):
                self.serve_fast_batched(size)
                return
        if server.max_batch_size is None and not server.is_shared:
            size = 1  # auto batched an unshared demo for the paged pool only: the eager batch has none
        ok, why = batching_support(loaded.model) if size > 1 else (False, "")
        if not ok:
            if not selected:
                self.select_backend()
            if why:
                self.backend.reason = "; ".join(filter(None, [self.backend.reason, f"batching off: {why}"]))
            return
        self.serve_eager_batched(size)

    def serve_eager_batched(self, size: int, note: str = "") -> None:
        """Concurrent replies batched by llm_core.engine.scheduler's loop over transformers' forward (models or
        cards the batched fast path does not serve)."""
        from .serving import BatchedBackend, default_kv_budget_bytes

        loaded = self.loaded
        runner = EagerRunner.for_model(
            loaded.model, max_batch_size=size,
            kv_budget_bytes=default_kv_budget_bytes(loaded, size, self.budget.budget_bytes, self.facts),
            cache_dtype=loaded.compute_dtype, cache_kwarg=cache_kwarg(loaded.model))
        self.scheduler = Scheduler(runner, eos_token_ids=sorted(loaded.eos_token_ids))
        self.scheduler.start()
        self.backend = BatchedBackend(self.scheduler, "; ".join(filter(None, [
            f"MAX_BATCH_SIZE={size}: concurrent replies share one decode batch", note])))
        self.replies = size

    def serve_fast_batched(self, size: int) -> None:
        """Replace the single-reply fast backend by the batched fast loop: `size` KV slots (at most 32) of the
        largest length s (<= the context) for which llm_core.memory.plan.static_cache_plan still fits a reply filling
        one slot with the other slots' blocks held as resident; fewer slots when s would be under
        MIN_FAST_CACHE_TOKENS."""
        from ..fast.batched import MAX_SLOTS, SlotDecoder
        from ..memory.plan import MIN_FAST_CACHE_TOKENS, fast_resident_estimate, longest_slot_tokens
        from .fast_runner import FastRunner
        from .serving import FastBatchedBackend

        fast = self.backend
        assert isinstance(fast, FastBackend)
        decoder = fast.decoder
        context = int(self.loaded.context_length)
        per_token = int(decoder.kv_bytes_per_token())
        chunk = self.prefill_chunk_tokens

        def longest(slots: int) -> int:
            return longest_slot_tokens(replace(self.facts, context_length=context), self.budget.budget_bytes,
                                       slots=slots, per_token=per_token,
                                       max_new_tokens=self.settings.generation.max_new_tokens,
                                       prefill_chunk_tokens=chunk, kv_cache=self.fast_kv_cache,
                                       extra_bytes=self.frag_bytes)

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
        rows = SlotDecoder(decoder, slots=slots, slot_tokens=slot_tokens, layout=self.settings.memory.kv_layout,
                           prefill_graph_tokens=self.batched_prefill_graph_tokens())
        decoder.max_cache_len = rows.reply_tokens  # the engine fits every history to one slot, or the pool
        scheduler = Scheduler(FastRunner(rows, prefix_cache=self.prefix_cache),
                              eos_token_ids=sorted(self.loaded.eos_token_ids))
        self.batched_reason = (fast.reason, size)
        self.backend = FastBatchedBackend(scheduler, decoder, _fast_batched_reason(fast.reason, size, slots,
                                                                                   slot_tokens))
        self.fast_scheduler = scheduler
        self.facts = replace(self.facts, static_kv_tokens=slots * slot_tokens, static_kv_cache=self.fast_kv_cache,
                             resident_extra_bytes=fast_resident_estimate(self.facts, 0, slot_tokens) + self.frag_bytes)
        self.replies = slots

    # --- warm-up, sizing by measurement, fall-backs (warm_decode_path) -----------------------------------------------
    def size_fast_slots(self, say: Say) -> None:
        """Warm the batched fast path's slots (compile, graphs) before its loop starts; on CUDA then size them by
        measurement as the single-reply cache is: SlotDecoder.profile_worst_reply
        runs one slot's last prefill chunk at the end of a full slot and a step with every slot decoding, and
        size_cache_by_measurement re-sizes the slot length until that peak fits the budget. The slot count stays;
        when not even MIN_FAST_CACHE_TOKENS per slot fit, ContextBudgetError says to lower MAX_BATCH_SIZE (and with
        DECODE_PATH=auto, warm_decode_path then serves the eager batch instead: fall_back_to_eager_batch)."""
        assert self.fast_scheduler is not None
        slots = self.fast_scheduler.runner.decoder
        if slots.k is None:
            slots.warmup()
        if self.loaded.device.type == "cuda":
            self.measure_fast_slots(say)

    def measure_fast_slots(self, say: Say) -> None:
        scheduler = self.fast_scheduler
        assert scheduler is not None and self.batched_reason is not None
        slots = scheduler.runner.decoder

        def resize(tokens: int) -> None:
            self._note(f"Sizing the {slots.slots} KV slots from measured memory: {slots.slot_tokens:,} -> "
                       f"{tokens:,} tokens each…", say)
            scheduler.resize_slots(tokens)

        try:
            self.profile = self.size_by_measurement(
                lambda: int(slots.slot_tokens), resize, lambda: slots.profile_worst_reply(self.prefill_chunk_tokens),
                slots.slots * slots.kv_bytes_per_token(), sequences=slots.slots)
        except ContextBudgetError as exc:
            raise ContextBudgetError(f"{exc} With MAX_BATCH_SIZE={slots.slots} the batch's KV slots share it: lower "
                                     "MAX_BATCH_SIZE.") from None
        slots.fast.max_cache_len = slots.reply_tokens  # the context one reply may span (FastBatchedBackend.decoder)
        self.facts = replace(self.facts, static_kv_tokens=slots.slots * slots.slot_tokens)
        base, size = self.batched_reason
        assert isinstance(self.backend, FastBatchedBackend)
        self.backend = replace(self.backend, reason=_fast_batched_reason(base, size, slots.slots, slots.slot_tokens,
                                                                         measured=True))
        log.info("batched fast path: %d KV slots of %d tokens; worst step's peak %s (allocated + held) of %s",
                 slots.slots, slots.slot_tokens, human_bytes(self.profile["peak_need_bytes"]),
                 human_bytes(self.budget.budget_bytes))

    def fall_back_to_eager_batch(self, exc: Exception) -> None:
        """The batched fast path's slots do not fit (measured at start-up): its loop, slots and graphs are released
        and transformers' forward batches the replies (llm_core.engine.eager_runner), with the reason in the model
        panel."""
        log.warning("batched fast path released at start-up: %s", exc)
        self.notes.append(f"batched fast path released at start-up: {exc}")
        scheduler = self.fast_scheduler
        assert scheduler is not None
        size = scheduler.runner.decoder.slots
        scheduler.close()
        slots = scheduler.runner.decoder
        slots._graphs.clear()
        if slots.prefill_graphs is not None:
            slots.prefill_graphs.clear()
        slots.k = slots.v = None
        self.fast_scheduler = None
        self.profile = None
        self.facts = self.plain_facts
        free_memory(self.loaded.device)
        self.serve_eager_batched(size, f"no room for the batched fast path's KV slots on this card: {exc}")

    def fall_back_to_plain(self, decoder: Any, exc: Exception) -> None:
        """Start-up never fails for a model whose weights fit: when the fast path's cache cannot fit beside them
        (found while warming up or measuring), its cache and graphs are released and plain generate serves, with
        the reason in the model panel."""
        log.warning("fast path released at start-up: %s", exc)
        self.notes.append(f"fast path released at start-up: {exc}")
        decoder.release()
        self.backend = self.plain_backend(f"no room for the fast path's KV cache on this card: {exc}")
        self.facts = self.plain_facts
        self.profile = None
        self.prefill_graph_tokens = self.held_free_bytes = 0
        free_memory(self.loaded.device)

    def warm_fast_decoder(self, decoder: Any, say: Say) -> None:
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
                        f"{human_bytes(self.budget.budget_bytes)}. {FAST_CACHE_ADVICE}") from None
                self._note(f"Out of memory while warming up: retrying with a KV cache of {tokens:,} tokens…", say)
                log.warning("fast path warm-up OOM with %d cache tokens; retrying with %d",
                            decoder.max_cache_len, tokens)
                decoder.max_cache_len = tokens

    def profile_fast_cache(self, decoder: Any, say: Say) -> None:
        """CUDA: size the fast path's static cache by measurement, not prediction (as vLLM sizes its KV cache):
        llm_core.memory.plan.size_cache_by_measurement over the decoder's worst-reply profile. The final cache is the
        per-reply bound: a reply whose prompt + new tokens fit the cache fits the card."""
        def resize(tokens: int) -> None:
            self._note(f"Sizing the KV cache from measured memory: {decoder.cache_len:,} -> {tokens:,} tokens…", say)
            decoder.max_cache_len = tokens
            decoder.resize_cache(tokens, strict=True)

        self.profile = self.size_by_measurement(lambda: int(decoder.cache_len), resize, decoder.profile_worst_reply,
                                                decoder.cache_bytes_per_token)
        self.facts = replace(self.facts, static_kv_tokens=decoder.cache_len)
        log.info("fast path KV cache: %d tokens; worst reply's peak %s (allocated + held) of %s", decoder.cache_len,
                 human_bytes(self.profile["peak_need_bytes"]), human_bytes(self.budget.budget_bytes))

    def size_by_measurement(self, current: Callable[[], int], resize: Callable[[int], None],
                            profile: Callable[[], dict[str, int]], bytes_per_token: int,
                            sequences: int = 1) -> dict[str, int]:
        """llm_core.memory.plan.size_cache_by_measurement over `profile` (the worst moment at the current size; a
        CUDA OOM there counts as over), re-sizing with `resize`; leaves the size it keeps in place and returns its
        profile. What a profile needs is its peak of allocated bytes plus what the allocator then holds and cannot
        give back (graph pools' free bytes, fragments of pages still in use: reserved after empty_cache, less
        allocated). Blocks it holds free but can give back are not counted: an allocation that needs them gets them
        (the allocator empties its cache and retries before it reports an OOM; with expandable segments it unmaps
        free pages). Counting them (the reserved peak) left ~1 GB of an 8 GiB card unused (Llama-2-7B, H100,
        bench/results/2026-12-05-h100-breakdown-llama-2-7b-8gib.json: 1.19 GB free after the profile, 274 MB in one
        block), as the caching allocator's extent, not memory any reply held; vLLM sizes by the allocated peak too.
        The cache is emptied before each profile as well, so blocks from compiling and captures are not in it. The
        need is never more than the pass's own reserved peak, though: that much memory did hold it (its working
        memory can fill the held fragments: Llama-2-7B on 8 GiB, 7.77 GB reserved against 6.85 + 0.97 GB,
        bench/results/2026-12-05-s4-h100-cards-llama-2-7b-8gib-fill.json)."""
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
                free_memory(self.loaded.device)
                peak = profile()
                held = unreturnable_free_bytes(self.loaded.device)
                need = int(peak["peak_allocated_bytes"]) + held
                if int(peak.get("peak_reserved_bytes") or 0) > 0:  # what the pass really reserved bounds it too
                    need = min(need, int(peak["peak_reserved_bytes"]))
                profiles[tokens] = peak | {"held_free_bytes": held, "peak_need_bytes": need}
            except torch.cuda.OutOfMemoryError as exc:
                traceback.clear_frames(exc.__traceback__)
                free_memory(self.loaded.device)
                return None
            return profiles[tokens]["peak_need_bytes"]

        tokens = size_cache_by_measurement(measure, current(), bytes_per_token, self.budget.budget_bytes,
                                           int(self.loaded.context_length), sequences=sequences)
        if tokens != current() or not allocated:  # the last size measured was not the one kept
            if measure(tokens) is None:
                raise ContextBudgetError(f"The KV cache of {tokens:,} tokens that fitted at start-up did not fit when "
                                         f"allocated again. {FAST_CACHE_ADVICE}")
        return profiles[tokens]

    def measure_fast_resident(self, decoder: Any) -> None:
        """What the fast path (`decoder`: a FastDecoder, or the batched path's SlotDecoder) holds beyond weights and
        cache, after giving back every cached block the allocator can: its buffers and graph pools, plus the
        fragments that empty_cache cannot return (free blocks inside segments still in use): no reply can count on
        them, so they are planned as held. The batched path counted CUDA_HELD_FREE_BYTES (1.25 GiB) instead until
        2026-12-05, so its predicted peaks came out 20% over the measured ones on an 8 GiB card."""
        if self.loaded.device.type != "cuda":
            return
        held = unreturnable_free_bytes(self.loaded.device)
        after = device_allocated_bytes(self.loaded.device)
        if after is not None and self.allocated_before_decode is not None:
            pools = decoder.graph_pool_idle_bytes()
            fragments = max(0, held - pools)
            self.held_free_bytes = pools + fragments  # planned as resident: see ChatEngine._final_stats
            self.facts = replace(self.facts, resident_extra_bytes=resident_extra_bytes(
                self.facts, self.allocated_before_decode, after, pools + fragments))

    # --- the re-plan after start-up ----------------------------------------------------------------------------------
    def fit_fast_cache(self, max_new_tokens: int, say: Say | None = None) -> bool:
        """Re-plan the static cache with the facts as they are now (measured resident bytes, learned reserve) and
        shrink it when a reply filling it would no longer fit the budget: a recapture of its graphs, never a
        compile. Memoized on the facts (fitted_for). True when it shrank the cache."""
        decoder = self.fast_decoder
        if decoder is None:
            return False
        if self.fitted_for == (self.facts, max_new_tokens):
            return False
        from ..memory.plan import static_cache_plan

        plan = static_cache_plan(self.facts, self.budget.budget_bytes, max_new_tokens=max_new_tokens,
                                 prefill_chunk_tokens=self.prefill_chunk_tokens,
                                 kv_cache=self.fast_kv_cache,
                                 resident_extra_bytes=self.facts.resident_extra_bytes,
                                 prefill_graph_tokens=self.prefill_graph_tokens)
        tokens = max(plan.tokens, min(decoder.cache_len, 2 * max_new_tokens + 16))  # keep room for a short reply
        resized = tokens < decoder.cache_len
        if resized:
            self._note(f"Re-sizing the KV cache from {decoder.cache_len:,} to {tokens:,} tokens for the measured "
                       "memory…", say)
            log.info("fast path KV cache re-planned: %d -> %d tokens", decoder.cache_len, tokens)
            decoder.max_cache_len = tokens
            decoder.resize_cache(tokens)
            self.facts = replace(self.facts, static_kv_tokens=decoder.cache_len)
            self.measure_fast_resident(decoder)
        self.fitted_for = (self.facts, max_new_tokens)
        return resized


def _static_kv_cache(kv: str) -> str:
    """The fast path's static cache for KV_CACHE as resolved: bf16 for offload, whose replies run on the plain path."""
    return kv if kv in ("bf16", "int8", "int4") else "bf16"


def _fast_batched_reason(base: str, size: int, slots: int, slot_tokens: int, *, measured: bool = False) -> str:
    sized = ", sized by measurement" if measured else ""
    return (f"{base}; batched: MAX_BATCH_SIZE={size}, {slots} KV slots of {slot_tokens:,} tokens{sized} (every "
            "reply is a row of one decode step)")
