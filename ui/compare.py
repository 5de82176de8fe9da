"""The Compare tab: one prompt through two or three configurations, each side's reply and numbers, a summary."""

from __future__ import annotations

import html
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import gradio as gr

from llm_core.config import KV_CACHE_MODES, Settings
from llm_core.errors import LLMCoreError
from llm_core.security import person_of

from .common import PageContext, UpdatePacer, add_rows, gen_options, model_choice, session
from .errors import user_error
from .stats import format_stats

NO_SIDE = "— none —"
MAX_COMPARE_SIDES = 3
SIDE_FIELDS = 4  # model, quantization mode, attention, KV cache
SUMMARY_COLUMNS = ["configuration", "ttft_ms", "decode_tokens_per_s", "new_tokens", "peak_memory_mib", "weights_mib",
                   "load_s"]
BAR_METRICS = (("decode_tokens_per_s", "Decode tokens/s", "higher is faster", "{:,.1f}"),
               ("ttft_ms", "Time to first token (ms)", "lower is faster", "{:,.0f}"),
               ("peak_memory_mib", "Peak memory (MiB)", "lower is smaller", "{:,.1f}"))


def default_sides(settings: Settings) -> list[tuple[str | None, str]]:
    modes = list(settings.compare.modes)
    served = settings.model.model_id
    first = modes[0] if modes else "nf4"
    second = "none" if "none" in modes and first != "none" else (modes[1] if len(modes) > 1 else first)
    return [(served, first), (served, second), (served, NO_SIDE)]


def summary_frame(rows: list[dict[str, Any]]) -> Any:
    import pandas as pd

    return pd.DataFrame(rows, columns=SUMMARY_COLUMNS)


def summary_bars(rows: list[dict[str, Any]]) -> str:
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


class CompareHandler:
    def __init__(self, ctx: PageContext) -> None:
        self.ctx = ctx

    def compare(self, prompt: str, model_0: str, mode_0: str, attn_0: str, kv_0: str, model_1: str, mode_1: str,
                attn_1: str, kv_1: str, model_2: str, mode_2: str, attn_2: str, kv_2: str, system_prompt: str,
                max_new_tokens: float, history_turns: float, do_sample: bool, temperature: float, top_p: float,
                top_k: float, rep: float, kv_cache: str, rows: list[dict[str, Any]],
                request: gr.Request) -> Iterator[tuple[Any, ...]]:
        """Run the chosen configurations (MAX_COMPARE_SIDES sides of model, mode, attention, KV mode) on one
        prompt; yields every Compare output each step, and the session's stats rows (a gr.State) at the end."""
        sides = [model_0, mode_0, attn_0, kv_0, model_1, mode_1, attn_1, kv_1, model_2, mode_2, attn_2, kv_2]
        ctx = self.ctx
        try:
            configs = [ctx.config_of(*sides[i:i + SIDE_FIELDS]) for i in range(0, len(sides), SIDE_FIELDS)
                       if sides[i + 1] != NO_SIDE]
            gen = gen_options(ctx.pool.primary(), max_new_tokens, do_sample, temperature, top_p, top_k, rep)
            texts = ["" for _ in range(MAX_COMPARE_SIDES)]
            side_stats = ["" for _ in range(MAX_COMPARE_SIDES)]
            notes: list[str] = []
            shown_results = -1  # the summary and bars are sent when a side finishes, not with every token
            pacer = UpdatePacer.for_page(ctx)
            for step in ctx.comparison.run(configs, prompt, gen, system_prompt, request_id=session(request),
                                           person=person_of(request, ctx.settings.server)):
                if step.notes:
                    notes.extend(n for n in step.notes if n not in notes)
                changed = len(step.results) != shown_results
                token = (step.update is not None and not step.update.done and not changed and not step.done
                         and not step.notes)  # a side's next token, nothing else: sent at the pacer's rate
                if step.update is not None:
                    texts[step.index] = step.update.text
                if not pacer.due(last=not token):
                    continue  # the sides run one after another: this side's next update shows this text
                if step.update is not None:
                    side_stats[step.index] = format_stats(step.update.stats, live=not step.update.done)
                elif not step.done:
                    side_stats[step.index] = f"*Loading / starting {step.config.label}…*"
                for i, result in enumerate(step.results):  # a finished side: its stats as the comparison counted them
                    side_stats[i] = format_stats(result.stats)
                summary = [r.summary_row() for r in step.results]
                shown_results = len(step.results)
                yield (*texts, *side_stats, summary_frame(summary) if changed else gr.skip(),
                       summary_bars(summary) if changed else gr.skip(),
                       step.difference or "\n".join(f"*{n}*" for n in notes),
                       [r.stats.as_dict() for r in step.results] if step.done else gr.skip(),
                       add_rows(rows, [r.stats for r in step.results]) if step.done else gr.skip())
        except LLMCoreError as exc:
            raise user_error(exc) from None


@dataclass
class CompareTab:
    prompt: Any
    run: Any
    side_inputs: list[Any]
    texts: list[Any]
    stats: list[Any]
    diff: Any
    summary: Any
    plot: Any
    records: Any

    @property
    def outputs(self) -> list[Any]:
        return [*self.texts, *self.stats, self.summary, self.plot, self.diff, self.records]


def build_compare_tab(ctx: PageContext) -> CompareTab:
    """The Compare tab's layout: the prompt, a column per side (its choices, reply and numbers), the summary."""
    with gr.Tab("Compare", id="compare-tab"):
        gr.Markdown("The same prompt, generation settings and seed through each configuration, one after "
                    "another; each side's own numbers. Generation settings are those of the Chat tab.")
        prompt = gr.Textbox(label="Prompt", lines=2, elem_id="compare-input")
        run = gr.Button("Compare", variant="primary", elem_id="compare-run")
        side_inputs: list[Any] = []
        texts: list[Any] = []
        stats: list[Any] = []
        with gr.Row(equal_height=False):
            for i, (model, mode) in enumerate(default_sides(ctx.settings)):
                with gr.Column():
                    side_inputs += _side_inputs(ctx, i, model, mode)
                    texts.append(gr.Markdown(elem_id=f"compare-output-{i}", container=True, min_height=120))
                    stats.append(gr.Markdown(elem_id=f"compare-stats-{i}"))
        diff = gr.Markdown(elem_id="compare-diff")
        summary = gr.Dataframe(elem_id="compare-summary", label="Summary", interactive=False, wrap=True)
        plot = gr.HTML(summary_bars([]), elem_id="compare-plot", label="Bars")
        records = gr.JSON(visible=False)
    return CompareTab(prompt, run, side_inputs, texts, stats, diff, summary, plot, records)


def _side_inputs(ctx: PageContext, i: int, model: str | None, mode: str) -> list[Any]:
    settings = ctx.settings
    first_is_remote = ctx.remote and i == 0 and settings.remote.engine == "openai"
    return [
        gr.Dropdown(ctx.served_choices, value=ctx.remote if first_is_remote else model_choice(model),
                    label=f"Side {i + 1}: model", allow_custom_value=settings.compare.allow_custom_models,
                    elem_id=f"compare-model-{i}"),
        gr.Dropdown([*settings.compare.modes, *([NO_SIDE] if i >= 2 else [])], value=mode, label="Quantization",
                    elem_id=f"compare-mode-{i}"),
        gr.Dropdown(["sdpa", "eager"], value="sdpa", label="Attention", elem_id=f"compare-attn-{i}"),
        gr.Dropdown(list(KV_CACHE_MODES), value="auto", label="KV cache", elem_id=f"compare-kv-{i}"),
    ]
