"""The stats panel of each reply (format_stats) and the Session stats tab: every reply of the browser session, its
plots and its export."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import gradio as gr

from llm_core.metrics import ReplyStats, configuration_label, export_csv, format_bytes, format_mib

from .common import PageContext, session


def format_stats(stats: ReplyStats | None, *, live: bool = False) -> str:
    """Markdown for the stats panel."""
    if stats is None:
        return "*Send a message to see what each reply costs: TTFT, decode speed, tokens, memory.*"

    def num(value: float | None, fmt: str, unit: str) -> str:
        return "…" if value is None else f"{value:{fmt}} {unit}"

    remote = stats.decode_path == "remote"
    memory_label, memory = _memory_row(stats, live=live)
    rows = [
        ("TTFT", num(stats.ttft_s and stats.ttft_s * 1000, ",.0f", "ms")),
        ("Decode speed", num(stats.decode_tokens_per_s, ",.1f", "tokens/s")),
        ("Tokens in / out", f"{stats.prompt_tokens:,} / {stats.new_tokens:,}"),
        ("Prompt from cache", "n/a" if remote else f"{stats.cached_prompt_tokens:,} of {stats.prompt_tokens:,} tokens"),
        ("End to end", num(stats.end_to_end_s, ",.2f", "s") if not live else "streaming…"),
        (memory_label, memory),
        ("KV cache", "…" if live else "not reported by the engine" if remote and stats.kv_cache_bytes is None
         else format_bytes(stats.kv_cache_bytes) + ("" if remote else f" ({stats.kv_cache})")),
        ("Context meter", "the engine's own" if remote else "…" if stats.context_fit_tokens is None else
         f"{stats.prompt_tokens:,} of {stats.context_fit_tokens:,} prompt tokens that fit "
         f"(budget {format_bytes(stats.memory_budget_bytes)})"),
        ("Decode path", stats.decode_path),
    ]
    if stats.grammar_mask_ms_per_token is not None:
        rows.append(("JSON schema mask", f"{stats.grammar_mask_ms_per_token:.2f} ms/token"))
    if not live and stats.finish_reason:
        rows.append(("Finished by", stats.finish_reason))
    text = "| Reply | |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in rows)
    if stats.notes:
        text += "\n\n" + "\n".join(f"*{n}*" for n in stats.notes)
    return text


def _memory_row(stats: ReplyStats, *, live: bool) -> tuple[str, str]:
    """The stats panel's memory row: (label, value). The peak is the reply's own (ReplyStats.own_peak_bytes), in
    MiB as every table writes it; the other loaded engines' share of the process peak is said here, once."""
    if stats.decode_path == "remote":  # measured by the engine's process, if it reports it at all
        peak = stats.peak_memory_bytes
        return "Peak memory", "…" if live else "not reported by the engine" if peak is None else (
            f"{format_mib(peak)} (reported by the engine)")
    cuda = stats.peak_vram_allocated_bytes is not None
    if live and not cuda:
        return "Peak RSS (CPU)", "…"
    memory = format_mib(stats.own_peak_bytes) + (" allocated" if cuda else "")
    if stats.others_resident_bytes:
        memory += (f" (the process peak less {format_mib(stats.others_resident_bytes)} held by the other loaded "
                   "engines)")
    if cuda:
        memory += f" · {format_mib(stats.peak_vram_reserved_bytes)} reserved by the process"
    predicted = "predicted" if cuda else "the model's predicted peak"  # RSS also counts torch and the libraries
    memory += f" · {predicted} {format_mib(stats.predicted_peak_bytes)}"
    if stats.peak_batch_rows is not None:  # replies overlapped: the batch's peak during this reply
        rows_text = f"{stats.peak_batch_rows} repl{'y' if stats.peak_batch_rows == 1 else 'ies'}"
        memory += f" (the batch's, {rows_text} decoding at that peak)"
    return ("Peak VRAM" if cuda else "Peak RSS (CPU)"), memory


HISTORY_COLUMNS = ["reply", "configuration", "model", "quantization", "decode_path", "prompt_tokens", "new_tokens",
                   "ttft_ms", "decode_tokens_per_s", "peak_memory_mib", "kv_cache_mib"]
PLOT_HEADROOM = 1.15  # the y axis ends this far above the highest point, so no point sits on the upper edge


def history_frame(rows: list[dict[str, Any]]) -> Any:
    import pandas as pd

    data = []
    for i, row in enumerate(rows, start=1):
        stats = ReplyStats.from_dict(row)
        peak = stats.own_peak_bytes
        data.append({
            # A category, not a number: the plots' axis then shows whole reply numbers only (a numeric axis ticks
            # 1.2, 1.4, ...); their order is given to the plots explicitly (history_plot).
            "reply": str(i), "configuration": configuration_label(stats), "model": stats.model,
            "quantization": stats.quantization, "decode_path": stats.decode_path,
            "prompt_tokens": stats.prompt_tokens, "new_tokens": stats.new_tokens,
            "ttft_ms": None if stats.ttft_s is None else round(stats.ttft_s * 1000, 1),
            "decode_tokens_per_s": None if stats.decode_tokens_per_s is None else round(stats.decode_tokens_per_s, 2),
            "peak_memory_mib": None if peak is None else round(peak / 2**20, 1),
            "kv_cache_mib": None if stats.kv_cache_bytes is None else round(stats.kv_cache_bytes / 2**20, 2),
        })
    return pd.DataFrame(data, columns=HISTORY_COLUMNS)


def history_plot(frame: Any, y: str) -> Any:
    """A Session stats plot's update: one series of points per configuration, replies in order on the x axis, the
    y axis from zero to PLOT_HEADROOM above the highest point."""
    values = [float(v) for v in frame[y] if v is not None and v == v] if y in frame else []
    top = max(values, default=0.0) * PLOT_HEADROOM or None
    return gr.ScatterPlot(value=frame, sort=list(frame["reply"]), y_lim=[0, top])


def show_history(history_rows: list[dict[str, Any]]) -> tuple[Any, ...]:
    """The Session stats tab from the session's rows. Takes no client data: the rows are a gr.State, written only by
    the chat and compare handlers from the engine's own stats."""
    frame = history_frame(history_rows)
    return frame, history_plot(frame, "decode_tokens_per_s"), history_plot(frame, "peak_memory_mib")


@dataclass
class StatsTab:
    table: Any
    speed_plot: Any
    memory_plot: Any

    @property
    def outputs(self) -> list[Any]:
        return [self.table, self.speed_plot, self.memory_plot]


def build_stats_tab(ctx: PageContext, stats_history: Any) -> StatsTab:
    """The Session stats tab: every reply of this session, plots per reply, CSV/JSON export."""
    with gr.Tab("Session stats", id="history-tab"):
        gr.Markdown("Every reply of this browser session (chat and compare), with what produced it.")
        table = gr.Dataframe(elem_id="history-table", interactive=False, wrap=True)
        with gr.Row():
            speed_plot = gr.ScatterPlot(x="reply", y="decode_tokens_per_s", color="configuration", y_lim=[0, None],
                                        label="Decode tokens/s per reply", elem_id="history-speed")
            memory_plot = gr.ScatterPlot(x="reply", y="peak_memory_mib", color="configuration", y_lim=[0, None],
                                         label="Peak memory (MiB) per reply", elem_id="history-memory")
        with gr.Row():
            export_csv_btn = gr.Button("Export CSV", elem_id="export-csv")
            export_json_btn = gr.Button("Export JSON", elem_id="export-json")
        export_file = gr.File(label="Export", elem_id="export-file", interactive=False)

    def export_csv_file(history_rows: list[dict[str, Any]], request: gr.Request) -> str:
        return _export(ctx, history_rows, "csv", request)

    def export_json_file(history_rows: list[dict[str, Any]], request: gr.Request) -> str:
        return _export(ctx, history_rows, "json", request)

    export_csv_btn.click(export_csv_file, stats_history, export_file, api_visibility="private")
    export_json_btn.click(export_json_file, stats_history, export_file, api_visibility="private")
    return StatsTab(table, speed_plot, memory_plot)


def _export(ctx: PageContext, history_rows: list[dict[str, Any]], kind: str, request: gr.Request) -> str:
    if not history_rows:
        raise gr.Error("No replies yet: chat or compare first, then export.")
    folder = ctx.exports.new_folder(session(request) or "")  # deleted at session end or after EXPORT_TTL_S
    if kind == "csv":
        return str(export_csv(history_rows, folder / "reply-stats.csv"))
    path = folder / "reply-stats.json"
    path.write_text(json.dumps(history_rows, indent=2, ensure_ascii=False), encoding="utf-8")
    return str(path)
