"""A later prefill chunk's attention over the cached prefix, the two forms the fast path has (llm_core.fast.layer):
SDPA with an explicit (S, T) mask (memory-efficient attention; flash refuses a mask) and flash attention with its
causal mask aligned bottom-right (LayerSpec.prefix_flash). One layer of Llama-2-7B (32 heads) or Llama-3-8B (32
query, 8 K/V heads), head_dim 128, bf16, timed in a CUDA graph; TFLOP/s count 4*S*T_avg*H*D (QK^T and PV, the
causal part skipped). What a part can do, not a user's number: bench.multiturn gives the turn's TTFT.

    python -m bench.prefix_attention --out bench/results/<date>-h200-prefix-attention.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from functools import partial

import torch

from llm_core.fast import layer
from llm_core.fast.timing import time_in_cuda_graph

SHAPES = {"llama-2-7b": (32, 32), "llama-3-8b": (32, 8)}
CASES = [(3000, 0), (3000, 3000), (3000, 9000), (3000, 15000), (3000, 24000), (512, 16000)]  # (new, cached)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    dev = torch.device("cuda")
    records = []
    for model, (heads, kv_heads) in SHAPES.items():
        dim = 128
        for seq, start in CASES:
            spec = layer.LayerSpec(heads, kv_heads, dim, dim ** -0.5, 1e-5, 1e-5, None, (), True, "triton", True)
            end = start + seq
            q = torch.randn(1, heads, seq, dim, device=dev, dtype=torch.bfloat16)
            keys = torch.randn(1, kv_heads, end, dim, device=dev, dtype=torch.bfloat16)
            values = torch.randn(1, kv_heads, end, dim, device=dev, dtype=torch.bfloat16)
            mask = torch.arange(end, device=dev)[None, :] <= torch.arange(start, end, device=dev)[:, None]
            flops = 4 * seq * (start + (seq + 1) / 2) * heads * dim
            rec = {"model": model, "new_tokens": seq, "cached_tokens": start}
            forms = {"flash_lower_right": partial(layer._prefix_flash_attention, spec, q, keys, values)}
            if start:
                forms["sdpa_mask"] = partial(layer._prefill_attention, spec, q, keys, values, mask)
            else:
                forms["sdpa_causal"] = partial(layer._prefill_attention, spec, q, keys, values, None)
            for name, fn in forms.items():
                try:  # under the backends the fast path's prefill runs with (FastDecodeOptions.prefill_attention)
                    with layer._prefill_attention_scope("flash", dev):
                        ms = time_in_cuda_graph(fn, dev, reps=5, replays=5, warmups=2) / 1000.0  # us -> ms
                    rec[f"{name}_ms"] = round(ms, 3)
                    rec[f"{name}_tflops"] = round(flops / (ms / 1e3) / 1e12, 1)
                except Exception as exc:  # noqa: BLE001 - a form that cannot run is recorded as such
                    rec[f"{name}_error"] = f"{type(exc).__name__}: {exc}"[:300]
            if "sdpa_mask_ms" in rec and "flash_lower_right_ms" in rec:
                rec["mask_over_flash"] = round(rec["sdpa_mask_ms"] / rec["flash_lower_right_ms"], 2)
                with layer._prefill_attention_scope("flash", dev):
                    diff = (layer._prefix_flash_attention(spec, q, keys, values).float()
                            - layer._prefill_attention(spec, q, keys, values, mask).float())
                rec["max_abs_diff"] = float(diff.abs().max())
            print(json.dumps(rec), flush=True)
            records.append(rec)
            del q, keys, values, mask
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "when": time.strftime("%F %T"),
            "command": "python -m bench.prefix_attention " + " ".join(sys.argv[1:])}
    with open(args.out, "w") as fh:
        json.dump({"meta": meta, "records": records}, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
