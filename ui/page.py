"""The whole page: the tabs laid out (ui.chat, ui.compare, ui.fit, ui.stats) and their events wired together."""

from __future__ import annotations

from typing import Any

import gradio as gr

from llm_core.config import Settings
from llm_core.engine.backend import ChatBackend
from llm_core.engine.compare import EnginePool

from .chat import ChatHandlers, ChatTab, build_chat_tab
from .common import WORKER_THREADS, PageContext, header
from .compare import CompareHandler, CompareTab, build_compare_tab
from .errors import in_page
from .fit import build_fit_tab
from .model import current_model
from .stats import StatsTab, build_stats_tab, show_history

# Compare events handled at once (at most one runs): taken from the worker threads chat leaves free for Stop.
COMPARE_WIDTH = 4
# Gradio's tables break words anywhere to fit, which split narrow labels mid-word ("Sourc e", "decode_tok ens"):
# the key-value tables' labels and the data tables' column names stay whole; values wrap.
PAGE_CSS = ("#model-info td:first-child, #stats td:first-child, [id^=compare-stats-] td:first-child, "
            "#fit-answer td:first-child, #compare-summary th, #compare-summary th *, #history-table th, "
            "#history-table th * { white-space: nowrap; overflow-wrap: normal; word-break: normal; }")


def build_demo(engine: ChatBackend, settings: Settings, pool: EnginePool | None = None) -> gr.Blocks:
    """The whole UI: Chat, Compare, Will it fit? and Session stats tabs. Conversation state lives in each browser
    session. Handlers reach the served model through the pool, so a comparison may unload it if it must."""
    ctx = PageContext.create(engine, settings, pool)
    report = engine.report
    del engine
    ttl_s = int(settings.server.export_ttl_s)
    # Gradio keeps its own copy of each served file: delete_cache drops those after the same time.
    with gr.Blocks(title="Local LLM demo", fill_height=True, delete_cache=(min(ttl_s, 600), ttl_s)) as demo:
        gr.HTML(f"<style>{PAGE_CSS}</style>", elem_id="page-css", container=False, padding=False)
        page_header = gr.Markdown(header(report), elem_id="header")
        stats_history = gr.State([])
        chat = build_chat_tab(ctx, report, page_header)
        compare = build_compare_tab(ctx)
        build_fit_tab(settings)
        stats = build_stats_tab(ctx, stats_history)
        _wire(ctx, chat, compare, stats, stats_history)

        def on_load() -> tuple[Any, ...]:
            return current_model(ctx)

        demo.load(on_load, None, [page_header, chat.model.info, chat.model.choice, chat.model.mode],
                  api_visibility="private")
        demo.unload(ChatHandlers(ctx).end_session)
    demo.queue(default_concurrency_limit=ctx.concurrency, max_size=settings.server.queue_size)
    return demo


def _wire(ctx: PageContext, chat: ChatTab, compare: CompareTab, stats: StatsTab, stats_history: Any) -> None:
    """The chat and compare events. One queue for every chat reply (concurrency_id). Chat events reach the engine
    beyond its reply slots: the engine admits at most one running and SESSION_MAX_WAITING waiting requests per
    session (refusing more at once) and gives a free slot to the session served least recently. Gradio's FIFO
    queue, with its position display, holds what exceeds this width, kept below Gradio's worker threads so Stop
    always finds one. The page's events warn about bad input (in_page); the named API endpoints sit on triggers no
    one sees and fail the call, as API callers expect. (Their own api_names: a private event named after its
    function would take the public endpoint's name.)"""
    handlers = ChatHandlers(ctx)
    chat_inputs = [chat.chat_input, chat.chatbot, *chat.options.components, chat.json_schema, stats_history]
    chat_outputs = [chat.chat_input, chat.chatbot, chat.stats_md, chat.stats_json, stats_history]
    chat_width = min(WORKER_THREADS - 8, ctx.concurrency + ctx.settings.server.queue_size)
    in_chat: dict[str, Any] = {"concurrency_id": "chat", "concurrency_limit": chat_width}
    page_respond = in_page(handlers.respond, len(chat_outputs))
    replies = [
        chat.send.click(page_respond, chat_inputs, chat_outputs, api_name="chat_in_page", api_visibility="private",
                        **in_chat),
        chat.chat_input.submit(page_respond, chat_inputs, chat_outputs, api_name="chat_in_page",
                               api_visibility="private", **in_chat),
        chat.api_chat.click(handlers.respond, chat_inputs, chat_outputs, api_name="chat", **in_chat),
    ]
    regen_inputs = [chat.chatbot, *chat.options.components, chat.json_schema, stats_history]
    replies += [
        chat.regenerate.click(in_page(handlers.regenerate, len(chat_outputs) - 1), regen_inputs, chat_outputs[1:],
                              api_name="regenerate_in_page", api_visibility="private", **in_chat),
        chat.api_regenerate.click(handlers.regenerate, regen_inputs, chat_outputs[1:], api_name="regenerate",
                                  **in_chat),
    ]
    compare_inputs = [compare.prompt, *compare.side_inputs, *chat.options.components, stats_history]
    compare_outputs = [*compare.outputs, stats_history]
    run = CompareHandler(ctx).compare
    # One comparison runs at a time (Comparison's fair turns, page and API together); the width lets several reach
    # those turns, where a person with one comparison in has the next refused at once instead of queued in FIFO.
    in_compare: dict[str, Any] = {"concurrency_id": "compare", "concurrency_limit": COMPARE_WIDTH}
    comparisons = [
        compare.run.click(in_page(run, len(compare_outputs)), compare_inputs, compare_outputs,
                          api_name="compare_in_page", api_visibility="private", **in_compare),
        chat.api_compare.click(run, compare_inputs, compare_outputs, api_name="compare", **in_compare),
    ]
    for event in (*replies, *comparisons):
        event.then(show_history, stats_history, stats.outputs, api_visibility="private")
    chat.stop.click(handlers.stop, None, None, cancels=[*replies, *comparisons], queue=False, api_name="stop")
    chat.clear.click(handlers.clear, None, [chat.chatbot, chat.stats_md, chat.stats_json], cancels=replies,
                     queue=False, api_name="clear")
