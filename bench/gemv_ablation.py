"""Where the time of a Triton NF4 matvec goes when its 16-entry table is read from L1 (the first design of
llm_core.nf4_gemv, kept here as the ablation's subject): the same kernel with one stage left out at a time
(time variants that leave one stage out, take differences). Not product code; results in
bench/results/2026-11-30-h200-gemv.json and docs/fast_decode.md. It showed the table gathers, not HBM, bound it
(ncu: L1 pipe ~90% busy, DRAM 11%), which led to the register table of llm_core.nf4_gemv.

    python -m bench.gemv_ablation --out ablation.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

from bench.gemv_bench import SHAPES, Weights, time_calls

# ABLATE: 0 full | 1 no table (q converted to float) | 2 no x loads (x = 1) | 3 no block scale | 4 loads only
# (sum of the words) | 5 full, x loaded once per iteration as an (8, BKW) tile (no per-nibble loads)


@triton.jit
def _ablate_kernel(x_ptr, w_ptr, q8_ptr, absmax2_ptr, offsets_ptr, code_ptr, code2_ptr, y_ptr, N,
                   KW: tl.constexpr, WPB: tl.constexpr, ABLATE: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_KW: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    cols = tl.arange(0, BLOCK_KW)
    nblk = KW // WPB
    acc = tl.zeros((BLOCK_N, BLOCK_KW), dtype=tl.float32)
    for j0 in range(0, KW, BLOCK_KW):
        j = j0 + cols
        jmask = j < KW
        m2 = rmask[:, None] & jmask[None, :]
        w = tl.load(w_ptr + rows[:, None] * KW + j[None, :], mask=m2, other=0)
        if ABLATE == 4:
            acc += w.to(tl.float32)
        else:
            part = tl.zeros((BLOCK_N, BLOCK_KW), dtype=tl.float32)
            for e in tl.static_range(8):
                q = (w >> (8 * (e // 2) + 4 * (1 - e % 2))) & 15
                if ABLATE == 1:
                    v = q.to(tl.float32)
                else:
                    v = tl.load(code_ptr + q)
                if ABLATE == 2:
                    part += v
                else:
                    xe = tl.load(x_ptr + j * 8 + e, mask=jmask, other=0.0).to(tl.float32)
                    part += v * xe[None, :]
            if ABLATE == 3:
                acc += part
            else:
                blk = rows[:, None] * nblk + (j // WPB)[None, :]
                qa = tl.load(q8_ptr + blk, mask=m2, other=0).to(tl.int32)
                scale = (tl.load(code2_ptr + qa) * tl.load(absmax2_ptr + blk // 256, mask=m2, other=0.0)
                         + tl.load(offsets_ptr + blk // 256, mask=m2, other=0.0))
                acc += part * scale
    y = tl.sum(acc, axis=1)
    tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=rmask)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--one", action="store_true", help="a few plain launches on gate_up, for ncu")
    ap.add_argument("--configs", default="8x64w4,8x128w8,4x128w4,16x64w8")
    args = ap.parse_args()
    configs = [tuple(int(v) for v in c.replace("w", "x").split("x")) for c in args.configs.split(",")]
    res: dict = {"command": " ".join(sys.argv), "device": torch.cuda.get_device_name(), "records": []}
    t0 = time.perf_counter()
    if args.one:
        n, k = 22016, 4096
        x = torch.randn(1, k, dtype=torch.bfloat16, device="cuda")
        wt = Weights(n, k, 1)
        c = wt.copies[0]
        for _ in range(3):
            y = torch.empty(1, n, dtype=x.dtype, device=x.device)
            _ablate_kernel[(triton.cdiv(n, 8),)](x, c["words"], c["q8"], c["absmax2"], c["offsets"], wt.code,
                                                 wt.code2, y, n, KW=k // 8, WPB=8, ABLATE=0, BLOCK_N=8, BLOCK_KW=64,
                                                 num_warps=4)
            torch.ops.bitsandbytes.gemm_4bit(x, c["packed"].view(-1, 1), [n, k], c["absmax2"], 64, "nf4", None,
                                             c["q8"], wt.code2, wt.offset)
        torch.cuda.synchronize()
        return 0
    for name, n, k in SHAPES["llama-2-7b"]:
        x = torch.randn(1, k, dtype=torch.bfloat16, device="cuda")
        wt = Weights(n, k, max(2, int(1.0e9 // (n * k // 2))))
        for ablate in range(5):
            for bn, bkw, warps in configs:
                calls = []
                for c in wt.copies:
                    def call(c=c, ablate=ablate, bn=bn, bkw=bkw, warps=warps, n=n, k=k, x=x, wt=wt):
                        y = torch.empty(1, n, dtype=x.dtype, device=x.device)
                        _ablate_kernel[(triton.cdiv(n, bn),)](x, c["words"], c["q8"], c["absmax2"], c["offsets"],
                                                              wt.code, wt.code2, y, n, KW=k // 8, WPB=8,
                                                              ABLATE=ablate, BLOCK_N=bn, BLOCK_KW=bkw,
                                                              num_warps=warps)
                        return y
                    calls.append(call)
                us = time_calls(calls)
                rec = {"shape": name, "n": n, "k": k, "ablate": ablate, "config": [bn, bkw, warps], "us": us,
                       "bytes_per_s": (n * k // 2 + n * k // 64) / (us * 1e-6)}
                res["records"].append(rec)
                print(json.dumps(rec), flush=True)
        del wt
        torch.cuda.empty_cache()
    res["wall_s"] = time.perf_counter() - t0
    args.out.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
