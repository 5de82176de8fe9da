"""The batched fast path's KV slots and step: every concurrent reply is a row of one decode step over the fast path's
packed weights. Token ids in, logits and tokens out; the loop that admits and streams rows is
llm_core.engine.scheduler with its fast runner (engine/fast_runner.py). A single reply is the batch of 1.

Storage: fixed KV slots, K and V each (layers, slots, slot_tokens, kv_heads, row) in the fast path's cache format
(bf16 rows, or the int8 rows of llm_core.fast.kvquant). Slot s is row s of the decode step, so a step over the first
B slots needs no gather: each row writes its K/V at its own position and attends to its own slot up to it. Why slots
and not paged blocks: with one model, one prompt budget (the engine fits every history to the slot length) and at
most 32 rows, slots are what the Triton attention kernel reads without a block table, the CUDA graphs need no
per-step table upload, and admission is a free-slot count; the cost is capacity: each slot holds the longest
reply the engine admits, so short replies leave most of their slot unused (docs/sharing.md).
Paged (KV_LAYOUT=paged): the same bytes as one pool (layers, num_blocks + 1, block_size, kv_heads, row); row b
reads and writes positions through its row of a static block table (slots, num_blocks) int32 that the scheduler
fills from llm_core.engine.kv_pool (the extra block is the idle rows' scratch), so one reply may span the pool and
full blocks are shared between replies with the same prefix. The CUDA graphs read the table in place.

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
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..errors import GenerationError
from . import kvquant
from .generate import FastDecoder, pool_idle_bytes
from .kernels.attention import PAGED_BLOCK_SIZES, gather_blocks, round_up
from .kvquant import from_cache, is_quantized, to_cache
from .layer import (
    HeadSpec,
    LayerSpec,
    _mlp,
    _prefill_attention_scope,
    _project_qkv,
    _split_linears,
    embed_prologue,
    layer_prefill_paged,
    layer_prefill_rows,
    rms_norm,
    rotate_half,
    write_paged_rows,
)
from .options import PREFILL_BUCKET_TOKENS
from .pack import LinSpec
from .prefill_graphs import PagedPrefillGraphs
from .rows import RowsPlan, fused_rows, linear_rows
from .slot_warmup import SlotWarmup
from .tables import embed_rows

log = logging.getLogger(__name__)

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32)  # decode-step batch sizes captured as CUDA graphs
MAX_SLOTS = BATCH_BUCKETS[-1]
# Prompt tokens prefilled between two decode steps while other rows are decoding: running replies stall at most
# one chunk's prefill per step (a newcomer alone is prefilled in one go, up to the fast path's own chunk).
PREFILL_TOKENS_PER_STEP = 512
KV_LAYOUTS = ("slots", "paged")  # KV_LAYOUT: fixed slots per row, or one pool of blocks read through block tables
PAGED_BLOCK_TOKENS = 16  # tokens per block of the paged pool (vLLM's default; the kernel takes 16, 32 or 64)


def batch_bucket(rows: int, slots: int) -> int:
    """The smallest batch bucket holding `rows` rows (at most `slots`)."""
    i = bisect.bisect_left(BATCH_BUCKETS, rows)
    return min(BATCH_BUCKETS[i] if i < len(BATCH_BUCKETS) else rows, slots)


# --- the step, for B rows ------------------------------------------------------------------------------------------


def attention_rows(spec: LayerSpec, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   pos: torch.Tensor, table: torch.Tensor | None = None) -> torch.Tensor:
    """Row b's query (B, Hq, D) over its own slot k/v_cache[b] (B, L, Hkv, row), rows after pos[b] masked ->
    (B, Hq*D); with a block table (B, max_blocks) int32, k/v_cache are a pool of blocks (num_blocks, block_size,
    Hkv, row) and row b's positions are its table's blocks in order. The torch form is the fast path's eager
    attention (same matmuls) with a leading row dimension, over the blocks gathered (the paged kernel's reference)."""
    rows = q.shape[0]
    if spec.attention == "triton":
        if table is not None:
            out = torch.ops.llm_core.decode_attention_paged(q, k_cache, v_cache, table, pos, spec.scale, spec.pdl)
        else:
            out = torch.ops.llm_core.decode_attention_rows(q, k_cache, v_cache, pos, spec.scale, spec.pdl)
        return out.reshape(rows, spec.n_heads * spec.head_dim)
    if table is not None:
        k_cache, v_cache = gather_blocks(k_cache, table), gather_blocks(v_cache, table)
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
               w: Sequence[torch.Tensor], rows_max: RowsPlan | int = 0, span: int | None = None,
               table: torch.Tensor | None = None, dest: tuple[torch.Tensor, torch.Tensor] | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """llm_core.fast.layer.layer_decode for B rows, one token each: h, hn (B, H); cos/sin (B, D); pos (B,) int64
    where row b's K/V is written; last (B,) the last cache row it attends to (= pos for a live row; 0 for an idle
    slot, which writes to its slot's scratch row and whose output is thrown away); k/v_cache (B, L, Hkv, row): the
    rows' slots of this layer; span: cache rows the attention reads (None: all; eager torch form only). Paged:
    k/v_cache are this layer's pool (num_blocks, block_size, Hkv, row), table (B, max_blocks) int32 the rows' block
    tables and dest (blocks, offsets), each (B,), where each row writes (SlotDecoder.step computes it once for
    every layer)."""
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
    if table is not None and dest is not None:
        write_paged_rows(k_cache, dest, to_cache(k, k_cache))
        write_paged_rows(v_cache, dest, to_cache(v, v_cache))
        if span is not None:
            table = table[:, :-(-span // k_cache.shape[1])]
    else:
        index = torch.arange(rows, device=h.device)
        k_cache.index_put_((index, pos), to_cache(k, k_cache))
        v_cache.index_put_((index, pos), to_cache(v, v_cache))
        if span is not None:
            k_cache, v_cache = k_cache[:, :span], v_cache[:, :span]
    attn = attention_rows(spec, q, k_cache, v_cache, last, table)
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


class SlotDecoder(SlotWarmup):
    """Fixed KV slots over a FastDecoder's packed weights, and the batched step and per-slot prefill over them.

    Scheduler-thread only (no lock of its own). The FastDecoder's own static cache is never allocated: its packed
    weights, specs and prefill layer functions are what is shared."""

    def __init__(self, decoder: FastDecoder, *, slots: int, slot_tokens: int, layout: str = "slots",
                 block_size: int = PAGED_BLOCK_TOKENS, prefill_graph_tokens: int = 0) -> None:
        if not 1 <= slots <= MAX_SLOTS:
            raise GenerationError(f"The batched fast path holds 1 to {MAX_SLOTS} replies at once, not {slots}.")
        if layout not in KV_LAYOUTS or block_size not in PAGED_BLOCK_SIZES:
            raise GenerationError(f"KV_LAYOUT={layout!r} with {block_size}-token blocks is not supported; choose one "
                                  f"of {', '.join(KV_LAYOUTS)} and blocks of {PAGED_BLOCK_SIZES} tokens.")
        # paged: one pool of slots x slot_tokens tokens in blocks, each row's through its row of `table`
        self.paged = layout == "paged"
        self.block_size = int(block_size)
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
        self.table = torch.zeros(n, 1, dtype=torch.int32, device=dev)  # paged: (slots, num_blocks) block ids
        self._size_table()
        self._graphs: dict[int, Any] = {}
        self._pool: Any = None
        # paged: whole prompts up to prefill_graph_tokens prefilled from CUDA graphs (llm_core.fast.prefill_graphs)
        self.prefill_graphs = PagedPrefillGraphs(self, prefill_graph_tokens) \
            if self.paged and prefill_graph_tokens >= PREFILL_BUCKET_TOKENS else None
        self._layer_fns: list[Callable[..., Any]] = []
        self._rows_fns: list[Callable[..., Any]] = []  # the group prefill's layer (prefill_rows), compiled or not
        self.rows_compiled = False
        self._head_fn: Callable[..., Any] = head_rows
        self._prologue_fn: Callable[..., Any] = embed_prologue
        self.compiled = False
        self.warmup_s: float | None = None
        self.release_all()
        self._make_functions(compiled=False)
        self._make_rows_functions(compiled=False)
        self._prefix_eager_fns: list[Callable[..., Any]] = []
        self._prefix_fns: list[Callable[..., Any]] = []  # layer_prefill_paged (PREFIX_ATTENTION=paged)
        if self.reads_pool_in_place:
            self._make_prefix_functions()

    # --- memory ----------------------------------------------------------------------------------------------------
    def kv_bytes_per_token(self) -> int:
        return int(self.fast.kv_bytes_per_token())

    def graph_pool_idle_bytes(self) -> int:
        """Bytes the batched step's CUDA graph pool holds free between replays (FastDecoder.graph_pool_idle_bytes)."""
        pf = self.prefill_graphs.handles() if self.prefill_graphs is not None else ()
        return pool_idle_bytes(self.device, (self._pool, *pf))

    @property
    def cache_bytes(self) -> int:
        if self.paged:
            return (self.num_blocks + 1) * self.block_size * self.kv_bytes_per_token()
        return self.slots * self.slot_tokens * self.kv_bytes_per_token()

    @property
    def num_blocks(self) -> int:
        """Paged: the pool's blocks a row may take (block num_blocks is the idle rows' scratch block)."""
        return max(1, self.slots * self.slot_tokens // self.block_size)

    @property
    def reply_tokens(self) -> int:
        """The most prompt + new tokens one reply may hold: its slot, or (paged) the whole pool."""
        return self.num_blocks * self.block_size if self.paged else self.slot_tokens

    @property
    def kv_namespace(self) -> str:
        """What a cached block's key is chained to besides its tokens: the KV format that wrote it."""
        return f"{self.fast.options.kv_cache}:{self.fast.dtype}:{self.block_size}"

    def _size_table(self) -> None:
        width = self.num_blocks if self.paged else 1
        self.table = torch.full((self.slots, width), self.num_blocks, dtype=torch.int32, device=self.device)

    def set_blocks(self, slot: int, block_ids: Sequence[int]) -> None:
        """Paged: row `slot` reads and writes these blocks in position order (llm_core.engine.kv_pool.BlockTable);
        the rest of its table names the scratch block. Copied into the static table the CUDA graphs read."""
        ids = list(block_ids)[:self.num_blocks]
        ids += [self.num_blocks] * (self.num_blocks - len(ids))
        self.table[slot].copy_(torch.tensor(ids, dtype=torch.int32), non_blocking=False)

    def append_blocks(self, grown: Sequence[tuple[int, int, Sequence[int]]]) -> None:
        """Paged: rows' tables gain blocks at their end (kv_pool.BlockPool.grow), given as (slot, the first new
        column, the new block ids) per row: every row of a step in one host-to-device copy and one scatter, the copy
        from pinned memory without waiting for the device (a blocking copy waits for the step in flight: with the
        runner's overlap that is most of a step). A row at a time was a tensor and a blocking copy each."""
        cells = [(slot, column + i, block) for slot, column, ids in grown for i, block in enumerate(ids)
                 if column + i < self.num_blocks]
        if not cells:
            return
        where = torch.tensor(cells, dtype=torch.int64).T.contiguous()
        if self.device.type == "cuda":  # queued behind the step in flight instead of waiting for it (overlap)
            where = where.pin_memory().to(self.device, non_blocking=True)
        self.table[where[0], where[1]] = where[2].to(torch.int32)

    def allocate(self) -> None:
        """The slot cache: (layers, slots, slot_tokens, Hkv, row) for K and for V, zeroed; paged: the pool
        (layers, num_blocks + 1, block_size, Hkv, row), the last block the idle rows' scratch."""
        a = self.fast._arch
        row, dtype = kvquant.cache_layout(self.fast.options.kv_cache, a.head_dim, self.fast.dtype)
        shape = (len(a.layers), self.slots, self.slot_tokens, a.n_kv_heads, row)
        if self.paged:
            shape = (len(a.layers), self.num_blocks + 1, self.block_size, a.n_kv_heads, row)
            self._size_table()
        self._graphs.clear()
        if self.prefill_graphs is not None:
            self.prefill_graphs.clear()
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
        had_prefill = self.prefill_graphs is not None and bool(self.prefill_graphs.graphs)
        self._graphs.clear()
        self._pool = None
        self.k = self.v = None  # allocate() forgets the prefill graphs too (they hold the pool's addresses)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        with torch.inference_mode(False), torch.no_grad():
            self.allocate()
            if self.use_graphs:
                self._capture()
                if had_prefill and self._graphs:
                    self._capture_prefill()
            self.release_all()
        prefill_oom = had_prefill and self.prefill_graphs is not None and self.prefill_graphs.capture_oom
        if (had_graphs and not self._graphs) or prefill_oom:  # captured before, not at this size: it does not fit
            del self.notes[notes:]
            raise torch.cuda.OutOfMemoryError(
                f"The batched path's CUDA graphs could not be captured with {self.slot_tokens:,}-token slots.")

    def profile_worst_reply(self, chunk: int | None) -> dict[str, int]:
        """Run the most memory the batched path can take with these slots and measure it (the single-reply
        profile, for the batch): one slot's last prefill chunk (`chunk` tokens, or the whole slot) at the end of a
        full slot, attending to every row before it, and its head; then a step with every slot decoding at its last
        row, from the top bucket's graph. Returns the peak bytes reserved and allocated (CUDA; 0 elsewhere, where the
        same pass runs unmeasured). The slots are released after it; the garbage it leaves in them every reply
        overwrites before reading."""
        end = self.reply_tokens - 2  # the last row a reply writes (scratch_position is the one after it)
        n = max(1, min(chunk or end, end))
        ids = (torch.arange(n, device=self.device) * 7 + 3) % self.fast._arch.vocab
        cuda = self.device.type == "cuda"
        with torch.inference_mode(False), torch.no_grad():
            if cuda:
                self.sync()
                torch.cuda.reset_peak_memory_stats(self.device)
            for slot in range(self.slots if self.paged else 0):  # paged: every row spans the pool (garbage rows)
                self.set_blocks(slot, range(self.num_blocks))
            hn = self.prefill(0, ids, end - n)
            self.first_scores(0, hn)
            del hn
            self.active.fill_(1)
            self.pos.fill_(end)
            self.run_step(max(self.buckets()), end + 1)
            self.sync()
            peak = {"peak_reserved_bytes": int(torch.cuda.max_memory_reserved(self.device)) if cuda else 0,
                    "peak_allocated_bytes": int(torch.cuda.max_memory_allocated(self.device)) if cuda else 0,
                    "tokens": self.reply_tokens if self.paged else self.slot_tokens, "slots": self.slots}
            self.release_all()
        return peak

    # --- warm-up: llm_core.fast.slot_warmup.SlotWarmup (warmup() and its passes) ---------------------------------
    @property
    def captured_buckets(self) -> list[int]:
        """The batch buckets whose step is captured as a CUDA graph."""
        return sorted(self._graphs)

    @property
    def rows_kernel(self) -> bool:
        """Whether llm_core.nf4_mm serves any batch size (bench records and tests read this)."""
        return isinstance(self.rows_max, RowsPlan) and self.rows_max.mm_max > 0

    def _make_rows_functions(self, compiled: bool) -> None:
        """The group prefill's layer (layer_prefill_rows, one closure per distinct layer spec), compiled or not.
        Compiled, Inductor fuses its norms, rotary and activations and it launches a fraction of the eager kernels:
        on 2026-12-05 (s5, H100) the eager group pass of 4 x 512 tokens took ~90 ms where its GEMMs and weight
        dequantization need ~45."""
        f = self.fast

        def bind(spec: LayerSpec) -> Callable[..., Any]:
            def layer(h: torch.Tensor, hn: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kc: torch.Tensor,
                      vc: torch.Tensor, index: torch.Tensor | None, w: list[torch.Tensor],
                      paged: tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, ...]] | None) -> Any:
                return layer_prefill_rows(spec, h, hn, cos, sin, kc, vc, index, w, paged)
            return layer

        wrap: Callable[[Callable[..., Any]], Callable[..., Any]] = f._compile if compiled else (lambda fn: fn)
        fns: dict[int, Callable[..., Any]] = {}
        self._rows_fns = [fns.setdefault(id(spec), wrap(bind(spec))) for spec in f._layer_specs]
        self.rows_compiled = compiled

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
                      span: int | None = None, table: torch.Tensor | None = None,
                      dest: tuple[torch.Tensor, torch.Tensor] | None = None) -> Any:
                return layer_rows(spec, h, hn, cos, sin, pos, last, kc, vc, w, rows_max, span, table, dest)
            return layer

        wrap: Callable[[Callable[..., Any]], Callable[..., Any]] = f._compile if compiled else (lambda fn: fn)
        fns: dict[int, Callable[..., Any]] = {}
        self._layer_fns = [fns.setdefault(id(spec), wrap(bind(spec))) for spec in f._layer_specs]
        self._prologue_fn, self._head_fn = wrap(prologue), wrap(head)
        self.compiled = compiled

    def buckets(self) -> list[int]:
        return sorted({batch_bucket(r, self.slots) for r in range(1, self.slots + 1)})

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # --- per-slot state --------------------------------------------------------------------------------------------
    @property
    def scratch_position(self) -> int:
        """The cache row an idle slot's step writes to: the slot's last, which no reply reaches (a reply is admitted
        with prompt + max new <= slot_tokens, and its last token is never fed back, so it writes rows <= T - 2).
        Paged: an idle row writes to the scratch block whatever its position (step's dest), so 0."""
        return 0 if self.paged else self.slot_tokens - 1

    def release_all(self) -> None:
        self.active.zero_()
        self.pos.fill_(self.scratch_position)
        self.tok.zero_()
        self.table.fill_(self.num_blocks if self.paged else 0)

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
        if self.paged:
            self.table[slot].fill_(self.num_blocks)

    def pause(self, slot: int) -> None:
        """Paged: the row sits out the next steps (no block for its next position yet): it writes to the scratch
        block and keeps its token and position until resume()."""
        self.active[slot] = 0

    def resume(self, slot: int) -> None:
        self.active[slot] = 1

    def _pool_places(self, slot: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Paged: where row `slot`'s positions start..end-1 live in the pool: (block ids, offsets), int64."""
        p = torch.arange(start, end, device=self.device)
        return self.table[slot, p // self.block_size].long(), p % self.block_size

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
            end = start + ids.numel()
            dest = self._pool_places(slot, start, end) if self.paged else None
            if dest is not None and start and self.reads_pool_in_place:
                return self._prefill_in_place(slot, h, hn, cos, sin, start, dest, compiled)
            for i, (fn, w) in enumerate(zip(fns, f._layer_weights, strict=True)):
                if dest is not None:  # paged: the same prefill layer over the row's positions gathered in order
                    kc, vc = self._gathered(self.k[i], slot, start, end), self._gathered(self.v[i], slot, start, end)
                else:
                    kc, vc = self.k[i, slot], self.v[i, slot]
                if compiled:
                    for t in (h, hn, cos, sin):
                        torch._dynamo.maybe_mark_dynamic(t, 1)
                    for t in (kc, vc):
                        torch._dynamo.maybe_mark_dynamic(t, 0)
                h, hn = fn(h, hn, cos, sin, start, kc, vc, w)
                if dest is not None:
                    write_paged_rows(self.k[i], dest, kc[start:end])
                    write_paged_rows(self.v[i], dest, vc[start:end])
        return hn[0, -1:].clone()

    @property
    def reads_pool_in_place(self) -> bool:
        """Whether a later chunk of a paged row attends to its prefix in the pool itself (PREFIX_ATTENTION=paged,
        layer_prefill_paged) instead of a gathered copy; int4 rows always take the copy."""
        return self.paged and self.fast.options.prefix_attention == "paged" and self.fast.options.kv_cache != "int4"

    def _prefill_in_place(self, slot: int, h: torch.Tensor, hn: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                          start: int, dest: tuple[torch.Tensor, torch.Tensor], compiled: bool) -> torch.Tensor:
        """prefill's later chunk of a paged row through layer_prefill_paged: the chunk's K/V written into the pool,
        its attention read from there through the row's block table (one copy of the table row per chunk: a view of
        a different row per slot would be another input to the compiled layer)."""
        f = self.fast
        assert self.k is not None and self.v is not None
        fns = self._prefix_fns if compiled else self._prefix_eager_fns
        table = self.table[slot].clone()
        if compiled:
            for t in (h, hn, cos, sin):
                torch._dynamo.maybe_mark_dynamic(t, 1)
            for t in dest:
                torch._dynamo.maybe_mark_dynamic(t, 0)
        for i, (fn, w) in enumerate(zip(fns, f._layer_weights, strict=True)):
            h, hn = fn(h, hn, cos, sin, start, self.k[i], self.v[i], dest, table, w)
        return hn[0, -1:].clone()

    def _make_prefix_functions(self) -> None:
        """layer_prefill_paged per distinct layer spec, eager and (lazily) compiled where the prefill compiles."""
        f = self.fast

        def bind(spec: LayerSpec) -> Callable[..., Any]:
            def layer(h: torch.Tensor, hn: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, start: int,
                      k_pool: torch.Tensor, v_pool: torch.Tensor, dest: tuple[torch.Tensor, torch.Tensor],
                      table: torch.Tensor, w: list[torch.Tensor]) -> Any:
                return layer_prefill_paged(spec, h, hn, cos, sin, start, k_pool, v_pool, dest, table, w)
            return layer

        eager: dict[int, Callable[..., Any]] = {}
        self._prefix_eager_fns = [eager.setdefault(id(spec), bind(spec)) for spec in f._layer_specs]
        self._prefix_fns = self._prefix_eager_fns
        if self.compile and f.options.compile_prefill:
            compiled: dict[int, Callable[..., Any]] = {}
            self._prefix_fns = [compiled.setdefault(id(fn), f._compile(fn)) for fn in self._prefix_eager_fns]

    def _gathered(self, pool: torch.Tensor, slot: int, start: int, end: int) -> torch.Tensor:
        """Paged prefill: a contiguous (end, Hkv, row) copy of row `slot`'s positions (rows before start read from
        its blocks: a cached prefix or earlier chunks; the chunk's own rows left for the layer to write)."""
        out = pool.new_empty(end, *pool.shape[2:])
        if start:
            out[:start] = gather_blocks(pool, self.table[slot:slot + 1, :-(-start // self.block_size)])[0, :start]
        return out

    def prefill_whole(self, slot: int, ids: torch.Tensor, keep: int = 0) -> torch.Tensor:
        """Paged: row `slot`'s whole prompt from position 0 through the padded prefill (from its CUDA graph where
        captured), positions before `keep` (a cached prefix) computed but not written; see prefill_serves."""
        assert self.prefill_graphs is not None and self.k is not None
        return self.prefill_graphs.prefill(slot, ids, keep)

    def prefill_serves(self, tokens: int) -> bool:
        """Whether prefill_whole serves a whole prompt of `tokens` (paged, and its padded length has a graph)."""
        return self.prefill_graphs is not None and self.prefill_graphs.serves(tokens)

    def prefill_rows(self, slots: Sequence[int], prompts: Sequence[torch.Tensor],
                     keep: Sequence[int] | None = None) -> list[torch.Tensor]:
        """Whole prompts (each from position 0) of several slots in one pass, right-padded to the longest
        (llm_core.fast.layer.layer_prefill_rows): one launch sequence for all newcomers instead of one per prompt.
        Returns each row's last real position's final hidden (1, H). Marks each prompt's tokens as seen.
        `keep` (paged): per row, the leading positions whose blocks hold a cached prefix (shared with other rows,
        so never written): they are computed again for the pass's attention, and only the rest is written."""
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
        index = dest = real = None
        if not self.paged:
            index = torch.tensor(list(slots), dtype=torch.long, device=self.device)
        else:  # each prompt's real rows go to its blocks; the padding is never written
            starts = list(keep) if keep is not None else [0] * len(prompts)
            places = [self._pool_places(slot, first, n) for slot, first, n in zip(slots, starts, lengths, strict=True)]
            dest = (torch.cat([b for b, _ in places]), torch.cat([o for _, o in places]))
            span = torch.arange(ids.shape[1], device=self.device)[None, :]
            real = ((span < torch.tensor(lengths, device=self.device)[:, None])
                    & (span >= torch.tensor(starts, device=self.device)[:, None])).nonzero(as_tuple=True)  # once
        paged = (dest, real) if dest is not None and real is not None else None
        if self.rows_compiled:  # one graph for every group: its rows, length and real positions symbolic
            flat = [*paged[0], *paged[1]] if paged is not None else [index]
            for t, dims in ((h, (0, 1)), (hn, (0, 1)), (cos, (1,)), (sin, (1,)), *((t, (0,)) for t in flat)):
                for d in dims:
                    torch._dynamo.maybe_mark_dynamic(t, d)
        with _prefill_attention_scope(f.options.prefill_attention, self.device):
            for i, (fn, w) in enumerate(zip(self._rows_fns, f._layer_weights, strict=True)):
                h, hn = fn(h, hn, cos, sin, self.k[i], self.v[i], None if self.paged else index, w, paged)
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
        span = None if length is None or self.compiled or length >= self.reply_tokens else length
        if self.paged:  # from the static table, so a graph replays with the blocks copied in since capture
            table = self.table[rows]
            block = table.gather(1, (pos // self.block_size).clamp(max=table.shape[1] - 1)[:, None])[:, 0]
            live = active.bool()  # an idle row writes to the scratch block (num_blocks), at its offset 0
            dest = (torch.where(live, block.long(), self.num_blocks), torch.where(live, pos % self.block_size, 0))
            for i, (fn, w) in enumerate(zip(self._layer_fns, f._layer_weights, strict=True)):
                h, hn = fn(h, hn, cos, sin, pos, last, self.k[i], self.v[i], w, span, table, dest)
        else:
            for i, (fn, w) in enumerate(zip(self._layer_fns, f._layer_weights, strict=True)):
                h, hn = fn(h, hn, cos, sin, pos, last, self.k[i, rows], self.v[i, rows], w, span)
        scores, nxt = self._head_fn(hn, f._lm_tensors, seen, self.penalty[rows], self.eos_bias[rows])
        self.scores[rows].copy_(scores)
        self.tok[rows].copy_(torch.where(active.bool(), nxt, tok))  # a paused row keeps the token it will feed
        self.pos[rows].add_(active)

    def run_step(self, bucket: int, longest: int) -> None:
        """The step from its CUDA graph when captured, else eagerly over the `longest` live cache rows."""
        graph = self._graphs.get(bucket)
        if graph is not None:
            graph.replay()
        else:
            triton_attention = self.fast._layer_specs[0].attention == "triton"
            self.step(bucket, None if triton_attention else round_up(longest, 16))
