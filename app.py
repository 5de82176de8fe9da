"""Gradio UI over llm_core: build_demo(engine, settings) -> gr.Blocks; main() parses flags, loads once, launches.

The UI never touches torch. llm_core errors become gr.Error here, in `_user_error` (bad input: a warning in the
page, `_in_page`), and OpenAI API errors in `_api_error` (for llm_core.web.openai_api, mounted at /v1); nowhere else.
"""

from __future__ import annotations

import argparse
import functools
import html
import importlib.util
import json
import logging
import os
import queue
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import gradio as gr
from gradio.components.chatbot import ChatbotDataMessages
from gradio.data_classes import GradioRootModel
from pydantic import ValidationError
from starlette.routing import Mount

from llm_core.config import (
    HISTORY_TURNS_RANGE,
    KV_CACHE_MODES,
    MAX_NEW_TOKENS_RANGE,
    REPETITION_PENALTY_RANGE,
    SPECS,
    TEMPERATURE_RANGE,
    TOP_K_RANGE,
    TOP_P_RANGE,
    ChatSettings,
    Settings,
    parse_auth,
)
from llm_core.engine.backend import ChatBackend
from llm_core.engine.chat import ChatEngine
from llm_core.engine.compare import REMOTE_MODE, CompareConfig, Comparison, EnginePool, allowed_models, check_allowed
from llm_core.engine.remote import RemoteEngine
from llm_core.errors import (
    BusyError,
    ContextBudgetError,
    GenerationError,
    InputError,
    LLMCoreError,
    ModelLoadError,
    OutOfMemoryError,
    SettingsError,
)
from llm_core.history import ERROR_TITLE, check_history_size, clean_chat_input, content_to_text, turns_from_messages
from llm_core.metrics import ReplyStats, export_csv, format_bytes
from llm_core.security import ExportFiles, check_exposure, person_of
from llm_core.web.openai_api import create_openai_app

log = logging.getLogger("llm_demo")

ChatHistory = list[dict[str, Any]]


class BadInputError(gr.Error):
    """A library error the user can fix (empty, too long, out of range, does not fit, busy): the page shows it as
    a warning (see `_in_page`); API callers get it as any error."""


def _user_error(exc: LLMCoreError) -> gr.Error:
    """The one place where library errors become messages in the UI (and API errors for clients)."""
    title = type(exc).__name__.replace("Error", " error").strip()
    bad_input = isinstance(exc, (InputError, ContextBudgetError, SettingsError))
    return (BadInputError if bad_input else gr.Error)(str(exc), title=title)


def _in_page(handler: Callable[..., Iterator[tuple[Any, ...]]], outputs: int) -> Callable[..., Any]:
    """The page's twin of an API handler: bad input found before anything was shown becomes a warning toast and
    leaves every output as it was (a failed event covers its outputs with error placeholders, hiding the chat).
    Same signature (functools.wraps), so Gradio passes the same inputs and the request."""

    @functools.wraps(handler)
    def in_page(*args: Any, **kwargs: Any) -> Iterator[tuple[Any, ...]]:
        shown = False
        try:
            for out in handler(*args, **kwargs):
                shown = True
                yield out
        except BadInputError as exc:
            if shown:
                raise
            gr.Warning(exc.message)
            yield tuple(gr.skip() for _ in range(outputs))

    return in_page


def _api_error(exc: LLMCoreError) -> tuple[int, str, str | None]:
    """The one place where library errors become OpenAI API errors: (HTTP status, error type, error code)."""
    if isinstance(exc, BusyError):
        return 429, "rate_limit_error", "server_busy"
    if isinstance(exc, ContextBudgetError):  # does not fit the context or the memory budget
        return 400, "invalid_request_error", "context_length_exceeded"
    if isinstance(exc, InputError):
        return 400, "invalid_request_error", None
    if isinstance(exc, OutOfMemoryError):
        return 507, "server_error", "out_of_memory"
    if isinstance(exc, ModelLoadError):
        return 503, "server_error", "model_unavailable"
    if isinstance(exc, GenerationError):
        return 500, "server_error", None
    return 400, "invalid_request_error", None  # SettingsError: a request option outside what the settings allow


def format_stats(stats: ReplyStats | None, *, live: bool = False) -> str:
    """Markdown for the stats panel."""
    if stats is None:
        return "*Send a message to see what each reply costs: TTFT, decode speed, tokens, memory.*"

    def num(value: float | None, fmt: str, unit: str) -> str:
        return "…" if value is None else f"{value:{fmt}} {unit}"

    predicted = format_bytes(stats.predicted_peak_bytes)
    remote = stats.decode_path == "remote"
    if remote:  # measured by the engine's process, if it reports it at all
        peak = stats.peak_memory_bytes
        memory = "…" if live else "not reported by the engine" if peak is None else (
            f"{format_bytes(peak)} (reported by the engine)")
        memory_label = "Peak memory"
    elif stats.peak_vram_allocated_bytes is not None:
        memory = (f"predicted {predicted} · measured {format_bytes(stats.peak_vram_allocated_bytes)} allocated / "
                  f"{format_bytes(stats.peak_vram_reserved_bytes)} reserved")
        memory_label = "Peak VRAM"
        if stats.peak_batch_rows is not None:  # replies overlapped: the batch's peak during this reply
            rows_text = f"{stats.peak_batch_rows} repl{'y' if stats.peak_batch_rows == 1 else 'ies'}"
            memory += f" (the batch's, {rows_text} decoding at that peak)"
    else:
        memory = (f"{format_bytes(stats.peak_rss_bytes) if not live else '…'} process "
                  f"(model's predicted peak {predicted})")
        memory_label = "Peak RSS (CPU)"
    rows = [
        ("TTFT", num(stats.ttft_s and stats.ttft_s * 1000, ",.0f", "ms")),
        ("Decode speed", num(stats.decode_tokens_per_s, ",.1f", "tokens/s")),
        ("Tokens in / out", f"{stats.prompt_tokens:,} / {stats.new_tokens:,}"),
        ("End to end", num(stats.end_to_end_s, ",.2f", "s") if not live else "streaming…"),
        (memory_label, memory),
        ("KV cache", "…" if live else "not reported by the engine" if remote and stats.kv_cache_bytes is None
         else format_bytes(stats.kv_cache_bytes) + ("" if remote else f" ({stats.kv_cache})")),
        ("Context meter", "the engine's own" if remote else "…" if stats.context_fit_tokens is None else
         f"{stats.prompt_tokens:,} of {stats.context_fit_tokens:,} prompt tokens that fit "
         f"(budget {format_bytes(stats.memory_budget_bytes)})"),
        ("Decode path", stats.decode_path),
    ]
    if not live and stats.finish_reason:
        rows.append(("Finished by", stats.finish_reason))
    text = "| Reply | |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in rows)
    if stats.notes:
        text += "\n\n" + "\n".join(f"*{n}*" for n in stats.notes)
    return text


def _stats_json(stats: ReplyStats | None) -> dict[str, Any]:
    return stats.as_dict() if stats is not None else {}


class _AnyHistory(GradioRootModel):
    root: Any = None


def _history_checked_by_llm_core(chatbot: gr.Chatbot, chat: ChatSettings) -> gr.Chatbot:
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
            raise _user_error(exc) from None
        except ValidationError as exc:
            where = ", ".join(".".join(str(p) for p in e.get("loc", ())) or "history" for e in exc.errors()[:3])
            raise gr.Error(f"The history is malformed (at {where}); send a list of messages with 'role' and "
                           "'content'.", title="Input error") from None
        return gradio_preprocess(checked)

    chatbot.data_model = _AnyHistory  # type: ignore[assignment]
    chatbot.preprocess = preprocess  # type: ignore[method-assign]
    return chatbot


_PROGRESS = gr.Progress()  # Gradio's marker default: it passes each call its own tracker

EMBEDDED_CHOICE = "(embedded default)"


def _model_choice(model_id: str | None) -> str:
    return model_id or EMBEDDED_CHOICE


def _header(report: Any) -> str:
    return f"## Local LLM demo · {report.model} · {report.quantization} · {report.device_name}"


def _served_choice(config: CompareConfig, remote: str | None) -> str:
    return remote if config.is_remote and remote else _model_choice(config.model_id)


def _remote_choice(settings: Settings) -> str | None:
    """The Compare view's name for the remote engine (mode, attention and KV cache are the engine's own)."""
    url = settings.remote.base_url
    return None if url is None else f"remote: {settings.remote.model or 'its first model'} at {url}"


def _model_id(choice: str | None) -> str | None:
    return None if not choice or choice == EMBEDDED_CHOICE else choice


class _Options:
    """The generation controls shared by the Chat and Compare tabs, in handler-argument order."""

    def __init__(self, settings: Settings) -> None:
        gen = settings.generation
        self.system_prompt = gr.Textbox(settings.chat.system_prompt, label="System prompt", lines=2,
                                        elem_id="system-prompt")
        self.max_new = gr.Slider(*MAX_NEW_TOKENS_RANGE, value=gen.max_new_tokens, step=1, label="Max new tokens",
                                 elem_id="max-new-tokens")
        self.turns = gr.Slider(*HISTORY_TURNS_RANGE, value=settings.chat.history_turns, step=1,
                               label="History length (turns)", elem_id="history-turns")
        self.do_sample = gr.Checkbox(gen.do_sample, label="Sample (off = greedy)", elem_id="do-sample")
        self.temperature = gr.Slider(*TEMPERATURE_RANGE, value=gen.temperature, step=0.05, label="Temperature",
                                     elem_id="temperature")
        self.top_p = gr.Slider(*TOP_P_RANGE, value=gen.top_p, step=0.01, label="Top-p", elem_id="top-p")
        self.top_k = gr.Slider(*TOP_K_RANGE, value=gen.top_k, step=1, label="Top-k (0 = off)", elem_id="top-k")
        self.rep = gr.Slider(*REPETITION_PENALTY_RANGE, value=gen.repetition_penalty, step=0.01,
                             label="Repetition penalty", elem_id="repetition-penalty")
        self.kv_cache = gr.Dropdown(list(KV_CACHE_MODES), value=gen.kv_cache, label="KV cache",
                                    info="quantized: ~3.5x more context per GiB, slower; offload: CPU RAM, last resort",
                                    elem_id="kv-cache")

    @property
    def components(self) -> list[Any]:
        return [self.system_prompt, self.max_new, self.turns, self.do_sample, self.temperature, self.top_p,
                self.top_k, self.rep, self.kv_cache]


def _gen_options(engine: ChatBackend, max_new_tokens: float, do_sample: bool, temperature: float, top_p: float,
                 top_k: float, repetition_penalty: float, kv_cache: str | None = None) -> Any:
    return engine.request_options(max_new_tokens=max_new_tokens, do_sample=do_sample, temperature=temperature,
                                  top_p=top_p, top_k=top_k, repetition_penalty=repetition_penalty,
                                  kv_cache=kv_cache)


def _history_label(row: dict[str, Any]) -> str:
    """A reply's configuration in the words of the Compare view: model · quantization preset · attention."""
    model = str(row.get("model") or "?")
    model = "embedded" if model.endswith("(embedded)") else model
    quantization = row.get("quantization") or "?"
    if quantization == "remote":  # as the Compare view names a remote engine's side
        return f"{model} · remote"
    if quantization == "nf4" and not row.get("double_quant"):
        quantization = "nf4-nodq"
    parts = [model, quantization, str(row.get("attention") or "?")]
    if row.get("kv_cache") not in (None, "dynamic"):
        parts.append(f"{row['kv_cache']} KV")
    return " · ".join(parts)


def _history_frame(rows: list[dict[str, Any]]) -> Any:
    import pandas as pd

    columns = ["reply", "configuration", "model", "quantization", "decode_path", "prompt_tokens", "new_tokens",
               "ttft_ms", "decode_tokens_per_s", "peak_memory_mib", "kv_cache_mib"]
    data = []
    for i, row in enumerate(rows, start=1):
        peak = row.get("peak_vram_allocated_bytes") or row.get("peak_rss_bytes")
        data.append({
            # A category, not a number: the plots' axis then shows whole reply numbers only (a numeric axis ticks
            # 1.2, 1.4, ...); their order is given to the plots explicitly (_history_plot).
            "reply": str(i), "configuration": _history_label(row), "model": row.get("model"),
            "quantization": row.get("quantization"),
            "decode_path": row.get("decode_path"), "prompt_tokens": row.get("prompt_tokens"),
            "new_tokens": row.get("new_tokens"),
            "ttft_ms": None if row.get("ttft_s") is None else round(row["ttft_s"] * 1000, 1),
            "decode_tokens_per_s": None if row.get("decode_tokens_per_s") is None else round(
                row["decode_tokens_per_s"], 2),
            "peak_memory_mib": None if peak is None else round(peak / 2**20, 1),
            "kv_cache_mib": None if row.get("kv_cache_bytes") is None else round(row["kv_cache_bytes"] / 2**20, 2),
        })
    return pd.DataFrame(data, columns=columns)


def _history_plot(frame: Any) -> Any:
    """A Session stats plot's update: one series of points per configuration, replies in order on the x axis."""
    return gr.ScatterPlot(value=frame, sort=list(frame["reply"]))


def build_demo(engine: ChatBackend, settings: Settings, pool: EnginePool | None = None) -> gr.Blocks:
    """The whole UI: Chat, Compare and Session stats tabs. Conversation state lives in each browser session."""
    pool = pool or EnginePool(settings, primary=engine)
    comparison = Comparison(pool, settings)
    exports = ExportFiles(settings.server.export_ttl_s)
    report = engine.report
    concurrency = engine.max_concurrent_replies  # chat events served at once (batched decoding when above 1)
    del engine  # handlers reach the served model through the pool, so a comparison may unload it if it must
    remote = _remote_choice(settings)  # the OpenAI-compatible server at OPENAI_BASE_URL, when set
    served_choices = [_model_choice(m) for m in allowed_models(settings)] + ([remote] if remote else [])

    def respond(message: str, history: ChatHistory, system_prompt: str, max_new_tokens: float,
                history_turns: float, do_sample: bool, temperature: float, top_p: float, top_k: float,
                repetition_penalty: float, kv_cache: str, rows: list[dict[str, Any]],
                request: gr.Request, progress: gr.Progress = _PROGRESS) -> Iterator[tuple[Any, ...]]:
        """The /chat API: stream a reply. Yields (textbox, chatbot history, stats markdown, stats JSON, session stats
        rows); the rows (a gr.State, never sent by the client) get the finished reply's stats. While the request
        waits for its turn in the engine, the progress overlay says how many go first. Bad input fails the call
        (gradio_client raises AppError with the message); the page's twin (_in_page) shows a warning instead."""

        def waiting(ahead: int) -> None:
            estimate = pool.primary().wait_estimate_s(ahead)
            eta = f" (about {estimate:.0f} s)" if estimate else ""
            progress(None, desc=f"Waiting for a free slot: {ahead} request{'s' if ahead != 1 else ''} ahead{eta}")

        try:
            # One cleaning and size check of every text input before anything is tokenized; what is echoed back is
            # the cleaned text (a lone surrogate sent back would break this client's stream).
            chat_input = clean_chat_input(message, history, system_prompt, settings.chat)
            chat_engine = pool.primary()
            gen = _gen_options(chat_engine, max_new_tokens, do_sample, temperature, top_p, top_k, repetition_penalty,
                               kv_cache)
            stream = chat_engine.stream_chat(chat_input.message, chat_input.turns, gen=gen,
                                             history_turns=_whole(history_turns),
                                             system_prompt=chat_input.system_prompt, request_id=_session(request),
                                             person=person_of(request, settings.server), on_wait=waiting)
            first = next(stream)  # admission, trimming, the fair turn and the first token happen here
        except LLMCoreError as exc:
            raise _user_error(exc) from None  # nothing was yielded: textbox and chat are untouched
        shown: ChatHistory = [*chat_input.history, {"role": "user", "content": chat_input.message},
                              {"role": "assistant", "content": first.text}]
        update = first
        try:
            yield "", shown, format_stats(first.stats, live=True), gr.skip(), gr.skip()
            for update in stream:
                shown[-1] = {"role": "assistant", "content": update.text}
                done = update.done
                yield gr.skip(), shown, format_stats(update.stats, live=not done), (
                    _stats_json(update.stats) if done else gr.skip()), (
                    _add_rows(rows, [update.stats]) if done else gr.skip())
        except LLMCoreError as exc:
            note = {"role": "assistant", "content": str(exc), "metadata": {"title": ERROR_TITLE}}
            shown = [*shown[:-1], *([shown[-1]] if update.text else []), note]
            yield gr.skip(), shown, format_stats(update.stats, live=False), _stats_json(update.stats), _add_rows(
                rows, [update.stats])
            raise _user_error(exc) from None

    def regenerate(history: ChatHistory, system_prompt: str, max_new_tokens: float, history_turns: float,
                   do_sample: bool, temperature: float, top_p: float, top_k: float, repetition_penalty: float,
                   kv_cache: str, rows: list[dict[str, Any]], request: gr.Request,
                   progress: gr.Progress = _PROGRESS) -> Iterator[tuple[Any, ...]]:
        """Answer the last user message again, replacing the reply(ies) after it."""
        values = (system_prompt, max_new_tokens, history_turns, do_sample, temperature, top_p, top_k,
                  repetition_penalty, kv_cache, rows)
        messages = history if isinstance(history, list) else []
        last_user = next((i for i in range(len(messages) - 1, -1, -1)
                          if isinstance(messages[i], dict) and messages[i].get("role") == "user"), None)
        if last_user is None:
            raise _user_error(InputError("There is no message to regenerate yet."))
        try:
            message = content_to_text(messages[last_user].get("content"))
        except LLMCoreError as exc:
            raise _user_error(exc) from None
        for out in respond(message, messages[:last_user], *values, request, progress):
            yield out[1:]

    def stop(request: gr.Request) -> None:
        for engine in pool.engines():  # never waits for a model load in progress
            engine.stop(_session(request))

    def clear(request: gr.Request) -> tuple[Any, ...]:
        stop(request)
        return [], format_stats(None), {}

    def compare(prompt: str, model_0: str, mode_0: str, attn_0: str, kv_0: str, model_1: str, mode_1: str,
                attn_1: str, kv_1: str, model_2: str, mode_2: str, attn_2: str, kv_2: str, system_prompt: str,
                max_new_tokens: float, history_turns: float, do_sample: bool, temperature: float, top_p: float,
                top_k: float, rep: float, kv_cache: str, rows: list[dict[str, Any]],
                request: gr.Request) -> Iterator[tuple[Any, ...]]:
        """Run the chosen configurations (MAX_COMPARE_SIDES sides of model, mode, attention, KV mode) on one
        prompt; yields every Compare output each step, and the session's stats rows (a gr.State) at the end."""
        sides = [model_0, mode_0, attn_0, kv_0, model_1, mode_1, attn_1, kv_1, model_2, mode_2, attn_2, kv_2]
        try:
            configs = [_remote_config() if remote and sides[i] == remote else
                       CompareConfig(_model_id(sides[i]), sides[i + 1], sides[i + 2], sides[i + 3])
                       for i in range(0, len(sides), 4) if sides[i + 1] != NO_SIDE]
            gen = _gen_options(pool.primary(), max_new_tokens, do_sample, temperature, top_p, top_k, rep)
            texts = ["" for _ in range(MAX_COMPARE_SIDES)]
            side_stats = ["" for _ in range(MAX_COMPARE_SIDES)]
            notes: list[str] = []
            for step in comparison.run(configs, prompt, gen, system_prompt, request_id=_session(request)):
                if step.notes:
                    notes.extend(n for n in step.notes if n not in notes)
                if step.update is not None:
                    texts[step.index] = step.update.text
                    side_stats[step.index] = format_stats(step.update.stats, live=not step.update.done)
                elif not step.done:
                    side_stats[step.index] = f"*Loading / starting {step.config.label}…*"
                summary = [r.summary_row() for r in step.results]
                yield (*texts, *side_stats, _summary_frame(summary), _summary_bars(summary),
                       step.difference or "\n".join(f"*{n}*" for n in notes),
                       [r.stats.as_dict() for r in step.results] if step.done else gr.skip(),
                       _add_rows(rows, [r.stats for r in step.results]) if step.done else gr.skip())
        except LLMCoreError as exc:
            raise _user_error(exc) from None

    def show_history(history_rows: list[dict[str, Any]]) -> tuple[Any, ...]:
        """The Session stats tab from the session's rows. Takes no client data: the rows are a gr.State, written
        only by the chat and compare handlers from the engine's own stats."""
        frame = _history_frame(history_rows)
        return frame, frame, frame

    def _switch_config(model: str | None, mode: str | None) -> CompareConfig:
        if remote and model == remote:
            return _remote_config()
        return CompareConfig(_model_id(model), mode or "nf4")

    def current_model() -> tuple[Any, ...]:
        """On page load: the model served now (it may have been switched since the page was built)."""
        served = pool.served()
        config = pool.primary_config
        mode = gr.skip() if config.is_remote else config.mode
        if served is None:
            return gr.skip(), gr.skip(), _served_choice(config, remote), mode
        return _header(served.report), served.report.as_markdown(), _served_choice(config, remote), mode

    def predict_fit(model: str | None, mode: str | None) -> str:
        """The fit prediction shown before loading (weights estimated from the model's config)."""
        try:
            return pool.fit(_switch_config(model, mode)).describe()
        except LLMCoreError as exc:
            return f"*{exc}*"

    def switch(model: str | None, mode: str | None) -> Iterator[tuple[Any, ...]]:
        """Load the chosen model and serve chat from it, streaming the load's progress (locate/download, load and
        quantize, warm-up, unload of the previous one); yields (status, model panel, header)."""
        try:
            config = _switch_config(model, mode)
            check_allowed(config, settings)
        except LLMCoreError as exc:
            raise _user_error(exc) from None
        messages: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        outcome: list[Any] = []

        def load() -> None:  # on its own thread, so the page sees each step as it happens
            try:
                outcome.append(pool.switch_primary(config, progress=messages.put)[0])
            except LLMCoreError as exc:
                outcome.append(exc)
            finally:
                messages.put(None)

        lines = [pool.fit(config).describe()]
        yield "\n\n".join(lines), gr.skip(), gr.skip()
        threading.Thread(target=load, name="switch-model", daemon=True).start()
        while (line := messages.get()) is not None:
            lines.append(line)
            yield "\n\n".join(lines), gr.skip(), gr.skip()
        result = outcome[0] if outcome else None
        if isinstance(result, LLMCoreError):
            yield "\n\n".join([*lines, f"**Not switched:** {result}"]), gr.skip(), gr.skip()
            raise _user_error(result)
        assert result is not None
        yield "\n\n".join(lines), result.report.as_markdown(), _header(result.report)

    def _remote_config() -> CompareConfig:
        """The remote side, named by the model the engine serves (OPENAI_MODEL, or the one it listed first)."""
        model = settings.remote.model or pool.get(CompareConfig(None, REMOTE_MODE))[0].report.model
        return CompareConfig(model, REMOTE_MODE)


    def export(history_rows: list[dict[str, Any]], kind: str, request: gr.Request) -> str:
        if not history_rows:
            raise gr.Error("No replies yet: chat or compare first, then export.")
        folder = exports.new_folder(_session(request) or "")  # deleted at session end or after EXPORT_TTL_S
        if kind == "csv":
            return str(export_csv(history_rows, folder / "reply-stats.csv"))
        path = folder / "reply-stats.json"
        path.write_text(json.dumps(history_rows, indent=2, ensure_ascii=False), encoding="utf-8")
        return str(path)

    def export_csv_file(history_rows: list[dict[str, Any]], request: gr.Request) -> str:
        return export(history_rows, "csv", request)

    def export_json_file(history_rows: list[dict[str, Any]], request: gr.Request) -> str:
        return export(history_rows, "json", request)

    def end_session(request: gr.Request) -> None:
        stop(request)
        exports.release(_session(request) or "")

    ttl_s = int(settings.server.export_ttl_s)
    # Gradio keeps its own copy of each served file: delete_cache drops those after the same time.
    with gr.Blocks(title="Local LLM demo", fill_height=True, delete_cache=(min(ttl_s, 600), ttl_s)) as demo:
        header = gr.Markdown(_header(report), elem_id="header")
        stats_history = gr.State([])
        with gr.Tab("Chat", id="chat-tab"):
            with gr.Row(equal_height=False):
                with gr.Column(scale=3):
                    chatbot = _history_checked_by_llm_core(
                        gr.Chatbot(elem_id="chatbot", label="Chat", height=520, buttons=["copy"]), settings.chat)
                    chat_input = gr.Textbox(elem_id="chat-input", show_label=False, lines=2, autofocus=True,
                                            placeholder="Type a message and press Enter (Shift+Enter: new line)")
                    with gr.Row():
                        send = gr.Button("Send", variant="primary", elem_id="send")
                        stop_btn = gr.Button("Stop", variant="stop", elem_id="stop")
                        regen = gr.Button("Regenerate", elem_id="regenerate")
                        clear_btn = gr.Button("Clear", elem_id="clear")
                        api_chat = gr.Button(visible=False, elem_id="api-chat")  # triggers of the API endpoints
                        api_regen = gr.Button(visible=False, elem_id="api-regenerate")
                        api_compare = gr.Button(visible=False, elem_id="api-compare")
                with gr.Column(scale=2):
                    stats_md = gr.Markdown(format_stats(None), elem_id="stats")
                    with gr.Accordion("Raw stats (JSON)", open=False):
                        stats_json = gr.JSON(value={}, elem_id="stats-json", show_label=False)
                    with gr.Accordion("Generation settings", open=True):
                        options = _Options(settings)
                    with gr.Accordion("Model", open=False, elem_id="model-panel"):
                        model_info = gr.Markdown(report.as_markdown(), elem_id="model-info")
                        with gr.Row():
                            switch_model = gr.Dropdown(
                                served_choices, value=_served_choice(pool.primary_config, remote),
                                label="Serve another model", allow_custom_value=settings.compare.allow_custom_models,
                                elem_id="switch-model")
                            switch_mode = gr.Dropdown(list(settings.compare.modes), value=pool.primary_config.mode
                                                      if not pool.primary_config.is_remote else None,
                                                      label="Quantization", elem_id="switch-mode")
                        switch_fit = gr.Markdown(elem_id="switch-fit")
                        switch_btn = gr.Button("Load and serve", elem_id="switch-load")
                        switch_status = gr.Markdown(elem_id="switch-status")
        with gr.Tab("Compare", id="compare-tab"):
            gr.Markdown("The same prompt, generation settings and seed through each configuration, one after "
                        "another; each side's own numbers. Generation settings are those of the Chat tab.")
            compare_input = gr.Textbox(label="Prompt", lines=2, elem_id="compare-input")
            compare_btn = gr.Button("Compare", variant="primary", elem_id="compare-run")
            side_inputs: list[Any] = []
            outputs_text: list[Any] = []
            outputs_stats: list[Any] = []
            model_choices = served_choices
            defaults = _default_sides(settings)
            with gr.Row(equal_height=False):
                for i in range(MAX_COMPARE_SIDES):
                    with gr.Column():
                        model, mode = defaults[i]
                        side_inputs += [
                            gr.Dropdown(model_choices, value=remote if remote and i == 0 and settings.remote.engine ==
                                        "openai" else _model_choice(model), label=f"Side {i + 1}: model",
                                        allow_custom_value=settings.compare.allow_custom_models,
                                        elem_id=f"compare-model-{i}"),
                            gr.Dropdown([*settings.compare.modes, *([NO_SIDE] if i >= 2 else [])], value=mode,
                                        label="Quantization", elem_id=f"compare-mode-{i}"),
                            gr.Dropdown(["sdpa", "eager"], value="sdpa", label="Attention",
                                        elem_id=f"compare-attn-{i}"),
                            gr.Dropdown(list(KV_CACHE_MODES), value="dynamic", label="KV cache",
                                        elem_id=f"compare-kv-{i}"),
                        ]
                        outputs_text.append(gr.Markdown(elem_id=f"compare-output-{i}",
                                                        container=True, min_height=120))
                        outputs_stats.append(gr.Markdown(elem_id=f"compare-stats-{i}"))
            compare_diff = gr.Markdown(elem_id="compare-diff")
            compare_summary = gr.Dataframe(elem_id="compare-summary", label="Summary", interactive=False, wrap=True)
            compare_plot = gr.HTML(_summary_bars([]), elem_id="compare-plot", label="Bars")
            compare_json = gr.JSON(visible=False)
        build_fit_tab(settings)
        with gr.Tab("Session stats", id="history-tab"):
            gr.Markdown("Every reply of this browser session (chat and compare), with what produced it.")
            history_table = gr.Dataframe(elem_id="history-table", interactive=False, wrap=True)
            with gr.Row():
                speed_plot = gr.ScatterPlot(x="reply", y="decode_tokens_per_s", color="configuration", y_lim=[0, None],
                                            label="Decode tokens/s per reply", elem_id="history-speed")
                memory_plot = gr.ScatterPlot(x="reply", y="peak_memory_mib", color="configuration", y_lim=[0, None],
                                             label="Peak memory (MiB) per reply", elem_id="history-memory")
            with gr.Row():
                export_csv_btn = gr.Button("Export CSV", elem_id="export-csv")
                export_json_btn = gr.Button("Export JSON", elem_id="export-json")
            export_file = gr.File(label="Export", elem_id="export-file", interactive=False)

        chat_inputs = [chat_input, chatbot, *options.components, stats_history]
        chat_outputs = [chat_input, chatbot, stats_md, stats_json, stats_history]
        history_outputs = [history_table, speed_plot, memory_plot]
        # One queue for every chat reply (concurrency_id). Chat events reach the engine beyond its reply slots: the
        # engine admits at most one running and SESSION_MAX_WAITING waiting requests per session (refusing more at
        # once) and gives a free slot to the session served least recently. Gradio's FIFO queue, with its position
        # display, holds what exceeds this width, kept below Gradio's worker threads so Stop always finds one.
        # The page's events warn about bad input (_in_page); the named API endpoints sit on triggers no one sees and
        # fail the call, as API callers expect. (Their own api_names: a private event named after its function would
        # take the public endpoint's name.)
        chat_width = min(_WORKER_THREADS - 8, concurrency + settings.server.queue_size)
        in_chat: dict[str, Any] = {"concurrency_id": "chat", "concurrency_limit": chat_width}
        send_event = send.click(_in_page(respond, len(chat_outputs)), chat_inputs, chat_outputs,
                                api_name="chat_in_page", api_visibility="private", **in_chat)
        submit_event = chat_input.submit(_in_page(respond, len(chat_outputs)), chat_inputs, chat_outputs,
                                         api_name="chat_in_page", api_visibility="private", **in_chat)
        api_event = api_chat.click(respond, chat_inputs, chat_outputs, api_name="chat", **in_chat)
        regen_inputs = [chatbot, *options.components, stats_history]
        regen_event = regen.click(_in_page(regenerate, len(chat_outputs) - 1), regen_inputs, chat_outputs[1:],
                                  api_name="regenerate_in_page", api_visibility="private", **in_chat)
        api_regen_event = api_regen.click(regenerate, regen_inputs, chat_outputs[1:], api_name="regenerate",
                                          **in_chat)
        compare_inputs = [compare_input, *side_inputs, *options.components, stats_history]
        compare_outputs = [*outputs_text, *outputs_stats, compare_summary, compare_plot, compare_diff, compare_json,
                           stats_history]
        # Loads/unloads models: one comparison at a time, page and API together.
        compare_event = compare_btn.click(_in_page(compare, len(compare_outputs)), compare_inputs, compare_outputs,
                                          api_name="compare_in_page", api_visibility="private",
                                          concurrency_id="compare", concurrency_limit=1)
        api_compare_event = api_compare.click(compare, compare_inputs, compare_outputs, api_name="compare",
                                              concurrency_id="compare", concurrency_limit=1)
        replies: list[Any] = [send_event, submit_event, api_event, regen_event, api_regen_event]
        for event in (*replies, compare_event, api_compare_event):
            event.then(show_history, stats_history, history_outputs, api_visibility="private")
        stop_btn.click(stop, None, None, cancels=[*replies, compare_event, api_compare_event], queue=False,
                       api_name="stop")
        clear_btn.click(clear, None, [chatbot, stats_md, stats_json], cancels=replies, queue=False, api_name="clear")
        demo.load(current_model, None, [header, model_info, switch_model, switch_mode], api_visibility="private")
        for control in (switch_model, switch_mode):
            control.change(predict_fit, [switch_model, switch_mode], switch_fit, api_visibility="private")
        # A page action only (not an API endpoint or MCP tool): it changes the model for every user of the demo.
        switch_btn.click(switch, [switch_model, switch_mode], [switch_status, model_info, header],
                         api_visibility="private", concurrency_id="switch", concurrency_limit=1)
        export_csv_btn.click(export_csv_file, stats_history, export_file, api_visibility="private")
        export_json_btn.click(export_json_file, stats_history, export_file, api_visibility="private")
        demo.unload(end_session)
    demo.queue(default_concurrency_limit=concurrency, max_size=settings.server.queue_size)
    return demo


NO_SIDE = "— none —"
MAX_COMPARE_SIDES = 3


FIT_CARDS_GIB = (8, 12, 16, 24, 48, 80)


def fit_answer(choice: str | None, card_gib: float, quantization: str, kv_cache: str, max_new_tokens: float,
               cache_dir: str | None = None) -> str:
    """The "Will it fit?" panel's answer (Markdown) for a model of the served/Compare list or a typed one."""
    from llm_core.fit import fit_config, load_config

    model = _model_id(choice) or ""
    try:
        config = load_config(model, cache_dir=cache_dir)
        report = fit_config(config, int(float(card_gib) * 2**30), model=choice or "embedded model",
                            quantization=quantization, kv_cache=kv_cache, max_new_tokens=int(max_new_tokens))
    except LLMCoreError as exc:
        raise _user_error(exc) from None
    return report.to_markdown()


def build_fit_tab(settings: Settings) -> None:
    """A self-contained tab: will a model fit a card, from its config.json alone (llm_core.fit), before loading."""
    from llm_core.config import QUANTIZATION_MODES

    with gr.Tab("Will it fit?", id="fit-tab"):
        gr.Markdown("From a model's config alone: weights, KV cache per token, the decode path and the longest "
                    "prompt that fits a card, with the prefill, CUDA graphs and allocator reserve counted "
                    "(`python -m llm_core.fit MODEL --gpu 8GiB` does the same).")
        with gr.Row():
            model = gr.Dropdown([_model_choice(m) for m in allowed_models(settings)],
                                value=_model_choice(settings.model.model_id or None), label="Model",
                                allow_custom_value=settings.compare.allow_custom_models, elem_id="fit-model")
            card = gr.Dropdown(list(FIT_CARDS_GIB), value=8, label="Card (GiB)", allow_custom_value=True,
                               elem_id="fit-card")
            quantization = gr.Dropdown(list(QUANTIZATION_MODES), value=settings.model.quantization,
                                       label="Quantization", elem_id="fit-quantization")
            kv_cache = gr.Dropdown(list(KV_CACHE_MODES), value=settings.generation.kv_cache, label="KV cache",
                                   elem_id="fit-kv")
            new_tokens = gr.Number(value=settings.generation.max_new_tokens, precision=0, label="Max new tokens",
                                   elem_id="fit-new")
        button = gr.Button("Will it fit?", elem_id="fit-run")
        answer = gr.Markdown(elem_id="fit-answer")
        def answer_fit(choice: str | None, card_gib: float, quant: str, kv: str, new: float) -> str:
            return fit_answer(choice, card_gib, quant, kv, new, cache_dir=settings.model.cache_dir)

        button.click(answer_fit, [model, card, quantization, kv_cache, new_tokens], answer, api_name="fit")


def _default_sides(settings: Settings) -> list[tuple[str | None, str]]:
    modes = list(settings.compare.modes)
    served = settings.model.model_id
    first = modes[0] if modes else "nf4"
    second = "none" if "none" in modes and first != "none" else (modes[1] if len(modes) > 1 else first)
    return [(served, first), (served, second), (served, NO_SIDE)]


def _summary_frame(rows: list[dict[str, Any]]) -> Any:
    import pandas as pd

    return pd.DataFrame(rows, columns=["configuration", "ttft_ms", "decode_tokens_per_s", "new_tokens",
                                       "peak_memory_mib", "weights_mib", "load_s"])


BAR_METRICS = (("decode_tokens_per_s", "Decode tokens/s", "higher is faster", "{:,.1f}"),
               ("ttft_ms", "Time to first token (ms)", "lower is faster", "{:,.0f}"),
               ("peak_memory_mib", "Peak memory (MiB), this configuration's own", "lower is smaller", "{:,.0f}"))


def _summary_bars(rows: list[dict[str, Any]]) -> str:
    """The Compare chart: for each number, one bar per configuration with its full label, every bar drawn from
    zero (so 28 against 20 looks like 28 against 20). HTML rather than gr.BarPlot, whose axis cuts labels to ~180 px."""
    if not rows:
        return "<p><em>Bars appear here when a comparison has finished sides.</em></p>"
    out = []
    for key, title, hint, fmt in BAR_METRICS:
        values = [(r["configuration"], r.get(key)) for r in rows]
        top = max((v for _, v in values if v is not None), default=0) or 1
        out.append(f'<div class="compare-bars" data-metric="{key}" style="margin-bottom:12px">'
                   f'<div style="font-weight:600">{html.escape(title)} <span style="font-weight:400;opacity:.7">'
                   f'({hint})</span></div>')
        for label, value in values:
            width = 0.0 if value is None else 100.0 * value / top
            shown = "n/a" if value is None else fmt.format(value)
            out.append(
                '<div class="bar-row" style="display:grid;grid-template-columns:minmax(8rem,2fr) 3fr 5rem;'
                'gap:8px;align-items:center;margin:3px 0">'
                f'<div class="bar-label" style="overflow-wrap:anywhere">{html.escape(label)}</div>'
                '<div style="background:var(--background-fill-secondary);height:1.1rem">'
                f'<div class="bar" data-value="{"" if value is None else value}" style="width:{width:.2f}%;'
                'height:100%;background:var(--color-accent)"></div></div>'
                f'<div class="bar-value" style="text-align:right">{shown}</div></div>')
        out.append("</div>")
    return "".join(out)


_WORKER_THREADS = 40  # gradio's default max_threads: the thread pool its sync handlers run on


def _add_rows(rows: Any, stats: list[ReplyStats]) -> list[dict[str, Any]]:
    """The session's stats rows with these finished replies appended (a new list: the State is replaced)."""
    rows = rows if isinstance(rows, list) else []
    seen = {row.get("reply_id") for row in rows if isinstance(row, dict)}
    return rows + [s.as_dict() for s in stats if s.reply_id not in seen]


def _whole(value: Any) -> Any:
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _session(request: gr.Request | None) -> str | None:
    return getattr(request, "session_hash", None) if request is not None else None


def parse_args(argv: list[str] | None = None) -> dict[str, Any]:
    """Command-line flags: one per setting (--model-id, --quantization, …), all optional, unknown flags fail."""
    parser = argparse.ArgumentParser(description="Local LLM demo: 4-bit chat with per-reply cost numbers.")
    parser.add_argument("--env-file", default=".env", help="dotenv file with settings (default: .env)")
    for spec in SPECS:
        extra: dict[str, Any] = {"nargs": "?", "const": "true"} if spec.is_switch else {}
        parser.add_argument(spec.flag, dest=spec.name, default=None, help=spec.help, **extra)
    return vars(parser.parse_args(argv))


def launch(demo: gr.Blocks, settings: Settings, pool: EnginePool | None = None, **options: Any) -> Any:
    """Serve the demo as settings say: AUTH -> parse_auth -> Gradio's login, with failed logins and API keys
    throttled per user and per address, sessions kept to their owners on every route, other sites' browser requests
    refused, unused routes closed, clean errors for malformed payloads (llm_core.web.guard); X-Forwarded-For believed
    only from FORWARDED_ALLOW_IPS; with `pool`, the OpenAI-compatible API under /v1 on the same server, on the
    engine that serves the chat tab (llm_core.web.openai_api); MCP_SERVER. `options` go to gr.Blocks.launch
    (tests: prevent_thread_lock, quiet)."""
    from fastapi.exceptions import RequestValidationError
    from starlette.middleware import Middleware

    from llm_core.security import LoginThrottle, SessionOwners
    from llm_core.web.guard import GuardMiddleware, validation_error_handler

    server = settings.server
    logins = parse_auth(server.auth) if server.auth else None
    throttle = LoginThrottle(server.login_max_failures, server.login_window_s,
                             users=[user for user, _ in logins or []])
    guard = Middleware(GuardMiddleware, throttle=throttle, owners=SessionOwners(), server=server)
    check_mcp_support(settings)
    app_kwargs: dict[str, Any] = {"middleware": [guard],
                                  "exception_handlers": {RequestValidationError: validation_error_handler}}
    if pool is not None:
        app_kwargs["routes"] = [Mount("/v1", app=create_openai_app(pool.primary, settings, _api_error,
                                                                   throttle=throttle))]
    # Gradio builds uvicorn's Config itself without forwarded_allow_ips, so uvicorn reads this variable, else
    # trusts X-Forwarded-For from 127.0.0.1 (every SHARE user arrives from there). Set only while the Config is built.
    previous = os.environ.get("FORWARDED_ALLOW_IPS")
    os.environ["FORWARDED_ALLOW_IPS"] = ",".join(server.forwarded_allow_ips)
    try:
        return demo.launch(server_name=server.host, server_port=server.port, share=server.share, auth=logins,
                           show_error=True, max_threads=_WORKER_THREADS, app_kwargs=app_kwargs,
                           mcp_server=server.mcp_server, **options)
    finally:
        if previous is None:
            os.environ.pop("FORWARDED_ALLOW_IPS", None)
        else:
            os.environ["FORWARDED_ALLOW_IPS"] = previous


def start(argv: list[str] | None = None, **launch_options: Any) -> gr.Blocks:
    """Parse settings, refuse an open host without AUTH (before loading anything), load, build and launch without
    blocking. Raises LLMCoreError (SettingsError, ModelLoadError) with a message for the operator."""
    args = parse_args(argv)
    env_file = args.pop("env_file")
    settings = Settings.from_env(env_file=env_file, overrides=args)
    warning = check_exposure(settings.server)
    if warning:
        log.warning(warning)
    check_mcp_support(settings)
    engine: ChatBackend = (RemoteEngine.connect(settings, progress=log.info) if settings.remote.engine == "openai"
                           else ChatEngine.load(settings, progress=log.info))
    log.info("Load report: %s", json.dumps(engine.report.as_dict()))
    pool = EnginePool(settings, primary=engine)
    demo = build_demo(engine, settings, pool)
    launch(demo, settings, pool, prevent_thread_lock=True, **launch_options)
    return demo


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    try:
        demo = start(argv)
    except LLMCoreError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    demo.block_thread()
    return 0


def check_mcp_support(settings: Settings) -> None:
    """MCP_SERVER=true needs Gradio's MCP extra; say so before the model loads, not after."""
    if settings.server.mcp_server and importlib.util.find_spec("mcp") is None:
        raise SettingsError('MCP_SERVER=true needs Gradio\'s MCP support: pip install "gradio[mcp]==6.31.0", or set '
                            "MCP_SERVER=false.")


if __name__ == "__main__":
    sys.exit(main())
