"""Many users at once over one model: batched decoding, isolation, limits, hostile input and auth (CPU, embedded model).

Every wait is bounded (deadlines, `job.result(timeout=...)`), every server binds 127.0.0.1 and every client targets it.
"""

from __future__ import annotations

import itertools
import re
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from app import launch as launch_app
from llm_core.engine.admission import ReplySlots
from llm_core.engine.chat import ChatEngine, ReplyUpdate
from llm_core.engine.eager_runner import EagerRunner
from llm_core.engine.scheduler import Scheduler
from llm_core.engine.serving import resolve_max_batch_size
from llm_core.errors import ContextBudgetError, InputError, OutOfMemoryError, SettingsError
from llm_core.history import check_history_size
from llm_core.sampling import SamplingOptions
from tests.conftest import drain, make_settings, run_threads
from tests.test_app import free_port, text
from ui import build_demo
from ui.page import COMPARE_WIDTH

SYSTEM = "You are a helpful assistant."
JOB_TIMEOUT_S = 240.0


# --- fixtures ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def batched_fp32(fp32_engine: ChatEngine) -> Iterator[ChatEngine]:
    """The fp32 reference model, served with batching (same weights object as `fp32_engine`)."""
    engine = ChatEngine(fp32_engine.loaded, make_settings(QUANTIZATION="none", COMPUTE_DTYPE="float32",
                                                          DECODE_PATH="plain", MAX_BATCH_SIZE="4"))
    yield engine
    assert engine.scheduler is not None
    engine.scheduler.close()


@pytest.fixture(scope="module")
def batched_nf4(nf4_engine: ChatEngine) -> Iterator[ChatEngine]:
    """The demo's default model (nf4) with MAX_BATCH_SIZE=8, as a GPU deployment runs it."""
    engine = ChatEngine(nf4_engine.loaded, make_settings(MAX_BATCH_SIZE="8"))
    yield engine
    assert engine.scheduler is not None
    engine.scheduler.close()


def launch(engine: ChatEngine, auth: str | None = None) -> tuple[Any, str]:
    """As app.main launches it, behind a "proxy" on 127.0.0.1 (FORWARDED_ALLOW_IPS): each test client names its own
    address, so without AUTH each client is its own person, as users on their own machines are."""
    demo = build_demo(engine, engine.settings)
    port = free_port()
    launch_app(demo, engine.settings.replace(server={"port": port, "auth": auth,
                                                     "forwarded_allow_ips": ("127.0.0.1",)}),
               prevent_thread_lock=True, quiet=True)
    return demo, f"http://127.0.0.1:{port}/"


@pytest.fixture(scope="module")
def batched_url(batched_nf4: ChatEngine) -> Iterator[str]:
    demo, url = launch(batched_nf4)
    try:
        yield url
    finally:
        demo.close()


_CLIENT_ADDRESSES = itertools.count(1)


def new_client(url: str, **kwargs: Any) -> Any:
    """A gradio_client session from an address of its own (the trusted proxy's X-Forwarded-For)."""
    from gradio_client import Client

    n = next(_CLIENT_ADDRESSES)
    return Client(url, verbose=False, headers={"X-Forwarded-For": f"10.77.{n // 250}.{n % 250 + 1}"}, **kwargs)


def submit_chat(client: Any, message: Any, history: Any = (), max_new_tokens: Any = 8, **overrides: Any) -> Any:
    """Submit /chat by parameter name; inputs not named take the UI's defaults (greedy)."""
    values = dict(system_prompt=SYSTEM, max_new_tokens=max_new_tokens, history_turns=8, do_sample=False)
    values.update(overrides)
    return client.submit(message=message, history=list(history), api_name="/chat", **values)


def final_output(job: Any, timeout_s: float = JOB_TIMEOUT_S) -> tuple[Any, ...]:
    """The last streamed output of a /chat job, waiting at most `timeout_s`; raises the job's error."""
    job.result(timeout=timeout_s)
    outputs = job.outputs()
    assert outputs, "the job finished without output"
    return tuple(outputs[-1])


def wait_until(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout_s:.0f} s waiting for {what}"
        time.sleep(0.05)


# --- settings and small parts ------------------------------------------------------------------------------------


def test_max_batch_size_auto_is_8_on_cuda_with_the_paged_pool_or_a_shared_demo_and_serial_otherwise() -> None:
    """Auto batches on CUDA where the paged pool lets a lone reply use all of it, or where several users are expected;
    with fixed slots one user's GPU keeps the single-reply fast loop, whose one cache gets the whole memory budget
    (the slots would split it); CPU serves one at a time; a number always wins."""
    assert resolve_max_batch_size(None, torch.device("cuda", 0), "auto", shared=True) == 8
    assert resolve_max_batch_size(None, torch.device("cuda", 0), "auto", shared=False) == 1  # slots: one cache
    assert resolve_max_batch_size(None, torch.device("cuda", 0), "auto", shared=False, paged=True) == 8  # one pool
    assert resolve_max_batch_size(None, torch.device("cpu"), "auto", shared=True, paged=True) == 1
    assert resolve_max_batch_size(None, torch.device("cuda", 0), "fast", shared=True) == 8  # the fast path batches
    assert resolve_max_batch_size(8, torch.device("cuda", 0), "auto", shared=False) == 8
    assert resolve_max_batch_size(None, torch.device("cpu"), "auto") == 1
    assert resolve_max_batch_size(3, torch.device("cpu"), "plain") == 3
    assert make_settings().server.max_batch_size is None
    assert make_settings(MAX_BATCH_SIZE="8").server.max_batch_size == 8
    assert make_settings(MAX_BATCH_SIZE="8", DECODE_PATH="fast").server.max_batch_size == 8
    with pytest.raises(SettingsError, match="MAX_BATCH_SIZE"):
        make_settings(MAX_BATCH_SIZE="0")


def test_serial_engine_keeps_todays_behaviour(nf4_engine: ChatEngine) -> None:
    assert nf4_engine.scheduler is None and nf4_engine.max_concurrent_replies == 1
    assert nf4_engine.backend.name in ("plain", "fast")


def test_reply_slots_exclusive_waits_for_every_running_reply() -> None:
    slots = ReplySlots(2)
    slots.acquire()
    slots.acquire()
    assert not slots.acquire(timeout=0.05)  # both taken
    entered = threading.Event()

    def take_all() -> None:
        with slots.exclusive():
            entered.set()

    thread = threading.Thread(target=take_all, daemon=True)
    thread.start()
    slots.release()
    assert not entered.wait(0.1)  # one reply still running
    slots.release()
    assert entered.wait(5)
    thread.join(5)
    assert slots.acquire(timeout=1)


def test_history_size_limits_name_the_limit() -> None:
    ok = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [{"type": "text", "text": "yo"}]}]
    check_history_size(ok, max_messages=2, max_chars=4)
    with pytest.raises(InputError, match="3 messages; the limit is 2"):
        check_history_size([*ok, ok[0]], max_messages=2, max_chars=100)
    with pytest.raises(InputError, match="5 characters; the limit is 4"):
        check_history_size([{"role": "user", "content": "hello"}], max_messages=9, max_chars=4)


# --- the scheduler on the fp32 reference model ----------------------------------------------------------------------

PROMPTS = [
    "Hi!",
    "Name three colours of the rainbow.",
    "Write two sentences about a lighthouse keeper who waits every night for a ship that never comes, and about "
    "the sea around the lighthouse in winter.",
    "What is 12 times 12?",
]


def test_batched_greedy_replies_equal_each_reply_alone_fp32(fp32_engine: ChatEngine,
                                                            batched_fp32: ChatEngine) -> None:
    """Exact token equality in fp32: each row is prefilled alone (batch 1, as when served alone), and in the batched
    decode step a row's logits do not depend on the other rows: padding columns are masked to exactly zero weight
    and the matmuls reduce each row on its own. Joins are staggered so rows join a wider and a narrower cache."""
    gen = fp32_engine.request_options(max_new_tokens=10)
    alone = [drain(fp32_engine.stream_chat(p, [], gen=gen, system_prompt=SYSTEM)) for p in PROMPTS]
    steps_before = batched_fp32.scheduler.snapshot() if batched_fp32.scheduler else None
    together: dict[int, ReplyUpdate] = {}

    def ask(i: int) -> Callable[[], None]:
        def run() -> None:
            time.sleep(0.4 * i)
            together[i] = drain(batched_fp32.stream_chat(PROMPTS[i], [], gen=gen, system_prompt=SYSTEM))
        return run

    run_threads([ask(i) for i in range(len(PROMPTS))])
    for i, reference in enumerate(alone):
        assert together[i].token_ids == reference.token_ids, f"prompt {i} differs from its reply alone"
        assert together[i].text == reference.text
        stats = together[i].stats
        assert stats.decode_path == "batched" and stats.new_tokens == len(reference.token_ids)
        assert stats.prompt_tokens == reference.stats.prompt_tokens and stats.ttft_s and stats.ttft_s > 0
        assert stats.kv_cache_bytes and stats.kv_cache_bytes > 0
    assert steps_before is not None and batched_fp32.scheduler is not None
    assert batched_fp32.scheduler.snapshot().max_rows_in_step >= 2  # they really shared decode steps


def test_stop_and_disconnect_halt_only_their_own_reply(batched_fp32: ChatEngine) -> None:
    gen = batched_fp32.request_options(max_new_tokens=20)
    stopped = batched_fp32.stream_chat("Count from one to fifty in words.", [], gen=gen, request_id="stop-me")
    dropped = batched_fp32.stream_chat("List ten animals.", [], gen=gen, request_id="drop-me")
    kept = batched_fp32.stream_chat("Write a short poem about rain.", [], gen=gen, request_id="keep-me")
    first = {"stopped": next(stopped), "dropped": next(dropped), "kept": next(kept)}
    assert all(u.text is not None for u in first.values())
    assert batched_fp32.stop("stop-me")
    last_stopped = drain(stopped)
    dropped.close()  # the client went away: the generator is closed mid-reply
    last_kept = drain(kept)
    assert last_stopped.done and last_stopped.stats.finish_reason == "stopped"
    assert last_stopped.stats.new_tokens < 20
    assert last_kept.done and last_kept.stats.finish_reason in ("length", "eos")
    assert last_kept.stats.finish_reason == "eos" or last_kept.stats.new_tokens == 20
    assert batched_fp32.scheduler is not None
    wait_until(lambda: batched_fp32.scheduler is not None and batched_fp32.scheduler.snapshot().active == 0, 30,
               "the stopped and dropped rows to leave the batch")


def test_a_session_gets_one_running_and_one_waiting_request_and_more_are_refused(batched_fp32: ChatEngine) -> None:
    """Even with free batch rows, a session's second request waits for its first (SESSION_MAX_WAITING=1) and a third
    is refused at once; the waiting one then runs."""
    gen = batched_fp32.request_options(max_new_tokens=6)
    running = batched_fp32.stream_chat("Say hello.", [], gen=gen, request_id="one-session")
    next(running)
    second: list[ReplyUpdate] = []
    waiter = threading.Thread(target=lambda: second.append(drain(batched_fp32.stream_chat(
        "And again.", [], gen=gen, request_id="one-session"))), daemon=True)
    waiter.start()
    wait_until(lambda: batched_fp32._lock.waiting("one-session") == 1, 10, "the second request to wait")
    with pytest.raises(InputError, match="already has a reply being written and 1 waiting"):
        next(batched_fp32.stream_chat("A third.", [], gen=gen, request_id="one-session"))
    assert not second  # still waiting while the first runs
    drain(running)
    waiter.join(60)
    assert second and second[0].done


def test_out_of_memory_in_a_batch_step_fails_only_the_newest_row(
        fp32_engine: ChatEngine, batched_fp32: ChatEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    scheduler = batched_fp32.scheduler
    assert scheduler is not None
    gen = batched_fp32.request_options(max_new_tokens=8)
    reference = drain(fp32_engine.stream_chat(PROMPTS[1], [], gen=gen, system_prompt=SYSTEM))
    real_forward = scheduler.runner._forward
    fired: list[int] = []

    def forward(input_ids: torch.Tensor, *args: Any) -> torch.Tensor:
        if input_ids.shape[0] == 2 and not fired:  # the first decode step with two rows
            fired.append(1)
            raise torch.OutOfMemoryError("CUDA out of memory (injected by the test).")
        return real_forward(input_ids, *args)

    monkeypatch.setattr(scheduler.runner, "_forward", forward)
    older = batched_fp32.stream_chat(PROMPTS[1], [], gen=gen, system_prompt=SYSTEM, request_id="older")
    first = next(older)
    newer = batched_fp32.stream_chat(PROMPTS[3], [], gen=gen, system_prompt=SYSTEM, request_id="newer")
    with pytest.raises(OutOfMemoryError, match="ran out of memory"):
        drain(newer)
    last = drain(older) if not first.done else first
    assert fired and last.token_ids == reference.token_ids  # the older reply is untouched and exact


def test_admission_waits_only_while_the_kv_would_not_fit(fp32_engine: ChatEngine) -> None:
    engine = ChatEngine(fp32_engine.loaded, make_settings(QUANTIZATION="none", COMPUTE_DTYPE="float32",
                                                          DECODE_PATH="plain", MAX_BATCH_SIZE="4"))
    scheduler = engine.scheduler
    assert isinstance(scheduler, Scheduler) and isinstance(scheduler.runner, EagerRunner)
    runner = scheduler.runner
    try:
        gen = engine.request_options(max_new_tokens=6)
        prompt_tokens = engine.count_tokens([{"role": "system", "content": SYSTEM},
                                             {"role": "user", "content": "Say yes."}])
        one_reply = (prompt_tokens + 6) * runner.kv_bytes_per_token
        runner.kv_budget_bytes = int(one_reply * 1.5)  # one reply fits, two do not
        replies: dict[str, ReplyUpdate] = {}

        def ask(name: str) -> Callable[[], None]:
            return lambda: replies.__setitem__(name, drain(engine.stream_chat("Say yes.", [], gen=gen,
                                                                               system_prompt=SYSTEM)))

        run_threads([ask("a"), ask("b")])
        tight = scheduler.snapshot()
        assert tight.max_rows_in_step == 1 and tight.waited_for_memory >= 1  # the second waited for the first
        assert replies["a"].token_ids == replies["b"].token_ids

        runner.kv_budget_bytes = one_reply * 4  # now both fit: nobody waits
        run_threads([ask("c"), ask("d")])
        roomy = scheduler.snapshot()
        assert roomy.waited_for_memory == tight.waited_for_memory

        too_big = engine.request_options(max_new_tokens=4096)
        with pytest.raises(ContextBudgetError, match="KV cache"):
            drain(engine.stream_chat("Say yes.", [], gen=too_big))  # refused at once, never queued forever
    finally:
        scheduler.close()


def test_a_bad_request_in_the_scheduler_fails_alone(batched_fp32: ChatEngine) -> None:
    scheduler = batched_fp32.scheduler
    assert scheduler is not None
    good = scheduler.submit([1, 9690, 198, 2], SamplingOptions(), 6, threading.Event())
    bad = scheduler.submit([1, 10**9], SamplingOptions(), 6, threading.Event())  # an id outside the vocabulary
    with pytest.raises(IndexError):
        list(scheduler.stream(bad))
    assert len(list(scheduler.stream(good))) >= 1


# --- through the Gradio app: 8 sessions at once -------------------------------------------------------------------

CODE_WORDS = ["QZX-ALPHA-17", "VRK-BRAVO-28", "JWM-CHARLIE-39", "PLD-DELTA-40", "HTY-ECHO-51", "NBG-FOXTROT-62",
              "KSU-GOLF-73", "ZFE-HOTEL-84"]
TOPICS = ["the moon", "bread", "rivers", "chess", "volcanoes", "owls", "trains", "glass"]


def test_eight_concurrent_sessions_each_get_their_own_complete_multi_turn_chat(batched_url: str,
                                                                              batched_nf4: ChatEngine) -> None:
    scheduler = batched_nf4.scheduler
    assert scheduler is not None and batched_nf4.max_concurrent_replies == 8
    eight_sessions_each_get_their_own_chat(batched_url, "batched", scheduler.snapshot)


def eight_sessions_each_get_their_own_chat(url: str, decode_path: str, snapshot: Callable[[], Any]) -> None:
    """8 gradio_client sessions at once, two turns each: every reply complete, on `decode_path`, built on its own
    session's history, with no other session's words; and served together (snapshot().max_rows_in_step >= 4)."""
    results: dict[int, list[Any]] = {}

    def session(k: int) -> Callable[[], None]:
        def run() -> None:
            client = new_client(url)
            turns = [f"Remember the code word {CODE_WORDS[k]}. Say one sentence about {TOPICS[k]}.",
                     f"What was the code word? Then one more sentence about {TOPICS[k]}."]
            history: list[Any] = []
            outputs = []
            for message in turns:
                _, history, _, stats = final_output(submit_chat(client, message, history, max_new_tokens=6))
                outputs.append((list(history), stats))
            results[k] = outputs
        return run

    run_threads([session(k) for k in range(8)])
    assert sorted(results) == list(range(8))
    for k, outputs in results.items():
        (history1, stats1), (history2, stats2) = outputs
        assert [m["role"] for m in history2] == ["user", "assistant", "user", "assistant"]
        assert history2[:2] == history1  # the second turn was built on this session's own first turn
        assert CODE_WORDS[k] in text(history2[0]["content"]) and TOPICS[k] in text(history2[2]["content"])
        for stats in (stats1, stats2):  # every reply completed, with its own numbers
            assert stats["finish_reason"] in ("length", "eos") and stats["new_tokens"] > 0
            assert stats["decode_path"] == decode_path and stats["ttft_s"] > 0
        replies = text(history2[1]["content"]) + text(history2[3]["content"])
        for other in range(8):
            if other != k:
                assert CODE_WORDS[other] not in replies and TOPICS[other] not in text(history2[0]["content"])
    assert snapshot().max_rows_in_step >= 4  # served together, not one after another


def test_stop_or_disconnect_in_one_session_leaves_the_others_running(batched_url: str,
                                                                     batched_nf4: ChatEngine) -> None:
    clients = [new_client(batched_url) for _ in range(4)]
    stopped = submit_chat(clients[0], "Count slowly from one to one hundred in words.", max_new_tokens=400)
    gone = submit_chat(clients[1], "List every country you know.", max_new_tokens=400)
    wait_until(lambda: len(stopped.outputs()) >= 2 and len(gone.outputs()) >= 2, 120, "the long replies to stream")
    others = [submit_chat(c, f"Write a long story about {topic}.", max_new_tokens=24)
              for c, topic in zip(clients[2:], ("tea", "snow"), strict=True)]
    wait_until(lambda: all(len(job.outputs()) >= 2 for job in others), 120, "the other replies to stream")
    running = [(job, len(job.outputs())) for job in others if not job.done()]
    scheduler = batched_nf4.scheduler
    assert scheduler is not None
    clients[0].predict(api_name="/stop")  # Stop in session 0 only
    gone.cancel()  # session 1's client goes away mid-reply
    # Both workers' rows leave the batch within a few decode steps (400 tokens would take far longer than 5 s): the
    # only rows left are those of the other replies still running.
    wait_until(lambda: scheduler.snapshot().active <= sum(not job.done() for job in others), 5,
               "the stopped and the abandoned rows to leave the batch")
    wait_until(stopped.done, 30, "the stopped reply to end")
    assert len(stopped.outputs()) < 400  # halted, not run to max_new_tokens
    assert running, "the other replies finished before Stop was pressed; nothing was proven"
    for job, streamed_before_stop in running:  # the others kept streaming after the Stop, to their end
        _, history, _, stats = final_output(job)
        assert len(job.outputs()) > streamed_before_stop
        assert stats["finish_reason"] in ("length", "eos") and stats["new_tokens"] > 0
        assert text(history[-1]["content"]).strip()
    wait_until(lambda: scheduler.snapshot().active == 0, 30, "the batch to drain")


def test_chat_events_share_one_queue_as_wide_as_the_batch(batched_fp32: ChatEngine) -> None:
    """Gradio lets as many chat replies run as the engine batches; the rest wait in one shared queue, which shows
    each waiting user its position (show_progress="full"); comparisons share one queue of their own."""
    demo = build_demo(batched_fp32, batched_fp32.settings)
    chat_fns = [fn for fn in demo.fns.values() if fn.name in ("respond", "regenerate")]
    assert len(chat_fns) == 5  # send, Enter and regenerate in the page; the /chat and /regenerate API endpoints
    assert {fn.concurrency_id for fn in chat_fns} == {"chat"} and all(fn.show_progress == "full" for fn in chat_fns)
    assert demo._queue.default_concurrency_limit == batched_fp32.max_concurrent_replies == 4
    compare_fns = [fn for fn in demo.fns.values() if fn.name == "compare"]  # the page's button and the API's
    # Several reach Comparison's per-person turns (one runs at a time there), page and API in one queue.
    assert len(compare_fns) == 2 and all(fn.concurrency_limit == COMPARE_WIDTH for fn in compare_fns)
    assert {fn.concurrency_id for fn in compare_fns} == {"compare"}


# --- hostile input through the API -------------------------------------------------------------------------------

def message(role: str, content: str) -> dict[str, Any]:
    """A chat message as Gradio 6's Chatbot takes it through the API (content as a list of parts)."""
    return {"role": role, "content": [{"type": "text", "text": content}]}


# Each case names who refuses it: the library (llm_core's own message, reached through the API) or Gradio's slider
# range check (its own message), so a dropped library check fails its case.
HOSTILE = [
    pytest.param("x" * 16_001, [], {}, "The message has 16,001 characters; the limit is 16,000.",
                 id="llm_core-oversized-message"),
    pytest.param("hi", [], {"system_prompt": "s" * 8_001},
                 "The system prompt has 8,001 characters; the limit is 8,000.", id="llm_core-oversized-system-prompt"),
    pytest.param("hi", "not a list", {}, "History message 1 is malformed: each needs 'role' and 'content'.",
                 id="llm_core-history-not-a-list"),  # gradio_client sends the string as a one-item list
    pytest.param("hi", [{"role": "user"}], {}, "History message 1 is malformed: each needs 'role' and 'content'.",
                 id="llm_core-history-message-without-content"),
    pytest.param("hi", [{"role": "tool", "content": "x"}], {}, "History message 1 has role 'tool'; use 'user' or "
                 "'assistant'.", id="llm_core-history-unknown-role"),
    pytest.param("hi", [message("user", "a"), message("assistant", "b")] * 129, {},
                 "The history has 258 messages; the limit is 256.", id="llm_core-history-too-many-messages"),
    pytest.param("hi", [message("user", "a" * 130_000), message("assistant", "b" * 130_000)], {},
                 "The history holds 260,000 characters; the limit is 256,000.",
                 id="llm_core-history-too-many-characters"),
    pytest.param("hi", [message("user", "a")] * 3 + [{"role": "user", "content": [{"type": "image"}]}], {},
                 "Files and images are not supported by this text-only demo.", id="llm_core-history-non-text-part"),
    pytest.param("hi", [], {"max_new_tokens": 2.5}, "max_new_tokens must be a whole number, got 2.5.",
                 id="llm_core-max-new-tokens-fraction"),
    pytest.param("\x00\x01\x02", [], {}, "The message is empty.", id="llm_core-only-control-characters"),
    pytest.param("hi", [], {"max_new_tokens": 10**9}, "Value 1000000000 is greater than maximum value 4096.",
                 id="gradio-max-new-tokens-huge"),
    pytest.param("hi", [], {"max_new_tokens": -5}, "Value -5 is less than minimum value 1.",
                 id="gradio-max-new-tokens-negative"),
    pytest.param("hi", [], {"do_sample": True, "temperature": 99.0}, "Value 99.0 is greater than maximum value 2.0.",
                 id="gradio-temperature-out-of-range"),
    pytest.param("hi", [], {"top_p": 7.0}, "Value 7.0 is greater than maximum value 1.0.",
                 id="gradio-top-p-out-of-range"),
    pytest.param("hi", [], {"history_turns": -1}, "Value -1 is less than minimum value 0.",
                 id="gradio-history-turns-negative"),
]


@pytest.mark.parametrize(("message", "history", "overrides", "says"), HOSTILE)
def test_hostile_input_gets_a_clear_error(batched_url: str, message: Any, history: Any, overrides: dict[str, Any],
                                          says: str) -> None:
    from gradio_client.exceptions import AppError

    client = new_client(batched_url)
    job = submit_chat(client, message, history, **overrides)
    with pytest.raises(AppError) as info:
        job.result(timeout=60)
    assert says in str(info.value)  # the refusing layer's own sentence, not a bare failure


def chat_defaults(url: str, **values: Any) -> list[Any]:
    """/chat's inputs in order, each at its API default unless given by parameter name."""
    import httpx

    parameters = httpx.get(url + "gradio_api/info", timeout=30).json()["named_endpoints"]["/chat"]["parameters"]
    return [values.get(p["parameter_name"], p.get("parameter_default")) for p in parameters]


def raw_chat_call(url: str, data: list[Any], timeout_s: float = 60.0) -> str:
    """POST /gradio_api/call/chat with JSON as any HTTP client may send it (here: escaped lone surrogates, which
    gradio_client cannot encode), then read the event stream; returns its text."""
    import json

    import httpx

    body = json.dumps({"data": data}, ensure_ascii=True)  # "\ud800" stays an escape in the JSON text
    posted = httpx.post(url + "gradio_api/call/chat", content=body, headers={"Content-Type": "application/json"},
                        timeout=timeout_s)
    assert posted.status_code == 200, posted.text
    event_id = posted.json()["event_id"]
    with httpx.stream("GET", f"{url}gradio_api/call/chat/{event_id}", timeout=timeout_s) as stream:
        return "".join(stream.iter_text())


def test_lone_surrogates_and_raw_api_calls_get_a_clear_error(batched_url: str) -> None:
    answer = raw_chat_call(batched_url, chat_defaults(batched_url, message="\udfff \ud800\u0000", history=[]))
    assert "event: error" in answer and "message is empty" in answer  # unpaired surrogates + NUL: nothing left
    assert "event: error" in raw_chat_call(batched_url, ["hi"])  # too few inputs
    answer = raw_chat_call(batched_url, chat_defaults(batched_url, message="Say ok.", history=[], max_new_tokens=2))
    assert "event: complete" in answer  # and the server keeps serving


def test_unicode_edge_cases_round_trip_and_the_server_keeps_serving(batched_url: str) -> None:
    client = new_client(batched_url)
    message = "👩‍👩‍👧‍👦 e\u0301\u0301 \u202eabc\u202c 你好 𝔘𝔫𝔦 \u200b end"
    _, history, _, stats = final_output(submit_chat(client, message, max_new_tokens=4))
    assert text(history[0]["content"]) == message and stats["new_tokens"] > 0


def test_many_requests_from_one_session_get_one_reply_and_clear_errors(batched_url: str) -> None:
    from gradio_client.exceptions import AppError

    client = new_client(batched_url)
    jobs = [submit_chat(client, f"Say the number {i}.", max_new_tokens=12) for i in range(4)]
    done, refused = 0, []
    for job in jobs:
        try:
            final_output(job)
            done += 1
        except AppError as exc:
            refused.append(str(exc))
    assert done >= 1 and refused, (done, refused)
    assert all("already has a reply being written" in message for message in refused)
    assert final_output(submit_chat(client, "Still there?", max_new_tokens=3))[3]["new_tokens"] > 0


# --- queue position and auth (a serial engine, as on CPU) ---------------------------------------------------------

PASSWORD = "correct-horse-battery"


@pytest.fixture(scope="module")
def auth_url(nf4_engine: ChatEngine) -> Iterator[str]:
    demo, url = launch(nf4_engine, auth=",".join(f"{name}:{PASSWORD}" for name in ("alice", "bob", "carol")))
    try:
        yield url
    finally:
        demo.close()


def test_wrong_credentials_are_refused_and_right_ones_admitted(auth_url: str) -> None:
    import httpx

    assert httpx.post(auth_url + "login", data={"username": "alice", "password": "wrong"}).status_code >= 400
    assert httpx.post(auth_url + "login", data={"username": "mallory", "password": PASSWORD}).status_code >= 400
    assert httpx.get(auth_url + "config").status_code >= 400  # nothing without logging in
    with pytest.raises(Exception):  # noqa: B017 - gradio_client raises a plain ValueError here
        new_client(auth_url, auth=("alice", "wrong"))
    assert httpx.post(auth_url + "login", data={"username": "alice", "password": PASSWORD}).status_code == 200
    client = new_client(auth_url, auth=("alice", PASSWORD))
    assert final_output(submit_chat(client, "Hi", max_new_tokens=2))[3]["new_tokens"] > 0


def test_auth_secret_is_not_in_the_settings_repr() -> None:
    settings = make_settings(AUTH=f"alice:{PASSWORD}")
    assert PASSWORD not in repr(settings) and PASSWORD not in repr(settings.server)


def test_queue_shows_each_waiting_user_a_position(auth_url: str) -> None:
    """With every reply slot busy (one on this serial engine), a request waiting for its turn in the engine's fair
    queue tells its client how many requests go first, in Gradio's progress overlay (status PROGRESS, desc)."""
    from gradio_client.utils import Status

    clients = [new_client(auth_url, auth=(name, PASSWORD)) for name in ("alice", "bob", "carol")]  # three people
    jobs = [submit_chat(c, f"Tell me about {topic}.", max_new_tokens=12) for c, topic in
            zip(clients, ("salt", "wind", "iron"), strict=True)]
    seen: list[str] = []

    def ranked() -> bool:  # whichever jobs wait behind the running one
        for job in jobs:
            status = job.status()
            if status.code == Status.PROGRESS and status.progress_data:
                seen.extend(str(unit.desc) for unit in status.progress_data if unit.desc)
        return bool(seen) or all(job.done() for job in jobs)

    wait_until(ranked, 120, "a waiting job to report its position")
    for job in jobs:
        final_output(job)
    assert seen and all(re.fullmatch(r"Waiting for a free slot: [12] requests? ahead( \(about \d+ s\))?", d)
                        for d in seen), seen


def test_wait_estimate_comes_from_measured_reply_times(fp32_engine: ChatEngine) -> None:
    """The estimate a waiting user sees: none before any reply was measured; after replies, the average reply time
    per round of max_concurrent_replies, growing with the requests ahead."""
    engine = ChatEngine(fp32_engine.loaded, fp32_engine.settings)
    assert engine.wait_estimate_s(2) is None
    drain(engine.stream_chat("Say hi.", [], gen=engine.request_options(max_new_tokens=4)))
    one = engine.wait_estimate_s(1)
    assert one is not None and one > 0
    assert engine.wait_estimate_s(0) == 0.0
    assert engine.wait_estimate_s(3) == pytest.approx(3 * one)  # serial engine: one reply per round
