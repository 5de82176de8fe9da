"""The Model panel: what is served now (the load report), and serving another allowed model without a restart."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import gradio as gr

from llm_core.engine.compare import CompareConfig, check_allowed
from llm_core.errors import LLMCoreError

from .common import PageContext, header
from .errors import user_error


@dataclass
class ModelPanel:
    info: Any
    choice: Any
    mode: Any


def build_model_panel(ctx: PageContext, report: Any, page_header: Any) -> ModelPanel:
    """The panel's layout and its events (page actions only: a switch changes the model for every user)."""
    primary = ctx.pool.primary_config
    with gr.Accordion("Model", open=False, elem_id="model-panel"):
        info = gr.Markdown(report.as_markdown(), elem_id="model-info")
        with gr.Row():
            choice = gr.Dropdown(ctx.served_choices, value=ctx.served_choice(primary), label="Serve another model",
                                 allow_custom_value=ctx.settings.compare.allow_custom_models, elem_id="switch-model")
            mode = gr.Dropdown(list(ctx.settings.compare.modes), value=None if primary.is_remote else primary.mode,
                               label="Quantization", elem_id="switch-mode")
        fit = gr.Markdown(elem_id="switch-fit")
        load = gr.Button("Load and serve", elem_id="switch-load")
        status = gr.Markdown(elem_id="switch-status")

    def predict_fit(model: str | None, mode: str | None) -> str:
        """The fit prediction shown before loading (weights estimated from the model's config)."""
        try:
            return ctx.pool.fit(ctx.config_of(model, mode)).describe()
        except LLMCoreError as exc:
            return f"*{exc}*"

    def switch(model: str | None, mode: str | None) -> Iterator[tuple[Any, ...]]:
        yield from switch_model(ctx, model, mode)

    for control in (choice, mode):
        control.change(predict_fit, [choice, mode], fit, api_visibility="private")
    load.click(switch, [choice, mode], [status, info, page_header], api_visibility="private",
               concurrency_id="switch", concurrency_limit=1)
    return ModelPanel(info, choice, mode)


def current_model(ctx: PageContext) -> tuple[Any, ...]:
    """On page load: the model served now (it may have been switched since the page was built)."""
    served = ctx.pool.served()
    config = ctx.pool.primary_config
    mode = gr.skip() if config.is_remote else config.mode
    if served is None:
        return gr.skip(), gr.skip(), ctx.served_choice(config), mode
    return header(served.report), served.report.as_markdown(), ctx.served_choice(config), mode


def switch_model(ctx: PageContext, model: str | None, mode: str | None) -> Iterator[tuple[Any, ...]]:
    """Load the chosen model and serve chat from it, streaming the load's progress (locate/download, load and
    quantize, warm-up, unload of the previous one); yields (status, model panel, header)."""
    try:
        config: CompareConfig = ctx.config_of(model, mode)
        check_allowed(config, ctx.settings)
    except LLMCoreError as exc:
        raise user_error(exc) from None
    messages: queue.SimpleQueue[str | None] = queue.SimpleQueue()
    outcome: list[Any] = []

    def load() -> None:  # on its own thread, so the page sees each step as it happens
        try:
            outcome.append(ctx.pool.switch_primary(config, progress=messages.put)[0])
        except LLMCoreError as exc:
            outcome.append(exc)
        finally:
            messages.put(None)

    lines = [ctx.pool.fit(config).describe()]
    yield "\n\n".join(lines), gr.skip(), gr.skip()
    threading.Thread(target=load, name="switch-model", daemon=True).start()
    while (line := messages.get()) is not None:
        lines.append(line)
        yield "\n\n".join(lines), gr.skip(), gr.skip()
    result = outcome[0] if outcome else None
    if isinstance(result, LLMCoreError):
        yield "\n\n".join([*lines, f"**Not switched:** {result}"]), gr.skip(), gr.skip()
        raise user_error(result)
    assert result is not None
    yield "\n\n".join(lines), result.report.as_markdown(), header(result.report)
