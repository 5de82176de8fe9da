"""llm_core: run a Hugging Face causal LM in 4-bit, stream chat replies inside a memory budget, and measure each one.

The public API, importable from here; it knows nothing of the UI (never imports gradio):

    from llm_core import ChatEngine, Settings
    engine = ChatEngine.load(Settings.from_env())          # loads and warms up the model (never at import time)
    for update in engine.stream_chat("Hello!", []):          # ReplyUpdate: text so far, ReplyStats so far
        print(update.text, update.stats.ttft_s)

Names resolve lazily (PEP 562), so `import llm_core.config` stays light and importing the package loads no model
and no torch until an engine name is used. Pipeline, module by module: config -> loading (models) -> history ->
memory -> engine (chat, serving, compare) -> fast (the CUDA decode path) -> metrics.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS: dict[str, str] = {
    # settings
    "Settings": "config", "GenerationSettings": "config", "ModelSettings": "config", "parse_auth": "config",
    # errors (every error the library raises is an LLMCoreError with a message written for the user)
    "LLMCoreError": "errors", "SettingsError": "errors", "ModelLoadError": "errors", "InputError": "errors",
    "ContextBudgetError": "errors", "GenerationError": "errors", "OutOfMemoryError": "errors",
    # chat input
    "Turn": "history", "content_to_text": "history", "turns_from_messages": "history", "ERROR_TITLE": "history",
    # the engine
    "ChatEngine": "engine.chat", "ReplyUpdate": "engine.chat", "PreparedPrompt": "engine.runners",
    "DecodeBackend": "engine.runners", "check_history_size": "history",
    "CompareConfig": "engine.compare", "Comparison": "engine.compare", "EnginePool": "engine.compare",
    "allowed_models": "engine.compare",
    # what each reply cost
    "ReplyStats": "metrics", "export_csv": "metrics", "export_json": "metrics", "format_bytes": "metrics",
}

__all__ = ["ChatEngine", "CompareConfig", "Comparison", "ContextBudgetError", "DecodeBackend", "ERROR_TITLE",
           "EnginePool", "GenerationError", "GenerationSettings", "InputError", "LLMCoreError", "ModelLoadError",
           "ModelSettings", "OutOfMemoryError", "PreparedPrompt", "ReplyStats", "ReplyUpdate", "Settings",
           "SettingsError", "Turn", "allowed_models", "check_history_size", "content_to_text", "export_csv",
           "export_json", "format_bytes", "parse_auth", "turns_from_messages"]  # == sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'llm_core' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # resolve once
    return value


if TYPE_CHECKING:  # for type checkers and editors: the same names, eagerly
    from .config import GenerationSettings, ModelSettings, Settings, parse_auth
    from .engine.chat import ChatEngine, ReplyUpdate
    from .engine.compare import CompareConfig, Comparison, EnginePool, allowed_models
    from .engine.runners import DecodeBackend, PreparedPrompt
    from .errors import (
        ContextBudgetError,
        GenerationError,
        InputError,
        LLMCoreError,
        ModelLoadError,
        OutOfMemoryError,
        SettingsError,
    )
    from .history import ERROR_TITLE, Turn, check_history_size, content_to_text, turns_from_messages
    from .metrics import ReplyStats, export_csv, export_json, format_bytes
