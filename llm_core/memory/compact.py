"""compact_storages: lay the model's device tensors end to end again, once, after loading and packing.

Why: loading a 4-bit model leaves the caching allocator's segments full of holes. bitsandbytes quantizes each weight
from a half-precision temporary, and the fast path fuses q/k/v and gate/up into new tensors and frees the parts
(llm_core.fast.pack), between the o/down weights and the block scales that stay. With expandable segments
`empty_cache` gives back only the whole 20 MiB pages of a free range, so every hole keeps the part of a page it
shares with a live neighbour: ~0.97 GB of an emulated 8 GiB card stayed reserved but free under Llama-2-7B NF4
(`held_free_bytes` in bench/results/2026-12-05-s4-h100-cards-llama-2-7b-8gib-fill.json), which the start-up sizing
must plan as taken: ~3,500 tokens of int8 KV cache.

How: every storage behind the given tensors is copied to host memory and freed (`UntypedStorage.resize_(0)`, as
PyTorch's FSDP frees parameters between uses), the allocator gives back its now empty pages, and each storage is
allocated again (largest first) and filled. A storage object is shared by every tensor and view over it, so every
holder (a module's parameter, a quant state's absmax, the fast path's packed list) sees the new bytes with no
re-binding. It must run before anything keeps a raw device address (CUDA graphs, compiled kernels' arguments):
the engine calls it once, right after building the decode path and before its warm-up.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from ..errors import ModelLoadError
from .device import unreturnable_free_bytes

log = logging.getLogger(__name__)

HOST_MARGIN_BYTES = 1 << 30  # host memory left free beside the copies (skip compaction when it is not there)


@dataclass(frozen=True)
class Compaction:
    """What compact_storages did: storages and bytes moved, the allocator's reserved-but-free bytes after
    empty_cache before and after (CUDA; 0 elsewhere), seconds taken, or why it did nothing."""

    storages: int
    moved_bytes: int
    held_free_before: int
    held_free_after: int
    seconds: float
    skipped: str = ""

    @property
    def returned_bytes(self) -> int:
        return max(0, self.held_free_before - self.held_free_after)

    def describe(self) -> str:
        if self.skipped:
            return f"Weights not re-laid: {self.skipped}"
        gib = 1 << 30
        return (f"Weights re-laid end to end ({self.moved_bytes / gib:.2f} GiB in {self.storages} storages, "
                f"{self.seconds:.1f} s): reserved-but-free memory {self.held_free_before / gib:.2f} -> "
                f"{self.held_free_after / gib:.2f} GiB")


def _as_bytes(storage: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
    """A flat uint8 tensor over the whole storage (a view: no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


def device_storages(tensors: Iterable[torch.Tensor], device: torch.device) -> list[torch.UntypedStorage]:
    """The distinct non-empty storages behind `tensors` on `device`, each once."""
    seen: dict[int, torch.UntypedStorage] = {}
    for t in tensors:
        if not isinstance(t, torch.Tensor) or t.device != device:
            continue
        storage = t.untyped_storage()
        if storage.nbytes() > 0:
            seen.setdefault(storage.data_ptr(), storage)
    return list(seen.values())


def compact_storages(tensors: Iterable[torch.Tensor], device: torch.device | str, *,
                     host_available_bytes: int | None = None) -> Compaction:
    """Move every storage behind `tensors` on `device` through host memory into fresh allocations, largest first
    (module docstring). Values, dtypes, shapes, strides and aliasing stay as they were; only device addresses
    change. Storages that cannot be resized (borrowed memory) stay where they are. Skipped, saying why, when host
    memory (`host_available_bytes`, default psutil's available) cannot hold the copies with a 1 GiB margin."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    t0 = time.perf_counter()
    storages = [s for s in device_storages(tensors, device) if s.resizable()]
    total = sum(s.nbytes() for s in storages)
    if host_available_bytes is None:
        import psutil

        host_available_bytes = int(psutil.virtual_memory().available)
    if total + HOST_MARGIN_BYTES > host_available_bytes:
        return Compaction(0, 0, 0, 0, 0.0, f"host memory has {host_available_bytes / (1 << 30):.1f} GiB free for "
                                            f"{total / (1 << 30):.1f} GiB of copies")
    before = unreturnable_free_bytes(device)
    with torch.no_grad():
        host = [_as_bytes(s, device).to("cpu", copy=True) for s in storages]
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        for s in storages:
            s.resize_(0)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        order = sorted(range(len(storages)), key=lambda i: -host[i].numel())
        try:
            for i in order:
                storages[i].resize_(host[i].numel())
                _as_bytes(storages[i], device).copy_(host[i])
                host[i] = torch.empty(0, dtype=torch.uint8)
        except RuntimeError as exc:  # torch.cuda.OutOfMemoryError too: the same bytes were free a moment ago
            raise ModelLoadError(f"Re-laying the weights on {device} failed part-way ({exc}); the model must be "
                                 "loaded again.") from exc
    after = unreturnable_free_bytes(device)
    result = Compaction(len(storages), total, before, after, time.perf_counter() - t0)
    log.info(result.describe())
    return result
