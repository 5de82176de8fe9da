"""Where the fast path's time to first token goes: the prefill timed by calling thread, prompt length and SDPA
backend, next to the engine's own TTFT.

Why: in the compare-vs-bench runs (bench/results/2026-11-30-h200-compare.json) a reply through ChatEngine took
57-80 ms longer to its first token than the same call from bench.decode, all of it inside the worker thread
before the first token. Suspect: cuDNN attention, whose execution plans PyTorch caches per thread and per shape,
so each new thread and each new prompt length builds one inside the reply. FastDecodeOptions.prefill_attention
("flash", the default, or "auto" = PyTorch's choice) is measured both ways on the same loaded model.

    python -m bench.ttft_probe --random llama-2-7b --out ttft.json     (GPU; writes JSON)

Per backend choice: prefill seconds (device synchronized before and after) on the main thread, on a new
thread each call, on one long-lived thread, at new prompt lengths (first call at each length), and the engine's
ReplyStats.ttft_s for whole replies; plus the attention kernels a prefill launches (torch.profiler).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from bench.compare_bench import prompt_ids, prompt_text
from bench.harness import RANDOM_ARCHS, make_random_checkpoint, sync
from bench.probes import prefill_only, time_decode_steps
from llm_core.config import Settings
from llm_core.engine.chat import ChatEngine
from llm_core.engine.runners import FastBackend
from llm_core.fast import FastDecoder
from llm_core.loading import library_versions


def timed_prefill(decoder: FastDecoder, ids: torch.Tensor) -> float:
    sync(ids.device)
    t0 = time.perf_counter()
    prefill_only(decoder, ids)
    sync(ids.device)
    return time.perf_counter() - t0


def on_new_thread(fn: Callable[[], float]) -> float:
    box: list[float] = []
    t = threading.Thread(target=lambda: box.append(fn()))
    t.start()
    t.join()
    return box[0]


class LongThread:
    def __init__(self) -> None:
        self.jobs: list[Any] = []
        self.cv = threading.Condition()
        threading.Thread(target=self.loop, daemon=True).start()

    def loop(self) -> None:
        while True:
            with self.cv:
                while not self.jobs:
                    self.cv.wait()
                fn, box, done = self.jobs.pop(0)
            box.append(fn())
            done.set()

    def call(self, fn: Callable[[], float]) -> float:
        box: list[float] = []
        done = threading.Event()
        with self.cv:
            self.jobs.append((fn, box, done))
            self.cv.notify()
        done.wait()
        return box[0]


def attention_kernels(decoder: FastDecoder, ids: torch.Tensor) -> list[dict[str, Any]]:
    from torch.profiler import ProfilerActivity, profile

    if ids.device.type != "cuda":
        return []
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        timed_prefill(decoder, ids)
    rows = []
    for ev in prof.key_averages():
        name = ev.key.lower()
        if any(s in name for s in ("attn", "attention", "fmha", "flash", "cudnn", "sdpa", "softmax")):
            rows.append({"kernel": ev.key[:160], "calls": ev.count,
                         "device_us": round(getattr(ev, "device_time_total", getattr(ev, "cuda_time_total", 0)), 1)})
    return rows


def probe(decoder: FastDecoder, ids: torch.Tensor, lengths: list[int], repeats: int) -> dict[str, Any]:
    base = ids.numel()
    out: dict[str, Any] = {"first_call_main_s": timed_prefill(decoder, ids)}
    out["main_thread_s"] = [timed_prefill(decoder, ids) for _ in range(repeats)]
    out["new_thread_each_s"] = [on_new_thread(lambda: timed_prefill(decoder, ids)) for _ in range(repeats)]
    worker = LongThread()
    out["long_lived_thread_s"] = [worker.call(lambda: timed_prefill(decoder, ids)) for _ in range(repeats + 1)]
    out["new_length_first_call_s"] = {}
    for n in lengths:
        part = torch.cat([ids, ids])[:n] if n > base else ids[:n]
        first = timed_prefill(decoder, part)
        again = timed_prefill(decoder, part)
        out["new_length_first_call_s"][str(n)] = {"first": first, "again": again}
    out["attention_kernels"] = attention_kernels(decoder, ids)
    for key in ("main_thread_s", "new_thread_each_s", "long_lived_thread_s"):
        out[key.replace("_s", "_median_s")] = statistics.median(out[key])
    return out


def load_engine(arch: str, quantization: str, positions: int, device: torch.device, work_dir: Path,
                prefill_graph_tokens: int | None = None) -> tuple[ChatEngine, Settings]:
    """The demo's engine on a random-weight checkpoint of `arch` (made once per work dir and context length)."""
    folder = work_dir / f"ckpt-{arch}-ctx{positions}"
    if not (folder / "config.json").is_file():
        make_random_checkpoint(arch, folder, device, positions)
    environ = {"MODEL_ID": str(folder), "QUANTIZATION": quantization, "DEVICE": device.type,
               "CACHE_DIR": str(work_dir / "cache"), "MAX_BATCH_SIZE": "1",
               "DECODE_PATH": "auto" if device.type == "cuda" else "fast",
               "MAX_NEW_TOKENS": "64", "DO_SAMPLE": "false", "REPETITION_PENALTY": "1.0", "HISTORY_TURNS": "0"}
    if prefill_graph_tokens is not None:  # else the setting's default
        environ["PREFILL_GRAPH_TOKENS"] = str(prefill_graph_tokens)
    settings = Settings.from_env(environ=environ, env_file=None)
    return ChatEngine.load(settings), settings


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--random", default="llama-2-7b", choices=sorted(RANDOM_ARCHS))
    ap.add_argument("--quantization", default="nf4")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--lengths", type=int, nargs="+", default=[500, 520, 600])
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of this script (tiny model, eager)")
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp/bench"))
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    device = torch.device(args.device)
    t0 = time.perf_counter()
    engine, settings = load_engine(args.random, args.quantization, args.prompt_tokens + 192, device, args.work_dir)
    result: dict[str, Any] = {
        "title": "Fast-path TTFT probe: prefill by thread, prompt length and SDPA backend",
        "command": " ".join(sys.argv),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "versions": library_versions(),
        "engine_load_s": round(time.perf_counter() - t0, 2), "decode_path": engine.backend.name,
        "decode_path_reason": engine.backend.reason, "prompt_tokens": args.prompt_tokens, "choices": {}}
    vocab = int(RANDOM_ARCHS[args.random]["vocab_size"])
    words = prompt_ids(vocab, args.prompt_tokens)
    text = prompt_text(words)
    ids = torch.tensor(words, device=device)
    gen = replace(settings.generation, max_new_tokens=32, min_new_tokens=32).validate()
    engine_decoder = engine.fast_decoder
    for choice in ("flash", "auto"):
        t1 = time.perf_counter()
        if choice == engine_decoder.options.prefill_attention:
            decoder = engine_decoder
        else:  # a second decoder on the same weights, warmed (compiled) under this choice
            torch._dynamo.reset()
            decoder = FastDecoder(engine.loaded, max_cache_len=engine_decoder.max_cache_len,
                                  options=replace(engine_decoder.options, prefill_attention=choice))
            decoder.warmup()
            engine.path = replace(engine.path, backend=FastBackend(decoder, engine.backend.reason))
        rec: dict[str, Any] = {"setup_s": round(time.perf_counter() - t1, 2)}
        ttfts = []
        for _ in range(args.repeats + 1):  # the first reply at this length is listed, not left out
            final = None
            for update in engine.stream_chat(text, [], gen=gen, history_turns=0, system_prompt=None):
                final = update
            assert final is not None and final.done
            ttfts.append(final.stats.ttft_s)
        rec["engine_reply_ttft_s"] = ttfts
        rec["engine_reply_ttft_median_s"] = statistics.median(ttfts[1:])
        rec.update(probe(decoder, ids, args.lengths, args.repeats))
        steps = [time_decode_steps(decoder, args.prompt_tokens, 64) for _ in range(3)]  # graph replays, no host reads
        rec["decode_step_s"] = steps
        rec["decode_tokens_per_s_from_steps"] = 1.0 / statistics.median(steps)
        rec["gemv"] = decoder.options.gemv
        rec["gemv_timings_us"] = getattr(decoder, "gemv_timings_us", None)
        rec["dense_gemv_timings_us"] = getattr(decoder, "dense_gemv_timings_us", None)
        result["choices"][choice] = rec
        args.out.write_text(json.dumps(result, indent=1, default=str))
        print(choice, json.dumps({k: v for k, v in rec.items()
                                  if "median" in k or k in ("attention_kernels", "decode_tokens_per_s_from_steps")}),
              flush=True)
    result["wall_s"] = round(time.perf_counter() - t_start, 1)
    args.out.write_text(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
