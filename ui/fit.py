"""The "Will it fit?" tab: will a model fit a card, from its config.json alone (llm_core.fit), before loading."""

from __future__ import annotations

from typing import Any

import gradio as gr

from llm_core.config import KV_CACHE_MODES, QUANTIZATION_MODES, Settings
from llm_core.engine.compare import allowed_models
from llm_core.errors import LLMCoreError

from .common import model_choice, model_id
from .errors import user_error, warn_on_bad_input

FIT_CARDS_GIB = (8, 12, 16, 24, 48, 80)


def fit_answer(choice: str | None, card_gib: Any, quantization: str, kv_cache: str, max_new_tokens: Any,
               cache_dir: str | None = None) -> str:
    """The "Will it fit?" panel's answer (Markdown) for a model of the served/Compare list or a typed one. Every
    input is checked by llm_core.fit (a card size it cannot read, new tokens below 1: InputError)."""
    from llm_core.fit import card_bytes_of, fit_config, load_config

    try:
        card_bytes = card_bytes_of(card_gib)
        config = load_config(model_id(choice) or "", cache_dir=cache_dir)
        report = fit_config(config, card_bytes, model=choice or "embedded model", quantization=quantization,
                            kv_cache=kv_cache, max_new_tokens=max_new_tokens)
    except LLMCoreError as exc:
        raise user_error(exc) from None
    return report.to_markdown()


def build_fit_tab(settings: Settings) -> None:
    """A self-contained tab: its inputs, the answer, and the /fit endpoint."""
    with gr.Tab("Will it fit?", id="fit-tab"):
        gr.Markdown("From a model's config alone: weights, KV cache per token, the decode path and the longest "
                    "prompt that fits a card, with the prefill, CUDA graphs and allocator reserve counted "
                    "(`python -m llm_core.fit MODEL --gpu 8GiB` does the same).")
        with gr.Row():
            model = gr.Dropdown([model_choice(m) for m in allowed_models(settings)],
                                value=model_choice(settings.model.model_id or None), label="Model",
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
        api_fit = gr.Button(visible=False, elem_id="api-fit")  # the /fit endpoint: bad input fails the call
        answer = gr.Markdown(elem_id="fit-answer")

    def answer_fit(choice: str | None, card_gib: Any, quant: str, kv: str, new: Any) -> str:
        return fit_answer(choice, card_gib, quant, kv, new, cache_dir=settings.model.cache_dir)

    inputs = [model, card, quantization, kv_cache, new_tokens]
    button.click(warn_on_bad_input(answer_fit), inputs, answer, api_name="fit_in_page", api_visibility="private")
    api_fit.click(answer_fit, inputs, answer, api_name="fit")
