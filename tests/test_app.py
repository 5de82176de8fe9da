"""The Gradio app end to end: the named API endpoint through gradio_client, and the page in headless Chromium."""

from __future__ import annotations

import contextlib
import re
import shutil
import socket
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from app import launch
from llm_core.config import Settings
from llm_core.engine.chat import ChatEngine
from ui import build_demo
from ui.common import EMBEDDED_CHOICE as EMBEDDED
from ui.common import UpdatePacer
from ui.compare import NO_SIDE

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic"]
SYSTEM = "You are a helpful assistant."


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def app_url(nf4_engine: ChatEngine) -> Iterator[str]:
    demo = build_demo(nf4_engine, nf4_engine.settings)
    port = free_port()
    launch(demo, nf4_engine.settings.replace(server={"port": port}), prevent_thread_lock=True, quiet=True)
    try:
        yield f"http://127.0.0.1:{port}/"
    finally:
        demo.close()


@pytest.fixture(scope="module")
def client(app_url: str) -> Any:
    from gradio_client import Client

    return Client(app_url, verbose=False)


def chat(client: Any, message: Any, history: Any = (), max_new_tokens: Any = 16, history_turns: Any = 8) -> list[Any]:
    """All streamed outputs of one /chat call (a failed streaming job yields nothing: callers assert on it)."""
    job = client.submit(message, list(history), SYSTEM, max_new_tokens, history_turns, False, 0.7, 0.95, 50, 1.05,
                        "bf16", api_name="/chat")
    return list(job)


def text(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content)


def test_chat_endpoint_streams_a_reply_with_its_numbers(client: Any) -> None:
    outputs = chat(client, "What is the capital of France?")
    assert len(outputs) >= 2  # streamed, not one final blob
    _, history, stats_md, stats = outputs[-1]
    assert [m["role"] for m in history] == ["user", "assistant"]
    assert text(history[1]["content"]).strip()
    assert stats["new_tokens"] > 0 and stats["ttft_s"] > 0 and stats["decode_tokens_per_s"] > 0
    assert stats["peak_rss_bytes"] > 0 and stats["kv_cache_bytes"] > 0
    assert "TTFT" in stats_md and "tokens/s" in stats_md


def test_history_from_the_api_is_used_and_kept(client: Any) -> None:
    first = chat(client, "My name is Ada.")[-1][1]
    second = chat(client, "What is my name?", history=first)[-1][1]
    assert len(second) == 4 and text(second[0]["content"]) == "My name is Ada."


@pytest.mark.parametrize(
    ("message", "history", "max_new_tokens", "history_turns", "says"),
    [("", [], 16, 8, "The message is empty."),  # llm_core
     ("   \n", [], 16, 8, "The message is empty."),  # llm_core
     ("hi", [], 10**6, 8, "Value 1000000 is greater than maximum value 4096."),  # Gradio's slider check
     ("hi", [], 0, 8, "Value 0 is less than minimum value 1."),  # Gradio's slider check
     ("hi", [], 16, -3, "Value -3 is less than minimum value 0."),  # Gradio's slider check
     ("hi", [{"role": "alien", "content": "x"}], 16, 8, "History message 1 has role 'alien'"),  # llm_core
     ("hi", [{"nonsense": True}], 16, 8, "History message 1 is malformed"),  # llm_core
     ("1 " * 7999, [], 16, 8, "Your message needs")],  # llm_core: more tokens than fit the context
)
def test_bad_input_through_the_api_gets_an_error_and_the_server_keeps_serving(
        client: Any, message: str, history: Any, max_new_tokens: int, history_turns: int, says: str) -> None:
    from gradio_client.exceptions import AppError

    with pytest.raises(AppError, match=re.escape(says)):
        client.predict(message, history, SYSTEM, max_new_tokens, history_turns, False, 0.7, 0.95, 50, 1.05,
                       "bf16", api_name="/chat")
    assert chat(client, "Still there?", max_new_tokens=4)[-1][3]["new_tokens"] > 0


def test_unicode_and_emoji_round_trip(client: Any) -> None:
    history = chat(client, "Répète: 你好 👋🏽", max_new_tokens=8)[-1][1]
    assert text(history[0]["content"]) == "Répète: 你好 👋🏽"


def test_regenerate_replaces_the_last_reply(client: Any) -> None:
    history = chat(client, "Say one word.", max_new_tokens=4)[-1][1]
    job = client.submit(history, SYSTEM, 4, 8, False, 0.7, 0.95, 50, 1.05, "bf16", api_name="/regenerate")
    regenerated = list(job)[-1][0]
    assert len(regenerated) == 2 and text(regenerated[0]["content"]) == "Say one word."


def test_update_pacer_sends_the_first_and_last_at_once_and_the_rest_at_most_one_per_interval() -> None:
    now = [0]
    pacer = UpdatePacer(5, clock=lambda: now[0])  # whole clock ticks: no float rounding at the interval's edge
    sent = []
    for step in range(20):  # a token every tick, the last one the reply's end
        now[0] = step
        sent.append(pacer.due(last=step == 19))
    assert [i for i, due in enumerate(sent) if due] == [0, 5, 10, 15, 19]
    held = UpdatePacer(5, clock=lambda: now[0])  # how long the reply's thread may sleep before its next read
    assert held.remaining() == 0 and held.due()  # nothing sent yet: no hold; the first goes out (at 19)
    now[0] = 22
    assert held.remaining() == 2 and not held.due() and held.due(last=True)  # the last goes out whatever the hold
    now[0] = 30
    assert held.remaining() == 0
    every = UpdatePacer(0.0, clock=lambda: 1.0)  # UI_UPDATE_INTERVAL_S=0: every update, even at the same instant
    assert all(every.due() for _ in range(5))


def test_update_pacer_spreads_a_cap_on_all_updates_over_the_replies_streaming() -> None:
    """UI_MAX_UPDATES_PER_S: 20 replies under a cap of 2 per tick each update every 10 ticks, not every 5; one reply
    keeps the interval; the count is every loaded engine's `generating` (an engine without one counts none)."""
    now, streaming = [0], [20]
    pacer = UpdatePacer(5, streams=lambda: streaming[0], max_updates_per_s=2, clock=lambda: now[0])
    sent = []
    for step in range(30):
        now[0] = step
        sent.append(pacer.due(last=step == 29))
    assert [i for i, due in enumerate(sent) if due] == [0, 10, 20, 29]
    streaming[0] = 1
    assert pacer.interval() == 5 and UpdatePacer(5, streams=lambda: 99).interval() == 5  # no cap: 0

    engines = [SimpleNamespace(generating=3), SimpleNamespace(generating=1), SimpleNamespace()]
    settings = Settings().replace(server={"ui_update_interval_s": 0.05, "ui_max_updates_per_s": 40})
    page = SimpleNamespace(settings=settings, pool=SimpleNamespace(engines=lambda: engines))
    assert UpdatePacer.for_page(page).interval() == pytest.approx(4 / 40)  # type: ignore[arg-type]
    engines[0].generating = 0
    assert UpdatePacer.for_page(page).interval() == 0.05  # type: ignore[arg-type]


@contextlib.contextmanager
def paced_client(engine: ChatEngine, interval_s: float) -> Iterator[Any]:
    from gradio_client import Client

    settings = engine.settings.replace(server={"ui_update_interval_s": interval_s})
    demo = build_demo(engine, settings)
    port = free_port()
    launch(demo, settings.replace(server={"port": port}), prevent_thread_lock=True, quiet=True)
    try:
        yield Client(f"http://127.0.0.1:{port}/", verbose=False)
    finally:
        demo.close()


def test_streamed_updates_are_paced_by_the_setting_and_the_reply_is_whole(nf4_engine: ChatEngine,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """UI_UPDATE_INTERVAL_S=0 sends every update the engine yields; a 1 s interval sends the first token's and the
    end's at once and at most one a second between them, and the reply's thread reads the engine about as often
    (hold: it sleeps between updates instead of waking for each token). The reply and its numbers are the same."""
    yielded = [0]
    stream_chat = nf4_engine.stream_chat

    def counted(*args: Any, **kwargs: Any) -> Iterator[Any]:
        for update in stream_chat(*args, **kwargs):
            yielded[0] += 1
            yield update

    monkeypatch.setattr(nf4_engine, "stream_chat", counted)
    with paced_client(nf4_engine, 0.0) as every, paced_client(nf4_engine, 1.0) as paced:
        each = chat(every, "Count from one to twenty in words.", max_new_tokens=24)
        each_yielded, yielded[0] = yielded[0], 0
        few = chat(paced, "Count from one to twenty in words.", max_new_tokens=24)
        few_yielded = yielded[0]
    assert each and few, "a streaming job failed (it yields nothing)"
    assert each[-1][1] == few[-1][1] and text(few[-1][1][1]["content"]).strip()
    assert each[-1][3]["new_tokens"] == few[-1][3]["new_tokens"] == 24
    assert len(each) == each_yielded  # interval 0: one page update per engine update
    decode_s = (few[-1][3]["new_tokens"] - 1) / few[-1][3]["decode_tokens_per_s"]
    assert 2 <= len(few) <= min(few_yielded, 3 + decode_s), (len(few), few_yielded, decode_s)
    assert few_yielded <= 3 + decode_s < 24, (few_yielded, decode_s)  # not one engine update per token


def test_a_reply_failing_mid_stream_keeps_every_token_read_even_those_not_yet_sent(
        nf4_engine: ChatEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    """With updates held back, a reply that fails after several tokens ends with the text of the last update the
    engine gave, not the last one sent, and the error note after it."""
    import gradio as gr

    from llm_core.errors import GenerationError
    from llm_core.history import ERROR_TITLE
    from ui.chat import ChatHandlers
    from ui.common import PageContext

    stream_chat = nf4_engine.stream_chat
    read: list[str] = []

    def failing(*args: Any, **kwargs: Any) -> Iterator[Any]:
        for update in stream_chat(*args, **kwargs):
            if len(read) == 6:
                raise GenerationError("The reply broke off (test).")
            read.append(update.text)
            yield update

    monkeypatch.setattr(nf4_engine, "stream_chat", failing)
    # a clock that never moves: after the first token's update, nothing is due until the reply's end or failure
    monkeypatch.setattr(UpdatePacer, "for_page", classmethod(lambda cls, ctx: cls(1.0, clock=lambda: 0.0)))
    monkeypatch.setattr(UpdatePacer, "remaining", lambda self: 0.0)  # every token read: six reads before the end
    handlers = ChatHandlers(PageContext.create(nf4_engine, nf4_engine.settings, None))
    request = SimpleNamespace(session_hash="held", client=SimpleNamespace(host="10.9.9.9"), username=None)
    shown = []
    with pytest.raises(gr.Error, match="broke off"):
        for out in handlers.respond("Count from one to twenty in words.", [], SYSTEM, 24, 8, False, 0.7, 0.95, 50,
                                    1.05, "bf16", "", [], request):  # type: ignore[arg-type]
            shown.append(out[1])
    assert len(read) == 6 and len(shown) == 2  # the first token's update, then the failure's
    *_, reply, note = shown[-1]
    assert reply == {"role": "assistant", "content": read[-1]} and read[-1] != read[0]
    assert note["metadata"]["title"] == ERROR_TITLE and "broke off" in note["content"]


@pytest.mark.browser
@pytest.mark.skipif(not Path(CHROMIUM).exists() or shutil.which("chromium") is None,
                    reason="Debian chromium not installed (make test installs it)")
def test_browser_sends_a_message_and_sees_the_reply_and_its_numbers(app_url: str, artifacts_dir: Path) -> None:
    from playwright.sync_api import expect, sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(app_url)
            box = page.locator("#chat-input textarea")
            box.fill("Hello! Name two planets.")
            page.locator("#send").click()
            bot = page.locator("#chatbot .message.bot, #chatbot [data-testid='bot']").last
            expect(bot).not_to_be_empty(timeout=60_000)
            stats = page.locator("#stats")
            expect(stats).to_contain_text("Finished by", timeout=120_000)
            for label in ("TTFT", "tokens/s", "Peak RSS", "KV cache"):
                expect(stats).to_contain_text(label)
            expect(box).to_have_value("")
            page.screenshot(path=str(artifacts_dir / "chat-reply.png"), full_page=True)

            box.fill("   ")  # bad input: a clear message, the conversation stays
            page.locator("#send").click()
            expect(page.get_by_text("The message is empty")).to_be_visible(timeout=20_000)
            expect(page.locator("#chatbot")).to_contain_text("Name two planets")
        finally:
            browser.close()


@pytest.mark.browser
@pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="Debian chromium not installed (make test installs it)")
def test_browser_what_the_user_types_while_a_reply_streams_stays(app_url: str) -> None:
    """The streamed updates leave the message box alone: the next message typed during a reply is still there when
    the reply ends (the first update clears the box once)."""
    from playwright.sync_api import expect

    with opened_page(app_url) as page:
        box = page.locator("#chat-input textarea")
        box.fill("Tell me a long story about a lighthouse keeper.")
        page.locator("#send").click()
        stats = page.locator("#stats")
        expect(stats).to_contain_text("tokens/s", timeout=60_000)  # streaming: the live numbers are shown
        expect(box).to_have_value("", timeout=20_000)
        streaming = "Finished by" not in stats.inner_text()
        box.fill("And then what happened?")
        expect(stats).to_contain_text("Finished by", timeout=120_000)
        page.wait_for_timeout(300)
        assert streaming, "the reply ended before the next message was typed: nothing was checked"
        expect(box).to_have_value("And then what happened?")


def test_compare_endpoint_answers_with_both_sides_and_a_summary(client: Any) -> None:
    sides = [EMBEDDED, "nf4", "sdpa", "bf16", EMBEDDED, "none", "sdpa", "bf16", EMBEDDED, NO_SIDE, "sdpa",
             "bf16"]
    outputs = list(client.submit("Name a color.", *sides, SYSTEM, 8, 8, False, 0.7, 0.95, 50, 1.05, "bf16",
                                 api_name="/compare"))
    final = outputs[-1]
    texts, diff, stats = final[0:3], final[8], final[9]
    assert texts[0] and texts[1] and not texts[2]
    assert [s["quantization"] for s in stats] == ["nf4", "none"]
    assert diff.startswith(("Outputs first differ", "All 2 outputs are identical"))


@pytest.mark.browser
@pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="Debian chromium not installed (make test installs it)")
def test_browser_compare_view_and_session_stats_export(app_url: str, artifacts_dir: Path) -> None:
    from playwright.sync_api import expect, sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1100})
            page.goto(app_url)
            page.get_by_role("tab", name="Compare").click()
            page.locator("#compare-input textarea").fill("Name a planet.")
            page.locator("#compare-run").click()
            expect(page.locator("#compare-diff")).to_contain_text("Outputs", timeout=180_000)
            for i in (0, 1):
                expect(page.locator(f"#compare-stats-{i}")).to_contain_text("tokens/s")
            expect(page.locator("#compare-summary")).to_contain_text("embedded · none · sdpa")
            bars = page.locator("#compare-plot [data-metric='decode_tokens_per_s'] .bar-row")
            expect(bars.locator(".bar-label")).to_have_text(["embedded · nf4 · sdpa", "embedded · none · sdpa"])
            values = [float(v) for v in bars.locator(".bar").evaluate_all("bars => bars.map(b => b.dataset.value)")]
            widths = bars.locator(".bar").evaluate_all("bars => bars.map(b => b.getBoundingClientRect().width)")
            assert widths[0] / widths[1] == pytest.approx(values[0] / values[1], rel=0.02)  # bars drawn from zero
            page.screenshot(path=str(artifacts_dir / "compare.png"), full_page=True)

            page.get_by_role("tab", name="Session stats").click()
            expect(page.locator("#history-table")).to_contain_text("none", timeout=20_000)
            page.locator("#export-csv").click()
            expect(page.locator("#export-file")).to_contain_text(re.compile(r"reply-stats\s*\.csv"), timeout=20_000)
            speed = page.locator("#history-speed")
            expect(speed).to_contain_text("embedded · none · sdpa", timeout=20_000)  # one series per configuration
            expect(speed).to_contain_text("embedded · nf4 · sdpa")
            x_axis = speed.locator("svg [aria-label^='X-axis']").get_attribute("aria-label") or ""
            assert "discrete scale with 2 values: 1, 2" in x_axis  # whole reply numbers, not 1.2, 1.4, ...
            page.screenshot(path=str(artifacts_dir / "session-stats.png"), full_page=True)
        finally:
            browser.close()


@contextlib.contextmanager
def opened_page(url: str, height: int = 1000) -> Iterator[Any]:
    """The app's page in headless Debian Chromium."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": height})
            page.goto(url)
            yield page
        finally:
            browser.close()


@pytest.mark.browser
@pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="Debian chromium not installed (make test installs it)")
def test_browser_fit_tab_refuses_bad_inputs_with_a_warning(app_url: str, artifacts_dir: Path) -> None:
    from playwright.sync_api import expect

    with opened_page(app_url) as page:
        page.get_by_role("tab", name="Will it fit?").click()
        answer = page.locator("#fit-answer")
        new_tokens = page.locator("#fit-new input")
        card = page.locator("#fit-card input")

        def refused(says: str) -> None:
            page.locator("#fit-run").click()
            toast = page.locator(".toast-body").filter(has_text=says)
            expect(toast).to_be_visible(timeout=20_000)
            expect(toast).to_have_class(re.compile(r"\bwarning\b"))  # a warning, not an error placeholder
            expect(answer.locator("[data-testid='status-tracker'] .error")).to_have_count(0)
            toast.locator("..").locator(".toast-close").first.click()

        # The tab mounts its inputs on first view: one filled before that is reset to its default (CI saw the run go
        # out with 256), so wait for the rendered default, then for the filled value.
        expect(new_tokens).to_have_value("256", timeout=20_000)
        new_tokens.fill("-5")
        expect(new_tokens).to_have_value("-5")
        refused("Max new tokens must be from 1")
        new_tokens.fill("256")
        card.fill("abc")
        card.press("Enter")
        expect(card).to_have_value("abc")
        refused("Card size 'abc' is not a size")
        expect(answer).not_to_contain_text("could not convert")
        card.fill("8")
        card.press("Enter")
        page.locator("#fit-run").click()
        expect(answer).to_contain_text("Longest prompt", timeout=20_000)
        page.screenshot(path=str(artifacts_dir / "fit-tab.png"), full_page=True)


@pytest.mark.browser
@pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="Debian chromium not installed (make test installs it)")
def test_browser_model_panel_labels_never_break_mid_word(app_url: str, artifacts_dir: Path) -> None:
    """The Model panel's label column stays on one line ("Source", never "Sourc" over "e")."""
    from playwright.sync_api import expect

    with opened_page(app_url, height=1100) as page:
        page.locator("#model-panel button").first.click()  # open the Model accordion
        label = page.locator("#model-info td").filter(has_text=re.compile(r"^Source$")).first
        expect(label).to_be_visible(timeout=20_000)
        assert label.evaluate("td => getComputedStyle(td).whiteSpace") == "nowrap"
        lines = label.evaluate("td => { const r = document.createRange(); r.selectNodeContents(td); "
                               "return new Set([...r.getClientRects()].map(b => Math.round(b.top))).size; }")
        assert lines == 1
        page.screenshot(path=str(artifacts_dir / "model-labels.png"), full_page=True)


def _numbers(text: str) -> list[float]:
    return [float(n.replace(",", "")) for n in re.findall(r"\d[\d,]*\.?\d*", text)]


def _cell_numbers(row: Any) -> list[float]:
    """The numbers of a table row, one per cell (a row's text runs its cells together). A Gradio Dataframe's rows are
    its `[role=row]` elements: its `tr` is a hidden sizing row that mixes the longest cell of each column."""
    cells = row.evaluate("tr => [...tr.children].map(c => c.textContent.trim())")
    return [float(c.replace(",", "")) for c in cells if re.fullmatch(r"\d[\d,]*\.?\d*", c)]


def _lines_of(element: Any) -> int:
    """How many lines an element's text takes on screen."""
    return int(element.evaluate("e => { const r = document.createRange(); r.selectNodeContents(e); "
                                "return new Set([...r.getClientRects()].map(b => Math.round(b.top))).size; }"))


def _shows(page: Any, row: Any, value: float, timeout_s: float = 20.0) -> bool:
    """Whether a table row shows `value` in one of its cells, once the table has rendered (read again until then)."""
    for _ in range(int(timeout_s * 4)):
        if row.count() and any(abs(n - value) < 0.05 for n in _cell_numbers(row)):
            return True
        page.wait_for_timeout(250)
    return False


@pytest.mark.browser
@pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="Debian chromium not installed (make test installs it)")
def test_browser_one_peak_number_per_reply_in_panel_summary_and_session_stats(app_url: str,
                                                                             artifacts_dir: Path) -> None:
    """After a comparison with both engines loaded: the none side's peak memory is one number in its panel, the
    summary and Session stats, and the other engines' share is said once, in the panel."""
    from playwright.sync_api import expect

    with opened_page(app_url, height=1100) as page:
        page.get_by_role("tab", name="Compare").click()
        page.locator("#compare-input textarea").fill("Name a planet.")
        page.locator("#compare-run").click()
        expect(page.locator("#compare-diff")).to_contain_text("Outputs", timeout=180_000)
        panel = page.locator("#compare-stats-1")
        expect(panel).to_contain_text("Finished by")
        expect(panel).to_contain_text("held by the other loaded engines")  # nf4 is loaded beside it
        row = panel.locator("tr").filter(has_text="Peak RSS").inner_text()
        peak_mib = _numbers(row.split("MiB")[0])[-1]
        assert panel.inner_text().count("held by the other loaded engines") == 1
        summary = page.locator("#compare-summary [role=row]").filter(has_text="embedded · none · sdpa").last
        assert _shows(page, summary, peak_mib), (row, _cell_numbers(summary))
        header = page.locator("#compare-summary th .header").filter(has_text="decode_tokens_per_s").first
        assert _lines_of(header) == 1  # a column name stays whole, never "decode_tok" over "ens_per_s"
        bar = page.locator("#compare-plot [data-metric='peak_memory_mib'] .bar-row").filter(
            has_text="embedded · none · sdpa")
        assert float(bar.locator(".bar").get_attribute("data-value") or "nan") == pytest.approx(peak_mib, abs=0.05)

        page.get_by_role("tab", name="Session stats").click()
        history = page.locator("#history-table [role=row]").filter(has_text="embedded · none · sdpa").last
        assert _shows(page, history, peak_mib), (row, _cell_numbers(history))
        page.screenshot(path=str(artifacts_dir / "one-peak.png"), full_page=True)
