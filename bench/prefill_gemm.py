"""Prefill-size 4-bit matmul sweep: per linear of a Llama layer (qkv, o, gate_up, down), a prompt chunk of M = 64 to
2,048 rows, time and tensor throughput of llm_core.nf4_gemm (the NF4 weights decoded in registers and fed to the
tensor cores; each tile config) against what the fast path's prefill runs today, bitsandbytes' dequantize_4bit then
a bf16 matmul, and against a bf16 matmul alone (the floor: cuBLAS on weights that are already bf16).

    python -m bench.prefill_gemm --out results.json [--archs llama-2-7b,llama-3-8b] [--ms 64,256,512,1024,2048]
                                 [--budget-s 300] [--refine 2]

Weights: random bf16 of the real shape quantized by bitsandbytes (NF4, blocksize 64, double quant), as
bench/small_m.py builds them; the fused q/k/v and gate/up weights as one tensor (the engine dequantizes a fused
weight one part at a time: the same bytes in a few more launches). Clock: as bench/small_m.py (a CUDA graph over
`copies` weight sets, together 3x the L2, replayed; per call = median replay / calls). Each variant's output is
checked against x @ dequantize_4bit(W).T in fp32 (relative L2 error; the tests' bound is 1e-2).

Records: one per (arch, linear, M) with µs per variant ("gemm:<BLOCK_M>x<BLOCK_N>x<BLOCK_K>/w<warps>/st<stages>/
<s16|exact>:<decode>", "dequant+matmul", "bf16_cublas"), TFLOP/s (2 M N K / time) and errors; the summary sums the
four linears per layer for each family's best and gives dequant+matmul / best gemm (> 1: the fused kernel is
faster) and best gemm / bf16 (how far from the floor). Needs CUDA, bitsandbytes and Triton.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from bench.small_m import WeightSet, cases, graph_us

# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) of the swept grid (decode "asm", scale16)
GRID = [(128, 128, 128, 8, 3), (128, 128, 64, 8, 3), (128, 128, 64, 4, 3), (128, 256, 64, 8, 3),
        (128, 64, 64, 4, 4), (64, 128, 64, 4, 4), (64, 64, 128, 4, 3), (256, 128, 64, 8, 3)]


def key_of(cfg: Any, decode: str) -> str:
    return (f"gemm:{cfg.block_m}x{cfg.block_n}x{cfg.block_k}/w{cfg.warps}/st{cfg.stages}/"
            f"{'s16' if cfg.scale16 else 'exact'}:{decode}")


def config_of(key: str) -> tuple[Any, str]:
    from llm_core.fast.kernels.nf4_mm import GemmConfig

    shape, decode = key.split(":")[1:]
    tiles, warps, stages, form = shape.split("/")
    bm, bn, bk = (int(v) for v in tiles.split("x"))
    return GemmConfig(bm, bn, bk, int(warps[1:]), int(stages[2:]), form == "s16"), decode


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Per arch and M: the layer's four linears summed for each family's best entry ("gemm": the best config per
    linear), with the ratios dequant+matmul / gemm and gemm / bf16."""
    out: dict[str, Any] = {}
    fams = {"gemm": lambda key: key.startswith("gemm:"), "dequant+matmul": lambda key: key == "dequant+matmul",
            "bf16": lambda key: key == "bf16_cublas"}
    for r in records:
        row = out.setdefault(r["arch"], {}).setdefault(str(r["m"]), {"linears": []})
        row["linears"].append(r["linear"])
        for fam, pick in fams.items():
            vals = [v for key, v in r["us"].items() if pick(key)]
            if vals:
                row[fam + "_us"] = round(row.get(fam + "_us", 0.0) + min(vals), 2)
    for rows in out.values():
        for row in rows.values():
            if "gemm_us" in row and "dequant+matmul_us" in row:
                row["dequant+matmul_over_gemm"] = round(row["dequant+matmul_us"] / row["gemm_us"], 3)
            if "gemm_us" in row and "bf16_us" in row:
                row["gemm_over_bf16"] = round(row["gemm_us"] / row["bf16_us"], 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--archs", default="llama-2-7b,llama-3-8b")
    ap.add_argument("--ms", default="64,256,512,1024,2048")
    ap.add_argument("--budget-s", type=float, default=300.0, help="stop starting new shapes after this long")
    ap.add_argument("--refine", type=int, default=2, help="re-time the best N configs exact and with 'gather'")
    args = ap.parse_args()

    import bitsandbytes as bnb
    import bitsandbytes.functional as bf
    import triton

    from llm_core.fast.kernels.nf4_mm import GemmConfig, nf4_gemm

    t_start = time.perf_counter()
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    l2 = int(getattr(props, "L2_cache_size", 50 * 2**20))
    doc: dict[str, Any] = {"meta": {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                                    "triton": triton.__version__, "bitsandbytes": bnb.__version__, "l2_bytes": l2,
                                    "command": "python -m bench.prefill_gemm " + " ".join(
                                        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items())},
                           "records": []}

    def save() -> None:
        args.out.write_text(json.dumps(doc, indent=1))

    ms = [int(v) for v in args.ms.split(",")]
    for arch, lin, n, k, m, sets, xs, ref in cases(args.archs.split(","), ms, l2, args.budget_s, t_start, doc, save):
        rec: dict[str, Any] = {"arch": arch, "linear": lin, "n": n, "k": k, "m": m, "copies": len(sets),
                               "us": {}, "tflops": {}, "rel_err": {}, "errors": {}}

        def timed(name: str, make: Any, rec: dict[str, Any] = rec, xs: list[torch.Tensor] = xs,
                  ref: torch.Tensor = ref, sets: list[WeightSet] = sets, m: int = m) -> None:
            try:
                out = make(sets[0], xs[0])()
                rec["rel_err"][name] = round(float((out.float() - ref).norm() / ref.norm()), 5)
                us = graph_us([make(s, x) for s, x in zip(sets, xs, strict=True)], replays=10)
                rec["us"][name] = round(us, 2)
                rec["tflops"][name] = round(2 * m * rec["n"] * rec["k"] / (us * 1e-6) / 1e12, 1)
            except Exception as exc:  # noqa: BLE001 - a variant that cannot run is recorded, not fatal
                rec["errors"][name] = f"{type(exc).__name__}: {str(exc)[:200]}"

        def ours(cfg: GemmConfig, decode: str) -> Any:
            return lambda s, x: (lambda: nf4_gemm(x, s.words, 64, s.code, nested=s.nested(), config=cfg,
                                                  decode=decode, levels=s.levels))

        for bm, bn, bk, warps, stages in GRID:
            cfg = GemmConfig(bm, bn, bk, warps, stages)
            timed(key_of(cfg, "asm"), ours(cfg, "asm"))
        ranked = sorted((v, key) for key, v in rec["us"].items() if key.startswith("gemm:"))
        for _, key in ranked[:args.refine]:
            cfg, _ = config_of(key)
            exact = cfg.__class__(cfg.block_m, cfg.block_n, cfg.block_k, cfg.warps, cfg.stages, False)
            timed(key_of(exact, "asm"), ours(exact, "asm"))
            timed(key_of(cfg, "gather"), ours(cfg, "gather"))
        timed("dequant+matmul", lambda s, x: (lambda: x @ bf.dequantize_4bit(s.q, s.st).t()))
        timed("bf16_cublas", lambda s, x: (lambda: x @ s.w.t()))
        best = min(((v, key) for key, v in rec["us"].items() if key.startswith("gemm:")), default=None)
        if best is not None:
            rec["best_gemm"], rec["best_gemm_us"] = best[1], best[0]
        doc["records"].append(rec)
        save()
        print(f"{arch} {lin:8s} M={m:5d} best {rec.get('best_gemm')} {rec.get('best_gemm_us')} µs; "
              f"dequant+matmul {rec['us'].get('dequant+matmul')} bf16 {rec['us'].get('bf16_cublas')} "
              f"errors={len(rec['errors'])}", flush=True)
    doc["summary"] = summarize(doc["records"])
    save()
    for arch, rows in doc["summary"].items():
        for m, r in rows.items():
            print(f"{arch:10s} M={m:>5s} per layer µs: gemm {r.get('gemm_us')} dequant+matmul "
                  f"{r.get('dequant+matmul_us')} bf16 {r.get('bf16_us')}  deq/gemm {r.get('dequant+matmul_over_gemm')}"
                  f"  gemm/bf16 {r.get('gemm_over_bf16')}")


if __name__ == "__main__":
    main()
