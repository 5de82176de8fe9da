"""What agents and tools send to /v1 beyond plain chat, through the official `openai` client (CPU, embedded model):
structured output, tool calls, logprobs, n, penalties, /v1/completions; and the per-reply control on each decode path.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from llm_core.constraints import OutputSpec, RowControl
from llm_core.engine.chat import ChatEngine
from llm_core.errors import InputError
from llm_core.web.openai_calls import parse_tool_calls
from tests import test_openai_api as served
from tests.conftest import make_settings
from tests.test_openai_api import KEY, ask

api, client = served.api, served.client  # the served app's fixtures (module-scoped here too)

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")  # absent on the GPU machine: the module skips there, not aborts

COLOR = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                          "shades": {"type": "array", "items": {"type": "string"}, "maxItems": 2}},
         "required": ["color", "shades"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                   "additionalProperties": False}}}
WEATHER_Q = [{"role": "user", "content": "What is the weather in Paris?"}]


def _schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "reply", "schema": schema, "strict": True}}


def _streamed(stream: Any) -> tuple[dict[int, str], list[Any]]:
    texts: dict[int, str] = {}
    chunks = list(stream)
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
    return texts, chunks


# --- structured output ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_json_schema_reply_is_valid_for_the_schema_and_reports_the_mask_time(client: Any, api: dict[str, Any],
                                                                             stream: bool) -> None:
    kwargs = dict(messages=[{"role": "user", "content": "Describe the sky."}], max_tokens=48,
                  response_format=_schema_format(COLOR))
    if stream:
        texts, chunks = _streamed(ask(client, api, stream=True, **kwargs))
        text, stats = texts[0], chunks[-1].model_extra["stats"]
    else:
        reply = ask(client, api, **kwargs)
        text, stats = reply.choices[0].message.content, reply.model_extra["stats"]
    jsonschema.validate(json.loads(text), COLOR)
    assert stats["grammar_mask_ms_per_token"] > 0


def test_json_object_reply_is_one_json_object(client: Any, api: dict[str, Any]) -> None:
    reply = ask(client, api, messages=[{"role": "user", "content": "Give me a user record."}], max_tokens=40,
                response_format={"type": "json_object"})
    assert isinstance(json.loads(reply.choices[0].message.content), dict)
    assert ask(client, api, max_tokens=4).model_extra["stats"]["grammar_mask_ms_per_token"] is None  # plain: no mask


def test_a_schema_that_cannot_be_compiled_is_a_400(client: Any, api: dict[str, Any]) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        ask(client, api, response_format=_schema_format({"type": "object", "properties": {"a": {"type": 5}}}))
    assert "schema" in str(err.value.body).lower()


# --- tool calls -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_forced_tool_call_round_trip_call_tool_message_answer(client: Any, api: dict[str, Any],
                                                              tool_choice: Any) -> None:
    reply = ask(client, api, messages=WEATHER_Q, max_tokens=40, tools=[WEATHER], tool_choice=tool_choice)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    result = {"role": "tool", "tool_call_id": call.id, "content": '{"temperature_c": 21, "sky": "clear"}'}
    history = [*WEATHER_Q, choice.message.model_dump(exclude_none=True), result]
    answer = ask(client, api, messages=history, max_tokens=30, tools=[WEATHER])
    assert answer.choices[0].finish_reason in ("stop", "length") and answer.choices[0].message.content
    assert answer.usage.prompt_tokens > reply.usage.prompt_tokens  # the call and its result are in the prompt


def test_streamed_tool_call_arrives_as_deltas_equal_to_the_whole_reply(client: Any, api: dict[str, Any]) -> None:
    """As OpenAI streams calls: the name (with id and type) in the first delta, then the arguments in pieces as they
    are generated; accumulated, the call of the same reply not streamed; no call markup in content."""
    # The prefix cache holds what earlier tests left: this first reply leaves this prompt's KV in it, so both replies
    # compared below reuse the same cached tokens and run the same computation after them.
    ask(client, api, messages=WEATHER_Q, max_tokens=2, tools=[WEATHER], tool_choice="required")
    whole = ask(client, api, messages=WEATHER_Q, max_tokens=40, tools=[WEATHER], tool_choice="required")
    texts, chunks = _streamed(ask(client, api, messages=WEATHER_Q, max_tokens=40, tools=[WEATHER],
                                  tool_choice="required", stream=True))
    deltas = [d for c in chunks if c.choices and c.choices[0].delta.tool_calls for d in c.choices[0].delta.tool_calls]
    first, rest = deltas[0], deltas[1:]
    assert first.index == 0 and first.id.startswith("call_") and first.type == "function"
    assert first.function.name == whole.choices[0].message.tool_calls[0].function.name
    assert len(rest) >= 2 and all(d.index == 0 and d.id is None and d.function.name is None for d in rest)
    streamed_args = "".join(d.function.arguments or "" for d in deltas)
    assert streamed_args == whole.choices[0].message.tool_calls[0].function.arguments
    assert texts[0] == "" and chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tool_calls_are_parsed_from_each_template_familys_format() -> None:
    names = ["get_weather"]
    hermes = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    content, calls = parse_tool_calls(hermes, names)
    assert content == "Let me check." and json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"}
    _, calls = parse_tool_calls('{"name": "get_weather", "parameters": {"city": "Rome"}}', names)  # Llama 3.1
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Rome"}
    content, calls = parse_tool_calls('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Bern"}}]', names)
    assert content is None and calls[0]["function"]["name"] == "get_weather"  # Mistral
    assert parse_tool_calls('{"name": "unknown_tool", "arguments": {}}', names) == (
        '{"name": "unknown_tool", "arguments": {}}', [])
    assert parse_tool_calls("It is sunny.", names) == ("It is sunny.", [])


def test_tools_on_a_template_without_a_tool_format_are_a_clear_400(api: dict[str, Any]) -> None:
    from llm_core.web.openai_jobs import tool_use

    class Req:
        messages = WEATHER_Q
        tools = [WEATHER]
        tool_choice = "auto"

    class Engine:
        class loaded:  # noqa: N801 - stands in for LoadedModel
            class tokenizer:  # noqa: N801
                chat_template = "{% for m in messages %}[INST] {{ m.content }} [/INST]{% endfor %}"

    with pytest.raises(InputError, match="ChatML"):
        tool_use(Engine(), Req())  # type: ignore[arg-type]


# --- n, logprobs, penalties -----------------------------------------------------------------------------------


def test_n3_sampled_choices_use_seeds_seed_plus_i_and_greedy_repeats(client: Any, api: dict[str, Any]) -> None:
    q = [{"role": "user", "content": "Write a word."}]
    sampled = ask(client, api, messages=q, n=3, temperature=0.9, seed=11, max_tokens=12)
    texts = [c.message.content for c in sampled.choices]
    assert [c.index for c in sampled.choices] == [0, 1, 2] and len(set(texts)) == 3
    for i in (1, 2):  # choice i is the reply the single request with seed 11 + i gets
        alone = ask(client, api, messages=q, temperature=0.9, seed=11 + i, max_tokens=12)
        assert alone.choices[0].message.content == texts[i]
    assert sampled.usage.completion_tokens == sum(c["new_tokens"] for c in (
        ch.model_extra["stats"] for ch in sampled.choices))
    greedy = ask(client, api, messages=q, n=3, max_tokens=12)
    assert len({c.message.content for c in greedy.choices}) == 1
    texts_streamed, _ = _streamed(ask(client, api, messages=q, n=3, temperature=0.9, seed=11, max_tokens=12,
                                      stream=True))
    assert [texts_streamed[i] for i in range(3)] == texts


def test_logprobs_come_back_per_token_streamed_and_not(client: Any, api: dict[str, Any]) -> None:
    # The prefix cache holds whatever earlier tests left; this first reply leaves the prompt's KV in it, so the two
    # replies compared below both reuse the same len(prompt) - 1 cached tokens and run the same computation after.
    ask(client, api, max_tokens=8)
    reply = ask(client, api, max_tokens=8, logprobs=True, top_logprobs=3)
    content = reply.choices[0].logprobs.content
    assert "".join(t.token for t in content) == reply.choices[0].message.content
    for token in content:
        assert len(token.top_logprobs) == 3 and token.top_logprobs[0].logprob >= token.logprob
        assert [t.logprob for t in token.top_logprobs] == sorted((t.logprob for t in token.top_logprobs),
                                                                 reverse=True)
    _, chunks = _streamed(ask(client, api, max_tokens=8, logprobs=True, top_logprobs=3, stream=True))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [t.token for t in streamed] == [t.token for t in content]
    assert max(abs(a.logprob - b.logprob) for a, b in zip(streamed, content, strict=True)) <= 1e-5
    with pytest.raises(openai.BadRequestError):
        ask(client, api, logprobs=True, top_logprobs=21)


def test_logprobs_equal_a_log_softmax_of_the_models_own_logits_fp32(fp32_engine: ChatEngine) -> None:
    control = RowControl.for_model(OutputSpec(top_logprobs=5), fp32_engine.loaded)
    gen = fp32_engine.request_options(max_new_tokens=10, do_sample=False, repetition_penalty=1.0, control=control)
    final = list(fp32_engine.stream_chat("Name a fruit.", [], gen=gen))[-1]
    prompt = fp32_engine._encode([{"role": "system", "content": fp32_engine.settings.chat.system_prompt},
                                  {"role": "user", "content": "Name a fruit."}])["input_ids"]
    new = list(final.token_ids)
    ids = torch.cat([prompt, torch.tensor([new])], dim=1)
    with torch.no_grad():
        logits = fp32_engine.loaded.model(ids).logits[0, prompt.shape[1] - 1:-1].float()
    expected = torch.log_softmax(logits, dim=-1)
    assert [e.token_id for e in control.logprobs] == new
    for step, entry in enumerate(control.logprobs):
        assert entry.logprob == pytest.approx(float(expected[step, entry.token_id]), abs=1e-4)
        top = torch.topk(expected[step], 5)
        assert [t for t, _ in entry.top] == top.indices.tolist()
        assert [v for _, v in entry.top] == pytest.approx(top.values.tolist(), abs=1e-4)


def test_presence_and_frequency_penalties_as_openai_defines_them() -> None:
    control = RowControl(OutputSpec(presence_penalty=0.5, frequency_penalty=0.25))
    control.start(8)
    zeros = torch.zeros(1, 10)
    control.process(zeros)
    for token in (5, 5, 7):
        control.accept(token)
        control.process(zeros)
    out = control.process(zeros)
    # logit[j] -= count[j] * frequency_penalty + (count[j] > 0) * presence_penalty
    assert out[0, 5] == pytest.approx(-(2 * 0.25 + 0.5)) and out[0, 7] == pytest.approx(-(0.25 + 0.5))
    assert out[0, [0, 1, 2, 3, 4, 6, 8, 9]].abs().sum() == 0
    with pytest.raises(InputError, match="presence_penalty"):
        OutputSpec(presence_penalty=2.5)


def test_penalties_reach_the_reply_through_the_api(client: Any, api: dict[str, Any]) -> None:
    def complete(**penalties: float) -> str:
        return client.completions.create(model=api["model"], prompt="cat cat cat cat cat cat cat cat", max_tokens=6,
                                         temperature=0, extra_body={"repetition_penalty": 1.0}, **penalties
                                         ).choices[0].text

    plain = complete()
    assert plain.split()[:2] == ["cat", "cat"]  # the loop the penalties are for
    assert "cat" not in complete(frequency_penalty=2.0, presence_penalty=2.0).split()[1:]  # its ids were generated


# --- /v1/completions --------------------------------------------------------------------------------------------


def test_completions_continue_the_raw_prompt_like_generate(client: Any, api: dict[str, Any]) -> None:
    loaded = api["engine"].loaded
    prompts = ["The capital of France is", "1, 2, 3,"]
    reply = client.completions.create(model=api["model"], prompt=prompts, max_tokens=8, temperature=0,
                                      extra_body={"repetition_penalty": 1.0})
    assert reply.object == "text_completion" and [c.index for c in reply.choices] == [0, 1]
    for prompt, choice in zip(prompts, reply.choices, strict=True):
        ids = loaded.tokenizer(prompt, return_tensors="pt")
        out = loaded.model.generate(**ids, max_new_tokens=8, do_sample=False, temperature=None, top_p=None,
                                    top_k=None, pad_token_id=min(loaded.eos_token_ids))
        assert choice.text == loaded.tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    assert reply.usage.prompt_tokens == sum(len(loaded.tokenizer(p)["input_ids"]) for p in prompts)
    assert reply.model_extra["stats"]["prompt_tokens"] == len(loaded.tokenizer(prompts[0])["input_ids"])
    chunks = list(client.completions.create(model=api["model"], prompt=prompts[0], max_tokens=8, temperature=0,
                                            extra_body={"repetition_penalty": 1.0}, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == reply.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length" and "stats" in chunks[-1].model_extra
    logged = client.completions.create(model=api["model"], prompt=prompts[0], max_tokens=4, temperature=0,
                                       logprobs=2)
    assert "".join(logged.choices[0].logprobs.tokens) == logged.choices[0].text
    assert all(len(top) == 2 for top in logged.choices[0].logprobs.top_logprobs)


@pytest.mark.parametrize(("extra", "named"), [({"suffix": "end"}, "suffix"), ({"echo": True}, "echo"),
                                              ({"logprobs": 6}, "logprobs"), ({"n": 5}, "n must be")])
def test_completions_refuse_what_they_cannot_do(client: Any, api: dict[str, Any], extra: dict[str, Any],
                                                named: str) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=api["model"], prompt="Hi", max_tokens=2, **extra)
    assert named in err.value.body["message"] and err.value.body["code"] == "unsupported_parameter"


# --- every decode path honours the control ---------------------------------------------------------------------


def _constrained(engine: ChatEngine, prompt: str, schema: dict[str, Any]) -> tuple[str, RowControl]:
    control = RowControl.for_model(OutputSpec(json=True, json_schema=schema, top_logprobs=0), engine.loaded)
    gen = engine.request_options(max_new_tokens=48, do_sample=False, control=control)
    return list(engine.stream_chat(prompt, [], gen=gen))[-1].text, control


def test_the_eager_batch_scheduler_masks_each_row(fp32_engine: ChatEngine) -> None:
    from tests.conftest import run_threads

    engine = ChatEngine(fp32_engine.loaded, make_settings(QUANTIZATION="none", COMPUTE_DTYPE="float32",
                                                          DECODE_PATH="plain", MAX_BATCH_SIZE="4"))
    try:
        assert engine.backend.name == "batched"
        people = {"name": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}},
                           "required": ["name"], "additionalProperties": False}, "color": COLOR}
        out: dict[str, str] = {}

        def reply(key: str) -> None:
            out[key] = _constrained(engine, "Answer in JSON.", people[key])[0]

        run_threads([lambda k=k: reply(k) for k in people])  # type: ignore[misc]
        for key, schema in people.items():
            jsonschema.validate(json.loads(out[key]), schema)
    finally:
        assert engine.scheduler is not None
        engine.scheduler.close()


def test_the_cpu_path_masks_and_reports_logprobs() -> None:
    engine = ChatEngine.load(make_settings(DECODE_PATH="cpu"))
    assert engine.backend.name == "cpu"
    text, control = _constrained(engine, "Describe the sky.", COLOR)
    jsonschema.validate(json.loads(text), COLOR)
    assert control.masked_steps > 0 and len(control.logprobs) > 0


# The fast paths' masks and logprobs on CUDA: tests/test_constrained_gpu.py (no server there).


# --- langchain-openai -----------------------------------------------------------------------------------------


def _chat_model(api: dict[str, Any]) -> Any:
    langchain_openai = pytest.importorskip("langchain_openai")
    return langchain_openai.ChatOpenAI(model=api["model"], base_url=api["base_url"], api_key=KEY, temperature=0,
                                       max_tokens=48, max_retries=0)


def test_langchain_with_a_tool_gets_its_tool_call(api: dict[str, Any]) -> None:
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        return "sunny"

    model = _chat_model(api).bind_tools([get_weather], tool_choice="get_weather")
    message = model.invoke("What is the weather in Paris?")
    (call,) = message.tool_calls
    assert call["name"] == "get_weather" and isinstance(call["args"]["city"], str)


def test_langchain_with_structured_output_returns_the_schemas_object(api: dict[str, Any]) -> None:
    from pydantic import BaseModel

    class Color(BaseModel):
        color: str
        brightness: int

    result = _chat_model(api).with_structured_output(Color).invoke("Describe the sky as a color and a brightness.")
    assert isinstance(result, Color)
