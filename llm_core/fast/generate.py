"""The fast path's runtime: FastDecoder owns the static KV cache, the compiled layer functions and their CUDA
graphs, and runs prefill -> decode_step -> select -> stream for one reply at a time (the stages are described in
llm_core/fast/__init__.py). It takes a LoadedModel and token ids, never text, settings files or the UI.

On CPU the same code runs eagerly (no compile, no graphs): that is what the token-equality tests exercise.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch

from ..config import GenerationSettings
from ..errors import GenerationError, OutOfMemoryError
from ..sampling import host_pick, sample_from_scores, sampling_generator
from ..types import LoadedModel
from . import kvquant, linear_pick
from .compiled import own_code
from .kernels.attention import round_up
from .kernels.pdl import compile_options, pdl_support
from .layer import (
    PREFIX_SPLIT_BUCKET,
    HeadSpec,
    LayerSpec,
    _prefill_attention_scope,
    embed_prologue,
    head_logits,
    layer_decode,
    layer_prefill,
    prefix_flash_ok,
    prefix_split_backend,
    rms_norm,
)
from .options import PREFILL_BUCKET_TOKENS, FastDecodeOptions
from .pack import pack_linears
from .support import Arch, fast_path_support
from .tables import embed_rows, table_tensors
from .warmup import DecoderWarmup, _load_compile_artifacts, _save_compile_artifacts

if TYPE_CHECKING:
    from ..prefix_cache import PrefixCache

log = logging.getLogger(__name__)

MIN_BUCKET_TOKENS = 256


def bucket_list(cache_len: int) -> list[int]:
    """Attention lengths the decode step is captured for: every 256 tokens to 4k, 1k to 16k, then 4k; the last
    is the cache length. Decoding at position p uses the smallest bucket > p, so attention reads at most ~25%
    (short) / ~6% (long contexts) more cache rows than needed."""
    out, b = [], MIN_BUCKET_TOKENS
    while b < cache_len:
        out.append(b)
        b += 256 if b < 4096 else 1024 if b < 16384 else 4096
    out.append(cache_len)
    return out


@dataclass
class _KVLayer:
    keys: torch.Tensor
    values: torch.Tensor


@dataclass
class KVCacheView:
    """Read-only view of the static cache in the layout metrics.cache_bytes reads (`layers[i].keys/values`)."""

    layers: list[_KVLayer] = field(default_factory=list)



def pool_idle_bytes(device: torch.device, handles: Sequence[Any]) -> int:
    """Bytes the CUDA graph pools `handles` (torch.cuda.graph_pool_handle(); None skipped) hold free; 0 off CUDA."""
    pools = {tuple(p) for p in handles if p is not None}
    if device.type != "cuda" or not pools:
        return 0
    index = device.index if device.index is not None else torch.cuda.current_device()
    return sum(int(seg["total_size"]) - int(seg["allocated_size"]) for seg in torch.cuda.memory_snapshot()
               if seg.get("device") == index and tuple(seg.get("segment_pool_id", ())) in pools)


class FastDecoder(DecoderWarmup):
    """Owns the static KV cache, packed weights, compiled step and captured graphs of one loaded model.

    One reply at a time (a lock). Building it re-points the model's q/k/v and gate/up weights at fused storage
    (same values); plain `model.generate` keeps working on the same model. With a `prefix_cache`, a reply prefills
    only the prompt tokens after the longest prefix whose KV the last reply left in the static cache.
    """

    def __init__(self, loaded: LoadedModel, *, max_cache_len: int | None = None, compile: bool | None = None,
                 options: FastDecodeOptions | None = None, prefix_cache: PrefixCache | None = None) -> None:
        ok, reason = fast_path_support(loaded, allow_cpu=True)
        if not ok:
            raise GenerationError(f"The fast decode path cannot run for this model: {reason}.")
        self.loaded = loaded
        self.device = loaded.device
        quantized = loaded.settings.quantization in ("nf4", "int8")
        self.dtype = loaded.compute_dtype if quantized else _weights_dtype(loaded.model)
        self.compile = self.device.type == "cuda" if compile is None else compile
        self.use_graphs = self.compile and self.device.type == "cuda"
        self._arch = Arch.from_model(loaded.model)
        requested = options or FastDecodeOptions()
        pdl = pdl_support(self.device) if requested.launch_overlap != "off" else (False, "")  # probed once
        self.options = requested.resolved(self.device, self._arch.head_dim, pdl=pdl)
        self._overlap_note = ""  # why LAUNCH_OVERLAP stayed off on a GPU that has it (a driver, a Triton)
        if (requested.launch_overlap != "off" and not pdl[0] and self.device.type == "cuda"
                and torch.cuda.get_device_capability(self.device)[0] >= 9):
            self._overlap_note = "launch overlap off: " + pdl[1]
        self.reason = reason
        self.max_cache_len = int(max_cache_len or loaded.context_length)
        self._lock = threading.Lock()
        self.prefix_cache = prefix_cache  # the ids whose KV the static cache holds (None: every reply from 0)
        self.gemv_timings_us: dict[str, float] = {}  # start-up timing of each 4-bit kernel (auto)
        self.dense_gemv_timings_us: dict[str, float] = {}  # and of cuBLAS / llm_core.dense_gemv (dense_gemv=auto)
        if self.options.gemv == "nf4" and self.dtype != torch.bfloat16:  # the kernel reads bf16 activations
            self.options = replace(self.options, gemv="bnb")
        with torch.no_grad():
            if self.options.gemv == "auto":
                gemv, self.gemv_timings_us = linear_pick.pick_gemv(
                    self._arch, self.options, loaded.settings.quantization, self.dtype, self.device)
                self.options = replace(self.options, gemv=gemv)
            if self.options.dense_gemv == "auto":
                dense, self.dense_gemv_timings_us = linear_pick.pick_dense_gemv(self._arch, self.options, self.dtype,
                                                                                self.device)
                self.options = replace(self.options, dense_gemv=dense)
            self._build_plan()
            # the prefill's NF4 matmul per chunk size: nf4_gemm or dequantize + matmul, timed (CUDA; {} elsewhere)
            self.prefill_gemm_timings_us = (linear_pick.pick_prefill_gemm(self) if self.options.prefill_gemm == "auto"
                                            else {})
        vocab = self._arch.vocab
        dev = self.device
        self._tok = torch.zeros(1, dtype=torch.long, device=dev)
        self._pos = torch.zeros(1, dtype=torch.long, device=dev)
        self._seen = torch.zeros(vocab, dtype=torch.bool, device=dev)
        self._penalty = torch.ones((), dtype=torch.float32, device=dev)
        self._eos_bias = torch.zeros(vocab, dtype=torch.float32, device=dev)
        self._scores = torch.zeros(1, vocab, dtype=torch.float32, device=dev)
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None
        self._cache_len = 0
        self._buckets: list[int] = []
        self._graphs: dict[int, Any] = {}
        self._pool: Any = None
        self._host_tokens: torch.Tensor | None = None
        self._events: list[Any] = []
        self._cpu_tokens: dict[int, int] = {}
        self._compiled = False
        self.warmup_s: float | None = None
        self.compile_cache_loaded = False
        self.compile_s: float | None = None
        self.capture_s: float | None = None
        self.prefill_warm_s: float | None = None
        self._pf_graphs: dict[int, Any] = {}  # padded prefill: one CUDA graph per bucket length
        self._pf_pool: Any = None
        self._prefill_capture_oom = False  # the last allocation's prefill graph capture ran out of memory
        self._pf_ids: torch.Tensor | None = None  # static inputs / outputs of the padded prefill
        self._pf_pos: torch.Tensor | None = None
        self._pf_last = torch.zeros(1, dtype=torch.long, device=self.device)
        self._pf_scores = torch.zeros(1, self._arch.vocab, dtype=torch.float32, device=self.device)
        self._pf_tok = torch.zeros(1, dtype=torch.long, device=self.device)
        # The one stream every warm-up before a graph capture runs on (decode buckets, padded prefills, the batched
        # step), for the decoder's life. A new torch.cuda.Stream() per capture would take the next of PyTorch's 32 pool
        # streams each time, and every (thread, stream) pair that runs cuBLAS keeps a workspace for good (32 MiB on
        # Hopper, ~8 MiB before), besides its own cached blocks: start-up sizing re-captures several times.
        self.side_stream: Any = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        # The last reply's prefill, for diagnostics (prefill_clock): host clock reads, and CUDA events around it
        self._clock: dict[str, float] = {}
        self._prefill_events: tuple[Any, Any] | None = None

    # --- weights ---------------------------------------------------------------------------------------------
    def _build_plan(self) -> None:
        a, opts = self._arch, self.options
        gemv = opts.gemv
        attention = opts.attention if opts.attention == "triton" else ("reduce" if self.compile else "matmul")
        prefix_flash = opts.prefill_attention == "flash" and prefix_flash_ok(self.device, self.dtype, a.head_dim)
        # split: where flash attention runs (CUDA), and on CPU (the eager fast path: its flash op, for tests)
        prefix_split = prefix_split_backend(self.device, self.dtype, a.head_dim) \
            if opts.prefix_attention == "split" and (prefix_flash or self.device.type == "cpu") else ""
        pdl = opts.overlaps  # resolved: on only where pdl_support said yes
        layer_specs: dict[LayerSpec, LayerSpec] = {}  # one instance per distinct spec: one compiled graph each
        self._layer_specs: list[LayerSpec] = []
        self._layer_weights: list[list[torch.Tensor]] = []
        notes: set[str] = set()
        for i, layer in enumerate(a.layers):
            attn = layer.self_attn
            packed = [pack_linears(g, opts, gemv, planar_input=attn.o_proj not in g)
                      for g in linear_pick.layer_groups(layer, opts.fuse)]
            notes.update(p.note for p in packed if p.note)
            next_norm = a.layers[i + 1].input_layernorm if i + 1 < len(a.layers) else a.norm
            rest = [layer.post_attention_layernorm.weight, next_norm.weight]
            qk_eps = None
            if a.qk_norm:
                rest += [attn.q_norm.weight, attn.k_norm.weight]
                qk_eps = float(_eps(attn.q_norm))
            spec = LayerSpec(a.n_heads, a.n_kv_heads, a.head_dim, float(attn.scaling),
                              float(_eps(layer.post_attention_layernorm)), float(_eps(next_norm)), qk_eps,
                              tuple(p.spec for p in packed), opts.fuse, attention, prefix_flash, prefix_split, pdl,
                              PREFIX_SPLIT_BUCKET)
            self._layer_specs.append(layer_specs.setdefault(spec, spec))
            self._layer_weights.append([t for p in packed for t in p.tensors] + [r.detach() for r in rest])
        lm = pack_linears([a.lm_head], replace(opts, fuse=False), gemv)
        self._head_spec = HeadSpec(lm.spec, float(_eps(a.layers[0].input_layernorm)))
        self._lm_tensors = lm.tensors
        self._embed = table_tensors(a.embed)  # [weight], or [int8 rows, row scales] (llm_core.fast.tables)
        self._norm0 = a.layers[0].input_layernorm.weight.detach()
        if pdl:
            notes.add("decode kernels launched as programmatic dependent launches (LAUNCH_OVERLAP"
                      + (", 4-bit weights prefetched before each wait)" if opts.launch_overlap == "early" else ")"))
        if self._overlap_note:
            notes.add(self._overlap_note)
        self.notes = sorted(notes)
        self._make_functions()

    def _make_functions(self) -> None:
        """Closures over static specs; compiled once each (all layers share one spec, hence one graph)."""
        head_spec, rotary = self._head_spec, self._arch.rotary

        def prologue(tok: torch.Tensor, pos: torch.Tensor, embed: list[torch.Tensor], norm0: torch.Tensor) -> Any:
            return embed_prologue(head_spec, rotary, tok, pos, embed, norm0)

        def head(hn: torch.Tensor, lm: list[torch.Tensor], seen: torch.Tensor, penalty: torch.Tensor,
                 eos_bias: torch.Tensor) -> Any:
            return head_logits(head_spec, hn, lm, seen, penalty, eos_bias)

        layer_fns: dict[int, Callable[..., Any]] = {}
        for spec in self._layer_specs:
            if id(spec) not in layer_fns:
                layer_fns[id(spec)] = _bind_layer(spec)
        prefill_fns: dict[int, Callable[..., Any]] = {}
        for spec in self._layer_specs:
            if id(spec) not in prefill_fns:
                prefill_fns[id(spec)] = _bind_prefill(spec)
        self._prologue_fn: Callable[..., Any] = prologue
        self._head_fn: Callable[..., Any] = head
        self._layer_fns: list[Callable[..., Any]] = [layer_fns[id(s)] for s in self._layer_specs]
        self._prefill_eager_fns: list[Callable[..., Any]] = [prefill_fns[id(s)] for s in self._layer_specs]
        self._prefill_fns = self._prefill_eager_fns
        self._prefill_compiled_ok = False
        if self.compile:
            compiled: dict[int, Callable[..., Any]] = {}
            self._prologue_fn = self._compile(prologue)
            self._head_fn = self._compile(head)
            self._layer_fns = [compiled.setdefault(id(fn), self._compile(fn)) for fn in self._layer_fns]
            if self.options.compile_prefill:
                self._prefill_fns = [compiled.setdefault(id(fn), self._compile(fn)) for fn in self._prefill_fns]
                self._prefill_compiled_ok = True

    def _compile(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        # Dynamo keeps its graphs (at most recompile_limit, 8) on the code object: every decoder of the process
        # compiling the one shared closure code ran into the limit, and fullgraph then failed the prefill graphs
        fn = own_code(fn, fn.__name__)
        backend = self.options.compile_backend
        if backend == "inductor":
            # The NF4 code-table lookups index a 16-entry table with a 4-bit value: skip inductor's bounds asserts.
            # LAUNCH_OVERLAP: inductor's kernels wait for and release their neighbours as ours do (kernels.pdl).
            options = {"assert_indirect_indexing": False,
                       **compile_options(self.options.overlaps)}
            return torch.compile(fn, fullgraph=True, options=options)
        return torch.compile(fn, fullgraph=True, backend=backend)

    def device_tensors(self) -> list[torch.Tensor]:
        """The tensors the decode step reads (packed linears, head, embedding, norms): with the model's own, what
        llm_core.memory.compact re-lays once before warm-up."""
        return [t for tensors in [*self._layer_weights, self._lm_tensors, self._embed] for t in tensors] + [self._norm0]

    @property
    def weights_bytes_per_token(self) -> int:
        """Bytes of weights the decode step reads per token (all linears, norms, lm_head; one embedding row)."""
        seen: set[int] = set()
        total = 0
        for tensors in [*self._layer_weights, self._lm_tensors]:
            for t in tensors:
                if t.data_ptr() not in seen:
                    seen.add(t.data_ptr())
                    total += t.numel() * t.element_size()
        return total + self._arch.hidden * self._embed[0].element_size()

    def kv_bytes_per_token(self) -> int:
        a = self._arch
        row, dtype = kvquant.cache_layout(self.options.kv_cache, a.head_dim, self.dtype)
        return 2 * len(a.layers) * a.n_kv_heads * row * dtype.itemsize

    @property
    def cache(self) -> KVCacheView | None:
        if self._k is None or self._v is None:
            return None
        return KVCacheView([_KVLayer(self._k[i], self._v[i]) for i in range(self._k.shape[0])])

    @property
    def cache_len(self) -> int:
        return self._cache_len

    @property
    def buckets(self) -> tuple[int, ...]:
        """The attention lengths the decode step is captured at (one CUDA graph each)."""
        return tuple(self._buckets)

    def step_bucket(self, length: int) -> int:
        """Cache rows a decode step attends to when the reply holds `length` tokens: its bucket."""
        return self._bucket_for(length)

    def describe(self) -> dict[str, Any]:
        spec = self._layer_specs[0]
        return {
            "options": asdict(self.options), "compiled": self.compile, "cuda_graphs": self.use_graphs,
            "linear_formats": [f"{s.fmt}/{s.absmax}/{s.gemv}" for s in spec.linears],
            "linears_per_layer": len(spec.linears), "notes": self.notes, "cache_len": self._cache_len,
            "buckets": len(self._buckets), "weights_bytes_per_token": self.weights_bytes_per_token,
            "kv_bytes_per_token": self.kv_bytes_per_token(), "warmup_s": self.warmup_s,
            "compile_s": self.compile_s, "capture_s": self.capture_s,
            "compile_cache_loaded": self.compile_cache_loaded, "gemv_timings_us": self.gemv_timings_us,
            "dense_gemv_timings_us": self.dense_gemv_timings_us,
            "prefill_compiled": self._prefill_compiled_ok, "prefill_warm_s": self.prefill_warm_s,
            "prefill_graphs": sorted(self._pf_graphs),
            "graph_pool_idle_bytes": self.graph_pool_idle_bytes(),
        }

    def graph_pool_idle_bytes(self) -> int:
        """Device bytes the CUDA graph pools (decode steps, padded prefills) hold with no live tensor in them: kept
        for the replays, so no other allocation can use them, yet memory_allocated leaves them out. 0 off CUDA."""
        return pool_idle_bytes(self.device, (self._pool, self._pf_pool))

    # --- cache, capture, warm-up -----------------------------------------------------------------------------
    def resize_cache(self, tokens: int, *, strict: bool = False) -> None:
        """Allocate the static cache for `tokens` (rounded up to 16) and capture its buckets; frees the old one.
        `strict` (start-up sizing): prefill graphs that were captured before and now (all or some) run out of memory
        raise torch.cuda.OutOfMemoryError, so the size counts as not fitting instead of being kept without them."""
        tokens = round_up(max(int(tokens), 1), 16)
        if tokens > self.max_cache_len:
            raise GenerationError(f"{tokens:,} tokens exceed the fast path's cache limit ({self.max_cache_len:,}).")
        had_prefill_graphs, notes = bool(self._pf_graphs), len(self.notes)
        with self._lock, torch.no_grad():
            self._allocate(tokens)
        if strict and had_prefill_graphs and self._prefill_capture_oom:
            del self.notes[notes:]
            raise torch.cuda.OutOfMemoryError(
                f"The prefill's CUDA graphs could not be captured beside a {tokens:,}-token KV cache.")

    def _forget(self) -> None:
        """The static cache is written outside a reply, re-allocated or released: nothing in it may be reused."""
        if self.prefix_cache is not None:
            self.prefix_cache.invalidate()

    def _allocate(self, tokens: int) -> None:
        self._forget()
        self._prefill_capture_oom = False  # set when a prefill graph's capture runs out of memory
        self._graphs.clear()
        self._pf_graphs.clear()  # their pool goes with them: freed before the new cache is allocated
        self._pf_pool = None
        self._k = self._v = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self._k, self._v = self._cache_tensors(tokens)
        self._cache_len = tokens
        self._buckets = bucket_list(tokens)
        if self.device.type == "cuda":
            self._host_tokens = torch.zeros(tokens + 1, dtype=torch.long, pin_memory=True)
            self._events = [torch.cuda.Event() for _ in range(3)]
        if self.options.prefill_graph_tokens:
            top = round_up(self.options.prefill_graph_tokens, PREFILL_BUCKET_TOKENS)
            self._pf_ids = torch.zeros(top, dtype=torch.long, device=self.device)
            self._pf_pos = torch.arange(top, device=self.device)
        if self.use_graphs:
            t0 = time.perf_counter()
            self._capture_all()
            try:
                self._capture_prefill()
            except Exception as exc:  # noqa: BLE001 - e.g. the compiled prefill failing: it has an eager fallback
                log.warning("Prefill graphs not captured: %s: %s", type(exc).__name__, exc)
                self.notes.append(f"prefill graphs off ({type(exc).__name__})")
                self._prefill_capture_oom |= isinstance(exc, torch.cuda.OutOfMemoryError)
                self._pf_graphs.clear()
                self._pf_ids = None
                self._pf_pool = None  # the failed capture's pool: released, not left as reserved fragments that
                self.sync()  # the engine would then count as held memory (seen at 8 GiB: ~0.9 GiB)
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()
            self.capture_s = round(time.perf_counter() - t0, 3)

    def _cache_tensors(self, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V blocks (layers, tokens, KV heads, row): row = head_dim values, or int8 / int4 rows (kvquant)."""
        a = self._arch
        row, dtype = kvquant.cache_layout(self.options.kv_cache, a.head_dim, self.dtype)
        shape = (len(a.layers), tokens, a.n_kv_heads, row)
        return (torch.zeros(shape, dtype=dtype, device=self.device),
                torch.zeros(shape, dtype=dtype, device=self.device))

    def warmup(self, cache_tokens: int | None = None) -> float:
        """Compile and capture everything a first reply needs: the cache for `cache_tokens` (default
        max_cache_len) and a graph for each of its attention buckets. Returns seconds."""
        t0 = time.perf_counter()
        with self._lock, torch.no_grad():
            cache_file = self._compile_cache_file()
            if self.compile and cache_file is not None and cache_file.is_file():
                self.compile_cache_loaded = _load_compile_artifacts(cache_file)
            if self.compile and not self._compiled:
                t1 = time.perf_counter()
                self._allocate_plain(round_up(min(self.max_cache_len, MIN_BUCKET_TOKENS), 16))
                self._warm_step(self._cache_len)  # compiles prologue, layer(s), head with a dynamic length
                self.sync()
                self.compile_s = round(time.perf_counter() - t1, 3)
                self._compiled = True
            self._allocate(round_up(min(cache_tokens or self.max_cache_len, self.max_cache_len), 16))
            self._warm_prefill_and_sampling()
            if self.compile and cache_file is not None:
                _save_compile_artifacts(cache_file)
        self.warmup_s = round(time.perf_counter() - t0, 3)
        return self.warmup_s

    def _allocate_plain(self, tokens: int) -> None:
        self._forget()
        self._graphs.clear()
        self._k = self._v = None
        self._k, self._v = self._cache_tensors(tokens)
        self._cache_len = tokens
        self._buckets = bucket_list(tokens)

    def sync(self) -> None:
        """Wait for the device (a no-op on CPU): before reading a host clock."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _views(self, bucket: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        assert self._k is not None and self._v is not None
        ks = [self._k[i, :bucket] for i in range(self._k.shape[0])]
        vs = [self._v[i, :bucket] for i in range(self._v.shape[0])]
        if self.compile:
            for t in (*ks, *vs):
                torch._dynamo.maybe_mark_dynamic(t, 0)
        return ks, vs

    def _step(self, bucket: int) -> None:
        """One decode step on the static buffers: feed _tok at _pos, write scores/next token, advance _pos."""
        ks, vs = self._views(bucket)
        self._seen.index_fill_(0, self._tok, True)
        h, hn, cos, sin = self._prologue_fn(self._tok, self._pos, self._embed, self._norm0)
        for fn, w, kc, vc in zip(self._layer_fns, self._layer_weights, ks, vs, strict=True):
            h, hn = fn(h, hn, cos, sin, self._pos, kc, vc, w)
        scores, nxt = self._head_fn(hn, self._lm_tensors, self._seen, self._penalty, self._eos_bias)
        self._scores.copy_(scores)
        self._tok.copy_(nxt)
        self._pos.add_(1)

    def _run_step(self, bucket: int) -> None:
        graph = self._graphs.get(bucket)
        if graph is not None:
            graph.replay()
        else:
            self._step(bucket)

    def _bucket_for(self, length: int) -> int:
        return self._buckets[bisect.bisect_left(self._buckets, length)]

    # --- prefill -----------------------------------------------------------------------------------------------
    def _prefill(self, ids: torch.Tensor, first: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """ids (P,) -> (scores (1, V), greedy token (1,)); fills cache rows first..P-1 (rows 0..first-1 already hold
        the KV of ids[:first]). Marks every prompt token as seen. The padded graphs start at row 0, so a prefill
        after a cached prefix runs the chunked passes, whose class with start > 0 warm-up compiled."""
        assert self._k is not None and self._v is not None
        total = ids.numel()
        self._seen.index_fill_(0, ids, True)
        chunk = self.options.prefill_chunk_tokens or total
        bucket = round_up(total, PREFILL_BUCKET_TOKENS)
        if first:
            with _prefill_attention_scope(self.options.prefill_attention, self.device):
                hn_last = self._prefill_layers(ids, total, chunk, first)
            return self._head_fn(hn_last, self._lm_tensors, self._seen, self._penalty, self._eos_bias)
        if self._pf_ids is not None and chunk >= total and bucket in self._prefill_buckets():
            # right-padded to the bucket: static ids, the last real row picked on the device
            self._pf_ids[:total].copy_(ids)
            self._pf_ids[total:bucket].fill_(0)  # any id: causal attention keeps real rows blind to it
            self._pf_last.fill_(total - 1)
            graph = self._pf_graphs.get(bucket)
            if graph is not None:
                graph.replay()
            else:
                with _prefill_attention_scope(self.options.prefill_attention, self.device):
                    self._padded_prefill(bucket)
            return self._pf_scores, self._pf_tok
        with _prefill_attention_scope(self.options.prefill_attention, self.device):
            hn_last = self._prefill_layers(ids, total, chunk)
        return self._head_fn(hn_last, self._lm_tensors, self._seen, self._penalty, self._eos_bias)

    def _padded_prefill(self, bucket: int) -> None:
        """The prefill over _pf_ids[:bucket] on static buffers (capturable): cache rows 0..bucket-1, then the head on
        row _pf_last, into _pf_scores / _pf_tok."""
        assert self._pf_ids is not None and self._pf_pos is not None
        hn = self._prefill_pass(self._pf_ids[:bucket], self._pf_pos[:bucket], 0)
        last = hn[0].index_select(0, self._pf_last)  # (1, H): the last real token's row
        scores, nxt = self._head_fn(last, self._lm_tensors, self._seen, self._penalty, self._eos_bias)
        self._pf_scores.copy_(scores)
        self._pf_tok.copy_(nxt)

    def _prefill_layers(self, ids: torch.Tensor, total: int, chunk: int, first: int = 0) -> torch.Tensor:
        hn_last = None
        for start in range(first, total, chunk):
            part = ids[start:start + chunk]
            pos = torch.arange(start, start + part.numel(), device=self.device)
            hn = self._prefill_pass(part, pos, start)
            # (1, H) with strides (H, 1), as the decode step and the padded prefill hand the head: a stride of S*H
            # fails the compiled head's stride guard and recompiles it inside a reply
            hn_last = hn[0, -1:].clone()
        assert hn_last is not None
        return hn_last

    def _prefill_pass(self, ids: torch.Tensor, pos: torch.Tensor, start: int) -> torch.Tensor:
        """Every layer over ids (S,) at positions pos (S,) = start..start+S-1: cache rows written; returns the
        last layer's hn (1, S, H) (un-normed h where the layers fuse their norms)."""
        assert self._k is not None and self._v is not None
        h = embed_rows(ids, self._embed, self._norm0.dtype)[None]
        cos, sin = self._arch.rotary(h, pos[None])
        hn = rms_norm(h, self._norm0, self._head_spec.eps0)
        fns = self._prefill_fns if self._prefill_compiled_ok and ids.numel() > 1 else self._prefill_eager_fns
        for i, (fn, w) in enumerate(zip(fns, self._layer_weights, strict=True)):
            if fns is self._prefill_fns:
                for t in (h, hn, cos, sin):
                    torch._dynamo.maybe_mark_dynamic(t, 1)
                for t in (self._k[i], self._v[i]):
                    torch._dynamo.maybe_mark_dynamic(t, 0)
            h, hn = fn(h, hn, cos, sin, start, self._k[i], self._v[i], w)
        return hn

    # --- generate --------------------------------------------------------------------------------------------
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, gen: GenerationSettings,
                 streamer: Any, stop_event: threading.Event, max_new_tokens: int, *,
                 min_new_tokens: int = 0, info: dict[str, Any] | None = None) -> torch.Tensor:
        """Like model.generate for batch 1: returns (1, P+N) ids. streamer.put(prompt) first, then each new token
        as it is produced (one step behind the GPU), then streamer.end(), also on stop or error. `info` (if given)
        gets cached_prompt_tokens: the prompt tokens not prefilled because their KV was in the cache."""
        try:  # warm-up's grad mode whatever the caller's: tensors made under inference_mode carry other dispatch
            # keys, and dynamo would recompile the prefill, head and prologue inside the first reply
            with self._lock, torch.inference_mode(False), torch.no_grad():
                try:
                    new = self._generate(input_ids, attention_mask, gen, streamer, stop_event, max_new_tokens,
                                         min_new_tokens, info)
                except BaseException:  # a half-written cache: nothing of it is reused
                    self._forget()
                    raise
            tail = torch.tensor([new], dtype=input_ids.dtype, device=input_ids.device).view(1, -1)
            return torch.cat([input_ids, tail], dim=1)
        except torch.cuda.OutOfMemoryError as exc:
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            raise OutOfMemoryError("The GPU ran out of memory in the fast decode path; lower max new tokens or the "
                                   "history length and try again.") from exc
        finally:
            if streamer is not None:
                streamer.end()

    def _prompt_ids(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        if input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise GenerationError(f"The fast decode path takes one prompt (batch 1), got {tuple(input_ids.shape)}.")
        ids = input_ids[0]
        if attention_mask is not None and not bool(attention_mask.all()):
            keep = attention_mask[0].bool()
            first = int(keep.nonzero()[0]) if bool(keep.any()) else ids.numel()
            if not bool(keep[first:].all()):
                raise GenerationError("The fast decode path supports left padding only.")
            ids = ids[first:]
        if ids.numel() == 0:
            raise GenerationError("The prompt is empty.")
        return ids.to(self.device)

    def _generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, gen: GenerationSettings,
                  streamer: Any, stop_event: threading.Event, max_new_tokens: int, min_new_tokens: int,
                  info: dict[str, Any] | None = None) -> list[int]:
        clock = {"entry": time.perf_counter()}
        self._clock = clock
        ids = self._prompt_ids(input_ids, attention_mask)
        prompt_len, limit = ids.numel(), int(max_new_tokens)
        if limit < 1:
            raise GenerationError("max_new_tokens must be at least 1.")
        need = prompt_len + limit
        if need > self.max_cache_len:
            raise GenerationError(f"The prompt ({prompt_len:,} tokens) plus max new tokens ({limit:,}) exceed the "
                                  f"fast path's KV cache ({self.max_cache_len:,} tokens); shorten the history.")
        if need > self._cache_len:  # only after resize_cache() shrank it: allocation and capture, never compile
            log.warning("Fast decode cache grows to %d tokens inside a reply (capture only).", need)
            self._allocate(round_up(need, 16))
        if streamer is not None:
            streamer.put(input_ids.cpu())
        eos = self.loaded.eos_token_ids
        self._seen.zero_()
        self._penalty.fill_(float(gen.repetition_penalty))
        self._eos_bias.zero_()
        if min_new_tokens > 0 and eos:
            self._eos_bias[list(eos)] = float("-inf")
        generator = sampling_generator(gen, self.device)
        events = self._prefill_events
        if events is None and self.device.type == "cuda":
            events = self._prefill_events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        prompt = ids.tolist()
        first = self.prefix_cache.begin(prompt) if self.prefix_cache is not None else 0
        if info is not None:
            info["cached_prompt_tokens"] = first
        clock["prefill_start"] = time.perf_counter()
        if events is not None:
            events[0].record()
        scores, nxt = self._prefill(ids, first)
        if events is not None:
            events[1].record()
        clock["prefill_launched"] = time.perf_counter()
        if host_pick(gen):
            nxt = sample_from_scores(scores, gen, generator)
        self._tok.copy_(nxt)
        self._pos.fill_(prompt_len)
        out: list[int] = []
        self._publish(0)
        for i in range(1, limit + 1):
            launched = i < limit and not stop_event.is_set()
            if launched:  # queue step i (it produces token i) before reading token i-1 back
                if min_new_tokens and i == min_new_tokens:
                    self._eos_bias.zero_()
                self._run_step(self._bucket_for(prompt_len + i))
                if host_pick(gen):
                    self._tok.copy_(sample_from_scores(self._scores, gen, generator))
                self._publish(i)
            token = self._collect(i - 1)
            out.append(token)
            if i == 1:
                clock["first_token"] = time.perf_counter()
            if streamer is not None:
                streamer.put(torch.tensor([token]))
            if token in eos or not launched or stop_event.is_set():
                break
        if self.prefix_cache is not None:  # steps 1..n-1 fed out[:-1]; out[-1]'s row may be written, never claimed
            self.prefix_cache.commit(prompt + out[:-1])
        return out

    def _publish(self, index: int) -> None:
        """Start copying the current token (device) to the host; index = its place among the new tokens."""
        if self._host_tokens is not None and self.device.type == "cuda":
            self._host_tokens[index:index + 1].copy_(self._tok, non_blocking=True)
            self._events[index % len(self._events)].record()
        else:
            self._cpu_tokens[index] = int(self._tok.item())

    def _collect(self, index: int) -> int:
        if self._host_tokens is not None and self.device.type == "cuda":
            self._events[index % len(self._events)].synchronize()
            return int(self._host_tokens[index])
        return self._cpu_tokens.pop(index)

    def release(self) -> None:
        """Give back the static cache, the captured graphs and their pools (the engine then serves from plain
        generate; the fused weights stay, shared with the model)."""
        with self._lock:
            self._forget()
            self._graphs.clear()
            self._pf_graphs.clear()
            self._pool = self._pf_pool = None
            self._k = self._v = None
            self._pf_ids = self._pf_pos = None
            self._cache_len = 0
            self._buckets = []
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    @property
    def cache_bytes_per_token(self) -> int:
        """Device bytes one token of the static cache takes (all layers, K and V, scales included)."""
        if self._k is None or self._v is None or not self._cache_len:
            return 0
        return (self._k.nbytes + self._v.nbytes) // self._cache_len

    # --- passes outside a reply (bench.probes: teacher forcing, step timing, prefill timing) --------------------
    @contextlib.contextmanager
    def outside_reply(self, tokens: int = 0) -> Iterator[None]:
        """Hold the decoder for passes that are no reply: its lock, no autograd, the cache forgotten by the prefix
        reuse (its rows are overwritten) and at least `tokens` long (re-allocated, graphs captured again, if not)."""
        with self._lock, torch.no_grad():
            self._forget()
            if tokens > self._cache_len:
                self._allocate(round_up(tokens, 16))
            yield

    def prompt_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(1, P) token ids as generate() reads them -> (P,) on the device."""
        return self._prompt_ids(input_ids, None)

    def prefill_scores(self, ids: torch.Tensor, *, penalties: bool = True) -> torch.Tensor:
        """Inside outside_reply(): prefill `ids` (P,) from row 0 as a reply does; the last position's scores (1, V).
        No token counts as seen before it; penalties=False also turns off the repetition penalty and the EOS ban.
        On CUDA this only launches work: sync() before reading a clock."""
        self._seen.zero_()
        if not penalties:
            self._penalty.fill_(1.0)
            self._eos_bias.zero_()
        return self._prefill(ids)[0]

    def seek(self, position: int) -> None:
        """Inside outside_reply(): the next decode step writes cache row `position`."""
        self._pos.fill_(position)

    def decode_step(self, position: int, token: int | None = None) -> torch.Tensor:
        """Inside outside_reply(): one decode step as a reply runs it (its graph on CUDA), writing row `position`
        (where seek() or the previous step left the device), fed `token` (else the step's own last token); the
        step's scores (1, V), overwritten by the next step."""
        if token is not None:
            self._tok.fill_(int(token))
        self._run_step(self._bucket_for(position + 1))
        return self._scores

    @contextlib.contextmanager
    def without_graphs(self) -> Iterator[None]:
        """Inside it decode steps launch the same compiled step op by op instead of replaying its CUDA graphs."""
        graphs, self._graphs = self._graphs, {}
        try:
            yield
        finally:
            self._graphs = graphs

    @property
    def prefill_clock(self) -> tuple[dict[str, float], tuple[Any, Any] | None]:
        """The last reply's host clock reads (entry, prefill_start, prefill_launched, first_token; perf_counter s)
        and the CUDA events around its prefill (None on CPU)."""
        return dict(self._clock), self._prefill_events


def _bind_prefill(spec: LayerSpec) -> Callable[..., Any]:
    def layer(h: torch.Tensor, hn: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, start: int,
              k_cache: torch.Tensor, v_cache: torch.Tensor, w: list[torch.Tensor]) -> Any:
        return layer_prefill(spec, h, hn, cos, sin, start, k_cache, v_cache, w)

    return layer


def _bind_layer(spec: LayerSpec) -> Callable[..., Any]:
    def layer(h: torch.Tensor, hn: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor,
              k_cache: torch.Tensor, v_cache: torch.Tensor, w: list[torch.Tensor]) -> Any:
        return layer_decode(spec, h, hn, cos, sin, pos, k_cache, v_cache, w)

    return layer


def _eps(norm: Any) -> float:
    eps = getattr(norm, "variance_epsilon", None)
    return float(eps if eps is not None else getattr(norm, "eps", 1e-6))


def _weights_dtype(model: Any) -> torch.dtype:
    return next(p.dtype for p in model.parameters() if p.is_floating_point())

