"""One-token matrix-vector products for unquantized bf16 weights on the GPU, per weight shape: cuBLAS (F.linear,
what the fast path ran before) against llm_core.dense_gemv, plain and with the prologue/epilogue each projection
gets in the fused decode layer (qkv and gate_up: RMSNorm; o: residual; down: SiLU-and-multiply + residual).

Each kernel runs over enough distinct weight copies that they come from HBM, not L2, inside one CUDA graph; the
time is per call and bytes/s counts the weight bytes. Error is relative L2 against the fp32 reference formula.

    python -m bench.dense_gemv_bench --out dense-gemv.json [--arch llama-2-7b llama-3-8b] [--sweep]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from bench.decode import measure_copy_bandwidth
from bench.gemv_bench import finish, time_calls
from llm_core.fast.kernels import dense_gemv as dg
from llm_core.fast.kernels.tuning import tuned_pick
from llm_core.loading import library_versions

SHAPES = {  # (name, N, K, the prologue/epilogue it gets in the fused layer)
    "llama-2-7b": [("qkv", 12288, 4096, "norm"), ("o", 4096, 4096, "residual"),
                   ("gate_up", 22016, 4096, "norm"), ("down", 4096, 11008, "glu+residual"),
                   ("lm_head", 32000, 4096, "norm")],
    "llama-3-8b": [("qkv", 6144, 4096, "norm"), ("o", 4096, 4096, "residual"),
                   ("gate_up", 28672, 4096, "norm"), ("down", 4096, 14336, "glu+residual"),
                   ("lm_head", 128256, 4096, "norm")],
}
LAYERS = 32


def kwargs_for(fusion: str, k: int, n: int) -> tuple[torch.Tensor, dict[str, Any]]:
    x = torch.randn(1, 2 * k if "glu" in fusion else k, dtype=torch.bfloat16, device="cuda")
    kw: dict[str, Any] = {}
    if "norm" in fusion:
        kw.update(norm_weight=(1 + 0.1 * torch.randn(k, device="cuda")).to(torch.bfloat16), eps=1e-5)
    if "glu" in fusion:
        kw["glu"] = True
    if "residual" in fusion:
        kw["residual"] = torch.randn(1, n, dtype=torch.bfloat16, device="cuda")
    return x, kw


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arch", nargs="+", default=["llama-2-7b"], choices=list(SHAPES))
    ap.add_argument("--sweep", action="store_true", help="also time every block shape of the plain kernel, untuned")
    ap.add_argument("--min-bytes", type=float, default=1.0e9, help="weights per timed graph (>> L2)")
    ap.add_argument("--budget-s", type=float, default=240.0)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    result: dict[str, Any] = {"title": "One-token bf16 matrix-vector kernels per weight shape",
                              "command": " ".join(sys.argv), "device": torch.cuda.get_device_name(),
                              "versions": library_versions(), "triton": getattr(dg.triton, "__version__", None),
                              "copy_bandwidth_bytes_per_s": measure_copy_bandwidth(torch.device("cuda")),
                              "records": [], "layers": {}}
    for arch in args.arch:
        per_layer: dict[str, float] = {}
        for name, n, k, fusion in SHAPES[arch]:
            if time.perf_counter() - t0 > args.budget_s:
                result["stopped"] = f"budget reached before {arch}/{name}"
                break
            nbytes = n * k * 2
            copies = max(2, math.ceil(args.min_bytes / nbytes))
            ws = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02 for _ in range(copies)]
            x = torch.randn(1, k, dtype=torch.bfloat16, device="cuda")
            xf, kw = kwargs_for(fusion, k, n)
            variants: dict[str, tuple[list[Callable[[], Any]], torch.Tensor]] = {
                "cublas": ([lambda w=w, x=x: F.linear(x, w) for w in ws],
                           dg.dense_gemv_reference(x.float(), ws[0].float())),
                "triton": ([lambda w=w, x=x: dg.dense_gemv(x, w) for w in ws],
                           dg.dense_gemv_reference(x.float(), ws[0].float())),
                f"triton_{fusion}": ([lambda w=w, xf=xf, kw=kw: dg.dense_gemv(xf, w, **kw) for w in ws],
                                     dg.dense_gemv_reference(xf, ws[0], **kw).float()),
            }
            if args.sweep and arch == args.arch[0]:
                for cfg in dg.CONFIGS:
                    variants[f"triton_cfg{cfg[0]}x{cfg[1]}w{cfg[2]}"] = (
                        [lambda w=w, cfg=cfg, x=x: dg.dense_gemv(x, w, config=cfg) for w in ws],
                        dg.dense_gemv_reference(x.float(), ws[0].float()))
            for kname, (calls, ref) in variants.items():
                rec: dict[str, Any] = {"arch": arch, "shape": name, "n": n, "k": k, "kernel": kname,
                                       "copies": copies}
                try:
                    y = calls[0]().float()
                    rec["rel_l2_err"] = float((y.view(-1) - ref.view(-1)).norm() / ref.norm())
                    us = time_calls(calls)
                    rec.update(us_per_call=us, bytes_per_s=nbytes / (us * 1e-6))
                    if kname.startswith("triton") and "cfg" not in kname:
                        rec["tuned_config"] = tuned_pick(dg.AUTOTUNER, n, k, ("BLOCK_N", "BLOCK_K"))
                    key = "triton_fused" if kname.startswith("triton_") and "cfg" not in kname else kname
                    if name != "lm_head" and "cfg" not in kname:
                        per_layer[key] = per_layer.get(key, 0.0) + us
                except Exception as exc:  # noqa: BLE001 - record and go on with the other kernels
                    rec["error"] = f"{type(exc).__name__}: {exc}"[:500]
                result["records"].append(rec)
                print(json.dumps(rec), flush=True)
            del ws
            torch.cuda.empty_cache()
        result["layers"][arch] = {kname: {"us_per_layer": us, "ms_per_step": us * LAYERS / 1e3}
                                  for kname, us in per_layer.items()}
        args.out.write_text(json.dumps(result, indent=1))
    finish(result, args.out, t0, "ms_per_step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
