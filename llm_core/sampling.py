"""The one sampler of every decode loop we own (fast and batched): transformers' own logits processors, built the
way `generate` builds them, then argmax or multinomial. The plain path is `generate` itself, so all three agree.

Knows nothing of models or caches: it takes (1, vocab) float32 scores and the request's sampling options.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from transformers import (
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)


class SamplingParams(Protocol):
    """What the sampler reads of GenerationSettings (or the batched path's per-row options)."""

    @property
    def do_sample(self) -> bool: ...

    @property
    def temperature(self) -> float: ...

    @property
    def top_p(self) -> float: ...

    @property
    def top_k(self) -> int: ...

    @property
    def repetition_penalty(self) -> float: ...


@dataclass(frozen=True)
class SamplingOptions:
    """One request's sampling options as a batch scheduler keeps them per row (the eager and the batched fast one):
    the GenerationSettings fields the sampler reads, its seed, min_new_tokens (the batched fast path bans EOS
    until then) and its output control (llm_core.constraints.RowControl: grammar, penalties, logprobs)."""

    do_sample: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    repetition_penalty: float = 1.0
    seed: int | None = None
    min_new_tokens: int = 0
    control: Any = field(default=None, compare=False)

    @classmethod
    def of(cls, gen: Any) -> SamplingOptions:
        return cls(do_sample=bool(gen.do_sample), temperature=float(gen.temperature), top_p=float(gen.top_p),
                   top_k=int(gen.top_k), repetition_penalty=float(gen.repetition_penalty), seed=gen.seed,
                   min_new_tokens=int(getattr(gen, "min_new_tokens", 0) or 0), control=getattr(gen, "control", None))


def sampling_generator(params: Any, device: torch.device | str | None = None) -> torch.Generator | None:
    """The random generator of one sampled reply (None when it decodes greedily): seeded with `params.seed` when
    set, else from fresh entropy."""
    if not params.do_sample:
        return None
    generator = torch.Generator(device=device) if device is not None else torch.Generator()
    if params.seed is not None:
        generator.manual_seed(int(params.seed))
    else:
        generator.seed()
    return generator


def logits_processors(params: SamplingParams, *, penalty: bool = True) -> LogitsProcessorList:
    """generate's processors for these options, in its order: repetition penalty (unless the caller applies it,
    as the fast path does inside its graph), then the warpers temperature, top-k, top-p (only when sampling)."""
    processors = LogitsProcessorList()
    if penalty and params.repetition_penalty != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(penalty=float(params.repetition_penalty)))
    if params.do_sample:
        if params.temperature != 1.0:
            processors.append(TemperatureLogitsWarper(float(params.temperature)))
        if params.top_k:
            processors.append(TopKLogitsWarper(top_k=int(params.top_k)))
        if params.top_p < 1.0:
            processors.append(TopPLogitsWarper(top_p=float(params.top_p)))
    return processors


def next_token(scores: torch.Tensor, do_sample: bool, processors: LogitsProcessorList,
               seen: torch.Tensor | None = None, generator: torch.Generator | None = None,
               control: Any = None) -> torch.Tensor:
    """scores (1, V) float32 -> the next token id (1,): the processors (seen: (1, T) ids the penalty reads), then
    multinomial over the softmax when sampling, else argmax. A `control` (llm_core.constraints.RowControl) runs
    between the repetition penalty and the warpers, as generate runs a custom logits processor, and is told the
    pick."""
    ids = seen if seen is not None else _NO_IDS.to(scores.device)
    if control is not None:
        penalties = [p for p in processors if isinstance(p, RepetitionPenaltyLogitsProcessor)]
        for processor in penalties:
            scores = processor(ids, scores)  # type: ignore[arg-type]
        scores = control.process(scores)
        processors = LogitsProcessorList(p for p in processors if p not in penalties)
    if len(processors):
        scores = processors(ids, scores)  # type: ignore[arg-type]  # LongTensor is a typing-only alias
    if do_sample:
        token = torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1, generator=generator).view(1)
    else:
        token = scores.argmax(dim=-1).view(1)
    if control is not None:
        control.accept(int(token))
    return token


def sample_from_scores(scores: torch.Tensor, params: Any, generator: torch.Generator | None) -> torch.Tensor:
    """The warpers (no penalty: the scores have it) and multinomial. scores (1, V) -> (1,). A row with an output
    control (`params.control`) goes through it and picks greedily when it does not sample."""
    control = getattr(params, "control", None)
    return next_token(scores, bool(params.do_sample) or control is None, logits_processors(params, penalty=False),
                      None, generator, control)


def host_pick(params: Any) -> bool:
    """Whether a row's token is picked on the host from its scores: it samples, or it has an output control."""
    return bool(params.do_sample) or getattr(params, "control", None) is not None


_NO_IDS = torch.zeros((1, 0), dtype=torch.long)  # the warpers never read input ids; a constant, never written
