"""Batched fast path benchmark: N concurrent chats through ChatEngine (every reply a row of the batched
fast step), beside transformers' own batched `generate` on the same loaded model in the same run; one JSON document.

GPU (one call; the random checkpoint is written once to --ckpt):
    python -m bench.batched --out "$OUT/batched.json" [--chats 1,8,32] [--arch llama-2-7b] [--quantization nf4]
        [--kv-layout slots|paged] [--prefill group|each|both]
CPU smoke (a tiny random llama, fp32, seconds):
    python -m bench.batched --smoke --out /tmp/batched-smoke.json

Load: --chats N chats started together (a barrier), each in its own thread as Gradio's workers call the engine; each
prompt is --prompt-tokens tokens (the chat template included), each reply exactly --new-tokens tokens
(min_new_tokens = max_new_tokens: EOS cannot end a random-weight reply early). Greedy. Every phase (each N, each
--prefill mode) has prompts of its own, so no phase finds another's prompt in the paged pool's prefix cache.
--prefill (paged): how newcomers that reach an idle loop together are prefilled: "group" (the default: padded groups
in one pass each), "each" (one pass per prompt, from its whole-prompt prefill graph where one serves it:
FastRunner(group_prefill=False)), "both" (each N twice, group first); the record's `prefill` says which.
--profile-chats N: then N chats arriving together under torch.profiler once per mode ("profile-arrivals" records:
the device's kernels over the run against its TTFTs: is the newcomers' prefill bound by the device or the host?).

Records (recipe "ours" and "transformers-generate"), definitions as in llm_core.metrics (TTFT = request received ->
first token on the host; a chat's decode tokens/s = (new - 1) / (last token - first token)):
  aggregate_decode_tokens_per_s   sum over chats of (new - 1) / (latest last token - earliest first token)
  per_chat_decode_tokens_per_s    {min, median} over the chats
  ttft_p50_s / ttft_p95_s         nearest rank over the chats
  peak_vram_bytes                 ours: the largest per-reply peak (the batch's peak during the reply, ReplyStats);
                                  reference: torch.cuda.max_memory_allocated over its generate (reset before)
  step profile (ours)             decode steps, mean host time per step (launch to tokens on the host), rows per
                                  step, steps per batch bucket, prefill chunks
  timeline (ours)                 the loop's ops from the first request on (BatchStats.timeline): op (prefill_rows,
                                  prefill_whole, prefill, run_step), rows, host start (ms from the first request)
                                  and host time; a gap is the loop's own time (admission, first tokens)
Reference: the same prompt ids left-padded into one `model.generate(..., do_sample=False, min_new_tokens=n,
max_new_tokens=n)`; its TTFT is a separate generate of 1 new token on the same batch (prefill + first token), and its
aggregate = chats x (n - 1) / (full generate - that first-token time).
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import statistics
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

import torch

from bench.harness import RANDOM_ARCHS, Recorder, checkpoint_ready, make_random_checkpoint, percentile
from bench.host_probe import HOST_VARIANTS, StepProbe, host_variant
from llm_core.config import Settings
from llm_core.engine.chat import ChatEngine, ReplyUpdate
from llm_core.fast.rows import RowsPlan

CONTEXT_TOKENS = 4096


def restrict_gemv_configs(which: str) -> None:
    """--gemv-configs: this process's NF4 one-token autotuner gets other configs (plain: nf4_gemv.CONFIGS without a
    load pipeline, made by the module's own nf4_gemv.gemv_configs); all: the library's, unchanged (bench-only)."""
    from llm_core.fast.kernels import nf4_gemv

    tuner = nf4_gemv.AUTOTUNER
    if tuner is None or which == "all":
        return
    tuner.configs = nf4_gemv.gemv_configs([c for c in nf4_gemv.CONFIGS if not c[3]])


def set_mm_split_sum(which: str) -> None:
    """--mm-split-sum: how this process's small-M NF4 kernel sums its K splits; rule: the library's launch rule
    (inside the launch at 5-16 rows, nf4_mm.FUSE_ROWS; a second kernel otherwise); fused: inside the launch at every
    row count (the library's rule on 2026-12-07 before its third session); kernel: a second kernel (_sum_splits) at
    every row count, as before 2026-12-07 (bench-only: the launch rule patched in this process, for the A/B through
    the engine)."""
    from llm_core.fast.kernels import nf4_mm

    if which == "rule":
        return
    rule = nf4_mm.default_config

    def patched(m: int, n: int, k: int, sms: int = 132) -> nf4_mm.MMConfig:
        return rule(m, n, k, sms).replace(fuse_splits=which == "fused")

    nf4_mm.default_config = patched  # type: ignore[assignment]


def set_attention_launches(items: list[str]) -> dict[str, str]:
    """--attention-launch FORMAT:ROWS=NAME (repeatable): this process's decode attention takes the launch NAME
    (bench.attention_rows' names, l<block_l>-w<warps>-s<stages or d>-p<programs per SM>) for that format and rows
    bucket of ATTENTION_LAUNCHES, e.g. int8:64=l64-w4-s2-p4 (bench-only: for an A/B of a sweep's suggestion through
    the engine in the sweep's own lease). Returns what was set, for the record."""
    from llm_core.fast.kernels import attention

    done = {}
    for item in items:
        key, _, name = item.partition("=")
        fmt, _, rows = key.partition(":")
        parts = dict((p[0], p[1:]) for p in name.split("-")) if name else {}
        if (fmt not in attention.ROW_FORMATS or not rows.isdigit() or int(rows) not in attention.LAUNCH_ROW_BUCKETS
                or set(parts) != set("lwsp")):
            raise SystemExit(f"--attention-launch takes FORMAT:ROWS=l<n>-w<n>-s<n|d>-p<n> with FORMAT in "
                             f"{attention.ROW_FORMATS} and ROWS in {attention.LAUNCH_ROW_BUCKETS}, not {item!r}")
        launch = attention.AttentionLaunch(block_l=int(parts["l"]), num_warps=int(parts["w"]),
                                           num_stages=None if parts["s"] == "d" else int(parts["s"]),
                                           programs_per_sm=int(parts["p"]))
        attention.ATTENTION_LAUNCHES[(fmt, int(rows))] = launch
        done[key] = name
    return done


def set_frag_config(spec: str) -> dict[str, int]:
    """--frag-config FIELD=N,...: this process's nf4_frag launches (the engine's op with NF4_FRAG on) take
    default_config with these FragConfig fields replaced, e.g. depth=2,early=1 (bench-only: an A/B of a kernel
    sweep's best form through the engine in the sweep's own lease). Returns what was set, for the record."""
    import dataclasses

    from llm_core.fast.kernels import nf4_frag

    if not spec:
        return {}
    fields = {f.name for f in dataclasses.fields(nf4_frag.FragConfig)} - {"table_regs", "scale_pairs"}
    done: dict[str, int] = {}
    for item in spec.split(","):
        name, _, value = item.partition("=")
        if name not in fields or not value.isdigit():
            raise SystemExit(f"--frag-config takes FIELD=N with FIELD in {sorted(fields)}, not {item!r}")
        done[name] = int(value)
    rule = nf4_frag.default_config
    kinds = {f.name: f.type for f in dataclasses.fields(nf4_frag.FragConfig)}

    def patched(n: int, k: int, sms: int = 132, m: int = 8) -> Any:
        return dataclasses.replace(rule(n, k, sms, m), **{key: bool(v) if kinds[key] in (bool, "bool") else v
                                                        for key, v in done.items()})

    nf4_frag.default_config = patched  # type: ignore[assignment]
    return done


LETTERS = "abcdefghijklmnopqrstuvwxyz"


def prompt_text(engine: ChatEngine, i: int, tokens: int) -> str:
    """A user message whose chat-templated prompt is `tokens` tokens (or the nearest below), different per chat."""
    base = f"chat {i}: " + " ".join(LETTERS[(i + j) % 26] * (1 + (i + j) % 5) for j in range(4 * tokens))

    def count(n: int) -> int:
        return engine.count_tokens([{"role": "user", "content": base[:n]}])

    lo, hi = 1, len(base)
    while lo < hi:  # the longest prefix whose prompt fits `tokens`
        mid = (lo + hi + 1) // 2
        if count(mid) <= tokens:
            lo = mid
        else:
            hi = mid - 1
    return base[:lo]



def mixed_load(n: int, over_s: float, longest: int, shortest: int = 128) -> tuple[list[int], list[float]]:
    """n prompts from `shortest` to `longest` tokens (log-spaced, so most are short as chat messages are) and their
    arrival times spread evenly over `over_s` seconds, the lengths in an order that mixes long and short arrivals
    (a fixed interleave of the sorted list: the same load every run)."""
    if n == 1:
        return [shortest], [0.0]
    ratio = longest / shortest
    sizes = [round(shortest * ratio ** (i / (n - 1))) for i in range(n)]
    order = [i // 2 if i % 2 == 0 else n - 1 - i // 2 for i in range(n)]  # short, long, short, long, ...
    return [sizes[j] for j in order], [over_s * i / (n - 1) for i in range(n)]


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.device = torch.device("cpu" if args.smoke else "cuda")
        self.ckpt = Path(args.ckpt or f"/tmp/batched-bench-{args.arch}-random")
        import transformers

        meta: dict[str, Any] = {
            "torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
            "command": " ".join(shlex.quote(a) for a in [sys.executable, "-m", "bench.batched", *sys.argv[1:]]),
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "device": torch.cuda.get_device_name(0) if self.device.type == "cuda" else "cpu",
            "model": f"{args.arch}-shape-random", "quantization": args.quantization,
            "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens, "settings": args.settings,
        }
        try:
            import bitsandbytes as bnb

            meta["bitsandbytes"] = bnb.__version__
        except ImportError:
            meta["bitsandbytes"] = "missing"
        self.meta = meta
        self.rec = Recorder(Path(args.out), meta)

    def load(self) -> ChatEngine:
        a = self.args
        environ = {"MODEL_ID": str(self.ckpt), "QUANTIZATION": a.quantization, "DEVICE": self.device.type,
                   "DECODE_PATH": "fast", "MAX_BATCH_SIZE": str(max(a.chats)), "MAX_NEW_TOKENS": str(a.new_tokens),
                   "STREAM_TIMEOUT_S": "300", "SESSION_MAX_WAITING": "1", "KV_LAYOUT": a.kv_layout, **a.settings}
        if a.smoke:
            environ["COMPUTE_DTYPE"] = "float32"
        t = time.perf_counter()
        engine = ChatEngine.load(Settings.from_env(environ=environ, env_file=None),
                                 progress=lambda m: print(m, flush=True))
        slots = engine.fast_scheduler.runner.decoder if engine.fast_scheduler is not None else None
        self.rec.add(phase="load", decode_path=engine.backend.name, decode_path_reason=engine.backend.reason,
                     load_s=round(time.perf_counter() - t, 1), warmup_s=engine.report.warmup_s,
                     weights_bytes=engine.report.weights_bytes,
                     slots=slots.slots if slots else None, slot_tokens=slots.slot_tokens if slots else None,
                     kv_layout=a.kv_layout, reply_tokens=slots.reply_tokens if slots else None,
                     slot_notes=slots.notes if slots else None, rows_kernel=slots.rows_kernel if slots else None,
                     rows_plan=dict(slots.rows_max.kernels) if slots and isinstance(slots.rows_max, RowsPlan) else None,
                     rows_timings_us=slots.rows_timings_us if slots else None,
                     graphs=slots.captured_buckets if slots else None, compiled=slots.compiled if slots else None,
                     prefill_graphs=slots.prefill_graphs.captured if slots and slots.prefill_graphs else None)
        return engine

    # --- ours -----------------------------------------------------------------------------------------------------
    def ours(self, engine: ChatEngine, n: int, texts: list[str],
             offsets_s: list[float] | None = None) -> dict[str, Any]:
        """n chats through the engine, each in its own thread: started together (a barrier), or each `offsets_s[i]`
        seconds after the first thread is ready (a mixed load arriving over a few seconds)."""
        a = self.args
        gen = engine.request_options(max_new_tokens=a.new_tokens, min_new_tokens=a.new_tokens, do_sample=False)
        results: list[Any] = [None] * n
        barrier = threading.Barrier(n)
        scheduler = engine.fast_scheduler
        before = scheduler.snapshot() if scheduler is not None else None

        def run(i: int) -> None:
            try:
                barrier.wait(timeout=60)
                if offsets_s is not None:
                    time.sleep(offsets_s[i])
                sent = time.perf_counter()
                last: ReplyUpdate = deque(engine.stream_chat(texts[i], [], gen=gen, system_prompt=None,
                                                             request_id=f"n{n}-chat{i}"), maxlen=1)[0]
                results[i] = (last, sent)
            except BaseException as exc:  # recorded: one failure must not hide the others' numbers
                results[i] = exc

        threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(a.phase_timeout_s)
        done = [r for r in results if isinstance(r, tuple)]
        failed = [f"{type(r).__name__}: {r}" if isinstance(r, BaseException) else "timed out" for r in results
                  if not isinstance(r, tuple)]
        out: dict[str, Any] = {"recipe": "ours", "concurrent_chats": n, "completed": len(done), "failed": failed}
        if done:
            stats = [r[0].stats for r in done]
            first = [r[1] + (s.ttft_s or 0.0) for r, s in zip(done, stats, strict=True)]
            last_t = [f + (s.decode_s or 0.0) for f, s in zip(first, stats, strict=True)]
            span = max(last_t) - min(first)
            rates = [s.decode_tokens_per_s for s in stats if s.decode_tokens_per_s]
            ttfts = [s.ttft_s for s in stats if s.ttft_s is not None]
            peaks = [s.peak_vram_allocated_bytes for s in stats if s.peak_vram_allocated_bytes]
            out.update(
                prompt_tokens=statistics.median(s.prompt_tokens for s in stats),
                new_tokens=[s.new_tokens for s in stats] if n <= 8 else sorted({s.new_tokens for s in stats}),
                aggregate_decode_tokens_per_s=sum(max(0, s.new_tokens - 1) for s in stats) / span if span > 0 else None,
                per_chat_decode_tokens_per_s={"min": min(rates) if rates else None,
                                              "median": statistics.median(rates) if rates else None},
                ttft_p50_s=percentile(ttfts, 50), ttft_p95_s=percentile(ttfts, 95),
                ttfts_s=sorted(round(t, 4) for t in ttfts) if n <= 8 else None,
                ttft_max_s=max(ttfts) if ttfts else None,
                peak_vram_bytes=max(peaks) if peaks else None,
                peak_batch_rows=max((s.peak_batch_rows or 0) for s in stats) or None,
                kv_cache_bytes_per_chat=statistics.median(s.kv_cache_bytes or 0 for s in stats),
            )
        if scheduler is not None and before is not None:
            s = scheduler.snapshot()
            steps = s.decode_steps - before.decode_steps
            out["step_profile"] = {
                "decode_steps": steps,
                "mean_step_s": (s.step_s - before.step_s) / steps if steps else None,
                "mean_rows_per_step": (s.rows_decoded - before.rows_decoded) / steps if steps else None,
                "max_rows_in_step": s.max_rows_in_step,
                "steps_by_bucket": {b: c - before.rows_by_bucket.get(b, 0) for b, c in s.rows_by_bucket.items()
                                    if c - before.rows_by_bucket.get(b, 0)},
                "prefill_chunks": s.prefill_chunks - before.prefill_chunks,
                "waited_for_slot": s.waited_for_slot - before.waited_for_slot, "errors": s.errors - before.errors,
                "waited_for_blocks": s.waited_for_blocks - before.waited_for_blocks,
                "paused_rows": s.paused_rows - before.paused_rows, "preempted": s.preempted - before.preempted}
            if done:  # the loop's ops from the first request on (BatchStats.timeline; CUDA), ms from that request
                t0 = min(r[1] for r in done)
                out["timeline"] = [{"op": op, "rows": rows, "start_ms": round((a0 - t0) * 1000, 2),
                                    "ms": round((a1 - a0) * 1000, 2)}
                                   for op, rows, a0, a1 in getattr(s, "timeline", []) if a0 >= t0][:80]
        return out

    # --- transformers' batched generate (the reference) -------------------------------------------------------------
    def reference(self, engine: ChatEngine, n: int, texts: list[str]) -> dict[str, Any]:
        a = self.args
        loaded = engine.loaded
        tok = loaded.tokenizer
        rows = [engine.encode_messages([{"role": "user", "content": t}])["input_ids"][0].tolist() for t in texts[:n]]
        width = max(len(r) for r in rows)
        pad = tok.pad_token_id if tok.pad_token_id is not None else 0
        ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows], device=loaded.device)
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=loaded.device)

        def generate(new: int) -> float:
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            with torch.inference_mode():
                loaded.model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=new,
                                      min_new_tokens=new, pad_token_id=pad, temperature=None, top_p=None, top_k=None)
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            return time.perf_counter() - t0

        generate(2)  # first-call costs out of the numbers
        first_s = generate(1)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        total_s = generate(a.new_tokens)
        peak = torch.cuda.max_memory_allocated() if self.device.type == "cuda" else None
        decode_s = max(1e-9, total_s - first_s)
        per_chat = (a.new_tokens - 1) / decode_s
        return {"recipe": "transformers-generate", "concurrent_chats": n, "prompt_tokens": width,
                "new_tokens": a.new_tokens, "aggregate_decode_tokens_per_s": n * per_chat,
                "per_chat_decode_tokens_per_s": {"min": per_chat, "median": per_chat},
                "ttft_p50_s": first_s, "ttft_p95_s": first_s, "peak_vram_bytes": peak, "generate_s": total_s}

    def run(self) -> None:
        a = self.args
        t_all = time.perf_counter()
        if not checkpoint_ready(self.ckpt):
            t = time.perf_counter()
            shape = "tiny" if a.smoke else a.arch
            make_random_checkpoint(shape, self.ckpt, self.device, CONTEXT_TOKENS, tokenizer="chatml")
            self.rec.set_summary(checkpoint_s=round(time.perf_counter() - t, 1))
        restrict_gemv_configs(a.gemv_configs)
        set_mm_split_sum(a.mm_split_sum)
        launches = set_attention_launches(a.attention_launch)
        frag = set_frag_config(a.frag_config)
        self.rec.set_summary(gemv_configs=a.gemv_configs, mm_split_sum=a.mm_split_sum, attention_launches=launches,
                             frag_config=frag)
        engine = self.load()
        modes = ["group", "each"] if a.prefill == "both" else [a.prefill]
        variants = [v for _ in range(a.host_repeats) for v in a.host_variants]
        phases = [(n, mode, variant) for n in a.chats for mode in modes for variant in variants]
        width = max(a.chats)
        texts = [prompt_text(engine, i, a.prompt_tokens) for i in range(width * len(phases))]
        common = {"model": self.meta["model"], "quantization": a.quantization, "device": self.meta["device"],
                  "versions": {k: self.meta[k] for k in ("torch", "transformers", "bitsandbytes")},
                  "command": self.meta["command"]}
        runner = engine.fast_scheduler.runner if engine.fast_scheduler is not None else None
        for index, (n, mode, variant) in enumerate(phases):
            print(f"ours: {n} chats, prefill {mode}, host {variant}", flush=True)
            if runner is not None:
                runner.group_prefill = mode == "group"
            own = texts[index * width:(index + 1) * width]
            with host_variant(variant, runner, engine), StepProbe(runner) as probe:
                run = self.ours(engine, n, own)
            self.rec.add(**common, prefill=mode, host=variant, **run, host_probe=probe.summary())
            if a.reference and mode == modes[0] and index == phases.index((n, mode, variants[0])):
                print(f"transformers generate: {n} chats", flush=True)
                try:
                    self.rec.add(**common, **self.reference(engine, n, own))
                except Exception as exc:  # noqa: BLE001 - the reference failing must not lose our numbers
                    self.rec.add(**common, recipe="transformers-generate", concurrent_chats=n,
                                 error=f"{type(exc).__name__}: {str(exc)[:300]}")
        if a.mixed:
            runner_mode = modes[0]
            if runner is not None:
                runner.group_prefill = runner_mode == "group"
            lengths, offsets = mixed_load(a.mixed, a.mixed_over_s,
                                          min(CONTEXT_TOKENS - a.new_tokens - 32, 8 * a.prompt_tokens),
                                          min(128, a.prompt_tokens))
            print(f"ours: {a.mixed} chats, a mixed load ({min(lengths)}-{max(lengths)} prompt tokens over "
                  f"{a.mixed_over_s} s)", flush=True)
            own = [prompt_text(engine, len(texts) + 1000 + i, n) for i, n in enumerate(lengths)]
            run = self.ours(engine, a.mixed, own, offsets)
            self.rec.add(**common, prefill=runner_mode, what="mixed", arrivals_s=[round(o, 3) for o in offsets],
                         **run)
        if a.profile_chats and runner is not None:
            for mode in modes:
                print(f"profile: {a.profile_chats} chats arriving together, prefill {mode}", flush=True)
                runner.group_prefill = mode == "group"
                fresh = [prompt_text(engine, len(texts) + 1 + i + (a.profile_chats if mode == "each" else 0),
                                     a.prompt_tokens) for i in range(a.profile_chats)]
                self.rec.add(**common, prefill=mode, **self.profile_arrivals(engine, fresh))
        if a.profile:
            print("profile: one chat", flush=True)
            self.rec.add(**common, **self.profile(engine, prompt_text(engine, len(texts), a.prompt_tokens)))
        if engine.fast_scheduler is not None:
            engine.fast_scheduler.close()
        self.rec.set_summary(total_s=round(time.perf_counter() - t_all, 1))

    def profile_arrivals(self, engine: ChatEngine, texts: list[str], top: int = 25) -> dict[str, Any]:
        """len(texts) chats arriving together (as `ours` runs them) under torch.profiler: the device's kernels by
        total time over the whole run (the profiler sees every thread's kernels), their sum against the wall time
        from the first request to the last first token, and the run's own record: whether the newcomers' prefill is
        bound by the device or by the host."""
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        with profile(activities=activities) as prof:
            run = self.ours(engine, len(texts), texts)
        key = "self_device_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
        events = sorted((e for e in prof.key_averages() if getattr(e, key, 0) > 0), key=lambda e: getattr(e, key),
                        reverse=True)
        return {**run, "what": "profile-arrivals",
                "device_kernels_us": round(sum(getattr(e, key) for e in events), 1),
                "device_kernels": [{"name": e.key[:120], "calls": e.count, "us": round(getattr(e, key), 1)}
                                   for e in events[:top]]}

    def profile(self, engine: ChatEngine, text: str, top: int = 15) -> dict[str, Any]:
        """One chat's reply (after the runs above: compiled, graphs captured) under torch.profiler: the device's
        kernels by total time, each with its calls and microseconds per decode step, and their sum per step beside
        the step's wall time (the scheduler's clock around run_step and its one host sync): a step much slower than
        its kernels loses its time on the host. (Host ops are not listed: the profiler records the calling thread's,
        and the reply runs on the scheduler's.)"""
        from torch.profiler import ProfilerActivity, profile

        gen = engine.request_options(max_new_tokens=self.args.new_tokens, min_new_tokens=self.args.new_tokens,
                                     do_sample=False)
        scheduler = engine.fast_scheduler
        before = scheduler.snapshot() if scheduler is not None else None
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        with profile(activities=activities) as prof:
            last = deque(engine.stream_chat(text, [], gen=gen, system_prompt=None, request_id="profile"), maxlen=1)[0]
        after = scheduler.snapshot() if scheduler is not None else None
        steps = (after.decode_steps - before.decode_steps) if after is not None and before is not None else 0
        per = max(steps, 1)

        key = "self_device_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
        events = sorted((e for e in prof.key_averages() if getattr(e, key, 0) > 0), key=lambda e: getattr(e, key),
                        reverse=True)
        kernels = [{"name": e.key[:120], "calls_per_step": round(e.count / per, 2),
                    "us_per_step": round(getattr(e, key) / per, 1)} for e in events[:top]]
        return {"recipe": "ours", "what": "profile", "concurrent_chats": 1, "decode_steps": steps,
                "mean_step_s": (after.step_s - before.step_s) / per if after is not None and before is not None
                else None,
                "kernels_us_per_step": round(sum(getattr(e, key) for e in events) / per, 1),
                "decode_tokens_per_s": last.stats.decode_tokens_per_s, "kv_layout": self.args.kv_layout,
                "device_kernels": kernels}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "/tmp"), "batched.json"))
    parser.add_argument("--smoke", action="store_true", help="tiny random llama on CPU, fp32, in seconds")
    parser.add_argument("--arch", default="llama-2-7b", choices=sorted(RANDOM_ARCHS))
    parser.add_argument("--quantization", default=None, help="default nf4 (GPU) / none (smoke)")
    parser.add_argument("--chats", default=None, help="comma-separated concurrent chats; default 1,8,32 (smoke 1,3)")
    parser.add_argument("--prompt-tokens", type=int, default=None, help="default 512 (smoke 48)")
    parser.add_argument("--new-tokens", type=int, default=None, help="default 128 (smoke 8)")
    parser.add_argument("--no-reference", dest="reference", action="store_false",
                        help="skip transformers' batched generate")
    parser.add_argument("--ckpt", default=None, help="random checkpoint folder (written when missing)")
    parser.add_argument("--phase-timeout-s", type=float, default=300.0)
    parser.add_argument("--kv-layout", default="paged", choices=("slots", "paged"),
                        help="KV_LAYOUT of ours (default paged, the app's)")
    parser.add_argument("--prefill", default="group", choices=("group", "each", "both"),
                        help="paged: newcomers arriving together prefilled in padded groups, one by one, or both")
    parser.add_argument("--mixed", type=int, default=0,
                        help="then N chats of 128 to 8 x --prompt-tokens prompt tokens (at most the context: ~4k by "
                             "default), arriving evenly over --mixed-over-s seconds, MAX_BATCH_SIZE as --chats sets it")
    parser.add_argument("--mixed-over-s", type=float, default=3.0)
    parser.add_argument("--profile-chats", type=int, default=0,
                        help="then N chats arriving together under torch.profiler, once per --prefill mode")
    parser.add_argument("--profile", action="store_true",
                        help="then one chat's reply under torch.profiler: kernels and host ops per decode step")
    parser.add_argument("--gemv-configs", default="all", choices=("all", "plain"),
                        help="the NF4 one-token kernel's autotuner: the library's configs, or only the ones without "
                             "a load prefetch (plain: PREFETCH off): an A/B through the engine")
    parser.add_argument("--mm-split-sum", default="rule", choices=("rule", "fused", "kernel"),
                        help="the small-M NF4 kernel's K splits summed as the library's rule says (rule: inside the "
                             "launch at 5-16 rows), inside its launch at every row count (fused) or by a second "
                             "kernel (kernel): an A/B through the engine")
    parser.add_argument("--host-variants", default="default",
                        help=f"comma-separated host settings each phase runs under, in turn, in this process "
                             f"(bench.host_probe: {', '.join(HOST_VARIANTS)}): an A/B of the host's part")
    parser.add_argument("--host-repeats", type=int, default=1, help="run the --host-variants list this many times")
    parser.add_argument("--attention-launch", action="append", default=[], metavar="FORMAT:ROWS=NAME",
                        help="the decode attention's launch for a format and rows bucket in this process "
                             "(repeatable), e.g. int8:64=l64-w4-s2-p4: an A/B of bench.attention_rows' suggestion")
    parser.add_argument("--frag-config", default="", metavar="FIELD=N,...",
                        help="nf4_frag's launches take its default_config with these FragConfig fields replaced, "
                             "e.g. depth=2,early=1 (with --set NF4_FRAG=on: an A/B of a sweep's best form)")
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                        help="a setting beyond the bench's own (repeatable), e.g. LAUNCH_OVERLAP=off")
    args = parser.parse_args(argv)
    args.settings = {}
    args.host_variants = [v for v in args.host_variants.split(",") if v]
    unknown = sorted({part for v in args.host_variants for part in v.split("+")} - set(HOST_VARIANTS))
    if unknown or not args.host_variants or args.host_repeats < 1:
        parser.error(f"--host-variants takes names from {HOST_VARIANTS} (several at once joined by '+') and "
                     "--host-repeats 1 or more")
    for item in args.set:
        name, sep, value = item.partition("=")
        if not sep or not name:
            parser.error(f"--set takes NAME=VALUE, not {item!r}")
        args.settings[name] = value
    smoke = args.smoke
    if smoke:
        args.arch = "tiny"
    args.quantization = args.quantization or ("none" if smoke else "nf4")
    args.chats = [int(c) for c in (args.chats or ("1,3" if smoke else "1,8,32")).split(",")]
    args.prompt_tokens = args.prompt_tokens or (48 if smoke else 512)
    args.new_tokens = args.new_tokens or (8 if smoke else 128)
    if smoke and args.ckpt is None:
        args.ckpt = f"/tmp/batched-bench-tiny-random-{os.getpid()}"
    if not smoke and not torch.cuda.is_available():
        parser.error("no CUDA device: use --smoke")
    Bench(args).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
