"""The engine: ChatEngine (chat.py), concurrent replies (scheduler.py over a runner), comparison (compare.py)."""
