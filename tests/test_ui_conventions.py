"""Gradio and Spaces conventions: Gradio's server variables, MCP_SERVER, and bad input as a warning in the page."""

from __future__ import annotations

import importlib.util
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from app import check_mcp_support, launch
from llm_core.config import Settings
from llm_core.engine.chat import ChatEngine
from llm_core.engine.compare import EnginePool
from llm_core.errors import SettingsError
from tests.conftest import MODEL_CACHE
from tests.test_app import CHROMIUM, CHROMIUM_FLAGS, free_port
from ui import build_demo


def settings_from(environ: dict[str, str], env_file: Path | None = None, **flags: Any) -> Settings:
    return Settings.from_env(environ={"CACHE_DIR": str(MODEL_CACHE), **environ}, env_file=env_file,
                             overrides=flags)


def test_gradio_server_name_and_port_apply_when_host_and_port_are_not_set() -> None:
    s = settings_from({"GRADIO_SERVER_NAME": "0.0.0.0", "GRADIO_SERVER_PORT": "7861"})
    assert (s.server.host, s.server.port) == ("0.0.0.0", 7861)
    assert s.server.is_shared  # binding beyond loopback counts as shared, as with HOST


def test_our_host_and_port_win_over_gradios_wherever_they_are_set(tmp_path: Path) -> None:
    gradio_env = {"GRADIO_SERVER_NAME": "0.0.0.0", "GRADIO_SERVER_PORT": "7861"}
    s = settings_from({**gradio_env, "HOST": "127.0.0.1", "PORT": "9000"})
    assert (s.server.host, s.server.port) == ("127.0.0.1", 9000)
    env_file = tmp_path / ".env"
    env_file.write_text("PORT=9001\n")
    s = settings_from(gradio_env, env_file=env_file)
    assert (s.server.host, s.server.port) == ("0.0.0.0", 9001)
    s = settings_from(gradio_env, HOST="localhost")
    assert s.server.host == "localhost" and s.server.port == 7861


def test_bad_gradio_server_port_is_refused_with_the_setting_named() -> None:
    with pytest.raises(SettingsError, match="PORT"):
        settings_from({"GRADIO_SERVER_PORT": "seventy"})


def test_mcp_server_follows_gradio_mcp_server_unless_set() -> None:
    assert settings_from({}).server.mcp_server is False
    assert settings_from({"GRADIO_MCP_SERVER": "True"}).server.mcp_server is True
    assert settings_from({"GRADIO_MCP_SERVER": "True", "MCP_SERVER": "false"}).server.mcp_server is False


@pytest.fixture(scope="module")
def served_on_gradio_port(nf4_engine: ChatEngine) -> Iterator[str]:
    """The app launched from settings that name only Gradio's variables (as a Space sets them)."""
    port = free_port()
    settings = settings_from({"GRADIO_SERVER_NAME": "127.0.0.1", "GRADIO_SERVER_PORT": str(port)})
    pool = EnginePool(settings, primary=nf4_engine)
    demo = build_demo(nf4_engine, settings, pool)
    launch(demo, settings, pool, prevent_thread_lock=True, quiet=True)
    try:
        yield f"http://127.0.0.1:{port}/"
    finally:
        demo.close()


def test_the_app_listens_where_gradios_variables_say(served_on_gradio_port: str) -> None:
    assert httpx.get(served_on_gradio_port, timeout=30).status_code == 200
    models = httpx.get(served_on_gradio_port + "v1/models", timeout=30).json()  # the API shares the server
    assert models["data"][0]["id"] == "SmolLM2-135M-Instruct"


@pytest.mark.skipif(importlib.util.find_spec("mcp") is not None, reason="gradio[mcp] is installed here")
def test_mcp_server_without_gradio_mcp_is_refused_with_the_fix() -> None:
    with pytest.raises(SettingsError, match=r"gradio\[mcp\]"):
        check_mcp_support(settings_from({"MCP_SERVER": "true"}))
    check_mcp_support(settings_from({}))  # off: nothing to check


# Run with gradio[mcp] installed, e.g. from a venv that adds it (it pins pydantic 2.12.5) on top of .venv's packages.
@pytest.mark.skipif(importlib.util.find_spec("mcp") is None, reason="gradio[mcp] is not installed")
def test_mcp_server_lists_the_chat_endpoint_as_a_tool(nf4_engine: ChatEngine) -> None:
    port = free_port()
    settings = settings_from({"MCP_SERVER": "true", "PORT": str(port)})
    pool = EnginePool(settings, primary=nf4_engine)
    demo = build_demo(nf4_engine, settings, pool)
    launch(demo, settings, pool, prevent_thread_lock=True, quiet=True)
    try:
        schema = httpx.get(f"http://127.0.0.1:{port}/gradio_api/mcp/schema", timeout=30).json()
        tools = {tool["name"]: tool for tool in schema}
        assert "message" in tools["respond"]["inputSchema"]["properties"]  # the /chat endpoint as a tool
        assert "/chat API" in tools["respond"]["description"]
    finally:
        demo.close()


@pytest.mark.browser
@pytest.mark.skipif(not Path(CHROMIUM).exists() or shutil.which("chromium") is None,
                    reason="Debian chromium not installed (make test installs it)")
def test_empty_message_is_a_warning_and_the_conversation_stays_in_view(served_on_gradio_port: str,
                                                                        artifacts_dir: Path) -> None:
    from playwright.sync_api import expect, sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(served_on_gradio_port)
            box = page.locator("#chat-input textarea")
            box.fill("Hello! Name two planets.")
            page.locator("#send").click()
            stats = page.locator("#stats")
            expect(stats).to_contain_text("Finished by", timeout=120_000)
            bot = page.locator("#chatbot .message.bot, #chatbot [data-testid='bot']").last
            reply = bot.inner_text()
            assert reply.strip()

            box.fill("   ")
            page.locator("#send").click()
            toast = page.locator(".toast-body").filter(has_text="The message is empty")
            expect(toast).to_be_visible(timeout=20_000)
            expect(toast).to_have_class(re.compile(r"\bwarning\b"))  # a warning, not an error
            # What a person sees: no error placeholder over the chat, the message box or the panel; all as before.
            for element in ("#chatbot", "#chat-input", "#stats"):
                expect(page.locator(f"{element} [data-testid='status-tracker'] .error")).to_have_count(0)
            expect(page.locator("#chatbot")).to_contain_text("Name two planets")
            expect(bot).to_have_text(reply)
            expect(stats).to_contain_text("Finished by")
            expect(box).to_have_value("   ")
            page.wait_for_timeout(500)  # the toast has faded in
            page.screenshot(path=str(artifacts_dir / "empty-message-warning.png"), full_page=True)

            box.fill("Thanks!")  # and the next message works
            page.locator("#send").click()
            expect(page.locator("#chatbot")).to_contain_text("Thanks!", timeout=60_000)
            expect(stats).to_contain_text("Finished by", timeout=120_000)

            page.locator("#clear").click()  # Regenerate with nothing to regenerate: a warning as well
            expect(page.locator("#chatbot")).not_to_contain_text("Thanks!")
            page.locator("#regenerate").click()
            toast = page.locator(".toast-body").filter(has_text="There is no message to regenerate yet")
            expect(toast).to_be_visible(timeout=20_000)
            expect(toast).to_have_class(re.compile(r"\bwarning\b"))
            expect(page.locator("#chatbot [data-testid='status-tracker'] .error")).to_have_count(0)
        finally:
            browser.close()


def test_compare_bars_start_at_zero_and_carry_full_escaped_labels() -> None:
    from ui.compare import summary_bars

    long_label = "/models/meta-llama/Llama-3.1-8B-Instruct-with-a-long-folder-name · int8 · eager"
    rows = [{"configuration": long_label, "decode_tokens_per_s": 28.0, "ttft_ms": 50.0, "peak_memory_mib": 900.0},
            {"configuration": "embedded · <b>none</b> · sdpa", "decode_tokens_per_s": 20.0, "ttft_ms": None,
             "peak_memory_mib": 300.0}]
    page = summary_bars(rows)
    speed = page.split('data-metric="decode_tokens_per_s"')[1].split('data-metric="ttft_ms"')[0]
    widths = [float(w) for w in re.findall(r'class="bar" data-value="[^"]*" style="width:([\d.]+)%', speed)]
    assert widths == [100.0, pytest.approx(100 * 20 / 28, abs=0.01)]  # 28 vs 20 drawn as 28 vs 20: from zero
    assert long_label in page.replace("&#x27;", "'")
    assert "<b>none</b>" not in page and "&lt;b&gt;none&lt;/b&gt;" in page  # labels are text, never markup
    assert ">n/a</div>" in page  # a missing number is said, not drawn as zero


def test_session_stats_plot_one_series_per_configuration_with_whole_reply_numbers() -> None:
    from ui.stats import history_frame, history_plot

    base = {"model": "SmolLM2-135M-Instruct (embedded)", "attention": "sdpa", "kv_cache": "bf16",
            "decode_tokens_per_s": 10.0, "peak_rss_bytes": 2**30}
    remote = {"model": "SmolLM2-135M-Instruct", "quantization": "remote", "attention": "", "decode_path": "remote"}
    assert history_frame([remote])["configuration"][0] == "SmolLM2-135M-Instruct · remote"  # as Compare labels it
    rows = [{**base, "quantization": "nf4", "double_quant": True}, {**base, "quantization": "none"},
            {**base, "quantization": "nf4", "double_quant": False},
            {**base, "quantization": "nf4", "double_quant": True}]
    frame = history_frame(rows)
    assert list(frame["reply"]) == ["1", "2", "3", "4"]
    assert list(frame["configuration"]) == ["embedded · nf4 · sdpa", "embedded · none · sdpa",
                                            "embedded · nf4-nodq · sdpa", "embedded · nf4 · sdpa"]
    plot = history_plot(frame, "decode_tokens_per_s")
    assert plot.sort == ["1", "2", "3", "4"]
    assert plot.value["datatypes"]["reply"] == "nominal"  # whole numbers as categories, never 1.5 on the axis


def test_session_stats_plots_leave_headroom_above_their_highest_point() -> None:
    from ui.stats import PLOT_HEADROOM, history_frame, history_plot

    rows = [{"model": "m", "decode_tokens_per_s": speed, "peak_rss_bytes": 300 * 2**20} for speed in (12.0, 40.0)]
    frame = history_frame(rows)
    assert history_plot(frame, "decode_tokens_per_s").y_lim == [0, pytest.approx(40.0 * PLOT_HEADROOM)]
    assert history_plot(frame, "peak_memory_mib").y_lim == [0, pytest.approx(300.0 * PLOT_HEADROOM)]
    assert PLOT_HEADROOM > 1


def test_one_peak_memory_number_in_the_panel_the_compare_summary_and_session_stats() -> None:
    """A reply measured at a 1,551.8 MiB process peak while other loaded engines held 808.8 MiB: every view shows
    its own 743.0 MiB, and only the panel says (once) what the other engines held."""
    from llm_core.engine.compare import CompareConfig, SideResult
    from llm_core.metrics import ReplyStats
    from ui.compare import summary_frame
    from ui.stats import format_stats, history_frame

    stats = ReplyStats(model="SmolLM2-135M-Instruct (embedded)", quantization="nf4", double_quant=True,
                       attention="sdpa", decode_path="plain", peak_rss_bytes=int(1551.8 * 2**20),
                       others_resident_bytes=int(808.8 * 2**20), new_tokens=8, predicted_peak_bytes=400 * 2**20)
    panel = format_stats(stats)
    assert re.findall(r"[\d,.]+ MiB", panel.split("Peak RSS (CPU) |")[1].split("|")[0])[0] == "743.0 MiB"
    assert panel.count("held by the other loaded engines") == 1 and "1.52 GiB" not in panel
    summary = summary_frame([SideResult(CompareConfig(None, "nf4"), "text", stats, None).summary_row()])
    assert list(summary["peak_memory_mib"]) == [743.0]
    assert list(history_frame([stats.as_dict()])["peak_memory_mib"]) == [743.0]


def test_labels_say_what_ran_the_same_in_compare_and_session_stats() -> None:
    from llm_core.engine.compare import CompareConfig, SideResult
    from llm_core.metrics import ReplyStats
    from ui.stats import history_frame

    cpu = ReplyStats(model="SmolLM2-135M-Instruct (embedded)", quantization="int4", quantization_requested="nf4",
                     attention="sdpa", decode_path="cpu")
    label = "embedded · nf4 -> int4 on CPU · sdpa"
    assert SideResult(CompareConfig(None, "nf4"), "", cpu, None).summary_row()["configuration"] == label
    assert list(history_frame([cpu.as_dict()])["configuration"]) == [label]
    int8 = ReplyStats(model="m", quantization="int8", quantization_requested="int8", attention="sdpa",
                      decode_path="cpu")
    assert list(history_frame([int8.as_dict()])["configuration"]) == ["m · int8 · sdpa"]  # ran as asked: no arrow


def test_compare_refuses_an_empty_prompt_before_loading_anything() -> None:
    from llm_core.engine.compare import CompareConfig, Comparison
    from llm_core.errors import InputError

    settings = settings_from({})
    pool = EnginePool(settings)  # nothing loaded yet
    run = Comparison(pool, settings).run([CompareConfig(None, "nf4"), CompareConfig(None, "none")], "   ",
                                         settings.generation)
    with pytest.raises(InputError, match="empty"):
        next(run)
    assert pool.resident() == []  # refused at once: no model was loaded to find out
