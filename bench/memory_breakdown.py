"""Where a small card's memory goes: the app's path (ChatEngine, default settings) on one emulated card,
with the CUDA allocator's history recorded, summarised after start-up and after one long chat turn.

The card runs (bench/results/2026-12-01-h200-cards-*.json) found the fast path holding 1.15-1.68 GB beyond its
weights and KV cache after warm-up on 8-16 GiB caps, of which the graph pools explain 0.22-0.28 GB; the rest was
reserved-but-free memory that empty_cache did not return, or allocations nobody has named. This benchmark names
them: per segment kind (graph pool or not, expandable or not, stream) the reserved, allocated and free bytes, and
the allocated bytes grouped by the first frame inside llm_core / transformers / bitsandbytes that made them.

    python -m bench.memory_breakdown --out "$OUT/breakdown.json" [--model llama-3-8b] [--positions 131072]
        [--card-gib 8] [--kv-cache int8] [--live-switch]

--live-switch reproduces bench.cards (cap first, expandable segments switched on in the live allocator); without
it the process starts as the app does (PYTORCH_CUDA_ALLOC_CONF set before CUDA is initialised). Raw snapshots are
written beside the JSON (open them at https://pytorch.org/memory_viz).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import sys
import time
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

GiB = 2**30
ALLOCATOR_STATS = ("reserved_bytes.all.current", "reserved_bytes.all.peak", "allocated_bytes.all.current",
                   "allocated_bytes.all.peak", "inactive_split_bytes.all.current", "segment.all.current",
                   "num_alloc_retries", "num_ooms", "num_device_alloc", "num_device_free")
OWNERS = ("llm_core/", "bench/", "transformers/", "bitsandbytes/", "accelerate/", "torch/_inductor/")


def owner_of(frames: Iterable[dict[str, Any]]) -> str:
    """The first frame (innermost first, as the snapshot lists them) in one of OWNERS: 'path:line name'."""
    for frame in frames:
        name = str(frame.get("filename", ""))
        for owner in OWNERS:
            i = name.find(owner)
            if i >= 0:
                return f"{name[i:]}:{frame.get('line')} {frame.get('name')}"
    return "(no python frame recorded)"


def summarize_snapshot(snapshot: dict[str, Any], *, top: int = 20) -> dict[str, Any]:
    """Segments by kind (graph pool or default pool, expandable or not, stream) with their reserved, allocated and
    free bytes and the largest free block; allocated blocks grouped by owner_of(frames), the largest `top`; and
    allocated block sizes that occur more than once per stream, by bytes held."""
    kinds: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    owners: dict[str, int] = defaultdict(int)
    sizes: dict[tuple[int, int], int] = defaultdict(int)  # (block size, stream) -> allocated blocks of that size
    for seg in snapshot.get("segments", []):
        pool = tuple(seg.get("segment_pool_id") or (0, 0))
        kind = (f"{'graph pool' if pool != (0, 0) else 'default'}"
                f"{' expandable' if seg.get('is_expandable') else ''} stream {seg.get('stream', 0)}")
        k = kinds[kind]
        k["segments"] += 1
        k["reserved"] += int(seg.get("total_size", 0))
        k["allocated"] += int(seg.get("allocated_size", 0))
        for block in seg.get("blocks", []):
            size = int(block.get("size", 0))
            if block.get("state") == "active_allocated":
                owners[owner_of(block.get("frames", []))] += size
                sizes[(size, int(seg.get("stream", 0)))] += 1
            elif block.get("state") == "inactive":
                k["largest_free_block"] = max(k["largest_free_block"], size)
    for k in kinds.values():
        k["free"] = k["reserved"] - k["allocated"]
    ranked = sorted(owners.items(), key=lambda kv: -kv[1])
    return {"by_segment_kind": {name: dict(v) for name, v in sorted(kinds.items())},
            "reserved": sum(v["reserved"] for v in kinds.values()),
            "allocated": sum(v["allocated"] for v in kinds.values()),
            "allocated_by_owner": dict(ranked[:top]),
            "allocated_by_other_owners": sum(size for _, size in ranked[top:]),
            # the block sizes that recur most (a cuBLAS workspace per thread and stream is one 32 MiB block on Hopper)
            "repeated_block_sizes": [{"bytes": size, "stream": stream, "count": n} for (size, stream), n in
                                     sorted(sizes.items(), key=lambda kv: -kv[0][0] * kv[1])[:top] if n > 1]}


def _neighbour(blocks: list[dict[str, Any]], j: int) -> str:
    """Who holds block j of a segment: its owner when allocated, else its state ('-' past either end)."""
    if not 0 <= j < len(blocks):
        return "-"
    if blocks[j].get("state") == "active_allocated":
        return owner_of(blocks[j].get("frames", []))
    return str(blocks[j].get("state"))


def summarize_free_blocks(snapshot: dict[str, Any], *, top: int = 15) -> dict[str, Any]:
    """The free blocks the allocator holds (take the snapshot after empty_cache: what it could not give back), by
    size band, and the largest `top` with the owners of the allocated blocks on either side (what pins them)."""
    bands = {"<2MiB": 2 << 20, "2-20MiB": 20 << 20, "20-100MiB": 100 << 20, ">=100MiB": 1 << 62}
    by_band: dict[str, dict[str, int]] = {name: {"count": 0, "bytes": 0} for name in bands}
    listed: list[dict[str, Any]] = []
    for seg in snapshot.get("segments", []):
        blocks = seg.get("blocks", [])
        for i, block in enumerate(blocks):
            if block.get("state") != "inactive":
                continue
            size = int(block.get("size", 0))
            band = next(name for name, limit in bands.items() if size < limit)
            by_band[band]["count"] += 1
            by_band[band]["bytes"] += size

            listed.append({"bytes": size, "expandable": bool(seg.get("is_expandable")),
                           "graph_pool": tuple(seg.get("segment_pool_id") or (0, 0)) != (0, 0),
                           "before": _neighbour(blocks, i - 1), "after": _neighbour(blocks, i + 1)})
    listed.sort(key=lambda b: -b["bytes"])
    return {"by_size": by_band, "largest": listed[:top]}


def table_bytes(model: Any) -> dict[str, int]:
    """Device bytes of the token table and the lm_head modules (a tied table counted under both names)."""
    out = {}
    for name, module in (("embedding", model.get_input_embeddings()), ("lm_head", model.get_output_embeddings())):
        seen = {t.data_ptr(): t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()]}
        out[name] = sum(seen.values())
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", default="llama-3-8b", choices=["llama-2-7b", "llama-3-8b"])
    parser.add_argument("--positions", type=int, default=131072)
    parser.add_argument("--card-gib", type=float, default=8)
    parser.add_argument("--kv-cache", default="int8", choices=["default", "bf16", "int8", "int4"],
                        help="default: KV_CACHE not set (the demo's own choice)")
    parser.add_argument("--prompt-words", type=int, default=2800)
    parser.add_argument("--live-switch", action="store_true")
    parser.add_argument("--no-pickles", action="store_true", help="write the JSON summaries only")
    parser.add_argument("--no-compact", action="store_true",
                        help="skip start-up's re-laying of the weights (llm_core.memory.compact), to compare")
    args = parser.parse_args(argv)
    if not args.live_switch:
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    import torch

    if not torch.cuda.is_available():
        print("bench.memory_breakdown needs a CUDA device", file=sys.stderr)
        return 2
    from bench.harness import make_random_checkpoint
    from llm_core.config import Settings
    from llm_core.engine.chat import ChatEngine
    from llm_core.loading import set_allocator_settings

    args.out.parent.mkdir(parents=True, exist_ok=True)
    folder = make_random_checkpoint(args.model, Path("/tmp/llm_core_breakdown") / f"{args.model}-{args.positions}",
                                    torch.device("cuda"), args.positions, tokenizer="word")
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, args.card_gib * GiB / total))
    if args.live_switch:
        set_allocator_settings("expandable_segments:True")
    torch.cuda.memory._record_memory_history(max_entries=100_000)
    env = {"MODEL_ID": str(folder), "VRAM_BUDGET": f"{args.card_gib - 0.5}GiB",
           "CACHE_DIR": "/tmp/llm_core_cache", "MAX_NEW_TOKENS": "64"}
    if args.kv_cache != "default":
        env["KV_CACHE"] = args.kv_cache
    result: dict[str, Any] = {"bench": "memory_breakdown", "command": "python -m bench.memory_breakdown "
                              + " ".join(argv if argv is not None else sys.argv[1:]), "args": vars(args) | {
                                  "out": str(args.out)},
                              "device": torch.cuda.get_device_name(0),
                              "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "(live switch)"),
                              "versions": {"torch": torch.__version__}}

    def snap(name: str, emptied: bool = False) -> None:
        torch.cuda.synchronize()
        if emptied:
            torch.cuda.empty_cache()
        raw = torch.cuda.memory._snapshot()
        if not args.no_pickles:
            (args.out.parent / f"{args.out.stem}-{name}.pickle").write_bytes(pickle.dumps(raw))
        stats = torch.cuda.memory_stats()
        result[name] = summarize_snapshot(raw) | {"free_blocks": summarize_free_blocks(raw), "emptied": emptied,
                                                 "max_reserved": torch.cuda.max_memory_reserved(),
                                                 "max_allocated": torch.cuda.max_memory_allocated(),
                                                 "allocator": {k: stats.get(k) for k in ALLOCATOR_STATS}}
        args.out.write_text(json.dumps(result, indent=1, default=str))

    # The start-up sizing's worst-reply profile is where the peak the budget is held to is taken: the allocator's
    # state right after each profile (reserved never shrinks within it) says what the reserved-but-free part is.
    from llm_core.fast.batched import SlotDecoder
    from llm_core.fast.generate import FastDecoder

    profiles: list[dict[str, int]] = []

    def wrap(cls: Any) -> None:
        original = cls.profile_worst_reply

        def profile_worst_reply(self: Any, *a: Any, **k: Any) -> dict[str, int]:
            peak = original(self, *a, **k)
            profiles.append(dict(peak))
            snap(f"after_worst_reply_{len(profiles)}")
            return peak
        cls.profile_worst_reply = profile_worst_reply

    wrap(SlotDecoder)
    wrap(FastDecoder)
    if args.no_compact:
        from llm_core.engine.startup import PathBuilder

        PathBuilder.compact_weights = lambda self: None  # type: ignore[method-assign]

    t0 = time.perf_counter()
    try:
        engine = ChatEngine.load(Settings.from_env(environ=env, env_file=None))
    except Exception as exc:  # noqa: BLE001 - a start-up failure is a result: where the memory was when it failed
        result["startup_error"] = f"{type(exc).__name__}: {exc}"[:500]
        snap("after_failed_startup")
        return 1
    decoder = engine.fast_decoder
    result["startup"] = {"load_s": round(time.perf_counter() - t0, 1), "decode_path": engine.backend.name,
                         "static_cache_tokens": decoder.cache_len if decoder else None,
                         "resident_extra_bytes": engine.memory_facts.resident_extra_bytes,
                         "weights_bytes": engine.memory_facts.weights_bytes,
                         "token_table_bytes": table_bytes(engine.loaded.model),
                         "token_tables": engine.loaded.extra.get("token_tables"),
                         "fast_memory_profile": engine.fast_memory_profile,
                         "graph_pool_idle_bytes": decoder.graph_pool_idle_bytes() if decoder else None,
                         "context_limit": engine.context_limit, "reason": engine.backend.reason,
                         "worst_reply_profiles": profiles, "startup_notes": list(engine.path.notes),
                         "compacted": not args.no_compact}
    snap("after_startup")
    snap("after_startup_emptied", emptied=True)
    torch.cuda.reset_peak_memory_stats()
    text = " ".join(f"t{(i * 7919) % 500 + 3}" for i in range(args.prompt_words))
    try:
        updates = list(engine.stream_chat(text, [], gen=engine.request_options(max_new_tokens=64)))
        stats = updates[-1].stats if updates else None
        result["turn"] = {"prompt_tokens": stats.prompt_tokens if stats else None,
                          "dropped_turns": stats.dropped_turns if stats else None,
                          "peak_vram_allocated_bytes": stats.peak_vram_allocated_bytes if stats else None,
                          "peak_vram_reserved_bytes": stats.peak_vram_reserved_bytes if stats else None,
                          "predicted_peak_bytes": stats.predicted_peak_bytes if stats else None}
    except Exception as exc:  # noqa: BLE001 - recorded
        result["turn"] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
    snap("after_turn")
    print(json.dumps({k: result[k] for k in ("startup", "turn") if k in result}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
