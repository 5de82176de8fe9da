"""The one place where llm_core errors become Gradio errors: bad input a warning in the page, failures an error."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

import gradio as gr

from llm_core.errors import ContextBudgetError, InputError, LLMCoreError, SettingsError


class BadInputError(gr.Error):
    """A library error the user can fix (empty, too long, out of range, does not fit, busy): the page shows it as
    a warning (see `in_page`); API callers get it as any error."""


def user_error(exc: LLMCoreError) -> gr.Error:
    """A library error as the message the UI shows (and API clients of the Gradio endpoints get)."""
    title = type(exc).__name__.replace("Error", " error").strip()
    bad_input = isinstance(exc, (InputError, ContextBudgetError, SettingsError))
    return (BadInputError if bad_input else gr.Error)(str(exc), title=title)


def in_page(handler: Callable[..., Iterator[tuple[Any, ...]]], outputs: int) -> Callable[..., Any]:
    """The page's twin of an API handler: bad input found before anything was shown becomes a warning toast and
    leaves every output as it was (a failed event covers its outputs with error placeholders, hiding the chat).
    Same signature (functools.wraps), so Gradio passes the same inputs and the request."""

    @functools.wraps(handler)
    def wrapped(*args: Any, **kwargs: Any) -> Iterator[tuple[Any, ...]]:
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

    return wrapped


def warn_on_bad_input(handler: Callable[..., Any]) -> Callable[..., Any]:
    """For a handler that returns one value: bad input becomes a warning toast and the output stays as it was."""

    @functools.wraps(handler)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        try:
            return handler(*args, **kwargs)
        except BadInputError as exc:
            gr.Warning(exc.message)
            return gr.skip()

    return wrapped
