"""The chat backend interface: what the UI, the /v1 API and Compare need from an engine. Knows nothing about Gradio.

Two implementations: `engine.chat.ChatEngine` (a model loaded in this process) and `remote.RemoteEngine` (a running
OpenAI-compatible server: vLLM, SGLang, llama.cpp's server, another instance of this demo).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from ..config import GenerationSettings, Settings
from ..history import Turn
from .chat import ReplyUpdate


class ChatBackend(Protocol):
    settings: Settings

    @property
    def report(self) -> Any:
        """What serves the replies (LoadReport or RemoteReport): model, quantization, device_name, as_markdown()."""

    @property
    def max_concurrent_replies(self) -> int:
        """Replies this backend serves at once: the UI's queue concurrency."""

    def request_options(self, **options: Any) -> GenerationSettings:
        """Per-request generation options on the configured defaults, validated (InputError if bad)."""

    def stream_chat(self, message: Any, history: list[Turn], *, gen: GenerationSettings | None = None,
                    history_turns: int | None = None, system_prompt: str | None = "",
                    request_id: str | None = None, person: str | None = None,
                    on_wait: Callable[[int], None] | None = None, raw_prompt: bool = False,
                    render_prompt: Callable[[list[dict[str, str]]], Any] | None = None,
                    group: str | None = None, hold: Callable[[], float] | None = None) -> Iterator[ReplyUpdate]:
        """Stream a reply (raw_prompt: continue `message` as plain text, no chat template); the last update has
        done=True and the reply's final numbers. `on_wait(ahead)` is told how many requests go first while this one
        waits for its turn (engines that queue). Stop names `request_id`; limits and fair turns count `person`
        (llm_core.security.person_of), or `request_id` when unset. `render_prompt` (local engines) renders the
        prompt instead of the chat template; replies of one `group` count as one request of the person.
        `hold()` (local engines): seconds the caller has no use for a next update, asked after each one; the
        reply's thread sleeps meanwhile instead of waking for every token, and the next update carries
        every token since (llm_core.streams.TokenStreams.token_batches)."""

    def wait_estimate_s(self, ahead: int) -> float | None:
        """About how many seconds a request with `ahead` requests before it waits; None when unknown."""

    def stop(self, request_id: str | None) -> bool:
        """Halt the reply running for `request_id`; True if one was running."""

    def exclusive(self) -> contextlib.AbstractContextManager[None]:
        """Hold the backend with no reply running (e.g. to unload it)."""
