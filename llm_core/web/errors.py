"""llm_core errors as OpenAI API errors, for the /v1 server (openai_api); knows nothing about Gradio."""

from __future__ import annotations

from .. import errors as e


def api_error(exc: e.LLMCoreError) -> tuple[int, str, str | None]:
    """The one place where library errors become OpenAI API errors: (HTTP status, error type, error code)."""
    if isinstance(exc, e.BusyError):
        return 429, "rate_limit_error", "server_busy"
    if isinstance(exc, e.ContextBudgetError):  # does not fit the context or the memory budget
        return 400, "invalid_request_error", "context_length_exceeded"
    if isinstance(exc, e.InputError):
        return 400, "invalid_request_error", None
    if isinstance(exc, e.OutOfMemoryError):
        return 507, "server_error", "out_of_memory"
    if isinstance(exc, e.ModelLoadError):
        return 503, "server_error", "model_unavailable"
    if isinstance(exc, e.GenerationError):
        return 500, "server_error", None
    return 400, "invalid_request_error", None  # SettingsError: a request option outside what the settings allow
