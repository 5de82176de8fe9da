"""What the tabs share: the page's context (settings, engine pool, exports), model choice names, the generation
controls, and the session's stats rows."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import gradio as gr

from llm_core.config import (
    HISTORY_TURNS_RANGE,
    KV_CACHE_MODES,
    MAX_NEW_TOKENS_RANGE,
    REPETITION_PENALTY_RANGE,
    TEMPERATURE_RANGE,
    TOP_K_RANGE,
    TOP_P_RANGE,
    Settings,
)
from llm_core.engine.backend import ChatBackend
from llm_core.engine.compare import REMOTE_MODE, CompareConfig, Comparison, EnginePool, allowed_models
from llm_core.metrics import ReplyStats
from llm_core.security import ExportFiles

ChatHistory = list[dict[str, Any]]

EMBEDDED_CHOICE = "(embedded default)"
WORKER_THREADS = 40  # gradio's default max_threads: the thread pool its sync handlers run on
PROGRESS = gr.Progress()  # Gradio's marker default: it passes each call its own tracker


def model_choice(model_id: str | None) -> str:
    return model_id or EMBEDDED_CHOICE


def model_id(choice: str | None) -> str | None:
    return None if not choice or choice == EMBEDDED_CHOICE else choice


def remote_choice(settings: Settings) -> str | None:
    """The Compare view's name for the remote engine (mode, attention and KV cache are the engine's own)."""
    url = settings.remote.base_url
    return None if url is None else f"remote: {settings.remote.model or 'its first model'} at {url}"


def header(report: Any) -> str:
    quantization = getattr(report, "quantization_label", report.quantization)  # a remote engine's is "remote"
    return f"## Local LLM demo · {report.model} · {quantization} · {report.device_name}"


@dataclass
class UpdatePacer:
    """When a streamed reply's next update goes out: the first and the last at once, the rest at most one per
    `interval_s` (UI_UPDATE_INTERVAL_S; 0 = every one). A held update is not lost: the reply's text is whole in each
    update, so the next one sent shows it. Each update costs Gradio ~0.6 ms of CPU on a 2-core machine (its
    postprocess, diff, queue and SSE), under the GIL the decoder's scheduler needs: with an update per token, 8
    concurrent chats on an H100 decoded at about a third of the speed (docs/sharing.md). A held token waits at most
    one interval plus the gap to the next token."""

    interval_s: float
    streams: Callable[[], int] = lambda: 1  # replies streaming now, this one included
    max_updates_per_s: float = 0.0  # UI_MAX_UPDATES_PER_S: all replies' updates together; 0 = no cap
    clock: Callable[[], float] = time.perf_counter
    _last_s: float | None = field(default=None, init=False)

    @classmethod
    def for_page(cls, ctx: PageContext) -> UpdatePacer:
        """A reply's pacer: the settings' interval, capped for all replies the page's loaded engines are streaming
        (read without waiting for a load; a remote engine's replies are not counted)."""
        server, pool = ctx.settings.server, ctx.pool
        return cls(server.ui_update_interval_s,
                   lambda: sum(int(getattr(engine, "generating", 0)) for engine in pool.engines()),
                   float(server.ui_max_updates_per_s))

    def interval(self) -> float:
        """The interval now: UI_UPDATE_INTERVAL_S, or longer while so many replies stream that their updates
        together would pass UI_MAX_UPDATES_PER_S."""
        if self.max_updates_per_s <= 0:
            return self.interval_s
        return max(self.interval_s, max(1, self.streams()) / self.max_updates_per_s)

    def remaining(self) -> float:
        """Seconds until the next update may go out (0: now). Passed to stream_chat as `hold`: the reply's thread
        sleeps that long instead of waking for every token (at 32 chats, ~3,000 wakes a second the decoder's thread
        waited for the GIL behind), and the next update carries every token since."""
        if self._last_s is None:
            return 0.0
        return max(0.0, self._last_s + self.interval() - self.clock())  # interval() is never below interval_s

    def due(self, last: bool = False) -> bool:
        now = self.clock()
        if not (last or self._last_s is None):
            elapsed = now - self._last_s
            if elapsed < self.interval_s or elapsed < self.interval():  # the replies are counted only past the first
                return False
        self._last_s = now
        return True


@dataclass(frozen=True)
class PageContext:
    """What every tab's handlers reach: built once per page by ui.build_demo."""

    settings: Settings
    pool: EnginePool
    comparison: Comparison
    exports: ExportFiles
    concurrency: int  # chat events served at once (batched decoding when above 1)
    remote: str | None  # the OpenAI-compatible server at OPENAI_BASE_URL, when set

    @classmethod
    def create(cls, engine: ChatBackend, settings: Settings, pool: EnginePool | None) -> PageContext:
        pool = pool or EnginePool(settings, primary=engine)
        return cls(settings, pool, Comparison(pool, settings), ExportFiles(settings.server.export_ttl_s),
                   engine.max_concurrent_replies, remote_choice(settings))

    @property
    def served_choices(self) -> list[str]:
        return [model_choice(m) for m in allowed_models(self.settings)] + ([self.remote] if self.remote else [])

    def served_choice(self, config: CompareConfig) -> str:
        return self.remote if config.is_remote and self.remote else model_choice(config.model_id)

    def remote_config(self) -> CompareConfig:
        """The remote side, named by the model the engine serves (OPENAI_MODEL, or the one it listed first)."""
        name = self.settings.remote.model or self.pool.get(CompareConfig(None, REMOTE_MODE))[0].report.model
        return CompareConfig(name, REMOTE_MODE)

    def config_of(self, choice: str | None, mode: str | None, attention: str = "sdpa",
                  kv_cache: str = "auto") -> CompareConfig:
        """A model choice of the page (a model, the remote engine) with its settings as a configuration."""
        if self.remote and choice == self.remote:
            return self.remote_config()
        return CompareConfig(model_id(choice), mode or "nf4", attention, kv_cache)


class Options:
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
                                    info="auto: the engine's (bf16, or int8 where the card is small); int8: ~1.8x "
                                         "the context per GiB; int4: ~3.2x, lower quality; offload: CPU RAM",
                                    elem_id="kv-cache")

    @property
    def components(self) -> list[Any]:
        return [self.system_prompt, self.max_new, self.turns, self.do_sample, self.temperature, self.top_p,
                self.top_k, self.rep, self.kv_cache]


def gen_options(engine: ChatBackend, max_new_tokens: float, do_sample: bool, temperature: float, top_p: float,
                top_k: float, repetition_penalty: float, kv_cache: str | None = None) -> Any:
    return engine.request_options(max_new_tokens=max_new_tokens, do_sample=do_sample, temperature=temperature,
                                  top_p=top_p, top_k=top_k, repetition_penalty=repetition_penalty,
                                  kv_cache=kv_cache)


def add_rows(rows: Any, stats: list[ReplyStats]) -> list[dict[str, Any]]:
    """The session's stats rows with these finished replies appended (a new list: the State is replaced)."""
    rows = rows if isinstance(rows, list) else []
    seen = {row.get("reply_id") for row in rows if isinstance(row, dict)}
    return rows + [s.as_dict() for s in stats if s.reply_id not in seen]


def stats_json(stats: ReplyStats | None) -> dict[str, Any]:
    return stats.as_dict() if stats is not None else {}


def whole(value: Any) -> Any:
    return int(value) if isinstance(value, float) and value.is_integer() else value


def session(request: gr.Request | None) -> str | None:
    return getattr(request, "session_hash", None) if request is not None else None
