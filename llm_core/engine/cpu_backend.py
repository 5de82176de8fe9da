"""The CPU decode backend: ChatEngine's DecodeBackend over the one scheduler (llm_core.engine.scheduler) with a
CPURunner (llm_core.engine.cpu_runner) over llm_core.fast.cpu.CPUDecoder; knows nothing of Gradio."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..prefix_cache import PrefixCache
from ..types import LoadedModel
from .cpu_runner import CPURunner
from .scheduler import Scheduler
from .serving import ScheduledBackend


@dataclass
class CPUBackend(ScheduledBackend):
    """llm_core.fast.cpu: int4/int8 weight-only linears, a static KV cache and a decode step compiled by inductor;
    every reply is the row of the scheduler's CPU runner (one at a time), with the loop's queue, Stop and counters.
    `decoder` holds the CPUDecoder (its runner holds it weakly)."""

    scheduler: Scheduler[CPURunner]
    decoder: Any  # llm_core.fast.cpu.CPUDecoder
    reason: str
    name: str = "cpu"
    cache_at_start: bool = True

    @property
    def prefill_chunk_tokens(self) -> int | None:
        """Long prompts are prefilled in chunks of this many tokens, one chunk per turn of the loop (None: one pass)."""
        return self.scheduler.runner.prefill_chunk_tokens

    def prompt_ids(self, prepared: Any) -> Any:
        """The prompt with its padding dropped. The reply's RowKV gets the static cache's rows the reply wrote (the
        cache is allocated empty, so rows never written are never resident). The first reply allocates the cache
        and compiles the step on the loop's thread."""
        mask = prepared.attention_mask
        return prepared.input_ids if bool(mask.all()) else prepared.input_ids[mask.bool()][None]

    def after_reply(self) -> None:
        if self.decoder.compile_error and "eager" not in self.reason:  # the model panel says what runs
            self.reason += f"; compiling failed ({self.decoder.compile_error}): running eagerly"


def cpu_backend(loaded: LoadedModel, weights: Any, cache_tokens: int, prefill_chunk_tokens: int | None, *,
                prefix_cache: bool = True) -> CPUBackend:
    """The backend for a model that loading.py quantized for the CPU path; the reason is what the model panel shows.
    prefix_cache: reuse the KV of the longest prefix a prompt shares with the last reply's ids (PREFIX_CACHE)."""
    from ..fast.cpu import CPUDecoder

    decoder = CPUDecoder(loaded, weights, max_cache_len=min(loaded.context_length, cache_tokens),
                         prefix_cache=PrefixCache() if prefix_cache else None)
    asked = loaded.settings.quantization
    if weights.fmt == "dense":
        what = f"{str(weights.layers[0][0].tensors[0].dtype).removeprefix('torch.')} weights (QUANTIZATION=none)"
    else:
        what = (f"{weights.fmt} weight-only linears (torch's CPU kernels, bf16 activations), "
                f"{weights.head.fmt} lm_head")
        if asked != weights.fmt:
            what += f"; QUANTIZATION={asked} was asked: bitsandbytes' {asked.upper()} is several times slower on CPU"
    compiled = (f"compiled by inductor (C++): {len(decoder.groups)} calls of up to {decoder.layers_per_graph} layers, "
                "then the head")
    reason = (f"CPU path: {what}; static KV cache ({str(decoder.cache_dtype).removeprefix('torch.')}); decode step "
              f"{'eager' if decoder.compile_mode == 'off' else compiled} (docs/cpu.md)")
    scheduler = Scheduler(CPURunner(decoder, prefill_chunk_tokens=prefill_chunk_tokens),
                          eos_token_ids=sorted(loaded.eos_token_ids))
    return CPUBackend(scheduler, decoder, reason)
