"""HTTP serving beside the Gradio UI: the guard in front of its routes (guard.py). Plain ASGI/FastAPI, no gradio."""
