"""What a Triton autotuner picked, for the benchmark records: shared by the kernels that autotune per shape."""

from __future__ import annotations

from typing import Any


def tuned_pick(tuner: Any, n: int, k: int, meta: tuple[str, ...]) -> dict[str, Any] | None:
    """The config `tuner` (a triton.autotune object, or None without Triton) chose for the first two key values
    (n, k), as {meta name: value, ..., "num_warps": ...}; None before it has tuned that shape."""
    if tuner is None:
        return None
    for key, cfg in tuner.cache.items():
        if key[0] == n and key[1] == k:
            return {**{name: cfg.kwargs[name] for name in meta}, "num_warps": cfg.num_warps}
    return None
