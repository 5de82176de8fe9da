"""The Chat tab: the /chat and /regenerate endpoints (streamed replies with their numbers), Stop and Clear."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import gradio as gr
from gradio.components.chatbot import ChatbotDataMessages
from gradio.data_classes import GradioRootModel
from pydantic import ValidationError

from llm_core.config import ChatSettings
from llm_core.constraints import schema_control
from llm_core.errors import InputError, LLMCoreError
from llm_core.history import ERROR_TITLE, check_history_size, clean_chat_input, content_to_text, turns_from_messages
from llm_core.metrics import ReplyStats
from llm_core.security import person_of

from .common import (
    PROGRESS,
    ChatHistory,
    Options,
    PageContext,
    UpdatePacer,
    add_rows,
    gen_options,
    session,
    stats_json,
    whole,
)
from .errors import user_error
from .model import ModelPanel, build_model_panel
from .stats import format_stats


class _AnyHistory(GradioRootModel):
    root: Any = None


def history_checked_by_llm_core(chatbot: gr.Chatbot, chat: ChatSettings) -> gr.Chatbot:
    """Make `chatbot`'s input from the API go through llm_core's checks before Gradio's schema: a malformed history
    gets the library's sentence ("History message 1 is malformed: ...") instead of a pydantic validation dump.
    Done on the instance (Gradio reads `data_model` and calls `preprocess` on it); the API still documents
    Gradio's message schema."""
    schema = ChatbotDataMessages.model_json_schema()
    schema["additional_description"] = schema.pop("description", None)
    chatbot._api_info_cache = schema  # type: ignore[assignment]
    gradio_preprocess = chatbot.preprocess

    def preprocess(payload: Any) -> Any:
        raw = payload.root if isinstance(payload, _AnyHistory) else payload
        if raw is None:
            return []
        try:
            check_history_size(raw, max_messages=chat.max_history_messages, max_chars=chat.max_history_chars)
            turns_from_messages(raw)  # role, content and parts, named by the library
            raw = [{**m, "content": [{"type": "text", "text": m["content"]}]} if isinstance(m.get("content"), str)
                   else m for m in raw]
            checked = ChatbotDataMessages.model_validate(raw, context={"validate_meta": True})
        except LLMCoreError as exc:
            raise user_error(exc) from None
        except ValidationError as exc:
            where = ", ".join(".".join(str(p) for p in e.get("loc", ())) or "history" for e in exc.errors()[:3])
            raise gr.Error(f"The history is malformed (at {where}); send a list of messages with 'role' and "
                           "'content'.", title="Input error") from None
        return gradio_preprocess(checked)

    chatbot.data_model = _AnyHistory  # type: ignore[assignment]
    chatbot.preprocess = preprocess  # type: ignore[method-assign]
    return chatbot


class ChatHandlers:
    """The Chat tab's handlers. Their parameters are the public API's inputs, in the order Gradio passes them."""

    def __init__(self, ctx: PageContext) -> None:
        self.ctx = ctx

    def respond(self, message: str, history: ChatHistory, system_prompt: str, max_new_tokens: float,
                history_turns: float, do_sample: bool, temperature: float, top_p: float, top_k: float,
                repetition_penalty: float, kv_cache: str, json_schema: str, rows: list[dict[str, Any]],
                request: gr.Request, progress: gr.Progress = PROGRESS) -> Iterator[tuple[Any, ...]]:
        """The /chat API: stream a reply. Yields (textbox, chatbot history, stats markdown, stats JSON, session stats
        rows); the rows (a gr.State, never sent by the client) get the finished reply's stats. While the request
        waits for its turn in the engine, the progress overlay says how many go first. Bad input fails the call
        (gradio_client raises AppError with the message); the page's twin (in_page) shows a warning instead."""
        pool = self.ctx.pool

        def waiting(ahead: int) -> None:
            estimate = pool.primary().wait_estimate_s(ahead)
            eta = f" (about {estimate:.0f} s)" if estimate else ""
            progress(None, desc=f"Waiting for a free slot: {ahead} request{'s' if ahead != 1 else ''} ahead{eta}")

        try:
            # One cleaning and size check of every text input before anything is tokenized; what is echoed back is
            # the cleaned text (a lone surrogate sent back would break this client's stream).
            chat_input = clean_chat_input(message, history, system_prompt, self.ctx.settings.chat)
            chat_engine = pool.primary()
            pacer = UpdatePacer.for_page(self.ctx)
            gen = replace(gen_options(chat_engine, max_new_tokens, do_sample, temperature, top_p, top_k,
                                      repetition_penalty, kv_cache),
                          control=schema_control(json_schema, getattr(chat_engine, "loaded", None)))
            stream = chat_engine.stream_chat(chat_input.message, chat_input.turns, gen=gen,
                                             history_turns=whole(history_turns),
                                             system_prompt=chat_input.system_prompt, request_id=session(request),
                                             person=person_of(request, self.ctx.settings.server), on_wait=waiting,
                                             hold=pacer.remaining)
            first = next(stream)  # admission, trimming, the fair turn and the first token happen here
        except LLMCoreError as exc:
            raise user_error(exc) from None  # nothing was yielded: textbox and chat are untouched
        shown: ChatHistory = [*chat_input.history, {"role": "user", "content": chat_input.message},
                              {"role": "assistant", "content": first.text}]
        update = first
        try:
            # The raw stats JSON is {} while the reply streams and the reply's own at its end. An unchanged value
            # costs Gradio less than gr.skip(), which builds a new component for each update (~0.4 ms of CPU). The
            # textbox keeps gr.skip(): a value would wipe what the user is typing meanwhile.
            pacer.due()
            yield "", shown, format_stats(first.stats, live=True), {}, gr.skip()
            for update in stream:  # read once per interval (hold), every token in it; at most one sent (and the last)
                done = update.done
                if not pacer.due(last=done):
                    continue
                shown[-1] = {"role": "assistant", "content": update.text}
                stats = self._with_others_share(update.stats) if done else update.stats
                yield gr.skip(), shown, format_stats(stats, live=not done), (
                    stats_json(stats) if done else {}), (add_rows(rows, [stats]) if done else gr.skip())
        except LLMCoreError as exc:
            note = {"role": "assistant", "content": str(exc), "metadata": {"title": ERROR_TITLE}}
            reply = [{"role": "assistant", "content": update.text}] if update.text else []  # a held update's too
            shown = [*shown[:-1], *reply, note]
            stats = self._with_others_share(update.stats)
            yield gr.skip(), shown, format_stats(stats, live=False), stats_json(stats), add_rows(rows, [stats])
            raise user_error(exc) from None

    def _with_others_share(self, stats: ReplyStats) -> ReplyStats:
        """The reply's stats with the share of the process peak that other loaded engines (Compare's) held."""
        if stats.decode_path == "remote":
            return stats
        pool = self.ctx.pool
        return replace(stats, others_resident_bytes=pool.others_resident_bytes(pool.primary_config))

    def regenerate(self, history: ChatHistory, system_prompt: str, max_new_tokens: float, history_turns: float,
                   do_sample: bool, temperature: float, top_p: float, top_k: float, repetition_penalty: float,
                   kv_cache: str, json_schema: str, rows: list[dict[str, Any]], request: gr.Request,
                   progress: gr.Progress = PROGRESS) -> Iterator[tuple[Any, ...]]:
        """Answer the last user message again, replacing the reply(ies) after it."""
        values = (system_prompt, max_new_tokens, history_turns, do_sample, temperature, top_p, top_k,
                  repetition_penalty, kv_cache, json_schema, rows)
        messages = history if isinstance(history, list) else []
        last_user = next((i for i in range(len(messages) - 1, -1, -1)
                          if isinstance(messages[i], dict) and messages[i].get("role") == "user"), None)
        if last_user is None:
            raise user_error(InputError("There is no message to regenerate yet."))
        try:
            message = content_to_text(messages[last_user].get("content"))
        except LLMCoreError as exc:
            raise user_error(exc) from None
        for out in self.respond(message, messages[:last_user], *values, request, progress):
            yield out[1:]

    def stop(self, request: gr.Request) -> None:
        for engine in self.ctx.pool.engines():  # never waits for a model load in progress
            engine.stop(session(request))

    def clear(self, request: gr.Request) -> tuple[Any, ...]:
        self.stop(request)
        return [], format_stats(None), {}

    def end_session(self, request: gr.Request) -> None:
        self.stop(request)
        self.ctx.exports.release(session(request) or "")


@dataclass
class ChatTab:
    chatbot: Any
    chat_input: Any
    send: Any
    stop: Any
    regenerate: Any
    clear: Any
    api_chat: Any  # hidden triggers of the API endpoints (the page's own events warn instead of failing)
    api_regenerate: Any
    api_compare: Any
    stats_md: Any
    stats_json: Any
    options: Options
    model: ModelPanel
    json_schema: Any  # structured output: replies are JSON valid for this schema (blank: off)


def build_chat_tab(ctx: PageContext, report: Any, header: Any) -> ChatTab:
    """The Chat tab's layout: the conversation, its buttons, the stats panel, settings and the Model panel."""
    with gr.Tab("Chat", id="chat-tab"), gr.Row(equal_height=False):
        with gr.Column(scale=3):
            chatbot = history_checked_by_llm_core(
                gr.Chatbot(elem_id="chatbot", label="Chat", height=520, buttons=["copy"]), ctx.settings.chat)
            chat_input = gr.Textbox(elem_id="chat-input", show_label=False, lines=2, autofocus=True,
                                    placeholder="Type a message and press Enter (Shift+Enter: new line)")
            with gr.Row():
                send = gr.Button("Send", variant="primary", elem_id="send")
                stop_btn = gr.Button("Stop", variant="stop", elem_id="stop")
                regen = gr.Button("Regenerate", elem_id="regenerate")
                clear_btn = gr.Button("Clear", elem_id="clear")
                api_chat = gr.Button(visible=False, elem_id="api-chat")
                api_regen = gr.Button(visible=False, elem_id="api-regenerate")
                api_compare = gr.Button(visible=False, elem_id="api-compare")
        with gr.Column(scale=2):
            stats_md = gr.Markdown(format_stats(None), elem_id="stats")
            with gr.Accordion("Raw stats (JSON)", open=False):
                stats_json_view = gr.JSON(value={}, elem_id="stats-json", show_label=False)
            with gr.Accordion("Generation settings", open=True):
                options = Options(ctx.settings)
                json_schema = gr.Code("", language="json", label="JSON schema (structured output; blank = off)",
                                      elem_id="json-schema")
            model = build_model_panel(ctx, report, header)
    return ChatTab(chatbot, chat_input, send, stop_btn, regen, clear_btn, api_chat, api_regen, api_compare, stats_md,
                   stats_json_view, options, model, json_schema)
