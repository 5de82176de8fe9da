"""The hand-written llama-family layer in decode (one token) and prefill (the prompt) form, and the head."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from . import prefill_gemm as _prefill_gemm  # noqa: F401 - registers torch.ops.llm_core.nf4_prefill
from .kernels import prefix_attention as _prefix_attention  # noqa: F401 - registers ...prefix_attention_paged
from .kernels.nf4_gemv import planar_pairs
from .kvquant import from_cache, is_quantized, to_cache
from .pack import LinSpec, absmax_2d, bias_of, code_of
from .tables import embed_rows

# K/V heads a later prefill chunk reads back from the cache at a time (layer_prefill): a fixed count, so the loop is
# the same for every chunk length (compiled with a dynamic length, it must not depend on it).
PREFIX_HEADS = 8

# PREFIX_ATTENTION=split (prefix_attention_over_cache): the unmasked part of a later chunk's attention covers the
# cached prefix rounded down to a multiple of this many keys, and its queries are padded to a multiple of
# PREFIX_SPLIT_QUERIES, so PyTorch's cuDNN attention (which builds a plan per new shape: 37-41 ms on an H100) sees
# few shapes: one per bucket and query size for every layer, chat and turn. The rest of the prefix goes with the
# chunk's own keys. A chunk whose prefix is under one bucket takes the gather form (no cuDNN call, no new plan).
PREFIX_SPLIT_BUCKET = 4096
PREFIX_SPLIT_QUERIES = 256


def nf4_matvec_torch(x: torch.Tensor, packed: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ W.T for one row x (1, K) and NF4 weights W (N, K), in torch ops that inductor fuses into a single
    reduction kernel: packed (N, K/2) uint8 (high nibble first), absmax (N, K/blocksize) fp32, code (16,) fp32."""
    n, k2 = packed.shape
    nblk = absmax.shape[1]
    per = k2 // nblk  # bytes per block
    p = packed.view(n, nblk, per)
    xf = x.float().view(nblk, per, 2)
    hi = code[(p >> 4).to(torch.int32)]
    lo = code[(p & 15).to(torch.int32)]
    y = ((hi * xf[:, :, 0] + lo * xf[:, :, 1]) * absmax[:, :, None]).sum(dim=(1, 2))
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).view(1, n)


def linear_decode(spec: LinSpec, x: torch.Tensor, ts: Sequence[torch.Tensor]) -> torch.Tensor:
    """x (1, K) -> (1, N) in the decode step."""
    if spec.fmt == "int8" or spec.gemv == "dense-triton":
        return dense_gemv_linear(spec, x, ts)
    if spec.fmt == "dense":
        return F.linear(x, ts[0], bias_of(spec, ts))
    if spec.gemv == "bnb":
        packed = ts[0].view(-1, 1)
        if spec.absmax == "fp32":
            return torch.ops.bitsandbytes.gemm_4bit(x, packed, [spec.n, spec.k], ts[1].view(-1), spec.blocksize,
                                                    "nf4", bias_of(spec, ts))
        if not spec.uniform_offset:
            return torch.ops.bitsandbytes.gemm_4bit(x, packed, [spec.n, spec.k], absmax_2d(spec, ts).view(-1),
                                                    spec.blocksize, "nf4", bias_of(spec, ts))
        return torch.ops.bitsandbytes.gemm_4bit(x, packed, [spec.n, spec.k], ts[2], spec.blocksize, "nf4",
                                                bias_of(spec, ts), ts[1], ts[4], ts[5])
    if spec.gemv == "nf4":  # llm_core.nf4_gemv: NF4 table in registers, nested absmax read in place
        if spec.planar:  # in planes (inductor folds this permutation into the kernel that made x)
            x = planar_pairs(x)
        if spec.absmax == "fp32":
            return torch.ops.llm_core.nf4_gemv(x, ts[0], ts[1], ts[1], ts[1], ts[1], ts[1], bias_of(spec, ts),
                                               spec.blocksize, False, list(spec.levels), spec.pdl, spec.early,
                                               spec.planar)
        return torch.ops.llm_core.nf4_gemv(x, ts[0], ts[1], ts[1], ts[2], ts[3], ts[4], bias_of(spec, ts),
                                           spec.blocksize, True, list(spec.levels), spec.pdl, spec.early,
                                           spec.planar)
    return nf4_matvec_torch(x, ts[0], absmax_2d(spec, ts), code_of(spec, ts), bias_of(spec, ts))


def linear_prefill(spec: LinSpec, x: torch.Tensor, ts: Sequence[torch.Tensor], gemm: bool = True) -> torch.Tensor:
    """x (..., K) -> (..., N) for many rows: dequantize once, then a dense matmul (what bitsandbytes does for 4-bit
    weights; for int8 it quantizes the activations instead, LLM.int8, which the fast path does not); NF4 with
    spec.prefill_gemm_max (and `gemm`): nf4_gemm up to that many rows (llm_core.fast.prefill_gemm). `gemm` False:
    always dequantize + matmul (the batched decode step's rows, whose own pick times that form)."""
    if spec.fmt == "dense":
        return F.linear(x, ts[0], bias_of(spec, ts))
    if spec.fmt == "int8":  # compiled: one kernel writes the scaled half-precision copy
        return F.linear(x, (ts[0].float() * ts[1][:, None]).to(x.dtype), bias_of(spec, ts))
    absmax = absmax_2d(spec, ts).reshape(-1)
    if spec.prefill_gemm_max and gemm:
        return _nf4_prefill(spec, x, ts[0], absmax, code_of(spec, ts), bias_of(spec, ts), spec.n)
    w = torch.ops.bitsandbytes.dequantize_4bit(ts[0].view(-1, 1), absmax, spec.blocksize, "nf4",
                                               [spec.n, spec.k], x.dtype)
    return F.linear(x, w, bias_of(spec, ts))


def linear_prefill_parts(spec: LinSpec, x: torch.Tensor, ts: Sequence[torch.Tensor], gemm: bool = True
                         ) -> list[torch.Tensor]:
    """linear_prefill of a fused linear, one output per fused part (q/k/v, gate/up), each part's rows dequantized
    on their own: the half-precision weight a prompt's matmul makes is the largest part's, not the fused weight
    (on Llama-3-8B the fused gate/up copy is 235 MB, held at the prefill's peak and again in the prefill graphs'
    pool; a part is 117 MB). The rows of a fused weight are its parts' rows concatenated (pack_linears), so
    each part's packed bytes, block scales, int8 row scales and bias are row slices of the fused ones."""
    splits = list(spec.splits)
    if spec.fmt == "dense" or len(splits) == 1:
        return list(linear_prefill(spec, x, ts, gemm).split(splits, dim=-1))
    bias = bias_of(spec, ts)
    absmax = absmax_2d(spec, ts) if spec.fmt == "nf4" else None
    outs, start = [], 0
    for rows in splits:
        end = start + rows
        if absmax is not None and spec.prefill_gemm_max and gemm:
            outs.append(_nf4_prefill(spec, x, ts[0][start:end], absmax[start:end].reshape(-1), code_of(spec, ts),
                                     bias[start:end] if bias is not None else None, rows))
            start = end
            continue
        if absmax is None:  # int8 rows x their scales
            w = (ts[0][start:end].float() * ts[1][start:end, None]).to(x.dtype)
        else:
            w = torch.ops.bitsandbytes.dequantize_4bit(ts[0][start:end].reshape(-1, 1), absmax[start:end].reshape(-1),
                                                       spec.blocksize, "nf4", [rows, spec.k], x.dtype)
        outs.append(F.linear(x, w, bias[start:end] if bias is not None else None))
        del w
        start = end
    return outs


def _nf4_prefill(spec: LinSpec, x: torch.Tensor, packed: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor,
                 bias: torch.Tensor | None, n: int) -> torch.Tensor:
    """x (..., K) -> (..., n) through torch.ops.llm_core.nf4_prefill (llm_core.fast.prefill_gemm): nf4_gemm for
    chunks of up to spec.prefill_gemm_max rows, dequantize + matmul above."""
    flat = x.reshape(-1, spec.k)
    y = torch.ops.llm_core.nf4_prefill(flat, packed, absmax, code, bias, spec.blocksize, list(spec.levels),
                                       spec.prefill_gemm_max)
    return y.view(*x.shape[:-1], n)


def dense_gemv_linear(spec: LinSpec, x: torch.Tensor, ts: Sequence[torch.Tensor], *,
                      residual: torch.Tensor | None = None,
                      norm: torch.Tensor | None = None, eps: float = 0.0, glu: bool = False) -> torch.Tensor:
    """llm_core.dense_gemv with its prologue (norm or glu) and residual epilogue; x (1, K) -> (1, N). int8 weights
    pass their row scales (the kernel widens the int8 rows in registers and scales each row once)."""
    row_scale = ts[1] if spec.fmt == "int8" else None
    return torch.ops.llm_core.dense_gemv(x, ts[0], bias_of(spec, ts), residual, norm, eps, glu, row_scale)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm, op for op (fp32 statistics, weight applied in the input dtype)."""
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


# --- the layer, in decode (one token) and prefill (the prompt) form ------------------------------------------


@dataclass(frozen=True)
class LayerSpec:
    n_heads: int
    n_kv_heads: int
    head_dim: int
    scale: float
    eps_post: float
    eps_next: float  # of the norm in rest[1]: the next layer's input norm (the final norm after the last layer)
    qk_norm_eps: float | None
    linears: tuple[LinSpec, ...]  # (qkv,) or (q, k, v); o; (gate_up,) or (gate, up); down
    fused: bool
    attention: str  # triton (custom kernel) | reduce (torch, written for inductor) | matmul (torch, eager)
    # A later prefill chunk's attention over the cached prefix as flash attention with its causal mask aligned
    # bottom-right (the chunk's last query sees every key), no mask tensor: set where flash attention runs (CUDA,
    # sm80+, half precision, head_dim a multiple of 8 up to 256; prefix_flash_ok). Else SDPA with an explicit mask,
    # which flash attention refuses: memory-efficient attention reading an (S, T) bias instead.
    prefix_flash: bool = False
    # PREFIX_ATTENTION=split: a later chunk's attention in two parts merged by their log-sum-exp
    # (_split_prefix_attention): its queries over the cached prefix without any mask, by this backend ("cudnn" or
    # "flash"; prefix_split_backend), and over the chunk's own keys with a square causal mask (flash), every K/V head
    # in one call. "" = off.
    prefix_split: str = ""
    # the decode attention kernel launched as a programmatic dependent launch (llm_core.fast.kernels.pdl)
    pdl: bool = False
    # with prefix_split: its bucket of keys (PREFIX_SPLIT_BUCKET; tests set a small one)
    prefix_split_bucket: int = PREFIX_SPLIT_BUCKET


def _split_linears(spec: LayerSpec, w: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Cut the flat weight list of a layer into per-linear lists (the rest: norms, see _layer_weights)."""
    out, i = [], 0
    for lin in spec.linears:
        count = tensor_count(lin)
        out.append(list(w[i:i + count]))
        i += count
    out.append(list(w[i:]))
    return out


def tensor_count(lin: LinSpec) -> int:
    base = {"dense": 1, "int8": 2}.get(lin.fmt) or (4 if lin.absmax == "fp32" else 8)  # nf4: pack.LinSpec's order
    return base + 3 * int(lin.frag) + int(lin.bias)


Linear = Callable[[LinSpec, torch.Tensor, Sequence[torch.Tensor]], torch.Tensor]
FusedParts = Callable[[LinSpec, torch.Tensor, Sequence[torch.Tensor]], Sequence[torch.Tensor]]


def _split_output(linear: Linear) -> FusedParts:
    """A fused linear's parts as views of its one output (one-token steps: the kernels read the weights in place)."""
    def parts(spec: LinSpec, x: torch.Tensor, ts: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
        return linear(spec, x, ts).split(list(spec.splits), dim=-1)
    return parts


def _project_qkv(spec: LayerSpec, x: torch.Tensor, lins: list[list[torch.Tensor]], linear: Linear,
                 parts: FusedParts | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    if spec.fused:
        q, k, v = (parts if parts is not None else _split_output(linear))(spec.linears[0], x, lins[0])
        return q, k, v, 1
    return (linear(spec.linears[0], x, lins[0]), linear(spec.linears[1], x, lins[1]),
            linear(spec.linears[2], x, lins[2]), 3)


def _mlp(spec: LayerSpec, x: torch.Tensor, lins: list[list[torch.Tensor]], first: int, linear: Linear,
         parts: FusedParts | None = None) -> torch.Tensor:
    if spec.fused:
        gate, up = (parts if parts is not None else _split_output(linear))(spec.linears[first], x, lins[first])
        down = first + 1
    else:
        gate = linear(spec.linears[first], x, lins[first])
        up = linear(spec.linears[first + 1], x, lins[first + 1])
        down = first + 2
    return linear(spec.linears[down], F.silu(gate) * up, lins[down])


def decode_attention(spec: LayerSpec, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      pos: torch.Tensor) -> torch.Tensor:
    """One query token over the cache prefix. q (H, D); k/v_cache (L, Hkv, D), rows after pos masked -> (1, H*D).

    Compiled form: broadcast products and reductions in fp32 (no repeat_kv copy, no fp32 copy of the cache) that
    inductor fuses into a few kernels. Eager form (CPU): the same math as two batched matmuls."""
    if spec.attention == "triton":  # reads bf16 or int8 rows (dequantized in registers)
        out = torch.ops.llm_core.decode_attention(q, k_cache, v_cache, pos, spec.scale, spec.pdl)
        return out.reshape(1, spec.n_heads * spec.head_dim)
    if is_quantized(k_cache):  # the torch forms: int8 rows dequantized first (the Triton kernel's reference)
        k_cache, v_cache = from_cache(k_cache, q.dtype), from_cache(v_cache, q.dtype)
    groups = spec.n_heads // spec.n_kv_heads
    length = k_cache.shape[0]
    valid = torch.arange(length, device=q.device) <= pos  # (L,)
    if spec.attention == "reduce":
        qf = q.float().view(1, spec.n_kv_heads, groups, spec.head_dim)
        scores = (qf * k_cache.float()[:, :, None, :]).sum(-1) * spec.scale  # (L, Hkv, G)
        scores = scores.masked_fill(~valid[:, None, None], float("-inf"))
        probs = torch.softmax(scores, dim=0)
        out = (probs[..., None] * v_cache.float()[:, :, None, :]).sum(0)  # (Hkv, G, D)
    else:
        qf = q.float().view(spec.n_kv_heads, groups, spec.head_dim)
        scores = torch.matmul(qf, k_cache.float().permute(1, 2, 0)) * spec.scale  # (Hkv, G, L)
        probs = torch.softmax(scores.masked_fill(~valid, float("-inf")), dim=-1)
        out = torch.matmul(probs, v_cache.float().transpose(0, 1))  # (Hkv, G, D)
    return out.reshape(1, spec.n_heads * spec.head_dim).to(q.dtype)


def layer_decode(spec: LayerSpec, h: torch.Tensor, hn: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  pos: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, w: Sequence[torch.Tensor]
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """One decoder layer for one token. h: residual (1, H); hn: h after this layer's input norm; cos/sin (1, D);
    pos (1,) int64 position of the token; k/v_cache (L, Hkv, D) prefix of this layer's cache (written at pos).
    Returns (h, next layer's normed input) so the next input norm fuses with this layer's last residual add."""
    lins = _split_linears(spec, w)
    rest = lins[-1]  # [post_attention_layernorm.weight, next layer's input norm weight, (q/k_norm)]
    q, k, v, used = _project_qkv(spec, hn, lins, linear_decode)
    q = q.view(spec.n_heads, spec.head_dim)
    k = k.view(spec.n_kv_heads, spec.head_dim)
    v = v.view(spec.n_kv_heads, spec.head_dim)
    if spec.qk_norm_eps is not None:
        q, k = rms_norm(q, rest[2], spec.qk_norm_eps), rms_norm(k, rest[3], spec.qk_norm_eps)
    q = q * cos + rotate_half(q) * sin
    k = k * cos + rotate_half(k) * sin
    k_cache.index_copy_(0, pos, to_cache(k[None], k_cache))
    v_cache.index_copy_(0, pos, to_cache(v[None], v_cache))
    attn = decode_attention(spec, q, k_cache, v_cache, pos)
    h = h + linear_decode(spec.linears[used], attn, lins[used])
    h = h + _mlp(spec, rms_norm(h, rest[0], spec.eps_post), lins, used + 1, linear_decode)
    return h, rms_norm(h, rest[1], spec.eps_next)


def layer_prefill(spec: LayerSpec, h: torch.Tensor, hn: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   start: int, k_cache: torch.Tensor, v_cache: torch.Tensor, w: Sequence[torch.Tensor]
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The same layer over a chunk of S prompt tokens at positions start..start+S-1. h, hn (1, S, H);
    cos/sin (1, S, D); k/v_cache (L, Hkv, D) full cache of this layer."""
    lins = _split_linears(spec, w)
    seq = h.shape[1]
    q, k, v, used = _prefill_qkv(spec, hn, cos, sin, lins)
    k_cache[start:start + seq].copy_(to_cache(k[0].transpose(0, 1), k_cache))
    v_cache[start:start + seq].copy_(to_cache(v[0].transpose(0, 1), v_cache))
    if start == 0:
        return _prefill_out(spec, h, _prefill_attention(spec, q, k, v, None), lins, used)
    return _prefill_out(spec, h, prefix_attention_over_cache(spec, q, k_cache, v_cache, start), lins, used)


def prefix_attention_over_cache(spec: LayerSpec, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                start: int) -> torch.Tensor:
    """A later chunk's attention (layer_prefill): q (1, H, S, D) at positions start..start+S-1 over k/v_cache
    (L, Hkv, row) rows 0..start+S-1 (the chunk's own written) -> (1, S, H * D). The chunk attends to everything
    cached so far (bottom-right aligned causal mask), PREFIX_HEADS K/V heads at a time: the cached prefix is read back
    as a bf16 temporary (dequantized, or made contiguous), and for a model with 32 K/V heads (Llama-2-7B) at 9.5k
    tokens that is 156 MB at once, part of the peak the start-up measures and the KV cache pays for; a quarter of it
    per group. Softmax is per head: the same values."""
    end = start + q.shape[2]
    base = start // spec.prefix_split_bucket * spec.prefix_split_bucket
    if spec.prefix_split and base > 0:  # under one bucket: the gather form below
        pre = [from_cache(c[:base], q.dtype).transpose(0, 1)[None] for c in (k_cache, v_cache)]
        rest = [from_cache(c[base:end], q.dtype).transpose(0, 1)[None] for c in (k_cache, v_cache)]
        return _split_prefix_attention(spec, q, pre[0], pre[1], rest[0], rest[1])
    mask = None if spec.prefix_flash else (
        torch.arange(end, device=q.device)[None, :] <= torch.arange(start, end, device=q.device)[:, None])
    groups = spec.n_heads // spec.n_kv_heads
    parts = []
    for first in range(0, spec.n_kv_heads, PREFIX_HEADS):
        last = min(first + PREFIX_HEADS, spec.n_kv_heads)
        keys = from_cache(k_cache[:end, first:last], q.dtype).transpose(0, 1)[None]
        values = from_cache(v_cache[:end, first:last], q.dtype).transpose(0, 1)[None]
        q_part = q[:, first * groups:last * groups]
        parts.append(_prefix_flash_attention(spec, q_part, keys, values) if spec.prefix_flash
                     else _prefill_attention(spec, q_part, keys, values, mask))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)


def layer_prefill_paged(spec: LayerSpec, h: torch.Tensor, hn: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        start: int, k_pool: torch.Tensor, v_pool: torch.Tensor,
                        dest: tuple[torch.Tensor, torch.Tensor], table: torch.Tensor, w: Sequence[torch.Tensor]
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """layer_prefill for a chunk of one sequence in the paged pool, read in place (PREFIX_ATTENTION=paged): h, hn
    (1, S, H) at positions start..start+S-1; k/v_pool (num_blocks, block_size, Hkv, row) this layer's pool; dest =
    (blocks, offsets) where the chunk's positions live (write_paged_rows); table (max_blocks,) int32 the sequence's
    block table. The chunk's K/V rows go into the pool first, then its queries attend to every position up to their
    own through the table (torch.ops.llm_core.prefix_attention_paged): no gathered or dequantized copy of the prefix.
    bf16/fp32 and int8 rows (int4 rows take layer_prefill over the gathered prefix)."""
    lins = _split_linears(spec, w)
    seq = h.shape[1]
    q, k, v, used = _prefill_qkv(spec, hn, cos, sin, lins)
    write_paged_rows(k_pool, dest, to_cache(k[0].transpose(0, 1), k_pool))
    write_paged_rows(v_pool, dest, to_cache(v[0].transpose(0, 1), v_pool))
    attn = torch.ops.llm_core.prefix_attention_paged(q[0].transpose(0, 1), k_pool, v_pool, table, start, spec.scale)
    return _prefill_out(spec, h, attn.reshape(1, seq, spec.n_heads * spec.head_dim), lins, used)


def write_paged_rows(pool: torch.Tensor, dest: tuple[torch.Tensor, torch.Tensor], rows: torch.Tensor) -> None:
    """pool (num_blocks, block_size, Hkv, row)[blocks, offsets] = rows (B, Hkv, row), in place; dest = (blocks,
    offsets), each (B,) int64: where each row's position lives.
    Indexed on the pool itself, not through a flattened view of it: compiled, a write through a view of a graph input
    that a custom op then reads made Inductor copy the whole pool (twice per K and V, every layer, every step: the
    paged step was ~6x slower than the slots one on the H200; tests/test_paged_kv.py checks the compiled code)."""
    pool.index_put_(dest, rows)


def layer_prefill_rows(spec: LayerSpec, h: torch.Tensor, hn: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor | None,
                       w: Sequence[torch.Tensor],
                       paged: tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, ...]] | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """layer_prefill for B whole prompts at once, each from position 0, right-padded to S: h, hn (B, S, H);
    cos/sin (1, S, D); k/v_cache (slots, L, Hkv, row) this layer's slot cache; slots (B,) the rows' slots, whose
    cache rows 0..S-1 are written (a row's padding K/V beyond its prompt is overwritten by its decode before any
    step reads it; causal attention keeps its real tokens blind to the padding after them).
    paged = (dest, real): k/v_cache are a paged pool (num_blocks, block_size, Hkv, row) instead (slots unused); the
    (row, position) pairs `real` (nonzero's tuple over (B, S)) are written at dest = (blocks, offsets), straight
    from the projections: no padded temporary written, read back and gathered (12 + 7 ms of index kernels for 8
    prompts of 512 tokens on an H100, bench/results/2026-12-05-s4-h100-batched-prefill.json's profile)."""
    lins = _split_linears(spec, w)
    rows, seq = h.shape[0], h.shape[1]
    q, k, v, used = _prefill_qkv(spec, hn, cos, sin, lins)
    if paged is not None:
        dest, real = paged
        write_paged_rows(k_cache, dest, to_cache(k.transpose(1, 2)[real], k_cache))
        write_paged_rows(v_cache, dest, to_cache(v.transpose(1, 2)[real], v_cache))
        return _prefill_out(spec, h, _prefill_attention(spec, q, k, v, None), lins, used)
    assert slots is not None
    index = (slots[:, None].expand(rows, seq).reshape(-1),
             torch.arange(seq, device=h.device)[None, :].expand(rows, seq).reshape(-1))
    k_cache.index_put_(index, to_cache(k.transpose(1, 2).reshape(rows * seq, spec.n_kv_heads, spec.head_dim),
                                       k_cache))
    v_cache.index_put_(index, to_cache(v.transpose(1, 2).reshape(rows * seq, spec.n_kv_heads, spec.head_dim),
                                       v_cache))
    return _prefill_out(spec, h, _prefill_attention(spec, q, k, v, None), lins, used)


def _prefill_qkv(spec: LayerSpec, hn: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 lins: list[list[torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """q, k, v (B, heads, S, D) of hn (B, S, H), normed (qk-norm models) and rotated; and how many linears that
    took (1 fused, 3 apart)."""
    rest = lins[-1]
    rows, seq = hn.shape[0], hn.shape[1]
    q, k, v, used = _project_qkv(spec, hn, lins, linear_prefill, linear_prefill_parts)
    q = q.view(rows, seq, spec.n_heads, spec.head_dim)
    k = k.view(rows, seq, spec.n_kv_heads, spec.head_dim)
    v = v.view(rows, seq, spec.n_kv_heads, spec.head_dim)
    if spec.qk_norm_eps is not None:
        q, k = rms_norm(q, rest[2], spec.qk_norm_eps), rms_norm(k, rest[3], spec.qk_norm_eps)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, heads, S, D)
    c, s = cos[:, None], sin[:, None]
    return q * c + rotate_half(q) * s, k * c + rotate_half(k) * s, v, used


def _prefill_attention(spec: LayerSpec, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                       mask: torch.Tensor | None) -> torch.Tensor:
    """SDPA of q (B, H, S, D) over keys/values (B, Hkv, T, D): causal (mask None, T = S) or with `mask`;
    -> (B, S, H * D). H and Hkv may be a slice of the model's heads (H = Hkv x the model's group size)."""
    rows, heads, seq = q.shape[0], q.shape[1], q.shape[2]
    groups = spec.n_heads // spec.n_kv_heads
    if groups > 1 and q.device.type == "cuda":  # flash attention with grouped K/V: expand (as repeat_kv does)
        keys, values = _expand_kv(spec, heads, keys, values)
        gqa: dict[str, Any] = {}
    else:
        gqa = {"enable_gqa": True} if groups > 1 else {}
    attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=mask is None,
                                          scale=spec.scale, **gqa)
    return attn.transpose(1, 2).reshape(rows, seq, heads * spec.head_dim)


def _expand_kv(spec: LayerSpec, heads: int, keys: torch.Tensor, values: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Grouped K/V (B, Hkv, T, D) -> (B, heads, T, D), each K/V head repeated for its query heads (as repeat_kv)."""
    groups, rows = spec.n_heads // spec.n_kv_heads, keys.shape[0]

    def expand(t: torch.Tensor) -> torch.Tensor:
        return t[:, :, None].expand(-1, -1, groups, -1, -1).reshape(rows, heads, -1, spec.head_dim)

    return expand(keys), expand(values)


def prefix_flash_ok(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether a later prefill chunk may use _prefix_flash_attention on `device` (LayerSpec.prefix_flash)."""
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16) or head_dim % 8 or head_dim > 256:
        return False
    return torch.backends.cuda.is_flash_attention_available() and torch.cuda.get_device_capability(device) >= (8, 0)


def _prefix_flash_attention(spec: LayerSpec, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
                            ) -> torch.Tensor:
    """A later chunk's attention: q (1, H, S, D) at the last S of T positions over keys/values (1, Hkv, T, D), each
    query seeing every key up to its own position -> (1, S, H * D). PyTorch's flash attention op aligns its causal
    mask bottom-right when S < T (torch.nn.attention.bias.causal_lower_right dispatches to it so; that class cannot
    be built inside a compiled function). The same values as _prefill_attention with the explicit mask, without
    the (S, T) bias that memory-efficient attention reads: at 3k new tokens over 27k cached, 162 MB per call."""
    rows, heads, seq = q.shape[0], q.shape[1], q.shape[2]
    if spec.n_heads > spec.n_kv_heads:  # the op takes as many K/V heads as query heads
        keys, values = _expand_kv(spec, heads, keys, values)
    attn = torch.ops.aten._scaled_dot_product_flash_attention(q, keys, values, 0.0, True, False,
                                                              scale=spec.scale)[0]
    return attn.transpose(1, 2).reshape(rows, seq, heads * spec.head_dim)


def attention_lse(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, causal: bool,
                  backend: str = "flash") -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q (1, H, S, D) over keys/values (1, H, T, D) with its log-sum-exp: -> out (1, H, S, D) in q's
    dtype and lse (1, H, S) fp32 (natural log of each query's sum of exp(score)). `causal` aligns the mask top-left
    (use it where S = T). backend: flash (CUDA; the CPU form elsewhere) | cudnn (CUDA: PyTorch's cuDNN attention op)."""
    if backend == "cudnn":
        out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(q, keys, values, None, True, 0.0, causal,
                                                                       False, scale=scale)[:2]
    elif q.device.type == "cuda":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, keys, values, 0.0, causal, False,
                                                                       scale=scale)[:2]
    else:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, keys, values, 0.0, causal,
                                                                               scale=scale)
    return out, lse.reshape(q.shape[:3]).float()


def merge_attention(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
                    ) -> torch.Tensor:
    """Two attentions of the same queries over disjoint key sets (attention_lse) -> the attention over their union:
    each part weighted by its share of the softmax denominator, exp(lse_a) / (exp(lse_a) + exp(lse_b)) =
    sigmoid(lse_a - lse_b) (no overflow). (1, H, S, D) in out_a's dtype; the sum in fp32."""
    share = torch.sigmoid(lse_a - lse_b)[..., None]
    b = out_b.float()
    return (b + (out_a.float() - b) * share).to(out_a.dtype)


def _split_prefix_attention(spec: LayerSpec, q: torch.Tensor, k_pre: torch.Tensor, v_pre: torch.Tensor,
                            k_rest: torch.Tensor, v_rest: torch.Tensor) -> torch.Tensor:
    """A later chunk's attention (LayerSpec.prefix_split): q (1, H, S, D) at the last S of the T = P + R positions
    of k/v_pre (1, Hkv, P, D), the prefix's first P (a multiple of spec.prefix_split_bucket; every query sees all of
    it: no mask, spec.prefix_split's backend, the queries padded to a multiple of PREFIX_SPLIT_QUERIES for cuDNN),
    then k/v_rest (1, Hkv, R, D), the rest of the prefix and the chunk's own rows (causal, aligned bottom-right: the
    chunk's last query sees every key) -> (1, S, H * D). The two parts merge by their log-sum-exp. Every head in one
    call each (grouped K/V heads expanded as repeat_kv does). Why: PyTorch's flash attention over the whole (bottom-
    right causal) runs near 0.34 PFLOP/s on an H100; the unmasked part is free to use a faster kernel
    (docs/prefix_cache.md)."""
    rows, heads, seq = q.shape[0], q.shape[1], q.shape[2]
    if spec.n_heads > spec.n_kv_heads:
        k_pre, v_pre = _expand_kv(spec, heads, k_pre, v_pre)
        k_rest, v_rest = _expand_kv(spec, heads, k_rest, v_rest)
    q_pre = q
    if spec.prefix_split == "cudnn":  # a plan per (queries, keys): few shapes
        q_pre = F.pad(q, (0, 0, 0, -seq % PREFIX_SPLIT_QUERIES))
    out_pre, lse_pre = attention_lse(q_pre, k_pre, v_pre, spec.scale, False, spec.prefix_split)
    out_rest, lse_rest = _bottom_right_attention(q, k_rest, v_rest, spec.scale)
    attn = merge_attention(out_pre[:, :, :seq], lse_pre[:, :, :seq], out_rest, lse_rest)
    return attn.transpose(1, 2).reshape(rows, seq, heads * spec.head_dim)


def _bottom_right_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """q (1, H, S, D) at the last S of keys/values (1, H, R, D), R >= S, causal with the mask aligned bottom-right
    -> (out, lse) as attention_lse. CUDA: PyTorch's flash op aligns its causal mask bottom-right where S < R. CPU
    (whose flash op aligns it top-left): the R - S keys every query sees, merged with the square causal part."""
    seq, total = q.shape[2], keys.shape[2]
    if q.device.type == "cuda" or seq == total:
        return attention_lse(q, keys, values, scale, True)
    out_a, lse_a = attention_lse(q, keys[:, :, :total - seq], values[:, :, :total - seq], scale, False)
    out_b, lse_b = attention_lse(q, keys[:, :, total - seq:], values[:, :, total - seq:], scale, True)
    return merge_attention(out_a, lse_a, out_b, lse_b), torch.logaddexp(lse_a, lse_b)


def prefix_split_backend(device: torch.device, dtype: torch.dtype, head_dim: int) -> str:
    """The prefix part's backend for PREFIX_ATTENTION=split on `device`: "cudnn" where PyTorch's cuDNN attention op
    runs a small probe (CUDA, half precision, cuDNN built in), else "flash"."""
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16) or not torch.backends.cudnn.is_available():
        return "flash"
    try:
        q = torch.randn(1, 64, 2, head_dim, device=device, dtype=dtype).transpose(1, 2)  # the prefill's layouts
        kv = torch.randn(80, 2, head_dim, device=device, dtype=dtype).transpose(0, 1)[None]
        got = attention_lse(q, kv, kv, head_dim ** -0.5, False, "cudnn")[0]
        want = F.scaled_dot_product_attention(q.float(), kv.float(), kv.float())
        if bool(torch.isfinite(got).all()) and float((got.float() - want).abs().max()) < 0.05:
            return "cudnn"
    except Exception:  # noqa: BLE001 - no cuDNN attention here: flash serves the prefix part
        pass
    return "flash"


def _prefill_out(spec: LayerSpec, h: torch.Tensor, attn: torch.Tensor, lins: list[list[torch.Tensor]], used: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The output projection, the MLP and the next layer's input norm after a prefill's attention."""
    rest = lins[-1]
    h = h + linear_prefill(spec.linears[used], attn, lins[used])
    h = h + _mlp(spec, rms_norm(h, rest[0], spec.eps_post), lins, used + 1, linear_prefill, linear_prefill_parts)
    return h, rms_norm(h, rest[1], spec.eps_next)


@dataclass(frozen=True)
class HeadSpec:
    lm: LinSpec
    eps0: float


def embed_prologue(spec: HeadSpec, rotary: Any, tok: torch.Tensor, pos: torch.Tensor, embed: Sequence[torch.Tensor],
              norm0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """tok, pos (1,) -> residual h (1, H), first layer's normed input, cos/sin (1, D) from the model's own RoPE.
    embed: the token table as llm_core.fast.tables.embed_rows takes it (rows come out in the norms' dtype)."""
    h = embed_rows(tok, embed, norm0.dtype)
    cos, sin = rotary(h[None], pos[None])
    return h, rms_norm(h, norm0, spec.eps0), cos[0], sin[0]


def head_logits(spec: HeadSpec, hn: torch.Tensor, lm: Sequence[torch.Tensor], seen: torch.Tensor, penalty: torch.Tensor,
          eos_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Final-normed hidden (1, H) -> scores (1, V) fp32 after repetition penalty and min-new-tokens EOS ban (as
    transformers' processors compute them), and the greedy token (1,)."""
    logits = linear_decode(spec.lm, hn, lm).float()
    penalized = torch.where(logits < 0, logits * penalty, logits / penalty)
    scores = torch.where(seen, penalized, logits) + eos_bias
    return scores, scores.argmax(-1)


def _prefill_attention_scope(choice: str, device: torch.device) -> Any:
    """The SDPA backends the prefill may use (FastDecodeOptions.prefill_attention). Set around tracing and every
    call alike: a compiled prefill keeps the backend chosen when it was traced."""
    if choice == "auto" or device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])
