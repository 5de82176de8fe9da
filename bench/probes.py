"""Diagnostics over the fast decoder's public passes (FastDecoder.outside_reply and the steps inside it): teacher
forcing for logit agreement, decode-step timing, prefill-only runs and where a reply's first token came from. For the
benchmarks and the tests; no reply runs through them."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch


def forced_scores(decoder: Any, input_ids: torch.Tensor, forced: Sequence[int]) -> torch.Tensor:
    """Teacher forcing: scores (1 + len(forced), V) fp32 for the last prompt position and after feeding each
    forced token through the decode step (graphs on CUDA). Repetition penalty off; for logit agreement."""
    ids = decoder.prompt_ids(input_ids)
    with decoder.outside_reply(ids.numel() + len(forced) + 1):
        rows = [decoder.prefill_scores(ids, penalties=False).clone()]
        decoder.seek(ids.numel())
        for j, token in enumerate(forced):
            rows.append(decoder.decode_step(ids.numel() + j, token).clone())
        return torch.cat(rows, 0)


def time_decode_steps(decoder: Any, context_tokens: int, steps: int) -> float:
    """Seconds per decode step (graph replays, no host reads) at a given context length."""
    with decoder.outside_reply(context_tokens + steps):
        decoder.seek(context_tokens)
        decoder.sync()
        t0 = time.perf_counter()
        for i in range(steps):
            decoder.decode_step(context_tokens + i)
        decoder.sync()
        return (time.perf_counter() - t0) / steps


def prefill_only(decoder: Any, ids: torch.Tensor) -> torch.Tensor:
    """One prefill of `ids` into the cache as a reply runs it, no decode: the last position's scores (1, V). It only
    launches work on CUDA: call decoder.sync() before reading a clock."""
    with decoder.outside_reply():
        return decoder.prefill_scores(ids)


def prefill_timing(decoder: Any) -> dict[str, float | None]:
    """Where the last reply's first token came from, in seconds (after it: the events have completed by then).
    entry_to_prefill_s: generate() entered -> prefill launch begins (prompt checks, streamer, buffers);
    prefill_launch_s: host time launching the prefill and head (waits inside count, e.g. a synchronizing op);
    prefill_gpu_s: device time from the prefill's first kernel to the head's last (CUDA events; None on CPU);
    first_token_s: generate() entered -> token 0 read back on the host."""
    c, events = decoder.prefill_clock
    if "prefill_launched" not in c:
        return {}
    gpu = None
    if events is not None:
        events[1].synchronize()
        gpu = events[0].elapsed_time(events[1]) / 1e3
    return {"entry_to_prefill_s": c["prefill_start"] - c["entry"],
            "prefill_launch_s": c["prefill_launched"] - c["prefill_start"], "prefill_gpu_s": gpu,
            "first_token_s": c["first_token"] - c["entry"] if "first_token" in c else None}
