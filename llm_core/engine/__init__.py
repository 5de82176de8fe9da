"""The engine: ChatEngine (chat.py) serving from the DecodePath start-up chose (startup.py), concurrent replies
(scheduler.py over a runner), comparison (compare.py)."""
