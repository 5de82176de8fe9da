"""The eager batch runner: concurrent replies as the rows of one left-padded transformers DynamicCache, stepped by the
model's own forward, admitted against a KV-cache memory budget (llm_core.engine.scheduler drives it; per-person limits:
llm_core.engine.admission). Knows nothing about text or Gradio.

Why our own batching and not transformers' continuous batching (`model.init_continuous_batching()`): it runs on CPU
here (fp32 and nf4) and streams per request, but it drops the repetition penalty (our default 1.05, so a batched reply
would differ from the same reply alone), takes do_sample from one manager-wide GenerationConfig, a cancelled request
simply vanishes (no final output), and between transformers 5.17 (the GPU machine) and 5.24 it changed behaviour:
5.17 rewrites the shared model's attention to `paged|sdpa` (or silently to flash) while the manager lives, which
breaks every other path over the same model. Measured and argued in docs/sharing.md.

A row's life:

    admitted (a free row and its worst-case KV fits the budget; at most PREFILL_TOKENS_PER_STEP prompt tokens per
    round, at least one whole prompt) --> prefill alone (batch 1: the same numerics as a reply served alone) -->
    joins the decode batch as a row of a left-padded DynamicCache --> one forward per step for all rows (2-D padding
    mask, per-row position ids) --> per-row logits processors (repetition penalty, temperature, top-k, top-p) and
    sampling, each row with its own generator --> the token to its request --> a row that ends (EOS, length, Stop,
    disconnect, error) leaves the batch, and cache columns that are padding in every remaining row are cut.

KV accounting: every row spans the batch width W (left padding included) and W can grow until the longest row ends,
so the batch's future peak is bounded by rows x max_i(length_i + remaining_i) x kv_bytes_per_token. A request waits
only while admitting it would break that bound (or all max_batch_size rows are taken); one that cannot fit even alone
is refused at once.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import ContextBudgetError, GenerationError
from ..memory.device import free_memory, is_oom_error
from ..memory.model import kv_bytes_per_token
from ..sampling import SamplingOptions, logits_processors, next_token
from ..streams import QueuedReply
from .runners import BoundRunner

# A waiting request whose KV does not fit yet may be overtaken by at most this many later (smaller) requests; after
# that nothing new is admitted until it fits, so a long prompt cannot starve behind a stream of short ones.
MAX_OVERTAKES = 8
# At most this many prompt tokens are prefilled between two decode steps (at least one whole prompt), so a burst of
# arrivals delays the rows already decoding by a bounded amount.
PREFILL_TOKENS_PER_STEP = 4096


@dataclass
class _Row:
    request: QueuedReply
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


class EagerRunner(BoundRunner):
    """The BatchRunner (llm_core.engine.runners) over transformers' forward (see the module docstring)."""

    label = "The batch scheduler"
    thread_name = "batch-scheduler"
    shutdown_message = "The model was unloaded or the demo is shutting down; this reply was stopped."
    max_overtakes = MAX_OVERTAKES
    admission_prefill_tokens: int | None = PREFILL_TOKENS_PER_STEP

    def __init__(self, model: Any, *, max_batch_size: int, kv_budget_bytes: int, kv_bytes_per_token: int,
                 cache_kwarg: str) -> None:
        if max_batch_size < 1:
            raise ValueError("max_batch_size must be at least 1")
        # A weak reference: unloading the model (the engine pool drops it) frees it, and the loop then exits.
        self._model_ref = weakref.ref(model)
        self._config = model.config
        self._max_batch_size = int(max_batch_size)
        self.kv_budget_bytes = int(kv_budget_bytes)  # read at every admission: may be changed while running
        self.kv_bytes_per_token = int(kv_bytes_per_token)
        self.cache_kwarg = cache_kwarg
        self.device = next(model.parameters()).device
        import inspect

        self._logits_to_keep = "logits_to_keep" in inspect.signature(type(model).forward).parameters
        self._rows: list[_Row] = []
        self._cache: Any = None

    @classmethod
    def for_model(cls, model: Any, *, max_batch_size: int, kv_budget_bytes: int, cache_dtype: torch.dtype,
                  cache_kwarg: str) -> EagerRunner:
        return cls(model, max_batch_size=max_batch_size, kv_budget_bytes=kv_budget_bytes,
                   kv_bytes_per_token=kv_bytes_per_token(model.config, cache_dtype), cache_kwarg=cache_kwarg)

    @property
    def model(self) -> Any:
        return self.held(self._model_ref)

    @property
    def max_batch_size(self) -> int:
        return self._max_batch_size

    # --- what the scheduler asks -------------------------------------------------------------------------------------
    def new_request(self, prompt_ids: list[int], options: SamplingOptions, max_new_tokens: int,
                    stop_event: threading.Event, record: Any) -> QueuedReply:
        """A request; ContextBudgetError when its KV could not fit the budget even alone."""
        request = QueuedReply(prompt_ids, options, max_new_tokens, stop_event, record)
        need = request.kv_tokens * self.kv_bytes_per_token
        if need > self.kv_budget_bytes:
            raise ContextBudgetError(
                f"This reply needs up to {need / 2**20:,.0f} MiB of KV cache ({request.kv_tokens:,} tokens), more "
                f"than the {self.kv_budget_bytes / 2**20:,.0f} MiB budget for all replies; shorten the history or "
                "lower max new tokens.")
        return request

    def new_stats(self) -> SchedulerStats:
        return SchedulerStats(kv_budget_bytes=self.kv_budget_bytes)

    def snapshot(self, stats: SchedulerStats, waiting: int) -> SchedulerStats:
        s = stats
        return SchedulerStats(waiting=waiting, active=len(self._rows),
                              kv_reserved_bytes=self._reserved_bytes(self._rows),
                              kv_held_bytes=self._held_bytes(), kv_budget_bytes=self.kv_budget_bytes,
                              decode_steps=s.decode_steps, rows_decoded=s.rows_decoded,
                              max_rows_in_step=s.max_rows_in_step, prefills=s.prefills,
                              waited_for_memory=s.waited_for_memory, errors=s.errors)

    def count_wait(self, stats: SchedulerStats, reason: str) -> bool:
        if reason != "memory":
            return False  # a full batch is not counted: waited_for_memory says the budget held a request back
        stats.waited_for_memory += 1
        return True

    def warm(self) -> None:
        pass  # nothing to allocate: the batch cache grows with its rows

    def resize(self, slot_tokens: int) -> None:
        raise GenerationError("The eager batch has no fixed KV slots to size: its cache grows with its rows.")

    @contextmanager
    def loop_mode(self) -> Iterator[None]:
        with torch.inference_mode():
            yield

    def usable(self) -> bool:
        return self._model_ref() is not None

    def busy(self) -> bool:
        return bool(self._rows)

    def decoding(self) -> bool:
        return bool(self._rows)

    def has_free_row(self) -> bool:
        return len(self._rows) < self._max_batch_size

    def fits(self, request: QueuedReply) -> bool:
        return self._reserved_bytes(self._rows, request) <= self.kv_budget_bytes

    def admit(self, request: QueuedReply) -> None:
        self._prefill_and_join(request)

    def advance_prefills(self) -> None:
        pass  # every prompt is prefilled whole at admission

    def drop_stopped_rows(self) -> None:
        keep = [i for i, row in enumerate(self._rows) if not row.request.stop_event.is_set()]
        if len(keep) < len(self._rows):
            for i, row in enumerate(self._rows):
                if i not in keep:
                    self._record_kv(row, i)
                    self.host.finish(row.request, "stopped")
            self._select_rows(keep)

    def fail_all(self, exc: BaseException) -> None:
        for row in self._rows:
            self.host.finish(row.request, "error", GenerationError(
                f"Generation failed: {type(exc).__name__}: {str(exc)[:300]}"))
        self._select_rows([])

    def take_all(self) -> list[QueuedReply]:
        pending = [row.request for row in self._rows]
        self._rows = []
        self._cache = None
        return pending

    # --- admission ---------------------------------------------------------------------------------------------------
    def _reserved_bytes(self, rows: Sequence[_Row], extra: QueuedReply | None = None) -> int:
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

    # --- model calls -------------------------------------------------------------------------------------------------
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

    def _prefill_and_join(self, request: QueuedReply) -> None:
        """Prefill alone (batch 1, like a reply served alone), pick the first token, and join the batch."""
        host = self.host
        row: _Row | None = None
        try:
            prompt = torch.tensor([request.prompt_ids], dtype=torch.long, device=self.device)
            cache = self._new_cache()
            logits = self._forward(prompt, torch.ones_like(prompt), torch.arange(prompt.shape[1],
                                   device=self.device).unsqueeze(0), cache)
            if cache.get_seq_length() != prompt.shape[1]:
                raise GenerationError(f"The model did not fill the cache passed as `{self.cache_kwarg}`; batching "
                                      "cannot run with this model / transformers version. Set MAX_BATCH_SIZE=1.")
            host.stats.prefills += 1
            row = self._make_row(request, len(request.prompt_ids))
            token = self._pick(row, logits)
        except BaseException as exc:  # this request only: the batch is untouched
            _free_after_error(exc, self.device)
            host.finish(request, "error", exc)
            return
        if request.stop_event.is_set():
            host.finish(request, "stopped")
            return
        reason = host.deliver(request, token, row.new_tokens)
        if reason:
            if request.record is not None:
                request.record.record(cache, 0)
            host.finish(request, reason)
            return
        try:
            self._join(row, cache)
        except BaseException as exc:
            _free_after_error(exc, self.device)
            host.finish(request, "error", exc)

    def _make_row(self, request: QueuedReply, prompt_len: int) -> _Row:
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

    def decode_step(self) -> None:
        host = self.host
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
        stats = host.stats
        stats.decode_steps += 1
        stats.rows_decoded += len(rows)
        stats.max_rows_in_step = max(stats.max_rows_in_step, len(rows))
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
                    host.finish(row.request, "stopped")
                    continue
                token = self._pick(row, logits[i:i + 1])
            except BaseException as exc:  # this row only (e.g. its sampling options)
                host.finish(row.request, "error", exc)
                continue
            reason = host.deliver(row.request, token, row.new_tokens)
            if reason:
                self._record_kv(row, i)  # before finishing: the reply's final stats read it
                host.finish(row.request, reason)
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
            self.host.finish(self._rows[newest].request, "error", exc)
            self._select_rows([i for i in range(len(self._rows)) if i != newest])
            return
        for row in self._rows:
            self.host.finish(row.request, "error", exc)
        self._select_rows([])

    # --- the batch cache ---------------------------------------------------------------------------------------------
    def _width(self) -> int:
        layer = self._cache.layers[0]
        return int(layer.keys.shape[-2])

    def _join(self, row: _Row, cache: Any) -> None:
        """Add a prefilled single-row cache to the batch cache, left-padding whichever side is shorter."""
        if self._cache is None or not self._rows:
            self._cache = cache
            row.pad_left = 0
            with self.host.cond:
                self._rows = [row]
            return
        width, length = self._width(), row.length
        grow = max(0, length - width)
        row.pad_left = max(0, width - length)
        for old, new in zip(self._cache.layers, cache.layers, strict=True):
            old.keys = torch.cat([_pad_left(old.keys, grow), _pad_left(new.keys, row.pad_left)], dim=0)
            old.values = torch.cat([_pad_left(old.values, grow), _pad_left(new.values, row.pad_left)], dim=0)
        with self.host.cond:
            for other in self._rows:
                other.pad_left += grow
            self._rows = [*self._rows, row]

    def _select_rows(self, keep: list[int]) -> None:
        """Keep only rows `keep` (batch indices) and cut columns that are padding in every remaining row."""
        with self.host.cond:
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
