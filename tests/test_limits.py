"""Issue 18 in the library: bounded work per request, fair turns between sessions, Stop of queued work, and a
Compare pool that never piles up model copies (CPU, embedded model, bounded waits)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from llm_core.config import GenerationSettings
from llm_core.engine.chat import ChatEngine
from llm_core.engine.compare import CompareConfig, Comparison, EnginePool, check_allowed, memory_in_use
from llm_core.errors import ContextBudgetError, InputError, ReplyStopped
from llm_core.history import Turn, clean_chat_input
from llm_core.memory.device import OOMInjector
from tests.conftest import drain, make_settings

NF4 = CompareConfig(None, "nf4")
NONE = CompareConfig(None, "none")


class StepCounter(OOMInjector):
    """Counts the engine's decode steps (the plain path checks the injector once per step); never fires."""

    def __init__(self) -> None:
        super().__init__()
        self.steps = 0

    def check(self, point: str) -> None:
        if point == "decode":
            self.steps += 1


@pytest.fixture
def counted(nf4_engine: ChatEngine) -> Iterator[tuple[ChatEngine, StepCounter]]:
    counter = StepCounter()
    saved = nf4_engine.oom_injector
    nf4_engine.oom_injector = counter
    try:
        yield nf4_engine, counter
    finally:
        nf4_engine.oom_injector = saved


def wait_until(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout_s:.0f} s waiting for {what}"
        time.sleep(0.01)


# --- 1 and 6: one cleaning and size check before any tokenization ---------------------------------------------------

def test_oversized_system_prompts_are_refused_before_tokenizing_and_memory_stays_flat(nf4_engine: ChatEngine) -> None:
    """Five distinct 1 MB system prompts: each refused by its size, at once, with nothing kept (RSS grew by ~85 MB per
    prompt when they were tokenized and their encodings cached)."""
    process = psutil.Process()
    gen = nf4_engine.request_options(max_new_tokens=4)
    rss_before = process.memory_info().rss
    t0 = time.perf_counter()
    for i in range(5):
        prompt = f"{i} " + "abcd " * 200_000
        with pytest.raises(InputError, match=f"The system prompt has {len(prompt) - 1:,} characters; the limit is "
                                             "8,000"):
            next(nf4_engine.stream_chat("Hi", [], gen=gen, system_prompt=prompt))
        del prompt
    assert time.perf_counter() - t0 < 5.0  # ~4 s per prompt when each was tokenized
    assert process.memory_info().rss - rss_before < 48 * 2**20
    assert drain(nf4_engine.stream_chat("Hi", [], gen=gen)).done  # and the engine serves the next request


def test_a_refused_prompt_is_tokenized_outside_the_engine_and_does_not_wait_behind_a_reply(
        counted: tuple[ChatEngine, StepCounter]) -> None:
    """A prompt too long for the context is refused while another session's reply is still running: tokenizing and
    fitting happen before the request takes the engine's (single) slot."""
    engine, counter = counted
    running = engine.stream_chat("Count from one to one hundred in words.", [],
                                 gen=engine.request_options(max_new_tokens=120), request_id="busy")
    next(running)
    try:
        steps_at_refusal = -1
        with pytest.raises(ContextBudgetError, match="needs .* tokens"):
            next(engine.stream_chat("1 " * 7_999, [], gen=engine.request_options(max_new_tokens=4096),
                                    request_id="long"))
        steps_at_refusal = counter.steps
        assert engine.generating == 1 and steps_at_refusal < 100  # the other reply was still being written
    finally:
        running.close()


def test_surrogates_and_control_characters_in_history_never_reach_the_prompt() -> None:
    settings = make_settings().chat
    history = [{"role": "user", "content": [{"type": "text", "text": "a\udc00b\x07c"}]},
               {"role": "assistant", "content": "x\ud800\x1by", "metadata": {"title": "t\udfff"}}]
    cleaned = clean_chat_input("hi\ud83d", history, "sys\x00tem", settings)
    assert cleaned.message == "hi" and cleaned.system_prompt == "system"
    assert cleaned.turns == [Turn("abc", "xy")]
    assert cleaned.history[0]["content"][0]["text"] == "abc" and cleaned.history[1]["metadata"]["title"] == "t"
    "".join(str(m) for m in cleaned.history).encode("utf-8")  # everything echoed back is valid UTF-8


def test_engine_cleans_turns_given_directly(counted: tuple[ChatEngine, StepCounter]) -> None:
    engine, _ = counted
    captured: list[Any] = []
    real = engine.prepare

    def spy(message: str, turns: list[Turn], **kwargs: Any) -> Any:
        captured.append(turns)
        return real(message, turns, **kwargs)

    engine.prepare = spy  # type: ignore[method-assign]
    try:
        drain(engine.stream_chat("Hi", [Turn("a\x00\udc80b", "c\x1bd")], gen=engine.request_options(max_new_tokens=2)))
    finally:
        del engine.prepare
    assert captured == [[Turn("ab", "cd")]]


# --- 3 and 4: per-session fairness and Stop of queued work ---------------------------------------------------------

def test_a_flooding_session_gets_one_waiting_request_and_another_user_goes_before_it(
        counted: tuple[ChatEngine, StepCounter]) -> None:
    engine, counter = counted
    gen = engine.request_options(max_new_tokens=24)
    first_token: dict[str, float] = {}
    errors: dict[str, BaseException] = {}

    def ask(name: str, session: str) -> threading.Thread:
        def run() -> None:
            try:
                for update in engine.stream_chat(f"Tell me about {name}.", [], gen=gen, request_id=session):
                    first_token.setdefault(name, time.monotonic())
                    del update
            except BaseException as exc:  # noqa: BLE001 - reported by the assertions below
                errors[name] = exc
        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        return thread

    hog1 = ask("salt", "hog")
    wait_until(lambda: counter.steps > 0, 60, "the hog's first reply to start")
    hog2 = ask("wind", "hog")
    wait_until(lambda: engine._lock.waiting("hog") == 1, 10, "the hog's second request to wait")
    with pytest.raises(InputError, match="already has a reply being written and 1 waiting"):
        next(engine.stream_chat("A third one.", [], gen=gen, request_id="hog"))
    victim = ask("iron", "victim")
    wait_until(lambda: engine._lock.waiting() == 2, 10, "the other user's request to wait")
    for thread in (hog1, hog2, victim):
        thread.join(120)
    assert not errors, errors
    assert first_token["iron"] < first_token["wind"]  # the other user waited for one reply, not for two


def test_stop_removes_a_queued_request_before_it_runs(counted: tuple[ChatEngine, StepCounter]) -> None:
    engine, counter = counted
    busy = engine.stream_chat("Count from one to one hundred in words.", [],
                              gen=engine.request_options(max_new_tokens=60), request_id="other-user")
    next(busy)
    queued = engine.stream_chat("Write a long story.", [], gen=engine.request_options(max_new_tokens=256),
                                request_id="stopper")
    outcome: list[BaseException] = []

    def consume() -> None:
        try:
            drain(queued)
        except BaseException as exc:  # noqa: BLE001
            outcome.append(exc)

    thread = threading.Thread(target=consume, daemon=True)
    thread.start()
    wait_until(lambda: engine._lock.waiting("stopper") == 1, 10, "the request to wait for its turn")
    assert engine.stop("stopper")
    thread.join(5)
    assert not thread.is_alive() and isinstance(outcome[0], ReplyStopped)
    assert "nothing was generated" in str(outcome[0])
    last = drain(busy)  # the other user's reply is untouched
    assert last.done and last.stats.finish_reason in ("length", "eos")
    assert counter.steps <= 60  # the stopped request never decoded a token


def test_stop_and_disconnect_halt_the_worker_within_a_few_tokens(counted: tuple[ChatEngine, StepCounter]) -> None:
    engine, counter = counted
    gen = engine.request_options(max_new_tokens=200)
    stream = engine.stream_chat("Count from one to two hundred in words.", [], gen=gen, request_id="s")
    for _ in range(3):
        next(stream)
    at_stop = counter.steps
    assert engine.stop("s")
    last = drain(stream)
    assert last.stats.finish_reason == "stopped" and counter.steps <= at_stop + 3
    assert engine.generating == 0

    stream = engine.stream_chat("Count from one to two hundred in words.", [], gen=gen, request_id="d")
    for _ in range(3):
        next(stream)
    at_close = counter.steps
    stream.close()  # the client went away
    assert engine.generating == 0 and counter.steps <= at_close + 3


# --- 2 and 5: Compare ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pool(nf4_engine: ChatEngine) -> EnginePool:
    return EnginePool(nf4_engine.settings, primary=nf4_engine)


def test_compare_with_another_kv_mode_loads_no_second_copy(pool: EnginePool, nf4_engine: ChatEngine) -> None:
    quantized_kv = CompareConfig(None, "nf4", kv_cache="int8")
    device = nf4_engine.loaded.device
    before = memory_in_use(device)
    done = drain(Comparison(pool, pool.settings).run([NF4, quantized_kv], "Name a fruit.",
                                                     nf4_engine.request_options(max_new_tokens=4)))
    grown = memory_in_use(device) - before
    assert [r.stats.kv_cache for r in done.results] == ["bf16", "int8"]
    assert pool.resident() == [NF4] and done.results[1].load_s is None  # the served engine answered both
    # a second copy would add at least the weights on top of what the run itself allocates (plain generate with an
    # int8 cache here: 61 MB of RSS in one CI run, against 110 MB of weights: half the weights was within reach)
    assert grown < 0.9 * nf4_engine.report.weights_bytes, grown


def test_a_side_the_device_cannot_run_is_refused_before_anything_loads(pool: EnginePool,
                                                                       nf4_engine: ChatEngine) -> None:
    offload = CompareConfig(None, "none", kv_cache="offload")  # needs CUDA
    with pytest.raises(InputError, match="embedded · none · sdpa · offload KV: KV_CACHE=offload .* needs a CUDA"):
        drain(Comparison(pool, pool.settings).run([NF4, offload], "hi", nf4_engine.request_options(max_new_tokens=2)))
    assert pool.resident() == [NF4]


def test_pool_keeps_at_most_compare_max_loaded_and_releases_a_refused_side() -> None:
    settings = make_settings(COMPARE_MAX_LOADED="1", QUANTIZATION="none", COMPUTE_DTYPE="float32")
    own_pool = EnginePool(settings)
    own_pool.get(NONE)
    _, notes = own_pool.get(NF4)
    assert own_pool.resident() == [NF4]
    assert any("at most 1 configurations stay loaded (COMPARE_MAX_LOADED)" in n for n in notes)
    own_pool.unload(NF4)

    # A side refused after its load (the prompt does not fit its context) does not stay loaded.
    roomy = make_settings(QUANTIZATION="none", COMPUTE_DTYPE="float32")
    own_pool = EnginePool(roomy)
    gen = GenerationSettings(max_new_tokens=4096)
    with pytest.raises(ContextBudgetError):
        drain(Comparison(own_pool, roomy).run([NF4, NONE], "1 " * 7_999, gen))
    assert own_pool.resident() == []


def test_typed_models_only_from_model_dirs_with_one_answer_for_missing_and_forbidden(tmp_path: Path) -> None:
    allowed_root = tmp_path / "models"
    allowed_root.mkdir()
    secret = tmp_path / "secret"
    secret.mkdir()
    (secret / "config.json").write_text("{}")
    (allowed_root / "good").mkdir()
    (allowed_root / "good" / "config.json").write_text("{}")
    (allowed_root / "escape").symlink_to(secret)  # a link out of MODEL_DIRS
    settings = make_settings(ALLOW_CUSTOM_MODELS="true", MODEL_DIRS=str(allowed_root))
    check_allowed(CompareConfig(str(allowed_root / "good"), "nf4"), settings)  # allowed: no error

    answers = []
    for model_id in (str(secret), "/nonexistent", str(allowed_root / "escape"), str(allowed_root / "missing"),
                     "gpt2", f"{allowed_root}/../secret"):
        with pytest.raises(InputError) as info:
            check_allowed(CompareConfig(model_id, "nf4"), settings)
        answers.append(str(info.value).replace(repr(model_id), "ID"))
    assert len(set(answers)) == 1 and "not in the configured list" in answers[0]

    downloads = make_settings(ALLOW_CUSTOM_MODELS="true", ALLOW_DOWNLOADS="true", HF_TOKEN="hf_operator")
    check_allowed(CompareConfig("org/model", "nf4"), downloads)  # a Hub id, only with ALLOW_DOWNLOADS
    assert CompareConfig("org/model", "nf4").apply(downloads).model.hf_token is None  # never the operator's token
