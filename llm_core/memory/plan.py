"""Sizing the fast path's static KV cache from a memory budget: pure arithmetic over llm_core.memory.model.

The fast path allocates its KV cache once, for T tokens, before any reply. T is the largest number of tokens such
that a reply filling the whole cache (prompt T - n, n new tokens) is predicted to fit the budget with everything
else that is resident or transient at its peak:

    budget >= weights + resident (buffers, decode and prefill CUDA-graph pools) + cuBLAS workspace
              + static block(T) + the largest prefill chunk's activations over T - n tokens of history
              + logits + allocator reserve (on the activations, not on the one-time static block)

so every reply the cache can hold fits the budget, and the block is counted once (never sized from the whole
budget for a prompt and counted again on top of that prompt's prefill). T never exceeds the
model's context. The resident term is estimated before warm-up (`fast_resident_estimate`) and measured after it;
the engine re-plans with the measured value and shrinks the cache if needed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial

from ..errors import ContextBudgetError
from .model import (
    MiB,
    ModelMemoryFacts,
    forward_activation_bytes,
    human_bytes,
    logits_bytes,
    predict_peak_bytes,
    static_kv_bytes,
)

CACHE_ROUND_TOKENS = 16  # FastDecoder rounds its cache to multiples of 16 tokens
MIN_GROW_TOKENS = 256  # size_cache_by_measurement measures again only for a headroom of at least this many tokens
MIN_FAST_CACHE_TOKENS = 256  # below this the fast path is not worth its graphs: the engine says so and stops
PREFILL_BUCKET_TOKENS = 64  # llm_core.fast.options.PREFILL_BUCKET_TOKENS (kept here: this module imports no torch)
# Where these three numbers come from (the measurements behind them): docs/memory.md, "The plan's constants".
# The fast path's small buffers and its decode graphs' pool (one step's temporaries, split-K attention partials).
FAST_FIXED_RESIDENT_BYTES = 64 * MiB
# Reserved but free after the CUDA warm-up beyond the graph pools' estimate (allocator fragments that cannot be
# handed back): what the plan and `python -m llm_core.fit` assume until start-up measures it. Since start-up re-lays
# the weights end to end (llm_core.memory.compact) the whole resident extra measured 0.14-0.15 GB on an emulated 8 GiB
# card (H100, Llama-2-7B and Llama-3-8B, bench/results/2026-12-05-s5-h100-cards-*.json; held-free 0.06-0.07 GB):
# 128 MiB keeps the estimate ~1.4x over it. Before, 0.93-0.97 GB (Llama-2-7B) and 0.43 GB (Llama-3-8B) of holes were
# held there (1,024 MiB, 1.25 GiB before that); where the compaction is skipped (host memory short) the plan is
# that much optimistic and the start-up measurement corrects it.
CUDA_HELD_FREE_BYTES = 128 * MiB
# Kept free below the budget when the cache is sized by measurement: a real reply may peak a little above the profile.
MEASURED_SAFETY_BYTES = 128 * MiB
# KV_CACHE=auto keeps bf16 where the card holds the model's context up to this many tokens in bf16, else int8
AUTO_KV_BF16_TOKENS = 32768
# NF4_FRAG=auto: the largest share of the batched KV slots' tokens its copy of the codes may take (resolve_nf4_frag)
AUTO_FRAG_POOL_SHARE = 0.10
# What a user can change when the fast path's cache does not fit (said by every error that says so)
FAST_CACHE_ADVICE = ("Use KV_CACHE=int8, a lower PREFILL_GRAPH_TOKENS or PREFILL_CHUNK_TOKENS, a smaller model, "
                     "or DECODE_PATH=plain.")


def fast_resident_estimate(facts: ModelMemoryFacts, prefill_graph_tokens: int, cache_tokens: int) -> int:
    """Device bytes the fast path holds beyond the weights and its KV block, before it is measured: the padded
    prefill graphs' pool (the largest bucket's activations and its head's logits), the decode graphs and buffers,
    and on CUDA the reserved memory the allocator cannot give back (CUDA_HELD_FREE_BYTES)."""
    top = min(int(prefill_graph_tokens), int(cache_tokens)) // PREFILL_BUCKET_TOKENS * PREFILL_BUCKET_TOKENS
    pool = forward_activation_bytes(facts, top) + logits_bytes(facts, 1) if top > 0 else 0
    held = CUDA_HELD_FREE_BYTES if facts.device_type == "cuda" else 0
    return pool + FAST_FIXED_RESIDENT_BYTES + facts.vocab_size * (1 + 4 + 4 + 4) + held


@dataclass(frozen=True)
class CachePlan:
    """The fast path's static cache for a budget: `tokens` of capacity (prompt + reply), and what it was planned on."""

    tokens: int
    static_bytes: int
    budget_bytes: int
    max_new_tokens: int
    resident_extra_bytes: int
    peak_bytes: int  # predicted peak of a reply that fills the cache (<= budget_bytes when tokens > 0)
    capped_by_context: bool

    @property
    def max_prompt_tokens(self) -> int:
        return max(0, self.tokens - self.max_new_tokens)


def static_cache_plan(facts: ModelMemoryFacts, budget_bytes: int, *, max_new_tokens: int,
                      prefill_chunk_tokens: int | None, kv_cache: str = "bf16",
                      resident_extra_bytes: int | None = None, prefill_graph_tokens: int = 0) -> CachePlan:
    """The largest static cache (multiple of 16 tokens, at most the model's context) whose fullest reply fits.

    `resident_extra_bytes`: what the fast path holds besides weights and cache (measured after warm-up); None =
    `fast_resident_estimate` for `prefill_graph_tokens`. tokens = 0 when not even MIN_FAST_CACHE_TOKENS fit."""
    n = max(1, int(max_new_tokens))
    base = replace(facts, static_kv_cache=kv_cache)

    def facts_for(t: int) -> ModelMemoryFacts:
        extra = resident_extra_bytes if resident_extra_bytes is not None else fast_resident_estimate(
            base, prefill_graph_tokens, t)
        return replace(base, static_kv_tokens=t, resident_extra_bytes=extra)

    def peak(t: int) -> int:
        reply_new = min(n, t - 1)
        return predict_peak_bytes(facts_for(t), t - reply_new, reply_new, kv_cache,
                                  prefill_chunk_tokens=prefill_chunk_tokens).total_bytes

    r = CACHE_ROUND_TOKENS
    ceiling = max(0, int(facts.context_length)) // r * r or int(facts.context_length)
    capped = peak(ceiling) <= budget_bytes if ceiling > 0 else False
    if capped:
        best = ceiling
    else:
        lo, hi = 0, ceiling // r  # in units of r tokens; peak() is non-decreasing in t
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if peak(mid * r) <= budget_bytes:
                lo = mid
            else:
                hi = mid - 1
        best = lo * r
    if best < min(MIN_FAST_CACHE_TOKENS, ceiling):
        best = 0
    used = facts_for(best) if best else facts_for(0)
    return CachePlan(tokens=best, static_bytes=static_kv_bytes(used, best), budget_bytes=int(budget_bytes),
                     max_new_tokens=n, resident_extra_bytes=used.resident_extra_bytes,
                     peak_bytes=peak(best) if best else 0, capped_by_context=capped)


def resolve_prefill_graph_tokens(setting: int | None, facts: ModelMemoryFacts, budget_bytes: int, *,
                                 max_new_tokens: int, prefill_chunk_tokens: int | None, kv_cache: str = "bf16"
                                 ) -> int:
    """PREFILL_GRAPH_TOKENS as the fast path uses it: the setting when given; auto (None) = the default
    (DEFAULT_PREFILL_GRAPH_TOKENS) where the model's whole context fits beside the graphs, else the small-card
    size. The graphs' pool holds the largest bucket's activations (and, for 4-bit weights, the dequantized gate/up
    weight) for good: on a card where memory bounds the cache that is context taken from every chat, for a
    TTFT gain of tens of milliseconds on prompts between the two sizes."""
    from ..config import DEFAULT_PREFILL_GRAPH_TOKENS, SMALL_CARD_PREFILL_GRAPH_TOKENS

    if setting is not None:
        return int(setting)
    plan = static_cache_plan(facts, budget_bytes, max_new_tokens=max_new_tokens,
                             prefill_chunk_tokens=prefill_chunk_tokens, kv_cache=kv_cache,
                             prefill_graph_tokens=DEFAULT_PREFILL_GRAPH_TOKENS)
    return DEFAULT_PREFILL_GRAPH_TOKENS if plan.capped_by_context else SMALL_CARD_PREFILL_GRAPH_TOKENS


def resolve_prefill_chunk_tokens(setting: int | None, facts: ModelMemoryFacts, budget_bytes: int, *,
                                 max_new_tokens: int, kv_cache: str = "bf16") -> int | None:
    """PREFILL_CHUNK_TOKENS as the engine uses it (None = one pass): the setting when given (0 = off); auto (None) =
    DEFAULT_PREFILL_CHUNK_TOKENS where the model's whole context fits the fast path's cache with the default
    prefill chunks and graphs, else SMALL_CARD_PREFILL_CHUNK_TOKENS. The last chunk of a long prompt is every
    reply's working-memory peak (its MLP activations and attention over the whole history): on a card where memory
    bounds the cache, halving it gives the cache the difference (Llama-3-8B NF4 on 8 GiB: ~1,500 more int8-cache
    tokens by this arithmetic, ~200 on Llama-2-7B), for one more pass of weight dequantization per 1,024 prompt
    tokens in the prefill."""
    from ..config import (
        DEFAULT_PREFILL_CHUNK_TOKENS,
        DEFAULT_PREFILL_GRAPH_TOKENS,
        SMALL_CARD_PREFILL_CHUNK_TOKENS,
    )

    if setting is not None:
        return int(setting) or None
    plan = static_cache_plan(facts, budget_bytes, max_new_tokens=max_new_tokens,
                             prefill_chunk_tokens=DEFAULT_PREFILL_CHUNK_TOKENS, kv_cache=kv_cache,
                             prefill_graph_tokens=DEFAULT_PREFILL_GRAPH_TOKENS)
    return DEFAULT_PREFILL_CHUNK_TOKENS if plan.capped_by_context else SMALL_CARD_PREFILL_CHUNK_TOKENS


AUTO_ON_PLAIN = ("KV cache bf16 (KV_CACHE=auto): the plain path's cache grows with the reply, and auto quantizes "
                 "only the CUDA fast path's (int8 and int4 can be asked for, decoding slower there).")


def choose_kv_cache(setting: str, facts: ModelMemoryFacts, budget_bytes: int, *, max_new_tokens: int,
                    prefill_chunk_tokens: int | None = None, prefill_graph_tokens: int | None = None,
                    fast_path: bool = True) -> tuple[str, str]:
    """(the KV cache, one sentence saying why) for KV_CACHE=`setting`. auto on the CUDA fast path: bf16 where its
    static cache planned in bf16 (with the prefill chunks and graphs auto would pick for it) holds the model's whole
    context or AUTO_KV_BF16_TOKENS, whichever is less; else int8 (about 1.8x the tokens per byte); never int4 (that
    is asked for). auto elsewhere (`fast_path` False: the plain or CPU path): bf16. Other settings are kept as they
    are. `prefill_*`: the settings (None = auto)."""
    if setting != "auto":
        return setting, f"KV cache {setting} (KV_CACHE={setting})."
    if not fast_path:
        return "bf16", AUTO_ON_PLAIN
    want = min(int(facts.context_length), AUTO_KV_BF16_TOKENS)
    chunk = resolve_prefill_chunk_tokens(prefill_chunk_tokens, facts, budget_bytes, max_new_tokens=max_new_tokens,
                                         kv_cache="bf16")
    graphs = resolve_prefill_graph_tokens(prefill_graph_tokens, facts, budget_bytes, max_new_tokens=max_new_tokens,
                                          prefill_chunk_tokens=chunk, kv_cache="bf16")
    held = static_cache_plan(facts, budget_bytes, max_new_tokens=max_new_tokens, prefill_chunk_tokens=chunk,
                             kv_cache="bf16", prefill_graph_tokens=graphs).tokens
    whole = "the model's whole context" if want == int(facts.context_length) else f"{want:,} tokens"
    if held >= want:
        return "bf16", f"KV cache bf16 (KV_CACHE=auto): the budget holds {whole} ({want:,} tokens) in bf16."
    return "int8", (f"KV cache int8 (KV_CACHE=auto): in bf16 the budget would hold {held:,} of the {want:,} tokens "
                    f"auto asks for ({whole}), and int8 holds about 1.8x more per byte.")


def require_cache(plan: CachePlan, facts: ModelMemoryFacts) -> CachePlan:
    """The plan itself when the fast path gets a usable cache; ContextBudgetError that says why otherwise."""
    if plan.tokens:
        return plan
    raise ContextBudgetError(
        f"The model's weights ({human_bytes(facts.weights_bytes)}) leave no room in the memory budget "
        f"({human_bytes(plan.budget_bytes)}) for a KV cache of {MIN_FAST_CACHE_TOKENS} tokens with the fast path's "
        f"prefill and graphs ({human_bytes(plan.resident_extra_bytes)}). Use a smaller model, QUANTIZATION=nf4, "
        "KV_CACHE=int8, a lower PREFILL_GRAPH_TOKENS or a larger VRAM_BUDGET.")


def size_cache_by_measurement(measure: Callable[[int], int | None], tokens: int, bytes_per_token: int,
                              budget_bytes: int, context_length: int, *, attempts: int = 10,
                              sequences: int = 1) -> int:
    """The static cache size, in tokens, found by measuring instead of predicting: `measure(t)` re-sizes the
    cache to t tokens, runs the worst reply it allows and returns the device's peak reserved bytes (None: it ran
    out of memory), which must stay MEASURED_SAFETY_BYTES under the budget. Over that: shrink by the excess
    (+10%, at least 1/32 of the cache), or to half after an OOM (no excess was measured: shrinking by a quarter
    ran out of attempts from a start 14x too large, Llama-3-8B bf16 on 8 GiB); under it by more than max(256
    tokens, 1/16 of the cache) and short of the context: grow once by 90% of the headroom, then measure again.
    `sequences`: how many sequences one unit of `tokens` stands for (the batched path sizes its slot length, each
    token of which is `sequences` tokens of the pool: the 256-token threshold is counted in the pool's tokens, or
    an 8 GiB card's 8 slots left ~300 MB of the budget unused, as a headroom under 256 x 8 pool tokens, Llama-2-7B,
    bench/results/2026-12-05-s3-h100-cards-llama-2-7b-8gib.json).
    Returns the largest size measured within it
    (the engine keeps that one), or raises ContextBudgetError when not even MIN_FAST_CACHE_TOKENS fit. Sizes are
    multiples of CACHE_ROUND_TOKENS."""
    r = CACHE_ROUND_TOKENS
    ceiling = max(MIN_FAST_CACHE_TOKENS, int(context_length) // r * r)
    per = max(1, int(bytes_per_token))
    budget_bytes = int(budget_bytes) - MEASURED_SAFETY_BYTES
    fits: list[int] = []
    grown = False
    t = int(tokens)
    for _ in range(attempts):
        peak = measure(t)
        if peak is not None and peak <= budget_bytes:
            fits.append(t)
            room = int((budget_bytes - peak) * 0.9) // per // r * r
            if grown or t >= ceiling or room < max(MIN_GROW_TOKENS // max(1, int(sequences)), t // 16, r):
                break
            t, grown = min(ceiling, t + room), True
            continue
        if peak is None:  # out of memory: nothing measured, so halve (a start far too large still converges)
            smaller = t // 2 // r * r
        else:  # over by a measured excess: shrink by it (+10%), at least 3% so that it always converges
            smaller = (t - max(int((peak - budget_bytes) * 1.1) // per + r, t // 32)) // r * r
        if fits and smaller <= max(fits):  # grown too far: the last size that fitted is the answer
            break
        if smaller < MIN_FAST_CACHE_TOKENS:
            break
        t = smaller
    if fits:
        return max(fits)
    raise ContextBudgetError(
        f"The fast decode path does not fit a useful KV cache ({MIN_FAST_CACHE_TOKENS} tokens) beside the model in "
        f"the memory budget ({human_bytes(budget_bytes)}), measured at start-up. {FAST_CACHE_ADVICE}")


def slots_fit(facts: ModelMemoryFacts, budget_bytes: int, *, slots: int, tokens: int, per_token: int,
              max_new_tokens: int, prefill_chunk_tokens: int | None, kv_cache: str, extra_bytes: int = 0) -> bool:
    """Whether the batched fast path's `slots` KV slots of `tokens` each fit the budget: a reply filling one slot,
    with the other slots' blocks (`per_token` bytes a token), the fast path's resident estimate and `extra_bytes`
    (NF4_FRAG's copy of the codes, where it is on) held beside it."""
    others = (slots - 1) * tokens * per_token
    plan = static_cache_plan(facts, budget_bytes, max_new_tokens=min(max_new_tokens, tokens - 1),
                             prefill_chunk_tokens=prefill_chunk_tokens, kv_cache=kv_cache,
                             resident_extra_bytes=fast_resident_estimate(facts, 0, tokens) + others + extra_bytes)
    return plan.tokens >= tokens


def longest_slot_tokens(facts: ModelMemoryFacts, budget_bytes: int, *, slots: int, per_token: int,
                        max_new_tokens: int, prefill_chunk_tokens: int | None, kv_cache: str,
                        extra_bytes: int = 0) -> int:
    """The most tokens (a multiple of 16, at most the model's context) each of `slots` KV slots can hold by
    slots_fit; 0 when not even 16 fit."""
    lo, hi = 0, int(facts.context_length) // CACHE_ROUND_TOKENS  # in units of 16 tokens
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if slots_fit(facts, budget_bytes, slots=slots, tokens=mid * CACHE_ROUND_TOKENS, per_token=per_token,
                     max_new_tokens=max_new_tokens, prefill_chunk_tokens=prefill_chunk_tokens, kv_cache=kv_cache,
                     extra_bytes=extra_bytes):
            lo = mid
        else:
            hi = mid - 1
    return lo * CACHE_ROUND_TOKENS


def resolve_nf4_frag(setting: str, facts: ModelMemoryFacts, budget_bytes: int, *, copy_bytes: int, slots: int,
                     max_new_tokens: int, prefill_chunk_tokens: int | None, kv_cache: str) -> tuple[str, str]:
    """(NF4_FRAG as the fast path takes it, on or off; why, for the model panel). auto = on where it pays and costs
    little context: NF4 weights the fragment-order kernel tiles (`copy_bytes` > 0: their second copy), decoded in
    batches (`slots` > 1: the one-token GEMV serves a lone reply, and is faster there), and a budget where the copy
    takes at most AUTO_FRAG_POOL_SHARE of the tokens the KV slots would hold without it (none where they hold the
    whole context either way). Where memory bounds the slots more tightly, the copy would take context from every
    chat for a faster step: off."""
    if setting != "auto":
        return setting, ""
    if copy_bytes <= 0:
        return "off", ""
    copy = human_bytes(copy_bytes)
    if slots <= 1:
        return "off", f"NF4_FRAG auto: off (one reply at a time: the one-token kernel serves it; the copy is {copy})"
    search = partial(longest_slot_tokens, facts, budget_bytes, slots=slots,
                     per_token=static_kv_bytes(facts, 1, kv_cache), max_new_tokens=max_new_tokens,
                     prefill_chunk_tokens=prefill_chunk_tokens, kv_cache=kv_cache)
    without, with_copy = search(), search(extra_bytes=copy_bytes)
    if without > 0 and with_copy >= (1 - AUTO_FRAG_POOL_SHARE) * without:
        cost = "no context" if with_copy == without else f"{with_copy:,} of {without:,} tokens a slot"
        return "on", f"NF4_FRAG auto: on (the codes' fragment-order copy, {copy}, leaves the {slots} KV slots {cost})"
    return "off", (f"NF4_FRAG auto: off (the fragment-order copy, {copy}, would cut the {slots} KV slots from "
                   f"{without:,} to {with_copy:,} tokens each)")
