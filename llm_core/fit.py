"""Will it fit? From a model's config.json alone (no weights), a quantization, a KV cache mode and a card size:
the weights' bytes, KV bytes per token, the decode path that would run and the longest prompt that fits, with the
KV cache, the prefill's working memory, the fast path's graphs and the allocator reserve counted (the same
arithmetic the engine plans every reply with: llm_core.memory.model, .budget and .plan).

    python -m llm_core.fit MODEL --gpu 8GiB [--quantization nf4] [--kv-cache dynamic] [--max-new-tokens 256]

MODEL: a local folder with config.json, a Hugging Face id (needs the network once), or empty for the embedded
model. Knows nothing about Gradio; app.py shows `FitReport.to_markdown()` in its panel.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, replace
from typing import Any

from .config import (
    DEFAULT_PREFILL_CHUNK_TOKENS,
    DEFAULT_PREFILL_GRAPH_TOKENS,
    KV_CACHE_MODES,
    QUANTIZATION_MODES,
    SettingsError,
    canonical_kv_cache,
    parse_bytes,
)
from .errors import InputError, LLMCoreError, ModelLoadError
from .memory.budget import max_context_tokens
from .memory.model import (
    BNB_4BIT_BLOCK,
    DEFAULT_CUDA_MARGIN_BYTES,
    GiB,
    ModelMemoryFacts,
    human_bytes,
    kv_bytes_per_token,
    static_kv_bytes,
)
from .memory.plan import (
    AUTO_ON_PLAIN,
    MIN_FAST_CACHE_TOKENS,
    choose_kv_cache,
    resolve_prefill_chunk_tokens,
    resolve_prefill_graph_tokens,
    static_cache_plan,
)

# Host-to-device bandwidth an offloaded weight crosses every token (PCIe 4.0 x16, practical): what offload costs.
OFFLOAD_BYTES_PER_S = 25e9


def estimate_weights_bytes(config: Any, quantization: str = "nf4", compute_dtype: str = "bfloat16",
                           double_quant: bool = True, int8_tables: bool = False) -> int:
    """Device bytes of a llama-family model's weights as bitsandbytes/transformers hold them, from the config.

    The decoder's linears (q, k, v, o, gate, up, down) are quantized; embeddings, norms and the lm_head stay in the
    compute dtype (transformers keeps the output layer unquantized). NF4/FP4: half a byte per weight plus one absmax
    per 64 weights (uint8 with double quant, plus one fp32 per 256 of them; fp32 without). int8: a byte per weight
    plus an fp32 scale per row. Checked against the H200 recordings (Llama-2-7B 3.61 GiB, Llama-3-8B 5.35 GiB) and
    the embedded model loaded on CPU (tests/test_fit.py). `int8_tables`: the embedding and lm_head as
    llm_core.fast.tables holds them (INT8_TOKEN_TABLE): a byte per weight plus an fp32 scale per row."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    h = int(text.hidden_size)
    heads = int(text.num_attention_heads)
    kvh = int(getattr(text, "num_key_value_heads", None) or heads)
    hd = int(getattr(text, "head_dim", None) or h // heads)
    inter = int(getattr(text, "intermediate_size", None) or 4 * h)
    layers = int(text.num_hidden_layers)
    vocab = int(text.vocab_size)
    b = {"float32": 4, "float16": 2, "bfloat16": 2}[compute_dtype]
    q_dim, kv_dim = heads * hd, kvh * hd
    shapes = [(q_dim, h), (kv_dim, h), (kv_dim, h), (h, q_dim), (inter, h), (inter, h), (h, inter)]  # (rows, cols)
    linear = sum(r * c for r, c in shapes) * layers
    rows = sum(r for r, _ in shapes) * layers
    if quantization in ("nf4", "fp4"):
        blocks = linear // BNB_4BIT_BLOCK
        absmax = blocks + (blocks // 256) * 4 if double_quant else blocks * 4
        quantized = linear // 2 + absmax
    elif quantization == "int8":
        quantized = linear + rows * 4
    else:
        quantized = linear * b
    bias = (q_dim + 2 * kv_dim) * layers * b if getattr(text, "attention_bias", False) else 0
    tied = bool(getattr(config, "tie_word_embeddings", getattr(text, "tie_word_embeddings", False)))
    embeddings = (vocab * h + vocab * 4 if int8_tables else vocab * h * b) * (1 if tied else 2)
    norms = (2 * layers + 1) * h * b + (2 * layers * hd * b if getattr(text, "model_type", "") == "qwen3" else 0)
    return quantized + bias + embeddings + norms


@dataclass(frozen=True)
class FitReport:
    """What `fit` predicts for one model on one card (bytes, tokens)."""

    model: str
    card_bytes: int
    budget_bytes: int
    quantization: str
    kv_cache: str
    weights_bytes: int
    kv_bytes_per_token: int
    decode_path: str  # "fast", "plain" or "none" (the weights do not fit)
    decode_path_reason: str
    context_length: int
    longest_prompt_tokens: int  # with max_new_tokens of reply, on the path that runs
    max_new_tokens: int
    static_cache_tokens: int  # the fast path's cache (0 on the plain path)
    seed_prompt_tokens: int  # plain generate, no guard, whole card, one-pass prefill: what the seed recipe holds
    offload_note: str = ""
    prefill_chunk_tokens: int | None = None  # as the engine would prefill long prompts (None: one pass)
    kv_cache_reason: str = ""  # one sentence: which KV cache (KV_CACHE=auto resolved) and why

    @property
    def fits(self) -> bool:
        return self.decode_path != "none"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"fits": self.fits, "tradeoff_note": self.tradeoff_note}

    def summary(self) -> str:
        card = human_bytes(self.card_bytes)
        if not self.fits:
            return (f"{self.model} does not fit a {card} card with {self.quantization} weights: the weights alone "
                    f"need {human_bytes(self.weights_bytes)} of the {human_bytes(self.budget_bytes)} budget. "
                    f"{self.offload_note}")
        lines = [
            f"{self.model} on a {card} card ({self.quantization} weights, KV cache {self.kv_cache}):",
            f"  weights            {human_bytes(self.weights_bytes)}",
            f"  KV cache per token {self.kv_bytes_per_token:,} B",
            f"  decode path        {self.decode_path} ({self.decode_path_reason})",
            f"  KV cache           {self.kv_cache_reason}",
            f"  longest prompt     {self.longest_prompt_tokens:,} tokens with {self.max_new_tokens:,} new "
            f"(model context {self.context_length:,})",
        ]
        if self.static_cache_tokens:
            lines.append(f"  static KV cache    {self.static_cache_tokens:,} tokens")
        lines.append(f"  seed recipe        {self.seed_prompt_tokens:,} prompt tokens (plain generate, no guard)")
        if self.tradeoff_note:
            lines.append(f"  note               {self.tradeoff_note}")
        return "\n".join(lines)

    @property
    def tradeoff_note(self) -> str:
        """Said where plain generate holds longer prompts than the fast path on this card (small cards: the fast
        path's graphs and static cache take memory plain generate leaves to the KV cache)."""
        if self.decode_path != "fast" or self.longest_prompt_tokens >= self.seed_prompt_tokens:
            return ""
        return (f"plain generate (DECODE_PATH=plain) could hold longer prompts here (up to about "
                f"{self.seed_prompt_tokens:,} tokens), decoding many times slower; the fast path holds "
                f"{self.longest_prompt_tokens:,}" + (" (try KV_CACHE=int8)" if self.kv_cache == "bf16" else "")
                + ".")

    def to_markdown(self) -> str:
        if not self.fits:
            return f"**Does not fit.** {self.summary()}"
        rows = [("Weights", human_bytes(self.weights_bytes)), ("KV cache", self.kv_cache_reason),
                ("KV cache per token", f"{self.kv_bytes_per_token:,} B"),
                ("Decode path", f"{self.decode_path}: {self.decode_path_reason}"),
                ("Longest prompt", f"{self.longest_prompt_tokens:,} tokens (+{self.max_new_tokens:,} new) of "
                 f"{self.context_length:,}"),
                ("Seed recipe (plain generate)", f"{self.seed_prompt_tokens:,} tokens")]
        if self.static_cache_tokens:
            rows.insert(3, ("Fast-path KV cache", f"{self.static_cache_tokens:,} tokens"))
        if self.tradeoff_note:
            rows.append(("Note", self.tradeoff_note))
        head = (f"**{self.model}** on a {human_bytes(self.card_bytes)} card, {self.quantization}, "
                f"KV cache {self.kv_cache}\n\n")
        return head + "| | |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in rows)


def offload_bytes(weights_bytes: int, budget_bytes: int) -> int:
    """Weights that would live in CPU RAM and cross PCIe every token: what leaves ~1 GiB of the budget for the KV
    cache and the prefill, never more than the model has."""
    return min(weights_bytes, max(0, weights_bytes - budget_bytes + GiB))


def card_bytes_of(value: Any) -> int:
    """A card size as the fit tab takes it: GiB as a number (8, 12.5) or a size with its unit (8GiB, 24GB)."""
    text = "" if value is None else str(value).strip()
    try:
        size = float(text) * GiB
    except ValueError:
        try:
            size = float(parse_bytes("card size", text) or 0)
        except SettingsError:
            raise InputError(f"Card size {text!r} is not a size: give GiB as a number (8, 12.5) or with a unit "
                             "(8GiB, 24GB).") from None
    if not size > 0 or size == float("inf"):
        raise InputError(f"Card size must be more than 0 GiB, got {text or 'nothing'!r}.")
    return int(size)


def _new_tokens_of(value: Any, context_length: int) -> int:
    """max_new_tokens as a whole number from 1 to the model's context, or an InputError saying what is wrong."""
    whole = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    if isinstance(value, bool) or not whole:
        raise InputError(f"Max new tokens must be a whole number of at least 1, got {value!r}.")
    if not 1 <= int(value) < context_length:
        raise InputError(f"Max new tokens must be from 1 to {context_length - 1:,} (the model's context is "
                         f"{context_length:,} tokens), got {int(value):,}.")
    return int(value)


def fit_config(config: Any, card_bytes: int, *, model: str = "model", quantization: str = "nf4",
               kv_cache: str = "auto", max_new_tokens: int = 256, margin_bytes: int | None = None,
               prefill_chunk_tokens: int | None = None, prefill_graph_tokens: int | None = None,
               compute_dtype: str = "bfloat16", weights_bytes: int | None = None,
               int8_token_table: bool | None = None) -> FitReport:
    """Predict what fits on a CUDA card of `card_bytes` (budget = card - margin, what the demo derives there).
    `prefill_chunk_tokens`, `prefill_graph_tokens` and `int8_token_table` as the settings of those names: None =
    auto, 0 = off."""
    if quantization not in QUANTIZATION_MODES:
        raise SettingsError(f"quantization {quantization!r}: choose one of {', '.join(QUANTIZATION_MODES)}.")
    kv_cache = asked = canonical_kv_cache(kv_cache, "KV cache")
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    from .fast.support import config_fast_path_support  # here: the fast package imports the decoder and kernels

    fast_ok, reason = config_fast_path_support(text, quantization)
    int8_tables = fast_ok and quantization in ("nf4", "int8") if int8_token_table is None else int8_token_table
    weights = estimate_weights_bytes(config, quantization, compute_dtype, int8_tables=int8_tables
                                     ) if weights_bytes is None else weights_bytes
    if not card_bytes > 0:
        raise InputError(f"Card size must be more than 0 bytes, got {card_bytes!r}.")
    margin = DEFAULT_CUDA_MARGIN_BYTES if margin_bytes is None else int(margin_bytes)
    budget = max(0, int(card_bytes) - margin)
    facts = ModelMemoryFacts.from_config(text, weights, compute_dtype, weight_quantization=quantization)
    n = _new_tokens_of(max_new_tokens, facts.context_length)
    fused = replace(facts, fast_prefill=True)
    kv_cache, kv_reason = choose_kv_cache(kv_cache, fused, budget, max_new_tokens=n, fast_path=fast_ok,
                                          prefill_chunk_tokens=prefill_chunk_tokens,
                                          prefill_graph_tokens=prefill_graph_tokens)
    fast_kv = kv_cache if kv_cache != "offload" else "bf16"  # offload replies run on the plain path
    chunk = resolve_prefill_chunk_tokens(prefill_chunk_tokens, fused, budget, max_new_tokens=n, kv_cache=fast_kv)
    # The seed recipe: plain generate with a growing cache, one-pass prefill, the whole card, no margin, its tables
    # as loaded.
    seed_facts = facts if weights_bytes is not None or not int8_tables else replace(
        facts, weights_bytes=estimate_weights_bytes(config, quantization, compute_dtype))
    seed = max_context_tokens(seed_facts, int(card_bytes), n, "bf16")
    common: dict[str, Any] = dict(model=model, card_bytes=int(card_bytes), budget_bytes=budget,
                                  quantization=quantization, kv_cache=kv_cache, weights_bytes=weights,
                                  context_length=facts.context_length, max_new_tokens=n, seed_prompt_tokens=seed,
                                  prefill_chunk_tokens=chunk, kv_cache_reason=kv_reason)
    if weights + facts.workspace_bytes >= budget:
        offload = offload_bytes(weights, budget)
        note = (f"With MAX_MEMORY offload about {human_bytes(offload)} of weights would cross PCIe every "
                "token: "
                f"about {OFFLOAD_BYTES_PER_S / max(offload, 1):.1f} tokens/s at best (a last resort).")
        return FitReport(kv_bytes_per_token=kv_bytes_per_token(facts, compute_dtype), decode_path="none",
                         decode_path_reason="the weights alone exceed the budget", longest_prompt_tokens=0,
                         static_cache_tokens=0, offload_note=note, **common)
    if int8_tables:
        reason += "; token table and lm_head int8 (a scale per row)"
    if fast_ok and kv_cache != "offload":
        graphs = resolve_prefill_graph_tokens(prefill_graph_tokens, fused, budget, max_new_tokens=n,
                                              prefill_chunk_tokens=chunk, kv_cache=fast_kv)
        plan = static_cache_plan(fused, budget, max_new_tokens=n, prefill_chunk_tokens=chunk,
                                 kv_cache=fast_kv, prefill_graph_tokens=graphs)
        if plan.tokens >= MIN_FAST_CACHE_TOKENS or plan.tokens == facts.context_length:
            per_token = static_kv_bytes(replace(facts, static_kv_cache=fast_kv), 1)
            return FitReport(kv_bytes_per_token=per_token, decode_path="fast", decode_path_reason=reason,
                             longest_prompt_tokens=plan.max_prompt_tokens, static_cache_tokens=plan.tokens, **common)
        reason = f"no room for a {MIN_FAST_CACHE_TOKENS}-token fast-path cache; plain generate"
    if asked == "auto" and kv_cache != "bf16":  # as the engine: auto means bf16 on the plain path
        kv_cache = "bf16"
        common.update(kv_cache=kv_cache, kv_cache_reason=AUTO_ON_PLAIN)
    longest = max_context_tokens(facts, budget, n, kv_cache, prefill_chunk_tokens=chunk)
    return FitReport(kv_bytes_per_token=kv_bytes_per_token(facts, compute_dtype, kv_cache), decode_path="plain",
                     decode_path_reason=reason, longest_prompt_tokens=longest, static_cache_tokens=0, **common)


def check_weights_fit(settings: Any) -> None:
    """Before any weight is loaded: ModelLoadError when the weights alone (estimated from config.json) exceed
    VRAM_BUDGET. Skipped without VRAM_BUDGET (a derived budget is known only once loaded), with MAX_MEMORY (offload
    places the weights itself) and when the config cannot be read here (the loader reports that). Estimated in the
    smaller compute dtype where it is "auto", so an estimate never refuses a model that fits."""
    budget = settings.memory.budget_bytes
    if budget is None or settings.model.max_memory:
        return
    model = settings.model.model_id or ""
    try:
        config = load_config(model, cache_dir=settings.model.cache_dir,
                             trust_remote_code=settings.model.trust_remote_code)
        dtype = settings.model.compute_dtype if settings.model.compute_dtype != "auto" else "bfloat16"
        from .loading import resolve_device, wants_int8_token_tables

        tables = wants_int8_token_tables(settings.model, resolve_device(settings.model), config)
        weights = estimate_weights_bytes(config, settings.model.quantization, dtype,
                                         double_quant=settings.model.double_quant is not False, int8_tables=tables)
    except (LLMCoreError, AttributeError, KeyError, TypeError):  # not llama-shaped or unreadable: load decides
        return
    if weights > budget:
        quant = settings.model.quantization
        offload = offload_bytes(weights, budget)
        raise ModelLoadError(
            f"{model or 'The embedded model'} does not fit: its weights alone need about {human_bytes(weights)} "
            f"with QUANTIZATION={quant}, more than VRAM_BUDGET={human_bytes(budget)}. Use QUANTIZATION=nf4, a smaller "
            "model or a "
            f"larger budget; MAX_MEMORY offload would move about {human_bytes(offload)} over PCIe every token (about "
            f"{OFFLOAD_BYTES_PER_S / offload:.1f} tokens/s at best). `python -m llm_core.fit` says what fits.")


def load_config(model: str, *, cache_dir: str | None = None, trust_remote_code: bool = False) -> Any:
    """config.json of a local folder, a hub id (network), or the embedded model ('' ) without loading weights."""
    from pathlib import Path

    from transformers import AutoConfig

    try:
        if not model:
            from .config import ModelSettings
            from .models import default_cache_dir, ensure_embedded_converted

            folder = ensure_embedded_converted(default_cache_dir(ModelSettings(cache_dir=cache_dir)))
            return AutoConfig.from_pretrained(str(folder))
        path = Path(model).expanduser()
        source = str(path) if path.exists() else model
        return AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"Could not read the config of {model!r}: {exc}") from exc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m llm_core.fit", description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", default="", help="local folder, hub id, or empty for the embedded model")
    parser.add_argument("--gpu", required=True, help="card size, e.g. 8GiB, 12GiB, 24GB")
    parser.add_argument("--quantization", default="nf4", choices=QUANTIZATION_MODES)
    parser.add_argument("--kv-cache", default="auto", type=canonical_kv_cache, choices=KV_CACHE_MODES)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--margin", default="", help="kept free on the card (default 512MiB)")
    parser.add_argument("--prefill-chunk-tokens", type=int, default=None,
                        help=f"as PREFILL_CHUNK_TOKENS (0 = off); default auto ({DEFAULT_PREFILL_CHUNK_TOKENS}, "
                        "less on small cards)")
    parser.add_argument("--prefill-graph-tokens", type=int, default=None,
                        help=f"as PREFILL_GRAPH_TOKENS; default auto ({DEFAULT_PREFILL_GRAPH_TOKENS}, less on small "
                        "cards)")
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    try:
        card = parse_bytes("--gpu", args.gpu)
        if card is None:
            raise SettingsError("--gpu needs a size, e.g. --gpu 8GiB.")
        report = fit_config(load_config(args.model, cache_dir=args.cache_dir), card,
                            model=args.model or "embedded SmolLM2-135M-Instruct", quantization=args.quantization,
                            kv_cache=args.kv_cache, max_new_tokens=args.max_new_tokens,
                            margin_bytes=parse_bytes("--margin", args.margin),
                            prefill_chunk_tokens=args.prefill_chunk_tokens,
                            prefill_graph_tokens=args.prefill_graph_tokens)
    except LLMCoreError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(report.to_dict(), indent=1) if args.json else report.summary())
    return 0 if report.fits else 1


if __name__ == "__main__":
    sys.exit(main())
