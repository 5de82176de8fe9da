"""A few launches of the 4-bit kernels the decode step runs, for Nsight Compute: the one-token NF4 GEMV
(llm_core.nf4_gemv, planar input, the prefetching 8 x 16 tile with 4 warps: the fastest planar tile of the
2026-12-06 sweep) on each Llama-2-7B linear, and the small-M kernel (llm_core.nf4_mm, asm decode, its default
config) at 8 rows on the same linears; or, with --frag-rows, only nf4_frag (fragment-order weights, the engine's form:
default_config with table_regs and scale_pairs) at each of those row counts on the same linears. Each is launched
WARM times before the launches meant to be profiled, so the compile and the first-launch costs are outside them.
Not a timing: run it under ncu (bench/h200_gemv_ncu.sh):

    ncu --clock-control none -k regex:"_nf4_(gemv|mm)_kernel" --launch-skip 8 --launch-count 8 \\
        --section SpeedOfLight --section WarpStateStats ... python3 -m bench.gemv_ncu
    ncu ... -k regex:"_nf4_frag_kernel" --launch-skip 16 --launch-count 8 ... python3 -m bench.gemv_ncu --frag-rows 8,32
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from bench.gemv_bench import SHAPES, Weights
from llm_core.fast.kernels import nf4_gemv, nf4_mm

WARM = 2  # launches of each kernel and shape before the profiled ones (in the same order)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8, help="nf4_mm's activation rows")
    parser.add_argument("--config", default="8,16,4,1", help="nf4_gemv's BLOCK_N,BLOCK_B,warps,PREFETCH")
    parser.add_argument("--frag-rows", default="",
                        help="comma-separated row counts: profile nf4_frag at each instead (skip 2 x 4 x their count)")
    args = parser.parse_args(argv)
    config = tuple(int(v) for v in args.config.split(","))
    if args.frag_rows:
        return run_rounds(frag_calls([int(v) for v in args.frag_rows.split(",")]))
    calls: list[Callable[[], object]] = []
    for _name, n, k in SHAPES["llama-2-7b"]:
        wt = Weights(n, k, 1)
        c = wt.copies[0]
        nested = (c["q8"], c["absmax2"], c["offsets"], wt.code2)
        x = torch.randn(1, k, dtype=torch.bfloat16, device="cuda")
        xp = nf4_gemv.planar_pairs(x)
        xs = torch.randn(args.rows, k, dtype=torch.bfloat16, device="cuda")
        calls.append(lambda c=c, wt=wt, nested=nested, xp=xp: nf4_gemv.nf4_gemv(
            xp, c["words"], 64, wt.code_host, nested=nested, config=config, planar=True))
        calls.append(lambda c=c, wt=wt, nested=nested, xs=xs: nf4_mm.nf4_mm(
            xs, c["words"], 64, wt.code, nested=nested, decode="asm", levels=wt.code_host))
    return run_rounds(calls)


def run_rounds(calls: list[Callable[[], object]]) -> int:
    """WARM rounds of the calls, then the round ncu profiles (--launch-skip = WARM x len(calls))."""
    for _ in range(WARM + 1):
        for call in calls:
            call()
    torch.cuda.synchronize()
    print("launches per round", len(calls))
    return 0


def frag_calls(rows: list[int]) -> list[Callable[[], object]]:
    """nf4_frag as the engine's op launches it (its default_config with both forms), per row count and linear."""
    from dataclasses import replace

    from llm_core.fast.kernels import nf4_frag

    calls: list[Callable[[], object]] = []
    for m in rows:
        for _name, n, k in SHAPES["llama-2-7b"]:
            wt = Weights(n, k, 1)
            c = wt.copies[0]
            frag = nf4_frag.repack(c["packed"])
            table = nf4_frag.frag_table(wt.code_host, "cuda")
            pairs = nf4_frag.scale_pairs(c["absmax_fp32"], n, k, 64)
            cfg = replace(nf4_frag.default_config(n, k, nf4_gemv.sm_count(0), m), table_regs=True, scale_pairs=True)
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            calls.append(lambda x=x, frag=frag, wt=wt, cfg=cfg, table=table, pairs=pairs: nf4_frag.nf4_frag(
                x, frag, 64, wt.code_host, config=cfg, table=table, pairs=pairs))
    return calls


if __name__ == "__main__":
    raise SystemExit(main())
