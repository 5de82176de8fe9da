"""The fast decode path: a static KV cache and a compiled decode step replayed as CUDA graphs; knows nothing of chat.

It takes a `LoadedModel` and token ids, never text, settings files or the UI. The pipeline, named gpt-fast style:
`pack_weights -> prefill -> decode_step -> select -> stream`.

- pack_weights: the model's own tensors, read in place (no copy) from transformers modules; q/k/v and gate/up
  are fused into one linear each by concatenating their rows. For bitsandbytes NF4 the packed 4-bit data is
  concatenated exactly (blocks never straddle rows) and the transformers modules are re-pointed at views of the
  fused storage, so the plain path keeps working on the same bytes and memory is not doubled. Double-quantized
  absmax is kept exactly (per-256-block scale and offset) or, for bitsandbytes' kernel, requantized once.
- prefill: one pass over the prompt (SDPA causal attention), writes K/V into the static cache; on CUDA each
  layer is compiled with the prompt length dynamic (one compile for every length), eager if that fails.
- decode_step: a hand-written llama-family layer (RMSNorm, RoPE, cache write, attention, SwiGLU) compiled once
  with torch.compile(fullgraph=True), the attended length dynamic, then captured as one CUDA graph per length
  bucket at warm-up. Attention is a Triton split-K kernel that reads cache rows up to the live position only.
  Replaying a graph launches every kernel of all layers with no Python and no host sync.
- select: repetition penalty, min-new-tokens and greedy argmax run inside the graph; sampling (temperature, top-k,
  top-p, multinomial) runs eagerly on the device right after the replay, with a per-request generator.
- stream: each new token is copied into pinned host memory with an event; the host reads token i after it has
  queued step i+1 (a one-step lag), so the GPU never waits for Python and Stop halts after at most one step.

On CPU the same code runs eagerly (no compile, no graphs): that is what the token-equality test exercises.

Modules, in pipeline order: `support` (can this model run here?), `options`, `pack` (pack_weights), `layer` (the
decode and prefill layer, the head), `kernels/` (attention, nf4_gemv, dense_gemv), `timing`, `generate`
(FastDecoder: cache, compile, graphs, the decode loop).
"""

from __future__ import annotations

from .generate import FastDecoder, KVCacheView, bucket_list
from .options import FastDecodeOptions
from .support import fast_path_support

__all__ = ["FastDecodeOptions", "FastDecoder", "KVCacheView", "bucket_list", "fast_path_support"]
