"""KV caches: build the cache object one reply runs with (KV_CACHE: bf16, int8, int4, offload), prefill it in chunks,
and count the bytes it holds; knows no chat, no tokenizer and no decoding loop.

Modes (the plain path's; the fast path keeps its own static block, llm_core.fast.kvquant)
- bf16: transformers' DynamicCache (bf16/fp16 K and V, grows by concatenation).
- int8 / int4: the builtin KIVI-style cache below at 8 / 4 bits (no extra package): keys quantized per channel over
  groups of `group_size` tokens, values per token over groups of channels (2/4/8 bits possible); the newest tokens
  of an incomplete group stay in full precision. Storage is preallocated for the reply (`capacity_tokens`), so it
  never fragments. Each step dequantizes a layer into one scratch buffer shared by all layers (attention then runs
  as usual). transformers' own QuantizedCache backends ("hqq", "quanto") can be chosen when their packages are
  installed.
- offload: DynamicCache(offloading=True): every layer but the one in use (and the next, prefetched) lives in CPU
  memory; CUDA only, and slow: each step moves the whole cache over PCIe.
"""

from __future__ import annotations

import importlib.util
import inspect
from typing import Any

import torch

from ..errors import SettingsError
from .model import DEQUANT_CHUNK_TOKENS, QuantizedKVSpec, check_kv_cache_name, layer_windows, plain_quant_spec

QUANT_BACKENDS = ("builtin", "hqq", "quanto")
QUANTIZE_CHUNK_TOKENS = 2048  # quantize at most this many tokens per batch (bounds fp32 temporaries)
_BACKEND_PACKAGES = {"hqq": ("hqq", "hqq==0.2.8.post1"), "quanto": ("optimum.quanto", "optimum-quanto==0.2.7")}


def _transformers_cache_classes() -> tuple[type, type, type]:
    from transformers.cache_utils import Cache, DynamicLayer, DynamicSlidingWindowLayer

    return Cache, DynamicLayer, DynamicSlidingWindowLayer


_Cache, _DynamicLayer, _DynamicSlidingWindowLayer = _transformers_cache_classes()


# --- packing ---------------------------------------------------------------------------------------------------


def pack_codes(codes: torch.Tensor, nbits: int) -> torch.Tensor:
    """uint8 codes < 2**nbits, last dim D -> uint8 [..., D * nbits / 8]; code j of a byte sits at bits nbits*j."""
    per_byte = 8 // nbits
    if per_byte == 1:
        return codes
    grouped = codes.view(*codes.shape[:-1], codes.shape[-1] // per_byte, per_byte)
    packed = grouped[..., 0].clone()
    for j in range(1, per_byte):
        packed |= grouped[..., j] << (nbits * j)
    return packed


def unpack_codes(packed: torch.Tensor, nbits: int) -> torch.Tensor:
    """Inverse of pack_codes: uint8 [..., D * nbits / 8] -> uint8 codes [..., D]."""
    per_byte = 8 // nbits
    if per_byte == 1:
        return packed
    mask = (1 << nbits) - 1
    parts = [(packed >> (nbits * j)) & mask if j else packed & mask for j in range(per_byte)]
    return torch.stack(parts, dim=-1).flatten(-2)


# --- the builtin quantized cache -------------------------------------------------------------------------------


class _Scratch:
    """One flat buffer per K and V that each layer dequantizes into in turn (a layer's K/V is only read by its own
    attention, before the next layer updates): one layer of full-precision K/V instead of a copy per layer."""

    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def views(self, shape: tuple[int, ...], like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        numel = 1
        for s in shape:
            numel *= s
        if self.keys is None or self.keys.numel() < numel or self.keys.dtype != like.dtype \
                or self.keys.device != like.device:
            self.keys = self.values = None  # drop before allocating the larger pair
            self.keys = torch.empty(numel, dtype=like.dtype, device=like.device)
            self.values = torch.empty(numel, dtype=like.dtype, device=like.device)
        assert self.values is not None
        return self.keys[:numel].view(shape), self.values[:numel].view(shape)


class GroupQuantizedLayer(_DynamicLayer):  # type: ignore[misc, valid-type]
    """One full-attention layer of the builtin quantized cache (see the module docstring)."""

    is_croppable = False
    is_sliding = False
    supports_early_init = True

    def __init__(self, spec: QuantizedKVSpec, capacity_tokens: int | None, scratch: _Scratch) -> None:
        super().__init__()
        self.spec = spec.validate()
        self.capacity_tokens = capacity_tokens
        self.scratch = scratch
        self.cumulative_length = 0  # tokens held: quantized + residual
        self.n_quantized = 0
        self.n_residual = 0

    # storage -----------------------------------------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, heads, _, head_dim = key_states.shape
        self.device, self.dtype = key_states.device, key_states.dtype
        self.shape = (batch, heads, head_dim)
        g = self.spec.group_size
        self.value_group = self.spec.value_group(head_dim)
        if head_dim * self.spec.nbits % 8:
            raise SettingsError(f"head_dim {head_dim} cannot be packed at {self.spec.nbits} bits.")
        self._allocate(((self.capacity_tokens or 0) // g) * g)
        if self.capacity_tokens:  # the scratch too is sized once for the whole reply
            self.scratch.views((batch, heads, self.capacity_tokens, head_dim), key_states)
        self.res_keys = torch.empty(batch, heads, g, head_dim, dtype=self.dtype, device=self.device)
        self.res_values = torch.empty_like(self.res_keys)
        self.keys, self.values = self.res_keys[:, :, :0], self.res_values[:, :, :0]
        self.is_initialized = True

    def _allocate(self, tokens: int) -> None:
        batch, heads, head_dim = self.shape
        g, packed_dim = self.spec.group_size, head_dim * self.spec.nbits // 8
        kw: dict[str, Any] = dict(device=self.device)
        self.q_keys = torch.empty(batch, heads, tokens, packed_dim, dtype=torch.uint8, **kw)
        self.q_values = torch.empty_like(self.q_keys)
        self.key_scale = torch.empty(batch, heads, tokens // g, head_dim, dtype=self.dtype, **kw)
        self.key_zero = torch.empty_like(self.key_scale)
        self.value_scale = torch.empty(batch, heads, tokens, head_dim // self.value_group, dtype=self.dtype, **kw)
        self.value_zero = torch.empty_like(self.value_scale)

    @property
    def quantized_capacity(self) -> int:
        return int(self.q_keys.shape[2])

    def _grow(self, tokens: int) -> None:
        """Make room for `tokens` quantized tokens (rare: only when a reply outgrows its capacity hint)."""
        g = self.spec.group_size
        new_cap = max(tokens, 2 * self.quantized_capacity, 4 * g)
        new_cap = (new_cap + g - 1) // g * g
        old = (self.q_keys, self.q_values, self.key_scale, self.key_zero, self.value_scale, self.value_zero)
        n, ng = self.n_quantized, self.n_quantized // g
        self._allocate(new_cap)
        self.q_keys[:, :, :n] = old[0][:, :, :n]
        self.q_values[:, :, :n] = old[1][:, :, :n]
        self.key_scale[:, :, :ng] = old[2][:, :, :ng]
        self.key_zero[:, :, :ng] = old[3][:, :, :ng]
        self.value_scale[:, :, :n] = old[4][:, :, :n]
        self.value_zero[:, :, :n] = old[5][:, :, :n]

    # transformers layer API --------------------------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any,
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new K/V ([batch, kv_heads, new, head_dim]); return all K/V so far in full precision."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        g = self.spec.group_size
        new = key_states.shape[-2]
        n_q, n_r = self.n_quantized, self.n_residual
        total = n_q + n_r + new
        batch, heads, head_dim = self.shape

        if n_q + n_r == 0:
            out_k, out_v = key_states, value_states  # first pass: attention uses the originals
        else:
            out_k, out_v = self.scratch.views((batch, heads, total, head_dim), key_states)
            self._dequantize_keys(out_k, 0, n_q)
            self._dequantize_values(out_v, 0, n_q)
            out_k[:, :, n_q:n_q + n_r] = self.res_keys[:, :, :n_r]
            out_v[:, :, n_q:n_q + n_r] = self.res_values[:, :, :n_r]
            out_k[:, :, n_q + n_r:] = key_states
            out_v[:, :, n_q + n_r:] = value_states

        full = (n_r + new) // g * g  # tokens that complete groups now: quantize them
        if full:
            if n_q + full > self.quantized_capacity:
                self._grow(n_q + full)
            # the tokens n_q..n_q+full: in the scratch (after the first pass) or the new states (first pass)
            self._quantize(out_k[:, :, n_q:n_q + full], out_v[:, :, n_q:n_q + full], n_q)
            rest = n_r + new - full  # < g, all from the new tokens (full >= g > n_r)
            if rest:
                self.res_keys[:, :, :rest] = key_states[:, :, new - rest:]
                self.res_values[:, :, :rest] = value_states[:, :, new - rest:]
            self.n_quantized, self.n_residual = n_q + full, rest
        else:
            self.res_keys[:, :, n_r:n_r + new] = key_states
            self.res_values[:, :, n_r:n_r + new] = value_states
            self.n_residual = n_r + new
        self.cumulative_length = total
        self.keys, self.values = self.res_keys[:, :, :self.n_residual], self.res_values[:, :, :self.n_residual]
        return out_k, out_v

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def reset(self) -> None:
        self.cumulative_length = self.n_quantized = self.n_residual = 0
        if self.is_initialized:
            self.keys, self.values = self.res_keys[:, :, :0], self.res_values[:, :, :0]

    def offload(self) -> None:  # the quantized cache is never offloaded
        return None

    def prefetch(self) -> None:
        return None

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("The quantized KV cache cannot be cropped (assisted decoding is not supported).")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("The quantized KV cache does not support beam search.")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("The quantized KV cache does not support expanding the batch.")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("The quantized KV cache does not support selecting batch rows.")

    # quantization ------------------------------------------------------------------------------------------
    def _quantize(self, keys: torch.Tensor, values: torch.Tensor, start: int) -> None:
        """Quantize `keys`/`values` ([B, H, n, D], n a multiple of the group) into positions start..start+n."""
        g, nbits = self.spec.group_size, self.spec.nbits
        qmax = (1 << nbits) - 1
        batch, heads, head_dim = self.shape
        n = keys.shape[2]
        for s in range(0, n, QUANTIZE_CHUNK_TOKENS):
            e = min(n, s + QUANTIZE_CHUNK_TOKENS)
            t, pos = e - s, start + s
            # keys: per channel, one scale/zero over each group of g tokens
            x = keys[:, :, s:e].float().view(batch, heads, t // g, g, head_dim)
            scale, zero = self._scale_zero(x.amin(dim=3), x.amax(dim=3), qmax)
            self.key_scale[:, :, pos // g:(pos + t) // g] = scale
            self.key_zero[:, :, pos // g:(pos + t) // g] = zero
            codes = x.sub_(zero.float().unsqueeze(3)).div_(scale.float().unsqueeze(3)).round_().clamp_(0, qmax)
            self.q_keys[:, :, pos:pos + t] = pack_codes(codes.to(torch.uint8).view(batch, heads, t, head_dim), nbits)
            del x, codes
            # values: per token, one scale/zero over each group of channels
            gv = self.value_group
            y = values[:, :, s:e].float().view(batch, heads, t, head_dim // gv, gv)
            scale, zero = self._scale_zero(y.amin(dim=4), y.amax(dim=4), qmax)
            self.value_scale[:, :, pos:pos + t] = scale
            self.value_zero[:, :, pos:pos + t] = zero
            codes = y.sub_(zero.float().unsqueeze(4)).div_(scale.float().unsqueeze(4)).round_().clamp_(0, qmax)
            self.q_values[:, :, pos:pos + t] = pack_codes(codes.to(torch.uint8).view(batch, heads, t, head_dim),
                                                          nbits)

    def _scale_zero(self, lo: torch.Tensor, hi: torch.Tensor, qmax: int) -> tuple[torch.Tensor, torch.Tensor]:
        # Stored in the cache dtype; codes are computed with the rounded values so dequantization matches.
        scale = ((hi - lo) / qmax).clamp_min(1e-6).to(self.dtype)
        return scale, lo.to(self.dtype)

    def _dequantize_keys(self, out: torch.Tensor, start: int, end: int) -> None:
        g = self.spec.group_size
        batch, heads, head_dim = self.shape
        step = max(g, DEQUANT_CHUNK_TOKENS // g * g)
        for s in range(start, end, step):
            e = min(end, s + step)
            groups = (e - s) // g
            codes = self._codes(self.q_keys[:, :, s:e]).view(batch, heads, groups, g, head_dim)
            target = out[:, :, s:e].view(batch, heads, groups, g, head_dim)
            torch.mul(codes, self.key_scale[:, :, s // g:e // g].unsqueeze(3), out=target)  # uint8 * bf16 -> bf16
            target.add_(self.key_zero[:, :, s // g:e // g].unsqueeze(3))

    def _dequantize_values(self, out: torch.Tensor, start: int, end: int) -> None:
        gv = self.value_group
        batch, heads, head_dim = self.shape
        for s in range(start, end, DEQUANT_CHUNK_TOKENS):
            e = min(end, s + DEQUANT_CHUNK_TOKENS)
            shape = (batch, heads, e - s, head_dim // gv, gv)
            codes = self._codes(self.q_values[:, :, s:e]).view(shape)
            target = out[:, :, s:e].view(shape)
            torch.mul(codes, self.value_scale[:, :, s:e].unsqueeze(4), out=target)
            target.add_(self.value_zero[:, :, s:e].unsqueeze(4))

    def _codes(self, packed: torch.Tensor) -> torch.Tensor:
        """Unpacked uint8 codes [..., head_dim] of packed [..., head_dim * nbits / 8], written in place (one
        uint8 temporary, no stack)."""
        nbits = self.spec.nbits
        if nbits == 8:
            return packed
        per_byte, mask = 8 // nbits, (1 << nbits) - 1
        codes = torch.empty(*packed.shape[:-1], packed.shape[-1], per_byte, dtype=torch.uint8, device=packed.device)
        for j in range(per_byte):
            if j == 0:
                torch.bitwise_and(packed, mask, out=codes[..., 0])
            else:
                torch.bitwise_right_shift(packed, nbits * j, out=codes[..., j])
                if j < per_byte - 1:
                    codes[..., j].bitwise_and_(mask)
        return codes.flatten(-2)


class QuantizedKVCache(_Cache):  # type: ignore[misc, valid-type]
    """transformers Cache of GroupQuantizedLayer (full-attention layers) and plain sliding-window layers."""

    def __init__(self, config: Any, spec: QuantizedKVSpec | None = None, capacity_tokens: int | None = None) -> None:
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        self.spec = (spec or QuantizedKVSpec()).validate()
        self.scratch = _Scratch()
        layers = [
            _DynamicSlidingWindowLayer(sliding_window=window) if window is not None
            else GroupQuantizedLayer(self.spec, capacity_tokens, self.scratch)
            for window in layer_windows(text)
        ]
        super().__init__(layers=layers)


# --- public API ------------------------------------------------------------------------------------------------


def check_kv_cache(mode: str, device: torch.device) -> None:
    """Whether `device` can run KV cache mode `mode`, before anything is loaded or allocated (SettingsError if
    not)."""
    check_kv_cache_name(mode)
    if mode == "offload" and torch.device(device).type != "cuda":
        raise SettingsError("KV_CACHE=offload moves the cache from the GPU to CPU memory; it needs a CUDA "
                            "device. On CPU the bf16 cache already lives in RAM: use KV_CACHE=bf16.")


def make_cache(
    mode: str,
    model: Any,
    *,
    capacity_tokens: int | None = None,
    quant: QuantizedKVSpec | None = None,
    backend: str = "builtin",
) -> Any:
    """A fresh cache for one reply. `capacity_tokens` (prompt + max_new_tokens) lets the quantized cache allocate
    its storage once. Raises SettingsError for an unknown mode/backend, a missing backend package, or offload
    without CUDA."""
    check_kv_cache(mode, getattr(model, "device", torch.device("cpu")))
    from transformers import DynamicCache

    config = model.config
    if mode == "bf16":
        return DynamicCache(config=config)
    if mode == "offload":
        return DynamicCache(config=config, offloading=True)
    spec = (quant or plain_quant_spec(mode)).validate()
    if backend == "builtin":
        return QuantizedKVCache(config, spec, capacity_tokens)
    if backend not in _BACKEND_PACKAGES:
        raise SettingsError(f"KV quantization backend {backend!r} is unknown; choose one of: "
                            f"{', '.join(QUANT_BACKENDS)}.")
    module, requirement = _BACKEND_PACKAGES[backend]
    if importlib.util.find_spec(module.split(".")[0]) is None or importlib.util.find_spec(module) is None:
        raise SettingsError(f"KV quantization backend {backend!r} needs the {requirement.split('==')[0]} package, "
                            f"which is not installed (`pip install {requirement}`); or use the builtin backend.")
    from transformers import QuantizedCache

    try:
        return QuantizedCache(backend, config, nbits=spec.nbits, q_group_size=spec.group_size,
                              residual_length=spec.group_size)
    except ValueError as exc:  # e.g. sliding-window layers, or nbits the backend does not offer
        raise SettingsError(f"KV quantization backend {backend!r} cannot serve this model: {exc}") from exc


def cache_bytes(cache: Any, device: torch.device | str | None = None) -> int:
    """Bytes held by a cache object: every tensor its layers reference (K/V, packed codes, scales and zero points,
    residual buffers, the dequantization scratch), each storage counted once and whole (a sliding layer's K is a
    view that keeps its window + 1 tokens alive); only those on `device` when given. 0-d bookkeeping tensors are
    left out."""
    if cache is None:
        return 0
    seen: set[tuple[str, int]] = set()
    want = torch.device(device).type if device is not None else None
    total = 0

    def visit(obj: Any, depth: int) -> None:
        nonlocal total
        if depth > 4 or obj is None:
            return
        if isinstance(obj, torch.Tensor):
            if obj.device.type == "meta" or (want is not None and obj.device.type != want):
                return
            storage = obj.untyped_storage()
            key = (str(obj.device), storage.data_ptr())
            if obj.dim() and storage.nbytes() and key not in seen:  # 0-d bookkeeping (window, lengths) skipped
                seen.add(key)
                total += storage.nbytes()
        elif isinstance(obj, (list, tuple)):
            for item in obj:
                visit(item, depth + 1)
        elif isinstance(obj, dict):
            for item in obj.values():
                visit(item, depth + 1)
        elif hasattr(obj, "__dict__") and not isinstance(obj, (type, torch.nn.Module)):
            for item in vars(obj).values():  # quantized states (hqq meta dicts, quanto QTensors), the scratch
                visit(item, depth + 1)

    for layer in getattr(cache, "layers", []):
        visit(layer, 0)
    visit(getattr(cache, "scratch", None), 0)
    return total


def cache_kwarg(model: Any) -> str:
    """The keyword a model's forward/generate takes the cache under: "cache" (transformers >= 5.2x) or
    "past_key_values" (older 5.x)."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"


def returned_cache(outputs: Any) -> Any:
    """The cache a generate/forward output carries, under either name."""
    for name in ("cache", "past_key_values"):
        value = getattr(outputs, name, None)
        if value is not None:
            return value
    return None


@torch.no_grad()  # not inference_mode: generate later updates the cache's buffers in place outside of it
def prefill_in_chunks(model: Any, input_ids: torch.Tensor, cache: Any, chunk_tokens: int) -> int:
    """Run the prompt except its last token through `model` in passes of at most `chunk_tokens`, filling `cache`
    (activation memory then scales with the chunk, not the prompt). Returns the tokens now cached; pass the full
    `input_ids` and the cache to generate, which then only processes the last token."""
    if chunk_tokens <= 0:
        raise SettingsError(f"The prefill chunk must be a positive number of tokens, got {chunk_tokens}.")
    extra: dict[str, Any] = {cache_kwarg(model): cache}
    if "logits_to_keep" in inspect.signature(model.forward).parameters:
        extra["logits_to_keep"] = 1  # only the last position's logits (unused here anyway)
    todo = input_ids.shape[1] - 1
    done = cache.get_seq_length()
    while done < todo:
        end = min(todo, done + chunk_tokens)
        positions = torch.arange(done, end, device=input_ids.device).unsqueeze(0)
        model(input_ids=input_ids[:, done:end], position_ids=positions, use_cache=True, **extra)
        done = end
    return done
