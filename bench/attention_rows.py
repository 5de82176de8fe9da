"""Decode attention over the KV cache's row formats on the GPU: one query row (and 8) over a long cache, the slots
form and the paged form, bf16 rows, int8 rows padded to head_dim + 4 bytes (the cache's layout) and + 16 (the
layout before 2026-12-05) and int4 rows, timed in CUDA graphs (llm_core.fast.timing: 20 replays of 50 calls each).

    python -m bench.attention_rows --out results.json [--tokens 9000] [--heads 32]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def padded(rows: torch.Tensor, pad: int) -> torch.Tensor:
    """int8 rows (..., D + 4) re-laid with `pad` bytes after the D codes (the exponent first)."""
    d = rows.shape[-1] - 4
    out = torch.zeros((*rows.shape[:-1], d + pad), dtype=rows.dtype, device=rows.device)
    out[..., :d + 1] = rows[..., :d + 1]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tokens", type=int, default=9000)
    ap.add_argument("--heads", type=int, default=32)
    args = ap.parse_args()
    from llm_core.fast import kvquant
    from llm_core.fast.kernels import attention  # noqa: F401 - registers the ops
    from llm_core.fast.timing import time_in_cuda_graph

    dev, d, hkv, page = torch.device("cuda"), 128, args.heads, 16
    t = args.tokens // page * page  # whole blocks: the paged form reads the same rows
    g = torch.Generator(device=dev).manual_seed(0)
    results = []
    for rows_n in (1, 8):
        q = torch.randn(rows_n, 32, d, device=dev, generator=g, dtype=torch.bfloat16)
        pos = torch.full((rows_n,), t - 1, dtype=torch.long, device=dev)
        k = torch.randn(rows_n, t, hkv, d, device=dev, generator=g, dtype=torch.bfloat16)
        v = torch.randn(rows_n, t, hkv, d, device=dev, generator=g, dtype=torch.bfloat16)
        kq, vq = kvquant.quantize_rows(k), kvquant.quantize_rows(v)
        k4, v4 = kvquant.quantize_rows4(k), kvquant.quantize_rows4(v)
        blocks = t // page
        for fmt, kk, vv in (("bf16", k, v), ("int8+4", kq, vq), ("int8+16", padded(kq, 16), padded(vq, 16)),
                            ("int4", k4, v4)):
            us = time_in_cuda_graph(lambda q=q, kk=kk, vv=vv, pos=pos: torch.ops.llm_core.decode_attention_rows(
                q, kk, vv, pos, d ** -0.5), reps=50)
            pool_k = kk.reshape(rows_n * blocks, page, hkv, kk.shape[-1])
            pool_v = vv.reshape(rows_n * blocks, page, hkv, vv.shape[-1])
            table = torch.arange(rows_n * blocks, dtype=torch.int32, device=dev).view(rows_n, blocks)
            table = table[:, torch.randperm(blocks, device=dev)].contiguous()  # the same rows, shuffled blocks
            us_paged = time_in_cuda_graph(lambda q=q, a=pool_k, b=pool_v, tb=table, pos=pos:
                             torch.ops.llm_core.decode_attention_paged(q, a, b, tb, pos, d ** -0.5), reps=50)
            nbytes = 2 * rows_n * t * hkv * kk.shape[-1] * kk.element_size()
            rec = {"rows": rows_n, "tokens": t, "kv_heads": hkv, "format": fmt, "row_bytes": kk.shape[-1] *
                   kk.element_size(), "slots_us": round(us, 1), "paged_us": round(us_paged, 1),
                   "slots_gbps": round(nbytes / us / 1e3, 1), "paged_gbps": round(nbytes / us_paged / 1e3, 1)}
            print(json.dumps(rec), flush=True)
            results.append(rec)
    args.out.write_text(json.dumps({"bench": "attention_rows", "device": torch.cuda.get_device_name(),
                                    "torch": torch.__version__, "records": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
