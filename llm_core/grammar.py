"""Constrained decoding: a JSON schema (or "any JSON object") as a mask over each step's logits, through llguidance.

Knows nothing about the decode paths: a path asks `JsonConstraint.mask_` for the scores of the next token and tells
it each token it picked with `accept`. Why llguidance: a 3 MB wheel with no dependencies that computes a 49k-vocab
mask in about 10 us per step on CPU (the mask is applied where the logits are, CPU or CUDA); xgrammar needs triton,
pydantic and a native FFI package on top.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from typing import Any

import llguidance
import llguidance.hf
import torch
from transformers import LogitsProcessor

from .errors import GenerationError, InputError

# Fixed whitespace: with flexible whitespace a small model can spend its whole reply on indentation tokens. One space
# after ':' and ',': json.dumps' layout, the one models mostly saw in training (the reply streams token by token either
# way: engine/chat.py's streamer passes each token of a structured reply on at once).
_JSON_DEFAULTS: Any = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_JSON_OBJECT: Mapping[str, Any] = {"type": "object"}
# Wrap-up: in the last quarter of the reply's token budget (at least this many tokens) the mask keeps, of the allowed
# tokens, those that close a value first, so a model looping inside a string or a number still ends valid JSON.
WRAP_UP_MIN_TOKENS = 24
# Tried in order, (characters, whole token made of them or just containing one): first tokens made only of quote,
# brace and bracket (inside a string a token merely containing '}' would not close it), then ending an object/array,
# ending a string, moving to the next item.
_CLOSING_TIERS = (('"}]', True), ("}]", False), ('"', False), (",", False))


class TokenGrammar:
    """One model's vocabulary as llguidance sees it; built once per loaded model (about 0.5 s for 49k tokens)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Collection[int]) -> None:
        if not eos_token_ids:
            raise InputError("Structured output needs a model with an end-of-sequence token.")
        self.vocab_size = int(vocab_size)
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self._tokenizer = llguidance.hf.from_tokenizer(tokenizer, eos_token=sorted(self.eos_token_ids))
        # bit b of word w of llguidance's mask allows token 32 * w + b
        self._bits = torch.arange(32, dtype=torch.int32)
        pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
        self.closing_tiers = [torch.tensor([bool(p) and (all if whole else any)(c in chars for c in p) for p in pieces]
                                           + [False] * max(0, self.vocab_size - len(pieces)))[: self.vocab_size]
                              for chars, whole in _CLOSING_TIERS]

    def json_constraint(self, schema: Mapping[str, Any] | None = None, max_tokens: int | None = None
                        ) -> JsonConstraint:
        """A fresh constraint for one reply of at most `max_tokens` new tokens (None: no wrap-up): valid JSON for
        `schema` (None: any JSON object)."""
        try:
            text = json.dumps(dict(ANY_JSON_OBJECT if schema is None else schema))
        except (TypeError, ValueError) as exc:
            raise InputError(f"The JSON schema is not valid JSON: {exc}.") from None
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(text, defaults=_JSON_DEFAULTS)
            error = llguidance.LLMatcher.validate_grammar(grammar, self._tokenizer)
        except (TypeError, ValueError, RuntimeError) as exc:  # the schema's own fault, said by llguidance
            raise InputError(f"This JSON schema cannot be used for structured output: {exc}") from None
        if error:
            raise InputError(f"This JSON schema cannot be used for structured output: {error}")
        return JsonConstraint(self, llguidance.LLMatcher(self._tokenizer, grammar), max_tokens)

    def unpack(self, bitmask: torch.Tensor) -> torch.Tensor:
        """(words,) int32 llguidance mask -> (vocab_size,) bool, True where the token is allowed."""
        allowed = ((bitmask.unsqueeze(-1) >> self._bits) & 1).reshape(-1).bool()
        if allowed.numel() < self.vocab_size:  # model vocabularies padded beyond the tokenizer's
            allowed = torch.cat([allowed, allowed.new_zeros(self.vocab_size - allowed.numel())])
        return allowed[: self.vocab_size]


class JsonConstraint:
    """One reply's grammar state (not shared between threads): mask the next token's scores, then accept the pick."""

    def __init__(self, grammar: TokenGrammar, matcher: Any, max_tokens: int | None = None) -> None:
        self._grammar = grammar
        self._matcher = matcher
        self.wrap_up_at = None if max_tokens is None else max(0, max_tokens - max(WRAP_UP_MIN_TOKENS, max_tokens // 4))
        self._words = torch.empty((grammar._tokenizer.vocab_size + 31) // 32, dtype=torch.int32)
        self.tokens = 0

    @property
    def done(self) -> bool:
        """The JSON value is complete: only an end-of-sequence token is allowed next."""
        return bool(self._matcher.is_stopped())

    def allowed(self) -> torch.Tensor:
        """(vocab_size,) bool on CPU: the tokens that keep the output a prefix of valid JSON for the schema (in the
        wrap-up, only those of the first closing tier that has any)."""
        self._matcher.unsafe_compute_mask_ptr(self._words.data_ptr(), self._words.numel() * 4)
        self._raise_on_error()
        allowed = self._grammar.unpack(self._words)
        if self.wrap_up_at is not None and self.tokens >= self.wrap_up_at:
            for tier in self._grammar.closing_tiers:
                closing = allowed & tier
                if bool(closing.any()):
                    return closing
        return allowed

    def mask_(self, scores: torch.Tensor) -> torch.Tensor:
        """Set the scores of disallowed tokens to -inf in place; scores is (vocab,) or (1, vocab), any device."""
        allowed = self.allowed().to(scores.device, non_blocking=True)
        vocab = scores.shape[-1]
        if vocab != allowed.numel():
            allowed = allowed[:vocab] if vocab < allowed.numel() else torch.cat(
                [allowed, allowed.new_zeros(vocab - allowed.numel())])
        return scores.masked_fill_(~allowed, float("-inf"))

    def accept(self, token: int) -> None:
        """Advance past the picked token (an end-of-sequence token ends the value)."""
        if not self._matcher.consume_token(int(token)):
            raise GenerationError(f"Token {int(token)} breaks the JSON schema: {self._matcher.get_error()}")
        self.tokens += 1

    def _raise_on_error(self) -> None:
        if self._matcher.is_error():
            raise GenerationError(f"Structured output failed: {self._matcher.get_error()}")


class JsonLogitsProcessor(LogitsProcessor):
    """The constraint as a transformers logits processor for `generate` (batch 1): each call first accepts the
    token the previous step picked, then masks the new scores."""

    def __init__(self, constraint: JsonConstraint, prompt_tokens: int) -> None:
        self.constraint = constraint
        self._seen = int(prompt_tokens)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if input_ids.shape[0] != 1:
            raise GenerationError("Structured output runs one reply per batch row; got a batch of "
                                  f"{input_ids.shape[0]}.")
        for token in input_ids[0, self._seen:].tolist():
            self.constraint.accept(token)
        self._seen = input_ids.shape[1]
        self.constraint.mask_(scores)
        return scores
