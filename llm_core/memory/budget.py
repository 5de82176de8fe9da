"""The reply budget: how many device bytes this process may use, and what one reply may do within them (how many prompt
tokens, how many new ones), over the peak arithmetic of llm_core.memory.model. Pure arithmetic but for reading the
device's free memory in `default_budget_bytes`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from ..errors import ContextBudgetError, SettingsError
from .model import (
    DEFAULT_CPU_MARGIN_BYTES,
    DEFAULT_CUDA_MARGIN_BYTES,
    ModelMemoryFacts,
    PeakPrediction,
    QuantizedKVSpec,
    human_bytes,
    predict_peak_bytes,
)

# --- budget ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MemoryBudget:
    """The most device bytes a reply may use in total, weights included (what the allocator may reserve)."""

    budget_bytes: int
    source: str = "setting"  # "setting" or how it was derived, shown next to the context meter

    def __post_init__(self) -> None:
        if self.budget_bytes <= 0:
            raise SettingsError(f"The memory budget must be positive, got {self.budget_bytes} bytes.")

    @classmethod
    def from_device(cls, device: torch.device | str, margin_bytes: int | None = None) -> MemoryBudget:
        budget = default_budget_bytes(device, margin_bytes)
        return cls(budget, f"free on {torch.device(device).type} after loading, minus a margin")

    def fits(self, prediction: PeakPrediction) -> bool:
        return prediction.total_bytes <= self.budget_bytes


def default_budget_bytes(device: torch.device | str, margin_bytes: int | None = None) -> int:
    """Bytes this process may use in total: on CUDA what the allocator holds now (the loaded weights) plus what the
    device has free, capped by torch.cuda.set_per_process_memory_fraction, minus `margin_bytes`; on CPU the RAM
    the process holds plus what is available (psutil), minus the margin. Call it after loading the model."""
    device = torch.device(device)
    if device.type == "cuda":
        margin = DEFAULT_CUDA_MARGIN_BYTES if margin_bytes is None else margin_bytes
        index = device.index if device.index is not None else torch.cuda.current_device()
        free_bytes, total_bytes = torch.cuda.mem_get_info(index)
        held = torch.cuda.memory_reserved(index)
        available = held + free_bytes
        fraction_of = getattr(torch.cuda, "get_per_process_memory_fraction", None)
        if fraction_of is not None:
            available = min(available, int(fraction_of(index) * total_bytes))
        return max(0, available - margin)
    import psutil

    margin = DEFAULT_CPU_MARGIN_BYTES if margin_bytes is None else margin_bytes
    held = psutil.Process().memory_info().rss
    return max(0, held + psutil.virtual_memory().available - margin)


def max_context_tokens(facts: ModelMemoryFacts, budget_bytes: int, max_new_tokens: int, kv_cache: str = "bf16", *,
                       prefill_chunk_tokens: int | None = None, quant: QuantizedKVSpec | None = None) -> int:
    """Largest prompt (tokens) whose reply of `max_new_tokens` is predicted to fit `budget_bytes`, within the
    model's context length; 0 when not even a one-token prompt fits. Non-decreasing in the budget."""

    def fits(p: int) -> bool:
        pred = predict_peak_bytes(facts, p, max_new_tokens, kv_cache, prefill_chunk_tokens=prefill_chunk_tokens,
                                  quant=quant)
        return pred.total_bytes <= budget_bytes

    hi = max(0, facts.context_length - max(0, int(max_new_tokens)))
    if hi == 0 or not fits(1):
        return 0
    lo = 1  # fits(lo) holds; the predicted peak is non-decreasing in the prompt, so bisect
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclass(frozen=True)
class ReplyPlan:
    """What the guard allows for one reply. The engine drops oldest whole turns until the prompt has at most
    `allowed_prompt_tokens` tokens, then generates at most `allowed_new_tokens` tokens."""

    fits: bool
    allowed_prompt_tokens: int
    allowed_new_tokens: int
    predicted: PeakPrediction
    message: str  # for the user: empty when nothing was cut, else what was cut and why
    budget_bytes: int = 0
    requested_prompt_tokens: int = 0
    requested_new_tokens: int = 0

    @property
    def trims_prompt(self) -> bool:
        return self.allowed_prompt_tokens < self.requested_prompt_tokens

    @property
    def lowers_new_tokens(self) -> bool:
        return self.allowed_new_tokens < self.requested_new_tokens


def plan_reply(
    facts: ModelMemoryFacts,
    budget_bytes: int,
    prompt_tokens: int,
    max_new_tokens: int,
    kv_cache: str = "bf16",
    *,
    min_prompt_tokens: int | None = None,
    min_new_tokens: int = 1,
    prefill_chunk_tokens: int | None = None,
    quant: QuantizedKVSpec | None = None,
) -> ReplyPlan:
    """Fit one reply into `budget_bytes`: keep it as asked if it fits; else allow fewer prompt tokens (the engine
    drops oldest whole turns) down to `min_prompt_tokens` (system prompt + newest message: what cannot be dropped;
    default: the whole prompt); else also lower max_new_tokens, to no fewer than `min_new_tokens`; else refuse."""
    kw: dict[str, Any] = dict(prefill_chunk_tokens=prefill_chunk_tokens, quant=quant)
    p, n = int(prompt_tokens), int(max_new_tokens)
    floor_p = p if min_prompt_tokens is None else min(p, int(min_prompt_tokens))
    common = dict(budget_bytes=int(budget_bytes), requested_prompt_tokens=p, requested_new_tokens=n)
    budget_text = human_bytes(budget_bytes)

    asked = predict_peak_bytes(facts, p, n, kv_cache, **kw)
    if asked.total_bytes <= budget_bytes:
        return ReplyPlan(True, p, n, asked, "", **common)

    fit_p = max_context_tokens(facts, budget_bytes, n, kv_cache, **kw)
    if fit_p >= floor_p and fit_p > 0:
        pred = predict_peak_bytes(facts, fit_p, n, kv_cache, **kw)
        msg = (f"Older turns were dropped to fit the memory budget ({budget_text}): the prompt may use at most "
               f"{fit_p:,} of its {p:,} tokens with a reply of up to {n:,} tokens "
               f"(predicted peak {human_bytes(asked.total_bytes)} as asked).")
        return ReplyPlan(True, fit_p, n, pred, msg, **common)

    # Not even the newest message fits with n new tokens: keep only it and lower n (largest that fits).
    lo, hi = 0, n - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if predict_peak_bytes(facts, floor_p, mid, kv_cache, **kw).total_bytes <= budget_bytes:
            lo = mid
        else:
            hi = mid - 1
    if lo >= max(1, min_new_tokens):
        pred = predict_peak_bytes(facts, floor_p, lo, kv_cache, **kw)
        dropped = "All older turns were dropped and the reply was shortened" if floor_p < p else \
            "The reply was shortened"
        msg = f"{dropped}: max_new_tokens was lowered from {n:,} to {lo:,} to fit the memory budget ({budget_text})."
        return ReplyPlan(True, floor_p, lo, pred, msg, **common)

    pred = predict_peak_bytes(facts, floor_p, max(1, min_new_tokens), kv_cache, **kw)
    most = max_context_tokens(facts, budget_bytes, max(1, min_new_tokens), kv_cache, **kw)
    hint = " Try KV cache mode 'int8'." if kv_cache == "bf16" else ""
    msg = (f"This message does not fit in memory: it needs {floor_p:,} prompt tokens (system prompt and your "
           f"message), predicted peak {human_bytes(pred.total_bytes)}, but the budget of {budget_text} fits at most "
           f"{most:,} prompt tokens with kv cache '{kv_cache}'. Shorten the message or raise the memory budget."
           + hint + " The conversation is kept.")
    return ReplyPlan(False, 0, 0, pred, msg, **common)


def require_fit(plan: ReplyPlan) -> ReplyPlan:
    """The plan itself when the reply can run; raises ContextBudgetError with the plan's message otherwise."""
    if not plan.fits:
        raise ContextBudgetError(plan.message)
    return plan


def refit_reserve(facts: ModelMemoryFacts, predicted: PeakPrediction, measured_reserved_bytes: int,
                  headroom: float = 1.10) -> ModelMemoryFacts:
    """Facts whose reserve covers a measured peak of reserved bytes (never lowered): after each reply the engine
    feeds back torch.cuda.max_memory_reserved (less the blocks already cached free when it started) so the next
    plans account for this allocator's reality.

    What the prediction's reserve did not cover is learned as a fixed number of bytes (reserve_fixed_bytes), not
    as a larger fraction: on the H200 under 8-24 GiB caps (bench/results/2026-12-01-h200-cards.json) reserved
    minus allocated stayed at ~1.0-1.4 GiB whatever the prompt length (2.9k to 32.7k tokens), i.e. fragments of
    start-up and graph pools, not a share of each reply's activations. Learned as a fraction from the 2-token
    warm-up reply, the same bytes had been multiplied onto every 2k-token chunk's activations (fraction 4.0) and
    had every message of an 8 GiB card refused."""
    excess = int(measured_reserved_bytes) - predicted.total_bytes
    if excess <= 0:
        return facts
    return replace(facts, reserve_fixed_bytes=facts.reserve_fixed_bytes + int(headroom * excess))
