"""Memory-guard benchmark: predicted vs measured peaks, the seed recipe vs ours under a small-card cap,
and the longest context the quantized KV cache fits; one JSON document rewritten after every record.

GPU (one call, about 5-7 minutes on an H200; starts no new case after --deadline-s, default 450 s):
    pip install --no-deps --no-index .whl/bitsandbytes-0.50.2-py3-none-manylinux_2_24_x86_64.whl -q
    python -m bench.memory_bench --out "$OUT/memory.json"
CPU smoke (a tiny random llama, < 1 minute; the cap is emulated by raising an injected OOM where the prediction
exceeds it, since CPU memory cannot be capped):
    python -m bench.memory_bench --cpu-smoke --out /tmp/memory-smoke.json

Phases
  a  prediction: the seed recipe (plain generate, one prefill pass, DynamicCache) on a random-weight Llama-2-7B-
     shaped NF4 model at 512 / 4k / 16k prompt tokens + 128 new (min_new_tokens forced): predicted vs measured peak
     (torch.cuda.max_memory_allocated); then ours with the quantized cache (chunked prefill) at 4k / 16k.
  b  under torch.cuda.set_per_process_memory_fraction(cap): the seed recipe with a prompt growing in 2k steps until
     it runs out of memory; ours with a chat history growing turn by turn to 32k tokens, the guard capping each
     prompt at max_context_tokens (what dropping the oldest turns does), chunked prefill; never expected to crash.
  c  the same cap: the longest prompt ours fits with the quantized KV cache (planner's number, then run), against
     the seed's; decode tokens/s of each. d  offload mode at 4k under the cap, to show its cost in tokens/s.
"""

from __future__ import annotations

import argparse
import os
import sys

if "--expandable-segments" in sys.argv:  # before torch touches CUDA; see llm_core.loading.configure_cuda_allocator
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
import platform
import shlex
import time
import traceback
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

import torch
from transformers import StoppingCriteria

from bench.harness import Recorder
from llm_core.memory.budget import max_context_tokens, plan_reply
from llm_core.memory.device import OOMInjector, PeakMeter, free_memory, is_oom_error
from llm_core.memory.kv_cache import cache_bytes, cache_kwarg, make_cache, prefill_in_chunks, returned_cache
from llm_core.memory.model import GiB, MiB, ModelMemoryFacts, QuantizedKVSpec, model_weights_bytes, predict_peak_bytes

LLAMA2_7B: dict[str, Any] = dict(
    hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=32, vocab_size=32000, max_position_embeddings=65536, rms_norm_eps=1e-5)
TINY: dict[str, Any] = dict(
    hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=1024, max_position_embeddings=8192, rms_norm_eps=1e-5)


class Timer(StoppingCriteria):
    """Stopping criterion that timestamps every generated token. TTFT: generate() (or the chunked prefill) start to
    the first token; decode tokens/s: tokens after the first over the time from the first to the last."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stamps: list[float] = []
        self.start = time.perf_counter()

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.stamps.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    @property
    def ttft_s(self) -> float | None:
        return round(self.stamps[0] - self.start, 4) if self.stamps else None

    @property
    def decode_tokens_per_s(self) -> float | None:
        if len(self.stamps) < 2:
            return None
        return round((len(self.stamps) - 1) / max(self.stamps[-1] - self.stamps[0], 1e-9), 2)


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.t0 = time.perf_counter()
        self.smoke = args.cpu_smoke
        self.device = torch.device("cpu" if self.smoke else "cuda")
        self.shape = TINY if self.smoke else LLAMA2_7B
        self.model_name = "tiny-llama-random" if self.smoke else "llama-2-7b-shape-random"
        self.cap_bytes = int(args.cap_gib * GiB) if not self.smoke else int(args.smoke_cap_mib * MiB)
        self.budget_bytes = self.cap_bytes - (256 * MiB if not self.smoke else 0)
        self.command = " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv])
        self.model: Any = None
        self.facts: ModelMemoryFacts | None = None
        self.faults = OOMInjector()  # CPU smoke: emulates the cap
        self.rec = Recorder(Path(args.out), self.meta())

    # --- setup -------------------------------------------------------------------------------------------------
    def meta(self) -> dict[str, Any]:
        import transformers

        meta: dict[str, Any] = {"torch": torch.__version__, "transformers": transformers.__version__,
                                "python": platform.python_version(), "command": self.command,
                                "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        try:
            import bitsandbytes as bnb

            meta["bitsandbytes"] = bnb.__version__
        except ImportError:
            meta["bitsandbytes"] = "missing"
        meta["device"] = torch.cuda.get_device_name(0) if self.device.type == "cuda" else "cpu"
        meta["alloc_conf"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
        return meta

    def left_s(self) -> float:
        return self.args.deadline_s - (time.perf_counter() - self.t0)

    def load(self) -> None:
        from transformers import AutoModelForCausalLM, BitsAndBytesConfig, LlamaConfig, LlamaForCausalLM

        ckpt = Path(self.args.ckpt or f"/tmp/memory-bench-{self.model_name}")
        t = time.perf_counter()
        if not (ckpt / "config.json").is_file():
            torch.manual_seed(0)
            with torch.device(self.device):
                model = cast(Any, LlamaForCausalLM(LlamaConfig(**self.shape))).to(torch.bfloat16)
            model.save_pretrained(ckpt)
            del model
            free_memory(self.device)
        made_s = time.perf_counter() - t
        q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=torch.bfloat16)
        self.model = AutoModelForCausalLM.from_pretrained(
            ckpt, quantization_config=q, dtype=torch.bfloat16, device_map={"": self.device.index or 0}
            if self.device.type == "cuda" else {"": "cpu"}, attn_implementation="sdpa").eval()
        weights = model_weights_bytes(self.model, self.device)
        self.generate(torch.randint(100, 1000, (1, 8), device=self.device), 2)  # warm-up: cuBLAS workspace etc.
        allocated = torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else weights
        facts = ModelMemoryFacts.from_config(self.model.config, weights, torch.bfloat16, weight_quantization="nf4",
                                             device_type=self.device.type, workspace_bytes=max(0, allocated - weights))
        if self.smoke:  # CPU: no allocator reserve; a cap the seed crosses near 1,000 tokens unless one was given
            facts = replace(facts, reserve_fraction=0.0, reserve_fixed_bytes=0)
            if not self.args.smoke_cap_mib:
                self.cap_bytes = self.budget_bytes = predict_peak_bytes(facts, 1000, self.args.new_tokens).total_bytes
        self.facts = facts
        self.rec.set_summary(checkpoint_s=round(made_s, 1), load_s=round(time.perf_counter() - t - made_s, 1),
                         weights_bytes=weights, allocated_after_warmup_bytes=allocated,
                         workspace_bytes=facts.workspace_bytes, reserve_fraction=facts.reserve_fraction)

    # --- one reply ---------------------------------------------------------------------------------------------
    def generate(self, ids: torch.Tensor, new: int, cache: Any = None, timer: Timer | None = None) -> Any:
        from transformers import StoppingCriteriaList

        kwargs: dict[str, Any] = {}
        if cache is not None:
            kwargs[cache_kwarg(self.model)] = cache
        if timer is not None:
            kwargs["stopping_criteria"] = StoppingCriteriaList([timer])
        return self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                                   min_new_tokens=new, do_sample=False, use_cache=True, pad_token_id=0,
                                   return_dict_in_generate=True, **kwargs)

    def reply(self, *, phase: str, recipe: str, prompt: int, new: int, kv_cache: str = "bf16",
              chunk: int | None = None, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        """Run one reply, measure it, record it. OOM is caught, freed and recorded as crashed=True."""
        assert self.facts is not None
        pred = predict_peak_bytes(self.facts, prompt, new, kv_cache, prefill_chunk_tokens=chunk)
        record: dict[str, Any] = dict(
            phase=phase, recipe=recipe, model=self.model_name, quantization="nf4+double-quant, bf16 compute",
            kv_cache=kv_cache, prompt_tokens=prompt, new_tokens=new, prefill_chunk_tokens=chunk,
            predicted_peak_vram_bytes=pred.peak_allocated_bytes, predicted_total_bytes=pred.total_bytes,
            predicted_phase=pred.phase, peak_vram_bytes=None, peak_reserved_bytes=None, device=str(self.device),
            vram_cap_bytes=self.cap_bytes if phase != "a" else None, max_context_tokens=None, crashed=False,
            error=None, decode_tokens_per_s=None, ttft_s=None, cache_bytes=None, command=self.command)
        record.update(extra or {})
        ids = torch.randint(100, 30000 if not self.smoke else 1000, (1, prompt), device=self.device)
        cache = None
        timer = Timer(self.device)
        try:
            with PeakMeter(self.device) as meter:
                timer.start = time.perf_counter()
                if self.smoke and pred.total_bytes > self.cap_bytes and phase != "a":
                    self.faults.arm("prefill")  # emulated small card
                self.faults.check("prefill")
                if recipe == "ours" or kv_cache != "bf16":
                    cache = make_cache(kv_cache, self.model, capacity_tokens=prompt + new,
                                       quant=QuantizedKVSpec())
                    if chunk:
                        prefill_in_chunks(self.model, ids, cache, chunk)
                out = self.generate(ids, new, cache, timer)
                record["cache_bytes"] = cache_bytes(returned_cache(out), self.device)
                del out
        except Exception as exc:  # every case is isolated: record, free, go on
            self.faults.armed.clear()
            record["crashed"] = True
            record["error"] = ("OOM: " if is_oom_error(exc) else "") + f"{type(exc).__name__}: {exc}"[:400]
            if not is_oom_error(exc):
                record["traceback"] = traceback.format_exc()[-1500:]
        finally:
            cache = None
            free_memory(self.device)
        result = meter.result
        if result is not None:  # also for a crash: how far it got before the allocator gave up
            record["peak_vram_bytes"] = result.peak_allocated_bytes if self.device.type == "cuda" else None
            record["peak_reserved_bytes"] = result.peak_reserved_bytes if self.device.type == "cuda" else None
            record["peak_rss_bytes"] = result.peak_allocated_bytes if self.device.type == "cpu" else None
            record["seconds"] = round(result.seconds, 2)
            if record["peak_vram_bytes"] and not record["crashed"]:
                err = pred.peak_allocated_bytes - record["peak_vram_bytes"]
                record["prediction_error_bytes"] = err
                record["prediction_error_pct"] = round(100 * err / record["peak_vram_bytes"], 2)
                record["within_goal"] = abs(err) <= max(0.05 * record["peak_vram_bytes"], 128 * MiB)
        record["decode_tokens_per_s"] = timer.decode_tokens_per_s
        record["ttft_s"] = timer.ttft_s
        return self.rec.add(**record)

    def guarded(self, case: str, need_s: float, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """Run a case unless the deadline is near; a crash of the case itself is recorded, never fatal."""
        if self.left_s() < need_s:
            self.rec.add(phase=case, skipped=True, reason=f"deadline: {self.left_s():.0f} s left, {need_s} needed")
            return None
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            self.rec.add(phase=case, crashed=True, error=f"{type(exc).__name__}: {exc}"[:400],
                         traceback=traceback.format_exc()[-1500:])
            free_memory(self.device)
            return None

    # --- phases ------------------------------------------------------------------------------------------------
    def sizes(self, gpu: list[int], smoke: list[int]) -> list[int]:
        return smoke if self.smoke else gpu

    def phase_a(self) -> None:
        new = self.args.new_tokens
        for prompt in self.sizes([512, 4096, 16384], [64, 256, 1024]):
            self.guarded("a", 25, self.reply, phase="a", recipe="seed", prompt=prompt, new=new)
        for prompt in self.sizes([4096, 16384], [256, 1024]):
            self.guarded("a", 40, self.reply, phase="a", recipe="ours", prompt=prompt, new=new, kv_cache="int8",
                         chunk=self.args.chunk)

    def set_cap(self, on: bool) -> None:
        if self.device.type != "cuda":
            return
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        total = torch.cuda.get_device_properties(index).total_memory
        torch.cuda.set_per_process_memory_fraction(self.cap_bytes / total if on else 1.0, index)

    def phase_b_seed(self) -> int:
        """The seed recipe under the cap, prompt growing by `step` until it runs out of memory."""
        step, last_ok = self.args.step, 0
        for prompt in range(step, self.args.max_history + 1, step):
            rec = self.guarded("b", 30, self.reply, phase="b", recipe="seed", prompt=prompt,
                               new=self.args.new_tokens)
            if rec is None:
                break
            if rec["crashed"]:
                break
            last_ok = prompt
        self.rec.set_summary(seed_max_context_tokens=last_ok, seed_crashed_at=prompt if last_ok < prompt else None)
        return last_ok

    def phase_b_ours(self, kv_cache: str = "bf16") -> int:
        """Ours under the cap: history grows turn by turn; the planner caps the prompt (drops oldest turns)."""
        assert self.facts is not None
        new, chunk = self.args.new_tokens, self.args.chunk
        most = max_context_tokens(self.facts, self.budget_bytes, new, kv_cache, prefill_chunk_tokens=chunk)
        crashed = 0
        for history in range(self.args.step, self.args.max_history + 1, self.args.step):
            plan = plan_reply(self.facts, self.budget_bytes, history, new, kv_cache, min_prompt_tokens=256,
                              prefill_chunk_tokens=chunk)
            extra = {"history_tokens": history, "max_context_tokens": most, "plan_message": plan.message,
                     "budget_bytes": self.budget_bytes}
            if not plan.fits:  # refused with a message: nothing runs, nothing crashes
                self.rec.add(phase="b", recipe="ours", kv_cache=kv_cache, refused=True, crashed=False, **extra)
                continue
            rec = self.guarded("b", 30, self.reply, phase="b", recipe="ours", prompt=plan.allowed_prompt_tokens,
                               new=plan.allowed_new_tokens, kv_cache=kv_cache, chunk=chunk, extra=extra)
            if rec is None:
                break
            crashed += bool(rec["crashed"])
        self.rec.set_summary(**{f"ours_{kv_cache}_max_context_tokens": most, f"ours_{kv_cache}_crashes": crashed})
        return most

    def phase_c(self, seed_max: int) -> None:
        """Longest context with the quantized KV cache under the cap, run at the planner's maximum."""
        assert self.facts is not None
        new, chunk = self.args.new_tokens, self.args.chunk
        most = max_context_tokens(self.facts, self.budget_bytes, new, "int8", prefill_chunk_tokens=chunk)
        rec = self.guarded("c", 60, self.reply, phase="c", recipe="ours", prompt=most, new=new,
                           kv_cache="int8", chunk=chunk, extra={"max_context_tokens": most,
                                                                     "budget_bytes": self.budget_bytes})
        ok = rec is not None and not rec["crashed"]
        self.rec.set_summary(ours_quantized_max_context_tokens=most, ours_quantized_ran_at_max=ok,
                         context_ratio_vs_seed=round(most / seed_max, 2) if seed_max else None,
                         ours_quantized_decode_tokens_per_s=rec and rec["decode_tokens_per_s"])

    def phase_d(self) -> None:
        prompt = self.sizes([4096], [256])[0]
        self.guarded("d", 60, self.reply, phase="d", recipe="ours", prompt=prompt, new=32, kv_cache="offload",
                     chunk=self.args.chunk)

    def run(self) -> None:
        self.load()
        phases = set(self.args.phases.split(","))
        if "a" in phases:
            self.phase_a()
        self.set_cap(True)
        seed_max = 0
        try:
            if "b" in phases:
                seed_max = self.phase_b_seed()
                seed_runs = [r for r in self.rec.records if r.get("phase") == "b" and r.get("recipe") == "seed"
                             and not r.get("crashed")]
                if seed_runs:
                    self.rec.set_summary(seed_decode_tokens_per_s_at_max=seed_runs[-1]["decode_tokens_per_s"])
            if "c" in phases:
                self.phase_c(seed_max)
            if "b" in phases:
                self.phase_b_ours("bf16")
            if "d" in phases and self.device.type == "cuda":
                self.phase_d()
        finally:
            self.set_cap(False)
        self.rec.set_summary(total_s=round(time.perf_counter() - self.t0, 1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "/tmp"), "memory.json"))
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny random llama on CPU, emulated cap")
    parser.add_argument("--expandable-segments", action="store_true",
                        help="PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True for the whole run (what the app sets)")
    parser.add_argument("--cap-gib", type=float, default=8.0, help="simulated card size for phases b-d")
    parser.add_argument("--smoke-cap-mib", type=float, default=0.0, help="CPU smoke: emulated cap (0 = auto)")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--step", type=int, default=2048, help="history growth per turn (tokens)")
    parser.add_argument("--max-history", type=int, default=32768)
    parser.add_argument("--chunk", type=int, default=2048, help="ours: prefill chunk (tokens)")
    parser.add_argument("--phases", default="a,b,c,d")
    parser.add_argument("--deadline-s", type=float, default=450.0, help="start no new case after this")
    parser.add_argument("--ckpt", default=None, help="random checkpoint folder (made when missing)")
    args = parser.parse_args(argv)
    if args.cpu_smoke:
        args.new_tokens = min(args.new_tokens, 8)
        args.step, args.max_history, args.chunk = 512, 2560, 128
    Bench(args).run()
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
