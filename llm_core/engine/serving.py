"""Serving many chats at once over one model: a scheduler that decodes concurrent replies in one batch, with
admission against a KV-cache memory budget (per-person limits: llm_core.engine.admission). Knows nothing about Gradio.

Why our own scheduler and not transformers' continuous batching (`model.init_continuous_batching()`): it runs on CPU
here (fp32 and nf4) and streams per request, but it drops the repetition penalty (our default 1.05, so a batched reply
would differ from the same reply alone), takes do_sample from one manager-wide GenerationConfig, a cancelled request
simply vanishes (no final output), and between transformers 5.17 (the GPU machine) and 5.24 it changed behaviour:
5.17 rewrites the shared model's attention to `paged|sdpa` (or silently to flash) while the manager lives, which
breaks every other path over the same model. Measured and argued in docs/sharing.md.

The scheduler (one background thread owns the model; request threads only queue tokens):

    waiting (FIFO) --admit: a free row and its worst-case KV fits the budget--> prefill alone (batch 1: the same
    numerics as a reply served alone) --> joins the decode batch as a row of a left-padded DynamicCache -->
    one forward per step for all rows (2-D padding mask, per-row position ids) --> per-row logits processors
    (repetition penalty, temperature, top-k, top-p) and sampling, each row with its own generator --> the token goes
    to that request's queue --> a row that ends (EOS, length, Stop, disconnect, error) leaves the batch, and cache
    columns that are padding in every remaining row are cut.

KV accounting: every row spans the batch width W (left padding included) and W can grow until the longest row ends,
so the batch's future peak is bounded by rows x max_i(length_i + remaining_i) x kv_bytes_per_token. A request waits
only while admitting it would break that bound (or all MAX_BATCH_SIZE rows are taken); one that cannot fit even alone
is refused at once.
"""

from __future__ import annotations

import atexit
import itertools
import threading
import weakref
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import ContextBudgetError, GenerationError, InputError
from ..memory.device import free_memory, is_oom_error
from ..memory.model import kv_bytes_per_token
from ..sampling import SamplingOptions, logits_processors, next_token
from ..streams import QueuedReply, TokenStreams

# A waiting request whose KV does not fit yet may be overtaken by at most this many later (smaller) requests; after
# that nothing new is admitted until it fits, so a long prompt cannot starve behind a stream of short ones.
MAX_OVERTAKES = 8
# At most this many prompt tokens are prefilled between two decode steps (at least one whole prompt), so a burst of
# arrivals delays the rows already decoding by a bounded amount.
PREFILL_TOKENS_PER_STEP = 4096
AUTO_BATCH_SIZE_CUDA = 8


# --- settings ----------------------------------------------------------------------------------------------------


def resolve_max_batch_size(setting: int | None, device: torch.device, decode_path: str, shared: bool = False) -> int:
    """MAX_BATCH_SIZE as the engine uses it. Empty (None) = auto: 8 on CUDA when the demo is shared (SHARE, AUTH or
    a non-local HOST: several users at once), else 1. With the fast path a batch is the batched fast loop
    (llm_core.fast.batched), whose fixed KV slots split the memory budget: on one user's card auto keeps the
    single-reply loop, whose one cache holds the whole budget (on a 24 GiB card the whole 32k context instead of an
    eighth of it) and which decodes a lone reply 6% faster (324 vs 306 tok/s, H200). A number set here batches
    whatever the sharing. 1 on CPU (the CPU path serves one reply at a time). `decode_path` is kept for callers."""
    if setting is not None:
        return int(setting)
    if device.type != "cuda" or not shared:
        return 1
    return AUTO_BATCH_SIZE_CUDA


def batching_support(model: Any) -> tuple[bool, str]:
    """Whether the scheduler can batch this model: a decoder whose layers all use full attention (a left-padded
    DynamicCache), with position ids and a 2-D padding mask in its forward, weights on one device."""
    config = model.config
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    if getattr(config, "is_encoder_decoder", False):
        return False, "encoder-decoder models are served one at a time"
    types = getattr(text, "layer_types", None)
    if types is not None and any(t != "full_attention" for t in types):
        return False, "sliding-window / linear-attention layers are served one at a time"
    if types is None and (getattr(text, "sliding_window", None) or getattr(text, "attention_chunk_size", None)):
        return False, "sliding-window attention is served one at a time"
    placement = {str(v) for v in (getattr(model, "hf_device_map", None) or {}).values()}
    if len(placement) > 1:
        return False, "weights offloaded across devices (MAX_MEMORY) are served one at a time"
    import inspect

    params = inspect.signature(type(model).forward).parameters
    if "position_ids" not in params or "attention_mask" not in params:
        return False, f"{type(model).__name__}.forward takes no position_ids / attention_mask"
    return True, ""


# --- the KV budget -----------------------------------------------------------------------------------------------


def default_kv_budget_bytes(loaded: Any, max_batch_size: int, budget_bytes: int | None = None,
                            facts: Any = None) -> int:
    """Bytes the batch's KV cache may hold: the engine's memory budget (`budget_bytes`: VRAM_BUDGET, else what the
    device had free after loading minus a margin; llm_core.memory), minus what is allocated now (weights), minus the
    activations of the largest prefill (a full-context prompt) or of a full batch's decode step, the logits and the
    workspace, all divided by (1 + the allocator's reserve fraction)."""
    from ..memory.budget import default_budget_bytes
    from ..memory.model import ModelMemoryFacts, decode_transient_bytes, forward_activation_bytes, logits_bytes

    device = loaded.device
    facts = facts if facts is not None else ModelMemoryFacts.from_loaded(loaded)
    total = budget_bytes if budget_bytes is not None else default_budget_bytes(device)
    if device.type == "cuda":
        in_use = int(torch.cuda.memory_allocated(device))
    else:
        import psutil

        in_use = int(psutil.Process().memory_info().rss)
    context = int(loaded.context_length)
    activations = max(forward_activation_bytes(facts, context),
                      max_batch_size * decode_transient_bytes(facts, context)) + logits_bytes(facts, max_batch_size)
    spare = total - in_use - activations - facts.workspace_bytes
    return max(0, int(spare / (1.0 + facts.reserve_fraction)))


# --- requests ----------------------------------------------------------------------------------------------------


class RowKV:
    """What a batched reply's KV held at its end: its row of the shared batch cache (left padding included), in
    bytes. Filled by the scheduler just before the reply finishes; the engine reports it as the reply's KV size."""

    def __init__(self) -> None:
        self.nbytes: int | None = None
        # Filled by the batched fast path on CUDA, where replies overlap and no reply may reset the device's peak:
        # the batch's allocation peak during this reply, and the rows decoding at that moment (the eager batch
        # fills peak_batch_rows alone: the most rows of a decode step this reply was in).
        self.peak_allocated_bytes: int | None = None
        self.peak_reserved_bytes: int | None = None
        self.peak_batch_rows: int | None = None
        self.cached_prompt_tokens = 0  # the batched fast path's paged pool: prompt tokens not prefilled

    def record(self, cache: Any, row: int) -> None:
        total = 0
        for layer in cache.layers:
            for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None)):
                if isinstance(tensor, torch.Tensor) and tensor.dim() == 4:
                    total += tensor[row].numel() * tensor.element_size()
        self.nbytes = total or None


class BatchRequest(QueuedReply):
    """One reply in the eager scheduler (counted_wait: in SchedulerStats.waited_for_memory)."""

    def __init__(self, prompt_ids: list[int], options: SamplingOptions, max_new_tokens: int,
                 stop_event: threading.Event, kv_record: RowKV | None = None) -> None:
        super().__init__(prompt_ids, options, max_new_tokens, stop_event, kv_record)
        self.overtaken = 0


@dataclass
class _Row:
    request: BatchRequest
    length: int  # real tokens in the cache for this row
    pad_left: int  # padding columns left of them
    last_token: int  # generated, not yet fed to the model
    seen: torch.Tensor  # (1, prompt + max_new) prompt and generated ids, for the repetition penalty
    n_seen: int
    new_tokens: int
    processors: Any  # transformers LogitsProcessorList
    generator: torch.Generator | None

    @property
    def remaining(self) -> int:
        return self.request.max_new_tokens - self.new_tokens


@dataclass
class SchedulerStats:
    """Counters for the UI and the benchmark (a snapshot; the scheduler keeps the live copy)."""

    waiting: int = 0
    active: int = 0
    kv_reserved_bytes: int = 0  # the admission bound of the current batch
    kv_held_bytes: int = 0  # bytes the batch cache holds now
    kv_budget_bytes: int = 0
    decode_steps: int = 0
    rows_decoded: int = 0  # sum over steps of the rows in the step
    max_rows_in_step: int = 0
    prefills: int = 0
    waited_for_memory: int = 0  # admissions that had to wait for KV to fit
    errors: int = 0

    @property
    def mean_rows_per_step(self) -> float:
        return self.rows_decoded / self.decode_steps if self.decode_steps else 0.0


class BatchScheduler(TokenStreams):
    """Decodes concurrent replies over one model in one batch (see the module docstring). Thread-safe `submit`."""

    def __init__(self, model: Any, *, max_batch_size: int, kv_budget_bytes: int, kv_bytes_per_token: int,
                 eos_token_ids: Sequence[int], cache_kwarg: str, name: str = "batch-scheduler") -> None:
        if max_batch_size < 1:
            raise ValueError("max_batch_size must be at least 1")
        # A weak reference: unloading the model (the engine pool drops it) frees it, and the thread then exits.
        self._model_ref = weakref.ref(model)
        self._config = model.config
        self.max_batch_size = int(max_batch_size)
        self.kv_budget_bytes = int(kv_budget_bytes)  # read at every admission: may be changed while running
        self.kv_bytes_per_token = int(kv_bytes_per_token)
        self.eos_token_ids = frozenset(int(e) for e in eos_token_ids)
        self.cache_kwarg = cache_kwarg
        self.device = next(model.parameters()).device
        import inspect

        self._logits_to_keep = "logits_to_keep" in inspect.signature(type(model).forward).parameters
        self._cond = threading.Condition()
        self._waiting: deque[BatchRequest] = deque()
        self._rows: list[_Row] = []
        self._cache: Any = None
        self._closed = False
        self.stats = SchedulerStats(kv_budget_bytes=self.kv_budget_bytes)
        self.fatal_error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()
        _RUNNING.add(self)

    # --- public ------------------------------------------------------------------------------------------------
    @classmethod
    def for_model(cls, model: Any, *, max_batch_size: int, kv_budget_bytes: int, cache_dtype: torch.dtype,
                  eos_token_ids: Sequence[int], cache_kwarg: str) -> BatchScheduler:
        return cls(model, max_batch_size=max_batch_size, kv_budget_bytes=kv_budget_bytes,
                   kv_bytes_per_token=kv_bytes_per_token(model.config, cache_dtype), eos_token_ids=eos_token_ids,
                   cache_kwarg=cache_kwarg)

    @property
    def model(self) -> Any:
        model = self._model_ref()
        if model is None:
            raise GenerationError("The model was unloaded; this reply was stopped.")
        return model

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._closed

    def submit(self, prompt_ids: list[int], options: SamplingOptions, max_new_tokens: int,
               stop_event: threading.Event, record: RowKV | None = None) -> BatchRequest:
        """Queue a reply. Raises ContextBudgetError at once when its KV could not fit the budget even alone."""
        if not prompt_ids:
            raise InputError("The prompt is empty.")
        request = BatchRequest(list(prompt_ids), options, max_new_tokens, stop_event, record)
        need = request.kv_tokens * self.kv_bytes_per_token
        if need > self.kv_budget_bytes:
            raise ContextBudgetError(
                f"This reply needs up to {need / 2**20:,.0f} MiB of KV cache ({request.kv_tokens:,} tokens), more "
                f"than the {self.kv_budget_bytes / 2**20:,.0f} MiB budget for all replies; shorten the history or "
                "lower max new tokens.")
        return self._enqueue(request, "The batch scheduler has stopped; restart the demo.")

    def _loop_running(self) -> bool:
        return self._thread.is_alive()

    def snapshot(self) -> SchedulerStats:
        with self._cond:
            s = self.stats
            return SchedulerStats(waiting=len(self._waiting), active=len(self._rows),
                                  kv_reserved_bytes=self._reserved_bytes(self._rows),
                                  kv_held_bytes=self._held_bytes(), kv_budget_bytes=self.kv_budget_bytes,
                                  decode_steps=s.decode_steps, rows_decoded=s.rows_decoded,
                                  max_rows_in_step=s.max_rows_in_step, prefills=s.prefills,
                                  waited_for_memory=s.waited_for_memory, errors=s.errors)

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the thread; requests still waiting or running end with a GenerationError."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout_s)

    # --- the loop (scheduler thread only) ----------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            with torch.inference_mode():
                while True:
                    with self._cond:
                        if self._closed or self._model_ref() is None:
                            break
                        if not self._rows and not self._waiting:
                            self._cond.wait(0.5)
                            continue
                    try:
                        self._drop_stopped()
                        self._admit()
                        if self._rows:
                            self._decode_step()
                        elif self._waiting:
                            with self._cond:
                                self._cond.wait(0.02)
                    except Exception as exc:  # a bug around the model calls: fail the running rows, keep serving
                        for row in self._rows:
                            self._finish(row.request, "error", GenerationError(
                                f"Generation failed: {type(exc).__name__}: {str(exc)[:300]}"))
                        self._select_rows([])
            error: BaseException = GenerationError("The model was unloaded or the demo is shutting down; this "
                                                   "reply was stopped.")
        except BaseException as exc:  # a bug in the loop itself: fail every reply rather than hang them
            self.fatal_error = exc
            error = GenerationError(f"The batch scheduler failed: {type(exc).__name__}: {str(exc)[:300]}")
        with self._cond:
            self._closed = True
            pending = list(self._waiting) + [row.request for row in self._rows]
            self._waiting.clear()
            self._rows = []
            self._cache = None
        for request in pending:
            self._finish(request, "error", error)

    def _drop_stopped(self) -> None:
        """Stop / disconnect: a waiting request leaves the queue, a running row leaves the batch."""
        with self._cond:
            for request in [r for r in self._waiting if r.stop_event.is_set()]:
                self._waiting.remove(request)
                self._finish(request, "stopped")
        keep = [i for i, row in enumerate(self._rows) if not row.request.stop_event.is_set()]
        if len(keep) < len(self._rows):
            for i, row in enumerate(self._rows):
                if i not in keep:
                    self._record_kv(row, i)
                    self._finish(row.request, "stopped")
            self._select_rows(keep)

    # --- admission ---------------------------------------------------------------------------------------------
    def _reserved_bytes(self, rows: Sequence[_Row], extra: BatchRequest | None = None) -> int:
        """Worst-case bytes of the batch cache from now on (see the module docstring), with `extra` joining."""
        ends = [row.length + row.remaining for row in rows]
        count = len(rows)
        if extra is not None:
            ends.append(extra.kv_tokens)
            count += 1
        if not count:
            return 0
        return count * max(ends) * self.kv_bytes_per_token

    def _held_bytes(self) -> int:
        if self._cache is None:
            return 0
        width = self._width()
        return len(self._rows) * width * self.kv_bytes_per_token

    def _admit(self) -> None:
        prefilled_tokens = 0
        while True:
            with self._cond:
                candidate = None
                for position, request in enumerate(self._waiting):
                    if len(self._rows) >= self.max_batch_size:
                        break
                    fits = self._reserved_bytes(self._rows, request) <= self.kv_budget_bytes
                    if fits:
                        candidate = request
                        for earlier in itertools.islice(self._waiting, position):
                            earlier.overtaken += 1
                        break
                    if request.overtaken >= MAX_OVERTAKES:
                        break  # nobody overtakes it any more: wait until it fits
                if candidate is None:
                    if self._waiting and len(self._rows) < self.max_batch_size:
                        head = self._waiting[0]
                        if not head.counted_wait:
                            head.counted_wait = True
                            self.stats.waited_for_memory += 1
                    return
                if prefilled_tokens and prefilled_tokens + len(candidate.prompt_ids) > PREFILL_TOKENS_PER_STEP:
                    return  # decode the running rows first; admit the rest next step
                self._waiting.remove(candidate)
            prefilled_tokens += len(candidate.prompt_ids)
            self._prefill_and_join(candidate)

    # --- model calls -------------------------------------------------------------------------------------------
    def _forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                 cache: Any) -> torch.Tensor:
        kwargs: dict[str, Any] = {self.cache_kwarg: cache, "use_cache": True, "attention_mask": attention_mask,
                                  "position_ids": position_ids}
        if self._logits_to_keep:
            kwargs["logits_to_keep"] = 1
        out = self.model(input_ids=input_ids, **kwargs)
        # (rows, vocab) in float32, as generate scores them
        return out.logits[:, -1, :].to(copy=True, dtype=torch.float32)

    def _new_cache(self) -> Any:
        from transformers import DynamicCache

        return DynamicCache(config=self._config)

    def _prefill_and_join(self, request: BatchRequest) -> None:
        """Prefill alone (batch 1, like a reply served alone), pick the first token, and join the batch."""
        row: _Row | None = None
        try:
            prompt = torch.tensor([request.prompt_ids], dtype=torch.long, device=self.device)
            cache = self._new_cache()
            logits = self._forward(prompt, torch.ones_like(prompt), torch.arange(prompt.shape[1],
                                   device=self.device).unsqueeze(0), cache)
            if cache.get_seq_length() != prompt.shape[1]:
                raise GenerationError(f"The model did not fill the cache passed as `{self.cache_kwarg}`; batching "
                                      "cannot run with this model / transformers version. Set MAX_BATCH_SIZE=1.")
            self.stats.prefills += 1
            row = self._make_row(request, len(request.prompt_ids))
            token = self._pick(row, logits)
        except BaseException as exc:  # this request only: the batch is untouched
            _free_after_error(exc, self.device)
            self._finish(request, "error", exc)
            return
        if request.stop_event.is_set():
            self._finish(request, "stopped")
            return
        request.items.put(token)
        reason = self._end_reason(row, token)
        if reason:
            self._record_kv_single(cache, request)
            self._finish(request, reason)
            return
        try:
            self._join(row, cache)
        except BaseException as exc:
            _free_after_error(exc, self.device)
            self._finish(request, "error", exc)

    def _make_row(self, request: BatchRequest, prompt_len: int) -> _Row:
        seen = torch.empty((1, request.kv_tokens), dtype=torch.long, device=self.device)
        seen[0, :prompt_len] = torch.tensor(request.prompt_ids, dtype=torch.long, device=self.device)
        options = request.options
        generator = None
        if options.do_sample and options.seed is not None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(int(options.seed))
        return _Row(request, prompt_len, 0, -1, seen, prompt_len, 0, logits_processors(options), generator)

    def _pick(self, row: _Row, logits: torch.Tensor) -> int:
        """Next token of one row from its (1, vocab) float32 logits: generate's processors, then argmax or sample."""
        options = row.request.options
        token = int(next_token(logits, options.do_sample, row.processors, row.seen[:, :row.n_seen], row.generator,
                               options.control)[0])
        row.seen[0, row.n_seen] = token
        row.n_seen += 1
        row.new_tokens += 1
        row.last_token = token
        return token

    def _end_reason(self, row: _Row, token: int) -> str | None:
        if token in self.eos_token_ids:
            return "eos"
        if row.new_tokens >= row.request.max_new_tokens:
            return "length"
        return None

    def _decode_step(self) -> None:
        rows = self._rows
        width = self._width()
        pad = torch.tensor([row.pad_left for row in rows], device=self.device)
        mask = (torch.arange(width + 1, device=self.device).unsqueeze(0) >= pad.unsqueeze(1)).long()
        input_ids = torch.tensor([[row.last_token] for row in rows], dtype=torch.long, device=self.device)
        positions = torch.tensor([[row.length] for row in rows], dtype=torch.long, device=self.device)
        try:
            logits = self._forward(input_ids, mask, positions, self._cache)
        except BaseException as exc:
            self._recover_from_step_error(exc, width)
            return
        self.stats.decode_steps += 1
        self.stats.rows_decoded += len(rows)
        self.stats.max_rows_in_step = max(self.stats.max_rows_in_step, len(rows))
        for row in rows:  # each reply's most rows decoded beside it: whether replies really shared steps
            record = row.request.record
            if record is not None:
                record.peak_batch_rows = max(record.peak_batch_rows or 0, len(rows))
        keep: list[int] = []
        for i, row in enumerate(rows):
            row.length += 1
            try:
                if row.request.stop_event.is_set():
                    self._record_kv(row, i)
                    self._finish(row.request, "stopped")
                    continue
                token = self._pick(row, logits[i:i + 1])
            except BaseException as exc:  # this row only (e.g. its sampling options)
                self._finish(row.request, "error", exc)
                continue
            row.request.items.put(token)
            reason = self._end_reason(row, token)
            if reason:
                self._record_kv(row, i)  # before finishing: the reply's final stats read it
                self._finish(row.request, reason)
                continue
            keep.append(i)
        if len(keep) < len(rows):
            self._select_rows(keep)

    def _recover_from_step_error(self, exc: BaseException, width: int) -> None:
        """A failed batch step: undo the columns some layers appended, then on out-of-memory fail only the newest
        row (the one whose admission tipped it over) and keep the others; on any other error fail every row."""
        _free_after_error(exc, self.device)
        for layer in self._cache.layers:
            if layer.keys is not None and layer.keys.shape[-2] > width:
                layer.keys = layer.keys[..., :width, :]
                layer.values = layer.values[..., :width, :]
        if is_oom_error(exc) and len(self._rows) > 1:
            newest = max(range(len(self._rows)), key=lambda i: self._rows[i].request.arrived_s)
            self._finish(self._rows[newest].request, "error", exc)
            self._select_rows([i for i in range(len(self._rows)) if i != newest])
            return
        for row in self._rows:
            self._finish(row.request, "error", exc)
        self._select_rows([])

    # --- the batch cache ---------------------------------------------------------------------------------------
    def _width(self) -> int:
        layer = self._cache.layers[0]
        return int(layer.keys.shape[-2])

    def _join(self, row: _Row, cache: Any) -> None:
        """Add a prefilled single-row cache to the batch cache, left-padding whichever side is shorter."""
        if self._cache is None or not self._rows:
            self._cache = cache
            row.pad_left = 0
            with self._cond:
                self._rows = [row]
            return
        width, length = self._width(), row.length
        grow = max(0, length - width)
        row.pad_left = max(0, width - length)
        for old, new in zip(self._cache.layers, cache.layers, strict=True):
            old.keys = torch.cat([_pad_left(old.keys, grow), _pad_left(new.keys, row.pad_left)], dim=0)
            old.values = torch.cat([_pad_left(old.values, grow), _pad_left(new.values, row.pad_left)], dim=0)
        with self._cond:
            for other in self._rows:
                other.pad_left += grow
            self._rows = [*self._rows, row]

    def _select_rows(self, keep: list[int]) -> None:
        """Keep only rows `keep` (batch indices) and cut columns that are padding in every remaining row."""
        with self._cond:
            if not keep:
                self._rows = []
                self._cache = None
                return
            if len(keep) < len(self._rows):
                index = torch.tensor(keep, device=self.device)
                for layer in self._cache.layers:
                    layer.keys = layer.keys.index_select(0, index)
                    layer.values = layer.values.index_select(0, index)
                self._rows = [self._rows[i] for i in keep]
            cut = min(row.pad_left for row in self._rows)
            if cut:
                for layer in self._cache.layers:
                    layer.keys = layer.keys[..., cut:, :].contiguous()
                    layer.values = layer.values[..., cut:, :].contiguous()
                for row in self._rows:
                    row.pad_left -= cut

    def _record_kv(self, row: _Row, index: int) -> None:
        if row.request.record is not None and self._cache is not None:
            row.request.record.record(self._cache, index)

    def _record_kv_single(self, cache: Any, request: BatchRequest) -> None:
        if request.record is not None:
            request.record.record(cache, 0)


_RUNNING: weakref.WeakSet[BatchScheduler] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    """Stop scheduler threads before the interpreter tears torch down under them."""
    for scheduler in list(_RUNNING):
        scheduler.close(timeout_s=2.0)


def _pad_left(tensor: torch.Tensor, columns: int) -> torch.Tensor:
    """(rows, heads, length, head_dim) -> (rows, heads, columns + length, head_dim), zeros on the left (masked)."""
    if columns <= 0:
        return tensor
    rows, heads, _, dim = tensor.shape
    return torch.cat([tensor.new_zeros((rows, heads, columns, dim)), tensor], dim=-2)


def _free_after_error(exc: BaseException, device: torch.device) -> None:
    """Let go of the failed call's activations (its finished frames hold them), then, after an OOM, of the memory."""
    import traceback

    traceback.clear_frames(exc.__traceback__)
    if is_oom_error(exc):
        free_memory(device)


@dataclass
class BatchedBackend:
    """The engine's DecodeBackend (llm_core.engine.runners) over a BatchScheduler: each reply is a row of the batch."""

    scheduler: BatchScheduler
    reason: str
    name: str = "batched"
    cache_at_start: bool = True

    def make_cache(self) -> RowKV:
        return RowKV()

    def run(self, prepared: Any, streamer: Any, stop_event: threading.Event, cache: Any) -> None:
        gen = prepared.gen
        self.scheduler.generate(prepared.input_ids, SamplingOptions.of(gen), gen.max_new_tokens, streamer,
                                stop_event, cache if isinstance(cache, RowKV) else None)


@dataclass
class FastBatchedBackend:
    """The engine's DecodeBackend over llm_core.engine.fast_scheduler.FastBatchScheduler: every reply, alone or not, is
    a row of the batched fast step. `decoder` is the FastDecoder whose packed weights it runs (its max_cache_len is the
    slot length: the context one reply may span)."""

    scheduler: Any  # llm_core.engine.fast_scheduler.FastBatchScheduler (imported lazily: the fast path is optional)
    decoder: Any
    reason: str
    name: str = "fast-batched"
    cache_at_start: bool = True
    measures_peak: bool = True  # the scheduler records each reply's peak (RowKV); the engine resets nothing

    def make_cache(self) -> RowKV:
        return RowKV()

    def warmup(self) -> None:
        self.scheduler.start()

    def run(self, prepared: Any, streamer: Any, stop_event: threading.Event, cache: Any) -> int:
        gen = prepared.gen
        record = cache if isinstance(cache, RowKV) else None
        self.scheduler.generate(prepared.input_ids, SamplingOptions.of(gen), gen.max_new_tokens, streamer, stop_event,
                                record)
        return record.cached_prompt_tokens if record is not None else 0
