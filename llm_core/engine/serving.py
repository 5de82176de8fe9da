"""Batched serving's settings and engine-facing pieces: MAX_BATCH_SIZE resolved, whether the eager batch can serve a
model, the eager batch's KV budget, each reply's KV record (RowKV) and the DecodeBackends over the one scheduler
(llm_core.engine.scheduler: BatchedBackend with its eager runner, FastBatchedBackend with its fast runner; the CPU
path's, llm_core.engine.cpu_backend, is a ScheduledBackend too). Knows nothing about Gradio.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..sampling import SamplingOptions

if TYPE_CHECKING:
    from .eager_runner import EagerRunner
    from .fast_runner import FastRunner
    from .scheduler import Scheduler

AUTO_BATCH_SIZE_CUDA = 8


# --- settings ----------------------------------------------------------------------------------------------------


def resolve_max_batch_size(setting: int | None, device: torch.device, decode_path: str, shared: bool = False,
                           paged: bool = False) -> int:
    """MAX_BATCH_SIZE as the engine uses it. Empty (None) = auto: on CUDA 8 when the demo is shared (SHARE, AUTH or a
    non-local HOST: several users at once) or the batched fast path keeps its KV in one paged pool (KV_LAYOUT=paged:
    a lone reply may use the whole pool, so batching costs a lone user no context), else 1; 1 on CPU (the CPU path
    serves one reply at a time). With fixed slots (KV_LAYOUT=slots) a batch splits the KV budget, so an unshared demo
    keeps the single-reply loop, whose one cache holds the whole budget. The engine batches an unshared demo only
    where the batched fast path serves (startup.PathBuilder.configure_decode): the eager batch has no paged pool. A
    number set here batches whatever the sharing. `decode_path` is kept for callers."""
    if setting is not None:
        return int(setting)
    if device.type != "cuda" or not (shared or paged):
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


# --- a reply's KV record -----------------------------------------------------------------------------------------


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


class ScheduledBackend:
    """What every DecodeBackend over the one scheduler shares (the eager batch's, the batched fast path's, the CPU
    path's): each reply is a row of `scheduler`'s runner, its KV recorded in a RowKV."""

    scheduler: Scheduler[Any]

    def make_cache(self) -> RowKV:
        return RowKV()

    def warmup(self) -> None:
        """Start the loop (idempotent): the runner warms up first (the fast path: slots, compile, graphs)."""
        self.scheduler.start()

    def prompt_ids(self, prepared: Any) -> torch.Tensor:
        """The ids the row is prefilled from (the CPU path drops the prompt's padding)."""
        return prepared.input_ids

    def submit(self, prepared: Any, streamer: Any, stop_event: threading.Event, cache: Any) -> Any:
        """Queue the prepared reply as a row and hand `streamer` its prompt (what `generate` does first); `feed` then
        reads the reply's token ids. Returns the request (streams.QueuedReply)."""
        gen = prepared.gen
        ids = self.prompt_ids(prepared)
        request = self.scheduler.submit(ids.reshape(-1).tolist(), SamplingOptions.of(gen), gen.max_new_tokens,
                                        stop_event, cache if isinstance(cache, RowKV) else None)
        if streamer is not None:
            streamer.put(ids.detach().reshape(1, -1).cpu())
        return request

    def cached_tokens(self, cache: Any) -> int:
        """After the reply: the prompt tokens whose KV came from a cache instead of the prefill."""
        return cache.cached_prompt_tokens if isinstance(cache, RowKV) else 0

    def after_reply(self) -> None:
        """Called once a reply of this backend ended (the CPU path updates what its panel says)."""

    def feed(self, prepared: Any, streamer: Any, stop_event: threading.Event, cache: Any,
             timeout_s: float | None = None, hold: Callable[[], float] | None = None) -> Iterator[None]:
        """Queue the prepared reply as a row (submit) and feed `streamer` its token ids on the calling thread as the
        scheduler delivers them, each read's ids stamped at their delivery (the engine's streamer, put_ids; another
        streamer gets them as a tensor); yields after each read. Raises the reply's error, or streams.TokenTimeout
        after timeout_s without a token; calls after_reply however it ends. The caller ends the streamer. `hold`:
        seconds to sleep after a read before the next (TokenStreams.token_batches)."""
        try:
            request = self.submit(prepared, streamer, stop_event, cache)
            read = 0
            for ids in self.scheduler.token_batches(request, timeout_s, hold=hold):
                if hasattr(streamer, "put_ids"):
                    streamer.put_ids(ids, request.delivered_s[read:read + len(ids)])
                elif streamer is not None:
                    streamer.put(torch.tensor(ids))
                read += len(ids)
                yield
        finally:
            self.after_reply()

    def run(self, prepared: Any, streamer: Any, stop_event: threading.Event, cache: Any) -> int:
        """The prepared reply as a row, streamed into `streamer` on the calling thread (DecodeBackend's form; the
        engine reads the row on the reply's thread itself: feed). Returns the prompt tokens whose KV came from a
        cache instead of the prefill."""
        try:
            for _ in self.feed(prepared, streamer, stop_event, cache):
                pass
        finally:
            if streamer is not None:
                streamer.end()
        return self.cached_tokens(cache)


@dataclass
class BatchedBackend(ScheduledBackend):
    """The engine's DecodeBackend (llm_core.engine.runners) over the scheduler with an EagerRunner: each reply is a
    row of the batch."""

    scheduler: Scheduler[EagerRunner]
    reason: str
    name: str = "batched"
    cache_at_start: bool = True


@dataclass
class FastBatchedBackend(ScheduledBackend):
    """The engine's DecodeBackend over the scheduler with a FastRunner (llm_core.engine.fast_runner): every reply,
    alone or not, is a row of the batched fast step. `decoder` is the FastDecoder whose packed weights it runs (its
    max_cache_len is the slot length: the context one reply may span)."""

    scheduler: Scheduler[FastRunner]
    decoder: Any
    reason: str
    name: str = "fast-batched"
    cache_at_start: bool = True
    measures_peak: bool = True  # the scheduler records each reply's peak (RowKV); the engine resets nothing
