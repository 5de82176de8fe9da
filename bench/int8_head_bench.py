"""The lm_head at the batch buckets (M = 1..32 rows), Llama-3-8B's shape (128,256 x 4096) by default: bf16 cuBLAS
(the table as loaded) against the int8 table's kernels (llm_core.dense_gemv with row scales at M = 1,
llm_core.int8_mm above) and dequantize-in-chunks + matmul (int8_rows_reference), each timed inside a CUDA graph.

    python -m bench.int8_head_bench --out "$OUT/int8-head.json" [--vocab 128256] [--hidden 4096]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--hidden", type=int, default=4096)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs CUDA", file=sys.stderr)
        return 2
    from llm_core.fast.kernels.int8_mm import int8_rows_reference
    from llm_core.fast.tables import quantize_rows_int8
    from llm_core.fast.timing import time_in_cuda_graph

    dev = torch.device("cuda")
    w = torch.randn(args.vocab, args.hidden, device=dev, dtype=torch.bfloat16) * 0.02
    q, scale = quantize_rows_int8(w)
    rows = []
    for m in (1, 2, 4, 8, 16, 32):
        x = torch.randn(m, args.hidden, device=dev, dtype=torch.bfloat16)
        cands = {
            "bf16_cublas": lambda x=x: torch.nn.functional.linear(x, w),
            "int8_kernel": (lambda x=x: torch.ops.llm_core.dense_gemv(x, q, None, None, None, 0.0, False, scale))
            if m == 1 else (lambda x=x: torch.ops.llm_core.int8_mm(x, q, scale)),
            "int8_dequant_chunks": lambda x=x: int8_rows_reference(x, q, scale),
        }
        row: dict[str, float | int] = {"m": m}
        for name, fn in cands.items():
            try:
                row[f"{name}_us"] = round(time_in_cuda_graph(fn, dev, reps=10, replays=5, warmups=3), 1)
            except Exception as exc:  # noqa: BLE001 - recorded
                row[f"{name}_error"] = f"{type(exc).__name__}: {exc}"[:200]  # type: ignore[assignment]
        ref = x.float() @ (q.float() * scale[:, None]).T
        got = cands["int8_kernel"]().float()
        row["int8_kernel_rel_err"] = float((got - ref).norm() / ref.norm())
        rows.append(row)
        print(json.dumps(row), flush=True)
    result = {"bench": "int8_head", "shape": [args.vocab, args.hidden], "device": torch.cuda.get_device_name(0),
              "versions": {"torch": torch.__version__}, "bf16_bytes": w.numel() * 2,
              "int8_bytes": q.numel() + scale.numel() * 4, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
