"""The OpenAI-compatible API on the running app, driven by the official `openai` client (CPU, embedded model)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from app import launch
from llm_core.engine.chat import ChatEngine
from llm_core.engine.compare import EnginePool
from llm_core.history import build_messages
from llm_core.streams import MAX_HOLD_S
from llm_core.web.openai_api import served_model_id
from tests.test_app import free_port
from ui import build_demo

openai = pytest.importorskip("openai")

KEY = "alice:s3cret pw"
LISTED_ORIGIN = "http://localhost:3000"  # CORS_ORIGINS of the served app: a local web UI
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def api(nf4_engine: ChatEngine) -> Iterator[dict[str, Any]]:
    """The demo as `app.main` serves it (UI + /v1 on one server), with a login so the API needs a key."""
    settings = nf4_engine.settings.replace(server={"auth": f"{KEY},bob:other", "cors_origins": (LISTED_ORIGIN,)})
    pool = EnginePool(settings, primary=nf4_engine)
    demo = build_demo(nf4_engine, settings, pool)
    port = free_port()
    launch(demo, settings.replace(server={"port": port}), pool, prevent_thread_lock=True, quiet=True)
    try:
        yield {"base_url": f"http://127.0.0.1:{port}/v1", "model": served_model_id(settings),
               "engine": nf4_engine, "settings": settings}
    finally:
        demo.close()


@pytest.fixture(scope="module")
def client(api: dict[str, Any]) -> Any:
    return openai.OpenAI(base_url=api["base_url"], api_key=KEY, max_retries=0, timeout=120)


def ask(client: Any, api: dict[str, Any], **kwargs: Any) -> Any:
    kwargs.setdefault("messages", QUESTION)
    kwargs.setdefault("max_tokens", 24)
    kwargs.setdefault("temperature", 0)
    return client.chat.completions.create(model=api["model"], **kwargs)


def test_models_lists_the_served_model(client: Any, api: dict[str, Any]) -> None:
    assert [m.id for m in client.models.list()] == [api["model"]] == ["SmolLM2-135M-Instruct"]


def test_chat_answers_with_usage_from_token_ids_and_the_stats_field(client: Any, api: dict[str, Any]) -> None:
    reply = ask(client, api)
    text = reply.choices[0].message.content
    assert "Paris" in text
    assert reply.choices[0].finish_reason == "stop" and reply.object == "chat.completion"
    stats = reply.model_extra["stats"]
    engine: ChatEngine = api["engine"]
    prompt = build_messages(api["settings"].chat.system_prompt, [], QUESTION[0]["content"])
    assert reply.usage.prompt_tokens == engine.count_tokens(prompt) == stats["prompt_tokens"]
    assert reply.usage.completion_tokens == stats["new_tokens"] > 0
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    assert stats["ttft_s"] > 0 and stats["decode_tokens_per_s"] > 0 and stats["peak_rss_bytes"] > 0
    assert stats["kv_cache_bytes"] > 0 and stats["finish_reason"] == "eos"


def test_streamed_chat_matches_the_plain_reply_and_ends_with_stats_and_usage(client: Any, api: dict[str, Any]) -> None:
    plain = ask(client, api)
    chunks, arrived = [], []
    for chunk in ask(client, api, stream=True, stream_options={"include_usage": True}):
        chunks.append(chunk)
        if chunk.choices and chunk.choices[0].delta.content:
            arrived.append(time.perf_counter())
    deltas = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert len(arrived) >= 2 and arrived[-1] - arrived[0] > 0.1  # pieces arrive as they are made, not in one blob
    assert "".join(deltas) == plain.choices[0].message.content  # greedy: the same reply
    finishing = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finishing) == 1 and finishing[0].choices[0].finish_reason == "stop"
    stats = finishing[0].model_extra["stats"]
    assert stats["new_tokens"] == plain.usage.completion_tokens and stats["ttft_s"] > 0
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens == stats["new_tokens"]
    assert usage.prompt_tokens == plain.usage.prompt_tokens


def test_a_whole_reply_without_stop_sequences_is_read_at_its_end_not_once_a_token(
        client: Any, api: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    engine: ChatEngine = api["engine"]
    real, seen = engine.stream_chat, []

    def counting(*args: Any, **kwargs: Any) -> Iterator[Any]:
        updates = list(real(*args, **kwargs))
        seen.append((kwargs.get("hold"), len(updates), updates[-1].stats))
        yield from updates

    monkeypatch.setattr(engine, "stream_chat", counting)
    whole = ask(client, api, max_tokens=24)
    streamed = list(ask(client, api, max_tokens=24, stream=True))
    stopped = ask(client, api, max_tokens=24, stop=["no such words"])
    (hold, reads, stats), (stream_hold, stream_reads, _), (stop_hold, stop_reads, _) = seen
    assert hold is not None and hold() == MAX_HOLD_S  # the row sleeps between reads; the reply's end wakes it
    assert reads <= 3 + stats.decode_s  # the first token, then about one read a MAX_HOLD_S, then the end
    assert stats.new_tokens >= 8 and stream_reads >= stats.new_tokens - 1  # a stream reads (about) every token
    assert stream_hold is None and stop_hold is None and stop_reads >= stats.new_tokens - 1  # stops are looked for
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert whole.choices[0].message.content == text == stopped.choices[0].message.content  # the same reply
    assert whole.usage.completion_tokens == stats.new_tokens


def test_max_tokens_caps_the_generated_ids(client: Any, api: dict[str, Any]) -> None:
    reply = ask(client, api, messages=[{"role": "user", "content": "Count from 1 to 100, separated by commas."}],
                max_tokens=5)
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == 5 == reply.model_extra["stats"]["new_tokens"]


def test_stop_sequence_cuts_the_reply_and_halts_generation(client: Any, api: dict[str, Any]) -> None:
    whole = ask(client, api, max_tokens=24)
    full, full_tokens = whole.choices[0].message.content, whole.usage.completion_tokens
    word = "Paris"
    assert word in full
    for stream in (False, True):
        if stream:
            chunks = list(ask(client, api, max_tokens=24, stop=[word], stream=True))
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            reason = chunks[-1].choices[0].finish_reason
            new_tokens = chunks[-1].model_extra["stats"]["new_tokens"]
        else:
            reply = ask(client, api, max_tokens=24, stop=word)
            text, reason = reply.choices[0].message.content, reply.choices[0].finish_reason
            new_tokens = reply.usage.completion_tokens
        assert text == full[:full.index(word)] and reason == "stop"
        assert new_tokens < full_tokens  # the engine stopped early, not just the text cut


def test_system_message_and_history_reach_the_model(client: Any, api: dict[str, Any]) -> None:
    messages = [{"role": "system", "content": "You answer in one word."},
                {"role": "user", "content": "My name is Ada."}, {"role": "assistant", "content": "Hello Ada."},
                {"role": "user", "content": [{"type": "text", "text": "What is my name?"}]}]
    reply = ask(client, api, messages=messages)
    engine: ChatEngine = api["engine"]
    from llm_core.history import Turn

    expected = build_messages("You answer in one word.", [Turn("My name is Ada.", "Hello Ada.")], "What is my name?")
    assert reply.usage.prompt_tokens == engine.count_tokens(expected)
    assert "Ada" in reply.choices[0].message.content


def test_sampling_with_a_seed_is_repeatable(client: Any, api: dict[str, Any]) -> None:
    texts = {ask(client, api, temperature=1.2, top_p=0.95, seed=11, max_tokens=12).choices[0].message.content
             for _ in range(2)}
    assert len(texts) == 1


def test_api_key_is_required_when_auth_is_set(api: dict[str, Any]) -> None:
    for key in ("nobody:wrong", "alice:s3cret", "s3cret pw"):
        bad = openai.OpenAI(base_url=api["base_url"], api_key=key, max_retries=0)
        with pytest.raises(openai.AuthenticationError) as err:
            ask(bad, api)
        assert err.value.status_code == 401 and err.value.code == "invalid_api_key"
    response = httpx.get(api["base_url"] + "/models")  # no Authorization header at all
    assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
    other = openai.OpenAI(base_url=api["base_url"], api_key="bob:other", max_retries=0)
    assert ask(other, api, max_tokens=2).usage.completion_tokens > 0


@pytest.mark.parametrize(("kwargs", "status", "named"), [
    ({"messages": [{"role": "user", "content": "   "}]}, 400, "empty"),
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "assistant", "content": "hi"}]}, 400, "last message"),
    ({"messages": [{"role": "function", "content": "x", "name": "f"}]}, 400, "role"),
    ({"temperature": 5}, 400, "TEMPERATURE"),
    ({"temperature": 1e-300}, 400, "TEMPERATURE"),  # the fuzzer found it: logits / 1e-300 overflow (was a 500)
    ({"max_tokens": 0}, 400, "max_new_tokens"),
    ({"max_tokens": 10**6}, 400, "max_new_tokens"),
    ({"top_p": -1}, 400, "TOP_P"),
    ({"n": 5}, 400, "n must be 1 to 4"),
    ({"stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ({"extra_body": {"frobnicate": True}}, 400, "frobnicate"),
    ({"extra_body": {"max_tokens": "many"}}, 400, "max_tokens"),
    ({"model": "gpt-4o"}, 404, "not served"),
    ({"messages": [{"role": "user", "content": "1 " * 17_000}]}, 400, "limit"),
])
def test_bad_requests_get_openai_shaped_errors_and_the_server_keeps_serving(
        client: Any, api: dict[str, Any], kwargs: dict[str, Any], status: int, named: str) -> None:
    call = {"model": api["model"], "messages": QUESTION, "max_tokens": 4, **kwargs}
    with pytest.raises(openai.APIStatusError) as err:
        client.chat.completions.create(**call)
    assert err.value.status_code == status
    body = err.value.body
    assert isinstance(body, dict) and named.lower() in body["message"].lower() and body["type"]
    assert ask(client, api, max_tokens=2).usage.completion_tokens > 0


def test_malformed_and_oversized_bodies_are_refused_with_their_status(api: dict[str, Any]) -> None:
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    url = api["base_url"] + "/chat/completions"
    bad_json = httpx.post(url, content=b"{not json", headers=headers)
    assert bad_json.status_code == 400 and "JSON" in bad_json.json()["error"]["message"]
    huge = httpx.post(url, content=json.dumps({"model": api["model"], "messages": [
        {"role": "user", "content": "x" * 2_000_000}]}), headers=headers)
    assert huge.status_code == 413 and huge.json()["error"]["code"] == "request_too_large"


def test_a_key_gets_one_running_and_one_waiting_reply_and_a_third_is_refused_as_busy(
        client: Any, api: dict[str, Any], nf4_engine: ChatEngine) -> None:
    """The engine's per-session admission (SESSION_MAX_WAITING=1) through the API: while a reply runs, a second
    request of the same key waits its turn, a third gets 429; when the client drops the first, the second runs."""
    stream = ask(client, api, messages=[{"role": "user", "content": "Write a long story about a dragon."}],
                 max_tokens=400, stream=True)
    chunks = iter(stream)
    next(chunks)  # the reply is running
    result: list[Any] = []
    second = threading.Thread(target=lambda: result.append(ask(client, api, max_tokens=2)))
    second.start()
    for _ in range(600):  # bounded (30 s): until the second request waits in the engine
        if nf4_engine.waiting() == 1:
            break
        time.sleep(0.05)
    assert nf4_engine.waiting() == 1
    with pytest.raises(openai.RateLimitError) as refused:
        ask(client, api, max_tokens=2)
    assert refused.value.status_code == 429 and int(refused.value.response.headers["retry-after"]) >= 1
    assert "already has a reply being written and 1 waiting" in refused.value.body["message"]
    stream.close()  # the client goes away mid-reply: that reply stops, and the waiting one gets its turn
    second.join(timeout=60)
    assert result and result[0].usage.completion_tokens > 0


def assert_openai_error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, (response.status_code, response.text[:300])
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return dict(body["error"])


def test_only_json_bodies_and_no_other_sites_browser_requests(api: dict[str, Any]) -> None:
    url = api["base_url"] + "/chat/completions"
    body = json.dumps({"model": api["model"], "messages": QUESTION, "max_tokens": 2})
    auth = {"Authorization": f"Bearer {KEY}"}
    plain = httpx.post(url, content=body, headers={**auth, "Content-Type": "text/plain"})
    assert assert_openai_error(plain, 415)["code"] == "unsupported_media_type"  # a CORS "simple" request: refused
    foreign = httpx.post(url, content=body, headers={**auth, "Content-Type": "text/plain",
                                                    "Origin": "https://evil.example"})
    assert assert_openai_error(foreign, 403)["code"] == "origin_not_allowed"
    page = httpx.get(api["base_url"].removesuffix("/v1") + "/config", headers={"Origin": "https://evil.example"})
    assert page.status_code == 403  # the Gradio routes too
    preflight = httpx.options(url, headers={"Origin": LISTED_ORIGIN, "Access-Control-Request-Method": "POST",
                                            "Access-Control-Request-Headers": "authorization,content-type"})
    assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == LISTED_ORIGIN
    listed = httpx.post(url, content=body, headers={**auth, "Content-Type": "application/json",
                                                   "Origin": LISTED_ORIGIN})
    assert listed.status_code == 200 and listed.headers["access-control-allow-origin"] == LISTED_ORIGIN
    own = api["base_url"].removesuffix("/v1")
    same = httpx.post(url, content=body, headers={**auth, "Content-Type": "application/json", "Origin": own})
    assert same.status_code == 200  # the demo's own page
    unlisted = httpx.post(url, content=body, headers={**auth, "Content-Type": "application/json",
                                                     "Origin": "http://localhost:4000"})
    assert assert_openai_error(unlisted, 403)["code"] == "origin_not_allowed"  # Gradio's CORS would let it in


def test_every_v1_answer_that_is_not_a_success_is_in_openai_error_shape(api: dict[str, Any], client: Any) -> None:
    base, auth = api["base_url"], {"Authorization": f"Bearer {KEY}"}
    for path in ("/moderations", "/embeddings", "/nope", "/models/x/y/z/../.."):
        error = assert_openai_error(httpx.post(base + path, headers=auth, json={}), 404 if path != "/models/x/y/z/../.."
                                    else 405)
    assert error["type"] == "invalid_request_error"
    assert assert_openai_error(httpx.get(base + "/embeddings", headers=auth), 404)["code"] == "unknown_url"
    assert assert_openai_error(httpx.delete(base + "/chat/completions", headers=auth), 405)
    assert client.models.retrieve(api["model"]).id == api["model"]  # GET /v1/models/{id}
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("gpt-4o")
    assert missing.value.code == "model_not_found"
    url = base + "/chat/completions"
    json_headers = {**auth, "Content-Type": "application/json"}
    seed = httpx.post(url, headers=json_headers, content=json.dumps(
        {"model": api["model"], "messages": QUESTION, "seed": 2**64}))
    assert assert_openai_error(seed, 400)["param"] == "seed"
    deep = httpx.post(url, headers=json_headers, content=b"[" * 100_000)
    assert "deeper than" in assert_openai_error(deep, 400)["message"]
    deep_object = httpx.post(url, headers=json_headers, content=b'{"model": ' + b'{"a": ' * 5_000 + b"1" +
                             b"}" * 5_001)
    assert assert_openai_error(deep_object, 400)["code"] == "invalid_json"
    assert ask(client, api, max_tokens=2).usage.completion_tokens > 0  # still serving
