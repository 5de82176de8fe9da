"""Memory: what a reply will need (model.py, pure arithmetic), what it did need (device.py: peaks, freeing, OOM),
and the KV caches themselves (kv_cache.py)."""
