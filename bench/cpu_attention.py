"""The CPU path's attention over its static KV cache, alone (SmolLM2-135M's shape: 3 KV heads, 9 query heads, head
dim 64; 30 layers, each its own cache): what chose the cache layout and the attention dtype of llm_core.fast.cpu.

- prefill: one 512-token chunk over n cached tokens (SDPA with the chunk's causal mask), per layer: through fp32
  copies of the cache (the path before 2026-12-05, and where the CPU has no native bf16), or reading the bf16 cache
  as stored (bf16 queries), token-major (L, Hkv, D) and head-major (Hkv, L, D) rows.
- decode: one token through 30 layers compiled as one inductor graph (the attended length symbolic, as in the
  decode graphs), each layer's output the next layer's query so none is skipped: inductor's fused fp32 reduction
  over token-major rows (before), the same over head-major rows, and SDPA over the head-major bf16 cache as stored.

    python -m bench.cpu_attention --out bench/results/<date>-cpu-attention.json

Medians of --repeats timed calls after 3 warm ones; max |difference| against the fp32 form of the same layout."""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from bench.harness import Recorder
from bench.multiturn import machine

HKV, GROUPS, D, LAYERS = 3, 3, 64, 30
HEADS = HKV * GROUPS
SCALE = D ** -0.5


def timed(fn: Callable[[], torch.Tensor], repeats: int) -> float:
    with torch.no_grad():
        for _ in range(3):
            fn()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def prefill(n: int, chunk: int, repeats: int, rec: Recorder) -> None:
    start = n - chunk
    q = torch.randn(1, HEADS, chunk, D)
    token_major = torch.randn(n, HKV, D).bfloat16(), torch.randn(n, HKV, D).bfloat16()
    head_major = tuple(t.transpose(0, 1).contiguous() for t in token_major)
    mask = torch.arange(n)[None, :] <= torch.arange(start, n)[:, None]

    def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=SCALE, enable_gqa=True).float()

    forms = {
        "fp32 copies, token-major": lambda: sdpa(q, *(t.transpose(0, 1)[None].float() for t in token_major)),
        "as stored, token-major": lambda: sdpa(q.bfloat16(), *(t.transpose(0, 1)[None] for t in token_major)),
        "as stored, head-major": lambda: sdpa(q.bfloat16(), *(t[None] for t in head_major)),
    }
    ref = forms["fp32 copies, token-major"]()
    for name, fn in forms.items():
        rec.add("prefill", form=name, cached_tokens=n, chunk=chunk, ms_per_layer=round(timed(fn, repeats) * 1e3, 3),
                max_abs_diff=float((fn() - ref).abs().max()))


def fused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n: int, head_major: bool) -> torch.Tensor:
    qg = q.view(HKV, GROUPS, 1, D).float()
    kt = (k[:, None, :n] if head_major else k[:n].transpose(0, 1)[:, None]).float()
    vt = (v[:, None, :n] if head_major else v[:n].transpose(0, 1)[:, None]).float()
    p = torch.softmax((qg * kt).sum(-1) * SCALE, dim=-1)
    return (p[..., None] * vt).sum(-2).reshape(1, HEADS * D)


def sdpa_stored(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n: int, head_major: bool) -> torch.Tensor:
    qh = q.view(1, HEADS, 1, D).to(k.dtype)
    return F.scaled_dot_product_attention(qh, k[None, :, :n], v[None, :, :n], scale=SCALE,
                                          enable_gqa=True).reshape(1, HEADS * D).float()


def decode(ns: list[int], repeats: int, rec: Recorder, max_len: int) -> None:
    lengths = torch.empty(max_len, dtype=torch.int8)
    forms: dict[str, tuple[Callable[..., torch.Tensor], bool]] = {
        "fused fp32, token-major": (fused, False),
        "fused fp32, head-major": (fused, True),
        "sdpa as stored, head-major": (sdpa_stored, True),
    }
    token_major = [(torch.randn(max_len, HKV, D).bfloat16(), torch.randn(max_len, HKV, D).bfloat16())
                   for _ in range(LAYERS)]
    head_major = [tuple(t.transpose(0, 1).contiguous() for t in kv) for kv in token_major]
    for name, (form, hm) in forms.items():
        caches = head_major if hm else token_major

        def layers(q: torch.Tensor, caches: Any, length: torch.Tensor, form: Any = form, hm: bool = hm
                   ) -> torch.Tensor:
            for k, v in caches:
                q = form(q, k, v, length.shape[0], hm)
            return q

        graph = torch.compile(layers, fullgraph=True, dynamic=False)
        for n in ns:
            length = lengths[:n]
            torch._dynamo.maybe_mark_dynamic(length, 0)
            q = torch.randn(1, HEADS * D)
            with torch.no_grad():
                ref = layers(q, head_major, length, fused, True)
                diff = float((graph(q, caches, length) - ref).abs().max())
            seconds = timed(lambda g=graph, q=q, c=caches, m=length: g(q, c, m), repeats)
            rec.add("decode", form=name, cached_tokens=n, us_per_layer=round(seconds / LAYERS * 1e6, 1),
                    max_abs_diff=diff)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tokens", default="600,1024,3000,6000", help="cached tokens, comma-separated")
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args(argv)
    ns = [int(t) for t in args.tokens.split(",")]
    rec = Recorder(args.out, {"command": "python -m bench.cpu_attention " + " ".join(argv or sys.argv[1:]),
                              "machine": machine(), "threads": torch.get_num_threads(),
                              "avx512_bf16": bool(getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)()),
                              "amx": bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())})
    for n in ns:
        if n > args.chunk:
            prefill(n, args.chunk, max(3, args.repeats // 3), rec)
    decode(ns, args.repeats, rec, max(ns))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
