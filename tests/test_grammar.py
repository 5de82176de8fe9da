"""Structured output (llm_core.grammar): the embedded model's replies are valid JSON for the schema when masked."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
import torch

from llm_core.engine.chat import ChatEngine
from llm_core.errors import InputError
from llm_core.grammar import JsonLogitsProcessor, TokenGrammar

SCHEMAS: list[dict[str, Any]] = [
    {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"],
     "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"}, "minItems": 1,
                                               "maxItems": 3}},
     "required": ["tags"], "additionalProperties": False},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "id": {"type": "integer"}, "active": {"type": "boolean"}}, "required": ["id", "active"],
        "additionalProperties": False}}, "required": ["user"], "additionalProperties": False},
    {"type": "object", "properties": {"answer": {"type": "number"}, "unit": {"enum": ["km", "mi"]}},
     "required": ["answer", "unit"], "additionalProperties": False},
]
PROMPTS = ["Describe a person.", "Pick a color.", "Tag this post about cooking pasta.", "Make a user record.",
           "How far is it from Paris to Lyon?"]


@pytest.fixture(scope="module")
def grammar(fp32_engine: ChatEngine) -> TokenGrammar:
    loaded = fp32_engine.loaded
    return TokenGrammar(loaded.tokenizer, loaded.model.config.vocab_size, loaded.eos_token_ids)


def _constrained_reply(engine: ChatEngine, grammar: TokenGrammar, schema: dict[str, Any] | None, prompt: str,
                       *, do_sample: bool, seed: int = 0) -> str:
    loaded = engine.loaded
    ids = loaded.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                               return_tensors="pt", return_dict=True)["input_ids"]
    constraint = grammar.json_constraint(schema, max_tokens=96)
    torch.manual_seed(seed)
    out = loaded.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=96, do_sample=do_sample,
                                temperature=0.8 if do_sample else None, top_p=None, top_k=None,
                                logits_processor=[JsonLogitsProcessor(constraint, ids.shape[1])],
                                pad_token_id=min(grammar.eos_token_ids))
    new = out[0, ids.shape[1]:].tolist()
    assert new[-1] in grammar.eos_token_ids, loaded.tokenizer.decode(new)
    return loaded.tokenizer.decode(new[:-1])


@pytest.mark.parametrize("index", range(len(SCHEMAS)))
@pytest.mark.parametrize("do_sample", [False, True], ids=["greedy", "sampled"])
def test_constrained_reply_is_valid_json_for_the_schema(fp32_engine: ChatEngine, grammar: TokenGrammar, index: int,
                                                        do_sample: bool) -> None:
    text = _constrained_reply(fp32_engine, grammar, SCHEMAS[index], PROMPTS[index], do_sample=do_sample)
    jsonschema.validate(json.loads(text), SCHEMAS[index])


def test_json_object_mode_gives_an_object(fp32_engine: ChatEngine, grammar: TokenGrammar) -> None:
    text = _constrained_reply(fp32_engine, grammar, None, "List three fruits.", do_sample=False)
    assert isinstance(json.loads(text), dict)


def test_the_mask_allows_only_tokens_that_continue_the_schema(fp32_engine: ChatEngine, grammar: TokenGrammar
                                                              ) -> None:
    tokenizer = fp32_engine.loaded.tokenizer
    constraint = grammar.json_constraint(SCHEMAS[1])
    allowed = constraint.allowed()
    assert allowed.shape == (grammar.vocab_size,)
    for token in torch.nonzero(allowed).flatten().tolist()[:200]:
        assert '{"color": "'.startswith(tokenizer.decode([token])), tokenizer.decode([token])
    scores = torch.zeros(1, grammar.vocab_size)
    constraint.mask_(scores)
    assert torch.equal(torch.isfinite(scores[0]), allowed)
    assert not bool(allowed[sorted(grammar.eos_token_ids)].any())  # no end before the value is complete


def test_an_unusable_schema_is_refused_with_a_clear_error(grammar: TokenGrammar) -> None:
    with pytest.raises(InputError, match="JSON schema"):
        grammar.json_constraint({"type": "object", "properties": {"x": {"type": "no-such-type"}}})


def test_a_looping_value_is_closed_within_the_token_budget(fp32_engine: ChatEngine, grammar: TokenGrammar) -> None:
    """Greedy, with no repetition penalty, the embedded model repeats digits without end in this schema; the wrap-up
    closes the value inside a 40-token budget."""
    loaded = fp32_engine.loaded
    ids = loaded.tokenizer.apply_chat_template([{"role": "user", "content": "Make a user record."}],
                                               add_generation_prompt=True, return_tensors="pt",
                                               return_dict=True)["input_ids"]
    replies = []
    for max_tokens in (None, 40):
        constraint = grammar.json_constraint(SCHEMAS[3], max_tokens=max_tokens)
        out = loaded.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False,
                                    logits_processor=[JsonLogitsProcessor(constraint, ids.shape[1])],
                                    pad_token_id=min(grammar.eos_token_ids))
        replies.append(out[0, ids.shape[1]:].tolist())
    unbounded, bounded = replies
    assert unbounded[-1] not in grammar.eos_token_ids  # without the wrap-up the budget runs out mid-value
    assert bounded[-1] in grammar.eos_token_ids
    jsonschema.validate(json.loads(loaded.tokenizer.decode(bounded[:-1])), SCHEMAS[3])


def test_a_structured_reply_streams_token_by_token(fp32_engine: ChatEngine) -> None:
    """JSON is mostly symbols, which the base streamer holds back until a space: a structured reply's text must still
    grow with every token (so /v1 stream chunks and the UI follow the reply), ending in symbols mid-stream, and equal
    the whole reply at the end (without every_token: 4 growing texts for 17 tokens)."""
    from llm_core.constraints import OutputSpec, RowControl

    schema = {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a1", "b2", "c3"]},
                                                        "minItems": 2, "maxItems": 3}},
              "required": ["tags"], "additionalProperties": False}
    control = RowControl.for_model(OutputSpec(json=True, json_schema=schema), fp32_engine.loaded)
    gen = fp32_engine.request_options(max_new_tokens=48, do_sample=False, control=control)
    updates = list(fp32_engine.stream_chat("Tag this.", [], gen=gen))
    final = updates[-1]
    jsonschema.validate(json.loads(final.text), schema)
    texts = [u.text for u in updates[:-1]]
    growing = [t for i, t in enumerate(texts) if t and (i == 0 or t != texts[i - 1])]
    assert len(growing) >= final.stats.new_tokens - 2, (len(growing), final.stats.new_tokens, texts)
    assert any(t[-1] in '{["]:,' for t in growing[:-1])  # a prefix ending in a symbol reached the reader
    assert all(final.text.startswith(t) for t in texts)
