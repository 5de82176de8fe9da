"""Kernel timing as the decode step runs them: inside a CUDA graph, no Python launch costs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def time_in_cuda_graph(fn: Callable[[], Any], device: torch.device | None = None, *, reps: int = 1,
                       replays: int = 20, warmups: int = 1) -> float:
    """Microseconds per call of `fn` as a decode step runs it: called `warmups` times eagerly (compile, autotune),
    then `reps` times captured in one CUDA graph, replayed once, then timed over `replays` replays. Python launch
    costs don't count. Used by the 4-bit kernel pick and the kernel benchmark."""
    for _ in range(warmups):
        fn()
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize(device)
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    stop.record()
    stop.synchronize()
    return start.elapsed_time(stop) * 1e3 / (replays * reps)
