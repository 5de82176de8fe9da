"""The Gradio UI over llm_core, one module per tab (chat, compare, fit, stats); Gradio only, never torch.

llm_core errors become Gradio errors in ui.errors and nowhere else; build_demo(engine, settings) -> gr.Blocks."""

from .page import build_demo

__all__ = ["build_demo"]
