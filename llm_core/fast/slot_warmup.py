"""SlotDecoder's start-up passes: allocating the slots, the rows kernels' pick, compiling the prefill, the step and the
group prefill, capturing the step's and the whole-prompt prefill's CUDA graphs. Nothing here runs per reply.

SlotWarmup is SlotDecoder's start-up half (as fast/warmup.py's DecoderWarmup is FastDecoder's): SlotDecoder inherits
it and owns the state it reads and writes (the slots, the pool, the functions and graphs of llm_core.fast.batched)."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import torch

from .layer import _split_linears, linear_prefill
from .rows import ROWS_KERNELS, RowsPlan, fused_rows, linear_rows, nf4_rows_linear, pick_rows_plan
from .timing import time_in_cuda_graph

log = logging.getLogger(__name__)

# the group prefill warmed at start-up: two rows each time, the longer this long (2 x 200 and 2 x 201 padded rows: a
# multiple of 16 and not, the two specializations a Triton kernel compiles for a row count)
WARM_GROUP_LENGTHS = (200, 201)


class SlotWarmup:
    """Start-up passes of SlotDecoder; see the module docstring."""

    # What the passes below set (declared here for the type checker; initialised by SlotDecoder.__init__)
    rows_max: RowsPlan | int
    rows_timings_us: dict[int, dict[str, float]]
    warmup_s: float | None
    notes: list[str]
    _pool: Any

    if TYPE_CHECKING:  # the slots, pool, functions and graphs, defined by SlotDecoder
        def __getattr__(self, name: str) -> Any: ...

    def warmup(self) -> float:
        """Allocate the slots; on CUDA check the rows kernels against their references, compile the step and capture
        one graph per batch bucket (each a fallback to the next simpler form if it fails, said in `notes`)."""
        t0 = time.perf_counter()
        with torch.inference_mode(False), torch.no_grad():
            self.allocate()
            if self.device.type == "cuda":
                self._pick_rows_kernel()
                if self.compile:
                    self._warm_prefill()
                    self._compile_step()
                self._warm_prefill_rows(compiled=self.compile and self.fast._prefill_compiled_ok)
                if self.use_graphs:
                    self._capture()
                    self._capture_prefill()
            self.release_all()
        self.warmup_s = round(time.perf_counter() - t0, 3)
        return self.warmup_s

    def _pick_rows_kernel(self) -> None:
        """The kernel for NF4 linears over B > 1 rows, per batch bucket: llm_core.nf4_mm checked against dequantize +
        matmul on the first layer's NF4 linears for a batch of 8 (relative error < 2%, the bf16 rounding of the
        weights and products), then every candidate (nf4_mm if it passed, bitsandbytes' gemm_4bit, dequantize +
        matmul) timed there inside a CUDA graph at every bucket above 1, as layer_rows runs them; each bucket takes
        its fastest (pick_rows_plan). A candidate that fails to run is left out; dequantize + matmul always runs."""
        spec = self.fast._layer_specs[0]
        nf4 = [i for i, s in enumerate(spec.linears) if s.fmt == "nf4" and s.levels]
        if not nf4 or self.fast.dtype != torch.bfloat16:
            return
        from .kernels.nf4_mm import triton

        lins = _split_linears(spec, self.fast._layer_weights[0])
        candidates = list(ROWS_KERNELS)
        if any(spec.linears[i].frag for i in nf4):  # NF4_FRAG=on: the fragment-order copy's kernel too
            candidates.append("frag")
        worst = 0.0
        for kernel in [k for k in candidates if k in ("mm", "frag")]:
            try:
                if triton is None:
                    raise RuntimeError("Triton is not installed")
                err = 0.0
                for i in nf4:
                    s = spec.linears[i]
                    x = torch.randn(8, s.k, dtype=torch.bfloat16, device=self.device)
                    got = nf4_rows_linear(kernel, s, x, lins[i]).float()
                    ref = linear_prefill(s, x, lins[i], gemm=False).float()
                    err = max(err, float((got - ref).norm() / ref.norm().clamp_min(1e-6)))
                worst = max(worst, err)
                if err >= 0.02:
                    self.notes.append(f"NF4 rows kernel {kernel} off: relative error {err:.3f} vs dequantize + matmul")
                    candidates.remove(kernel)
            except Exception as exc:  # noqa: BLE001 - dequantize + matmul always works; say why it is used
                log.warning("NF4 rows kernel %s unavailable: %s: %s", kernel, type(exc).__name__, exc)
                self.notes.append(f"NF4 rows kernel {kernel} off ({type(exc).__name__}: {str(exc)[:120]})")
                candidates.remove(kernel)
        timings: dict[int, dict[str, float]] = {}
        for m in (b for b in self.buckets() if b > 1):
            xs = {i: torch.randn(m, spec.linears[i].k, dtype=torch.bfloat16, device=self.device) for i in nf4}
            timings[m] = {}
            for kernel in candidates:
                plan = RowsPlan(((m, kernel),))

                def run(plan: RowsPlan = plan, xs: dict[int, torch.Tensor] = xs) -> None:
                    for i in nf4:  # as layer_rows runs them
                        s = spec.linears[i]
                        if len(s.splits) > 1:
                            fused_rows(s, xs[i], lins[i], plan)
                        else:
                            linear_rows(s, xs[i], lins[i], plan)

                try:
                    timings[m][kernel] = round(time_in_cuda_graph(run, self.device, replays=5, warmups=2), 1)
                except Exception as exc:  # noqa: BLE001 - a candidate that cannot run is not chosen
                    log.warning("rows kernel %s not timed at %d rows: %s: %s", kernel, m, type(exc).__name__, exc)
        self.rows_max = pick_rows_plan(timings)
        shown = "; ".join(f"{m} rows " + ", ".join(f"{k} {v:.0f}" for k, v in t.items()) + " µs"
                          for m, t in sorted(timings.items()))
        chosen = ", ".join(f"{b}: {k}" for b, k in self.rows_max.kernels)
        self.notes.append(f"NF4 rows kernels per batch ({chosen}); largest relative error {worst:.4f}"
                          + (f"; first layer's NF4 linears: {shown}" if shown else ""))
        self.rows_timings_us = timings
        self._make_functions(compiled=False)

    def _warm_prefill(self) -> None:
        """Compile the fast path's prefill layer for every shape class a reply meets (FastDecoder never warms it here:
        its own cache is not allocated): from position 0, and chunks after cached rows at two starts and lengths, so
        that dynamo makes both the length and the start symbolic here, not inside a reply."""
        if not self.fast._prefill_compiled_ok:
            return
        first = max(4, min(71, (self.reply_tokens - 2) // 3))
        start = 0
        if self.paged:
            self.set_blocks(0, range(self.num_blocks))
        try:
            for length in (first, first - 1, first - 2):
                ids = (torch.arange(length, device=self.device) * 7 + 3) % self.fast._arch.vocab
                self.prefill(0, ids, start)
                start += length
            self.sync()
        except Exception as exc:  # noqa: BLE001 - the eager prefill is the same math
            log.warning("Compiled prefill unavailable (%s: %s); the prefill runs eagerly.", type(exc).__name__, exc)
            self.notes.append(f"prefill eager: compiling it failed ({type(exc).__name__})")
            self.fast._prefill_compiled_ok = False

    def _warm_prefill_rows(self, compiled: bool = False) -> bool:
        """Run the group prefill (prefill_rows: newcomers arriving together) twice, with two rows of unequal lengths
        (WARM_GROUP_LENGTHS), so its first-call costs are paid at start-up and not by the first group of users: the
        compile (`compiled`: one graph, its rows, length and positions symbolic; eager if compiling fails, said in
        `notes`), the CUDA modules of its kernels loaded at their first launch, the GEMM plans of a new shape,
        Triton's specializations. On 2026-12-05 (s5, H100) the first group of 8 chats after start-up got its first
        tokens ~100 ms later than the same group run again. Returns whether it ran (not where two rows of its
        longest length do not fit). Start-up only: it writes the
        pool's first blocks, which a prefix cache may hold later."""
        longest = max(WARM_GROUP_LENGTHS)
        fits = 2 * -(-longest // self.block_size) <= self.num_blocks if self.paged else longest <= self.slot_tokens
        if self.k is None or self.slots < 2 or not fits:
            return False
        if compiled:
            try:
                self._make_rows_functions(compiled=True)
                self._run_warm_groups()
                return True
            except Exception as exc:  # noqa: BLE001 - the eager group prefill is the same math
                log.warning("Group prefill not compiled: %s: %s", type(exc).__name__, exc)
                self.notes.append(f"group prefill eager: compiling failed ({type(exc).__name__}: {str(exc)[:120]})")
            self._make_rows_functions(compiled=False)
        try:
            self._run_warm_groups()
            return True
        except Exception as exc:  # noqa: BLE001 - a warm-up: the group prefill's own failures fail only its rows
            log.warning("Warming the group prefill failed (%s: %s)", type(exc).__name__, exc)
            self.notes.append(f"group prefill not warmed ({type(exc).__name__})")
            return False

    def _run_warm_groups(self) -> None:
        """_warm_prefill_rows' runs on rows 0 and 1 (it checked that two rows of each length fit); rows left idle."""
        vocab = self.fast._arch.vocab
        try:
            for n in WARM_GROUP_LENGTHS:
                if self.paged:
                    per = -(-n // self.block_size)
                    self.set_blocks(0, range(per))
                    self.set_blocks(1, range(per, 2 * per))
                ids = [(torch.arange(m, device=self.device) * 7 + 3) % vocab for m in (n, n - 1)]
                for hn in self.prefill_rows([0, 1], ids):
                    self.first_scores(0, hn)
            self.sync()
        finally:
            self.release_all()

    def _compile_step(self) -> None:
        try:
            self._make_functions(compiled=True)
            for bucket in self.buckets():
                self.step(bucket)
            self.sync()
        except Exception as exc:  # noqa: BLE001 - the eager step is the same math
            log.warning("Batched step not compiled: %s: %s", type(exc).__name__, exc)
            self.notes.append(f"batched step eager: compiling failed ({type(exc).__name__}: {str(exc)[:120]})")
            self._make_functions(compiled=False)

    def _capture(self) -> None:
        self._pool = torch.cuda.graph_pool_handle()
        side = self.fast.side_stream  # one warm-up stream per decoder (FastDecoder.side_stream says why)
        side.wait_stream(torch.cuda.current_stream(self.device))
        try:
            with torch.cuda.stream(side):
                for bucket in self.buckets():
                    self.step(bucket)
                    self.step(bucket)
            torch.cuda.current_stream(self.device).wait_stream(side)
            self.sync()
            for bucket in self.buckets():
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self._pool):
                    self.step(bucket)
                self._graphs[bucket] = graph
            self.sync()
        except Exception as exc:  # noqa: BLE001 - the step runs without graphs (slower launches, same tokens)
            log.warning("Batched step graphs not captured: %s: %s", type(exc).__name__, exc)
            self.notes.append(f"batched CUDA graphs off ({type(exc).__name__})")
            self._graphs.clear()
            self._pool = None
            self.sync()

    def _capture_prefill(self) -> None:
        """Paged: the whole-prompt prefill graphs (PagedPrefillGraphs.capture), after the step's graphs; a failure
        leaves the compiled prefill serving (said in the notes)."""
        if self.prefill_graphs is None or not self.fast._prefill_compiled_ok:
            return
        try:
            self.prefill_graphs.capture()
            captured = self.prefill_graphs.captured
            note = f"whole prompts up to {captured[-1]:,} tokens prefilled from {len(captured)} CUDA graphs" \
                if captured else ""
            if note and note not in self.notes:  # (re-sizing captures them again)
                self.notes.append(note)
        except Exception as exc:  # noqa: BLE001 - the compiled prefill serves every length
            log.warning("Paged prefill graphs not captured: %s: %s", type(exc).__name__, exc)
            self.notes.append(f"paged prefill graphs off ({type(exc).__name__})")
            self.prefill_graphs.capture_oom |= isinstance(exc, torch.cuda.OutOfMemoryError)
            self.prefill_graphs.clear()
            self.sync()
            torch.cuda.empty_cache()
