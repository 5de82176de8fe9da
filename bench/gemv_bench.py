"""One-token NF4 kernels on the GPU, per weight shape: bitsandbytes' kernels against llm_core.nf4_gemv.

`ours_*` use the default bf16x2 multiply-adds of llm_core.nf4_gemv.dot8_asm; `ours_nested_fp32math` the fp32
variant (exact products). Every kernel runs on the same bitsandbytes-quantized weights (double quant on,
blocksize 64), over enough distinct copies that the weights come from HBM, not L2 (60 MB on an H200), inside
one CUDA graph; the time is per call. Error is against x @ dequantize_4bit(W).T in fp32.

    python -m bench.gemv_bench --out gemv.json [--arch llama-2-7b llama-3-8b] [--sweep]
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

from bench.decode import measure_copy_bandwidth
from llm_core.fast.kernels import nf4_gemv
from llm_core.fast.kernels.pdl import pdl_support
from llm_core.fast.kernels.tuning import tuned_pick
from llm_core.fast.timing import time_in_cuda_graph
from llm_core.loading import library_versions

SHAPES = {  # fused projections as the fast path runs them: (name, N, K)
    "llama-2-7b": [("qkv", 12288, 4096), ("o", 4096, 4096), ("gate_up", 22016, 4096), ("down", 4096, 11008)],
    "llama-3-8b": [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)],
}
LAYERS = {"llama-2-7b": 32, "llama-3-8b": 32}
# --sweep: these tiles (BLOCK_N, BLOCK_B, warps) in these modes (PREFETCH: the next step's loads in registers;
# planar: x in planes, planar_pairs, the kernel's XPLANAR form)
SWEEP_TILES = [(8, 16, 4), (4, 16, 4), (16, 8, 4), (8, 8, 4), (8, 8, 2)]
SWEEP_MODES = [(False, False), (True, False), (False, True), (True, True)]


def sweep_name(cfg: tuple[Any, ...]) -> str:
    bn, bb, w, pf, planar = cfg
    return f"ours_nested_cfg{bn}x{bb}w{w}" + ("pf" if pf else "") + ("planar" if planar else "")


def time_calls(calls: list[Callable[[], Any]], replays: int = 20) -> float:
    """Microseconds per call: all calls captured in one CUDA graph, replayed `replays` times."""

    def all_calls() -> None:
        for c in calls:
            c()

    return time_in_cuda_graph(all_calls, replays=replays) / len(calls)


class Weights:
    """One quantized weight, cloned `copies` times (distinct memory), in every form the kernels read."""

    def __init__(self, n: int, k: int, copies: int) -> None:
        import bitsandbytes.functional as bf

        w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02
        packed, qs = bf.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")
        self.n, self.k, self.qs = n, k, qs
        self.deq = bf.dequantize_4bit(packed, qs).float()
        self.code = qs.code.float()
        self.code_host = tuple(self.code.tolist())
        self.code2 = qs.state2.code.float()
        self.offset = qs.offset.float().reshape(())
        nb2 = qs.state2.absmax.numel()
        self.copies = []
        absmax_fp32 = (bf.dequantize_blockwise(qs.absmax, qs.state2) + qs.offset).float().view(-1)
        for _ in range(copies):
            p = packed.clone().view(torch.uint8).reshape(n, k // 2)
            self.copies.append({
                "packed": p, "words": nf4_gemv.words_view(p), "q8": qs.absmax.clone().view(-1),
                "absmax2": qs.state2.absmax.float().clone(), "offsets": self.offset.repeat(nb2),
                "absmax_fp32": absmax_fp32.clone()})

    @property
    def nbytes_nested(self) -> int:
        return self.n * self.k // 2 + self.n * self.k // 64  # packed + one uint8 absmax per block


def kernels(wt: Weights, x: torch.Tensor, configs: list[tuple[Any, ...]] | None) -> dict[str, list[Callable]]:
    n, k = wt.n, wt.k
    out: dict[str, list[Callable]] = {}
    out["bnb_gemm_4bit_nested"] = [
        (lambda c=c: torch.ops.bitsandbytes.gemm_4bit(x, c["packed"].view(-1, 1), [n, k], c["absmax2"], 64, "nf4",
                                                      None, c["q8"], wt.code2, wt.offset)) for c in wt.copies]
    out["bnb_gemm_4bit_fp32"] = [
        (lambda c=c: torch.ops.bitsandbytes.gemm_4bit(x, c["packed"].view(-1, 1), [n, k], c["absmax_fp32"], 64,
                                                      "nf4", None)) for c in wt.copies]
    out["bnb_gemv_4bit_fp32"] = [
        (lambda c=c: torch.ops.bitsandbytes.gemv_4bit(x, c["packed"].view(-1, 1), [n, k], c["absmax_fp32"],
                                                      wt.code, 64)) for c in wt.copies]

    xp = nf4_gemv.planar_pairs(x)  # what the planar form reads (in the engine, the op before would write it so)

    def ours(c: dict[str, Any], nested: bool, **kw: Any) -> Callable[[], Any]:
        xin = xp if kw.get("planar") else x
        if nested:
            state = (c["q8"], c["absmax2"], c["offsets"], wt.code2)
            return lambda: nf4_gemv.nf4_gemv(xin, c["words"], 64, wt.code_host, nested=state, **kw)
        return lambda: nf4_gemv.nf4_gemv(xin, c["words"], 64, wt.code_host, absmax=c["absmax_fp32"], **kw)

    out["ours_nested"] = [ours(c, True) for c in wt.copies]  # the default: bf16x2 multiply-adds, 16-byte x loads
    out["ours_fp32"] = [ours(c, False) for c in wt.copies]
    out["ours_nested_x4loads"] = [ours(c, True, xvec=False) for c in wt.copies]  # activation pairs one by one
    out["ours_nested_fp32math"] = [ours(c, True, math="fp32") for c in wt.copies]  # exact products, ~1.7x instr
    out["ours_nested_planar"] = [ours(c, True, planar=True) for c in wt.copies]  # x in planes: no conversion
    if pdl_support(x.device)[0]:  # LAUNCH_OVERLAP: each call a programmatic dependent launch of the one before
        out["ours_nested_pdl"] = [ours(c, True, pdl=True) for c in wt.copies]
        out["ours_nested_planar_pdl"] = [ours(c, True, planar=True, pdl=True) for c in wt.copies]
        out["ours_nested_pdl_early"] = [ours(c, True, pdl=True, early=True) for c in wt.copies]  # + L2 prefetch
    for cfg in configs or []:
        out[sweep_name(cfg)] = [ours(c, True, config=cfg[:4], planar=cfg[4]) for c in wt.copies]
    return out


def dump_asm(call: Callable[[], Any], stem: Path) -> dict[str, int] | str:
    """PTX and SASS of the kernel `call` launches (its tuned config), and SASS opcode counts (whole kernel)."""
    import collections
    import re

    from llm_core.fast.kernels import nf4_gemv as k

    kernels: list[Any] = []
    original = k.nf4_gemv

    def capture(*a: Any, **kw: Any) -> Any:
        return original(*a, **kw, compiled=kernels)

    k.nf4_gemv = capture  # the call's closure looks the function up on the module
    try:
        call()
    finally:
        k.nf4_gemv = original
    if not kernels or kernels[0] is None:
        return "no compiled kernel returned"
    stem.parent.mkdir(parents=True, exist_ok=True)
    asm = kernels[0].asm
    stem.with_suffix(".ptx").write_text(asm["ptx"])
    try:
        sass = asm["sass"]
    except Exception as exc:  # noqa: BLE001 - needs cuobjdump/nvdisasm on the machine
        return f"no SASS: {type(exc).__name__}: {exc}"[:300]
    stem.with_suffix(".sass").write_text(sass)
    line = re.compile(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9.]+)", re.M)
    ops = collections.Counter(m.group(1).split(".")[0] for m in line.finditer(sass))
    return dict(ops.most_common(40))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arch", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--sweep", action="store_true",
                    help="also time SWEEP_TILES x SWEEP_MODES of ours, untuned (first arch only)")
    ap.add_argument("--kernels", help="comma-separated names of the fixed kernels to time (default: all)")
    ap.add_argument("--min-bytes", type=float, default=1.0e9, help="weights per timed graph (>> L2)")
    ap.add_argument("--budget-s", type=float, default=420.0)
    ap.add_argument("--asm-dir", type=Path, help="write PTX and SASS of the tuned kernels here, with opcode counts")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    result: dict[str, Any] = {"title": "One-token NF4 kernels per weight shape", "command": " ".join(sys.argv),
                              "device": torch.cuda.get_device_name(), "versions": library_versions(),
                              "triton": getattr(nf4_gemv.triton, "__version__", None),
                              "copy_bandwidth_bytes_per_s": measure_copy_bandwidth(torch.device("cuda")),
                              "records": [], "layers": {}}
    for arch in args.arch:
        per_layer: dict[str, float] = {}
        for name, n, k in SHAPES[arch]:
            if time.perf_counter() - t0 > args.budget_s:
                result["stopped"] = f"budget reached before {arch}/{name}"
                break
            x = torch.randn(1, k, dtype=torch.bfloat16, device="cuda")
            probe = Weights(n, k, 1)
            copies = max(2, math.ceil(args.min_bytes / probe.nbytes_nested))
            del probe
            wt = Weights(n, k, copies)
            ref = x.float() @ wt.deq.T
            sweep = ([(*t, *m) for m in SWEEP_MODES for t in SWEEP_TILES] if args.sweep and arch == args.arch[0]
                     else None)
            chosen = kernels(wt, x, sweep)
            if args.kernels:
                keep = set(args.kernels.split(","))
                chosen = {kn: c for kn, c in chosen.items() if kn in keep or kn.startswith("ours_nested_cfg")}
            for kname, calls in chosen.items():
                rec: dict[str, Any] = {"arch": arch, "shape": name, "n": n, "k": k, "kernel": kname, "copies": copies}
                try:
                    y = calls[0]().float()
                    rec["max_abs_err_rel"] = float((y - ref).abs().max() / ref.abs().max())
                    rec["rel_l2_err"] = float((y.view(-1) - ref.view(-1)).norm() / ref.norm())
                    us = time_calls(calls)
                    rec["us_per_call"] = us
                    rec["bytes_per_s"] = wt.nbytes_nested / (us * 1e-6)
                    if kname.startswith("ours") and "cfg" not in kname:
                        rec["tuned_config"] = tuned_pick(nf4_gemv.AUTOTUNER, n, k // 8,
                                                         ("BLOCK_N", "BLOCK_B", "PREFETCH"),
                                                         XPLANAR="planar" in kname, XVEC="x4loads" not in kname,
                                                         NESTED=not kname.startswith("ours_fp32"))
                        if args.asm_dir is not None and arch == args.arch[0]:
                            rec["sass_opcodes"] = dump_asm(calls[0], args.asm_dir / f"{kname}-{name}")
                    per_layer[kname] = per_layer.get(kname, 0.0) + us
                except Exception as exc:  # noqa: BLE001 - record and go on with the other kernels
                    rec["error"] = f"{type(exc).__name__}: {exc}"[:500]
                result["records"].append(rec)
                print(json.dumps(rec), flush=True)
            del wt
            torch.cuda.empty_cache()
        result["layers"][arch] = {kname: {"us_per_layer": us, "ms_per_step_gemv": us * LAYERS[arch] / 1e3}
                                  for kname, us in per_layer.items()}
        args.out.write_text(json.dumps(result, indent=1))
    finish(result, args.out, t0, "ms_per_step_gemv")
    return 0


def finish(result: dict[str, Any], out: Path, t0: float, step_key: str) -> None:
    """Write the result with its wall time, then print each arch's kernels per layer, fastest first."""
    result["wall_s"] = time.perf_counter() - t0
    out.write_text(json.dumps(result, indent=1))
    for arch, table in result["layers"].items():
        print(arch)
        for kname, v in sorted(table.items(), key=lambda kv: kv[1]["us_per_layer"]):
            print(f"  {kname:40s} {v['us_per_layer']:8.1f} us/layer  {v[step_key]:6.2f} ms/step")


if __name__ == "__main__":
    sys.exit(main())
