"""Prefix reuse bookkeeping: which token ids have their KV at positions 0..L-1 of one cache; knows nothing of tensors.

A decoder that keeps one KV cache between replies asks `begin(prompt_ids)` how many leading prompt tokens it may
skip (their KV is already at those positions), prefills only the rest, and on a clean end `commit`s the ids whose
KV it wrote. The skipped count is the longest common prefix of the prompt with the cached ids, capped at
len(prompt) - 1: the last prompt token always runs, since its logits choose the first new token. What a reply
generates counts except its last token, whose KV no decode step wrote (the loop stops after sampling it).

Anything that writes the cache outside a reply (warm-up, re-allocation, a benchmark's pass, release) or may have
left it half-written (an exception, a lost device) calls `invalidate`. The `key` says what format the KV was
written in (model, weights, KV dtype): a prompt asked under another key reuses nothing. This is llama.cpp server's
`cache_prompt` for one cache; a paged block pool with chained block keys replaces it with the same questions.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Sequence


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two id sequences."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PrefixCache:
    """The ids whose KV sits at positions 0..len-1 of one cache, and the key they were written under. Thread-safe;
    the decoder serializes the replies that write its cache."""

    def __init__(self, key: Hashable = None) -> None:
        self._key = key
        self._ids: tuple[int, ...] = ()
        self._lock = threading.Lock()

    @property
    def ids(self) -> tuple[int, ...]:
        """The cached ids (positions 0..len-1)."""
        with self._lock:
            return self._ids

    def reusable(self, prompt_ids: Sequence[int], key: Hashable = None) -> int:
        """Prompt tokens whose KV the cache holds already: the longest common prefix, at most len(prompt) - 1;
        0 under another key. Changes nothing."""
        with self._lock:
            return self._reusable(prompt_ids, key)

    def _reusable(self, prompt_ids: Sequence[int], key: Hashable) -> int:
        if key != self._key or not prompt_ids:
            return 0
        return min(common_prefix(self._ids, prompt_ids), len(prompt_ids) - 1)

    def begin(self, prompt_ids: Sequence[int], key: Hashable = None) -> int:
        """A reply is about to write the cache from the returned position on: `reusable(prompt_ids, key)`, and from
        now only those ids stay marked (every later position is overwritten or stale)."""
        with self._lock:
            start = self._reusable(prompt_ids, key)
            self._ids = tuple(int(i) for i in prompt_ids[:start])
            self._key = key
            return start

    def commit(self, ids: Sequence[int], key: Hashable = None) -> None:
        """The KV of `ids` now sits at positions 0..len(ids)-1 (a reply ended cleanly, or was stopped between
        steps): the prompt and the generated ids except the last."""
        with self._lock:
            self._ids = tuple(int(i) for i in ids)
            self._key = key

    def invalidate(self) -> None:
        """Nothing in the cache may be reused."""
        with self._lock:
            self._ids = ()
