"""The CPU decode backend: ChatEngine's DecodeBackend over llm_core.fast.cpu.CPUDecoder; knows nothing of Gradio."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from ..prefix_cache import PrefixCache
from ..types import LoadedModel
from .serving import RowKV


@dataclass
class CPUBackend:
    """llm_core.fast.cpu: int4/int8 weight-only linears, a static KV cache and a decode step compiled by inductor."""

    decoder: Any  # llm_core.fast.cpu.CPUDecoder
    reason: str
    prefill_chunk_tokens: int | None
    name: str = "cpu"
    cache_at_start: bool = True

    def make_cache(self) -> RowKV:
        """What the reply's KV held at its end, filled by run(): the static cache's rows it wrote (the cache is
        allocated empty, so rows never written are never resident)."""
        return RowKV()

    def run(self, prepared: Any, streamer: Any, stop_event: threading.Event, cache: Any) -> int:
        """Returns the prompt tokens whose KV came from the cache (not prefilled)."""
        gen = prepared.gen
        info: dict[str, int] = {}
        try:
            self.decoder.generate(prepared.input_ids, prepared.attention_mask, gen, streamer, stop_event,
                                  gen.max_new_tokens, min_new_tokens=gen.min_new_tokens,
                                  eos_ids=self.decoder.loaded.eos_token_ids, prefill_chunk=self.prefill_chunk_tokens,
                                  info=info)
            return info.get("cached_prompt_tokens", 0)
        finally:
            if self.decoder.compile_error and "eager" not in self.reason:  # the model panel says what runs
                self.reason += f"; compiling failed ({self.decoder.compile_error}): running eagerly"
            if isinstance(cache, RowKV):
                cache.nbytes = self.decoder.rows_used * self.decoder.kv_bytes_per_token()


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
    return CPUBackend(decoder, reason, prefill_chunk_tokens)
