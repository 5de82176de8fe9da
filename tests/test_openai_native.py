"""Tools through the model's own chat template, and `n` as rows of one batch, on served /v1 apps driven by the official
`openai` client (CPU, the embedded model's fp32 weights under other chat templates; no hub).

The templates below are modelled on Qwen2.5's and Llama 3.1's public chat templates (their tools sections, the
`tool_calls` and `tool` message rendering), cut to what these tests need.
"""
# ruff: noqa: E501 - the templates keep their lines as the originals write them

from __future__ import annotations

import json
import shutil
import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from transformers import AutoTokenizer

from llm_core.engine.admission import ReplySlots
from llm_core.engine.chat import ChatEngine
from llm_core.errors import BusyError
from llm_core.history import build_messages
from llm_core.web.openai_calls import FORMATS, HERMES_PROMPT, ToolCallStream, parse_tool_calls, template_family
from llm_core.web.openai_tools import native_prompt
from tests.conftest import MODEL_CACHE, make_settings, run_threads

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

QWEN_TEMPLATE = """{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}
{{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
{%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}
{{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- for message in messages %}
{%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
{%- elif message.role == "assistant" %}
{{- '<|im_start|>' + message.role }}
{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
{%- for tool_call in message.tool_calls %}
{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
{{- '\\n<tool_call>\\n{"name": "' }}{{- tool_call.name }}{{- '", "arguments": ' }}{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == "tool" %}
{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}
{%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"""

LLAMA_TEMPLATE = """{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content']|trim %}{%- set messages = messages[1:] %}{%- else %}{%- set system_message = "" %}{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if tools is not none %}{{- "Environment: ipython\\n" }}{%- endif %}
{{- system_message }}{{- "<|eot_id|>" }}
{%- if tools is not none %}
{%- set first_user_message = messages[0]['content']|trim %}{%- set messages = messages[1:] %}
{{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}
{{- "Given the following functions, please respond with a JSON for a function call with its proper arguments that best answers the given prompt.\\n\\n" }}
{{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}. Do not use variables.\\n\\n' }}
{%- for t in tools %}{{- t | tojson }}{{- "\\n\\n" }}{%- endfor %}
{{- first_user_message + "<|eot_id|>" }}
{%- endif %}
{%- for message in messages %}
{%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}
{%- elif 'tool_calls' in message %}
{%- set tool_call = message.tool_calls[0].function %}
{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
{{- '{"name": "' + tool_call.name + '", "parameters": ' }}{{- tool_call.arguments | tojson }}{{- "}<|eot_id|>" }}
{%- else %}
{{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}{{- message.content }}{{- "<|eot_id|>" }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"""

INST_TEMPLATE = "{% for m in messages %}[INST] {{ m.content }} [/INST]{% endfor %}"  # no tools section, not ChatML

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                   "additionalProperties": False}}}
WEATHER_Q = [{"role": "user", "content": "What is the weather in Paris?"}]


def _tokenizer(tmp: Path, template: str) -> Any:
    """The embedded model's tokenizer files with their chat template replaced."""
    source = next(MODEL_CACHE.iterdir())
    tmp.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, tmp / name)
    (tmp / "chat_template.jinja").write_text(template)
    return AutoTokenizer.from_pretrained(tmp)


def _serve(engines: dict[str, ChatEngine]) -> Iterator[str]:
    """The /v1 app alone on a free port, serving engines["served"] (a test may swap it); yields the base URL."""
    from starlette.applications import Starlette
    from starlette.routing import Mount

    from app import _api_error
    from llm_core.web.openai_api import create_openai_app
    from tests.test_app import free_port

    engine = engines["served"]
    app = Starlette(routes=[Mount("/v1", app=create_openai_app(lambda: engines["served"], engine.settings,
                                                               _api_error))])
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    started = threading.Event()
    for _ in range(600):  # bounded: until uvicorn listens
        if server.started:
            started.set()
            break
        started.wait(0.05)
    assert server.started
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        server.should_exit = True
        thread.join(10)


def _engine(fp32_engine: ChatEngine, tokenizer: Any = None, **settings: str) -> ChatEngine:
    """An engine over the fp32 weights (shared, not reloaded), with its own tokenizer and settings."""
    loaded = replace(fp32_engine.loaded, tokenizer=tokenizer or fp32_engine.loaded.tokenizer, extra={})
    return ChatEngine(loaded, make_settings(QUANTIZATION="none", COMPUTE_DTYPE="float32", DECODE_PATH="plain",
                                            **settings))


@pytest.fixture(scope="module")
def native(fp32_engine: ChatEngine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A served app whose model's template renders tools (Qwen2.5-style); `engines` has Llama- and [INST]-style
    variants to swap in."""
    tmp = tmp_path_factory.mktemp("templates")
    engines = {name: _engine(fp32_engine, _tokenizer(tmp / name, template)) for name, template in
               (("qwen", QWEN_TEMPLATE), ("llama", LLAMA_TEMPLATE), ("inst", INST_TEMPLATE))}
    engines["served"] = engines["qwen"]
    for base_url in _serve(engines):
        client = openai.OpenAI(base_url=base_url, api_key="local", max_retries=0, timeout=120)
        yield {"client": client, "engines": engines, "model": "SmolLM2-135M-Instruct"}


def _ask(native: dict[str, Any], **kwargs: Any) -> Any:
    kwargs.setdefault("messages", WEATHER_Q)
    kwargs.setdefault("max_tokens", 40)
    kwargs.setdefault("temperature", 0)
    return native["client"].chat.completions.create(model=native["model"], **kwargs)


class _Served:
    """Serve another engine of `native` for one test."""

    def __init__(self, native: dict[str, Any], name: str) -> None:
        self.engines, self.name = native["engines"], name

    def __enter__(self) -> ChatEngine:
        self.engines["served"] = self.engines[self.name]
        return self.engines[self.name]

    def __exit__(self, *exc: object) -> None:
        self.engines["served"] = self.engines["qwen"]


# --- native tool templates ------------------------------------------------------------------------------------------


def test_template_families_are_read_from_the_template_text(fp32_engine: ChatEngine) -> None:
    assert template_family(QWEN_TEMPLATE) == "hermes"
    assert template_family(LLAMA_TEMPLATE) == "llama3"
    assert template_family("{% if tools %}[AVAILABLE_TOOLS]{{ tools|tojson }}[/AVAILABLE_TOOLS]{% endif %}") == \
        "mistral"
    assert template_family(INST_TEMPLATE) is None
    assert template_family(fp32_engine.loaded.tokenizer.chat_template) is None  # the embedded ChatML: no tools


@pytest.mark.parametrize(("family", "reply", "content"), [
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
     "Let me check."),
    ("llama3", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}', ""),
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Bern"}}]', ""),
    ("hermes", "It is <b>sunny</b> in Paris, no tool needed.", "It is <b>sunny</b> in Paris, no tool needed."),
])
def test_the_call_reader_streams_content_then_the_call_in_pieces_equal_to_the_whole(family: str, reply: str,
                                                                                 content: str) -> None:
    """Fed the reply as it grows (a character at a time): content first (never call markup), then the call's name
    in one delta and its arguments in pieces; added up, what the whole reply parses to."""
    fmt = FORMATS[family]
    stream = ToolCallStream(["get_weather"], fmt)
    deltas = [d for i in range(1, len(reply) + 1) for d in stream.feed(reply[:i])] + stream.feed(reply, done=True)
    streamed_content = "".join(d.get("content", "") for d in deltas)
    calls = [d["tool_call"] for d in deltas if "tool_call" in d]
    whole_content, whole_calls = parse_tool_calls(reply, ["get_weather"], fmt=fmt)
    assert streamed_content == content == (whole_content or "")
    assert "<tool_call>" not in streamed_content and "[TOOL_CALLS]" not in streamed_content
    if not whole_calls:
        assert calls == [] and not stream.calling
        return
    assert calls[0]["function"] == {"name": "get_weather", "arguments": ""} and "id" in calls[0]
    assert len(calls) > 3 and all("id" not in c and "name" not in c["function"] for c in calls[1:])
    assert "".join(c["function"]["arguments"] for c in calls) == whole_calls[0]["function"]["arguments"]
    assert json.loads(whole_calls[0]["function"]["arguments"])["city"] in ("Oslo", "Rome", "Bern")


def test_the_hermes_prompt_also_reads_a_bare_json_call() -> None:
    """The embedded model is not trained on the Hermes prompt: a call written as bare JSON still counts."""
    _, calls = parse_tool_calls('{"name": "get_weather", "arguments": {"city": "Oslo"}}', ["get_weather"],
                                fmt=HERMES_PROMPT)
    assert calls[0]["function"]["name"] == "get_weather"
    assert parse_tool_calls('{"name": "get_weather", "arguments": {}}', ["get_weather"], fmt=FORMATS["hermes"]) == (
        '{"name": "get_weather", "arguments": {}}', [])  # a Qwen-style template's own format is the tagged one


def test_the_rendered_prompt_carries_the_tool_schema_and_the_served_prompt_is_it(native: dict[str, Any]) -> None:
    engine = native["engines"]["qwen"]
    tokenizer = engine.loaded.tokenizer
    system = engine.settings.chat.system_prompt
    for forced, opener in ((False, ""), (True, "<tool_call>\n")):
        prompt = native_prompt(tokenizer, WEATHER_Q, [WEATHER], FORMATS["hermes"].opener if forced else "")
        ids = prompt(build_messages(system, [], WEATHER_Q[0]["content"]))["input_ids"][0].tolist()
        text = tokenizer.decode(ids)
        assert "# Tools" in text and json.dumps(WEATHER) in text  # the template's tools section, the schema in it
        assert text.startswith(f"<|im_start|>system\n{system}")
        assert text.endswith("<|im_start|>assistant\n" + opener)
        reply = _ask(native, tools=[WEATHER], tool_choice="required" if forced else "auto", max_tokens=4)
        assert reply.usage.prompt_tokens == len(ids)  # the served reply was prompted with exactly this


@pytest.mark.parametrize("name", ["qwen", "llama"])
def test_a_forced_call_round_trips_through_the_models_own_template(native: dict[str, Any], name: str) -> None:
    """call (the grammar holds it to the function's schema, in the family's format) -> tool message -> answer; the
    call and its result reach the model as the template renders them (Qwen: <tool_call>/<tool_response>; Llama:
    "parameters" and an ipython turn)."""
    with _Served(native, name) as engine:
        reply = _ask(native, tools=[WEATHER], tool_choice="required")
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
        result = {"role": "tool", "tool_call_id": call.id, "content": '{"temperature_c": 21, "sky": "clear"}'}
        history = [*WEATHER_Q, choice.message.model_dump(exclude_none=True), result]
        answer = _ask(native, messages=history, tools=[WEATHER], max_tokens=24)
        assert answer.choices[0].finish_reason in ("stop", "length") and answer.choices[0].message.content
        tokenizer = engine.loaded.tokenizer
        expected = tokenizer.apply_chat_template(
            [{"role": "system", "content": engine.settings.chat.system_prompt}, *WEATHER_Q,
             {"role": "assistant", "content": "", "tool_calls": [{"id": call.id, "type": "function", "function": {
                 "name": "get_weather", "arguments": json.loads(call.function.arguments)}}]},
             {"role": "tool", "content": result["content"], "tool_call_id": call.id, "name": "get_weather"}],
            tools=[WEATHER], add_generation_prompt=True, tokenize=False)
        assert ("<tool_response>" if name == "qwen" else "ipython<|end_header_id|>") in expected
        assert answer.usage.prompt_tokens == len(tokenizer(expected, add_special_tokens=False)["input_ids"])


def test_a_streamed_native_call_adds_up_to_the_whole_one(native: dict[str, Any]) -> None:
    # The prefix cache holds what earlier tests left: this first reply leaves this prompt's KV in it, so both replies
    # compared below reuse the same cached tokens and run the same computation after them.
    _ask(native, tools=[WEATHER], tool_choice="required", max_tokens=2)
    whole = _ask(native, tools=[WEATHER], tool_choice="required").choices[0].message.tool_calls[0]
    chunks = list(_ask(native, tools=[WEATHER], tool_choice="required", stream=True))
    deltas = [d for c in chunks if c.choices and c.choices[0].delta.tool_calls for d in c.choices[0].delta.tool_calls]
    assert deltas[0].function.name == whole.function.name and len(deltas) >= 3
    assert "".join(d.function.arguments or "" for d in deltas) == whole.function.arguments
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)  # no markup as content
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_langchain_streams_the_same_call_as_it_invokes(native: dict[str, Any]) -> None:
    langchain_openai = pytest.importorskip("langchain_openai")
    model = langchain_openai.ChatOpenAI(model=native["model"], base_url=str(native["client"].base_url),
                                        api_key="local", temperature=0, max_tokens=40, max_retries=0
                                        ).bind_tools([WEATHER], tool_choice="get_weather")
    model.invoke("What is the weather in Paris?")  # the prompt's KV cached for both compared replies, as above
    invoked = model.invoke("What is the weather in Paris?").tool_calls
    streamed = None
    for chunk in model.stream("What is the weather in Paris?"):
        streamed = chunk if streamed is None else streamed + chunk
    assert streamed is not None
    assert [(c["name"], c["args"]) for c in streamed.tool_calls] == [(c["name"], c["args"]) for c in invoked]
    assert invoked[0]["name"] == "get_weather" and isinstance(invoked[0]["args"]["city"], str)


def test_tools_on_a_template_without_tools_that_is_not_chatml_are_a_400(native: dict[str, Any]) -> None:
    with _Served(native, "inst"), pytest.raises(openai.BadRequestError) as err:
        _ask(native, tools=[WEATHER])
    assert "tools" in err.value.body["message"] and "ChatML" in err.value.body["message"]
    with _Served(native, "inst"):
        assert _ask(native, max_tokens=2).usage.completion_tokens > 0  # without tools it serves as usual


# --- n as rows of one batch -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def batched(fp32_engine: ChatEngine) -> Iterator[dict[str, Any]]:
    """A served app whose engine batches (the eager scheduler over the fp32 weights, MAX_BATCH_SIZE=4)."""
    engine = _engine(fp32_engine, MAX_BATCH_SIZE="4")
    assert engine.backend.name == "batched"
    try:
        for base_url in _serve({"served": engine}):
            client = openai.OpenAI(base_url=base_url, api_key="local", max_retries=0, timeout=120)
            yield {"client": client, "engine": engine, "model": "SmolLM2-135M-Instruct"}
    finally:
        assert engine.scheduler is not None
        engine.scheduler.close()


def test_n_choices_run_as_rows_of_one_batch_and_equal_single_requests_with_seed_plus_i(
        batched: dict[str, Any]) -> None:
    engine: ChatEngine = batched["engine"]
    ask: dict[str, Any] = dict(model=batched["model"], messages=[{"role": "user", "content": "Tell me about cats."}],
                               temperature=0.9, seed=7, max_tokens=12)
    result: list[Any] = []
    with engine.exclusive():  # the rows queue up while the engine is held, then start together
        sender = threading.Thread(target=lambda: result.append(batched["client"].chat.completions.create(
            n=3, **ask)))
        sender.start()
        gate = threading.Event()
        for _ in range(1200):  # bounded (60 s): until all three rows wait for a slot
            if engine.waiting() == 3:
                break
            gate.wait(0.05)
        assert engine.waiting() == 3
    sender.join(120)
    (reply,) = result
    texts = [c.message.content for c in reply.choices]
    assert [c.model_extra["stats"]["peak_batch_rows"] for c in reply.choices] == [3, 3, 3]  # decoded side by side
    for i, text in enumerate(texts):
        alone = batched["client"].chat.completions.create(**{**ask, "seed": 7 + i})
        assert alone.choices[0].message.content == text
        assert alone.model_extra["stats"]["peak_batch_rows"] == 1
    assert len(set(texts)) == 3


def test_the_rows_of_one_request_count_once_and_more_rows_than_slots_all_finish() -> None:
    """Admission: a group's tickets are one request of the person (a second request is refused while they are in,
    with SESSION_MAX_WAITING=0), and 5 rows on 2 slots each get a slot in turn."""
    slots = ReplySlots(2, session_max_waiting=0)
    finished: list[int] = []
    in_group = threading.Barrier(5)
    release = threading.Event()

    def row(k: int) -> None:
        with slots.ticket("alice", group="request-1") as ticket:
            in_group.wait(30)  # all five tickets are in before any takes a slot
            ticket.wait()
            release.wait(30)
            finished.append(k)

    threads = [threading.Thread(target=row, args=(k,), daemon=True) for k in range(5)]
    for thread in threads:
        thread.start()
    probe = threading.Event()
    for _ in range(600):  # bounded: until the rows hold both slots
        if slots.waiting("alice") == 3 and slots.locked():
            break
        probe.wait(0.05)
    assert slots.waiting("alice") == 3 and slots.locked()  # two rows of one person run at once
    with pytest.raises(BusyError), slots.ticket("alice"):
        pass
    release.set()
    run_threads([lambda t=t: t.join(30) for t in threads])  # type: ignore[misc]
    assert sorted(finished) == [0, 1, 2, 3, 4]


