"""HTTP serving beside the Gradio UI: the guard in front of its routes (guard.py) and the OpenAI-compatible
API under /v1 (openai_api.py). Plain ASGI/FastAPI; never imports gradio."""
