"""Compare benchmark: the Compare view's own numbers against bench.decode's numbers for the same
configuration, on the same loaded model, in one process; NF4 vs bf16 vs int8 of a random-weight Llama-2-7B shape.
The requirement: TTFT, decode tokens/s and peak memory each agree within 5% (the comparison adds no overhead). TTFT
is compared from the same point on both sides (the decode loop's start); the reply's full TTFT, which also counts the
engine's templating, tokenizing and memory planning (about 3 ms at 512 tokens), is reported beside it.

GPU (one device call, about 4-6 minutes on an H200; starts no new mode past --budget-s and cuts repeats to fit it):
    BENCH=bench.compare_bench BENCH_OUT=compare.json bash bench/h200.sh --random llama-2-7b
    (or, with bitsandbytes importable: python -m bench.compare_bench --random llama-2-7b --out compare.json)
CPU smoke (the tiny random llama of `python -m bench.decode --cpu-smoke`, about 10 s on two cores):
    python -m bench.compare_bench --cpu-smoke --out /tmp/compare-smoke.json

Per mode of --modes (CompareConfig presets: nf4 = NF4 + double quant + bf16 compute, none = plain bf16, int8 = LLM.int8
with fp16 compute), in that order; each model is loaded once and unloaded before the next mode:
  compare  Comparison.run([config], prompt, gen) over an EnginePool: the objects the Compare tab uses, the random
           checkpoint allowed through COMPARE_MODELS. The prompt is --prompt-tokens words of the checkpoint's word
           tokenizer (one token each, no system prompt); gen is greedy, --new-tokens tokens, repetition penalty off
           and EOS held back until the last token (GenerationSettings.min_new_tokens): what bench.decode runs.
           The first comparison loads the engine (its load time, warm-up included, is the comparison's own) and is
           not counted: it pays the first-call costs at this prompt length. Numbers: each reply's final ReplyStats.
  bench    the same engine's model, the same prompt ids and token count, timed as bench.decode times them
           (bench.timed_run): through the engine's own FastDecoder with bench.ours_call when the comparison decoded on
           the fast path, through model.generate with bench.seed_call when it decoded on the plain path. One 8-token
           call first (first-call costs, as bench does), then the repeats, interleaved with the compare runs
           (each side leads in turn). A third, informative side: the same call on a long-lived worker thread
           (bench_worker), as the engine runs replies, to tell a thread effect from overhead. Every run also records
           the process CPU seconds it took and the GPU's SM clock just before it; on the fast path, where its first
           token's time went (bench.probes.prefill_timing: host launch vs CUDA-event device time of the prefill).
  check    per metric: medians over the repeats of each side and ratio = compare / bench (of the medians); the
           paired ratios (compare / bench within each repeat, the two runs next to each other in time) and their
           median, paired_ratio; within_5pct = |paired_ratio - 1| <= 0.05. Required: ttft_from_decode_start_s (vs
           the bench's ttft_s), decode_tokens_per_s, peak memory; informative: ttft_s, e2e_tokens_per_s.
  --reanalyze FILE  recompute the checks of an earlier run's records with this version's check (no model).

Definitions (both sides stamp each token on the host when the decode loop hands it to its streamer):
  ttft_s               compare: request received by the engine (before templating) -> first new token (ReplyStats);
                       bench: the call (ids already on the device, device synchronized) -> first new token.
                       Attribution of a gap (compare side, two clock reads per reply): prepare_s = ChatEngine.prepare
                       (templating, tokenizing, memory planning); handoff_s = end of prepare -> the decode backend
                       starting in the worker thread; before_prepare_s = request received -> prepare (message
                       checks); ttft_from_decode_start_s = ttft_s minus all three (decode start -> first token, both
                       read on the reply's own clock): the part comparable with the bench's ttft_s.
  decode_tokens_per_s  (new tokens - 1) / (last token - first token), both sides.
  peak_vram_bytes      torch.cuda.max_memory_allocated over the reply, peak statistics reset just before it (both
                       sides; ReplyStats.peak_vram_allocated_bytes). On CPU: the process's peak RSS (peak_rss_bytes).
  e2e_tokens_per_s     new tokens / (request or call -> reply finished); informative, not part of the requirement.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from bench.decode import RunResult, _device_name, measure_copy_bandwidth, ours_call, seed_call, summarize, timed_run
from bench.harness import RANDOM_ARCHS, Recorder, checkpoint_ready, make_random_checkpoint, median
from bench.probes import prefill_timing
from llm_core.config import Settings
from llm_core.engine.chat import ChatEngine, WorkerThreads
from llm_core.engine.compare import MODE_PRESETS, CompareConfig, CompareUpdate, Comparison, EnginePool, SideResult
from llm_core.engine.runners import PreparedPrompt
from llm_core.loading import configure_cuda_allocator, library_versions
from llm_core.memory.device import PeakMeter, free_memory
from llm_core.metrics import ReplyStats

TITLE = "Compare view vs the benchmark, same configuration (batch 1, random-weight Llama shape)"
TOLERANCE = 0.05
FIRST_CALL_TOKENS = 8  # bench.ours_first / the seed's first call: first-call costs at this prompt length
GPU = {"prompt_tokens": 512, "new_tokens": 128, "repeats": 7, "budget_s": 400.0}  # 7 pairs: paired ratios need them
SMOKE = {"arch": "tiny", "prompt_tokens": 32, "new_tokens": 8, "repeats": 2, "budget_s": 600.0}
MODE_START_S = {"cuda": 60.0, "cpu": 5.0}  # left in the budget to start a mode (load, warm-up, first reply)
UNLOAD_RESERVE_S = {"cuda": 15.0, "cpu": 2.0}
PREFILL_KEYS = ("entry_to_prefill_s", "prefill_launch_s", "prefill_gpu_s", "first_token_s")  # prefill_timing
MIN_CUT_TOKENS = 16  # fewest new tokens a mode is measured with when the budget forces a cut


@dataclass(frozen=True)
class Metric:
    name: str  # key in the check record
    compare_key: str  # key of a compare-side run row
    bench_key: str  # key of a bench-side run row
    required: bool  # part of the 5% agreement the Compare view must keep


# --- prompt --------------------------------------------------------------------------------------------------


def prompt_ids(vocab: int, length: int) -> list[int]:
    """Seeded random ids whose words ("t<id>") the checkpoint's word tokenizer maps back to exactly one token each.
    Ids whose word starts with t0/t1/t2 are left out: those are its special tokens, matched inside longer words."""
    allowed = torch.tensor([i for i in range(3, vocab) if str(i)[0] not in "012"])
    g = torch.Generator().manual_seed(length)
    return [int(i) for i in allowed[torch.randint(0, allowed.numel(), (length,), generator=g)]]


def prompt_text(ids: list[int]) -> str:
    return " ".join(f"t{i}" for i in ids)


# --- numbers -------------------------------------------------------------------------------------------------


def ratio(compare: float | None, bench: float | None) -> float | None:
    if compare is None or bench is None or bench == 0:
        return None
    return compare / bench


def within(r: float | None) -> bool | None:
    return None if r is None else abs(r - 1.0) <= TOLERANCE


class Probe:
    """Clock reads inside a compare-side reply, to attribute a TTFT gap: around ChatEngine.prepare, and when the
    decode backend starts: its run() in the worker thread, or, for a reply of the scheduler (ScheduledBackend), its
    submit() on the reply's own thread. Wraps the engine object's own prepare and backend.run / backend.submit (two
    perf_counter calls per reply); it also keeps the PreparedPrompt, whose ids the bench side then uses."""

    def __init__(self, engine: ChatEngine) -> None:
        self.prepare_start: float | None = None
        self.prepare_end: float | None = None
        self.decode_start: float | None = None
        self.clock_start: float | None = None
        self.prepared: PreparedPrompt | None = None
        inner_prepare, inner_run = engine.prepare, engine.backend.run

        def prepare(*args: Any, **kwargs: Any) -> PreparedPrompt:
            self.prepare_start = time.perf_counter()
            out = inner_prepare(*args, **kwargs)
            self.prepare_end = time.perf_counter()
            self.prepared = out
            return out

        def run(prepared: Any, streamer: Any, *args: Any, **kwargs: Any) -> Any:
            self.decode_start = time.perf_counter()
            self.clock_start = streamer.clock.start_s  # the reply's TTFT clock: the engine received the request
            return inner_run(prepared, streamer, *args, **kwargs)

        engine.prepare = prepare  # type: ignore[method-assign]
        engine.backend.run = run
        inner_submit = getattr(engine.backend, "submit", None)
        if inner_submit is not None:
            def submit(prepared: Any, streamer: Any, *args: Any, **kwargs: Any) -> Any:
                self.decode_start = time.perf_counter()
                self.clock_start = streamer.clock.start_s
                return inner_submit(prepared, streamer, *args, **kwargs)

            engine.backend.submit = submit

    def clear(self) -> None:
        self.prepare_start = self.prepare_end = self.decode_start = self.clock_start = None

    def row(self, ttft_s: float | None) -> dict[str, Any]:
        a, b, c, t0 = self.prepare_start, self.prepare_end, self.decode_start, self.clock_start
        if a is None or b is None or c is None or t0 is None:
            return {"prepare_s": None, "handoff_s": None, "before_prepare_s": None, "ttft_from_decode_start_s": None}
        return {"prepare_s": b - a, "handoff_s": c - b, "before_prepare_s": a - t0,
                "ttft_from_decode_start_s": None if ttft_s is None else ttft_s - (c - t0)}


def compare_row(stats: ReplyStats, probe: dict[str, Any]) -> dict[str, Any]:
    """One compare-side reply: the numbers compared (ReplyStats names), the probe's split, and the whole stats."""
    return {
        "ttft_s": stats.ttft_s, "decode_tokens_per_s": stats.decode_tokens_per_s,
        "e2e_tokens_per_s": stats.new_tokens / stats.end_to_end_s if stats.end_to_end_s else None,
        "new_tokens": stats.new_tokens, "prompt_tokens": stats.prompt_tokens,
        "peak_vram_bytes": stats.peak_vram_allocated_bytes, "peak_rss_bytes": stats.peak_rss_bytes,
        "decode_path": stats.decode_path, "finish_reason": stats.finish_reason, **probe,
        "stats": {k: v for k, v in stats.as_dict().items() if k != "versions"},  # versions: in meta
    }


def bench_row(run: RunResult, peak_rss: int | None, decode_path: str, prompt_tokens: int) -> dict[str, Any]:
    return {
        "ttft_s": run.ttft_s, "decode_tokens_per_s": run.decode_tokens_per_s, "e2e_tokens_per_s": run.e2e_tokens_per_s,
        "new_tokens": run.new_tokens, "prompt_tokens": prompt_tokens, "peak_vram_bytes": run.peak_vram_bytes,
        "peak_rss_bytes": peak_rss, "decode_path": decode_path, "allocated_before_bytes": run.allocated_before_bytes,
    }


def gpu_clock_mhz(device: torch.device) -> int | None:
    """The GPU's SM clock now (MHz), read before a run and outside its timing: a prefill is compute-bound, so its
    time follows the clock, which the GPU lowers while idle. pynvml when importable, else nvidia-smi."""
    if device.type != "cuda":
        return None
    try:
        return int(torch.cuda.clock_rate(device))
    except Exception:  # noqa: BLE001 - no pynvml: ask nvidia-smi
        pass
    try:
        index = device.index if device.index is not None else torch.cuda.current_device()
        out = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm", "--format=csv,noheader,nounits", "-i",
                              str(index)], capture_output=True, text=True, timeout=5, check=True).stdout
        return int(out.strip().splitlines()[0])
    except Exception:  # noqa: BLE001 - informative only
        return None


def side_summary(rows: list[dict[str, Any]], keys: list[str]) -> dict[str, Any]:
    return {**{k: median([r.get(k) for r in rows]) for k in keys}, "runs": len(rows),
            "new_tokens": sorted({r["new_tokens"] for r in rows}),
            "decode_path": sorted({r["decode_path"] for r in rows})}


def check_metrics(metrics: list[Metric], compare_rows: list[dict[str, Any]], bench_rows: list[dict[str, Any]]
                  ) -> dict[str, dict[str, Any]]:
    """Per metric: each side's median and their ratio, and the ratios of the runs of each repeat (a compare run
    and a bench run next to each other in time), whose median `within_5pct` judges: it cancels drift that
    medians over the whole series do not (e.g. the GPU's prefill time creeping up over a mode's minute)."""
    out = {}
    for m in metrics:
        c = median([row.get(m.compare_key) for row in compare_rows])
        b = median([row.get(m.bench_key) for row in bench_rows])
        q = ratio(c, b)
        pairs = zip(compare_rows, bench_rows, strict=False)  # a cut run can leave a side one run short
        paired = [ratio(cr.get(m.compare_key), br.get(m.bench_key)) for cr, br in pairs]
        pq = median(paired)
        out[m.name] = {"compare": c, "bench": b, "ratio": None if q is None else round(q, 6),
                       "paired_ratios": [None if v is None else round(v, 4) for v in paired],
                       "paired_ratio": None if pq is None else round(pq, 6), "within_5pct": within(pq),
                       "required": m.required, "compare_key": m.compare_key, "bench_key": m.bench_key}
    return out


def metric_list(peak: str) -> list[Metric]:
    return [
        Metric("ttft_from_decode_start_s", "ttft_from_decode_start_s", "ttft_s", True),
        Metric("decode_tokens_per_s", "decode_tokens_per_s", "decode_tokens_per_s", True),
        Metric(peak, peak, peak, True),
        Metric("ttft_s", "ttft_s", "ttft_s", False),
        Metric("e2e_tokens_per_s", "e2e_tokens_per_s", "e2e_tokens_per_s", False),
    ]


def mode_summary(check: dict[str, Any]) -> dict[str, Any]:
    metrics = check["metrics"]
    required = [name for name, m in metrics.items() if m["required"]]
    return {"decode_path": check["decode_path"], "all_within_5pct": check["all_within_5pct"],
            "repeats": check["repeats"],
            **{f"{name}_paired_ratio": m["paired_ratio"] for name, m in metrics.items()},
            **{f"{name}_ratio": m["ratio"] for name, m in metrics.items()},
            **{f"{name}_{side}": metrics[name][side] for name in required for side in ("compare", "bench")},
            "weights_bytes": check["weights_bytes"], "load_s": check["load_s"]}


def reanalyze(source: Path, out: Path | None) -> dict[str, Any]:
    """An earlier run's document with every check recomputed from its run records by this version's check."""
    doc = json.loads(source.read_text(encoding="utf-8"))
    records = doc["records"]
    peak = "peak_vram_bytes" if any(r.get("peak_vram_bytes") for r in records if r["kind"] == "run") else (
        "peak_rss_bytes")
    metrics = metric_list(peak)
    required = [m.name for m in metrics if m.required]
    summary: dict[str, Any] = {}
    for check in (r for r in records if r["kind"] == "check"):
        rows = {side: sorted((r for r in records if r["kind"] == "run" and r["mode"] == check["mode"]
                              and r["recipe"] == side), key=lambda r: r["repeat"]) for side in ("compare", "bench")}
        check["metrics"] = check_metrics(metrics, rows["compare"], rows["bench"])
        check["all_within_5pct"] = all(check["metrics"][name]["within_5pct"] is True for name in required)
        summary[check["mode"]] = mode_summary(check)
    checks = [r for r in records if r["kind"] == "check"]
    summary.update(all_modes_within_5pct=bool(checks) and all(c["all_within_5pct"] for c in checks),
                   modes_measured=[c["mode"] for c in checks])
    doc["summary"] = summary
    doc["meta"]["reanalyzed"] = {"from": str(source), "with": "bench/compare_bench.py --reanalyze",
                                 "at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "plan_metrics": required}
    if out is not None:
        out.write_text(json.dumps(doc, indent=1, default=str) + "\n", encoding="utf-8")
    print(table(records, peak), flush=True)
    return doc


# --- the benchmark -------------------------------------------------------------------------------------------


class CompareBench:
    def __init__(self, args: argparse.Namespace, command: list[str]) -> None:
        self.args = args
        self.t_start = time.perf_counter()
        self.smoke = bool(args.cpu_smoke)
        self.device = torch.device("cpu" if self.smoke else "cuda")
        self.arch = str(SMOKE["arch"]) if self.smoke else str(args.random)
        self.model_label = f"random:{self.arch}"
        self.work = args.work_dir or Path(tempfile.mkdtemp(prefix="llmc-compare-"))
        peak = "peak_vram_bytes" if self.device.type == "cuda" else "peak_rss_bytes"
        self.peak_metric = peak
        self.metrics = metric_list(peak)
        import transformers

        plan = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
        plan.update(random=self.arch, device=self.device.type, tolerance=TOLERANCE,
                    metrics=[m.name for m in self.metrics if m.required],
                    informative_metrics=[m.name for m in self.metrics if not m.required],
                    first_call_tokens=FIRST_CALL_TOKENS)
        meta = {
            "command": " ".join(shlex.quote(a) for a in [sys.executable, *command]),
            "argv": list(command), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "device": _device_name(self.device),
            "machine": {"host_cpu_count": os.cpu_count(), "platform": platform.platform(),
                        "python": platform.python_version(),
                        "gpu_count": torch.cuda.device_count() if self.device.type == "cuda" else 0},
            "versions": {**library_versions(), "torch_runtime": torch.__version__,
                         "transformers_runtime": transformers.__version__},
            "torch_cuda": torch.version.cuda, "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
            "definitions": __doc__.split("Definitions")[1].strip() if __doc__ else "",
            "plan": plan,
        }
        head = {"title": TITLE, "date": time.strftime("%Y-%m-%d"), "device": _device_name(self.device)}
        self.rec = Recorder(args.out, meta, head=head)

    def left_s(self) -> float:
        return float(self.args.budget_s) - (time.perf_counter() - self.t_start)

    # --- set-up ------------------------------------------------------------------------------------------------
    def checkpoint(self) -> Path:
        positions = self.args.prompt_tokens + self.args.new_tokens + 64
        # The context length is part of the name: it sizes the engine's static cache, so a checkpoint of another
        # length (e.g. bench.decode's, 16k, in a shared work dir) must not be picked up.
        folder = self.work / f"ckpt-{self.arch}-ctx{positions}"
        if not checkpoint_ready(folder):
            t0 = time.perf_counter()
            make_random_checkpoint(self.arch, folder, self.device, positions)
            free_memory(self.device)
            self.rec.add("checkpoint", model=self.model_label, seconds=round(time.perf_counter() - t0, 1),
                         folder=str(folder), context_length=positions)
        return folder

    def settings(self, folder: Path, mode: str) -> Settings:
        environ = {
            "MODEL_ID": str(folder), "COMPARE_MODELS": str(folder), "COMPARE_MODES": ",".join(self.args.modes),
            "DEVICE": self.device.type, "CACHE_DIR": str(self.work / "cache"), "DECODE_PATH": self.decode_path(mode),
            "MAX_BATCH_SIZE": "1", "MAX_NEW_TOKENS": str(self.args.new_tokens), "DO_SAMPLE": "false",
            "REPETITION_PENALTY": "1.0", "HISTORY_TURNS": "0", "STREAM_TIMEOUT_S": "300",
        }
        if self.args.prefill_graph_tokens is not None:
            environ["PREFILL_GRAPH_TOKENS"] = str(self.args.prefill_graph_tokens)
        return Settings.from_env(environ=environ, env_file=None)

    def decode_path(self, mode: str) -> str:
        """DECODE_PATH for a mode: as asked; in the CPU smoke, the fast path where it supports the mode (it runs
        eagerly on CPU), so both of this script's paths run."""
        if self.args.decode_path != "auto":
            return str(self.args.decode_path)
        if self.smoke and MODE_PRESETS[mode][0] in ("nf4", "none"):
            return "fast"
        return "plain" if self.smoke else "auto"  # CPU smoke: as bitsandbytes loads the mode (auto: the CPU path)

    # --- run ---------------------------------------------------------------------------------------------------
    def run(self) -> None:
        hbm = measure_copy_bandwidth(self.device)
        self.rec.add("env", device=_device_name(self.device), copy_bandwidth_bytes_per_s=round(hbm) if hbm else None,
                     hbm_note="measured device-to-device copy, bytes read + written" if hbm else None)
        folder = self.checkpoint()
        ids = prompt_ids(int(RANDOM_ARCHS[self.arch]["vocab_size"]), self.args.prompt_tokens)
        for mode in self.args.modes:
            need = MODE_START_S[self.device.type]
            if self.left_s() < need:
                self.rec.add("skipped", mode=mode, model=self.model_label, reason="time budget",
                             left_s=round(self.left_s(), 1), needed_s=need)
                continue
            try:
                self.run_mode(folder, mode, ids)
            except Exception as exc:  # noqa: BLE001 - one mode failing must not lose the others
                self.rec.add("error", mode=mode, model=self.model_label, error=f"{type(exc).__name__}: {exc}"[:1500],
                             trace=traceback.format_exc()[-3000:])
            finally:
                torch._dynamo.reset()
                free_memory(self.device)
        self.finish()

    def run_mode(self, folder: Path, mode: str, ids: list[int]) -> None:
        """Measure one mode, then unload it through the pool and drop compiled graphs (also after a failure): nothing
        of this mode stays for the next one. The engine is referenced only inside measure(), gone once it returns."""
        settings = self.settings(folder, mode)
        config = CompareConfig(str(folder), mode)
        pool = EnginePool(settings, progress=lambda m: print(m, flush=True))
        base = {"mode": mode, "configuration": config.label, "model": self.model_label}
        try:
            self.measure(pool, settings, config, ids, base)
        finally:
            t0 = time.perf_counter()
            freed = pool.unload(config)
            torch._dynamo.reset()
            free_memory(self.device)
            self.rec.add("unload", **base, freed_bytes=freed, seconds=round(time.perf_counter() - t0, 2),
                         resident_after=[c.label for c in pool.resident()],
                         allocated_after_bytes=int(torch.cuda.memory_allocated(self.device))
                         if self.device.type == "cuda" else None)

    def measure(self, pool: EnginePool, settings: Settings, config: CompareConfig, ids: list[int],
                base: dict[str, Any]) -> None:
        device, new, mode = self.device, self.args.new_tokens, config.mode
        comparison = Comparison(pool, settings, min_sides=1)  # the Compare tab's path, one side at a time
        gen = replace(settings.generation, max_new_tokens=new, min_new_tokens=new).validate()
        message = prompt_text(ids)

        def compare_once() -> tuple[SideResult, tuple[int, ...]]:
            """One comparison, consumed to the end as the CLI consumes it: the side's result, and its generated ids
            from the engine's final update (which the comparison passes through)."""
            final: CompareUpdate | None = None
            token_ids: tuple[int, ...] = ()
            for step in comparison.run([config], message, gen, system_prompt=None):
                if step.update is not None and step.update.done:
                    token_ids = step.update.token_ids
                final = step
            assert final is not None and final.done and len(final.results) == 1
            return final.results[0], token_ids

        # 1. the first comparison loads the engine (the comparison's own load time) and pays first-call costs
        t0 = time.perf_counter()
        first, _ = compare_once()
        first_s = time.perf_counter() - t0
        engine = pool.get(config)[0]  # resident: the engine object the comparison used
        report = engine.report
        path = engine.backend.name
        if path not in ("fast", "plain"):
            raise RuntimeError(f"decode path {path!r}: this benchmark measures one reply at a time (MAX_BATCH_SIZE=1)")
        decoder = engine.fast_decoder if path == "fast" else None
        if path == "fast" and decoder is None:
            raise RuntimeError("the engine reports the fast path but holds no FastDecoder")
        self.rec.add("load", **base, quantization=report.quantization, double_quant=report.double_quant,
                     compute_dtype=report.compute_dtype, attention=report.attention, decode_path=path,
                     decode_path_reason=engine.backend.reason, load_s=first.load_s, engine_load_s=report.load_s,
                     warmup_s=report.warmup_s, weights_bytes=report.weights_bytes,
                     allocated_after_load_bytes=int(torch.cuda.memory_allocated(device))
                     if device.type == "cuda" else None,
                     fast_decoder=decoder.describe() if decoder is not None else None,
                     first_comparison_s=round(first_s, 3), first_reply=compare_row(first.stats, {}))

        # A slow mode (int8 decodes on the plain path) gets fewer new tokens, on both sides, when one reply each would
        # not fit the budget at the first comparison's cost per token: a cut run beats a run killed by the time-out.
        per_token_s = (first.stats.end_to_end_s or first_s) / max(1, first.stats.new_tokens)
        fit = int((self.left_s() - UNLOAD_RESERVE_S[device.type]) / per_token_s - FIRST_CALL_TOKENS) // 2
        cut_from = None
        if fit < new:
            cut_from, new = new, max(MIN_CUT_TOKENS, fit)
            gen = replace(gen, max_new_tokens=new, min_new_tokens=new)
            print(f"{mode}: {cut_from} new tokens would not fit the time budget; measuring {new}", flush=True)

        # 2. the repeats, compare and bench interleaved
        probe = Probe(engine)
        intended = torch.tensor([ids], dtype=torch.long, device=engine.loaded.device)

        def bench_once(prompt: torch.Tensor, tokens: int, thread: WorkerThreads | None = None
                       ) -> tuple[RunResult, int | None]:
            """bench.decode's timed call, on this (main) thread as bench.decode runs it, or on `thread`."""
            if decoder is not None:
                call = ours_call(decoder, prompt, tokens)  # bench.decode's "ours", on the engine's own decoder
            else:
                call = seed_call(engine.loaded, prompt, tokens)  # bench.decode's seed recipe: plain generate
            meter = PeakMeter(device).start() if device.type != "cuda" else None  # CUDA: timed_run's own peak
            if thread is None:
                run = timed_run(device, call)
            else:
                box: list[RunResult] = []
                thread.submit(lambda: box.append(timed_run(device, call))).wait()
                if not box:
                    raise RuntimeError("the bench call failed on its worker thread (see the log)")
                run = box[0]
            return run, meter.stop().peak_allocated_bytes if meter is not None else None

        bench_once(intended, FIRST_CALL_TOKENS)
        # The bench's call again on a long-lived worker thread, as the engine runs replies (informative): tells a
        # thread effect from overhead of the comparison. Its first call pays that thread's first-call costs.
        worker = WorkerThreads(1, name="bench")
        bench_once(intended, FIRST_CALL_TOKENS, worker)
        sides = ["compare", "bench", "bench_worker"]
        worker_rows: list[dict[str, Any]] = []
        compare_rows: list[dict[str, Any]] = []
        bench_rows: list[dict[str, Any]] = []
        bench_runs: list[RunResult] = []
        token_lists: list[tuple[int, ...]] = []
        pair_s = 2 * first_s if path == "plain" else first_s  # re-measured after every pair
        for r in range(self.args.repeats):
            if r > 0 and self.left_s() < pair_s + UNLOAD_RESERVE_S[device.type]:
                self.rec.add("skipped", **base, recipe="compare+bench", repeats_done=r, reason="time budget",
                             left_s=round(self.left_s(), 1), needed_s=round(pair_s, 1))
                break
            t_pair = time.perf_counter()
            order = sides[r % len(sides):] + sides[:r % len(sides)]  # each side leads in turn
            for recipe in order:
                clock = gpu_clock_mhz(device)
                cpu0 = time.process_time()
                if recipe == "compare":
                    probe.clear()
                    side, token_ids = compare_once()
                    row = compare_row(side.stats, probe.row(side.stats.ttft_s))
                    compare_rows.append(row)
                    token_lists.append(token_ids)
                else:
                    prompt = probe.prepared.input_ids if probe.prepared is not None else intended
                    run, rss = bench_once(prompt, new, worker if recipe == "bench_worker" else None)
                    token_lists.append(tuple(run.tokens))
                    row = bench_row(run, rss, path, int(prompt.shape[-1]))
                    row.update(bench_recipe="ours" if decoder is not None else "seed",
                               variant="engine-fast-decoder" if decoder is not None else "plain-generate",
                               thread="worker" if recipe == "bench_worker" else "main")
                    if recipe == "bench":
                        bench_runs.append(run)
                        bench_rows.append(row)
                    else:
                        worker_rows.append(row)
                row.update(process_cpu_s=round(time.process_time() - cpu0, 4), sm_clock_mhz_before=clock)
                if decoder is not None:  # the same FastDecoder served this run: where its first token came from
                    row.update(prefill_timing(decoder))
                self.rec.add("run", recipe=recipe, repeat=r, **base, **row)
            pair_s = time.perf_counter() - t_pair

        # 3. the check
        metrics = check_metrics(self.metrics, compare_rows, bench_rows)
        required = [m.name for m in self.metrics if m.required]
        all_ok = all(metrics[name]["within_5pct"] is True for name in required)
        captured = probe.prepared.input_ids[0].tolist() if probe.prepared is not None else None
        self.rec.add(
            "check", **base, quantization=report.quantization, double_quant=report.double_quant,
            compute_dtype=report.compute_dtype, device=_device_name(device), decode_path=path,
            bench_recipe="ours" if decoder is not None else "seed", prompt_tokens=len(ids), new_tokens=new,
            new_tokens_cut_from=cut_from,
            repeats=len(compare_rows), load_s=first.load_s, engine_load_s=report.load_s, warmup_s=report.warmup_s,
            weights_bytes=report.weights_bytes, metrics=metrics, all_within_5pct=all_ok,
            compare=side_summary(compare_rows, [m.compare_key for m in self.metrics]
                                 + ["before_prepare_s", "prepare_s", "handoff_s"]),
            bench={**side_summary(bench_rows, sorted({m.bench_key for m in self.metrics})),
                   "llm_core_bench": summarize(bench_runs)},
            bench_worker=({**side_summary(worker_rows, sorted({m.bench_key for m in self.metrics})),
                           "vs_compare": check_metrics(self.metrics, compare_rows, worker_rows),
                           "note": "informative: the bench's call on a long-lived worker thread"}
                          if worker_rows else None),
            prefill_timing=({side: side_summary(rows, list(PREFILL_KEYS)) for side, rows in
                             (("compare", compare_rows), ("bench", bench_rows), ("bench_worker", worker_rows))}
                            if decoder is not None else None),
            prompt_ids_match=captured == ids,
            decode_path_match=all(row["decode_path"] == path for row in compare_rows),
            full_length=all(row["new_tokens"] == new for row in compare_rows + bench_rows),
            same_tokens=bool(token_lists) and all(t == token_lists[0] for t in token_lists),
        )
        self.rec.set_summary(**{mode: mode_summary(self.rec.records[-1])})

    def finish(self) -> None:
        checks = [r for r in self.rec.records if r["kind"] == "check"]
        self.rec.set_summary(all_modes_within_5pct=bool(checks) and all(c["all_within_5pct"] for c in checks),
                             modes_measured=[c["mode"] for c in checks],
                             total_s=round(time.perf_counter() - self.t_start, 1))
        self.rec.add("done", seconds=round(time.perf_counter() - self.t_start, 1))
        print(table(self.rec.records, self.peak_metric), flush=True)


def table(records: list[dict[str, Any]], peak_metric: str) -> str:
    """One line per mode: compare / bench medians and the paired ratio (the check) of each required metric, and the
    reply's full TTFT (templating and planning included) beside the bench's."""
    def pair(m: dict[str, Any], scale: float, fmt: str) -> str:
        c, b = m["compare"], m["bench"]
        return f"{c * scale:{fmt}} /{b * scale:{fmt}}" if c is not None and b is not None else "n/a"

    def q(m: dict[str, Any]) -> str:
        return f"{m['paired_ratio']:6.3f}" if m.get("paired_ratio") is not None else f"{'n/a':>6}"

    peak = "peak_GiB" if peak_metric == "peak_vram_bytes" else "rss_GiB"
    lines = [f"{'mode':5} {'path':5} {'ttft_ms cmp/bench':>17} {'paired':>6} {'decode/s cmp/bench':>18} {'paired':>6} "
             f"{peak + ' cmp/bench':>17} {'paired':>6} {'full ttft_ms cmp':>16} ok"]
    for r in records:
        if r["kind"] != "check":
            continue
        m = r["metrics"]
        full = m["ttft_s"]["compare"]
        lines.append(f"{r['mode']:5} {r['decode_path']:5} {pair(m['ttft_from_decode_start_s'], 1e3, '8.2f'):>17} "
                     f"{q(m['ttft_from_decode_start_s'])} "
                     f"{pair(m['decode_tokens_per_s'], 1, '8.1f'):>18} {q(m['decode_tokens_per_s'])} "
                     f"{pair(m[peak_metric], 2**-30, '8.3f'):>17} {q(m[peak_metric])} "
                     f"{full * 1e3 if full is not None else float('nan'):16.2f} "
                     f"{'yes' if r['all_within_5pct'] else 'NO'}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    ap.add_argument("--random", default="llama-2-7b", choices=sorted(RANDOM_ARCHS),
                    help="random-weight model of this architecture (GPU run)")
    ap.add_argument("--modes", nargs="+", default=["nf4", "none", "int8"], choices=list(MODE_PRESETS),
                    help="CompareConfig quantization presets, measured in this order")
    ap.add_argument("--prompt-tokens", type=int, default=None, help=f"default {GPU['prompt_tokens']}")
    ap.add_argument("--new-tokens", type=int, default=None, help=f"default {GPU['new_tokens']}")
    ap.add_argument("--repeats", type=int, default=None,
                    help=f"timed runs per side after one uncounted first run; default {GPU['repeats']}")
    ap.add_argument("--decode-path", default="auto", choices=["auto", "fast", "plain"],
                    help="DECODE_PATH of the engines (auto: what the demo runs)")
    ap.add_argument("--prefill-graph-tokens", type=int, default=None,
                    help="PREFILL_GRAPH_TOKENS of the engines (padded prefill from CUDA graphs; 0 = off; default: "
                         "the setting's default)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help=f"start no new mode or repeat past this many seconds; default {GPU['budget_s']:.0f}")
    ap.add_argument("--no-expandable-segments", action="store_true",
                    help="leave PYTORCH_CUDA_ALLOC_CONF as found (bench.decode's case) instead of setting expandable "
                         "segments before the first CUDA allocation, as the app does")
    ap.add_argument("--work-dir", type=Path, default=None, help="checkpoint and caches (default: a temporary folder)")
    ap.add_argument("--out", type=Path, default=None, help="JSON file, rewritten after every record")
    ap.add_argument("--reanalyze", type=Path, default=None, metavar="FILE",
                    help="recompute the checks of an earlier run's JSON (its records) with this version; --out gets it")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help=f"tiny random llama on CPU: {SMOKE['prompt_tokens']}-token prompt, {SMOKE['new_tokens']} new "
                         f"tokens, {SMOKE['repeats']} repeats unless given; seconds")
    args = ap.parse_args(argv)
    if args.reanalyze is not None:
        return args
    for key in ("prompt_tokens", "new_tokens", "repeats", "budget_s"):
        if getattr(args, key) is None:
            setattr(args, key, (SMOKE if args.cpu_smoke else GPU)[key])
    if not args.cpu_smoke and not torch.cuda.is_available():
        ap.error("no CUDA device: use --cpu-smoke")
    if args.repeats < 1 or args.new_tokens < 2 or args.prompt_tokens < 1:
        ap.error("--repeats >= 1, --new-tokens >= 2 and --prompt-tokens >= 1 are needed")
    if len(set(args.modes)) != len(args.modes):
        ap.error("--modes lists a mode twice")
    return args


def main(argv: list[str] | None = None) -> int:
    command = list(sys.argv) if argv is None else [__file__, *argv]
    args = parse_args(command[1:])
    if args.reanalyze is not None:
        reanalyze(args.reanalyze, args.out)
        return 0
    if not args.no_expandable_segments:
        configure_cuda_allocator()  # as the app runs: before the first CUDA allocation (load_model's call is too late)
    bench = CompareBench(args, command)
    try:
        bench.run()
    finally:
        if args.work_dir is None:
            shutil.rmtree(bench.work, ignore_errors=True)
    if args.out is not None:
        print(f"wrote {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
