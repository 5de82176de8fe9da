"""Prefix reuse on the plain path: one transformers DynamicCache kept between replies, cropped to the longest
prefix it shares with the next prompt; knows nothing of chat, the UI or other decode paths.

transformers' generate continues a cache it is given: with the full prompt ids and a full attention mask it runs
only the ids after `cache.get_seq_length()` (generation/utils.py `_prefill`), so a cache cropped to the reusable
prefix makes the prefill start there. The kept cache serves one reply at a time; a reply that finds it in use
(replies overlapping on the plain path beside a batched one) gets a fresh cache and reuses nothing.
"""

from __future__ import annotations

import threading
from typing import Any

from ..prefix_cache import PrefixCache


class PlainPrefixCache:
    """The kept DynamicCache of one model and the ids whose KV it holds."""

    def __init__(self, model: Any) -> None:
        self._model = model
        self._cache: Any = None
        self._holder: object | None = None  # the reply holding the kept cache (its stop event)
        self._unsupported = False  # sliding-window or linear-attention layers: every reply gets a fresh cache
        self._lock = threading.Lock()
        self.prefix = PrefixCache()

    def claim(self, holder: object) -> Any | None:
        """The kept cache for the reply `holder` (a fresh DynamicCache the first time), or None while another reply
        has it. The holder gives it back with `release`."""
        with self._lock:
            if self._holder is not None or self._unsupported:
                return None
            if self._cache is None:
                from transformers import DynamicCache

                cache = DynamicCache(config=self._model.config)
                if any(cache.is_sliding) or not cache.is_croppable:  # crop cannot put back what a window dropped
                    self._unsupported = True
                    return None
                self._cache = cache
            self._holder = holder
            return self._cache

    def owns(self, cache: Any) -> bool:
        return cache is not None and cache is self._cache

    def begin(self, cache: Any, prompt_ids: list[int]) -> int:
        """Crop the claimed cache to the prompt's reusable prefix; returns its length (the tokens not prefilled)."""
        held = cache.get_seq_length()
        start = min(self.prefix.begin(prompt_ids), held)
        if held > start:
            cache.crop(start - held)  # transformers 5.2x: a negative count of tokens to remove
        return start

    def release(self, holder: object, ids: list[int] | None) -> None:
        """Give the claimed cache back (a no-op unless `holder` holds it). `ids`: the sequence generate returned
        (prompt + new), whose first cache.get_seq_length() ids have their KV in it; None (an error, or a reply
        that never ran): the cache is dropped."""
        with self._lock:
            if holder is not self._holder:
                return
            if ids is None or self._cache is None:
                self.prefix.invalidate()
                self._cache = None
            else:
                self.prefix.commit(ids[:min(len(ids), self._cache.get_seq_length())])
            self._holder = None

    def drop(self) -> None:
        """Free the kept KV (an out-of-memory recovery, a model going away); a reply holding it keeps its claim."""
        with self._lock:
            self.prefix.invalidate()
            if self._holder is None:
                self._cache = None
