"""One reply's output controls, applied by every decode path at its token pick: the JSON grammar mask, OpenAI's
presence and frequency penalties, and the logprobs capture.

`OutputSpec` is what a request asks for (frozen, from the API or the UI); `RowControl` is one reply's state built from
it for one loaded model. A path calls `process(scores)` on the step's (1, vocab) float32 scores after the repetition
penalty and before the sampling warpers, picks, then calls `accept(token)`. Rows without a control keep their path's
own pick (the CUDA graph's argmax for greedy rows), so plain replies pay nothing.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from transformers import LogitsProcessor, StoppingCriteria

from .errors import InputError
from .grammar import JsonConstraint, TokenGrammar

MAX_TOP_LOGPROBS = 20  # as OpenAI's API
PENALTY_RANGE = (-2.0, 2.0)  # presence_penalty and frequency_penalty, as OpenAI's API


@dataclass(frozen=True)
class OutputSpec:
    """What one request asks of its output. json: constrain to JSON (json_schema, or any object when None);
    top_logprobs: None = no logprobs, else the alternatives kept per token (0-20)."""

    json: bool = False
    json_schema: Mapping[str, Any] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    top_logprobs: int | None = None

    def __post_init__(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                    PENALTY_RANGE[0] <= value <= PENALTY_RANGE[1]):
                raise InputError(f"{name} must be a number from {PENALTY_RANGE[0]} to {PENALTY_RANGE[1]}, got "
                                 f"{value!r}.")
        top = self.top_logprobs
        if top is not None and (isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_TOP_LOGPROBS):
            raise InputError(f"top_logprobs must be a whole number from 0 to {MAX_TOP_LOGPROBS}, got {top!r}.")

    @property
    def active(self) -> bool:
        return self.json or bool(self.presence_penalty or self.frequency_penalty) or self.top_logprobs is not None


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log-probability and its most likely alternatives (token id, logprob), best first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


def schema_control(text: Any, loaded: Any) -> RowControl | None:
    """The chat page's "JSON schema" field as one reply's control: blank = none; otherwise a JSON schema object
    (InputError saying what is wrong when it is not valid JSON, not an object, or not usable as a grammar)."""
    if text is None or not str(text).strip():
        return None
    try:
        schema = json.loads(str(text))
    except ValueError as exc:
        raise InputError(f"The JSON schema is not valid JSON: {exc}.") from None
    if not isinstance(schema, dict):
        raise InputError("The JSON schema must be a JSON object, e.g. {\"type\": \"object\", \"properties\": {...}}.")
    if loaded is None:
        raise InputError("Structured output runs on a local engine only, not on a remote one.")
    return RowControl.for_model(OutputSpec(json=True, json_schema=schema), loaded)


def token_grammar(loaded: Any) -> TokenGrammar:
    """The loaded model's vocabulary for llguidance, built on first use (about 0.5 s) and kept with the model."""
    grammar = loaded.extra.get("token_grammar")
    if grammar is None:
        grammar = TokenGrammar(loaded.tokenizer, int(loaded.model.config.vocab_size), loaded.eos_token_ids)
        grammar = loaded.extra.setdefault("token_grammar", grammar)
    return grammar


class RowControl:
    """One reply's controls (used by one decode thread at a time; the API reads `logprobs` as they grow)."""

    def __init__(self, spec: OutputSpec, grammar: TokenGrammar | None = None) -> None:
        if spec.json and grammar is None:
            raise InputError("Structured output needs the model's vocabulary (a local engine).")
        self.spec = spec
        self._grammar = grammar
        if spec.json and grammar is not None:  # refuse a bad schema before the reply is queued
            grammar.json_constraint(spec.json_schema)
        self.constraint: JsonConstraint | None = None
        self.logprobs: list[TokenLogprob] = []
        self.mask_s = 0.0
        self.masked_steps = 0
        self._counts: torch.Tensor | None = None
        self._pending: torch.Tensor | None = None

    @classmethod
    def for_model(cls, spec: OutputSpec, loaded: Any) -> RowControl:
        return cls(spec, token_grammar(loaded) if spec.json else None)

    def start(self, max_new_tokens: int) -> None:
        """Fresh state for a reply of at most `max_new_tokens` (the grammar's wrap-up point depends on it)."""
        if self.spec.json and self._grammar is not None:
            self.constraint = self._grammar.json_constraint(self.spec.json_schema, max_tokens=int(max_new_tokens))
        self.logprobs, self.mask_s, self.masked_steps = [], 0.0, 0
        self._counts = self._pending = None

    def process(self, scores: torch.Tensor) -> torch.Tensor:
        """(1, vocab) float32 scores -> penalised and masked scores (a new tensor or `scores` itself)."""
        spec = self.spec
        if spec.presence_penalty or spec.frequency_penalty:
            if self._counts is None:
                self._counts = torch.zeros(scores.shape[-1], dtype=scores.dtype, device=scores.device)
            counts = self._counts
            # OpenAI: logit[j] -= count[j] * frequency_penalty + (count[j] > 0) * presence_penalty
            scores = scores - counts * spec.frequency_penalty - (counts > 0).to(scores.dtype) * spec.presence_penalty
        if self.constraint is not None and not self.constraint.done:
            t0 = time.perf_counter()
            scores = self.constraint.mask_(scores if scores.is_contiguous() else scores.contiguous())
            self.mask_s += time.perf_counter() - t0
            self.masked_steps += 1
        elif self.constraint is not None:  # the value is complete: only end-of-sequence may follow
            allowed = torch.zeros(scores.shape[-1], dtype=torch.bool, device=scores.device)
            allowed[[t for t in self._grammar.eos_token_ids if t < scores.shape[-1]]] = True  # type: ignore[union-attr]
            scores = scores.masked_fill(~allowed, float("-inf"))
        if spec.top_logprobs is not None:
            self._pending = torch.log_softmax(scores.float(), dim=-1)[0]
        return scores

    def accept(self, token: int) -> None:
        """The token the path picked from the processed scores."""
        token = int(token)
        if self._pending is not None:
            k = int(self.spec.top_logprobs or 0)
            top: tuple[tuple[int, float], ...] = ()
            if k:
                values, ids = torch.topk(self._pending, k)
                # tokens the mask ruled out are not alternatives (their -inf is not JSON either)
                top = tuple((t, v) for t, v in zip(ids.tolist(), values.tolist(), strict=True) if v > float("-inf"))
            self.logprobs.append(TokenLogprob(token, float(self._pending[token]), top))
            self._pending = None
        if self._counts is not None:
            self._counts[token] += 1
        if self.constraint is not None and not self.constraint.done:
            self.constraint.accept(token)

    def forget_picks(self, count: int) -> None:
        """The last `count` picks' logprobs dropped: they were picked for decode steps whose tokens the reply never
        streams (the batched loop's overlap runs a step past a row's end). Their grammar and penalty state stays:
        the reply has ended."""
        if count > 0 and self.logprobs:
            del self.logprobs[-count:]

    def stats_fields(self) -> dict[str, Any]:
        """The reply's numbers for ReplyStats: the mask's mean time per masked token."""
        if self.constraint is None:
            return {}
        return {"grammar_mask_ms_per_token": round(1000 * self.mask_s / self.masked_steps, 4)
                if self.masked_steps else 0.0}

    def hf_hooks(self) -> tuple[LogitsProcessor, StoppingCriteria]:
        """The control for transformers' `generate` (batch 1): a logits processor (after generate's repetition
        penalty, before its warpers) and a stopping criterion that accepts each picked token (never stops)."""
        return _ControlProcessor(self), _AcceptToken(self)


class _ControlProcessor(LogitsProcessor):
    def __init__(self, control: RowControl) -> None:
        self.control = control

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        return self.control.process(scores)  # type: ignore[return-value]


class _AcceptToken(StoppingCriteria):
    def __init__(self, control: RowControl) -> None:
        self.control = control

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        self.control.accept(int(input_ids[0, -1]))
        return torch.zeros((input_ids.shape[0],), dtype=torch.bool, device=input_ids.device)
