"""Property-based bodies for the /v1 API (hypothesis): whatever a client sends, the answer is never a server error,
every refusal is in OpenAI's error shape, the server keeps serving and its memory stays bounded.

The unit run is a few hundred derandomized examples (it cannot flake and stays short on CI's 2 cores); for the
record, `LLM_CORE_FUZZ_EXAMPLES=10000 python -m pytest tests/test_fuzz_api.py` runs 10,000 and writes the tally to
artifacts/fuzz.json (statuses, server errors, answers outside OpenAI's shape, RSS growth). Requests go out
with their raw request target, so paths like `/v1/..` reach the server as sent instead of being normalised away by
the client.
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from app import build_demo, launch
from llm_core.engine.chat import ChatEngine
from llm_core.engine.compare import EnginePool
from llm_core.web.openai_api import served_model_id
from tests.test_app import free_port

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

KEY = "fuzz:pw"
EXAMPLES = int(os.environ.get("LLM_CORE_FUZZ_EXAMPLES", "300"))
MAX_RSS_GROWTH_BYTES = 300 * 2**20  # a leak of even 30 KiB per body would pass 300 MiB over a 10,000 run


@pytest.fixture(scope="module")
def fuzzed(nf4_engine: ChatEngine, artifacts_dir: Path) -> Iterator[dict[str, Any]]:
    settings = nf4_engine.settings.replace(server={"auth": KEY})
    pool = EnginePool(settings, primary=nf4_engine)
    demo = build_demo(nf4_engine, settings, pool)
    port = free_port()
    launch(demo, settings.replace(server={"port": port}), pool, prevent_thread_lock=True, quiet=True)
    tally: Counter[str] = Counter()
    failures: list[str] = []  # answers that broke a rule (hypothesis then shrinks the first)
    state = {"rss": [rss_bytes()]}
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120,
                          headers={"Authorization": f"Bearer {KEY}"}) as http:
            yield {"http": http, "model": served_model_id(settings), "tally": tally, "failures": failures, **state}
    finally:
        demo.close()
        record = {"examples": EXAMPLES, "statuses": tally, "server_errors": sum(
            n for status, n in tally.items() if status.startswith("5")), "non_openai_answers": len(failures),
            "rss_growth_mib": round((rss_bytes() - state["rss"][0]) / 2**20, 1)}
        (artifacts_dir / "fuzz.json").write_text(json.dumps(record, indent=2))


def rss_bytes() -> int:
    match = re.search(r"VmRSS:\s+(\d+) kB", Path("/proc/self/status").read_text())
    return int(match.group(1)) * 1024 if match else 0


# --- what a client might send --------------------------------------------------------------------------------------

json_leaf = st.one_of(st.none(), st.booleans(), st.integers(), st.integers(min_value=2**62, max_value=2**70),
                      st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=40))
json_value = st.recursive(json_leaf, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                             st.dictionaries(st.text(max_size=12), inner, max_size=4)),
                          max_leaves=12)
# Token counts stay tiny or invalid, so an accepted body decodes at most 3 tokens on the CPU.
token_count = st.one_of(st.integers(min_value=-3, max_value=3), st.integers(min_value=10**6),
                        st.integers(max_value=-4), json_value)
content = st.one_of(st.text(max_size=60), st.lists(st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "image_url", "x"]), "text": st.text(max_size=30)}), max_size=3), json_value)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system", "developer", "tool", "", "USER"]), "content": content},
    optional={"name": st.text(max_size=8), "tool_call_id": json_value})
OPTIONAL = {
    "temperature": st.one_of(st.floats(allow_nan=True, allow_infinity=True), json_value),
    "top_p": st.one_of(st.floats(allow_nan=True, allow_infinity=True), json_value),
    "top_k": st.one_of(st.integers(), json_value), "seed": st.one_of(st.integers(min_value=-2**70, max_value=2**70),
                                                                    json_value),
    "stop": st.one_of(st.text(max_size=5), st.lists(st.text(max_size=5), max_size=6), json_value),
    "stream": st.one_of(st.booleans(), json_value), "stream_options": json_value, "n": json_value,
    "user": json_value, "repetition_penalty": st.one_of(st.floats(allow_nan=True), json_value),
    "presence_penalty": json_value, "logprobs": json_value, "logit_bias": json_value, "tools": json_value,
    "tool_choice": json_value, "response_format": json_value, "metadata": json_value,
    "max_completion_tokens": token_count, "unknown_field": json_value,
}


@st.composite
def chat_body(draw: Any, model: str) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": draw(st.one_of(st.just(model), st.text(max_size=20), json_value)),
        "messages": draw(st.one_of(st.lists(message, min_size=1, max_size=4), json_value)),
        "max_tokens": draw(token_count),
    }
    for name, strategy in OPTIONAL.items():
        if draw(st.integers(0, 5)) == 0:
            body[name] = draw(strategy)
    return body


@st.composite
def near_valid_body(draw: Any, model: str) -> dict[str, Any]:
    """A body a real client could send, with edge values in its numbers: most reach the engine's own checks."""
    number = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(min_value=-2**65, max_value=2**65),
                       st.sampled_from([0, 1, -1, 0.5, 2**63, 2**63 - 1, -(2**63), 1e-300]))
    body: dict[str, Any] = {"model": model, "max_tokens": draw(st.integers(1, 3)),
                            "messages": draw(st.lists(st.fixed_dictionaries(
                                {"role": st.sampled_from(["user", "system"]), "content": st.text(max_size=40)}),
                                min_size=1, max_size=2)) + [{"role": "user", "content": "Hi"}]}
    for name in ("temperature", "top_p", "top_k", "seed", "repetition_penalty"):
        if draw(st.booleans()):
            body[name] = draw(number)
    if draw(st.integers(0, 3)) == 0:
        body["stream"] = True
    return body


# Spellings of a /v1 path: encoded dots and slashes, doubled and trailing slashes, segment parameters, backslashes,
# an absolute-form target. Sent as the raw request target, so no client normalisation takes them out of /v1.
V1_PREFIXES = ["/v1", "/v1/", "//v1", "/v1//", "/v1;p", "/v1\\", "http://127.0.0.1/v1"]
V1_TAILS = ["/models", "/models/", "/models/x", "/models/x/", "/chat/completions", "/chat/completions/", "/embeddings",
            "/moderations", "/.", "/..", "/../", "/%2e%2e/", "/../gradio_api/info", "/%2e%2e/gradio_api/queue/data",
            "/models/%2e%2e/%2e%2e/config", "%2fmodels", "/chat%2fcompletions", "/%ff", "/%zz", "/%", ""]
METHODS = ["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD", "TRACE"]


def request_strategy(model: str) -> Any:
    """(method, raw request target, content type, body bytes): mostly chat bodies, then raw bytes, deep nests and
    odd targets under /v1 with every method."""
    chat = chat_body(model).map(lambda b: ("POST", "/v1/chat/completions", "application/json",
                                           json.dumps(b, allow_nan=True).encode()))
    raw = st.tuples(st.just("POST"), st.just("/v1/chat/completions"),
                    st.sampled_from(["application/json", "text/plain", "application/x-www-form-urlencoded", ""]),
                    st.binary(max_size=200))
    deep = st.tuples(st.just("POST"), st.just("/v1/chat/completions"), st.just("application/json"),
                     st.integers(1, 200_000).map(lambda n: b"[" * n))
    tail = st.one_of(st.sampled_from(V1_TAILS), st.text(alphabet="abcxyz/-_.%092eEfF;\\", max_size=20).map(
        lambda t: "/" + t))
    query = st.one_of(st.just(""), st.text(alphabet="ab=&%2e/?", max_size=8).map(lambda q: "?" + q))
    odd = st.tuples(st.sampled_from(METHODS), st.tuples(st.sampled_from(V1_PREFIXES), tail, query).map("".join),
                    st.just("application/json"), json_value.map(lambda v: json.dumps(v).encode()))
    near = near_valid_body(model).map(lambda b: ("POST", "/v1/chat/completions", "application/json",
                                                 json.dumps(b, allow_nan=True).encode()))
    return st.one_of(chat, chat, near, near, raw, deep, odd, odd)


def check_answer(method: str, response: httpx.Response) -> None:
    assert response.status_code < 500, (response.status_code, response.text[:300])
    if method == "HEAD":  # no body: at least the headers say JSON for a refusal
        assert response.status_code < 300 or response.headers["content-type"] == "application/json", response.headers
    elif response.status_code >= 300:
        assert response.headers.get("content-type") == "application/json", response.headers
        body = response.json()
        assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
        assert isinstance(body["error"]["message"], str) and body["error"]["message"]
        if response.status_code == 429:
            assert int(response.headers["retry-after"]) >= 1
    elif response.headers.get("content-type", "").startswith("text/event-stream"):
        assert response.text.rstrip().endswith("data: [DONE]") or '"error"' in response.text
    else:
        response.json()


def test_fuzzed_bodies_never_get_a_server_error_or_a_non_openai_error(fuzzed: dict[str, Any]) -> None:
    http, tally, failures = fuzzed["http"], fuzzed["tally"], fuzzed["failures"]

    @settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(request_strategy(fuzzed["model"]))
    def one(request: tuple[str, str, str, bytes]) -> None:
        method, target, content_type, body = request
        headers = {"Content-Type": content_type} if content_type else {}
        response = http.request(method, "/", content=body if method not in ("GET", "HEAD") else None,
                                headers=headers, extensions={"target": target.encode()})  # sent as it is
        tally[str(response.status_code)] += 1
        try:
            check_answer(method, response)
        except (AssertionError, ValueError, KeyError):
            failures.append(f"{method} {target}: {response.status_code} {response.text[:100]}")
            raise

    one()
    served = http.post("/v1/chat/completions", json={"model": fuzzed["model"], "max_tokens": 2,
                                                  "messages": [{"role": "user", "content": "Hi"}]})
    assert served.status_code == 200 and served.json()["usage"]["completion_tokens"] > 0  # still serving
    growth = rss_bytes() - fuzzed["rss"][0]
    assert growth < MAX_RSS_GROWTH_BYTES, f"RSS grew by {growth / 2**20:.0f} MiB over {EXAMPLES} bodies"
    assert sum(tally.values()) >= EXAMPLES and not [s for s in tally if s.startswith("5")], tally


def test_every_spelling_of_a_v1_path_is_answered_in_openai_shape(fuzzed: dict[str, Any]) -> None:
    """Each prefix x tail above, sent raw by GET and POST, and every method on two routes: never Gradio's answer
    (`{"detail": ...}`, its page, a redirect), always the /v1 app's or the guard's, in OpenAI's shape."""
    http = fuzzed["http"]
    requests = [(m, p + t) for p in V1_PREFIXES for t in V1_TAILS for m in ("GET", "POST")]
    requests += [(m, p) for m in METHODS for p in ("/v1/models", "/v1/chat/completions")]
    statuses: Counter[int] = Counter()
    for method, target in requests:
        response = http.request(method, "/", content=b"{}" if method not in ("GET", "HEAD") else None,
                                headers={"Content-Type": "application/json"}, extensions={"target": target.encode()})
        statuses[response.status_code] += 1
        try:
            check_answer(method, response)
        except (AssertionError, ValueError, KeyError) as exc:
            raise AssertionError(f"{method} {target}: {response.status_code} {response.text[:200]}") from exc
    assert statuses[404] > 200 and statuses[405] > 0 and statuses[400] > 0, statuses  # each kind was reached
