"""Decode attention over the KV cache's row formats on the GPU: one query row (and 8) over a long cache, the slots
form and the paged form, bf16 rows, int8 rows padded to head_dim + 4 bytes (the cache's layout) and + 16 (the
layout before 2026-12-05) and int4 rows, timed in CUDA graphs (llm_core.fast.timing: 20 replays of 50 calls each).

    python -m bench.attention_rows --out results.json [--tokens 9000] [--heads 32]

With --sweep: the split kernel's launch (llm_core.fast.kernels.attention.AttentionLaunch: rows per inner step, warps,
pipeline stages, programs per SM) per row format (bf16, int8 + 4, int4), 1 and 8 rows (--sweep-rows) and each of
--sweep-tokens, the paged form (16-token blocks) only. Every launch is timed at 1 row (--probe-rows) and 9,000 tokens
(--probe-tokens), a short timing
each; the best few of each format, the default and the best kernel at every programs_per_sm are then timed at every
length and row count. Kernels are compiled beforehand in --compile-workers processes (the Triton cache on disk keeps
them for this one). The sweep stops at --budget-s and writes what it has; its JSON's `suggested` entries are what
ATTENTION_LAUNCHES takes.

    python -m bench.attention_rows --sweep --out sweep.json [--sweep-tokens 2048,9000,14000,26000] [--budget-s 150]
    python -m bench.attention_rows --sweep --sweep-rows 32 --probe-rows 32 --sweep-tokens 576,1024,2048,4096 \
        --probe-tokens 1024 --out sweep-32.json      # the rows bucket above 8 (ATTENTION_LAUNCHES' 64): 32 chats
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
import time
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import asdict
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import torch

SWEEP_FORMATS = ("bf16", "int8", "int4")
SWEEP_ROWS = (1, 8)
SWEEP_BLOCK_L = (32, 64, 128)
SWEEP_WARPS = (2, 4, 8)
SWEEP_STAGES = (None, 2, 3, 4)
SWEEP_PROGRAMS_PER_SM = (2, 4, 8, 16)
SWEEP_PAGE = 16
SWEEP_TOP = 6  # launches of each format timed past the probe, besides the default and the best kernel's siblings
HEAD_DIM, QUERY_HEADS = 128, 32


def padded(rows: torch.Tensor, pad: int) -> torch.Tensor:
    """int8 rows (..., D + 4) re-laid with `pad` bytes after the D codes (the exponent first)."""
    d = rows.shape[-1] - 4
    out = torch.zeros((*rows.shape[:-1], d + pad), dtype=rows.dtype, device=rows.device)
    out[..., :d + 1] = rows[..., :d + 1]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tokens", type=int, default=9000)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--sweep", action="store_true", help="sweep the split kernel's launch (the module's docstring)")
    ap.add_argument("--sweep-tokens", default="2048,9000,14000,26000", help="comma-separated cache lengths")
    ap.add_argument("--probe-tokens", type=int, default=9000, help="the length every launch is timed at")
    ap.add_argument("--sweep-rows", default="1,8", help="comma-separated query row counts of the full timings")
    ap.add_argument("--probe-rows", type=int, default=1, help="the row count every launch is timed at")
    ap.add_argument("--formats", default=",".join(SWEEP_FORMATS), help="comma-separated row formats the sweep times")
    ap.add_argument("--budget-s", type=float, default=150.0, help="the sweep stops here and writes what it has")
    ap.add_argument("--compile-workers", type=int, default=min(12, max(1, (os.cpu_count() or 2) - 2)),
                    help="processes compiling the sweep's kernels ahead (0: each compiles when first launched)")
    args = ap.parse_args()
    try:
        sweep_tokens = sorted({int(t) for t in args.sweep_tokens.split(",") if t.strip()} | {args.probe_tokens})
    except ValueError:
        ap.error(f"--sweep-tokens takes comma-separated integers, not {args.sweep_tokens!r}")
    try:
        sweep_rows = sorted({int(r) for r in args.sweep_rows.split(",") if r.strip()})
    except ValueError:
        ap.error(f"--sweep-rows takes comma-separated integers, not {args.sweep_rows!r}")
    if not sweep_rows or min(sweep_rows + [args.probe_rows]) < 1:
        ap.error("row counts must be 1 or more")
    formats = tuple(f for f in args.formats.split(",") if f)
    if not formats or set(formats) - set(SWEEP_FORMATS):
        ap.error(f"--formats takes comma-separated names from {SWEEP_FORMATS}, not {args.formats!r}")
    if min(sweep_tokens) < SWEEP_PAGE:
        ap.error(f"every length must be at least one {SWEEP_PAGE}-token block")
    if not torch.cuda.is_available():
        print("bench.attention_rows times the Triton decode attention on a CUDA GPU; none is available here",
              file=sys.stderr)
        return 2
    if args.sweep:
        return sweep(args.out, args.heads, sweep_tokens, args.probe_tokens, args.budget_s, args.compile_workers,
                     rows=tuple(sweep_rows), probe_rows=args.probe_rows, formats=formats)
    from llm_core.fast import kvquant
    from llm_core.fast.kernels import attention  # noqa: F401 - registers the ops
    from llm_core.fast.timing import time_in_cuda_graph

    dev, d, hkv, page = torch.device("cuda"), 128, args.heads, 16
    t = args.tokens // page * page  # whole blocks: the paged form reads the same rows
    g = torch.Generator(device=dev).manual_seed(0)
    results = []
    for rows_n in (1, 8):
        q = torch.randn(rows_n, 32, d, device=dev, generator=g, dtype=torch.bfloat16)
        pos = torch.full((rows_n,), t - 1, dtype=torch.long, device=dev)
        k = torch.randn(rows_n, t, hkv, d, device=dev, generator=g, dtype=torch.bfloat16)
        v = torch.randn(rows_n, t, hkv, d, device=dev, generator=g, dtype=torch.bfloat16)
        kq, vq = kvquant.quantize_rows(k), kvquant.quantize_rows(v)
        k4, v4 = kvquant.quantize_rows4(k), kvquant.quantize_rows4(v)
        blocks = t // page
        for fmt, kk, vv in (("bf16", k, v), ("int8+4", kq, vq), ("int8+16", padded(kq, 16), padded(vq, 16)),
                            ("int4", k4, v4)):
            us = time_in_cuda_graph(lambda q=q, kk=kk, vv=vv, pos=pos: torch.ops.llm_core.decode_attention_rows(
                q, kk, vv, pos, d ** -0.5), reps=50)
            pool_k = kk.reshape(rows_n * blocks, page, hkv, kk.shape[-1])
            pool_v = vv.reshape(rows_n * blocks, page, hkv, vv.shape[-1])
            table = torch.arange(rows_n * blocks, dtype=torch.int32, device=dev).view(rows_n, blocks)
            table = table[:, torch.randperm(blocks, device=dev)].contiguous()  # the same rows, shuffled blocks
            us_paged = time_in_cuda_graph(lambda q=q, a=pool_k, b=pool_v, tb=table, pos=pos:
                             torch.ops.llm_core.decode_attention_paged(q, a, b, tb, pos, d ** -0.5), reps=50)
            nbytes = 2 * rows_n * t * hkv * kk.shape[-1] * kk.element_size()
            rec = {"rows": rows_n, "tokens": t, "kv_heads": hkv, "format": fmt, "row_bytes": kk.shape[-1] *
                   kk.element_size(), "slots_us": round(us, 1), "paged_us": round(us_paged, 1),
                   "slots_gbps": round(nbytes / us / 1e3, 1), "paged_gbps": round(nbytes / us_paged / 1e3, 1)}
            print(json.dumps(rec), flush=True)
            results.append(rec)
    args.out.write_text(json.dumps({"bench": "attention_rows", "device": torch.cuda.get_device_name(),
                                    "torch": torch.__version__, "records": results}, indent=1))
    return 0


# --- the launch sweep (--sweep) ---------------------------------------------------------------------------------


def sweep_launches() -> tuple[list[Any], int | None]:
    """Every launch of the sweep's grid, the default first, and Triton's default num_stages (None and that number
    compile the same kernel: the number is left out)."""
    from llm_core.fast.kernels.attention import AttentionLaunch

    try:
        from triton.backends.nvidia.compiler import CUDAOptions

        default_stages: int | None = CUDAOptions.num_stages
    except (ImportError, AttributeError):  # pragma: no cover - depends on the Triton build
        default_stages = None
    stages = [s for s in SWEEP_STAGES if s is None or s != default_stages]
    grid = [AttentionLaunch(block_l=b, num_warps=w, num_stages=st, programs_per_sm=p)
            for b, w, st, p in itertools.product(SWEEP_BLOCK_L, SWEEP_WARPS, stages, SWEEP_PROGRAMS_PER_SM)]
    default = AttentionLaunch()
    return [default, *[launch for launch in grid if launch != default]], default_stages


def launch_name(launch: Any) -> str:
    stages = "d" if launch.num_stages is None else launch.num_stages
    return f"l{launch.block_l}-w{launch.num_warps}-s{stages}-p{launch.programs_per_sm}"


def kernel_of(launch: Any) -> tuple[int, int, int | None]:
    """What a launch compiles: programs_per_sm only changes the grid (and the combine kernel's split count)."""
    return launch.block_l, launch.num_warps, launch.num_stages


def _compile_job(device: str, fmt: str, rows: int, width: int, kv_heads: int, row_len: int, dtype: str,
                 launches: list[dict[str, Any]]) -> list[str]:
    """In a worker process: run each launch once over tensors shaped as the sweep's but for a one-block pool, so that
    Triton compiles (into its cache on disk) the kernels the sweep's own launches will look up: the same dtypes,
    strides, block table width, row count and split count, so the same specialization. Errors are returned, not
    raised: the sweep meets and records them itself."""
    from llm_core.fast.kernels import attention

    dev = torch.device(device)
    k = torch.zeros(1, SWEEP_PAGE, kv_heads, row_len, dtype=getattr(torch, dtype), device=dev)
    q = torch.zeros(rows, QUERY_HEADS, HEAD_DIM, dtype=torch.bfloat16, device=dev)
    table = torch.zeros(rows, width, dtype=torch.int32, device=dev)
    pos = torch.zeros(rows, dtype=torch.long, device=dev)
    errors = []
    for kw in launches:
        try:
            attention._attend_rows(q, k, k.clone(), pos, HEAD_DIM ** -0.5, table, attention.AttentionLaunch(**kw))
        except Exception as e:  # noqa: BLE001 - a launch that fails to compile is a result of the sweep
            errors.append(f"{kw}: {type(e).__name__}: {e}"[:300])
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return errors


class Budget:
    """The sweep's wall-clock budget: `left()` seconds until `budget_s` after the start."""

    def __init__(self, budget_s: float) -> None:
        self.start = time.monotonic()
        self.budget_s = budget_s

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def left(self) -> float:
        return self.budget_s - self.elapsed()


class BudgetReached(Exception):
    pass


class Precompiler:
    """_compile_job over lists of jobs in `workers` spawned processes, kept between the sweep's two phases (Triton
    compiles on one CPU core, about a second a kernel: the sweep's 100-odd kernels one by one would take most of its
    budget). A run stops at the budget, its workers then ended. Nothing is timed while one runs: the workers'
    launches would disturb the timings."""

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self.executor: ProcessPoolExecutor | None = None

    def run(self, jobs: list[tuple[Any, ...]], budget: Budget) -> dict[str, Any]:
        if self.workers <= 0 or not jobs:
            return {"jobs": len(jobs), "workers": 0, "s": 0.0}
        t0 = time.monotonic()
        from bench import attention_rows as this  # a module path the spawned workers import

        workers = self.workers
        pending: set[Future[list[str]]] = set()
        errors: list[str] = []
        try:
            if self.executor is None:
                self.executor = ProcessPoolExecutor(max_workers=self.workers, mp_context=get_context("spawn"))
            pending = {self.executor.submit(this._compile_job, *job) for job in jobs}
            while pending and budget.left() > 0:
                done, pending = wait(pending, timeout=min(5.0, max(0.1, budget.left())),
                                     return_when=FIRST_COMPLETED)
                for fut in done:
                    errors += fut.result()
        except Exception as e:  # noqa: BLE001 - a broken pool: the sweep compiles each kernel at its first launch
            errors.append(f"precompile: {type(e).__name__}: {e}"[:300])
            self.workers = 0
        if pending or not self.workers:
            self.close(abandon=True)
        return {"jobs": len(jobs), "workers": workers, "unfinished": len(pending),
                "s": round(time.monotonic() - t0, 1), "errors": errors[:20]}

    def close(self, abandon: bool = False) -> None:
        if self.executor is None:
            return
        if abandon:  # the budget is spent: our own workers, ended one by one
            for proc in list((getattr(self.executor, "_processes", None) or {}).values()):
                proc.terminate()
        self.executor.shutdown(wait=not abandon, cancel_futures=True)
        self.executor = None


def quantized_pool(pool: torch.Tensor, fmt: str) -> torch.Tensor:
    """The bf16 pool in the cache's row format, quantized 1024 blocks at a time (kvquant's fp32 temporaries of the
    whole pool would take several times its size)."""
    from llm_core.fast import kvquant

    if fmt == "bf16":
        return pool
    quantize = kvquant.quantize_rows if fmt == "int8" else kvquant.quantize_rows4
    return torch.cat([quantize(pool[i:i + 1024]) for i in range(0, pool.shape[0], 1024)])


def sweep(out: Path, kv_heads: int, tokens: list[int], probe_tokens: int, budget_s: float, workers: int,
          dev: torch.device | None = None, rows: tuple[int, ...] = SWEEP_ROWS, probe_rows: int = 1,
          formats: tuple[str, ...] = SWEEP_FORMATS) -> int:
    """The launch sweep (see the module's docstring): a pool of random bf16 K/V blocks for the most rows at the longest
    length, in each row format; per (rows, length) a block table of distinct shuffled blocks, every row at its last
    position. Each timing is a CUDA graph of calls (llm_core.fast.timing), short for the probe of every launch,
    longer for the candidates; each launch's output is checked once against the default launch's (max abs diff)."""
    from llm_core.fast.kernels import attention
    from llm_core.fast.timing import time_in_cuda_graph

    budget = Budget(budget_s)
    dev = dev or torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    launches, default_stages = sweep_launches()
    default = launches[0]
    by_name = {launch_name(launch): launch for launch in launches}
    width_max = max(tokens) // SWEEP_PAGE
    num_blocks = max(*rows, probe_rows) * width_max
    k16 = torch.randn(num_blocks, SWEEP_PAGE, kv_heads, HEAD_DIM, device=dev, generator=g, dtype=torch.bfloat16)
    v16 = torch.randn(num_blocks, SWEEP_PAGE, kv_heads, HEAD_DIM, device=dev, generator=g, dtype=torch.bfloat16)
    pools = {fmt: (quantized_pool(k16, fmt), quantized_pool(v16, fmt)) for fmt in formats}
    cases: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}
    for n, t in itertools.product(sorted({*rows, probe_rows}), tokens):
        width = t // SWEEP_PAGE
        table = torch.randperm(num_blocks, device=dev, generator=g)[:n * width].view(n, width)
        q = torch.randn(n, QUERY_HEADS, HEAD_DIM, device=dev, generator=g, dtype=torch.bfloat16)
        cases[(n, t)] = (q, table.to(torch.int32).contiguous(),
                         torch.full((n,), width * SWEEP_PAGE - 1, dtype=torch.long, device=dev))
    torch.cuda.synchronize()
    scale = HEAD_DIM ** -0.5
    records: list[dict[str, Any]] = []
    references: dict[tuple[str, int, int], torch.Tensor] = {}
    compiles: list[dict[str, Any]] = []
    stopped: str | None = None
    compiler = Precompiler(workers)

    def jobs_for(fmt: str, rows: int, t: int, chosen: list[Any]) -> list[tuple[Any, ...]]:
        k = pools[fmt][0]
        kernels: dict[tuple[int, int, int | None], list[dict[str, Any]]] = {}
        for launch in chosen:
            kernels.setdefault(kernel_of(launch), []).append(asdict(launch))
        return [(str(dev), fmt, rows, t // SWEEP_PAGE, kv_heads, k.shape[-1], str(k.dtype).removeprefix("torch."), kw)
                for kw in kernels.values()]

    def measure(fmt: str, rows: int, t: int, launch: Any, phase: str) -> dict[str, Any]:
        """One timing, recorded; a launch that fails records its error."""
        if budget.left() <= 0:
            raise BudgetReached
        k, v = pools[fmt]
        q, table, pos = cases[(rows, t)]
        t_eff = table.shape[1] * SWEEP_PAGE
        nbytes = 2 * rows * t_eff * kv_heads * k.shape[-1] * k.element_size()  # K and V rows, scales and padding
        rec: dict[str, Any] = {"phase": phase, "format": fmt, "rows": rows, "tokens": t_eff,
                               "launch": launch_name(launch), **asdict(launch)}
        try:
            t0 = time.monotonic()
            got = attention._attend_rows(q, k, v, pos, scale, table, launch)
            torch.cuda.synchronize()
            rec["first_call_s"] = round(time.monotonic() - t0, 3)  # a compile, or a load from Triton's cache
            key = (fmt, rows, t)
            if key not in references:
                references[key] = got if launch == default else attention._attend_rows(q, k, v, pos, scale, table,
                                                                                        default)
            rec["max_abs_diff"] = float((got.float() - references[key].float()).abs().max())
            # about 20 ms of replays for the probe and 60 ms for the candidates, at an assumed 1.5 TB/s
            replays, target_us = (10, 2e4) if phase == "probe" else (20, 6e4)
            reps = min(50, max(2, round(target_us / (replays * nbytes / 1.5e6))))
            us = time_in_cuda_graph(lambda: attention._attend_rows(q, k, v, pos, scale, table, launch), reps=reps,
                                    replays=replays)
            rec.update(us=round(us, 2), gbps=round(nbytes / us / 1e3, 1), reps=reps, replays=replays)
        except Exception as e:  # noqa: BLE001 - compile errors, out of shared memory: recorded, the sweep goes on
            torch.cuda.synchronize()
            rec["error"] = f"{type(e).__name__}: {e}"[:500]
        records.append(rec)
        return rec

    candidates: dict[str, list[Any]] = {}
    try:
        probe_jobs = [job for fmt in formats for job in jobs_for(fmt, probe_rows, probe_tokens, launches)]
        compiles.append({"phase": "probe", **compiler.run(probe_jobs, budget)})
        print(f"# {len(launches)} launches per format; compiled ahead in {compiles[-1]['s']} s", flush=True)
        for fmt in formats:  # phase 1: every launch at 1 row and the probe length
            probe = [measure(fmt, probe_rows, probe_tokens, launch, "probe") for launch in launches]
            timed = sorted((r for r in probe if "us" in r), key=lambda r: r["us"])
            chosen = [by_name[r["launch"]] for r in timed[:SWEEP_TOP]]
            if timed:  # the best kernel at every programs_per_sm: 8 rows share the SMs otherwise than 1
                best = by_name[timed[0]["launch"]]
                chosen += [lau for lau in launches if kernel_of(lau) == kernel_of(best)]
            chosen.append(default)
            candidates[fmt] = list(dict.fromkeys(chosen))
            print(f"# {fmt} probe ({probe_tokens} tokens, {probe_rows} rows): " + ", ".join(
                f"{r['launch']} {r['us']} µs" for r in timed[:SWEEP_TOP]), flush=True)
        full = [(n, t) for n, t in cases if n in rows]
        full_jobs = [job for n, t in full for fmt in formats for job in jobs_for(fmt, n, t, candidates[fmt])]
        compiles.append({"phase": "candidates", **compiler.run(full_jobs, budget)})
        compiler.close()
        # phase 2: the candidates at every length and row count, timed longer; the fewest rows (a lone chat) first
        for n, t in full:
            for fmt in formats:
                for launch in candidates[fmt]:
                    measure(fmt, n, t, launch, "full")
    except BudgetReached:
        stopped = f"the budget of {budget_s} s was reached after {len(records)} timings"
        print(f"# {stopped}", flush=True)
    finally:
        compiler.close(abandon=True)
    best, suggested = best_tables(records, default)
    buckets = bucket_suggestions(records, default, attention.LAUNCH_ROW_BUCKETS)
    result = {"bench": "attention_rows --sweep", "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "triton": attention.triton.__version__, "kv_heads": kv_heads, "query_heads": QUERY_HEADS,
              "head_dim": HEAD_DIM, "page": SWEEP_PAGE, "tokens": tokens, "probe_tokens": probe_tokens,
              "triton_default_num_stages": default_stages, "elapsed_s": round(budget.elapsed(), 1),
              "budget_s": budget_s, "stopped": stopped, "compiles": compiles,
              "candidates": {fmt: [launch_name(la) for la in c] for fmt, c in candidates.items()},
              "best": best, "suggested": suggested, "buckets": buckets, "records": records}
    out.write_text(json.dumps(result, indent=1))
    print_summary(result)
    return 0


def best_tables(records: list[dict[str, Any]], default: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """`best`: per (format, rows, tokens) the fastest launch beside the default's time (the longer timings where a
    case has them); `suggested`: per (format, rows) the launch with the lowest geometric mean of its time over the
    default's across the lengths it was timed at all of (an ATTENTION_LAUNCHES entry)."""
    default_name = launch_name(default)
    groups: dict[tuple[str, int, int], list[dict[str, Any]]] = {}
    for r in records:
        if "us" in r:
            groups.setdefault((r["format"], r["rows"], r["tokens"]), []).append(r)
    best = []
    per_launch: dict[tuple[str, int], dict[str, dict[int, float]]] = {}
    for (fmt, rows, t), recs in sorted(groups.items()):
        if any(r["phase"] == "full" for r in recs):
            recs = [r for r in recs if r["phase"] == "full"]
        top = min(recs, key=lambda r: r["us"])
        base = next((r["us"] for r in recs if r["launch"] == default_name), None)
        best.append({"format": fmt, "rows": rows, "tokens": t, "best": top["launch"], "best_us": top["us"],
                     "best_gbps": top["gbps"], "default_us": base,
                     "speedup": round(base / top["us"], 3) if base else None})
        if base:
            for r in recs:
                per_launch.setdefault((fmt, rows), {}).setdefault(r["launch"], {})[t] = r["us"] / base
    suggested = []
    for (fmt, rows), ratios in sorted(per_launch.items()):
        lengths = max(len(by_t) for by_t in ratios.values())
        full = {name: by_t for name, by_t in ratios.items() if len(by_t) == lengths}
        name, by_t = min(full.items(), key=lambda item: sum(math.log(x) for x in item[1].values()))
        geo = math.exp(sum(math.log(x) for x in by_t.values()) / len(by_t))
        lau = [r for r in records if r.get("launch") == name][0]
        entry = (f'("{fmt}", {rows}): AttentionLaunch(block_l={lau["block_l"]}, num_warps={lau["num_warps"]}, '
                 f'num_stages={lau["num_stages"]}, programs_per_sm={lau["programs_per_sm"]}),')
        suggested.append({"format": fmt, "rows": rows, "launch": name, "lengths": sorted(by_t),
                          "time_vs_default_geomean": round(geo, 3), "entry": entry})
    return best, suggested


def bucket_suggestions(records: list[dict[str, Any]], default: Any, buckets: tuple[int, ...]
                       ) -> list[dict[str, Any]]:
    """Per format and ATTENTION_LAUNCHES rows bucket (the smallest of `buckets` holding a row count), the launch
    with the lowest geometric mean of its time over the default's across every (rows, tokens) case of that bucket
    it was timed at all of (the longer timings only): the bucket's entry where several row counts share it (9-64
    rows: 16 and 32 chats). `arg` is bench.batched's --attention-launch for it."""
    default_name = launch_name(default)
    full = [r for r in records if "us" in r and r["phase"] == "full"]
    cases: dict[tuple[str, int], dict[tuple[int, int], dict[str, float]]] = {}
    for r in full:
        bucket = next((b for b in buckets if r["rows"] <= b), buckets[-1])
        cases.setdefault((r["format"], bucket), {}).setdefault((r["rows"], r["tokens"]), {})[r["launch"]] = r["us"]
    out = []
    for (fmt, bucket), by_case in sorted(cases.items()):
        by_case = {c: t for c, t in by_case.items() if default_name in t}
        names = set.intersection(*(set(t) for t in by_case.values())) if by_case else set()
        if not names:
            continue
        geo = {n: math.exp(sum(math.log(t[n] / t[default_name]) for t in by_case.values()) / len(by_case))
               for n in names}
        name = min(geo, key=lambda n: geo[n])
        out.append({"format": fmt, "bucket": bucket, "launch": name, "cases": sorted(by_case),
                    "time_vs_default_geomean": round(geo[name], 3), "arg": f"{fmt}:{bucket}={name}"})
    return out


def print_summary(result: dict[str, Any]) -> None:
    errors = [r for r in result["records"] if "error" in r]
    diffs = [r["max_abs_diff"] for r in result["records"] if "max_abs_diff" in r]
    print(f"# {result['device']}: {len(result['records'])} timings in {result['elapsed_s']} s, {len(errors)} failed"
          + (f", max abs diff to the default {max(diffs):.3g}" if diffs else ""))
    for r in errors[:5]:
        print(f"#   failed {r['format']} {r['launch']}: {r['error'][:160]}")
    print(f"{'format':6} {'rows':>4} {'tokens':>6} {'default µs':>10} {'best µs':>8} {'GB/s':>6} {'x':>6}  best")
    for b in result["best"]:
        print(f"{b['format']:6} {b['rows']:>4} {b['tokens']:>6} {b['default_us'] or '-':>10} {b['best_us']:>8} "
              f"{b['best_gbps']:>6} {b['speedup'] or '-':>6}  {b['best']}")
    for s in result["suggested"]:
        print(f"# suggested {s['entry']}  # {s['time_vs_default_geomean']}x the default's time over {s['lengths']}")
    for b in result.get("buckets", []):
        print(f"# bucket {b['arg']}  # {b['time_vs_default_geomean']}x the default's time over {len(b['cases'])} "
              f"cases (rows, tokens)")
    if result["stopped"]:
        print(f"# stopped early: {result['stopped']}")


if __name__ == "__main__":
    raise SystemExit(main())
