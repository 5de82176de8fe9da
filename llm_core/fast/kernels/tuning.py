"""What a Triton autotuner picked, for the benchmark records: shared by the kernels that autotune per shape."""

from __future__ import annotations

from typing import Any


def tuned_pick(tuner: Any, n: int, k: int, meta: tuple[str, ...], **keys: Any) -> dict[str, Any] | None:
    """The config `tuner` (a triton.autotune object, or None without Triton) chose for the first two key values
    (n, k) and, where given, the other key arguments named in `keys` (e.g. XPLANAR=True: the planar form's pick,
    not the plain one's for the same shape), as {meta name: value, ..., "num_warps": ...}; None before it has tuned
    that case."""
    if tuner is None:
        return None
    names = list(getattr(tuner, "keys", ()))
    unknown = [name for name in keys if name not in names]
    if unknown:
        raise ValueError(f"{unknown} are not keys of this autotuner ({names})")
    for key, cfg in tuner.cache.items():
        if key[0] == n and key[1] == k and all(key[names.index(name)] == value for name, value in keys.items()):
            return {**{name: cfg.kwargs[name] for name in meta}, "num_warps": cfg.num_warps}
    return None
