"""A newcomer's whole prompt on the batched path's paged pool, prefilled from one CUDA graph per padded length.

What it replaces: SlotDecoder.prefill runs the compiled prefill layer by layer from Python, and a compiled prefill is
host-launch-bound (docs/fast_decode.md, "Time to first token": 21-43 ms of launches for a 512-token NF4 prefill whose
kernels take 18 ms on the H200). The single-reply path replays padded prefill graphs (FastDecoder._padded_prefill);
this is the same for the paged pool, which the batched path (the CUDA default) prefills into.

How: the prompt ids right-padded to a multiple of PREFILL_BUCKET_TOKENS in a static buffer, positions 0..L-1, and
per position where its K/V goes in the pool (block id, offset) in two more static buffers. Every layer runs the fast
path's prefill layer over a temporary (L, Hkv, row) K/V from position 0 and writes the rows to the pool through those
buffers; the padding's rows, and the rows of a cached prefix that is computed again (`keep`: its blocks are shared and
never written), go to the pool's scratch block. Causal attention keeps the real rows blind to the padding. The last
real row's final hidden state is copied to a static (1, H) output, from which the runner picks the first token.

Only prompts from position 0 (a cached prefix of a few blocks is computed again, as the group prefill does) whose
padded length has a graph; longer prompts and later chunks after a cached prefix keep the compiled prefill. The
graphs' pool holds the largest length's activations and the dequantized weight of the largest linear part for as long
as the graphs live: it is resident memory, which the start-up measurement counts before it sizes the pool."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from .layer import _prefill_attention_scope, rms_norm
from .options import PREFILL_BUCKET_TOKENS
from .tables import embed_rows

log = logging.getLogger(__name__)


def padded_length(tokens: int) -> int:
    return -(-int(tokens) // PREFILL_BUCKET_TOKENS) * PREFILL_BUCKET_TOKENS


class PagedPrefillGraphs:
    """Padded prefills of whole prompts into a SlotDecoder's paged pool (`rows`: the SlotDecoder, duck-typed: this
    module is imported by it). `top_tokens`: the longest padded length served (PREFILL_GRAPH_TOKENS as the batched
    path resolves it). Off CUDA (or without graphs) the same padded pass runs eagerly: what the CPU tests check."""

    def __init__(self, rows: Any, top_tokens: int) -> None:
        self.rows = rows
        self.top = int(top_tokens) // PREFILL_BUCKET_TOKENS * PREFILL_BUCKET_TOKENS
        dev = rows.device
        self.ids = torch.zeros(self.top, dtype=torch.long, device=dev)
        self.pos = torch.arange(self.top, device=dev)
        self.blocks = torch.zeros(self.top, dtype=torch.long, device=dev)
        self.offsets = torch.zeros(self.top, dtype=torch.long, device=dev)
        self.last = torch.zeros(1, dtype=torch.long, device=dev)
        self.hn = torch.zeros(1, rows.fast._arch.hidden, dtype=rows.fast.dtype, device=dev)
        self.graphs: dict[int, Any] = {}
        self.pool: Any = None
        self.capture_oom = False  # the last capture ran out of memory

    def buckets(self) -> list[int]:
        """The padded lengths served: multiples of PREFILL_BUCKET_TOKENS up to the top, within one reply's tokens."""
        top = min(self.top, self.rows.reply_tokens - 2)
        return list(range(PREFILL_BUCKET_TOKENS, top + 1, PREFILL_BUCKET_TOKENS))

    def serves(self, tokens: int) -> bool:
        """Whether a prompt of `tokens` goes through the padded pass: its length has a captured graph (or, without
        graphs, a bucket)."""
        bucket = padded_length(tokens)
        if self.rows.use_graphs:
            return bucket in self.graphs
        return 1 < tokens and bucket in self.buckets()

    def clear(self) -> None:
        """Forget the graphs and their pool (before the pool is re-allocated: the graphs hold its addresses)."""
        self.graphs.clear()
        self.pool = None

    # --- a prefill -----------------------------------------------------------------------------------------------
    def prefill(self, slot: int, ids: torch.Tensor, keep: int = 0) -> torch.Tensor:
        """Row `slot`'s whole prompt `ids` (P,) from position 0 (its blocks already set): positions keep..P-1 written
        to its blocks, positions before `keep` (a cached prefix held by other rows too) computed but not written.
        Marks the prompt's tokens as seen. Returns the last position's final hidden (1, H)."""
        rows = self.rows
        total = int(ids.numel())
        bucket = padded_length(total)
        rows.seen[slot].index_fill_(0, ids, True)
        self.ids[:total].copy_(ids)
        self.ids[total:bucket].fill_(0)  # any id: causal attention keeps the real rows blind to it
        p = self.pos[:bucket]
        scratch = rows.num_blocks
        real = (p >= int(keep)) & (p < total)
        block = rows.table[slot, (p // rows.block_size).clamp(max=rows.table.shape[1] - 1)].long()
        self.blocks[:bucket].copy_(torch.where(real, block, scratch))
        self.offsets[:bucket].copy_(p % rows.block_size)
        self.last.fill_(total - 1)
        graph = self.graphs.get(bucket)
        if graph is not None:
            graph.replay()
        else:
            with _prefill_attention_scope(rows.fast.options.prefill_attention, rows.device):
                self.run(bucket)
        return self.hn.clone()

    def run(self, bucket: int) -> None:
        """The capturable pass over the static buffers' first `bucket` positions."""
        rows, f = self.rows, self.rows.fast
        ids = self.ids[:bucket]
        h = embed_rows(ids, f._embed, f._norm0.dtype)[None]
        cos, sin = f._arch.rotary(h, self.pos[:bucket][None])
        hn = rms_norm(h, f._norm0, f._head_spec.eps0)
        dest = (self.blocks[:bucket], self.offsets[:bucket])
        compiled = f._prefill_compiled_ok
        fns = f._prefill_fns if compiled else f._prefill_eager_fns
        for i, (fn, w) in enumerate(zip(fns, f._layer_weights, strict=True)):
            kc = rows.k.new_empty(bucket, *rows.k.shape[3:])  # this layer's K/V rows, then into the pool
            vc = rows.v.new_empty(bucket, *rows.v.shape[3:])
            if compiled:  # the same shape class as SlotDecoder.prefill from position 0: no new compile
                for t in (h, hn, cos, sin):
                    torch._dynamo.maybe_mark_dynamic(t, 1)
                for t in (kc, vc):
                    torch._dynamo.maybe_mark_dynamic(t, 0)
            h, hn = fn(h, hn, cos, sin, 0, kc, vc, w)
            rows.k[i].index_put_(dest, kc)  # layer.write_paged_rows: indexed on the pool itself
            rows.v[i].index_put_(dest, vc)
        self.hn.copy_(hn[0].index_select(0, self.last))

    # --- warm-up -------------------------------------------------------------------------------------------------
    def capture(self) -> None:
        """One graph per padded length, each warmed twice first on the decoder's side stream (compiles and autotunes
        outside capture), writing only the scratch block. A length whose capture fails is left to the compiled
        prefill (said in the decoder's notes); an out-of-memory failure is remembered (capture_oom)."""
        rows = self.rows
        self.clear()
        self.capture_oom = False
        buckets = self.buckets()
        if not buckets or not rows.use_graphs:
            return
        self.blocks.fill_(rows.num_blocks)
        self.offsets.copy_(self.pos % rows.block_size)
        self.last.zero_()
        self.pool = torch.cuda.graph_pool_handle()
        side = rows.fast.side_stream
        side.wait_stream(torch.cuda.current_stream(rows.device))
        scope = rows.fast.options.prefill_attention
        with torch.cuda.stream(side), _prefill_attention_scope(scope, rows.device):
            for bucket in buckets:
                self.run(bucket)
                self.run(bucket)
        torch.cuda.current_stream(rows.device).wait_stream(side)
        rows.sync()
        torch.cuda.empty_cache()  # the side stream's warm-up blocks: free, but only that stream could reuse them
        for bucket in buckets:
            graph = torch.cuda.CUDAGraph()
            try:
                with _prefill_attention_scope(scope, rows.device), torch.cuda.graph(graph, pool=self.pool):
                    self.run(bucket)
            except Exception as exc:  # noqa: BLE001 - the compiled prefill still serves this length
                log.warning("Paged prefill graph for %d tokens not captured: %s: %s", bucket, type(exc).__name__, exc)
                rows.notes.append(f"paged prefill graphs off from {bucket} tokens ({type(exc).__name__})")
                self.capture_oom |= isinstance(exc, torch.cuda.OutOfMemoryError)
                break
            self.graphs[bucket] = graph
        rows.sync()

    @property
    def captured(self) -> list[int]:
        return sorted(self.graphs)

    def handles(self) -> Sequence[Any]:
        return (self.pool,)
