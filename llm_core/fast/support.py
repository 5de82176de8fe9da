"""Can the fast path run this model? The llama-family pieces it reads, and the linear-layer kinds it knows."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..types import LoadedModel

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
UNSUPPORTED_ROPE_TYPES = ("dynamic", "longrope")  # they change inv_freq with the sequence length at run time


def fast_path_support(loaded: LoadedModel, *, allow_cpu: bool = False) -> tuple[bool, str]:
    """(can run, reason shown in the model panel). False on CPU unless `allow_cpu`, on offloaded models, on
    quantization modes other than nf4/int8/none, and on architectures whose layers this module does not implement."""
    device = loaded.device
    if device.type != "cuda" and not allow_cpu:
        return False, "CPU: the fast path needs CUDA graphs; plain generate is used"
    if loaded.report.offloaded:
        return False, "layers are offloaded to CPU (MAX_MEMORY); the fast path needs every weight on the GPU"
    quant = loaded.settings.quantization
    if quant not in ("nf4", "int8", "none"):
        return False, f"QUANTIZATION={quant} is not supported by the fast path (nf4, int8 or none)"
    try:
        Arch.from_model(loaded.model)
    except Unsupported as exc:
        return False, str(exc)
    if device.type == "cuda":
        try:
            from torch.utils._triton import has_triton
        except ImportError:  # pragma: no cover - very old torch
            return False, "this PyTorch cannot report Triton support; torch.compile is unavailable"
        if not has_triton():
            return False, "Triton is not installed, so torch.compile cannot build the decode step"
    kind = {"nf4": "NF4", "int8": "int8 (weight-only)"}.get(quant, str(loaded.compute_dtype).removeprefix("torch."))
    return True, f"static KV cache + compiled {kind} decode step replayed as CUDA graphs"


class Unsupported(Exception):
    """The model's structure is outside what the fast path implements (message is user-facing)."""


@dataclass
class Arch:
    """The pieces of a llama-family transformers model the fast path reads (modules, not copies)."""

    model: Any
    embed: Any
    layers: list[Any]
    norm: Any
    rotary: Any
    lm_head: Any
    n_heads: int
    n_kv_heads: int
    head_dim: int
    hidden: int
    vocab: int
    qk_norm: bool

    @classmethod
    def from_model(cls, model: Any) -> Arch:
        cfg = model.config
        model_type = getattr(cfg, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise Unsupported(f"model type {model_type!r} is not implemented by the fast path "
                               f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
        layer_types = getattr(cfg, "layer_types", None) or []
        if any(t != "full_attention" for t in layer_types) or (
                getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", model_type == "mistral")):
            raise Unsupported("sliding-window attention is not implemented by the fast path")
        rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
        rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
        if rope_type in UNSUPPORTED_ROPE_TYPES:
            raise Unsupported(f"RoPE type {rope_type!r} changes with the sequence length; not supported")
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise Unsupported(f"activation {cfg.hidden_act!r} is not implemented by the fast path (silu only)")
        inner: Any = getattr(model, "model", None)
        layers = list(getattr(inner, "layers", []) or [])
        if not layers or not all(hasattr(inner, a) for a in ("embed_tokens", "norm", "rotary_emb")):
            raise Unsupported("the model does not have the llama layout (model.layers, norm, rotary_emb)")
        n_heads = int(cfg.num_attention_heads)
        n_kv = int(getattr(cfg, "num_key_value_heads", None) or n_heads)
        head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads)
        qk_norm = False
        for layer in layers:
            attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
            names = [(attn, "q_proj"), (attn, "k_proj"), (attn, "v_proj"), (attn, "o_proj"),
                     (mlp, "gate_proj"), (mlp, "up_proj"), (mlp, "down_proj"),
                     (layer, "input_layernorm"), (layer, "post_attention_layernorm")]
            if any(getattr(owner, name, None) is None for owner, name in names):
                raise Unsupported("a decoder layer lacks the llama projections (q/k/v/o, gate/up/down)")
            qk_norm = hasattr(attn, "q_norm")
            for owner, name in names[:7]:
                _check_linear(getattr(owner, name))
        lm_head = model.get_output_embeddings()
        if lm_head is None:
            raise Unsupported("the model has no output projection (lm_head)")
        _check_linear(lm_head)
        return cls(model, inner.embed_tokens, layers, inner.norm, inner.rotary_emb, lm_head, n_heads, n_kv, head_dim,
                   int(cfg.hidden_size), int(lm_head.out_features) if is_nf4_linear(lm_head) or is_int8_table(lm_head)
                   else int(lm_head.weight.shape[0]), qk_norm)


def is_nf4_linear(module: Any) -> bool:
    return type(module).__name__ in ("Linear4bit", "LinearNF4", "LinearFP4") and hasattr(module.weight, "quant_state")


def is_int8_linear(module: Any) -> bool:
    """bitsandbytes' LLM.int8 layer holding int8 weights (CB) and per-row scales (SCB)."""
    return type(module).__name__ == "Linear8bitLt" and module.weight.dtype == torch.int8


def is_int8_table(module: Any) -> bool:
    """The int8 lm_head of llm_core.fast.tables (int8 rows, an fp32 scale per row)."""
    return type(module).__name__ == "TableHead" and hasattr(module, "table")


def is_dense_linear(module: Any) -> bool:
    return not (is_nf4_linear(module) or is_int8_linear(module) or is_int8_table(module))


def int8_scb(module: Any) -> torch.Tensor | None:
    """The per-row absmax of an int8 layer: on the weight until its first forward, then on its matmul state."""
    scb = getattr(module.weight, "SCB", None)
    return scb if scb is not None else getattr(module.state, "SCB", None)


def int8_row_scale(module: Any) -> torch.Tensor:
    """SCB / 127 in fp32: the factor each int8 row is dequantized with (bitsandbytes' int8_vectorwise_dequant)."""
    scb = int8_scb(module)
    if scb is None:
        raise Unsupported("an int8 layer has no row scales (SCB)")
    return scb.float() / 127


def int8_weight_fp32(module: Any) -> torch.Tensor:
    """An LLM.int8 layer's weights as bitsandbytes dequantizes them (CB * SCB / 127), in fp32: what the fast path's
    int8 products compute with (the reference of its accuracy checks)."""
    return module.weight.data.float() * int8_row_scale(module)[:, None]


def _check_linear(module: Any) -> None:
    if is_int8_table(module):
        return
    if is_nf4_linear(module):
        qs = module.weight.quant_state
        if qs is None or qs.quant_type != "nf4":
            raise Unsupported("only NF4 4-bit weights are implemented by the fast path")
        if module.in_features % qs.blocksize or qs.blocksize % 2:
            raise Unsupported(f"4-bit block size {qs.blocksize} does not divide the input size {module.in_features}")
        return
    if is_int8_linear(module):
        if module.state.has_fp16_weights or int8_scb(module) is None or module.weight.dim() != 2:
            raise Unsupported("int8 layers must hold quantized weights and row scales (inference mode)")
        return
    if not isinstance(module, torch.nn.Linear):
        raise Unsupported(f"{type(module).__name__} layers are not implemented by the fast path")


def config_fast_path_support(config: Any, quantization: str) -> tuple[bool, str]:
    """Whether the fast path would run this model on a CUDA card from its config alone (no weights)."""
    model_type = getattr(config, "model_type", None)
    if quantization not in ("nf4", "int8", "none"):
        return False, f"QUANTIZATION={quantization} runs on plain generate (the fast path takes nf4, int8, none)"
    if model_type not in SUPPORTED_MODEL_TYPES:
        return False, (f"model type {model_type!r} runs on plain generate "
                       f"(fast path: {', '.join(SUPPORTED_MODEL_TYPES)})")
    sliding = getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window",
                                                                  model_type == "mistral")
    if any(t != "full_attention" for t in (getattr(config, "layer_types", None) or [])) or sliding:
        return False, "sliding-window attention runs on plain generate"
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    if rope_type in UNSUPPORTED_ROPE_TYPES:
        return False, f"RoPE type {rope_type!r} runs on plain generate"
    if getattr(config, "hidden_act", "silu") != "silu":
        return False, f"activation {config.hidden_act!r} runs on plain generate"
    return True, "fast path: static KV cache, compiled decode step replayed as CUDA graphs"
