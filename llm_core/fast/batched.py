"""The batched fast path: every concurrent reply is a row of one decode step over the fast path's packed weights.
It takes token ids and sampling options, never text, settings files or the UI; a single reply is the batch of 1.

Storage: fixed KV slots, K and V each (layers, slots, slot_tokens, kv_heads, row) in the fast path's cache format
(bf16 rows, or the int8 rows of llm_core.fast.kvquant). Slot s is row s of the decode step, so a step over the first
B slots needs no gather: each row writes its K/V at its own position and attends to its own slot up to it. Why slots
and not paged blocks: with one model, one prompt budget (the engine fits every history to the slot length) and at
most 32 rows, slots are what the Triton attention kernel reads without a block table, the CUDA graphs need no
per-step table upload, and admission is a free-slot count; the cost is capacity: each slot holds the longest
reply the engine admits, so short replies leave most of their slot unused (docs/sharing.md).

Loop (one scheduler thread owns the device; request threads only queue work and read their tokens):

    waiting (FIFO) --a free slot--> prefill in chunks of PREFILL_TOKENS_PER_STEP between decode steps (the fast
    path's prefill layer over the slot) --> first token --> active row --> decode step for rows 0..B-1 (B = the
    smallest batch bucket >= the highest active slot + 1; idle slots inside it compute a throw-away token at
    position 0 of their own slot) --> per-row select (repetition penalty, min-new-tokens EOS ban and argmax inside
    the step; sampling rows through llm_core.sampling with their own generator) --> each row's token to its request
    --> a row that ends (EOS, length, Stop, error) frees its slot before the next step.

Step: embedding + RoPE for B positions, per layer the fast path's projections on B rows (one token each), a KV write
per row, attention per row over its own length (Triton: a row dimension on the split-K kernel; torch elsewhere),
SwiGLU, the head. Linears on B > 1 rows: NF4 through the kernel the warm-up picked per batch bucket
(llm_core.fast.rows: llm_core.nf4_mm, each weight decoded once for all rows; bitsandbytes' gemm_4bit; dequantize +
matmul, correct everywhere); dense weights through cuBLAS; B = 1 takes the single-reply kernels (linear_decode). On
CUDA the step is compiled and captured as one CUDA graph per batch bucket (1, 2, 4, 8, 16, 32) at warm-up; on CPU it
runs eagerly.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import logging
import queue
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from ..errors import ContextBudgetError, GenerationError, InputError, OutOfMemoryError
from ..sampling import SamplingOptions, sample_from_scores, sampling_generator
from ..streams import Finished, TokenStreams
from . import kvquant
from .generate import FastDecoder, _prefill_attention_scope
from .kernels.attention import round_up
from .kernels.nf4_mm import MM_MAX
from .kvquant import from_cache, is_quantized, to_cache
from .layer import (
    HeadSpec,
    LayerSpec,
    _mlp,
    _project_qkv,
    _split_linears,
    embed_prologue,
    layer_prefill_rows,
    linear_decode,
    linear_prefill,
    linear_prefill_parts,
    rms_norm,
    rotate_half,
)
from .pack import LinSpec, bias_of
from .rows import ROWS_KERNELS, RowsPlan, kernel_for, nf4_rows_linear, pick_rows_plan
from .tables import embed_rows
from .timing import time_in_cuda_graph

log = logging.getLogger(__name__)

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32)  # decode-step batch sizes captured as CUDA graphs
MAX_SLOTS = BATCH_BUCKETS[-1]
# Prompt tokens prefilled between two decode steps while other rows are decoding: running replies stall at most
# one chunk's prefill per step (a newcomer alone is prefilled in one go, up to the fast path's own chunk).
PREFILL_TOKENS_PER_STEP = 512


def batch_bucket(rows: int, slots: int) -> int:
    """The smallest batch bucket holding `rows` rows (at most `slots`)."""
    i = bisect.bisect_left(BATCH_BUCKETS, rows)
    return min(BATCH_BUCKETS[i] if i < len(BATCH_BUCKETS) else rows, slots)


# --- the step, for B rows ------------------------------------------------------------------------------------------


def linear_rows(spec: LinSpec, x: torch.Tensor, ts: Sequence[torch.Tensor], rows_max: RowsPlan | int = 0
                ) -> torch.Tensor:
    """x (B, K) -> (B, N): the single-reply kernel for one row; for more, NF4 through the plan's kernel for B
    (llm_core.fast.rows: llm_core.nf4_mm or bitsandbytes' gemm_4bit; an int n: nf4_mm for B <= n), cuBLAS (dense),
    or dequantize + matmul (NF4, int8: correct on every device)."""
    if x.shape[0] == 1:
        return linear_decode(spec, x, ts)
    if spec.fmt == "dense":
        return F.linear(x, ts[0], bias_of(spec, ts))
    kernel = kernel_for(rows_max, x.shape[0]) if spec.fmt == "nf4" and x.shape[0] <= MM_MAX else "dequant"
    if kernel != "dequant":
        return nf4_rows_linear(kernel, spec, x, ts)
    return linear_prefill(spec, x, ts)


def fused_rows(spec: LinSpec, x: torch.Tensor, ts: Sequence[torch.Tensor], rows_max: RowsPlan | int = 0
               ) -> Sequence[torch.Tensor]:
    """A fused linear (q/k/v, gate/up) over B rows, one output per part: as linear_rows, except that where that
    would dequantize + matmul, each part's weight is dequantized on its own (linear_prefill_parts)."""
    rows = x.shape[0]
    served = spec.fmt == "nf4" and rows <= MM_MAX and kernel_for(rows_max, rows) != "dequant"
    if rows > 1 and spec.fmt != "dense" and not served:
        return linear_prefill_parts(spec, x, ts)
    return linear_rows(spec, x, ts, rows_max).split(list(spec.splits), dim=-1)


def attention_rows(spec: LayerSpec, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   pos: torch.Tensor) -> torch.Tensor:
    """Row b's query (B, Hq, D) over its own slot k/v_cache[b] (B, L, Hkv, row), rows after pos[b] masked ->
    (B, Hq*D). The torch form is the fast path's eager attention (same matmuls) with a leading row dimension."""
    rows = q.shape[0]
    if spec.attention == "triton":
        out = torch.ops.llm_core.decode_attention_rows(q, k_cache, v_cache, pos, spec.scale)
        return out.reshape(rows, spec.n_heads * spec.head_dim)
    if is_quantized(k_cache):
        k_cache, v_cache = from_cache(k_cache, q.dtype), from_cache(v_cache, q.dtype)
    groups = spec.n_heads // spec.n_kv_heads
    length = k_cache.shape[1]
    valid = torch.arange(length, device=q.device)[None, :] <= pos[:, None]  # (B, L)
    qf = q.float().view(rows, spec.n_kv_heads, groups, spec.head_dim)
    scores = torch.matmul(qf, k_cache.float().permute(0, 2, 3, 1)) * spec.scale  # (B, Hkv, G, L)
    probs = torch.softmax(scores.masked_fill(~valid[:, None, None, :], float("-inf")), dim=-1)
    out = torch.matmul(probs, v_cache.float().transpose(1, 2))  # (B, Hkv, G, D)
    return out.reshape(rows, spec.n_heads * spec.head_dim).to(q.dtype)


def layer_rows(spec: LayerSpec, h: torch.Tensor, hn: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               pos: torch.Tensor, last: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               w: Sequence[torch.Tensor], rows_max: RowsPlan | int = 0, span: int | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """llm_core.fast.layer.layer_decode for B rows, one token each: h, hn (B, H); cos/sin (B, D); pos (B,) int64
    where row b's K/V is written; last (B,) the last cache row it attends to (= pos for a live row; 0 for an idle
    slot, which writes to its slot's scratch row and whose output is thrown away); k/v_cache (B, L, Hkv, row): the
    rows' slots of this layer; span: cache rows the attention reads (None: all; eager torch form only)."""
    rows = h.shape[0]
    lins = _split_linears(spec, w)
    rest = lins[-1]

    def linear(s: LinSpec, x: torch.Tensor, ts: Sequence[torch.Tensor]) -> torch.Tensor:
        return linear_rows(s, x, ts, rows_max)

    def parts(s: LinSpec, x: torch.Tensor, ts: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
        return fused_rows(s, x, ts, rows_max)

    q, k, v, used = _project_qkv(spec, hn, lins, linear, parts)
    q = q.reshape(rows, spec.n_heads, spec.head_dim)
    k = k.reshape(rows, spec.n_kv_heads, spec.head_dim)
    v = v.reshape(rows, spec.n_kv_heads, spec.head_dim)
    if spec.qk_norm_eps is not None:
        q, k = rms_norm(q, rest[2], spec.qk_norm_eps), rms_norm(k, rest[3], spec.qk_norm_eps)
    c, s = cos[:, None, :], sin[:, None, :]
    q = q * c + rotate_half(q) * s
    k = k * c + rotate_half(k) * s
    index = torch.arange(rows, device=h.device)
    k_cache.index_put_((index, pos), to_cache(k, k_cache))
    v_cache.index_put_((index, pos), to_cache(v, v_cache))
    if span is not None:
        k_cache, v_cache = k_cache[:, :span], v_cache[:, :span]
    attn = attention_rows(spec, q, k_cache, v_cache, last)
    h = h + linear(spec.linears[used], attn, lins[used])
    h = h + _mlp(spec, rms_norm(h, rest[0], spec.eps_post), lins, used + 1, linear, parts)
    return h, rms_norm(h, rest[1], spec.eps_next)


def head_rows(spec: HeadSpec, hn: torch.Tensor, lm: Sequence[torch.Tensor], seen: torch.Tensor,
              penalty: torch.Tensor, eos_bias: torch.Tensor, rows_max: RowsPlan | int = 0
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """llm_core.fast.layer.head_logits per row: hn (B, H), seen (B, V) bool, penalty (B, 1), eos_bias (B, V) ->
    scores (B, V) fp32 and the greedy tokens (B,)."""
    if spec.lm.fmt == "int8" and hn.shape[0] > 1:  # the int8 lm_head: weight-only, no half-precision copy of it
        logits = torch.ops.llm_core.int8_mm(hn, lm[0], lm[1]).float()
    else:
        logits = linear_rows(spec.lm, hn, lm, rows_max).float()
    penalized = torch.where(logits < 0, logits * penalty, logits / penalty)
    scores = torch.where(seen, penalized, logits) + eos_bias
    return scores, scores.argmax(-1)


# --- the slots: cache, step, prefill ---------------------------------------------------------------------------------


class SlotDecoder:
    """Fixed KV slots over a FastDecoder's packed weights, and the batched step and per-slot prefill over them.

    Scheduler-thread only (no lock of its own). The FastDecoder's own static cache is never allocated: its packed
    weights, specs and prefill layer functions are what is shared."""

    def __init__(self, decoder: FastDecoder, *, slots: int, slot_tokens: int) -> None:
        if not 1 <= slots <= MAX_SLOTS:
            raise GenerationError(f"The batched fast path holds 1 to {MAX_SLOTS} replies at once, not {slots}.")
        self.fast = decoder
        self.device = decoder.device
        self.slots = int(slots)
        self.slot_tokens = round_up(max(int(slot_tokens), 16), 16)
        self.compile = decoder.compile
        self.use_graphs = decoder.use_graphs
        # the kernel per batch bucket for NF4 linears over B > 1 rows (0: dequantize + matmul for all): set at
        # warm-up to the fastest candidate that matches dequantize + matmul (_pick_rows_kernel)
        self.rows_max: RowsPlan | int = 0
        self.rows_timings_us: dict[int, dict[str, float]] = {}  # the pick's timings: {bucket: {kernel: µs}}
        self.notes: list[str] = []
        a = decoder._arch
        vocab, dev, n = a.vocab, self.device, self.slots
        self.tok = torch.zeros(n, dtype=torch.long, device=dev)
        self.pos = torch.zeros(n, dtype=torch.long, device=dev)
        self.active = torch.zeros(n, dtype=torch.long, device=dev)  # 1 while the slot's row is decoding
        self.seen = torch.zeros(n, vocab, dtype=torch.bool, device=dev)
        self.penalty = torch.ones(n, 1, dtype=torch.float32, device=dev)
        self.eos_bias = torch.zeros(n, vocab, dtype=torch.float32, device=dev)
        self.scores = torch.zeros(n, vocab, dtype=torch.float32, device=dev)
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self._graphs: dict[int, Any] = {}
        self._pool: Any = None
        self._layer_fns: list[Callable[..., Any]] = []
        self._head_fn: Callable[..., Any] = head_rows
        self._prologue_fn: Callable[..., Any] = embed_prologue
        self.compiled = False
        self.warmup_s: float | None = None
        self.release_all()
        self._make_functions(compiled=False)

    # --- memory ----------------------------------------------------------------------------------------------------
    def kv_bytes_per_token(self) -> int:
        return int(self.fast.kv_bytes_per_token())

    @property
    def cache_bytes(self) -> int:
        return self.slots * self.slot_tokens * self.kv_bytes_per_token()

    def allocate(self) -> None:
        """The slot cache: (layers, slots, slot_tokens, Hkv, row) for K and for V, zeroed."""
        a = self.fast._arch
        int8 = self.fast.options.kv_cache == "int8"
        row = kvquant.row_bytes(a.head_dim) if int8 else a.head_dim
        shape = (len(a.layers), self.slots, self.slot_tokens, a.n_kv_heads, row)
        dtype = torch.int8 if int8 else self.fast.dtype
        self._graphs.clear()
        self.k = self.v = None
        self.k = torch.zeros(shape, dtype=dtype, device=self.device)
        self.v = torch.zeros(shape, dtype=dtype, device=self.device)

    def resize(self, slot_tokens: int) -> None:
        """Re-allocate every slot for `slot_tokens` (rounded up to 16) and recapture the step's graphs; the compiled
        functions stay (no compile). Before the scheduler's loop runs (start-up sizing). A capture that worked at the
        old size and fails at the new one raises torch.cuda.OutOfMemoryError: the sizing then shrinks the slots
        instead of keeping a size whose steps would run without graphs."""
        self.slot_tokens = round_up(max(int(slot_tokens), 16), 16)
        had_graphs, notes = bool(self._graphs), len(self.notes)
        self._graphs.clear()
        self._pool = None
        self.k = self.v = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        with torch.inference_mode(False), torch.no_grad():
            self.allocate()
            if self.use_graphs:
                self._capture()
            self.release_all()
        if had_graphs and not self._graphs:  # captured before, not at this size: it does not fit (not "graphs off")
            del self.notes[notes:]
            raise torch.cuda.OutOfMemoryError(
                f"The batched step's CUDA graphs could not be captured with {self.slot_tokens:,}-token slots.")

    def profile_worst_reply(self, chunk: int | None) -> dict[str, int]:
        """Run the most memory the batched path can take with these slots and measure it (issue 17's start-up profile,
        for the batch): one slot's last prefill chunk (`chunk` tokens, or the whole slot) at the end of a full slot,
        attending to every row before it, and its head; then a step with every slot decoding at its last row, from
        the top bucket's graph. Returns the peak bytes reserved and allocated (CUDA; 0 elsewhere, where the same pass
        runs unmeasured). The slots are released after it; the garbage it leaves in them every reply overwrites
        before reading."""
        end = self.slot_tokens - 2  # the last row a reply writes (scratch_position is the one after it)
        n = max(1, min(chunk or end, end))
        ids = (torch.arange(n, device=self.device) * 7 + 3) % self.fast._arch.vocab
        cuda = self.device.type == "cuda"
        with torch.inference_mode(False), torch.no_grad():
            if cuda:
                self.sync()
                torch.cuda.reset_peak_memory_stats(self.device)
            hn = self.prefill(0, ids, end - n)
            self.first_scores(0, hn)
            del hn
            self.active.fill_(1)
            self.pos.fill_(end)
            self.run_step(max(self.buckets()), end + 1)
            self.sync()
            peak = {"peak_reserved_bytes": int(torch.cuda.max_memory_reserved(self.device)) if cuda else 0,
                    "peak_allocated_bytes": int(torch.cuda.max_memory_allocated(self.device)) if cuda else 0,
                    "tokens": self.slot_tokens, "slots": self.slots}
            self.release_all()
        return peak

    # --- warm-up ---------------------------------------------------------------------------------------------------
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
                if self.use_graphs:
                    self._capture()
            self.release_all()
        self.warmup_s = round(time.perf_counter() - t0, 3)
        return self.warmup_s

    @property
    def rows_kernel(self) -> bool:
        """Whether llm_core.nf4_mm serves any batch size (bench records and tests read this)."""
        return isinstance(self.rows_max, RowsPlan) and self.rows_max.mm_max > 0

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
        worst = 0.0
        try:
            if triton is None:
                raise RuntimeError("Triton is not installed")
            for i in nf4:
                s = spec.linears[i]
                x = torch.randn(8, s.k, dtype=torch.bfloat16, device=self.device)
                got = nf4_rows_linear("mm", s, x, lins[i]).float()
                ref = linear_prefill(s, x, lins[i]).float()
                worst = max(worst, float((got - ref).norm() / ref.norm().clamp_min(1e-6)))
            if worst >= 0.02:
                self.notes.append(f"NF4 small-M kernel off: relative error {worst:.3f} vs dequantize + matmul")
                candidates.remove("mm")
        except Exception as exc:  # noqa: BLE001 - dequantize + matmul always works; say why it is used
            log.warning("NF4 small-M kernel unavailable: %s: %s", type(exc).__name__, exc)
            self.notes.append(f"NF4 small-M kernel off ({type(exc).__name__}: {str(exc)[:120]})")
            candidates.remove("mm")
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
        self.notes.append(f"NF4 rows kernels per batch ({chosen}); nf4_mm relative error {worst:.4f}"
                          + (f"; first layer's NF4 linears: {shown}" if shown else ""))
        self.rows_timings_us = timings
        self._make_functions(compiled=False)

    def _warm_prefill(self) -> None:
        """Compile the fast path's prefill layer for every shape class a reply meets (FastDecoder never warms it here:
        its own cache is not allocated): from position 0, and chunks after cached rows at two starts and lengths, so
        that dynamo makes both the length and the start symbolic here, not inside a reply."""
        if not self.fast._prefill_compiled_ok:
            return
        first = max(4, min(71, (self.slot_tokens - 2) // 3))
        start = 0
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

    def _make_functions(self, compiled: bool) -> None:
        """Closures over the static specs (one per distinct layer spec, as FastDecoder binds them), compiled or not."""
        f, rows_max = self.fast, self.rows_max
        head_spec, rotary = f._head_spec, f._arch.rotary

        def prologue(tok: torch.Tensor, pos: torch.Tensor, embed: list[torch.Tensor], norm0: torch.Tensor) -> Any:
            return embed_prologue(head_spec, rotary, tok, pos, embed, norm0)

        def head(hn: torch.Tensor, lm: list[torch.Tensor], seen: torch.Tensor, penalty: torch.Tensor,
                 eos_bias: torch.Tensor) -> Any:
            return head_rows(head_spec, hn, lm, seen, penalty, eos_bias, rows_max)

        def bind(spec: LayerSpec) -> Callable[..., Any]:
            def layer(h: torch.Tensor, hn: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor,
                      last: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, w: list[torch.Tensor],
                      span: int | None = None) -> Any:
                return layer_rows(spec, h, hn, cos, sin, pos, last, kc, vc, w, rows_max, span)
            return layer

        wrap: Callable[[Callable[..., Any]], Callable[..., Any]] = f._compile if compiled else (lambda fn: fn)
        fns: dict[int, Callable[..., Any]] = {}
        self._layer_fns = [fns.setdefault(id(spec), wrap(bind(spec))) for spec in f._layer_specs]
        self._prologue_fn, self._head_fn = wrap(prologue), wrap(head)
        self.compiled = compiled

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

    def buckets(self) -> list[int]:
        return sorted({batch_bucket(r, self.slots) for r in range(1, self.slots + 1)})

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # --- per-slot state --------------------------------------------------------------------------------------------
    @property
    def scratch_position(self) -> int:
        """The cache row an idle slot's step writes to: the slot's last, which no reply reaches (a reply is admitted
        with prompt + max new <= slot_tokens, and its last token is never fed back, so it writes rows <= T - 2)."""
        return self.slot_tokens - 1

    def release_all(self) -> None:
        self.active.zero_()
        self.pos.fill_(self.scratch_position)
        self.tok.zero_()

    def start_row(self, slot: int, repetition_penalty: float, eos_ids: Sequence[int], ban_eos: bool) -> None:
        self.seen[slot].zero_()
        self.penalty[slot].fill_(float(repetition_penalty))
        self.eos_bias[slot].zero_()
        if ban_eos and eos_ids:
            self.eos_bias[slot, list(eos_ids)] = float("-inf")

    def allow_eos(self, slot: int) -> None:
        self.eos_bias[slot].zero_()

    def activate(self, slot: int, token: int, position: int) -> None:
        self.tok[slot] = token
        self.pos[slot] = position
        self.active[slot] = 1

    def release(self, slot: int) -> None:
        self.active[slot] = 0
        self.pos[slot] = self.scratch_position
        self.tok[slot] = 0

    # --- prefill ---------------------------------------------------------------------------------------------------
    def prefill(self, slot: int, ids: torch.Tensor, start: int) -> torch.Tensor:
        """Prompt tokens ids (S,) at positions start..start+S-1 into slot `slot` (the fast path's prefill layer;
        compiled where it is); returns the last position's final hidden (1, H). Marks the tokens as seen."""
        assert self.k is not None and self.v is not None
        f = self.fast
        self.seen[slot].index_fill_(0, ids, True)
        h = embed_rows(ids, f._embed, f._norm0.dtype)[None]
        pos = torch.arange(start, start + ids.numel(), device=self.device)
        cos, sin = f._arch.rotary(h, pos[None])
        hn = rms_norm(h, f._norm0, f._head_spec.eps0)
        compiled = f._prefill_compiled_ok and ids.numel() > 1
        fns = f._prefill_fns if compiled else f._prefill_eager_fns
        with _prefill_attention_scope(f.options.prefill_attention, self.device):
            for i, (fn, w) in enumerate(zip(fns, f._layer_weights, strict=True)):
                kc, vc = self.k[i, slot], self.v[i, slot]
                if compiled:
                    for t in (h, hn, cos, sin):
                        torch._dynamo.maybe_mark_dynamic(t, 1)
                    for t in (kc, vc):
                        torch._dynamo.maybe_mark_dynamic(t, 0)
                h, hn = fn(h, hn, cos, sin, start, kc, vc, w)
        return hn[0, -1:].clone()

    def prefill_rows(self, slots: Sequence[int], prompts: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Whole prompts (each from position 0) of several slots in one pass, right-padded to the longest
        (llm_core.fast.layer.layer_prefill_rows): one launch sequence for all newcomers instead of one per prompt.
        Returns each row's last real position's final hidden (1, H). Marks each prompt's tokens as seen."""
        assert self.k is not None and self.v is not None
        f = self.fast
        lengths = [int(p.numel()) for p in prompts]
        ids = torch.zeros(len(prompts), max(lengths), dtype=torch.long, device=self.device)
        for b, (slot, prompt) in enumerate(zip(slots, prompts, strict=True)):
            ids[b, :lengths[b]] = prompt
            self.seen[slot].index_fill_(0, prompt, True)
        h = embed_rows(ids, f._embed, f._norm0.dtype)
        pos = torch.arange(ids.shape[1], device=self.device)
        cos, sin = f._arch.rotary(h, pos[None])
        hn = rms_norm(h, f._norm0, f._head_spec.eps0)
        index = torch.tensor(list(slots), dtype=torch.long, device=self.device)
        with _prefill_attention_scope(f.options.prefill_attention, self.device):
            for i, (spec, w) in enumerate(zip(f._layer_specs, f._layer_weights, strict=True)):
                h, hn = layer_prefill_rows(spec, h, hn, cos, sin, self.k[i], self.v[i], index, w)
        return [hn[b, n - 1:n].clone() for b, n in enumerate(lengths)]

    def first_scores(self, slot: int, hn_last: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The head on a prefilled row: scores (1, V) and the greedy token (1,)."""
        f = self.fast
        return head_rows(f._head_spec, hn_last, f._lm_tensors, self.seen[slot:slot + 1],
                         self.penalty[slot:slot + 1], self.eos_bias[slot:slot + 1])

    # --- decode ----------------------------------------------------------------------------------------------------
    def step(self, bucket: int, length: int | None = None) -> None:
        """One decode step for slots 0..bucket-1 on the static buffers: feed tok at pos, write scores and the greedy
        next token, advance pos of the active slots. `length`: cache rows the torch attention reads (eager only;
        the Triton kernel reads each row up to its own position)."""
        assert self.k is not None and self.v is not None
        f = self.fast
        rows = slice(0, bucket)
        tok, pos, active = self.tok[rows], self.pos[rows], self.active[rows]
        seen = self.seen[rows]
        index = tok[:, None]
        seen.scatter_(1, index, seen.gather(1, index) | active[:, None].bool())  # live rows only: idle ones keep
        last = pos * active  # an idle slot attends to its row 0 only (and writes to its scratch row)
        h, hn, cos, sin = self._prologue_fn(tok, pos, f._embed, f._norm0)
        span = None if length is None or self.compiled or length >= self.slot_tokens else length
        for i, (fn, w) in enumerate(zip(self._layer_fns, f._layer_weights, strict=True)):
            h, hn = fn(h, hn, cos, sin, pos, last, self.k[i, rows], self.v[i, rows], w, span)
        scores, nxt = self._head_fn(hn, f._lm_tensors, seen, self.penalty[rows], self.eos_bias[rows])
        self.scores[rows].copy_(scores)
        self.tok[rows].copy_(nxt)
        self.pos[rows].add_(active)

    def run_step(self, bucket: int, longest: int) -> None:
        """The step from its CUDA graph when captured, else eagerly over the `longest` live cache rows."""
        graph = self._graphs.get(bucket)
        if graph is not None:
            graph.replay()
        else:
            triton_attention = self.fast._layer_specs[0].attention == "triton"
            self.step(bucket, None if triton_attention else round_up(longest, 16))


# --- the scheduler -------------------------------------------------------------------------------------------------


class FastRequest:
    """One reply in the batched fast path. The scheduler thread puts token ids (int) and finally a Finished on
    `items`, and fills `record` (duck-typed: nbytes, peak_*_bytes, peak_batch_rows) before the Finished."""

    _ids = itertools.count()

    def __init__(self, prompt_ids: list[int], options: SamplingOptions, max_new_tokens: int,
                 stop_event: threading.Event, record: Any = None) -> None:
        self.id = next(self._ids)
        self.prompt_ids = prompt_ids
        self.options = options
        self.max_new_tokens = int(max_new_tokens)
        self.stop_event = stop_event
        self.record = record
        self.items: queue.SimpleQueue[int | Finished] = queue.SimpleQueue()
        self.arrived_s = time.perf_counter()
        self.counted_wait = False
        self.finished: Finished | None = None
        self.peak_allocated = 0
        self.peak_reserved = 0
        self.peak_rows = 0

    @property
    def kv_tokens(self) -> int:
        return len(self.prompt_ids) + self.max_new_tokens


@dataclass
class _Row:
    request: FastRequest
    slot: int
    ids: torch.Tensor  # the prompt on the device
    prefilled: int = 0  # prompt tokens in the slot
    length: int = 0  # tokens in the slot once decoding (prompt + fed tokens)
    new_tokens: int = 0
    generator: torch.Generator | None = None


@dataclass
class BatchStats:
    """Counters for the UI, the tests and the benchmark (a snapshot; the scheduler keeps the live copy)."""

    waiting: int = 0
    active: int = 0
    prefilling: int = 0
    slots: int = 0
    slot_tokens: int = 0
    kv_held_bytes: int = 0  # the slot cache (allocated once)
    decode_steps: int = 0
    rows_decoded: int = 0  # sum over steps of the live rows in the step
    padded_rows: int = 0  # sum over steps of the bucket's rows (live + idle slots computed anyway)
    max_rows_in_step: int = 0
    prefills: int = 0
    prefill_chunks: int = 0
    waited_for_slot: int = 0  # requests that found every slot taken
    errors: int = 0
    step_s: float = 0.0  # host time of the decode steps, launch to tokens on the host
    rows_by_bucket: dict[int, int] = field(default_factory=dict)  # steps per batch bucket

    @property
    def mean_rows_per_step(self) -> float:
        return self.rows_decoded / self.decode_steps if self.decode_steps else 0.0

    @property
    def mean_step_s(self) -> float:
        return self.step_s / self.decode_steps if self.decode_steps else 0.0


class FastBatchScheduler(TokenStreams):
    """Decodes every concurrent reply as a row of one batched fast-path step (see the module docstring).

    Thread-safe `submit` / `generate`; one background thread owns the device. A request whose prompt + max new
    tokens exceed a slot is refused at once (ContextBudgetError); one that fits waits only for a free slot."""

    def __init__(self, slots: SlotDecoder, *, eos_token_ids: Sequence[int], name: str = "fast-batch",
                 prefill_tokens_per_step: int = PREFILL_TOKENS_PER_STEP) -> None:
        self.decoder = slots
        self.device = slots.device
        self.eos_token_ids = frozenset(int(e) for e in eos_token_ids)
        self.prefill_tokens_per_step = int(prefill_tokens_per_step)
        self._cond = threading.Condition()
        self._waiting: deque[FastRequest] = deque()
        self._rows: dict[int, _Row] = {}  # slot -> row, decoding
        self._prefilling: list[_Row] = []  # in slot order of admission
        self._closed = False
        self.stats = BatchStats(slots=slots.slots, slot_tokens=slots.slot_tokens)
        self.fatal_error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self._name = name

    # --- public ------------------------------------------------------------------------------------------------------
    @property
    def max_batch_size(self) -> int:
        return self.decoder.slots

    @property
    def slot_tokens(self) -> int:
        return self.decoder.slot_tokens

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._closed

    def start(self) -> None:
        """Allocate and warm the slots (compile and capture on CUDA) and start the loop thread. Idempotent."""
        with self._start_lock:  # held through the warm-up: the first replies may arrive on several threads at once
            if self._thread is not None:
                return
            if self.decoder.k is None:
                self.decoder.warmup()
            thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
            with self._cond:
                self._thread = thread
            thread.start()
            _RUNNING.add(self)

    def resize_slots(self, slot_tokens: int) -> None:
        """SlotDecoder.resize before the loop runs (the engine sizes the slots by measurement at start-up)."""
        with self._start_lock:
            if self._thread is not None:
                raise GenerationError("The batched decode loop is running: its KV slots are sized before it starts.")
            self.decoder.resize(slot_tokens)
            self.stats = BatchStats(slots=self.decoder.slots, slot_tokens=self.decoder.slot_tokens)

    def submit(self, prompt_ids: list[int], options: SamplingOptions, max_new_tokens: int,
               stop_event: threading.Event, record: Any = None) -> FastRequest:
        if not prompt_ids:
            raise InputError("The prompt is empty.")
        if max_new_tokens < 1:
            raise GenerationError("max_new_tokens must be at least 1.")
        request = FastRequest(list(prompt_ids), options, max_new_tokens, stop_event, record)
        if request.kv_tokens > self.slot_tokens:
            raise ContextBudgetError(
                f"The prompt ({len(prompt_ids):,} tokens) plus max new tokens ({max_new_tokens:,}) exceed one "
                f"reply's KV slot ({self.slot_tokens:,} tokens); shorten the history or lower max new tokens.")
        self.start()
        with self._cond:
            if not self.alive:
                raise GenerationError("The batched decode loop has stopped; restart the demo.")
            self._waiting.append(request)
            self._cond.notify_all()
        return request

    def _loop_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def snapshot(self) -> BatchStats:
        with self._cond:
            s = self.stats
            return BatchStats(
                waiting=len(self._waiting), active=len(self._rows), prefilling=len(self._prefilling),
                slots=s.slots, slot_tokens=s.slot_tokens, kv_held_bytes=self.decoder.cache_bytes,
                decode_steps=s.decode_steps, rows_decoded=s.rows_decoded, padded_rows=s.padded_rows,
                max_rows_in_step=s.max_rows_in_step, prefills=s.prefills, prefill_chunks=s.prefill_chunks,
                waited_for_slot=s.waited_for_slot, errors=s.errors, step_s=s.step_s,
                rows_by_bucket=dict(s.rows_by_bucket))

    def queue_position(self, request: FastRequest) -> int | None:
        """Requests ahead of `request` in the slot queue (0 = next), None once it has a slot."""
        with self._cond:
            for i, r in enumerate(self._waiting):
                if r is request:
                    return i
        return None

    def close(self, timeout_s: float = 10.0) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout_s)

    # --- the loop (scheduler thread only) -----------------------------------------------------------------------------
    def _loop(self) -> None:
        error: BaseException
        try:
            with torch.inference_mode(False), torch.no_grad():  # the warm-up's mode: no recompile of the step
                while True:
                    with self._cond:
                        if self._closed:
                            break
                        if not self._rows and not self._waiting and not self._prefilling:
                            self._cond.wait(0.5)
                            continue
                    try:
                        self._drop_stopped()
                        self._admit()
                        self._advance_prefills()
                        if self._rows:
                            self._decode_step()
                    except Exception as exc:  # noqa: BLE001 - a failed step: fail the rows in it, keep serving
                        self._fail_all(exc)
            error = GenerationError("The demo is shutting down; this reply was stopped.")
        except BaseException as exc:  # a bug in the loop itself: fail every reply rather than hang them
            self.fatal_error = exc
            error = GenerationError(f"The batched decode loop failed: {type(exc).__name__}: {str(exc)[:300]}")
        with self._cond:
            self._closed = True
            pending = list(self._waiting) + [r.request for r in (*self._rows.values(), *self._prefilling)]
            self._waiting.clear()
            self._rows.clear()
            self._prefilling.clear()
        for request in pending:
            self._finish(request, "error", error)

    def _fail_all(self, exc: BaseException) -> None:
        import traceback

        traceback.clear_frames(exc.__traceback__)
        if isinstance(exc, torch.cuda.OutOfMemoryError):
            torch.cuda.empty_cache()
            err: BaseException = OutOfMemoryError("The GPU ran out of memory in the batched decode step; the replies "
                                                  "in it were stopped. Try again with fewer at once.")
        else:
            err = GenerationError(f"Generation failed: {type(exc).__name__}: {str(exc)[:300]}")
        for row in [*self._rows.values(), *self._prefilling]:
            self._end_row(row, "error", err)

    def _finish(self, request: FastRequest, reason: str, error: BaseException | None = None) -> None:
        if request.finished is None:
            request.finished = Finished(reason, error)
            if error is not None:
                self.stats.errors += 1
            request.items.put(request.finished)

    def _end_row(self, row: _Row, reason: str, error: BaseException | None = None) -> None:
        """The row leaves: its record filled, its slot freed, its request finished."""
        request = row.request
        record = request.record
        if record is not None:
            tokens = row.length if row.length else row.prefilled
            record.nbytes = tokens * self.decoder.kv_bytes_per_token() or None
            if self.device.type == "cuda":
                record.peak_allocated_bytes = request.peak_allocated or None
                record.peak_reserved_bytes = request.peak_reserved or None
            record.peak_batch_rows = request.peak_rows or None
        with self._cond:
            if self._rows.get(row.slot) is row:
                del self._rows[row.slot]
            if row in self._prefilling:
                self._prefilling.remove(row)
        self.decoder.release(row.slot)
        self._finish(request, reason, error)

    def _drop_stopped(self) -> None:
        with self._cond:
            for request in [r for r in self._waiting if r.stop_event.is_set()]:
                self._waiting.remove(request)
                self._finish(request, "stopped")
        for row in [r for r in (*self._rows.values(), *self._prefilling) if r.request.stop_event.is_set()]:
            self._end_row(row, "stopped")

    def _free_slots(self) -> list[int]:
        taken = set(self._rows) | {r.slot for r in self._prefilling}
        return [s for s in range(self.decoder.slots) if s not in taken]

    def _admit(self) -> None:
        """Waiting requests take the lowest free slots, in arrival order (they all fit a slot: checked at submit)."""
        with self._cond:
            free = self._free_slots()
            while self._waiting and free:
                request = self._waiting.popleft()
                slot = free.pop(0)
                options = request.options
                ids = torch.tensor(request.prompt_ids, dtype=torch.long, device=self.device)
                self._prefilling.append(_Row(request, slot, ids, generator=sampling_generator(options, self.device)))
                self.decoder.start_row(slot, options.repetition_penalty, sorted(self.eos_token_ids),
                                       options.min_new_tokens > 0)
            if self._waiting:
                head = self._waiting[0]
                if not head.counted_wait:
                    head.counted_wait = True
                    self.stats.waited_for_slot += 1

    def _measure(self, op: Callable[[], Any], rows: int) -> Any:
        """Run op; on CUDA record the device's allocation peak during it on every reply in flight (the batch's
        peak during each reply, with the rows decoding at that moment). Only this thread allocates on the device
        while the batched path serves, so the peak between reset and read is this op's."""
        if self.device.type != "cuda":
            return op()
        torch.cuda.reset_peak_memory_stats(self.device)
        out = op()
        allocated = torch.cuda.max_memory_allocated(self.device)
        reserved = torch.cuda.max_memory_reserved(self.device)
        for row in [*self._rows.values(), *self._prefilling]:
            request = row.request
            if allocated > request.peak_allocated:
                request.peak_allocated, request.peak_rows = allocated, rows
            request.peak_reserved = max(request.peak_reserved, reserved)
        return out

    def _advance_prefills(self) -> None:
        """Prefill newcomers: at most prefill_tokens_per_step tokens while rows are decoding, else everything
        waiting (in chunks of the fast path's prefill_chunk_tokens if set). A finished prefill picks its first
        token and joins the decode batch."""
        budget = self.prefill_tokens_per_step if self._rows else None
        chunk_cap = self.decoder.fast.options.prefill_chunk_tokens
        if budget is None:
            self._prefill_together(chunk_cap)
        while self._prefilling and (budget is None or budget > 0):
            row = self._prefilling[0]
            total = row.ids.numel()
            take = total - row.prefilled
            if budget is not None:
                take = min(take, budget)
            if chunk_cap:
                take = min(take, int(chunk_cap))
            start = row.prefilled
            try:
                hn = self._measure(functools.partial(self.decoder.prefill, row.slot, row.ids[start:start + take],
                                                     start), len(self._rows) + 1)
            except Exception as exc:  # noqa: BLE001 - this request only
                self._fail_prefill([row], exc)
                continue
            self.stats.prefill_chunks += 1
            row.prefilled += take
            if budget is not None:
                budget -= take
            if row.prefilled < total:
                continue
            self.stats.prefills += 1
            with self._cond:
                self._prefilling.remove(row)
            self._first_token(row, hn)

    def _fail_prefill(self, rows: Sequence[_Row], exc: BaseException) -> None:
        """A prefill that raised ends its rows only: the failed call's frames let go, the cache emptied after an OOM,
        which the user is told as such."""
        import traceback

        traceback.clear_frames(exc.__traceback__)
        if isinstance(exc, torch.cuda.OutOfMemoryError):
            torch.cuda.empty_cache()
            exc = OutOfMemoryError("The GPU ran out of memory prefilling this prompt; shorten the history and try "
                                   "again.")
        for row in rows:
            self._end_row(row, "error", exc)

    def _prefill_together(self, chunk_cap: int | None) -> None:
        """With no row decoding, newcomers whose whole prompt is waiting are prefilled together, in groups whose
        padded size (rows x the longest prompt) stays within one prefill chunk: the memory the start-up profile
        measured for one chunk bounds it, and each group is one forward instead of one per prompt (issue 16: 8
        newcomers took 14 host-launched prefills, TTFT p95 0.59 s). A group's failure fails its rows only."""
        cap = int(chunk_cap) if chunk_cap else self.decoder.slot_tokens
        fresh = sorted((r for r in self._prefilling if r.prefilled == 0 and r.ids.numel() <= cap),
                       key=lambda r: r.ids.numel())
        while len(fresh) >= 2:
            group = [fresh.pop(0)]
            while fresh and (len(group) + 1) * fresh[0].ids.numel() <= cap:
                group.append(fresh.pop(0))
            if len(group) < 2:
                continue
            try:
                hns = self._measure(functools.partial(self.decoder.prefill_rows, [r.slot for r in group],
                                                      [r.ids for r in group]), len(group))
            except Exception as exc:  # noqa: BLE001 - these requests only
                self._fail_prefill(group, exc)
                continue
            self.stats.prefill_chunks += 1
            for row, hn in zip(group, hns, strict=True):
                row.prefilled = row.ids.numel()
                self.stats.prefills += 1
                with self._cond:
                    self._prefilling.remove(row)
                self._first_token(row, hn)

    def _first_token(self, row: _Row, hn: torch.Tensor) -> None:
        request = row.request
        if request.stop_event.is_set():
            self._end_row(row, "stopped")
            return
        try:
            scores, nxt = self.decoder.first_scores(row.slot, hn)
            if request.options.do_sample:
                nxt = sample_from_scores(scores, request.options, row.generator)
            token = int(nxt.item())
        except Exception as exc:  # noqa: BLE001 - this request only (e.g. its sampling options)
            self._end_row(row, "error", exc)
            return
        row.length = row.prefilled
        row.new_tokens = 1
        with self._cond:
            self._rows[row.slot] = row  # decoding from here (so _end_row finds it)
        request.items.put(token)
        reason = self._end_reason(row, token)
        if reason:
            self._end_row(row, reason)
            return
        self.decoder.activate(row.slot, token, row.length)
        if request.options.min_new_tokens and row.new_tokens >= request.options.min_new_tokens:
            self.decoder.allow_eos(row.slot)

    def _end_reason(self, row: _Row, token: int) -> str | None:
        if token in self.eos_token_ids and row.new_tokens >= row.request.options.min_new_tokens:
            return "eos"
        if row.new_tokens >= row.request.max_new_tokens:
            return "length"
        return None

    def _decode_step(self) -> None:
        rows = dict(self._rows)
        bucket = batch_bucket(max(rows) + 1, self.decoder.slots)
        longest = max(r.length for r in rows.values()) + 1
        t0 = time.perf_counter()
        self._measure(lambda: self.decoder.run_step(bucket, longest), len(rows))
        sampled = {s: r for s, r in rows.items() if r.request.options.do_sample}
        for slot, row in sampled.items():  # the sampler shared by every path, on this row's scores
            self.decoder.tok[slot:slot + 1].copy_(
                sample_from_scores(self.decoder.scores[slot:slot + 1], row.request.options, row.generator))
        tokens = self.decoder.tok[:bucket].tolist()  # the step's one host sync
        s = self.stats
        s.step_s += time.perf_counter() - t0
        s.decode_steps += 1
        s.rows_decoded += len(rows)
        s.padded_rows += bucket
        s.max_rows_in_step = max(s.max_rows_in_step, len(rows))
        s.rows_by_bucket[bucket] = s.rows_by_bucket.get(bucket, 0) + 1
        for slot, row in rows.items():
            row.length += 1
            request = row.request
            if request.stop_event.is_set():
                self._end_row(row, "stopped")
                continue
            token = int(tokens[slot])
            row.new_tokens += 1
            request.items.put(token)
            reason = self._end_reason(row, token)
            if reason:
                self._end_row(row, reason)
                continue
            if request.options.min_new_tokens and row.new_tokens == request.options.min_new_tokens:
                self.decoder.allow_eos(slot)
            if row.length + 1 > self.decoder.slot_tokens:  # cannot happen: admitted with prompt + max new <= slot
                self._end_row(row, "length")


_RUNNING: weakref.WeakSet[FastBatchScheduler] = weakref.WeakSet()


def close_all() -> None:
    """Stop every loop thread (at interpreter exit, before torch is torn down under them)."""
    for scheduler in list(_RUNNING):
        scheduler.close(timeout_s=2.0)


import atexit  # noqa: E402 - registered once the function exists

atexit.register(close_all)
