"""FastDecoder's start-up passes: warming the compiled prefill and step, capturing their CUDA graphs, the persistent
compile cache, and the worst-reply memory profile the engine sizes the cache by. Nothing here runs per reply.

DecoderWarmup is FastDecoder's start-up half: FastDecoder inherits it and owns the state it reads and writes (the
buffers, cache and graphs created in FastDecoder.__init__ and _allocate)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..config import GenerationSettings
from ..sampling import sample_from_scores
from .layer import _prefill_attention_scope
from .options import PREFILL_BUCKET_TOKENS

log = logging.getLogger(__name__)


class DecoderWarmup:
    """Start-up passes of FastDecoder; see the module docstring."""

    # What the passes below set (declared here for the type checker; initialised by FastDecoder.__init__)
    prefill_warm_s: float | None
    _prefill_compiled_ok: bool
    _prefill_capture_oom: bool
    _pool: Any
    _pf_pool: Any

    if TYPE_CHECKING:  # the decoder's buffers, cache, graphs and passes, defined by FastDecoder
        def __getattr__(self, name: str) -> Any: ...

    def _warm_prefill_and_sampling(self) -> None:
        ids = torch.arange(min(8, self._cache_len - 2), device=self.device) % self._arch.vocab
        self._seen.zero_()
        t0 = time.perf_counter()
        try:
            scores, _ = self._prefill(ids)
        except Exception as exc:  # noqa: BLE001 - the eager prefill is always there; say why it is used
            if not self._prefill_compiled_ok:
                raise
            log.warning("Compiled prefill unavailable (%s: %s); the prefill runs eagerly.", type(exc).__name__, exc)
            self.notes.append(f"prefill eager: compiling it failed ({type(exc).__name__})")
            self._prefill_compiled_ok = False
            scores, _ = self._prefill(ids)
        self._warm_prefill_shapes()
        self.prefill_warm_s = round(time.perf_counter() - t0, 3)
        sample_from_scores(scores, GenerationSettings(do_sample=True, top_k=50, top_p=0.9, temperature=0.7),
                           torch.Generator(device=self.device))
        self.sync()

    def _warm_prefill_shapes(self) -> None:
        """Compile every shape class of the compiled prefill here, never inside a reply (else the first prompt
        beyond the padded graphs would compile in the user's reply). Classes: one pass from position 0 (a prompt past
        PREFILL_GRAPH_TOKENS, or a long prompt's first chunk), and chunks after cached history (start > 0), run
        at two different starts and lengths so that dynamo's automatic dynamic shapes make both symbolic (it
        specializes an int on first sight and generalizes it at the second value). One-token passes run eagerly.
        Lengths are small: the classes are symbolic in the length, so any later length reuses them."""
        if not (self.compile and self._prefill_compiled_ok):
            return
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        first = max(4, min(self.options.prefill_graph_tokens + PREFILL_BUCKET_TOKENS + 7, (self._cache_len - 2) // 3))
        start = 0
        for length in (first, first - 1, first - 2):
            ids = (torch.arange(length, device=self.device) * 7 + 3) % self._arch.vocab
            with _prefill_attention_scope(self.options.prefill_attention, self.device):
                self._prefill_pass(ids, torch.arange(start, start + length, device=self.device), start)
            start += length
        self.sync()

    def _compile_cache_file(self) -> Path | None:
        if not self.compile or self.options.compile_backend != "inductor":
            return None
        try:
            from ..models import default_cache_dir

            root = default_cache_dir(self.loaded.settings) / "compile"
        except Exception:  # noqa: BLE001 - the compile cache is an optimisation; never fail warm-up for it
            return None
        import transformers

        key = json.dumps({
            "torch": torch.__version__, "transformers": transformers.__version__,
            "config": self.loaded.model.config.to_json_string(use_diff=False),
            "options": asdict(self.options), "dtype": str(self.dtype),
            "device": torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu",
            "specs": repr(sorted({repr(s) for s in self._layer_specs})), "head": repr(self._head_spec),
        }, sort_keys=True)
        return root / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.bin"

    def _warm_step(self, bucket: int) -> None:
        self._tok.zero_()
        self._pos.zero_()
        self._step(bucket)

    def _capture_all(self) -> None:
        """Warm each bucket (first-call autotuning happens outside capture), then capture one graph per bucket."""
        self._pool = torch.cuda.graph_pool_handle()
        side = self.side_stream
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for bucket in self._buckets:
                self._warm_step(bucket)
                self._warm_step(bucket)
        torch.cuda.current_stream(self.device).wait_stream(side)
        self.sync()
        torch.cuda.empty_cache()  # the side stream's warm-up blocks: free, but only that stream could reuse them
        for bucket in self._buckets:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                self._step(bucket)
            self._graphs[bucket] = graph
        self.sync()

    def _prefill_buckets(self) -> list[int]:
        """Padded prefill lengths that fit the cache (multiples of PREFILL_BUCKET_TOKENS, up to the option)."""
        top = min(self.options.prefill_graph_tokens, self._cache_len)
        return list(range(PREFILL_BUCKET_TOKENS, top + 1, PREFILL_BUCKET_TOKENS))

    def _capture_prefill(self) -> None:
        """One graph per padded prefill length, warmed twice first (outside capture) like the decode buckets. A
        length whose capture fails is left to the compiled prefill (and said in the notes)."""
        buckets = self._prefill_buckets()
        if not buckets:
            return
        self._pf_pool = torch.cuda.graph_pool_handle()
        side = self.side_stream
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side), _prefill_attention_scope(self.options.prefill_attention, self.device):
            for bucket in buckets:
                self._pf_last.fill_(bucket - 1)
                self._padded_prefill(bucket)
                self._padded_prefill(bucket)
        torch.cuda.current_stream(self.device).wait_stream(side)
        self.sync()
        torch.cuda.empty_cache()  # as in _capture_all: the capture's pool must not compete with idle side blocks
        for bucket in buckets:
            graph = torch.cuda.CUDAGraph()
            try:
                with _prefill_attention_scope(self.options.prefill_attention, self.device), \
                        torch.cuda.graph(graph, pool=self._pf_pool):
                    self._padded_prefill(bucket)
            except Exception as exc:  # noqa: BLE001 - the compiled prefill still serves this length
                log.warning("Prefill graph for %d tokens not captured: %s: %s", bucket, type(exc).__name__, exc)
                self.notes.append(f"prefill graphs off from {bucket} tokens ({type(exc).__name__})")
                self._prefill_capture_oom |= isinstance(exc, torch.cuda.OutOfMemoryError)
                break
            self._pf_graphs[bucket] = graph
        self.sync()

    def profile_worst_reply(self) -> dict[str, int]:
        """Run the most memory any reply can take on this cache and measure it (measured, not predicted, like vLLM's
        start-up profile): the last prefill chunk of a prompt that fills the cache, attending to every
        cached row before it, then its head and a decode step at the top bucket (graph replay). Prompts up to
        PREFILL_GRAPH_TOKENS replay graphs whose pool is already reserved; longer prompts run in chunks of
        `prefill_chunk_tokens` (or one pass), so this is each reply's bound. Returns the peak bytes reserved and
        allocated on the device (CUDA; 0 elsewhere, where the same pass runs unmeasured). The cache's contents are
        left as garbage, which every reply overwrites from position 0 before reading."""
        if self.device.type != "cuda":
            with self._lock, torch.no_grad():
                self._worst_reply_pass()
            return {"peak_reserved_bytes": 0, "peak_allocated_bytes": 0, "tokens": self._cache_len}
        with self._lock, torch.no_grad():
            self.sync()
            torch.cuda.reset_peak_memory_stats(self.device)
            self._worst_reply_pass()
            self.sync()
            return {"peak_reserved_bytes": int(torch.cuda.max_memory_reserved(self.device)),
                    "peak_allocated_bytes": int(torch.cuda.max_memory_allocated(self.device)),
                    "tokens": self._cache_len}

    def _worst_reply_pass(self) -> None:
        self._forget()
        end = self._cache_len - 1
        chunk = min(self.options.prefill_chunk_tokens or end, end)
        start = end - chunk
        ids = (torch.arange(chunk, device=self.device) * 7 + 3) % self._arch.vocab
        self._seen.zero_()
        with _prefill_attention_scope(self.options.prefill_attention, self.device):
            hn = self._prefill_pass(ids, torch.arange(start, end, device=self.device), start)
        last = hn[0, -1:].clone()
        del hn
        self._head_fn(last, self._lm_tensors, self._seen, self._penalty, self._eos_bias)
        self._pos.fill_(end)
        self._run_step(self._bucket_for(end + 1))


def _load_compile_artifacts(path: Path) -> bool:
    try:
        torch.compiler.load_cache_artifacts(path.read_bytes())
        return True
    except Exception as exc:  # noqa: BLE001 - a stale or foreign cache only costs a recompile
        log.warning("Ignoring compile cache %s: %s", path, exc)
        return False


def _save_compile_artifacts(path: Path) -> None:
    try:
        saved = torch.compiler.save_cache_artifacts()
        if saved is None:
            return
        data = saved[0]
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_bytes(data)
        tmp.replace(path)
    except Exception as exc:  # noqa: BLE001 - see above
        log.warning("Could not save the compile cache to %s: %s", path, exc)
