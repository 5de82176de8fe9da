"""Concurrency benchmark: N concurrent chats through ChatEngine with batched decoding vs one chat alone on
the same build; aggregate decode tokens/s, TTFT (p50/p95) and peak memory against the budget; one JSON document.

GPU (one call; about 3-5 minutes on an H200, most of it writing and quantizing the random 7B checkpoint):
    pip install --no-deps --no-index .whl/bitsandbytes-0.50.2-py3-none-manylinux_2_24_x86_64.whl -q
    python -m bench.concurrency_bench --out "$OUT/concurrency.json" [--budget-gib 8] [--serial-baseline]
CPU smoke (a tiny random llama, about a minute on two cores):
    python -m bench.concurrency_bench --cpu-smoke --out /tmp/concurrency-smoke.json

What it runs
  model    a random-weight Llama-2-7B-shaped checkpoint (bf16, written once to --ckpt), loaded through llm_core's own
           loader in NF4 + double quant, with a byte-level tokenizer and a ChatML template written next to it (the GPU
           machine has no hub; random weights make the text meaningless, the costs are real).
  single   the batched build (MAX_BATCH_SIZE=--chats) serving one chat alone: --new-tokens tokens, --single-runs runs.
  batch    --chats chats started together (different prompts, --new-tokens each), each in its own thread, as
           Gradio's workers would call the engine.
  serial   (--serial-baseline) the engine reloaded with MAX_BATCH_SIZE=1 and DECODE_PATH=auto (the fast path where it
           runs): its single-chat figure, for the ratio against the build's best single-chat speed.

Numbers (definitions as in llm_core.metrics: TTFT = request received -> first token on the host; decode tokens/s =
(new - 1) / (last token - first token))
  aggregate_decode_tokens_per_s   sum over chats of (new_tokens - 1) / (latest last token - earliest first token)
  aggregate_end_to_end_tokens_per_s   sum of new tokens / (last reply done - first request sent): prefills included
  speedup_vs_single                aggregate_decode_tokens_per_s / the single chat's decode tokens/s (same build)
  ttft_p50_s / ttft_p95_s          over the concurrent chats (nearest rank)
  peak_vram_*_bytes                torch.cuda max allocated / reserved over the concurrent phase (reset before it),
                                   against budget_bytes (llm_core.memory.default_budget_bytes, capped by --budget-gib)
With random weights a chat can end early on the EOS id (p = 1/vocab per token); counts are what ran.
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

import torch

from bench import memory_bench
from bench.harness import Recorder, make_random_checkpoint, percentile
from llm_core.config import Settings
from llm_core.engine.chat import ChatEngine, ReplyUpdate
from llm_core.memory.budget import default_budget_bytes
from llm_core.memory.device import free_memory
from llm_core.memory.model import GiB

# memory_bench's model shapes, with this benchmark's context length
LLAMA2_7B: dict[str, Any] = dict(memory_bench.LLAMA2_7B, max_position_embeddings=4096)
TINY: dict[str, Any] = dict(memory_bench.TINY, max_position_embeddings=4096)
TOPICS = ["the moon", "bread", "rivers", "chess", "volcanoes", "owls", "trains", "glass", "salt", "wind", "iron",
          "maps", "bees", "clocks", "ice", "paper"]


def prompt(i: int) -> str:
    topic = TOPICS[i % len(TOPICS)]
    return (f"Chat {i}: tell me a long, detailed story about {topic}, with three characters, a journey and a "
            f"surprising ending. Use plain words.")


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.smoke = args.cpu_smoke
        self.device = torch.device("cpu" if self.smoke else "cuda")
        self.shape = TINY if self.smoke else LLAMA2_7B
        self.ckpt = Path(args.ckpt or f"/tmp/concurrency-bench-{'tiny' if self.smoke else 'llama2-7b'}-random")
        self.out = Path(args.out)
        self.t0 = time.perf_counter()
        import transformers

        meta: dict[str, Any] = {
            "torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
            "command": " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]),
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "device": torch.cuda.get_device_name(0) if self.device.type == "cuda" else "cpu",
            "model": "tiny-llama-random" if self.smoke else "llama-2-7b-shape-random",
            "quantization": args.quantization, "chats": args.chats, "new_tokens": args.new_tokens,
        }
        try:
            import bitsandbytes as bnb

            meta["bitsandbytes"] = bnb.__version__
        except ImportError:
            meta["bitsandbytes"] = "missing"
        self.rec = Recorder(self.out, meta)
        self.record, self.summary = self.rec.add, self.rec.set_summary

    # --- engine ------------------------------------------------------------------------------------------------
    def settings(self, max_batch_size: int) -> Settings:
        environ = {"MODEL_ID": str(self.ckpt), "QUANTIZATION": self.args.quantization,
                   "DEVICE": self.device.type, "MAX_BATCH_SIZE": str(max_batch_size),
                   "MAX_NEW_TOKENS": str(self.args.new_tokens), "STREAM_TIMEOUT_S": "300"}
        if max_batch_size > 1:
            environ["DECODE_PATH"] = "auto"  # the batched path replaces it; auto keeps the settings consistent
        return Settings.from_env(environ=environ, env_file=None)

    def load(self, max_batch_size: int) -> ChatEngine:
        t = time.perf_counter()
        engine = ChatEngine.load(self.settings(max_batch_size), progress=lambda m: print(m, flush=True))
        self.record(phase="load", max_batch_size=max_batch_size, decode_path=engine.backend.name,
                    decode_path_reason=engine.backend.reason, load_s=round(time.perf_counter() - t, 1),
                    weights_bytes=engine.report.weights_bytes, warmup_s=engine.report.warmup_s,
                    kv_budget_bytes=engine.scheduler.runner.kv_budget_bytes if engine.scheduler else None)
        return engine

    def chat(self, engine: ChatEngine, i: int, request_id: str) -> tuple[ReplyUpdate, float, float]:
        gen = engine.request_options(max_new_tokens=self.args.new_tokens)
        sent = time.perf_counter()
        last = deque(engine.stream_chat(prompt(i), [], gen=gen, request_id=request_id), maxlen=1)[0]
        return last, sent, time.perf_counter()

    def single(self, engine: ChatEngine, label: str) -> dict[str, Any]:
        runs = []
        for r in range(self.args.single_runs):
            last, _, _ = self.chat(engine, r, f"single-{label}-{r}")
            s = last.stats
            runs.append(self.record(phase="single", build=label, run=r, new_tokens=s.new_tokens,
                                    prompt_tokens=s.prompt_tokens, ttft_s=s.ttft_s,
                                    decode_tokens_per_s=s.decode_tokens_per_s, decode_path=s.decode_path,
                                    finish_reason=s.finish_reason))
        rates = [r["decode_tokens_per_s"] for r in runs if r["decode_tokens_per_s"]]
        return {"decode_tokens_per_s": max(rates) if rates else None,
                "ttft_s": min(r["ttft_s"] for r in runs if r["ttft_s"] is not None)}

    def concurrent(self, engine: ChatEngine) -> dict[str, Any]:
        n = self.args.chats
        results: list[tuple[ReplyUpdate, float, float] | BaseException | None] = [None] * n
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = threading.Barrier(n)

        def run(i: int) -> None:
            try:
                start.wait(timeout=60)
                results[i] = self.chat(engine, i, f"chat-{i}")
            except BaseException as exc:  # recorded below; one failure must not hide the others' numbers
                results[i] = exc

        threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(n)]
        for t in threads:
            t.start()
        deadline = time.perf_counter() + self.args.phase_timeout_s
        for t in threads:
            t.join(max(0.0, deadline - time.perf_counter()))
        peak_alloc = peak_reserved = None
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            peak_alloc, peak_reserved = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
        done = [r for r in results if isinstance(r, tuple)]
        failed = [f"{type(r).__name__}: {r}" if isinstance(r, BaseException) else "timed out" for r in results
                  if not isinstance(r, tuple)]
        for i, r in enumerate(results):
            if isinstance(r, tuple):
                s = r[0].stats
                self.record(phase="concurrent", chat=i, new_tokens=s.new_tokens, prompt_tokens=s.prompt_tokens,
                            ttft_s=s.ttft_s, decode_tokens_per_s=s.decode_tokens_per_s,
                            end_to_end_s=s.end_to_end_s, finish_reason=s.finish_reason,
                            kv_cache_bytes=s.kv_cache_bytes)
        out: dict[str, Any] = {"completed": len(done), "failed": failed}
        if done:
            first_token = [r[1] + (r[0].stats.ttft_s or 0.0) for r in done]
            last_token = [r[1] + (r[0].stats.ttft_s or 0.0) + (r[0].stats.decode_s or 0.0) for r in done]
            span = max(last_token) - min(first_token)
            decoded = sum(max(0, r[0].stats.new_tokens - 1) for r in done)
            wall = max(r[2] for r in done) - min(r[1] for r in done)
            ttfts = [r[0].stats.ttft_s for r in done if r[0].stats.ttft_s is not None]
            out.update(
                new_tokens=sum(r[0].stats.new_tokens for r in done),
                aggregate_decode_tokens_per_s=decoded / span if span > 0 else None,
                aggregate_end_to_end_tokens_per_s=sum(r[0].stats.new_tokens for r in done) / wall if wall else None,
                ttft_p50_s=percentile(ttfts, 50), ttft_p95_s=percentile(ttfts, 95), ttft_max_s=max(ttfts),
                per_chat_decode_tokens_per_s=[r[0].stats.decode_tokens_per_s for r in done],
                peak_vram_allocated_bytes=peak_alloc, peak_vram_reserved_bytes=peak_reserved,
            )
        if engine.scheduler is not None:
            snap = engine.scheduler.snapshot()
            out["scheduler"] = {"max_rows_in_step": snap.max_rows_in_step,
                                "mean_rows_per_step": round(snap.mean_rows_per_step, 2),
                                "decode_steps": snap.decode_steps, "prefills": snap.prefills,
                                "waited_for_memory": snap.waited_for_memory, "kv_budget_bytes": snap.kv_budget_bytes,
                                "errors": snap.errors}
        return out

    # --- run ---------------------------------------------------------------------------------------------------
    def run(self) -> None:
        args = self.args
        made_s = 0.0
        if not (self.ckpt / "config.json").is_file():
            t_made = time.perf_counter()
            make_random_checkpoint(self.shape, self.ckpt, self.device, int(self.shape["max_position_embeddings"]),
                                   tokenizer="chatml")
            made_s = time.perf_counter() - t_made
        # The cap applies to serving, after the bf16/fp32 random checkpoint was written (it needs ~27 GB).
        if self.device.type == "cuda" and args.budget_gib:
            total = torch.cuda.get_device_properties(0).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, args.budget_gib * GiB / total))
        self.summary(checkpoint_s=round(made_s, 1), checkpoint=str(self.ckpt))
        engine = self.load(args.chats)
        budget = default_budget_bytes(self.device, margin_bytes=0) if self.device.type == "cuda" else None
        single = self.single(engine, "batched")
        together = self.concurrent(engine)
        rate = together.get("aggregate_decode_tokens_per_s")
        summary: dict[str, Any] = {
            "single_chat_decode_tokens_per_s": single["decode_tokens_per_s"], "single_chat_ttft_s": single["ttft_s"],
            **{k: v for k, v in together.items() if k != "per_chat_decode_tokens_per_s"},
            "speedup_vs_single": rate / single["decode_tokens_per_s"] if rate and single["decode_tokens_per_s"]
            else None,
            "budget_bytes": budget,
        }
        if budget is not None and together.get("peak_vram_reserved_bytes") is not None:
            summary["within_budget"] = together["peak_vram_reserved_bytes"] <= budget
        summary["meets_4x"] = bool(summary["speedup_vs_single"] and summary["speedup_vs_single"] >= 4.0)
        self.summary(**summary)
        engine.close()
        del engine
        free_memory(self.device)
        if args.serial_baseline:
            serial = self.load(1)
            base = self.single(serial, "serial")
            self.summary(serial_decode_path=serial.backend.name,
                         serial_single_chat_decode_tokens_per_s=base["decode_tokens_per_s"],
                         serial_single_chat_ttft_s=base["ttft_s"],
                         speedup_vs_serial_single=rate / base["decode_tokens_per_s"]
                         if rate and base["decode_tokens_per_s"] else None)
        self.summary(total_s=round(time.perf_counter() - self.t0, 1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "/tmp"), "concurrency.json"))
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny random llama on CPU")
    parser.add_argument("--chats", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=None, help="default 128 (GPU) / 16 (CPU smoke)")
    parser.add_argument("--single-runs", type=int, default=2)
    parser.add_argument("--quantization", default="nf4")
    parser.add_argument("--budget-gib", type=float, default=None,
                        help="cap the process with torch.cuda.set_per_process_memory_fraction (GPU)")
    parser.add_argument("--serial-baseline", action="store_true",
                        help="also reload with MAX_BATCH_SIZE=1 (fast path where it runs) for its single-chat figure")
    parser.add_argument("--ckpt", default=None, help="random checkpoint folder (written when missing)")
    parser.add_argument("--phase-timeout-s", type=float, default=400.0)
    args = parser.parse_args(argv)
    if args.new_tokens is None:
        args.new_tokens = 16 if args.cpu_smoke else 128
    if not args.cpu_smoke and not torch.cuda.is_available():
        parser.error("no CUDA device: use --cpu-smoke")
    Bench(args).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
