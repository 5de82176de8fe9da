"""The engine: ChatEngine (chat.py), concurrent replies (serving.py), side-by-side comparison (compare.py)."""
