"""A few launches of the 4-bit kernels the decode step runs, for Nsight Compute: the one-token NF4 GEMV
(llm_core.nf4_gemv, planar input, the prefetching 8 x 16 tile with 4 warps: the fastest planar tile of the
2026-12-06 sweep) on each Llama-2-7B linear, and the small-M kernel (llm_core.nf4_mm, asm decode, its default
config) at 8 rows on the same linears. Each is launched WARM times before the launches meant to be profiled, so the
compile and the first-launch costs are outside them. Not a timing: run it under ncu (bench/h200_gemv_ncu.sh):

    ncu --clock-control none -k regex:"_nf4_(gemv|mm)_kernel" --launch-skip 8 --launch-count 8 \\
        --section SpeedOfLight --section WarpStateStats ... python3 -m bench.gemv_ncu
"""

from __future__ import annotations

import argparse

import torch

from bench.gemv_bench import SHAPES, Weights
from llm_core.fast.kernels import nf4_gemv, nf4_mm

WARM = 2  # launches of each kernel and shape before the profiled ones (in the same order)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8, help="nf4_mm's activation rows")
    parser.add_argument("--config", default="8,16,4,1", help="nf4_gemv's BLOCK_N,BLOCK_B,warps,PREFETCH")
    args = parser.parse_args(argv)
    config = tuple(int(v) for v in args.config.split(","))
    calls = []
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
    for _ in range(WARM + 1):  # the last round is the one ncu profiles (--launch-skip = WARM x len(calls))
        for call in calls:
            call()
    torch.cuda.synchronize()
    print("launches per round", len(calls))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
