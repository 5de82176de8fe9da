"""Gradio UI over llm_core: build_demo(engine, settings) -> gr.Blocks; main() parses flags, loads once, launches.

The UI never touches torch. llm_core errors become gr.Error here, in `_user_error`, and nowhere else.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Iterator
from typing import Any

import gradio as gr

from llm_core.config import (
    HISTORY_TURNS_RANGE,
    MAX_NEW_TOKENS_RANGE,
    REPETITION_PENALTY_RANGE,
    SPECS,
    TEMPERATURE_RANGE,
    TOP_K_RANGE,
    TOP_P_RANGE,
    Settings,
    parse_auth,
)
from llm_core.errors import LLMCoreError
from llm_core.generation import ChatEngine
from llm_core.history import ERROR_TITLE, content_to_text, turns_from_messages
from llm_core.metrics import ReplyStats, format_bytes

log = logging.getLogger("llm_demo")

ChatHistory = list[dict[str, Any]]


def _user_error(exc: LLMCoreError) -> gr.Error:
    """The one place where library errors become messages in the UI (and API errors for clients)."""
    return gr.Error(str(exc), title=type(exc).__name__.replace("Error", " error").strip())


def format_stats(stats: ReplyStats | None, *, live: bool = False) -> str:
    """Markdown for the stats panel."""
    if stats is None:
        return "*Send a message to see what each reply costs: TTFT, decode speed, tokens, memory.*"

    def num(value: float | None, fmt: str, unit: str) -> str:
        return "…" if value is None else f"{value:{fmt}} {unit}"

    if stats.peak_vram_allocated_bytes is not None:
        memory = (f"{format_bytes(stats.peak_vram_allocated_bytes)} allocated / "
                  f"{format_bytes(stats.peak_vram_reserved_bytes)} reserved")
        memory_label = "Peak VRAM"
    else:
        memory = format_bytes(stats.peak_rss_bytes) if not live else "…"
        memory_label = "Peak RSS (CPU)"
    rows = [
        ("TTFT", num(stats.ttft_s and stats.ttft_s * 1000, ",.0f", "ms")),
        ("Decode speed", num(stats.decode_tokens_per_s, ",.1f", "tokens/s")),
        ("Tokens in / out", f"{stats.prompt_tokens:,} / {stats.new_tokens:,}"),
        ("End to end", num(stats.end_to_end_s, ",.2f", "s") if not live else "streaming…"),
        (memory_label, memory),
        ("KV cache", format_bytes(stats.kv_cache_bytes) if not live else "…"),
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


def build_demo(engine: ChatEngine, settings: Settings) -> gr.Blocks:
    """The whole UI. Conversation state lives in each browser session's Chatbot value."""
    gen_defaults = settings.generation

    def respond(message: str, history: ChatHistory, system_prompt: str, max_new_tokens: float,
                history_turns: float, do_sample: bool, temperature: float, top_p: float, top_k: float,
                repetition_penalty: float, request: gr.Request) -> Iterator[tuple[Any, ...]]:
        """Stream a reply. Yields (textbox, chatbot history, stats markdown, stats JSON)."""
        try:
            gen = engine.request_options(max_new_tokens=max_new_tokens, do_sample=do_sample,
                                         temperature=temperature, top_p=top_p, top_k=top_k,
                                         repetition_penalty=repetition_penalty)
            turns = turns_from_messages(history)
            stream = engine.stream_chat(message, turns, gen=gen, history_turns=_whole(history_turns),
                                        system_prompt=system_prompt, request_id=_session(request))
            first = next(stream)  # validation, trimming and the first token happen here
        except LLMCoreError as exc:
            raise _user_error(exc) from None  # nothing was yielded: textbox and chat are untouched
        shown: ChatHistory = [*history, {"role": "user", "content": message},
                              {"role": "assistant", "content": first.text}]
        update = first
        try:
            yield "", shown, format_stats(first.stats, live=True), gr.skip()
            for update in stream:
                shown[-1] = {"role": "assistant", "content": update.text}
                yield gr.skip(), shown, format_stats(update.stats, live=not update.done), (
                    _stats_json(update.stats) if update.done else gr.skip())
        except LLMCoreError as exc:
            note = {"role": "assistant", "content": str(exc), "metadata": {"title": ERROR_TITLE}}
            shown = [*shown[:-1], *([shown[-1]] if update.text else []), note]
            yield gr.skip(), shown, format_stats(update.stats, live=False), _stats_json(update.stats)
            raise _user_error(exc) from None

    def regenerate(history: ChatHistory, system_prompt: str, max_new_tokens: float, history_turns: float,
                   do_sample: bool, temperature: float, top_p: float, top_k: float, repetition_penalty: float,
                   request: gr.Request) -> Iterator[tuple[Any, ...]]:
        """Answer the last user message again, replacing the reply(ies) after it."""
        values = (system_prompt, max_new_tokens, history_turns, do_sample, temperature, top_p, top_k,
                  repetition_penalty)
        last_user = next((i for i in range(len(history) - 1, -1, -1) if history[i].get("role") == "user"), None)
        if last_user is None:
            raise gr.Error("There is no message to regenerate yet.")
        message = content_to_text(history[last_user]["content"])
        for out in respond(message, history[:last_user], *values, request):
            yield out[1:]

    def stop(request: gr.Request) -> None:
        engine.stop(_session(request))

    def clear(request: gr.Request) -> tuple[Any, ...]:
        engine.stop(_session(request))
        return [], format_stats(None), {}

    with gr.Blocks(title="Local LLM demo", fill_height=True) as demo:
        gr.Markdown(f"## Local LLM demo · {engine.report.model} · {engine.report.quantization} · "
                    f"{engine.report.device_name}")
        with gr.Row(equal_height=False):
            with gr.Column(scale=3):
                chatbot = gr.Chatbot(elem_id="chatbot", label="Chat", height=520, buttons=["copy"])
                chat_input = gr.Textbox(elem_id="chat-input", show_label=False, lines=2, autofocus=True,
                                        placeholder="Type a message and press Enter (Shift+Enter for a new line)")
                with gr.Row():
                    send = gr.Button("Send", variant="primary", elem_id="send")
                    stop_btn = gr.Button("Stop", variant="stop", elem_id="stop")
                    regen = gr.Button("Regenerate", elem_id="regenerate")
                    clear_btn = gr.Button("Clear", elem_id="clear")
            with gr.Column(scale=2):
                stats_md = gr.Markdown(format_stats(None), elem_id="stats")
                with gr.Accordion("Raw stats (JSON)", open=False):
                    stats_json = gr.JSON(value={}, elem_id="stats-json", show_label=False)
                with gr.Accordion("Generation settings", open=True):
                    system_prompt = gr.Textbox(settings.chat.system_prompt, label="System prompt", lines=2,
                                               elem_id="system-prompt")
                    max_new = gr.Slider(*MAX_NEW_TOKENS_RANGE, value=gen_defaults.max_new_tokens, step=1,
                                        label="Max new tokens", elem_id="max-new-tokens")
                    turns = gr.Slider(*HISTORY_TURNS_RANGE, value=settings.chat.history_turns, step=1,
                                      label="History length (turns)", elem_id="history-turns")
                    do_sample = gr.Checkbox(gen_defaults.do_sample, label="Sample (off = greedy)",
                                            elem_id="do-sample")
                    temperature = gr.Slider(*TEMPERATURE_RANGE, value=gen_defaults.temperature, step=0.05,
                                            label="Temperature", elem_id="temperature")
                    top_p = gr.Slider(*TOP_P_RANGE, value=gen_defaults.top_p, step=0.01, label="Top-p",
                                      elem_id="top-p")
                    top_k = gr.Slider(*TOP_K_RANGE, value=gen_defaults.top_k, step=1, label="Top-k (0 = off)",
                                      elem_id="top-k")
                    rep = gr.Slider(*REPETITION_PENALTY_RANGE, value=gen_defaults.repetition_penalty, step=0.01,
                                    label="Repetition penalty", elem_id="repetition-penalty")
                with gr.Accordion("Model", open=False):
                    gr.Markdown(engine.report.as_markdown(), elem_id="model-info")

        options = [system_prompt, max_new, turns, do_sample, temperature, top_p, top_k, rep]
        chat_outputs = [chat_input, chatbot, stats_md, stats_json]
        send_event = send.click(respond, [chat_input, chatbot, *options], chat_outputs, api_name="chat")
        submit_event = chat_input.submit(respond, [chat_input, chatbot, *options], chat_outputs,
                                        api_visibility="private")
        regen_event = regen.click(regenerate, [chatbot, *options], chat_outputs[1:], api_name="regenerate")
        stop_btn.click(stop, None, None, cancels=[send_event, submit_event, regen_event], queue=False,
                       api_name="stop")
        clear_btn.click(clear, None, [chatbot, stats_md, stats_json], cancels=[send_event, submit_event, regen_event],
                        queue=False, api_name="clear")
    demo.queue(default_concurrency_limit=1, max_size=settings.server.queue_size)
    return demo


def _whole(value: Any) -> Any:
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _session(request: gr.Request | None) -> str | None:
    return getattr(request, "session_hash", None) if request is not None else None


def parse_args(argv: list[str] | None = None) -> dict[str, Any]:
    """Command-line flags: one per setting (--model-id, --quantization, …), all optional, unknown flags fail."""
    parser = argparse.ArgumentParser(description="Local LLM demo: 4-bit chat with per-reply cost numbers.")
    parser.add_argument("--env-file", default=".env", help="dotenv file with settings (default: .env)")
    for spec in SPECS:
        is_bool = spec.parser.__name__ in ("_parse_bool", "_parse_opt_bool")
        extra: dict[str, Any] = {"nargs": "?", "const": "true"} if is_bool else {}
        parser.add_argument(spec.flag, dest=spec.name, default=None, help=spec.help, **extra)
    return vars(parser.parse_args(argv))


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    args = parse_args(argv)
    env_file = args.pop("env_file")
    try:
        settings = Settings.from_env(env_file=env_file, overrides=args)
        engine = ChatEngine.load(settings, progress=log.info)
    except LLMCoreError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    log.info("Load report: %s", json.dumps(engine.report.as_dict()))
    demo = build_demo(engine, settings)
    server = settings.server
    demo.launch(server_name=server.host, server_port=server.port, share=server.share,
                auth=parse_auth(server.auth) if server.auth else None, show_error=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
