"""A later prefill chunk's attention over the cached prefix, the two forms the fast path has (llm_core.fast.layer):
SDPA with an explicit (S, T) mask (memory-efficient attention; flash refuses a mask) and flash attention with its
causal mask aligned bottom-right (LayerSpec.prefix_flash). One layer of Llama-2-7B (32 heads) or Llama-3-8B (32
query, 8 K/V heads), head_dim 128, bf16, timed in a CUDA graph; TFLOP/s count 4*S*T_avg*H*D (QK^T and PV, the
causal part skipped). What a part can do, not a user's number: bench.multiturn gives the turn's TTFT.

    python -m bench.prefix_attention --out bench/results/<date>-h200-prefix-attention.json

--paged times instead what a later chunk of the paged pool costs per layer, bf16 and int8 rows, chunks of 1,024 (the
small-card default) and 3,000 new tokens: the engine's path today (SlotDecoder.prefill: the row's prefix gathered out
of the pool into a temporary, dequantized and flash-attended PREFIX_HEADS K/V heads at a time) against the paged
prefix attention kernel (llm_core.fast.kernels.prefix_attention, the pool read in place) at a few launch
configurations, with the largest difference between the two outputs.

--split times the engine's gather path against PREFIX_ATTENTION=split (layer._split_prefix_attention: the prefix
attended without a mask, by flash or by cuDNN, the chunk's own keys causally, merged by log-sum-exp), both through
engine_prefix_attention, with each form's largest difference from a float32 reference, and the first call of a new
shape for the cuDNN form (its execution plan is built per shape), then cuDNN's own causal mask over the whole
(which corner it aligns: `cudnn_causal_matches`).
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
    parser.add_argument("--paged", action="store_true", help="the paged pool's forms (see above)")
    parser.add_argument("--split", action="store_true", help="PREFIX_ATTENTION=split's forms (see above)")
    args = parser.parse_args(argv)
    dev = torch.device("cuda")
    records = paged_records(dev) if args.paged else split_records(dev) if args.split else []
    for model, (heads, kv_heads) in SHAPES.items() if not (args.paged or args.split) else ():
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


PAGED_CASES = [(1024, 8000), (1024, 24000), (3000, 3000), (3000, 24000)]  # (new, cached)
PAGED_LAUNCHES = [dict(block_m=64, block_n=64, num_warps=4), dict(block_m=128, block_n=64, num_warps=8),
                  dict(block_m=128, block_n=32, num_warps=4), dict(block_m=64, block_n=32, num_warps=4, num_stages=2)]
PAGE = 16  # the pool's block size (KV_BLOCK_TOKENS' default)


def engine_prefix_attention(spec: layer.LayerSpec, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                            table: torch.Tensor, start: int) -> torch.Tensor:
    """What SlotDecoder.prefill does for a later chunk's attention over the paged pool: the row's positions gathered
    into a contiguous (end, Hkv, row) temporary, then layer.prefix_attention_over_cache (dequantized or made
    contiguous and flash-attended PREFIX_HEADS K/V heads at a time). q (1, Hq, S, D) -> (1, S, Hq * D)."""
    from llm_core.fast.kernels.attention import gather_blocks

    end = start + q.shape[2]
    blocks = table[None, :-(-end // PAGE)]
    cache = []
    for pool in (k_pool, v_pool):  # as SlotDecoder._gathered: a gather, then a copy into the layer's temporary
        temp = pool.new_empty(end, *pool.shape[2:])
        temp[:] = gather_blocks(pool, blocks)[0, :end]
        cache.append(temp)
    return layer.prefix_attention_over_cache(spec, q, cache[0], cache[1], start)


def random_pool(dev: torch.device, rows: str, end: int, kv_heads: int, dim: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Generator]:
    """A paged K/V pool with `end` positions of random rows (bf16, or int8 rows with their scales) in shuffled blocks
    (8 spare), that row's block table, and the seeded generator (for the queries)."""
    from llm_core.fast.kvquant import quantize_rows

    blocks = -(-end // PAGE)
    g = torch.Generator(device=dev).manual_seed(0)
    k = torch.randn(blocks + 8, PAGE, kv_heads, dim, device=dev, dtype=torch.bfloat16, generator=g)
    v = torch.randn(blocks + 8, PAGE, kv_heads, dim, device=dev, dtype=torch.bfloat16, generator=g)
    if rows == "int8":
        k, v = quantize_rows(k), quantize_rows(v)
    table = torch.randperm(blocks + 8, device=dev, generator=g)[:blocks].to(torch.int32)
    return k, v, table, g


def paged_records(dev: torch.device) -> list[dict[str, object]]:
    from llm_core.fast.kernels.prefix_attention import prefix_attention_paged

    records: list[dict[str, object]] = []
    dim = 128
    for model, (heads, kv_heads) in SHAPES.items():
        spec = layer.LayerSpec(heads, kv_heads, dim, dim ** -0.5, 1e-5, 1e-5, None, (), True, "triton", True)
        for rows in ("bf16", "int8"):
            for seq, start in PAGED_CASES:
                end = start + seq
                k, v, table, g = random_pool(dev, rows, end, kv_heads, dim)
                q = torch.randn(seq, heads, dim, device=dev, dtype=torch.bfloat16, generator=g)
                flops = 4 * seq * (start + (seq + 1) / 2) * heads * dim
                rec: dict[str, object] = {"model": model, "rows": rows, "new_tokens": seq, "cached_tokens": start,
                                          "page": PAGE}
                forms = {"engine_gather_flash": partial(engine_prefix_attention, spec, q.transpose(0, 1)[None], k, v,
                                                        table, start)}
                for i, launch in enumerate(PAGED_LAUNCHES):
                    forms[f"paged_kernel_{i}"] = partial(prefix_attention_paged, q, k, v, table, start, spec.scale,
                                                         **launch)
                outs = {}
                for name, fn in forms.items():
                    try:
                        with layer._prefill_attention_scope("flash", dev):
                            outs[name] = fn().reshape(seq, heads * dim).float()
                            ms = time_in_cuda_graph(fn, dev, reps=3, replays=5, warmups=2) / 1000.0
                        rec[f"{name}_ms"] = round(ms, 3)
                        rec[f"{name}_tflops"] = round(flops / (ms / 1e3) / 1e12, 1)
                    except Exception as exc:  # noqa: BLE001 - a form that cannot run is recorded as such
                        rec[f"{name}_error"] = f"{type(exc).__name__}: {exc}"[:300]
                if "engine_gather_flash" in outs:
                    ref = outs["engine_gather_flash"]
                    rec["max_abs_diff"] = max((float((o - ref).abs().max()) for n, o in outs.items()
                                               if n != "engine_gather_flash"), default=None)
                print(json.dumps(rec), flush=True)
                records.append(rec)
                del k, v, q, table, outs
                torch.cuda.empty_cache()
    return records


SPLIT_CASES = [(1024, 8000), (1024, 16000), (3000, 3000), (3000, 12000), (3000, 24000)]  # (new, cached)
SPLIT_FORMS = {"engine_gather_flash": "", "split_flash": "flash", "split_cudnn": "cudnn"}


def _reference(spec: layer.LayerSpec, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int
               ) -> torch.Tensor:
    """float32 attention of q (1, H, S, D) at positions start..start+S-1 over keys/values (1, Hkv, T, D), each query
    seeing the keys up to its position, per head (bounded memory) -> (S, H * D). start = T - S: the bottom-right
    causal mask; start = 0: the top-left one."""
    seq, end = q.shape[2], keys.shape[2]
    groups = spec.n_heads // spec.n_kv_heads
    mask = torch.arange(end, device=q.device)[None, :] <= torch.arange(start, start + seq, device=q.device)[:, None]
    outs = []
    for h in range(spec.n_heads):
        s = (q[0, h].float() @ keys[0, h // groups].float().T) * spec.scale
        p = torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1)
        outs.append(p @ values[0, h // groups].float())
    return torch.stack(outs, 1).reshape(seq, spec.n_heads * spec.head_dim)


def split_records(dev: torch.device) -> list[dict[str, object]]:
    from llm_core.fast.kvquant import from_cache

    records: list[dict[str, object]] = []
    dim = 128
    cudnn_ok = layer.prefix_split_backend(dev, torch.bfloat16, dim)
    records.append({"kind": "probe", "prefix_split_backend": cudnn_ok,
                    "cudnn_version": torch.backends.cudnn.version()})
    print(json.dumps(records[-1]), flush=True)
    for model, (heads, kv_heads) in SHAPES.items():
        for rows in ("bf16", "int8"):
            for seq, start in SPLIT_CASES:
                end = start + seq
                k, v, table, g = random_pool(dev, rows, end, kv_heads, dim)
                q = torch.randn(1, heads, seq, dim, device=dev, dtype=torch.bfloat16, generator=g)
                flops = 4 * seq * (start + (seq + 1) / 2) * heads * dim
                rec: dict[str, object] = {"model": model, "rows": rows, "new_tokens": seq, "cached_tokens": start,
                                          "page": PAGE}
                from llm_core.fast.kernels.attention import gather_blocks
                whole = [from_cache(gather_blocks(pool, table[None])[0, :end], torch.bfloat16).transpose(0, 1)[None]
                         for pool in (k, v)]
                ref = _reference(layer.LayerSpec(heads, kv_heads, dim, dim ** -0.5, 1e-5, 1e-5, None, (), True,
                                                 "triton", True), q, whole[0], whole[1], start)
                for name, backend in SPLIT_FORMS.items():
                    if backend == "cudnn" and cudnn_ok != "cudnn":
                        rec[f"{name}_error"] = "cuDNN attention unavailable (prefix_split_backend)"
                        continue
                    spec = layer.LayerSpec(heads, kv_heads, dim, dim ** -0.5, 1e-5, 1e-5, None, (), True, "triton",
                                           True, backend)
                    fn = partial(engine_prefix_attention, spec, q, k, v, table, start)
                    try:
                        with layer._prefill_attention_scope("flash", dev):
                            torch.cuda.synchronize()
                            t0 = time.perf_counter()
                            out = fn().reshape(seq, heads * dim).float()
                            torch.cuda.synchronize()
                            rec[f"{name}_first_call_ms"] = round((time.perf_counter() - t0) * 1e3, 2)
                            ms = time_in_cuda_graph(fn, dev, reps=3, replays=5, warmups=2) / 1000.0
                        rec[f"{name}_ms"] = round(ms, 3)
                        rec[f"{name}_tflops"] = round(flops / (ms / 1e3) / 1e12, 1)
                        rec[f"{name}_max_abs_diff_fp32"] = round(float((out - ref).abs().max()), 5)
                    except Exception as exc:  # noqa: BLE001 - a form that cannot run is recorded as such
                        rec[f"{name}_error"] = f"{type(exc).__name__}: {exc}"[:300]
                if cudnn_ok == "cudnn" and kv_heads == heads:  # which corner cuDNN's own causal mask takes
                    try:
                        got = layer.attention_lse(q, whole[0], whole[1], dim ** -0.5, True, "cudnn")[0]
                        got = got.transpose(1, 2).reshape(seq, heads * dim).float()
                        top_left = _reference(layer.LayerSpec(heads, kv_heads, dim, dim ** -0.5, 1e-5, 1e-5, None,
                                                              (), True, "triton", True), q, whole[0], whole[1], 0)
                        rec["cudnn_causal_matches"] = ("bottom-right" if float((got - ref).abs().max()) < 0.02
                                                       else "top-left" if float((got - top_left).abs().max()) < 0.02
                                                       else "neither")
                    except Exception as exc:  # noqa: BLE001
                        rec["cudnn_causal_error"] = f"{type(exc).__name__}: {exc}"[:300]
                print(json.dumps(rec), flush=True)
                records.append(rec)
                del k, v, q, table, whole, ref
                torch.cuda.empty_cache()
    return records


if __name__ == "__main__":
    raise SystemExit(main())
