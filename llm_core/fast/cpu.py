"""CPU decode path: weight-only int4/int8 linears and a static-cache decode step compiled by inductor's CPU code
generation; knows nothing of chat, settings files or the UI.

Why this route (measured on a 2-core AMD EPYC, docs/cpu.md): decoding one token of a small model reads every weight
once, so on CPU it is bound by bytes of weights per token and by per-op dispatch (30 layers x ~15 ops). fp32 weights
read 540 MB per token for SmolLM2-135M; torch's weight-only int4 kernel (`_weight_int4pack_mm_for_cpu`, bf16
activations, AVX-512) reads 0.625 byte per weight, the bytes llama.cpp's Q4_1 reads, and one compiled graph for the
step (or a few) removes the Python per op. The pipeline:

- quantize_for_cpu (at load, instead of bitsandbytes): every decoder linear becomes int4, groups of 32 along the
  input with a scale and a float zero (min/max per group: for a Q4_1 GGUF, whose blocks are 32 wide and whose
  extremes hit 0 and 15, this gives back the file's own grid); the tied lm_head/embedding becomes int8 per row (the
  GGUF's token table is Q8_0). q/k/v and gate/up are quantized as one fused matrix each; the transformers modules
  are re-pointed at row views of it, so plain `generate` keeps working on the same bytes (the quantization's own
  reference) and memory is not doubled.
- weights: llm_core.fast.cpu_weights.
- the static cache: per layer (Hkv, L, D), head-major, bf16 (fp32 for dense fp32 weights).
- prefill: the same layer over the prompt, eager (SDPA attention), writing K/V into the static cache.
  Attention reads a bf16 cache as it is (bf16 queries, fp32 accumulation) where the CPU multiplies bf16 natively
  (attention_dtype_is_cache), else fp32 copies of it. Over the bf16 cache its SDPA calls are cut by absolute
  position (attention_blocks), so a row gets the same bits in a prefill of any chunks as in a decode step: replies
  with and without the prefix cache are token-identical.
- decode_step: embedding -> 30 layers -> norm -> lm_head for one token, compiled by inductor as one graph per group
  of up to LAYERS_PER_GRAPH consecutive layers (groups of one size share one graph, their weights inputs; the
  attended length dynamic, so attention reads exactly the live rows) and one for the head, which also applies the
  repetition penalty and the EOS ban and takes the argmax; the one-token attention is an SDPA call over the bf16
  cache as stored (as prefill), or inductor's own fused reduction over fp32 where prefill copies; eager if compiling
  fails. Fewer, larger graphs cut the per-call cost (Python wrapper,
  extern-kernel checks) that 2 threads do not share; measured in docs/cpu.md.
- select: greedy reads the head graph's argmax; sampling runs llm_core.sampling's warpers and multinomial on the
  head graph's (penalized) fp32 scores.
- a reply in pieces (start, a prefill chunk, a step, finish/fail): the CPU runner (llm_core.engine.cpu_runner) runs
  them as the one row of the engine's scheduler loop, so each token goes out as it is made and Stop is honoured
  between prefill chunks and steps.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from ..config import GenerationSettings
from ..errors import GenerationError
from ..sampling import logits_processors, next_token, sampling_generator
from .compiled import own_code
from .cpu_weights import ACT_DTYPE, GROUP_SIZE, CPUWeights, embed_rows, fused_linear

if TYPE_CHECKING:
    from ..prefix_cache import PrefixCache

log = logging.getLogger(__name__)

LAYERS_PER_GRAPH = 5  # consecutive decoder layers per compiled graph (docs/cpu.md)
# inductor options of the decode graphs: its wrapper's Python checks of every extern kernel's output size, stride and
# alignment (a few per kernel, ~50 kernels per 5 layers) measured ~5% of a 135M token (docs/cpu.md)
GRAPH_OPTIONS = {"size_asserts": False, "alignment_asserts": False, "scalar_asserts": False}
QUERY_ROWS = 4  # the fewest query rows an SDPA call over a bf16 cache gets (attention_blocks)
ATTENTION_BLOCK = 64  # query rows per SDPA call over a bf16 cache, read to the block's end (attention_blocks)
DECODE_ATTENTION = "fused"  # one token's attention in the decode graphs: sdpa | fused (inductor's own reduction)
# QUANTIZATION (what the user asked for) -> the weight format the CPU path computes with
CPU_FORMATS = {"nf4": "int4", "fp4": "int4", "int8": "int8", "none": "dense"}


def cpu_weight_format(quantization: str) -> str:
    """int4 | int8 | dense: the CPU path's weight format for a requested quantization."""
    return CPU_FORMATS[quantization]


CPU_MODEL_TYPES = ("llama", "mistral")  # the layer forward_tokens implements: no biases, no q/k norms


def cpu_path_support(config: Any) -> tuple[bool, str]:
    """(can the CPU path run a model of this config, why not): read before loading, since the path decides how the
    weights are loaded (float, then quantized here, instead of bitsandbytes)."""
    model_type = getattr(config, "model_type", None)
    if model_type not in CPU_MODEL_TYPES:
        return False, f"model type {model_type!r} is not implemented by the CPU path ({', '.join(CPU_MODEL_TYPES)})"
    if getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
        return False, "linear biases are not implemented by the CPU path"
    if getattr(config, "hidden_act", "silu") != "silu":
        return False, f"activation {config.hidden_act!r} is not implemented by the CPU path (silu only)"
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", model_type == "mistral"):
        return False, "sliding-window attention is not implemented by the CPU path"
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    if rope_type in ("dynamic", "longrope"):
        return False, f"RoPE type {rope_type!r} changes with the sequence length; not supported by the CPU path"
    hidden = int(config.hidden_size)
    inter = int(getattr(config, "intermediate_size", hidden))
    if hidden % GROUP_SIZE or inter % GROUP_SIZE:
        return False, f"hidden/MLP sizes ({hidden}, {inter}) are not multiples of the int4 group ({GROUP_SIZE})"
    return True, ""


# --- the step ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepSpec:
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    scale: float
    eps: float
    fmt: str
    head_fmt: str
    splits_qkv: tuple[int, int, int]
    splits_gate_up: tuple[int, int]
    decode_attention: str = "sdpa"
    cache_dtype_attention: bool = False  # SDPA over the cache as stored (bf16), not fp32 copies: see attention_dtype


def _no_guards(entries: Sequence[Any]) -> list[bool]:
    return [False for _ in entries]


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm, op for op, but for the mean of squares, summed in fp64 (each fp32 square exact
    there): the compiled decode step and the eager prefill sum a row in different orders, which in fp32 gave ~1 row
    in 4 other bits; in fp64 the fp32 result is the same either way (docs/cpu.md, "Token-identical replies")."""
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.double().pow(2).mean(-1, keepdim=True).float() + eps)
    return weight * xf.to(x.dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def attention_dtype_is_cache(cache_dtype: torch.dtype) -> bool:
    """Whether SDPA reads a bf16 cache as it is (bf16 queries, fp32 accumulation) instead of fp32 copies of it: where
    the CPU multiplies bf16 natively (AVX512-BF16 or AMX), torch's CPU flash attention is 1.9-3.4x faster that way
    for a 512-token chunk over 0.6-6k cached tokens and 2x for one token over 6k (bench/results/
    2026-12-05-cpu-attention.json); elsewhere bf16 GEMMs are emulated, so the fp32 copies stay (not measured). fp32
    caches (the dense reference) are read as they are either way."""
    if cache_dtype != torch.bfloat16:
        return False
    probe = getattr(torch.cpu, "_is_avx512_bf16_supported", None)
    amx = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool((probe is not None and probe()) or (amx is not None and amx()))


AttentionBlock = tuple[int, int, int, torch.Tensor]  # rows a..b-1, keys 0..end-1, the (b - a, end) additive mask


def attention_blocks(first: int, seq: int, rows: int, dtype: torch.dtype, block: int = ATTENTION_BLOCK
                     ) -> list[AttentionBlock]:
    """How attention over a bf16 cache read as stored splits query rows first..first+seq-1 into SDPA calls so that a
    row's output has the same bits however the rows came (one prompt, a prompt in chunks, a cached prefix plus a
    chunk, one decode step): each call holds the rows of one block of `block` absolute positions and attends keys
    0..end-1, end the block's end, the keys after each row masked by an additive mask (0 / -inf). torch's CPU flash
    attention sums a row's keys in key blocks of 512 and its last, shorter one whose size is the call's key count
    (and a causal call's query block decides it): fixing that count per row fixes the order of the sums; its bf16
    GEMMs give a row the same bits whatever the number of rows from QUERY_ROWS on (fewer rows: another kernel, other
    bits), so a call of fewer rows gets zero rows after them (docs/cpu.md, "Token-identical replies"). The cache
    holds rows up to the next multiple of `block` (CPUDecoder._allocate) and rows past the written ones are zeroed
    before they are read (CPUDecoder._clean), so the masked ones are finite."""
    blocks = []
    a, last = first, first + seq
    while True:
        end = torch.sym_min((a // block + 1) * block, rows)  # rows: the cache's
        b = last if seq == 1 else min(last, end)  # seq 1: the decode graph's position is symbolic, one block
        # at least QUERY_ROWS query rows a call: the rows after b - a are zeros, their mask rows 0 (see above)
        mask = torch.zeros(QUERY_ROWS if seq == 1 else max(QUERY_ROWS, b - a), end, dtype=dtype)
        mask[:1 if seq == 1 else b - a].masked_fill_(torch.arange(end)[None, :] > torch.arange(a, b)[:, None],
                                                      float("-inf"))
        blocks.append((a, b, end, mask))
        if seq == 1 or b >= last:
            return blocks
        a = b


def layer_forward(spec: StepSpec, h: torch.Tensor, pos: torch.Tensor, start: int, cos: torch.Tensor,
                  sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, n: int,
                  norm_in: torch.Tensor, norm_post: torch.Tensor, w: Sequence[torch.Tensor],
                  masks: Sequence[AttentionBlock] | None = None) -> torch.Tensor:
    """One decoder layer over S tokens at positions pos = start..start+S-1. h (S, H) fp32 residual; cos/sin (S, D);
    k/v_cache (Hkv, L, D): this layer's whole static cache, its own tensor, head-major (each head's rows contiguous:
    one token's attention over 6k rows takes 0.72 ms a layer against 1.02 token-major, fused form; rows pos are
    written in place here; attention reads rows 0..n-1 only, n = start + S);
    w: the tensors of qkv, o, gate_up, down in order."""
    seq = h.shape[0]
    per = 2 if spec.fmt in ("int4", "int8") else 1
    hkv, nh, d = spec.n_kv_heads, spec.n_heads, spec.head_dim
    x = _rms_norm(h, norm_in, spec.eps)
    q, k, v = fused_linear(spec.fmt, x, w[0:per]).split(spec.splits_qkv, dim=-1)
    q = _rope(q.view(seq, nh, d), cos[:, None], sin[:, None])
    k = _rope(k.view(seq, hkv, d), cos[:, None], sin[:, None])
    k_cache.index_copy_(1, pos, k.transpose(0, 1).to(k_cache.dtype))
    v_cache.index_copy_(1, pos, v.view(seq, hkv, d).transpose(0, 1).to(v_cache.dtype))
    att = k_cache.dtype if spec.cache_dtype_attention else q.dtype
    gqa = hkv != nh
    if spec.cache_dtype_attention:  # the bf16 cache as stored: batch-invariant blocks (attention_blocks)
        qh = q.transpose(0, 1)[None].to(att)  # (1, H, S, D)
        parts = []
        for a, b, end, mask in masks or attention_blocks(n - seq, seq, k_cache.shape[1], att):
            rows = qh[:, :, a - n + seq:b - n + seq]
            if mask.shape[0] > rows.shape[2]:
                rows = torch.cat([rows, rows.new_zeros(1, nh, mask.shape[0] - rows.shape[2], d)], dim=2)
            out = F.scaled_dot_product_attention(rows, k_cache[None, :, :end], v_cache[None, :, :end], attn_mask=mask,
                                                 scale=spec.scale, enable_gqa=gqa)
            parts.append(out[:, :, :1] if seq == 1 else out[:, :, :b - a])
        attn = torch.cat(parts, dim=2) if len(parts) > 1 else parts[0]
        return _layer_tail(spec, h, attn[0].transpose(0, 1).reshape(seq, nh * d).to(h.dtype), norm_post, w, per)
    keys = k_cache[:, :n][None].to(att)  # (1, Hkv, n, D)
    values = v_cache[:, :n][None].to(att)
    qh = q.transpose(0, 1)[None].to(att)  # (1, H, S, D)
    if seq == 1 and spec.decode_attention == "fused" and not spec.cache_dtype_attention \
            and torch.compiler.is_compiling():
        # one query over an fp32 copy, compiled: products, softmax and sums inductor fuses into its own loops (no
        # SDPA call, no copy; eagerly these would materialize (H, n, D) products, so the eager step keeps SDPA).
        # Over a bf16 cache read as it is, SDPA is faster (docs/cpu.md)
        qg = q.view(hkv, nh // hkv, 1, d).float()  # query head i reads kv head i // (nh / hkv), as enable_gqa
        kt = k_cache[:, None, :n].float()  # (Hkv, 1, n, D)
        vt = v_cache[:, None, :n].float()
        p = torch.softmax((qg * kt).sum(-1) * spec.scale, dim=-1)  # (Hkv, G, n)
        return _layer_tail(spec, h, (p[..., None] * vt).sum(-2).reshape(1, nh * d).to(h.dtype), norm_post, w, per)
    if seq == 1:
        attn = F.scaled_dot_product_attention(qh, keys, values, scale=spec.scale, enable_gqa=gqa)
    elif start == 0:
        attn = F.scaled_dot_product_attention(qh, keys, values, is_causal=True, scale=spec.scale, enable_gqa=gqa)
    else:  # a later chunk: every cached row before it, causal within it
        n = keys.shape[2]
        mask = torch.arange(n)[None, :] <= torch.arange(start, n)[:, None]
        attn = F.scaled_dot_product_attention(qh, keys, values, attn_mask=mask, scale=spec.scale, enable_gqa=gqa)
    attn = attn[0].transpose(0, 1).reshape(seq, nh * d)
    return _layer_tail(spec, h, attn.to(h.dtype), norm_post, w, per)


def _layer_tail(spec: StepSpec, h: torch.Tensor, attn: torch.Tensor, norm_post: torch.Tensor,
                w: Sequence[torch.Tensor], per: int) -> torch.Tensor:
    """A layer after attention: o projection, residual, MLP, residual."""
    h = h + fused_linear(spec.fmt, attn, w[per:2 * per])
    x = _rms_norm(h, norm_post, spec.eps)
    gate, up = fused_linear(spec.fmt, x, w[2 * per:3 * per]).split(spec.splits_gate_up, dim=-1)
    return h + fused_linear(spec.fmt, F.silu(gate) * up, w[3 * per:4 * per])


def head_forward(spec: StepSpec, h: torch.Tensor, norm: torch.Tensor, head: Sequence[torch.Tensor]) -> torch.Tensor:
    """The last row of h (S, H) -> logits (1, V) fp32."""
    return head_logits(spec, _rms_norm(h[-1:], norm, spec.eps), head)


def head_logits(spec: StepSpec, last: torch.Tensor, head: Sequence[torch.Tensor]) -> torch.Tensor:
    """Final-normed hidden (1, H) -> logits (1, V) fp32. Compiled (int8): one row against the int8 table as one
    inductor reduction, fp32 products and the row scale after the sum, 2x faster than _weight_int8pack_mm on
    49152 x 576; the norm stays outside that graph, as inductor would recompute it for every row (docs/cpu.md)."""
    if spec.head_fmt == "int8" and torch.compiler.is_compiling():
        return ((last.float() * head[0].float()).sum(-1) * head[1].float())[None]
    return fused_linear(spec.head_fmt, last, head).float()


def select_scores(logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor, bias: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """generate's repetition penalty and min_new_tokens' EOS ban as one pointwise pass over the logits (1, V), and
    the greedy pick: (scores (1, V), argmax (1,)). seen (1, V) bool: the ids the penalty reads (prompt + new; each id
    once, as RepetitionPenaltyLogitsProcessor's gather/scatter); penalty (1,); bias (1, V): 0, or -inf on banned
    ids. With penalty 1 and bias 0 the scores are the logits exactly."""
    scores = torch.where(seen, torch.where(logits < 0, logits * penalty, logits / penalty), logits) + bias
    return scores, scores.argmax(-1)


def layers_graph(spec: StepSpec, h: torch.Tensor, pos: torch.Tensor, cos_table: torch.Tensor,
                 sin_table: torch.Tensor, ks: Sequence[torch.Tensor], vs: Sequence[torch.Tensor], length: torch.Tensor,
                 norms: Sequence[torch.Tensor], weights: Sequence[Sequence[torch.Tensor]], final_norm: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """What one compiled decode graph runs: len(ks) consecutive layers for one token at `pos` (the attended length
    is length.shape[0], kept symbolic), RoPE read from the tables. Returns (h, final-normed h): the head's input is
    ready whichever group is last (one row's norm, negligible)."""
    cos, sin = cos_table[pos], sin_table[pos]
    n = length.shape[0]
    # one set of attention masks for the group's layers (as forward_tokens), not one per layer in the graph
    masks = attention_blocks(n - 1, 1, ks[0].shape[1], ks[0].dtype) if spec.cache_dtype_attention else None
    for i in range(len(ks)):
        h = layer_forward(spec, h, pos, 0, cos, sin, ks[i], vs[i], n, norms[2 * i], norms[2 * i + 1], weights[i],
                          masks)
    return h, _rms_norm(h, final_norm, spec.eps)


def layer_groups(n_layers: int, per: int) -> list[tuple[int, int]]:
    """(first layer, count) of consecutive groups of at most `per` layers, as even as can be: 30 by 5 -> six of 5,
    16 by 5 -> four of 4, 22 by 5 -> 5, 5, 4, 4, 4 (never more than two sizes, so at most two graphs to compile)."""
    groups = -(-n_layers // max(1, per))
    sizes = [n_layers // groups + (1 if i < n_layers % groups else 0) for i in range(groups)]
    starts = [sum(sizes[:i]) for i in range(groups)]
    return list(zip(starts, sizes, strict=True))


def forward_tokens(spec: StepSpec, ids: torch.Tensor, pos: torch.Tensor, start: int, cos: torch.Tensor,
                   sin: torch.Tensor, ks: Sequence[torch.Tensor], vs: Sequence[torch.Tensor],
                   norms: Sequence[torch.Tensor], weights: Sequence[Sequence[torch.Tensor]],
                   head: Sequence[torch.Tensor], embed: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """S tokens `ids` (S,) through every layer -> the last position's logits (1, V) fp32. ks/vs: each layer's static
    cache; norms: per layer (input, post-attention), then the final norm."""
    h = embed(ids)  # (S, H)
    # one set of attention masks for every layer
    masks = attention_blocks(start, ids.shape[0], ks[0].shape[1], ks[0].dtype) if spec.cache_dtype_attention else None
    for i in range(spec.n_layers):
        h = layer_forward(spec, h, pos, start, cos, sin, ks[i], vs[i], start + ids.shape[0], norms[2 * i],
                          norms[2 * i + 1], weights[i], masks)
    return head_forward(spec, h, norms[-1], head)


@dataclass
class Selection:
    """What the head graph applies after the logits (select_scores): the penalty's seen ids as a (1, V) mask, the
    penalty (1,), and the bias (1, V) in force (0, or the min_new_tokens ban)."""

    seen: torch.Tensor
    penalty: torch.Tensor
    bias: torch.Tensor

    @classmethod
    def neutral(cls, vocab: int) -> Selection:
        """No penalty, no ban: the scores are the raw logits."""
        return cls(torch.zeros(1, vocab, dtype=torch.bool), torch.ones(1), torch.zeros(1, vocab))


class CPUDecoder:
    """Static KV cache, quantized weights and the compiled decode step of one loaded (CPU-quantized) model.

    One reply at a time (a lock, taken by start() and given back by finish() or fail()). A reply runs as pieces:
    start, prefill_chunk until the prompt is in (its first token), step per new token, finish or fail; the engine's
    CPU runner (llm_core.engine.cpu_runner) calls them from the one scheduler's loop, `generate` in one loop. With a
    `prefix_cache`, a reply prefills only the prompt tokens after the longest prefix whose KV the last reply left in
    the static cache."""

    def __init__(self, loaded: Any, weights: CPUWeights, *, max_cache_len: int | None = None,
                 compile: str = "graphs", layers_per_graph: int | None = None,
                 prefix_cache: PrefixCache | None = None) -> None:
        model = loaded.model
        cfg = model.config
        inner = model.model
        self.loaded, self.weights = loaded, weights
        self.dtype = torch.float32  # the residual stream, norms and RoPE: fp32 whatever the checkpoint's dtype
        n_heads = int(cfg.num_attention_heads)
        n_kv = int(getattr(cfg, "num_key_value_heads", None) or n_heads)
        head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads)
        attn0 = inner.layers[0].self_attn
        # dense weights: the cache in their dtype (fp32: the token-equality reference); int4/int8: bf16, as llama.cpp
        # keeps its cache in f16
        self.cache_dtype = weights.layers[0][0].tensors[0].dtype if weights.fmt == "dense" else ACT_DTYPE
        self.spec = StepSpec(len(inner.layers), n_heads, n_kv, head_dim, float(attn0.scaling),
                             float(inner.norm.variance_epsilon), weights.fmt, weights.head.fmt,
                             tuple(weights.layers[0][0].splits), tuple(weights.layers[0][2].splits),  # type: ignore[arg-type]
                             DECODE_ATTENTION, attention_dtype_is_cache(self.cache_dtype))
        self._norms = [t.detach().float() for layer in inner.layers
                       for t in (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)]
        self._norms.append(inner.norm.weight.detach().float())
        self._w = [[t for f in layer for t in f.tensors] for layer in weights.layers]
        self._head = list(weights.head.tensors)
        self._rotary = inner.rotary_emb
        table = weights.embed
        self._embed: Callable[[torch.Tensor], torch.Tensor] = lambda ids: embed_rows(table, ids, self.dtype)
        self.max_cache_len = int(max_cache_len or loaded.context_length)
        self._lock = threading.Lock()
        self.prefix_cache = prefix_cache  # the ids whose KV the static cache holds (None: every reply from 0)
        self._k: list[torch.Tensor] = []  # per layer (Hkv, L, D), each its own tensor: written in place by the graph
        self._v: list[torch.Tensor] = []
        self._lengths = torch.empty(0)  # sliced to (n,): the attended length as a shape the graphs keep symbolic
        self._clean_to = 0  # cache rows from here on were not written since _allocate (_clean)
        self._rows_used = 0
        self._cos = self._sin = torch.empty(0)  # RoPE of every cache row, made with the cache
        self._step: Callable[..., tuple[torch.Tensor, torch.Tensor]] = self._eager_step
        self.compile_error: str | None = None
        self.compile_mode = compile
        self.layers_per_graph = int(layers_per_graph or LAYERS_PER_GRAPH)
        self._groups = layer_groups(self.spec.n_layers, self.layers_per_graph)  # (first layer, count) per graph call
        self._graphs: dict[int, Callable[..., Any]] = {}  # layers in the group -> its compiled graph
        if compile == "graphs":
            spec = self.spec
            # No guards: these graphs are only called from _graph_step with the shapes they were traced with (the
            # attended length symbolic), and checking a graph's guards costs ~1 µs per input tensor per call
            opts: dict[str, str | int | bool | Callable[..., Any]] = {"guard_filter_fn": _no_guards, **GRAPH_OPTIONS}
            for _, count in self._groups:
                if count not in self._graphs:  # every group of this size shares one graph (weights are inputs)
                    fn = own_code(lambda h, pos, ct, st, ks, vs, length, norms, ws, fn_: layers_graph(
                        spec, h, pos, ct, st, ks, vs, length, norms, ws, fn_), f"cpu_layers_x{count}_{id(self):x}")
                    self._graphs[count] = torch.compile(fn, fullgraph=True, dynamic=False, options=opts)
            head = own_code(lambda last, w, seen, penalty, bias: select_scores(
                head_logits(spec, last, w), seen, penalty, bias), f"cpu_head_{id(self):x}")
            self._head_c = torch.compile(head, fullgraph=True, dynamic=False, options=opts)
            self._step = self._graph_step
        elif compile != "off":
            raise GenerationError(f"Unknown CPU compile mode {compile!r}; choose graphs or off.")
        self.compile_s: float | None = None
        self.warmup_s: float | None = None

    # --- pieces ---------------------------------------------------------------------------------------------
    def _cos_sin(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probe = torch.empty(1, 1, 1, dtype=self.dtype)
        cos, sin = self._rotary(probe, pos[None])
        return cos[0], sin[0]

    def _graph_step(self, ids: torch.Tensor, pos: torch.Tensor, n: int, sel: Selection
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        h = self._embed(ids)
        norms, w = self._norms, self._w
        length = self._lengths[:n]
        torch._dynamo.maybe_mark_dynamic(length, 0)
        last = h
        for first, count in self._groups:
            end = first + count
            h, last = self._graphs[count](h, pos, self._cos, self._sin, self._k[first:end], self._v[first:end], length,
                                          norms[2 * first:2 * end], w[first:end], norms[-1])
        return self._head_c(last, self._head, sel.seen, sel.penalty, sel.bias)

    def _eager_step(self, ids: torch.Tensor, pos: torch.Tensor, n: int, sel: Selection
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self._cos[pos], self._sin[pos]
        logits = forward_tokens(self.spec, ids, pos, n - 1, cos, sin, self._k, self._v, self._norms, self._w,
                                self._head, self._embed)
        return select_scores(logits, sel.seen, sel.penalty, sel.bias)

    def _allocate(self, tokens: int) -> None:
        """torch.empty: pages are touched (and count in RSS) only as rows are written; no row is read unwritten.
        One tensor per layer: a graph that writes into a view of a larger tensor copies more than the row."""
        s = self.spec
        self._forget()
        self._k, self._v = [], []
        rows = -(-tokens // ATTENTION_BLOCK) * ATTENTION_BLOCK if s.cache_dtype_attention else tokens
        for _ in range(s.n_layers):
            self._k.append(torch.empty(s.n_kv_heads, rows, s.head_dim, dtype=self.cache_dtype))
            self._v.append(torch.empty(s.n_kv_heads, rows, s.head_dim, dtype=self.cache_dtype))
        self._clean_to = 0
        self._lengths = torch.empty(tokens, dtype=torch.int8)
        self._cos, self._sin = self._cos_sin(torch.arange(tokens))  # (tokens, D) each: RoPE, read by the graphs

    @property
    def groups(self) -> list[tuple[int, int]]:
        """(first layer, count) of each layer group: one compiled graph call each in a decode step."""
        return list(self._groups)

    @property
    def rows_used(self) -> int:
        """Cache rows the last reply wrote (prompt + new tokens fed back)."""
        return self._rows_used

    @property
    def cache(self) -> Any:
        """The rows the last reply wrote, in the layout metrics.cache_bytes reads (the rest is never touched)."""
        from .generate import KVCacheView, _KVLayer

        if not self._k:
            return None
        n = self._rows_used
        return KVCacheView([_KVLayer(k[:, :n], v[:, :n]) for k, v in zip(self._k, self._v, strict=True)])

    @property
    def cache_bytes(self) -> int:
        """The static cache as allocated (its pages count in RSS only once written)."""
        return int(self._k[0].shape[1]) * self.kv_bytes_per_token() if self._k else 0

    def kv_bytes_per_token(self) -> int:
        s = self.spec
        return 2 * s.n_layers * s.n_kv_heads * s.head_dim * torch.empty((), dtype=self.cache_dtype).element_size()

    def _decode(self, token: int, position: int, sel: Selection) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed `token` at `position`: (scores (1, V) fp32 after sel's penalty and bias, their argmax (1,))."""
        n = position + 1
        self._clean(n)
        ids = torch.tensor([token])
        pos = torch.tensor([position])
        try:
            return self._step(ids, pos, n, sel)
        except Exception as exc:  # noqa: BLE001 - no C++ compiler, an inductor bug: the eager step is the same math
            if self._step == self._eager_step:
                raise
            log.warning("CPU decode step not compiled (%s: %s); running it eagerly", type(exc).__name__, exc)
            self.compile_error = f"{type(exc).__name__}: {str(exc)[:200]}"
            self._step = self._eager_step
            return self._step(ids, pos, n, sel)

    def _clean(self, n: int) -> None:
        """Before attention reads rows 0..n-1 to the end of their block (attention_blocks): zero the rows of that span
        not written since the cache was allocated (torch.empty), so that the masked ones are finite."""
        if not self.spec.cache_dtype_attention:
            return
        end = min(-(-n // ATTENTION_BLOCK) * ATTENTION_BLOCK, int(self._k[0].shape[1]))
        if end > self._clean_to:
            for t in (*self._k, *self._v):
                t[:, self._clean_to:end].zero_()
            self._clean_to = end

    def _forget(self) -> None:
        """The static cache is written outside a reply (or re-allocated): nothing in it may be reused."""
        if self.prefix_cache is not None:
            self.prefix_cache.invalidate()

    def _prefill(self, ids: torch.Tensor, chunk: int | None = None, first: int = 0) -> torch.Tensor:
        """Eager over the prompt from position `first` (rows 0..first-1 already hold its KV), in chunks of `chunk`
        tokens; the last position's logits (1, V) fp32."""
        total = ids.numel()
        self._clean(total)
        chunk = chunk or total - first
        logits = None
        for start in range(first, total, chunk):
            part = ids[start:start + chunk]
            pos = torch.arange(start, start + part.numel())
            cos, sin = self._cos[pos], self._sin[pos]
            logits = forward_tokens(self.spec, part, pos, start, cos, sin, self._k, self._v, self._norms, self._w,
                                    self._head, self._embed)
        assert logits is not None
        return logits

    # --- warm-up and generation -------------------------------------------------------------------------------
    def warmup(self) -> float:
        """Allocate the cache and compile the step (its attended length dynamic from the second call on)."""
        t0 = time.perf_counter()
        with self._lock, torch.inference_mode(False), torch.no_grad():
            self._allocate(self.max_cache_len)  # forgets any cached prefix
            self._prefill(torch.arange(4))
            t1 = time.perf_counter()
            sel = Selection.neutral(self.weights.head.n)
            for p in (4, 5, 6):
                self._decode(1, p, sel)
            self.compile_s = round(time.perf_counter() - t1, 3) if self.compile_mode != "off" else None
        self.warmup_s = round(time.perf_counter() - t0, 3)
        return self.warmup_s

    def forced_scores(self, input_ids: torch.Tensor, forced: Sequence[int]) -> torch.Tensor:
        """Teacher forcing: fp32 logits (1 + len(forced), V) at the last prompt position and after feeding each forced
        token through the decode step (no penalty). For the agreement tests and benchmarks."""
        ids = input_ids[0]
        with self._lock, torch.inference_mode(False), torch.no_grad():
            self._forget()
            if not self._k:
                self._allocate(self.max_cache_len)
            rows = [self._prefill(ids.to(torch.long))]
            sel = Selection.neutral(self.weights.head.n)
            for j, token in enumerate(forced):
                rows.append(self._decode(int(token), ids.numel() + j, sel)[0])
            return torch.cat(rows, 0)

    # --- one reply, in pieces (the CPU runner, llm_core.engine.cpu_runner, calls them between its loop's turns) ----
    def check_reply(self, prompt_tokens: int, max_new_tokens: int) -> None:
        """GenerationError for a reply this decoder could never hold (checked before it waits for its turn)."""
        if prompt_tokens == 0:
            raise GenerationError("The prompt is empty.")
        if max_new_tokens < 1:
            raise GenerationError("max_new_tokens must be at least 1.")
        if prompt_tokens + max_new_tokens > self.max_cache_len:
            raise GenerationError(f"The prompt ({prompt_tokens:,} tokens) plus max new tokens ({max_new_tokens:,}) "
                                  f"exceed the CPU path's KV cache ({self.max_cache_len:,} tokens); shorten the "
                                  "history.")

    def start(self, prompt: Sequence[int], params: Any, max_new_tokens: int, *, min_new_tokens: int = 0,
              eos_ids: Iterable[int] = ()) -> CPUReply:
        """Take the decoder for one reply (its lock, held until finish or fail): the penalty's seen ids, the EOS ban
        until min_new_tokens, the sampler (`params`: GenerationSettings or SamplingOptions), and the prompt tokens
        whose KV the prefix cache holds (not prefilled again). This and the pieces after it run with autograd off
        outside inference mode, as the warm-up did (the runner's loop_mode, or generate)."""
        self.check_reply(len(prompt), int(max_new_tokens))
        prompt_ids = [int(i) for i in prompt]
        self._lock.acquire()
        try:
            if not self._k:
                self._allocate(self.max_cache_len)
            vocab, eos = self.weights.head.n, frozenset(int(i) for i in eos_ids)
            ids = torch.tensor(prompt_ids, dtype=torch.long)
            sel = Selection(torch.zeros(1, vocab, dtype=torch.bool), torch.tensor([float(params.repetition_penalty)]),
                            torch.zeros(1, vocab))
            sel.seen[0, ids] = True  # prompt + new ids: what the penalty reads
            no_ban, ban = sel.bias, torch.zeros(1, vocab)
            ban[0, sorted(i for i in eos if 0 <= i < vocab)] = float("-inf")
            if min_new_tokens > 0 and eos:
                sel.bias = ban
            first = self.prefix_cache.begin(prompt_ids) if self.prefix_cache is not None else 0
        except BaseException:
            self._lock.release()
            raise
        reply = CPUReply(ids, int(max_new_tokens), int(min_new_tokens), eos, params, sel, no_ban,
                         logits_processors(params, penalty=False),  # the penalty is applied with the head
                         sampling_generator(params), cached_tokens=first, prefilled=first)
        self._rows_used = reply.rows_used = ids.numel()
        return reply

    def prefill_chunk(self, reply: CPUReply, chunk: int | None) -> int | None:
        """Prefill the reply's next `chunk` prompt tokens (None: all that are left); once the whole prompt is in, its
        first new token (picked as step() picks), else None."""
        total = reply.ids.numel()
        end = min(total, reply.prefilled + chunk) if chunk else total
        logits = self._prefill(reply.ids[:end], None, reply.prefilled)
        reply.prefilled = end
        if end < total:
            return None
        return self._pick(reply, *select_scores(logits, reply.sel.seen, reply.sel.penalty, reply.sel.bias))

    def step(self, reply: CPUReply) -> int:
        """Feed the reply's last new token (its KV written at the next row) and pick the one after it."""
        if len(reply.out) >= reply.min_new_tokens:
            reply.sel.bias = reply.no_ban
        self._rows_used = reply.rows_used = reply.ids.numel() + len(reply.out)
        return self._pick(reply, *self._decode(reply.out[-1], reply.rows_used - 1, reply.sel))

    def _pick(self, reply: CPUReply, scores: torch.Tensor, best: torch.Tensor) -> int:
        """The next token from the head's (penalized, EOS-banned) scores: greedy reads the head's argmax; sampling or
        an output control go through llm_core.sampling."""
        params = reply.params
        control = getattr(params, "control", None)
        token = int(next_token(scores, params.do_sample, reply.warpers, None, reply.generator, control)
                    if params.do_sample or control is not None else best)
        reply.sel.seen[0, token] = True
        reply.out.append(token)
        return token

    def finish(self, reply: CPUReply) -> None:
        """The reply ended cleanly (EOS, length, Stop after a token): the prefix cache learns what the static cache
        holds (the prompt and every new id but the last, never fed back); the decoder is free again."""
        try:
            if self.prefix_cache is not None:
                self.prefix_cache.commit(reply.ids[:reply.prefilled].tolist() + reply.out[:-1])
        finally:
            self._lock.release()

    def fail(self, reply: CPUReply) -> None:
        """The reply ended half-way (an error, a Stop inside the prefill): nothing of the cache is reused."""
        try:
            self._forget()
        finally:
            self._lock.release()

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, gen: GenerationSettings,
                 streamer: Any, stop_event: threading.Event, max_new_tokens: int, *,
                 min_new_tokens: int = 0, eos_ids: Sequence[int] = (), prefill_chunk: int | None = None,
                 info: dict[str, Any] | None = None) -> list[int]:
        """The pieces above in one loop on the calling thread, for tests and probes (the engine serves replies
        through the CPU runner): streamer.put(prompt), then every new token as it is made, then streamer.end() (also
        on stop or error). Returns the new token ids; `info` (if given) gets cached_prompt_tokens."""
        try:
            if input_ids.dim() != 2 or input_ids.shape[0] != 1:
                raise GenerationError(f"The CPU decode path takes one prompt (batch 1), got {tuple(input_ids.shape)}.")
            ids = input_ids[0] if attention_mask is None else input_ids[0][attention_mask[0].bool()]
            with torch.inference_mode(False), torch.no_grad():
                reply = self.start(ids.tolist(), gen, int(max_new_tokens), min_new_tokens=int(min_new_tokens),
                                   eos_ids=eos_ids)
                try:
                    if info is not None:
                        info["cached_prompt_tokens"] = reply.cached_tokens
                    if streamer is not None:
                        streamer.put(input_ids.cpu())
                    token = None
                    while token is None:
                        token = self.prefill_chunk(reply, prefill_chunk)
                    while True:
                        if streamer is not None:
                            streamer.put(torch.tensor([token]))
                        if reply.ended(token) or stop_event.is_set():
                            self.finish(reply)
                            return reply.out
                        token = self.step(reply)
                except BaseException:  # a half-written cache: nothing of it is reused
                    self.fail(reply)
                    raise
        finally:
            if streamer is not None:
                streamer.end()


@dataclass
class CPUReply:
    """One reply's state between CPUDecoder's pieces: start -> prefill_chunk ... -> step ... -> finish | fail."""

    ids: torch.Tensor  # (P,) long: the prompt
    max_new_tokens: int
    min_new_tokens: int  # EOS is banned (sel.bias) until this many new tokens are out
    eos: frozenset[int]
    params: Any  # the sampling options: do_sample, temperature, top_k, top_p, repetition_penalty, seed, control
    sel: Selection
    no_ban: torch.Tensor  # sel.bias once min_new_tokens are out
    warpers: Any  # transformers LogitsProcessorList: temperature, top-k, top-p (the penalty is the head's)
    generator: torch.Generator | None
    cached_tokens: int = 0  # prompt tokens whose KV the prefix cache held: not prefilled
    prefilled: int = 0  # prompt tokens whose KV is in the cache
    rows_used: int = 0  # cache rows holding this reply's KV (prompt + new tokens fed back)
    out: list[int] = field(default_factory=list)  # the new tokens

    def ended(self, token: int) -> bool:
        """Whether `token`, the last of `out`, ends the reply: EOS or max_new_tokens."""
        return token in self.eos or len(self.out) >= self.max_new_tokens
