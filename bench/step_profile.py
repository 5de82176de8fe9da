"""Where a fast-path decode step's time goes: every kernel of the captured step, per step, from torch.profiler.

The engine is the demo's (ChatEngine on a random-weight checkpoint, as bench/ttft_probe.py loads it); the step is
the CUDA graph the replies replay, at a given context length. Kernels are grouped: the 4-bit or dense
matrix-vector products, decode attention, and the rest (norms, rotary + cache write, residual adds, SiLU, the
head's sampling epilogue), with their count and device time per step, next to the step's wall time.

    python -m bench.step_profile --random llama-2-7b --quantization nf4 --out profile.json   (GPU)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bench.harness import RANDOM_ARCHS
from bench.probes import time_decode_steps
from bench.ttft_probe import load_engine
from llm_core.loading import library_versions

GROUPS = (("gemv", ("nf4_gemv", "gemm_4bit", "gemv", "gemm", "cublas", "cutlass", "sm90_xmma", "nvjet")),
          ("attention", ("_attn_split", "_attn_combine", "attention")))


def group_of(name: str) -> str:
    low = name.lower()
    for group, keys in GROUPS:
        if any(k in low for k in keys):
            return group
    return "other"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--random", default="llama-2-7b", choices=sorted(RANDOM_ARCHS))
    ap.add_argument("--quantization", default="nf4")
    ap.add_argument("--context", type=int, default=512, help="tokens already in the cache")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp/bench"))
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    from torch.profiler import ProfilerActivity, profile

    device = torch.device("cuda")
    engine, _ = load_engine(args.random, args.quantization, args.context + 192, device, args.work_dir)
    decoder = engine.fast_decoder
    wall = [time_decode_steps(decoder, args.context, args.steps) for _ in range(3)]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        time_decode_steps(decoder, args.context, args.steps)
    kernels: list[dict[str, Any]] = []
    for ev in prof.key_averages():
        us = float(getattr(ev, "device_time_total", 0.0) or getattr(ev, "cuda_time_total", 0.0))
        if us <= 0:
            continue
        kernels.append({"kernel": ev.key[:200], "group": group_of(ev.key), "calls_per_step": ev.count / args.steps,
                        "us_per_step": us / args.steps})
    kernels.sort(key=lambda k: -k["us_per_step"])
    groups: dict[str, dict[str, float]] = {}
    for k in kernels:
        g = groups.setdefault(k["group"], {"kernels_per_step": 0.0, "us_per_step": 0.0})
        g["kernels_per_step"] += k["calls_per_step"]
        g["us_per_step"] += k["us_per_step"]
    step_s = statistics.median(wall)
    result = {"title": "Fast-path decode step profile", "command": " ".join(sys.argv),
              "device": torch.cuda.get_device_name(), "versions": library_versions(),
              "decode_path_reason": engine.backend.reason, "context_tokens": args.context,
              "step_wall_us": step_s * 1e6, "tokens_per_s": 1.0 / step_s,
              "kernel_us_per_step": sum(k["us_per_step"] for k in kernels),
              "kernels_per_step": sum(k["calls_per_step"] for k in kernels),
              "groups": groups, "kernels": kernels, "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "kernels"}, indent=1))
    for k in kernels[:25]:
        print(f"{k['us_per_step']:9.1f} us {k['calls_per_step']:6.1f}x  {k['group']:9s} {k['kernel'][:110]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
