"""Error types of llm_core: few classes, each message written for the person using the demo.

app.py translates these into UI messages in one place; nothing else in llm_core catches them.
"""

from __future__ import annotations


class LLMCoreError(Exception):
    """Base class: every error llm_core raises on purpose. `str(err)` is safe to show a user."""


class SettingsError(LLMCoreError):
    """A setting is unknown, malformed or contradicts another; the message names the setting and the fix."""


class ModelLoadError(LLMCoreError):
    """The model or tokenizer could not be found, converted or loaded with the requested settings."""


class InputError(LLMCoreError):
    """A request is malformed: empty message, out-of-range option, malformed history."""


class BusyError(InputError):
    """The request was refused because the server (or this person) is busy, or because of too many failed logins;
    the same request can be retried later, after `retry_after_s` when that is known."""

    def __init__(self, message: str, *, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class AuthError(LLMCoreError):
    """A request that needs a login (or API key) came without a valid one."""


class ContextBudgetError(LLMCoreError):
    """The request cannot fit the model's context (or memory) budget even after dropping old turns."""


class GenerationError(LLMCoreError):
    """Generation failed or stalled; the conversation so far is kept and the next request can run."""


class OutOfMemoryError(GenerationError):
    """The device ran out of memory during a reply; memory was freed and the conversation kept."""


class ReplyStopped(LLMCoreError):
    """Stop was pressed while the request was still waiting for its turn: nothing was generated."""
