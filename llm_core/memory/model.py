"""Memory model: the bytes one reply needs (weights, KV cache, prefill, logits, allocator reserve): pure arithmetic
over a model config (fitting a reply into a budget: llm_core.memory.budget; measuring and OOM: llm_core.memory.device).
It never generates: llm_core.memory.kv_cache builds the caches it describes, and the engine asks it before each reply.

Units are bytes unless a name says otherwise. The formulas and their calibration are written up in docs/memory.md.

Peak model (batch 1, a llama-style decoder: RMSNorm -> attention -> RMSNorm -> gated MLP), b = compute-dtype bytes,
h = hidden size, I = MLP intermediate size, q = tokens in one forward pass (the whole prompt, or one prefill chunk):

    peak_allocated = weights + workspace + max(prefill peak, decode peak) + logits
    prefill peak   = KV(prompt) + activation(q)          (the last layer's MLP of the last prefill pass)
    activation(q)  = q * (2*head_dim*b + 8)               rotary cos/sin + int64 position ids, live all pass
                     + max(q*(4h + 3I)*b,                 embeddings, layer input, residual, normed input + the
                           q*(4h + 2I)*b + W_dq,          MLP's act(gate), up and their product; or, while a 4-bit
                           q*(6h + 2*q_dim)*b + mask)     weight is dequantized for the matmul (bitsandbytes does
                                                          this for prefill), that bf16 copy W_dq = h*I*b (+ absmax
                                                          in fp32); or the attention block (a bound)
    decode peak    = KV(prompt + new) + one layer's K being re-concatenated (dynamic) / the dequantized scratch
                     (quantized) / two layers brought back from the CPU (offload)
    reserve        = reserve_fraction * (KV + activation) + reserve_fixed   (caching allocator: reserved > allocated)

Traced against tensor allocations on CPU to the byte (tests/test_memory.py) and against the H200 reference peaks
(Llama-2-7B and Llama-3-8B NF4, 11 points) to within 10 MiB, the rounding of the recorded numbers.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..config import KV_CACHE_MODES
from ..errors import SettingsError

MiB = 2**20
GiB = 2**30

# torch allocates the cuBLAS workspace (":4096:8" = 8 x 4 MiB on sm90) through the caching allocator at the first
# matmul, so it shows in memory_allocated: the H200 reference shows it as 3.61 -> 3.64 GiB after a warm-up reply.
CUDA_WORKSPACE_BYTES = 32 * MiB
# Allocator reserve (reserved - allocated) as a fraction of KV + activations. 0.30 is what the seed recipe's OOM
# boundary under an 8 GiB cap implies (Llama-2-7B OOM at 6,144 needs >= 0.22, Llama-3-8B fine at 8,192 allows
# <= 0.39); bench/memory_bench.py measures it and `refit_reserve` raises it from what a reply really reserved.
DEFAULT_CUDA_RESERVE_FRACTION = 0.30
DEFAULT_CPU_RESERVE_FRACTION = 0.10  # glibc heap growth around large tensors
DEFAULT_RESERVE_FIXED_BYTES = 16 * MiB
DEFAULT_CUDA_MARGIN_BYTES = 512 * MiB  # other processes, CUDA graphs, a second tokenizer thread...
DEFAULT_CPU_MARGIN_BYTES = 1 * GiB
BNB_4BIT_BLOCK = 64  # bitsandbytes NF4/FP4 block size: one absmax per 64 weights
DEQUANT_CHUNK_TOKENS = 8192  # the quantized KV cache dequantizes at most this many tokens per kernel batch
PLAIN_QUANTIZED = ("int8", "int4")  # KV_CACHE modes the plain path serves with its quantized cache (kv_cache.py)
STATIC_INT8_ROW_PAD = 4  # bytes after each int8 row of head_dim codes: its scale byte, padded to 4-byte rows
STATIC_INT4_GROUP = 16  # int4 rows: one scale and zero point per this many (rotated) values


STATIC_KV_LAYOUTS = {"int8": "per token and head scale",
                     "int4": "Hadamard-rotated, a scale and zero point per 16 values"}


def static_row_bytes(kv_cache: str, head_dim: int, cache_element_bytes: int = 2) -> int:
    """Bytes of one (token, KV head) row of the fast path's static cache: head_dim values of the cache dtype (bf16),
    head_dim int8 codes + STATIC_INT8_ROW_PAD (int8), head_dim / 2 packed bytes + two bytes per STATIC_INT4_GROUP
    values (scale exponent, zero point) padded to 16 (int4)."""
    if kv_cache == "int8":
        return head_dim + STATIC_INT8_ROW_PAD
    if kv_cache == "int4":
        return head_dim // 2 + -(-2 * head_dim // STATIC_INT4_GROUP // 16) * 16
    if kv_cache == "bf16":
        return head_dim * cache_element_bytes
    raise SettingsError(f"The fast path's KV cache cannot be {kv_cache!r}; choose bf16, int8 or int4.")


def dtype_bytes(dtype: torch.dtype | str) -> int:
    """Bytes per element of a torch dtype, given as a dtype or its name ("bfloat16", "torch.float16", "fp8")."""
    if isinstance(dtype, torch.dtype):
        return dtype.itemsize
    name = str(dtype).removeprefix("torch.").lower()
    aliases = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32",
               "fp8": "float8_e4m3fn"}
    resolved = getattr(torch, aliases.get(name, name), None)
    if not isinstance(resolved, torch.dtype):
        raise SettingsError(f"Unknown dtype {dtype!r}; use e.g. bfloat16, float16 or float32.")
    return resolved.itemsize


@dataclass(frozen=True)
class QuantizedKVSpec:
    """Layout of the quantized KV cache (llm_core.memory.kv_cache's builtin backend, KIVI-style).

    Keys: per channel, one (scale, zero) pair per `group_size` tokens. Values: per token, one pair per `group_size`
    channels (or per head when head_dim is smaller). The newest tokens of an incomplete group stay in full precision
    in a residual buffer of `group_size` tokens. Scales and zero points are stored in the cache dtype.
    """

    nbits: int = 4
    group_size: int = 64

    def validate(self) -> QuantizedKVSpec:
        if self.nbits not in (2, 4, 8):
            raise SettingsError(f"KV cache quantization supports 2, 4 or 8 bits, got {self.nbits}.")
        if self.group_size < 8 or self.group_size & (self.group_size - 1):
            raise SettingsError(f"KV quantization group size must be a power of two >= 8, got {self.group_size}.")
        return self

    def value_group(self, head_dim: int) -> int:
        group = min(self.group_size, head_dim)
        if head_dim % group:
            raise SettingsError(f"head_dim {head_dim} is not a multiple of the KV quantization group {group}.")
        return group


# --- model layout ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelMemoryFacts:
    """What the memory model needs about one loaded model: config shape, measured weights, device and dtypes."""

    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    layer_windows: tuple[int | None, ...]  # per layer: None = full attention, n = sliding window of n tokens
    weights_bytes: int  # parameters, buffers and quantization states as held on the device
    compute_dtype: str = "bfloat16"
    cache_dtype: str = "bfloat16"
    weight_quantization: str = "nf4"  # nf4 | fp4 | int8 | none: nf4/fp4 add the dequantized-weight temporary
    device_type: str = "cuda"
    workspace_bytes: int = CUDA_WORKSPACE_BYTES  # allocated once by the first matmul (0 when already in weights)
    reserve_fraction: float = DEFAULT_CUDA_RESERVE_FRACTION
    reserve_fixed_bytes: int = DEFAULT_RESERVE_FIXED_BYTES
    logits_to_keep: bool = True  # the model computes prefill logits for the last position only
    context_length: int = 4096
    # The fast decode path's KV cache: allocated once (at warm-up) for this many tokens, so a reply's cache is
    # that whole block whatever its length. 0 = the cache grows with the reply (plain generate).
    static_kv_tokens: int = 0
    # How the fast path stores that block: "bf16" = the cache dtype; "int8" = int8 codes per (token, KV head) row of
    # head_dim plus STATIC_INT8_ROW_PAD bytes that hold the row's scale (llm_core.fast.kvquant).
    static_kv_cache: str = "bf16"
    # Measured after the decode path's warm-up: device memory it holds beyond the weights and that KV block (the
    # fast path's buffers and its CUDA graphs' memory pool). Held through every reply, so part of every peak.
    resident_extra_bytes: int = 0
    # The fast path's prefill: it dequantizes the weights of an nf4/fp4/int8 model for each matmul, one fused part
    # (gate or up, an h x I weight) at a time (llm_core.fast.layer.linear_prefill_parts), as bitsandbytes does for
    # 4-bit weights; for int8 bitsandbytes makes no such copy (LLM.int8 multiplies in int8), the fast path does.
    fast_prefill: bool = False

    # -- construction --
    @classmethod
    def from_config(
        cls,
        config: Any,
        weights_bytes: int,
        compute_dtype: torch.dtype | str,
        *,
        weight_quantization: str = "nf4",
        device_type: str = "cuda",
        cache_dtype: torch.dtype | str | None = None,
        workspace_bytes: int | None = None,
        reserve_fraction: float | None = None,
        logits_to_keep: bool = True,
    ) -> ModelMemoryFacts:
        """Facts from a transformers config (no weights needed) and a measured or estimated `weights_bytes`."""
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        heads = int(text.num_attention_heads)
        kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
        cuda = device_type == "cuda"
        return cls(
            num_layers=int(text.num_hidden_layers),
            hidden_size=int(text.hidden_size),
            intermediate_size=int(getattr(text, "intermediate_size", None) or 4 * text.hidden_size),
            num_attention_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            vocab_size=int(text.vocab_size),
            layer_windows=layer_windows(text),
            weights_bytes=int(weights_bytes),
            compute_dtype=_dtype_name(compute_dtype),
            cache_dtype=_dtype_name(cache_dtype if cache_dtype is not None else compute_dtype),
            weight_quantization=weight_quantization,
            device_type=device_type,
            workspace_bytes=(CUDA_WORKSPACE_BYTES if cuda else 0) if workspace_bytes is None else workspace_bytes,
            reserve_fraction=(DEFAULT_CUDA_RESERVE_FRACTION if cuda else DEFAULT_CPU_RESERVE_FRACTION)
            if reserve_fraction is None else reserve_fraction,
            logits_to_keep=logits_to_keep,
            context_length=int(getattr(text, "max_position_embeddings", None) or 4096),
        )

    @classmethod
    def from_loaded(cls, loaded: Any, **overrides: Any) -> ModelMemoryFacts:
        """Facts of an llm_core LoadedModel; weights are counted from its tensors (incl. bitsandbytes states)."""
        model = loaded.model
        kwargs: dict[str, Any] = dict(
            weight_quantization=loaded.settings.quantization,
            device_type=loaded.device.type,
            logits_to_keep=_supports_logits_to_keep(model),
        )
        kwargs.update(overrides)
        facts = cls.from_config(model.config, model_weights_bytes(model, loaded.device), loaded.compute_dtype,
                                **kwargs)
        return replace(facts, context_length=int(getattr(loaded, "context_length", facts.context_length)))

    # -- derived numbers --
    @property
    def compute_bytes(self) -> int:
        """Bytes of one element in the compute dtype (activations, logits)."""
        return dtype_bytes(self.compute_dtype)

    @property
    def cache_bytes_per_element(self) -> int:
        """Bytes of one element in the KV cache's dtype."""
        return dtype_bytes(self.cache_dtype)

    @property
    def q_dim(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def dequant_weight_bytes(self) -> int:
        """The half-precision copy of the largest quantized weight a multi-token matmul makes: an h x I weight (gate,
        up or down), by bitsandbytes (4-bit) or by the fast path's prefill (4-bit or int8)."""
        n = self.hidden_size * self.intermediate_size
        if self.weight_quantization == "int8":
            return n * self.compute_bytes if self.fast_prefill else 0
        if self.weight_quantization not in ("nf4", "fp4"):
            return 0
        return n * self.compute_bytes + (n // BNB_4BIT_BLOCK) * 4  # + the absmax dequantized to fp32 (double quant)


def layer_windows(config: Any) -> tuple[int | None, ...]:
    """Per decoder layer: None for full attention, the window in tokens for sliding-window layers.

    Follows transformers: `layer_types` when the config has it ("sliding_attention" / "chunked_attention" layers
    hold a window), else every layer slides when `sliding_window` is set (Mistral-style), else all are full.
    """
    n = int(config.num_hidden_layers)
    window = getattr(config, "sliding_window", None)
    chunk = getattr(config, "attention_chunk_size", None)
    types = getattr(config, "layer_types", None)
    if types is None:
        return tuple([int(window) if window else (int(chunk) if chunk else None)] * n)
    out: list[int | None] = []
    for kind in types:
        if kind in ("sliding_attention", "hybrid_sliding") and window:
            out.append(int(window))
        elif kind == "chunked_attention" and chunk:
            out.append(int(chunk))
        else:
            out.append(None)
    return tuple(out)


def _facts_of(config: Any, cache_dtype: torch.dtype | str | None = None) -> ModelMemoryFacts:
    if isinstance(config, ModelMemoryFacts):
        return config if cache_dtype is None else replace(config, cache_dtype=_dtype_name(cache_dtype))
    return ModelMemoryFacts.from_config(config, 0, cache_dtype or "bfloat16")


def _dtype_name(dtype: torch.dtype | str) -> str:
    dtype_bytes(dtype)  # validates
    return str(dtype).removeprefix("torch.")


def _supports_logits_to_keep(model: Any) -> bool:
    import inspect

    try:
        return "logits_to_keep" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def model_tensors(model: Any) -> Iterator[torch.Tensor]:
    """Every tensor the model holds: parameters, buffers, and the bitsandbytes quant states behind 4-bit weights
    (absmax, code, offset; nested once with double quant)."""
    for tensor in list(model.parameters()) + list(model.buffers()):
        yield tensor
        state = getattr(tensor, "quant_state", None)
        while state is not None:
            for name in ("absmax", "code", "offset"):
                value = getattr(state, name, None)
                if isinstance(value, torch.Tensor):
                    yield value
            state = getattr(state, "state2", None)


def model_weights_bytes(model: Any, device: torch.device | str | None = None) -> int:
    """Bytes of every tensor the model holds (model_tensors), each storage counted once; only tensors on `device`
    when given (offloaded layers live elsewhere)."""
    seen: set[tuple[str, int]] = set()
    total = 0
    want = torch.device(device).type if device is not None else None
    for t in model_tensors(model):
        if t.device.type == "meta" or (want is not None and t.device.type != want):
            continue
        storage = t.untyped_storage()
        key = (str(t.device), storage.data_ptr())
        if key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total


# --- KV cache bytes --------------------------------------------------------------------------------------------


def kv_bytes_per_token(
    config: Any,
    cache_dtype: torch.dtype | str,
    kv_cache: str = "bf16",
    quant: QuantizedKVSpec | None = None,
) -> int:
    """KV-cache bytes one more token of history costs, summed over layers (a sliding layer counts until its
    window is full): 2 (K and V) x layers x KV heads x head_dim x bytes per element.

    int8 / int4 (the plain path's quantized cache, 8 / 4 bits unless `quant` says otherwise): bytes per element =
    nbits/8 + 2 x scale bytes / group (one scale and one zero point per group), e.g. 4-bit, group 64, bf16 scales:
    0.5 + 4/64 = 0.5625 B, 3.56x less than bf16. Rounded up to whole bytes.
    offload: the same bytes as bf16, held in CPU memory instead of on the device.
    """
    facts = _facts_of(config, cache_dtype)
    check_kv_cache_name(kv_cache)
    elems = 2 * facts.num_layers * facts.kv_dim
    b = facts.cache_bytes_per_element
    if kv_cache not in PLAIN_QUANTIZED:
        return elems * b
    spec = (quant or plain_quant_spec(kv_cache)).validate()
    per_element = spec.nbits / 8 + 2 * b / spec.group_size
    return math.ceil(elems * per_element)


def kv_bytes(
    config: Any,
    tokens: int,
    cache_dtype: torch.dtype | str,
    kv_cache: str = "bf16",
    quant: QuantizedKVSpec | None = None,
) -> int:
    """Exact bytes a cache holding `tokens` tokens of history keeps (all layers, K and V).

    bf16/offload: a full-attention layer holds every token; a sliding layer holds at most `window` tokens
    (transformers keeps a view of the last window - 1 of the window it just attended to, so the storage of the whole
    window stays alive; right after a prefill it is the whole prompt: see `predict_peak_bytes`). offload holds the
    same bytes, in CPU memory.
    int8 (the builtin quantized backend, preallocated for `tokens`): per full-attention layer, floor(tokens / G) * G
    tokens packed at nbits with key scales per (group of G tokens, channel) and value scales per (token, group of
    channels), plus a full-precision residual buffer of G tokens; sliding layers stay full precision in their window.
    The dequantization scratch (one layer, shared) is not part of it: see `kv_workspace_bytes`.
    """
    facts = _facts_of(config, cache_dtype)
    check_kv_cache_name(kv_cache)
    tokens = max(0, int(tokens))
    b = facts.cache_bytes_per_element
    total = 0
    for window in facts.layer_windows:
        if window is not None:
            total += 2 * min(tokens, window) * facts.kv_dim * b
        elif kv_cache not in PLAIN_QUANTIZED:
            total += 2 * tokens * facts.kv_dim * b
        else:
            total += _quantized_layer_bytes(facts, tokens, (quant or plain_quant_spec(kv_cache)).validate())
    return total


def _quantized_layer_bytes(facts: ModelMemoryFacts, tokens: int, spec: QuantizedKVSpec) -> int:
    b = facts.cache_bytes_per_element
    g = spec.group_size
    hd, kvh = facts.head_dim, facts.num_kv_heads
    n_q = (tokens // g) * g
    packed = 2 * n_q * kvh * hd * spec.nbits // 8
    key_scales = 2 * (n_q // g) * kvh * hd * b  # scale + zero per (token group, channel)
    value_scales = 2 * n_q * kvh * (hd // spec.value_group(hd)) * b  # scale + zero per (token, channel group)
    residual = 2 * g * kvh * hd * b
    return packed + key_scales + value_scales + residual


def kv_workspace_bytes(config: Any, tokens: int, cache_dtype: torch.dtype | str, kv_cache: str) -> int:
    """Device bytes a cache needs besides what it stores, at `tokens` of history.

    int8: the shared scratch that one layer's K and V are dequantized into (2 x tokens x kv_dim x b, allocated
    once for the reply's capacity) plus the unpacking temporaries of one dequantization batch (bounded by
    batch x kv_dim x (2 + b): the codes are unpacked to uint8 and multiplied straight into the scratch).
    offload: the two layers resident on the device (the one being used and the one prefetched).
    bf16: 0 (its transient is counted with the decode step).
    """
    facts = _facts_of(config, cache_dtype)
    b = facts.cache_bytes_per_element
    if kv_cache in PLAIN_QUANTIZED:
        batch = min(tokens, DEQUANT_CHUNK_TOKENS)
        return 2 * tokens * facts.kv_dim * b + batch * facts.kv_dim * (2 + b)
    if kv_cache == "offload":
        return 2 * 2 * tokens * facts.kv_dim * b
    return 0


def check_kv_cache_name(kv_cache: str) -> None:
    """SettingsError unless `kv_cache` names a cache (a mode of KV_CACHE_MODES other than auto)."""
    if kv_cache not in KV_CACHE_MODES:
        raise SettingsError(f"KV_CACHE={kv_cache!r} is not supported; choose one of: {', '.join(KV_CACHE_MODES)}.")
    if kv_cache == "auto":
        raise SettingsError("KV_CACHE=auto names no cache: the engine resolves it at start-up (choose_kv_cache).")


def plain_quant_spec(kv_cache: str) -> QuantizedKVSpec:
    """The plain path's quantized cache for KV_CACHE=int8 / int4: the builtin KIVI-style cache at 8 / 4 bits."""
    return QuantizedKVSpec(nbits=8 if kv_cache == "int8" else 4)


def is_fast_reply(facts: ModelMemoryFacts, kv_cache: str) -> bool:
    """Whether a reply with this KV cache runs on the fast path's static block (allocated, and of that mode); a
    reply with another mode runs on the plain path beside it."""
    return bool(facts.static_kv_tokens) and kv_cache == facts.static_kv_cache


def _kv_device_bytes(facts: ModelMemoryFacts, tokens: int, kv_cache: str, quant: QuantizedKVSpec | None,
                     pass_tokens: int = 1) -> int:
    """KV bytes resident on the device (offload keeps all layers but two on the CPU: see kv_workspace_bytes).
    Right after a pass of `pass_tokens` a sliding layer still holds window - 1 + pass_tokens tokens."""
    if kv_cache == "offload":
        return 0
    total = kv_bytes(facts, tokens, facts.cache_dtype, kv_cache, quant)
    for window in facts.layer_windows:
        if window is not None:
            extra = min(tokens, window - 1 + pass_tokens) - min(tokens, window)
            total += 2 * max(0, extra) * facts.kv_dim * facts.cache_bytes_per_element
    return total


def static_kv_bytes(facts: ModelMemoryFacts, tokens: int | None = None, kv_cache: str | None = None) -> int:
    """Bytes of the fast path's static KV block for `tokens` (default facts.static_kv_tokens): K and V tensors of
    (layers, tokens, KV heads, row), a row as `static_row_bytes` lays it out."""
    fmt = facts.static_kv_cache if kv_cache is None else kv_cache
    t = facts.static_kv_tokens if tokens is None else int(tokens)
    row = static_row_bytes(fmt, facts.head_dim, facts.cache_bytes_per_element)
    return 2 * facts.num_layers * max(0, t) * facts.num_kv_heads * row


# --- activations -----------------------------------------------------------------------------------------------


def forward_activation_bytes(facts: ModelMemoryFacts, new_tokens: int, cached_tokens: int = 0,
                             kv_cache: str = "bf16") -> int:
    """Peak bytes of temporaries in one forward pass over `new_tokens` tokens after `cached_tokens` of history.

    The largest of three moments, each with the per-pass rotary tables and position ids:
    MLP product       q(4h + 3I)b        embeddings, layer input, residual, normed input, act(gate), up, product
    4-bit matmul      q(4h + 2I)b + W_dq the same minus the product, plus bitsandbytes' bf16 copy of a weight
    attention (bound) q(6h + 2 q_dim)b   + with history (chunked prefill): the bool mask and SDPA's additive copy of
                                         it, the GQA repeat of K/V, and the cache update's transient copy
    """
    q, b = int(new_tokens), facts.compute_bytes
    if q <= 0:
        return 0
    h, inter = facts.hidden_size, facts.intermediate_size
    mlp = q * (4 * h + 3 * inter) * b
    mlp_dq = q * (4 * h + 2 * inter) * b + facts.dequant_weight_bytes if q > 4 else 0  # M <= 4: fused gemv
    attn = q * (6 * h + 2 * facts.q_dim) * b
    if cached_tokens > 0:
        kv_len = cached_tokens + q
        attn += q * kv_len * (1 + 2 * b)  # bool mask + additive mask in the compute dtype (+ alignment copy)
        if facts.num_kv_heads < facts.num_attention_heads:
            attn += 2 * kv_len * facts.q_dim * b  # repeat_kv: SDPA gets full-head K and V when a mask is passed
        if is_fast_reply(facts, kv_cache):  # the fast path writes its static block in place
            if facts.static_kv_cache in ("int8", "int4"):  # ... and dequantizes the history it attends to (K and V)
                attn += 2 * kv_len * facts.kv_dim * b
        elif kv_cache in ("bf16", "offload"):
            attn += cached_tokens * facts.kv_dim * facts.cache_bytes_per_element  # torch.cat keeps old + new
    per_pass = q * (2 * facts.head_dim * b + 8)  # cos/sin tables + int64 position ids
    return max(mlp, mlp_dq, attn) + per_pass


def decode_transient_bytes(facts: ModelMemoryFacts, context_tokens: int, kv_cache: str = "bf16") -> int:
    """Temporaries of one decode step at `context_tokens` of history: the cache's own transient plus, for GQA,
    the K/V repeat some SDPA kernels make (counted to stay on the safe side)."""
    b = facts.cache_bytes_per_element
    t = int(context_tokens)
    transient = 0
    if kv_cache in ("bf16", "offload") and not is_fast_reply(facts, kv_cache):
        transient = t * facts.kv_dim * b  # torch.cat: one layer's old K (or V) and the new one coexist
    step = 16 * facts.hidden_size * facts.compute_bytes + facts.intermediate_size * 3 * facts.compute_bytes
    if facts.num_kv_heads < facts.num_attention_heads:
        step += 2 * t * facts.q_dim * b
    return transient + step


def logits_bytes(facts: ModelMemoryFacts, positions: int = 1) -> int:
    """Logits of the positions the prefill scores (one with logits_to_keep) in the compute dtype, generate's fp32
    copy and one processed fp32 copy (logits processors / softmax)."""
    return positions * facts.vocab_size * (facts.compute_bytes + 4 + 4)


# --- prediction ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PeakPrediction:
    """Predicted device peak of one reply. total_bytes = weights + resident extra + workspace + kv + activation +
    logits + reserve;
    `peak_allocated_bytes` leaves the allocator reserve out (compare it with torch.cuda.max_memory_allocated)."""

    weights_bytes: int
    kv_bytes: int  # KV held on the device at the peak moment
    prefill_activation_bytes: int  # temporaries of the largest prefill pass
    logits_bytes: int
    reserve_bytes: int
    total_bytes: int
    workspace_bytes: int = 0  # cuBLAS workspace + KV dequantization scratch / offload staging at the peak
    resident_extra_bytes: int = 0  # ModelMemoryFacts.resident_extra_bytes (the fast path's buffers, graph pool)
    activation_bytes: int = 0  # temporaries at the peak moment (prefill activations or the decode transient)
    decode_transient_bytes: int = 0
    kv_end_bytes: int = 0  # the whole cache after the reply (host memory for offload)
    phase: str = "prefill"  # where the peak falls: "prefill" or "decode"
    prompt_tokens: int = 0
    new_tokens: int = 0
    kv_cache: str = "bf16"
    prefill_chunk_tokens: int | None = None
    reserve_base_bytes: int = 0  # what reserve_fraction multiplies (KV that grows per reply, activations, scratch)

    @property
    def peak_allocated_bytes(self) -> int:
        return self.total_bytes - self.reserve_bytes

    def as_dict(self) -> dict[str, Any]:
        from dataclasses import asdict

        return asdict(self) | {"peak_allocated_bytes": self.peak_allocated_bytes}


def resident_extra_bytes(facts: ModelMemoryFacts, allocated_before: int, allocated_after: int,
                         held_idle: int = 0) -> int:
    """What a decode path's set-up keeps on the device beyond the static KV block the facts already count: the device
    bytes allocated after its warm-up less those before it was built (the weights, and any other engine's memory,
    are in both), less that block, plus `held_idle`: bytes held for it that memory_allocated does not show (CUDA
    graph pools between replays). Never negative."""
    static_kv = static_kv_bytes(facts) if facts.static_kv_tokens else 0
    return max(0, int(allocated_after) - int(allocated_before) - static_kv) + max(0, int(held_idle))


def predict_peak_bytes(
    model_facts: ModelMemoryFacts,
    prompt_tokens: int,
    max_new_tokens: int,
    kv_cache: str = "bf16",
    *,
    prefill_chunk_tokens: int | None = None,
    quant: QuantizedKVSpec | None = None,
) -> PeakPrediction:
    """Predicted peak device bytes of a reply: prompt of `prompt_tokens`, up to `max_new_tokens` new tokens.

    `prefill_chunk_tokens`: prefill in passes of at most that many tokens (llm_core.memory.kv_cache.prefill_in_chunks);
    None = one pass over the whole prompt (plain generate). The cache is counted for prompt + new tokens.
    """
    f = model_facts
    check_kv_cache_name(kv_cache)
    p, n = max(0, int(prompt_tokens)), max(0, int(max_new_tokens))
    end = p + n
    chunk = p if not prefill_chunk_tokens or prefill_chunk_tokens >= p else int(prefill_chunk_tokens)
    last_pass = (p - 1) % chunk + 1 if chunk else 0  # the final pass is the largest KV + activation moment
    # The last pass is at most `chunk` tokens over p - last_pass cached ones; a full chunk just before it has less
    # history, so the last full-size chunk bounds every pass.
    cached_before = max(0, p - chunk)
    prefill_act = forward_activation_bytes(f, chunk, cached_before, kv_cache) if p else 0
    if last_pass != chunk and p > chunk:
        prefill_act = max(prefill_act, forward_activation_bytes(f, last_pass, p - last_pass, kv_cache))
    # The quantized cache is preallocated for the whole reply; the others grow to `p` during the prefill.
    kv_at_prefill = _kv_device_bytes(f, end if kv_cache in PLAIN_QUANTIZED else p, kv_cache, quant, chunk)
    kv_at_end = _kv_device_bytes(f, end, kv_cache, quant)
    static = static_kv_bytes(f) if f.static_kv_tokens else 0
    fast = is_fast_reply(f, kv_cache)
    if fast:  # the fast path: one preallocated block, held throughout
        kv_at_prefill = kv_at_end = static
    plain = "bf16" if fast else kv_cache  # the static block needs no dequantization scratch
    ws_prefill = kv_workspace_bytes(f, end if plain in PLAIN_QUANTIZED else p, f.cache_dtype, plain)
    ws_end = kv_workspace_bytes(f, end, f.cache_dtype, plain)
    decode_t = decode_transient_bytes(f, end, kv_cache) if n else 0
    prefill_total = kv_at_prefill + ws_prefill + prefill_act
    decode_total = kv_at_end + ws_end + decode_t
    if prefill_total >= decode_total:
        phase, kv_peak, ws_peak, act_peak = "prefill", kv_at_prefill, ws_prefill, prefill_act
    else:
        phase, kv_peak, ws_peak, act_peak = "decode", kv_at_end, ws_end, decode_t
    logits = logits_bytes(f, 1 if f.logits_to_keep else max(chunk, 1))
    # The allocator's reserve grows with what is allocated and freed per reply; the static block is one allocation
    # made at start-up (no fragmentation around it), so it is not part of the base.
    reserve_base = (kv_peak - (static if fast else 0)) + ws_peak + act_peak
    reserve = int(f.reserve_fraction * reserve_base) + f.reserve_fixed_bytes
    workspace = f.workspace_bytes + ws_peak
    # A plain-path reply (another KV cache mode) runs beside the fast path's static block, which stays resident.
    resident = f.resident_extra_bytes + (static if not fast else 0)
    total = f.weights_bytes + resident + workspace + kv_peak + act_peak + logits + reserve
    return PeakPrediction(
        weights_bytes=f.weights_bytes,
        resident_extra_bytes=resident,
        reserve_base_bytes=reserve_base,
        kv_bytes=kv_peak,
        prefill_activation_bytes=prefill_act,
        logits_bytes=logits,
        reserve_bytes=reserve,
        total_bytes=total,
        workspace_bytes=workspace,
        activation_bytes=act_peak,
        decode_transient_bytes=decode_t,
        kv_end_bytes=kv_bytes(f, end, f.cache_dtype, plain, quant),
        phase=phase,
        prompt_tokens=p,
        new_tokens=n,
        kv_cache=kv_cache,
        prefill_chunk_tokens=prefill_chunk_tokens,
    )


def human_bytes(n: int) -> str:
    """Bytes for people: GiB with two decimals, MiB below a quarter GiB."""
    return f"{n / GiB:.2f} GiB" if abs(n) >= GiB // 4 else f"{n / MiB:.0f} MiB"


def kv_cache_exact_bytes(config: Any, tokens: int, dtype: torch.dtype) -> int:
    """Bytes of a K+V cache for `tokens` positions of a llama-family config (what the seed's cache holds)."""
    heads = int(config.num_attention_heads)
    kv = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    return 2 * int(config.num_hidden_layers) * kv * head_dim * tokens * torch.tensor([], dtype=dtype).element_size()

