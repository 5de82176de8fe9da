"""The one sampler: transformers' warpers in its order (temperature, top-k, top-p), then multinomial."""

from __future__ import annotations

import torch

from .config import GenerationSettings


def sample_from_scores(scores: torch.Tensor, gen: GenerationSettings, generator: torch.Generator | None
                       ) -> torch.Tensor:
    """transformers' warpers in its order (temperature, top-k, top-p), then multinomial. scores (1, V) -> (1,)."""
    if gen.temperature != 1.0:
        scores = scores / gen.temperature
    if gen.top_k:
        top_k = min(gen.top_k, scores.shape[-1])
        kth = torch.topk(scores, top_k)[0][..., -1, None]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if gen.top_p < 1.0:
        sorted_logits, sorted_idx = torch.sort(scores, descending=False)
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        remove = cum <= (1 - gen.top_p)
        remove[..., -1:] = False
        scores = scores.masked_fill(remove.scatter(1, sorted_idx, remove), float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator).view(1)


# --- the decoder ---------------------------------------------------------------------------------------------
