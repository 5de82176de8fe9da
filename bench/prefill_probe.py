"""Is the fast path's prefill bound by the GPU or by the host launching it? Times the same prefill two ways.

- as replies run it: CUDA events around FastDecoder._prefill (device wall time, idle gaps included) and the host
  time until _prefill returns;
- behind a busy GPU: a ~`--sleep-ms` spin kernel (torch.cuda._sleep) is queued first, so the host can launch the
  whole prefill before the GPU reaches it; the events then time the kernels back to back (pure device time), and
  the host time is the launch cost alone, unless something in the prefill waits for the GPU (then it includes the
  spin).

Device time of the first way minus the second is what the GPU spent waiting for the host.

    python -m bench.prefill_probe --quantization none --out prefill.json      (GPU)
    python -m bench.prefill_probe --device cpu --out /tmp/prefill.json        (CPU smoke: host times only)
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

from bench.probes import prefill_only
from bench.ttft_probe import load_engine
from llm_core.loading import library_versions


def spin_cycles_per_ms(device: torch.device) -> int:
    """Clock cycles of torch.cuda._sleep per millisecond on this GPU (measured)."""
    cycles = 10_000_000
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    stop.record()
    stop.synchronize()
    return int(cycles / max(start.elapsed_time(stop), 1e-3))


def time_prefill(decoder: Any, ids: torch.Tensor, sleep_cycles: int) -> dict[str, float | None]:
    cuda = ids.device.type == "cuda"
    decoder.sync()
    events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if cuda else None
    if cuda and sleep_cycles:
        torch.cuda._sleep(sleep_cycles)
    t0 = time.perf_counter()
    if events is not None:
        events[0].record()
    prefill_only(decoder, ids)
    if events is not None:
        events[1].record()
    host = time.perf_counter() - t0
    decoder.sync()
    total = time.perf_counter() - t0
    gpu = events[0].elapsed_time(events[1]) / 1e3 if events is not None else None
    return {"host_launch_s": host, "device_s": gpu, "until_done_s": total}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--random", default="llama-2-7b")
    ap.add_argument("--quantization", default="none")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--sleep-ms", type=float, default=60.0)
    ap.add_argument("--prefill-graph-tokens", type=int, default=None,
                    help="PREFILL_GRAPH_TOKENS (0 = compiled prefill; default: the setting's default)")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run (tiny model, eager)")
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp/bench"))
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    arch = args.random if device.type == "cuda" else "tiny"
    prompt = args.prompt_tokens if device.type == "cuda" else 32
    t0 = time.perf_counter()
    engine, _ = load_engine(arch, args.quantization, prompt + 192, device, args.work_dir, args.prefill_graph_tokens)
    decoder = engine.fast_decoder
    if decoder is None:
        raise SystemExit(f"no fast path: {engine.backend.reason}")
    ids = torch.randint(3, 500, (prompt,), generator=torch.Generator().manual_seed(0)).to(device)
    cycles = int(args.sleep_ms * spin_cycles_per_ms(device)) if device.type == "cuda" else 0
    time_prefill(decoder, ids, 0)  # first call at this length
    rows: dict[str, list[dict[str, float | None]]] = {"as_replies_run_it": [], "behind_a_busy_gpu": []}
    for _ in range(args.repeats):
        rows["as_replies_run_it"].append(time_prefill(decoder, ids, 0))
        rows["behind_a_busy_gpu"].append(time_prefill(decoder, ids, cycles))

    def med(rs: list[dict[str, float | None]], key: str) -> float | None:
        vals = [float(v) for r in rs if (v := r[key]) is not None]
        return statistics.median(vals) if vals else None

    result = {
        "title": "Prefill: device time as replies run it vs behind a busy GPU (host launch cost)",
        "command": " ".join(sys.argv), "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "versions": library_versions(), "quantization": args.quantization, "prompt_tokens": prompt,
        "decode_path_reason": engine.backend.reason, "load_s": round(time.perf_counter() - t0, 1),
        "sleep_ms": args.sleep_ms, "spin_cycles": cycles, "prefill_graphs": decoder.describe()["prefill_graphs"],
        "graph_pool_idle_bytes": decoder.graph_pool_idle_bytes(),
        "resident_extra_bytes": engine.memory_facts.resident_extra_bytes,
        "allocated_bytes": torch.cuda.memory_allocated(device) if device.type == "cuda" else None,
        "reserved_bytes": torch.cuda.memory_reserved(device) if device.type == "cuda" else None,
        "summary": {mode: {key: med(rs, key) for key in ("host_launch_s", "device_s", "until_done_s")}
                    for mode, rs in rows.items()},
        "runs": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["summary"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
