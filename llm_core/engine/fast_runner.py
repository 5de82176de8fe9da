"""The fast batch runner: concurrent replies as rows of llm_core.fast.batched.SlotDecoder's KV slots (or its paged
pool), prefilled in chunks between decode steps, stepped by the fast path's batched step (CUDA graphs per batch
bucket); llm_core.engine.scheduler drives it. Knows nothing about text or Gradio.

A row's life:

    admitted (strict FIFO: a free slot) --> prefill in chunks of PREFILL_TOKENS_PER_STEP between decode steps (the
    fast path's prefill layer over the slot; paged: a whole prompt that a prefill graph serves in one replay,
    llm_core.fast.prefill_graphs) --> first token --> active row --> decode step for rows 0..B-1 (B = the
    smallest batch bucket >= the highest active slot + 1; idle slots inside it compute a throw-away token at
    position 0 of their own slot) --> per-row select (repetition penalty, min-new-tokens EOS ban and argmax inside
    the step; sampling rows through llm_core.sampling with their own generator) --> each row's token to its request
    --> a row that ends (EOS, length, Stop, error) frees its slot before the next step.

Overlap (FastRunner.overlap, on): step i + 1 is launched before step i's tokens are read, so the host's part of a
step (reading and delivering tokens, ending rows, and the reply threads that wake for them taking the GIL) runs
while the device computes the next one. The device feeds each row's token to the next step itself (tok and pos are
written by the step), so nothing the host does between two steps is on the device's path, except admission,
which prefills and picks a first token on the same stream. A row that ends by EOS or Stop has then computed one step
more, whose token is dropped; a row whose budget ends with the step in flight sits the next step out.

Paged KV (KV_LAYOUT=paged, llm_core.engine.kv_pool): a row also needs blocks of the decoder's one pool. Admission
takes the prompt's blocks, the longest cached full-block prefix taken back instead of prefilled (the reply's
cached_prompt_tokens); a decoding row takes a block each time it crosses into a new one. A newcomer whose blocks
cannot be had waits in the queue; a decoding row that cannot get its next block sits out the steps (paused) until
one is freed, and when every decoding row is paused the newest is preempted, as vLLM does: its KV is cached and
released and it re-queues at the head, later resuming from everything it streamed (mostly from the cache). A
finished row's full blocks stay cached (LRU among unheld blocks) for the next prompt with that prefix.
"""

from __future__ import annotations

import functools
import itertools
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ..errors import ContextBudgetError, GenerationError, OutOfMemoryError
from ..fast.batched import PREFILL_TOKENS_PER_STEP, SlotDecoder, batch_bucket
from ..sampling import SamplingOptions, host_pick, sample_from_scores, sampling_generator
from ..streams import QueuedReply
from .kv_pool import BlockPool, BlockTable, PoolExhausted
from .runners import BoundRunner, grad_off

# A newcomer whose cached prefix is at most 1/RECOMPUTE_PREFIX_SHARE of its prompt is prefilled with the group that
# arrived with it, its prefix computed again (FastRunner._recomputable)
RECOMPUTE_PREFIX_SHARE = 4


class FastRequest(QueuedReply):
    """One reply in the batched fast path (`record`: duck-typed nbytes, peak_*_bytes, peak_batch_rows,
    cached_prompt_tokens)."""

    def __init__(self, prompt_ids: list[int], options: SamplingOptions, max_new_tokens: int,
                 stop_event: threading.Event, record: Any = None) -> None:
        super().__init__(prompt_ids, options, max_new_tokens, stop_event, record)
        self.peak_allocated = 0
        self.peak_reserved = 0
        self.peak_rows = 0
        self.generated: list[int] = []  # the tokens streamed so far (a preempted reply resumes after them)
        self.generator: torch.Generator | None = None
        self.cached_prompt_tokens = 0  # prompt tokens whose KV came from the paged pool's cache

    @property
    def kv_ids(self) -> list[int]:
        """Prompt and streamed tokens: what a (re-)admitted row prefills."""
        return self.prompt_ids + self.generated


@dataclass
class _Row:
    request: FastRequest
    slot: int
    ids: torch.Tensor  # the prompt on the device
    prefilled: int = 0  # prompt tokens in the slot
    length: int = 0  # tokens in the slot once decoding (prompt + fed tokens)
    new_tokens: int = 0
    generator: torch.Generator | None = None
    table: BlockTable | None = None  # paged: the row's blocks in the pool
    order: int = 0  # admission order (the newest paused row is the one preempted)
    paused: bool = False  # paged: waiting for a block for its next position
    inflight: int = 0  # launched steps of this row whose token the host has not read yet (0 or 1: overlap)
    final: bool = False  # its last token is in flight: it sits out further steps (overlap)
    eos_allowed: bool = False  # min_new_tokens reached: EOS no longer banned in its steps

    def kv_ids(self) -> list[int]:
        """The token ids whose K/V the row's cache holds (or a launched step writes), from position 0."""
        return self.request.kv_ids[:self.length or self.prefilled]


@dataclass
class _Step:
    """A launched decode step whose tokens the host reads later (FastRunner.decode_step)."""

    rows: dict[int, _Row]  # slot -> row, as launched
    bucket: int
    tokens: torch.Tensor  # the step's tok[:bucket], copied to the host (CUDA: non-blocking, into pinned memory)
    ready: Any  # CUDA: an event recorded after that copy; None when the copy is done already
    launched_s: float


TIMELINE_OPS = 256  # BatchStats.timeline's length


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
    kv_layout: str = "slots"
    pool_blocks: int = 0  # paged: blocks rows may take, of block_tokens each
    block_tokens: int = 0
    free_blocks: int = 0  # paged: unheld blocks (free or cached)
    cached_blocks: int = 0  # paged: blocks findable by a prompt prefix
    waited_for_blocks: int = 0  # paged: requests that found too few free blocks at the head of the queue
    paused_rows: int = 0  # paged: times a decoding row sat out steps for want of a block
    preempted: int = 0  # paged: rows released to the queue because every decoding row wanted a block
    errors: int = 0
    step_s: float = 0.0  # host time of the decode steps: to each step's tokens on the host from its launch, or
    # (overlap) from when the step before it was read, if later: their sum is the loop's time spent decoding
    rows_by_bucket: dict[int, int] = field(default_factory=dict)  # steps per batch bucket
    # the last TIMELINE_OPS device ops the loop ran: (op, rows, host start, host end) in time.perf_counter seconds;
    # on CUDA the end is when the host had launched it (a first token's .item() waits for the device after it)
    timeline: list[tuple[str, int, float, float]] = field(default_factory=list)

    @property
    def mean_rows_per_step(self) -> float:
        return self.rows_decoded / self.decode_steps if self.decode_steps else 0.0

    @property
    def mean_step_s(self) -> float:
        return self.step_s / self.decode_steps if self.decode_steps else 0.0

    def count_step(self, rows: int, bucket: int, step_s: float) -> None:
        """One decode step of `rows` live rows in a batch of `bucket` rows, `step_s` seconds on the host."""
        self.step_s += step_s
        self.decode_steps += 1
        self.rows_decoded += rows
        self.padded_rows += bucket
        self.max_rows_in_step = max(self.max_rows_in_step, rows)
        self.rows_by_bucket[bucket] = self.rows_by_bucket.get(bucket, 0) + 1


class FastRunner(BoundRunner):
    """The BatchRunner (llm_core.engine.runners) over SlotDecoder (see the module docstring). A request whose prompt
    + max new tokens exceed a slot (or the pool) is refused at once; one that fits waits only for a free slot."""

    label = "The batched decode loop"
    thread_name = "fast-batch"
    shutdown_message = "The demo is shutting down; this reply was stopped."
    max_overtakes = 0  # strict arrival order: every request fits a slot, so none waits for a smaller one
    admission_prefill_tokens: int | None = None  # prefill is chunked between steps instead (advance_prefills)

    def __init__(self, slots: SlotDecoder, *, prefill_tokens_per_step: int = PREFILL_TOKENS_PER_STEP,
                 prefix_cache: bool = True, group_prefill: bool = True, overlap: bool = True) -> None:
        self.decoder = slots
        self.prefix_cache = prefix_cache
        # newcomers reaching an idle loop together: one padded pass for a group (True), or each prompt alone (its
        # prefill graph where one serves it); bench.batched --prefill each times the second against the first
        self.group_prefill = group_prefill
        # a step launched before the previous one's tokens are read and delivered (decode_step); off: each step's
        # tokens read before the next launch (bench.batched --host-variants no-overlap times one against the other)
        self.overlap = overlap
        self._pending: _Step | None = None
        self._host_tok: list[torch.Tensor] = []  # two host buffers the steps' tokens are copied into, in turn
        self._last_read_s = 0.0
        self.pool = self._new_pool()
        self.device = slots.device
        self.prefill_tokens_per_step = int(prefill_tokens_per_step)
        self._rows: dict[int, _Row] = {}  # slot -> row, decoding
        self._prefilling: list[_Row] = []  # in slot order of admission
        self._admitted = itertools.count()

    def _new_pool(self) -> BlockPool | None:
        d = self.decoder
        return BlockPool(d.num_blocks, d.block_size, namespace=d.kv_namespace, caching=self.prefix_cache) \
            if d.paged else None

    @property
    def max_batch_size(self) -> int:
        return self.decoder.slots

    # --- what the scheduler asks -------------------------------------------------------------------------------------
    def new_request(self, prompt_ids: list[int], options: SamplingOptions, max_new_tokens: int,
                    stop_event: threading.Event, record: Any) -> FastRequest:
        if max_new_tokens < 1:
            raise GenerationError("max_new_tokens must be at least 1.")
        request = FastRequest(prompt_ids, options, max_new_tokens, stop_event, record)
        if request.kv_tokens > self.decoder.reply_tokens:
            room = "the KV pool" if self.pool is not None else "one reply's KV slot"
            raise ContextBudgetError(
                f"The prompt ({len(prompt_ids):,} tokens) plus max new tokens ({max_new_tokens:,}) exceed {room} "
                f"({self.decoder.reply_tokens:,} tokens); shorten the history or lower max new tokens.")
        return request

    def new_stats(self) -> BatchStats:
        d = self.decoder
        return BatchStats(slots=d.slots, slot_tokens=d.slot_tokens, kv_layout="paged" if d.paged else "slots",
                          pool_blocks=d.num_blocks if d.paged else 0, block_tokens=d.block_size if d.paged else 0)

    def snapshot(self, stats: BatchStats, waiting: int) -> BatchStats:
        pool = self.pool
        return replace(stats, waiting=waiting, active=len(self._rows), prefilling=len(self._prefilling),
                       kv_held_bytes=self.decoder.cache_bytes, free_blocks=pool.free_blocks if pool else 0,
                       cached_blocks=pool.cached_blocks if pool else 0, rows_by_bucket=dict(stats.rows_by_bucket),
                       timeline=list(stats.timeline))

    def count_wait(self, stats: BatchStats, reason: str) -> bool:
        if reason == "memory":
            stats.waited_for_blocks += 1
        else:
            stats.waited_for_slot += 1
        return True

    def warm(self) -> None:
        """Allocate and warm the slots (compile and capture on CUDA) unless done already."""
        if self.decoder.k is None:
            self.decoder.warmup()

    def resize(self, slot_tokens: int) -> None:
        """SlotDecoder.resize (the scheduler allows it before its loop runs); a fresh pool for the new slots."""
        self.decoder.resize(slot_tokens)
        self.pool = self._new_pool()

    def loop_mode(self) -> AbstractContextManager[None]:
        return grad_off()  # the warm-up's mode: no recompile of the step

    def usable(self) -> bool:
        return True

    def busy(self) -> bool:
        return bool(self._rows or self._prefilling) or self._pending is not None

    def decoding(self) -> bool:
        return bool(self._rows) or self._pending is not None  # a launched step's tokens still to deliver

    def has_free_row(self) -> bool:
        return bool(self._free_slots())

    def fits(self, request: QueuedReply) -> bool:
        """Paged: no decoding row is paused for a block, and the pool can give the prompt its blocks (a cached prefix
        taken back); with slots a free one is all a request needs (it fits a slot: checked at submit)."""
        if self.pool is None:
            return True
        assert isinstance(request, FastRequest)
        ids = request.kv_ids  # a preempted reply resumes after its tokens
        return not any(r.paused for r in self._rows.values()) and self.pool.can_start(ids, len(ids))

    def admit(self, request: QueuedReply) -> None:
        """The lowest free slot (and, paged, the prompt's blocks: a cached prefix is not prefilled again); the row
        prefills from advance_prefills on."""
        assert isinstance(request, FastRequest)
        ids_list = request.kv_ids
        table = self.pool.start(ids_list, len(ids_list)) if self.pool is not None else None
        slot = self._free_slots()[0]
        options = request.options
        if request.generator is None:
            request.generator = sampling_generator(options, self.device)
        ids = torch.tensor(ids_list, dtype=torch.long, device=self.device)
        row = _Row(request, slot, ids, generator=request.generator, table=table, order=next(self._admitted))
        if table is not None:
            self.decoder.set_blocks(slot, table.block_ids)
            row.prefilled = table.cached_tokens
            if not request.generated:
                request.cached_prompt_tokens = table.cached_tokens
        with self.host.cond:
            self._prefilling.append(row)
        self.decoder.start_row(slot, options.repetition_penalty, sorted(self.host.eos_token_ids),
                               options.min_new_tokens > len(request.generated))
        if row.prefilled:  # the cached prefix's tokens were seen too (the repetition penalty)
            self.decoder.seen[slot].index_fill_(0, ids[:row.prefilled], True)

    def drop_stopped_rows(self) -> None:
        for row in [r for r in (*self._rows.values(), *self._prefilling) if r.request.stop_event.is_set()]:
            self._end_row(row, "stopped")

    def fail_all(self, exc: BaseException) -> None:
        import traceback

        traceback.clear_frames(exc.__traceback__)
        if isinstance(exc, torch.cuda.OutOfMemoryError):
            torch.cuda.empty_cache()
            err: BaseException = OutOfMemoryError("The GPU ran out of memory in the batched decode step; the replies "
                                                  "in it were stopped. Try again with fewer at once.")
        else:
            err = GenerationError(f"Generation failed: {type(exc).__name__}: {str(exc)[:300]}")
        self._pending = None
        for row in [*self._rows.values(), *self._prefilling]:
            self._end_row(row, "error", err)

    def take_all(self) -> list[QueuedReply]:
        pending: list[QueuedReply] = [r.request for r in (*self._rows.values(), *self._prefilling)]
        self._pending = None
        self._rows.clear()
        self._prefilling.clear()
        return pending

    # --- rows --------------------------------------------------------------------------------------------------------
    def _free_slots(self) -> list[int]:
        taken = set(self._rows) | {r.slot for r in self._prefilling}
        return [s for s in range(self.decoder.slots) if s not in taken]

    def _end_row(self, row: _Row, reason: str, error: BaseException | None = None) -> None:
        """The row leaves: its record filled, its slot freed, its request finished. A pick for a launched step whose
        token the request never gets (overlap) leaves no logprob behind."""
        request = row.request
        control = getattr(request.options, "control", None)
        if row.inflight and control is not None:
            control.forget_picks(row.inflight)
        record = request.record
        if record is not None:
            tokens = row.length if row.length else row.prefilled
            record.nbytes = tokens * self.decoder.kv_bytes_per_token() or None
            if self.device.type == "cuda":
                record.peak_allocated_bytes = request.peak_allocated or None
                record.peak_reserved_bytes = request.peak_reserved or None
            record.peak_batch_rows = request.peak_rows or None
            record.cached_prompt_tokens = request.cached_prompt_tokens
        self._release_row(row, keep=error is None)
        self.host.finish(request, reason, error)

    def _release_row(self, row: _Row, keep: bool) -> None:
        """The row leaves its slot (and its blocks: the full ones cached unless `keep` is off, after an error)."""
        with self.host.cond:
            if self._rows.get(row.slot) is row:
                del self._rows[row.slot]
            if row in self._prefilling:
                self._prefilling.remove(row)
        if self.pool is not None and row.table is not None:
            if keep:
                self.pool.commit(row.table, row.kv_ids())
            self.pool.finish(row.table)
        self.decoder.release(row.slot)

    def _measure(self, op: Callable[[], Any], rows: int) -> Any:
        """Run op, noted in the stats' timeline (its name, rows and host start/end); on CUDA record the device's
        allocation peak during it on every reply in flight (the batch's peak during each reply, with the rows
        decoding at that moment). Only this thread allocates on the device while the batched path serves, so the
        peak between reset and read is this op's."""
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        name = getattr(op, "func", op).__name__
        t0 = time.perf_counter()
        out = op()
        timeline = self.host.stats.timeline
        timeline.append((name, rows, t0, time.perf_counter()))
        del timeline[:-TIMELINE_OPS]
        if not cuda:
            return out
        allocated = torch.cuda.max_memory_allocated(self.device)
        reserved = torch.cuda.max_memory_reserved(self.device)
        for row in [*self._rows.values(), *self._prefilling]:
            request = row.request
            if allocated > request.peak_allocated:
                request.peak_allocated, request.peak_rows = allocated, rows
            request.peak_reserved = max(request.peak_reserved, reserved)
        return out

    # --- prefill -----------------------------------------------------------------------------------------------------
    def advance_prefills(self) -> None:
        """Prefill newcomers: at most prefill_tokens_per_step tokens while rows are decoding, else everything
        waiting (in chunks of the fast path's prefill_chunk_tokens if set). A finished prefill picks its first
        token and joins the decode batch."""
        budget = self.prefill_tokens_per_step if self._rows else None
        chunk_cap = self.decoder.fast.options.prefill_chunk_tokens
        if budget is None and self.group_prefill:
            self._prefill_together(chunk_cap)
        stats = self.host.stats
        while self._prefilling and (budget is None or budget > 0):
            row = self._prefilling[0]
            total = row.ids.numel()
            if self.decoder.prefill_serves(total) and self._recomputable(row):
                # the whole prompt in one graph replay, even past the step's budget: the running rows stall once
                # instead of once per chunk of the host-launched prefill
                if budget is not None:
                    budget -= total - row.prefilled
                self._prefill_whole(row)
                continue
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
            stats.prefill_chunks += 1
            row.prefilled += take
            if budget is not None:
                budget -= take
            if row.prefilled < total:
                continue
            stats.prefills += 1
            with self.host.cond:
                self._prefilling.remove(row)
            self._first_token(row, hn)

    def _prefill_whole(self, row: _Row) -> None:
        """Row `row`'s whole prompt through SlotDecoder.prefill_whole (padded, from its CUDA graph), a cached prefix
        of a few blocks computed again (and so not counted as cached), then its first token."""
        try:
            hn = self._measure(functools.partial(self.decoder.prefill_whole, row.slot, row.ids, row.prefilled),
                               len(self._rows) + 1)
        except Exception as exc:  # noqa: BLE001 - this request only
            self._fail_prefill([row], exc)
            return
        self.host.stats.prefill_chunks += 1
        if row.prefilled and not row.request.generated:  # computed again: none of it came from the cache
            row.request.cached_prompt_tokens = 0
        row.prefilled = row.ids.numel()
        self.host.stats.prefills += 1
        with self.host.cond:
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
        measured for one chunk bounds it, and each group is one forward instead of one per prompt (fewer host-launched
        prefills: the newcomers' TTFT). A group's failure fails its rows only."""
        cap = int(chunk_cap) if chunk_cap else self.decoder.slot_tokens
        fresh = sorted((r for r in self._prefilling if self._recomputable(r) and r.ids.numel() <= cap),
                       key=lambda r: r.ids.numel())
        stats = self.host.stats
        while len(fresh) >= 2:
            group = [fresh.pop(0)]
            while fresh and (len(group) + 1) * fresh[0].ids.numel() <= cap:
                group.append(fresh.pop(0))
            if len(group) < 2:
                continue
            keep = [r.prefilled for r in group] if self.pool is not None else None
            try:
                hns = self._measure(functools.partial(self.decoder.prefill_rows, [r.slot for r in group],
                                                      [r.ids for r in group], keep), len(group))
            except Exception as exc:  # noqa: BLE001 - these requests only
                self._fail_prefill(group, exc)
                continue
            stats.prefill_chunks += 1
            for row, hn in zip(group, hns, strict=True):
                if row.prefilled and not row.request.generated:  # computed again: none of it came from the cache
                    row.request.cached_prompt_tokens = 0
                row.prefilled = row.ids.numel()
                stats.prefills += 1
                with self.host.cond:
                    self._prefilling.remove(row)
                self._first_token(row, hn)

    @staticmethod
    def _recomputable(row: _Row) -> bool:
        """Whether a newcomer may join a group prefilled together from position 0: nothing of it in the slot yet, or
        (paged) a cached prefix of at most a quarter of its prompt, e.g. the chat template's first block that every
        chat shares. That prefix is computed again for the group's attention and its shared blocks left as they are:
        cheaper than prefilling each such row on its own, one pass per row, while the group's first tokens wait."""
        return row.prefilled == 0 or row.prefilled * RECOMPUTE_PREFIX_SHARE <= row.ids.numel()

    def _first_token(self, row: _Row, hn: torch.Tensor) -> None:
        request = row.request
        if self.pool is not None and row.table is not None:  # the prompt's full blocks: findable from now on
            self.pool.commit(row.table, row.kv_ids())
        if request.stop_event.is_set():
            self._end_row(row, "stopped")
            return
        try:
            scores, nxt = self.decoder.first_scores(row.slot, hn)
            if host_pick(request.options):
                nxt = sample_from_scores(scores, request.options, row.generator)
            token = int(nxt.item())
        except Exception as exc:  # noqa: BLE001 - this request only (e.g. its sampling options)
            self._end_row(row, "error", exc)
            return
        row.length = row.prefilled
        request.generated.append(token)
        row.new_tokens = len(request.generated)
        with self.host.cond:
            self._rows[row.slot] = row  # decoding from here (so _end_row finds it)
        reason = self.host.deliver(request, token, row.new_tokens, request.options.min_new_tokens)
        if reason:
            self._end_row(row, reason)
            return
        self.decoder.activate(row.slot, token, row.length)
        if request.options.min_new_tokens and row.new_tokens >= request.options.min_new_tokens:
            row.eos_allowed = True
            self.decoder.allow_eos(row.slot)

    # --- decode ------------------------------------------------------------------------------------------------------
    def _take_blocks(self) -> None:
        """Paged: each decoding row holds a block for the position this step writes, oldest rows first; a row
        that cannot get one is paused (it sits the step out), and when every row is paused the newest is
        preempted (its KV cached and released, its request first in the queue)."""
        assert self.pool is not None
        rows = sorted((r for r in self._rows.values() if not r.final), key=lambda r: r.order)
        grown: list[tuple[int, int, list[int]]] = []  # written to the device table together, below
        for row in rows:
            assert row.table is not None
            if row.table.capacity <= row.length:
                held = len(row.table.block_ids)
                try:
                    self.pool.grow(row.table, row.length + 1)
                except PoolExhausted:
                    if not row.paused:
                        row.paused = True
                        self.host.stats.paused_rows += 1
                        self.decoder.pause(row.slot)
                    continue
                grown.append((row.slot, held, row.table.block_ids[held:]))
            if row.paused:
                row.paused = False
                self.decoder.resume(row.slot)
        self.decoder.append_blocks(grown)
        if rows and all(r.paused for r in rows):
            newest = rows[-1]
            self.host.stats.preempted += 1
            self._release_row(newest, keep=True)
            self.host.requeue_first(newest.request)
            if len(rows) > 1:
                self._take_blocks()

    def decode_step(self) -> None:
        """One decode step for every decoding row. With overlap (the default) the step is launched before the
        previous step's tokens are read and delivered, so the host's share of step i (reading its tokens, delivering
        them, ending rows, and the reply threads that wake for them taking the GIL) runs while the device computes
        step i + 1, as SGLang's overlap scheduler and vLLM's async scheduling do. A row that ends at step i by EOS or
        Stop has then run step i + 1 too, whose token is never read; a row whose token budget step i uses up sits
        step i + 1 out (_launch). When a row may not get the block its next position needs (the pool nearly full),
        the earlier step is read first, so pausing and preempting see every token."""
        pending, self._pending = self._pending, None
        if pending is not None and not self._may_run_ahead():
            self._finish(pending)
            pending = None
        launched = self._launch()
        if pending is not None:
            self._finish(pending)
        if launched is not None:
            if self.overlap:
                self._pending = launched
            else:
                self._finish(launched)

    def _may_run_ahead(self) -> bool:
        """Whether the next step may launch before the pending one's tokens are read: overlap on, and (paged) every
        row that needs a new block for its next position can have one, so no row pauses or is preempted."""
        if not self.overlap:
            return False
        if self.pool is None:
            return True
        rows = [r for r in self._rows.values() if not r.final]
        needed = sum(1 for r in rows if r.table is not None and r.table.capacity <= r.length)
        return not any(r.paused for r in rows) and needed <= self.pool.free_blocks

    def _launch(self) -> _Step | None:
        """Launch one step for the rows that have a token to feed (none when every row sits out): a row whose last
        token is already in flight (its budget, or its cache room) sits out from now on; EOS is allowed in a row's
        step once min_new_tokens will have been streamed before it. The step's tokens are copied to the host behind
        it, read by _finish."""
        for row in list(self._rows.values()):
            if row.final:
                continue
            if row.new_tokens + row.inflight >= row.request.max_new_tokens or \
                    row.length >= self.decoder.reply_tokens:  # the room: cannot happen (admitted within it)
                if row.inflight == 0:
                    self._end_row(row, "length")
                    continue
                row.final = True
                self.decoder.pause(row.slot)  # writes to the scratch block, keeps its position
        if self.pool is not None:
            self._take_blocks()
        rows = {s: r for s, r in self._rows.items() if not r.paused and not r.final}
        if not rows:
            return None
        for row in rows.values():
            least = row.request.options.min_new_tokens
            if least and not row.eos_allowed and row.new_tokens + row.inflight >= least:
                row.eos_allowed = True
                self.decoder.allow_eos(row.slot)
        bucket = batch_bucket(max(self._rows) + 1, self.decoder.slots)
        longest = max(r.length for r in rows.values()) + 1
        t0 = time.perf_counter()
        self._measure(functools.partial(self.decoder.run_step, bucket, longest), len(rows))
        sampled = {s: r for s, r in rows.items() if host_pick(r.request.options)}
        for slot, row in sampled.items():  # the sampler shared by every path, on this row's scores
            self.decoder.tok[slot:slot + 1].copy_(
                sample_from_scores(self.decoder.scores[slot:slot + 1], row.request.options, row.generator))
        tokens, ready = self._copy_tokens(bucket)
        for row in rows.values():
            row.length += 1
            row.inflight += 1
        return _Step(rows, bucket, tokens, ready, t0)

    def _copy_tokens(self, bucket: int) -> tuple[torch.Tensor, Any]:
        """The step's tokens onto the host: on CUDA a non-blocking copy into one of two pinned buffers (the other
        may hold the previous step's, not read yet) and an event after it; elsewhere a copy."""
        tok = self.decoder.tok[:bucket]
        if self.device.type != "cuda":
            return tok.clone(), None
        if not self._host_tok or self._host_tok[0].numel() < self.decoder.slots:
            self._host_tok = [torch.empty(self.decoder.slots, dtype=tok.dtype, pin_memory=True) for _ in range(2)]
        host = self._host_tok[0][:bucket]
        self._host_tok.reverse()
        host.copy_(tok, non_blocking=True)  # on tok's device's current stream, behind the step
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))
        return host, ready

    def _finish(self, step: _Step) -> None:
        """Read a launched step's tokens (the step's one host sync) and deliver each to its row's request, unless the
        row ended since (Stop, an error): its token is dropped."""
        if step.ready is not None:
            step.ready.synchronize()
        tokens = step.tokens.tolist()
        now = time.perf_counter()
        # the step's share of the loop's time: from its launch, or from when the step before it was read
        self.host.stats.count_step(len(step.rows), step.bucket, now - max(step.launched_s, self._last_read_s))
        self._last_read_s = now
        for slot, row in step.rows.items():
            if self._rows.get(slot) is not row:
                continue
            row.inflight -= 1
            request = row.request
            if request.stop_event.is_set():
                self._end_row(row, "stopped")
                continue
            token = int(tokens[slot])
            request.generated.append(token)
            row.new_tokens += 1
            reason = self.host.deliver(request, token, row.new_tokens, request.options.min_new_tokens)
            if reason:
                self._end_row(row, reason)
            elif row.final and row.inflight == 0:  # out of cache room (cannot happen: admitted within it)
                self._end_row(row, "length")
