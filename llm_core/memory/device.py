"""Measuring and freeing device memory: PeakMeter (peak VRAM, or peak RSS on CPU), freeing caches, OOM
detection and the OOM injector the tests use. The arithmetic that predicts these peaks is memory.model."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

# --- measuring -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MeasuredPeak:
    """One measured peak. CUDA: allocator statistics. CPU: the process's resident set (exact high-water mark
    where Linux lets us reset it, else sampled every few milliseconds)."""

    device_type: str
    peak_allocated_bytes: int  # CUDA max_memory_allocated; CPU peak RSS
    peak_reserved_bytes: int  # CUDA max_memory_reserved; CPU peak RSS
    start_bytes: int  # allocated (CUDA) or RSS (CPU) when the block started
    seconds: float

    @property
    def delta_bytes(self) -> int:
        return self.peak_allocated_bytes - self.start_bytes

    def reply_fields(self) -> dict[str, Any]:
        """The ReplyStats fields this measurement fills."""
        if self.device_type == "cuda":
            return {"peak_vram_allocated_bytes": self.peak_allocated_bytes,
                    "peak_vram_reserved_bytes": self.peak_reserved_bytes}
        return {"peak_rss_bytes": self.peak_allocated_bytes}


class PeakMeter:
    """The one peak-memory measurement of the project (replies, benchmarks, tests).

    `meter.start()` ... `meter.stop()` -> MeasuredPeak, or `with PeakMeter(device) as meter: ...` then
    `meter.result`. CUDA: resets the allocator's peak statistics at start (the peak is over the block only) and
    reads max_memory_allocated/reserved at stop, after a synchronize. CPU: resets the kernel's RSS high-water mark
    (VmHWM, via /proc/self/clear_refs) and reads it back, which is exact; where that is not allowed, a thread
    samples RSS every `interval_s`. The CPU high-water mark is per process: overlapping meters share it.
    """

    def __init__(self, device: torch.device | str, interval_s: float = 0.002) -> None:
        self.device = torch.device(device)
        self.interval_s = interval_s
        self.result: MeasuredPeak | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._hwm_reset = False
        self._peak_rss = 0
        self._start = 0
        self._t0 = 0.0

    def start(self) -> PeakMeter:
        self._t0 = time.perf_counter()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
            return self
        self._start = self._peak_rss = _rss_bytes()
        self._hwm_reset = reset_rss_high_water_mark()
        if not self._hwm_reset:
            def sample() -> None:
                while not self._stop.is_set():
                    self._peak_rss = max(self._peak_rss, _rss_bytes())
                    self._stop.wait(self.interval_s)

            self._thread = threading.Thread(target=sample, name="peak-rss", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> MeasuredPeak:
        seconds = time.perf_counter() - self._t0
        if self.device.type == "cuda":
            with contextlib.suppress(RuntimeError):  # after a CUDA OOM the sync may fail: keep the stats
                torch.cuda.synchronize(self.device)
            alloc = torch.cuda.max_memory_allocated(self.device)
            reserved = torch.cuda.max_memory_reserved(self.device)
            self.result = MeasuredPeak("cuda", alloc, reserved, self._start, seconds)
            return self.result
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        peak = max(self._peak_rss, _rss_bytes())
        if self._hwm_reset:
            peak = max(peak, _read_status_bytes("VmHWM") or 0)
        self.result = MeasuredPeak("cpu", peak, peak, self._start, seconds)
        return self.result

    def __enter__(self) -> PeakMeter:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _rss_bytes() -> int:
    import psutil

    return int(psutil.Process().memory_info().rss)


def reset_rss_high_water_mark() -> bool:
    """Linux: writing 5 to /proc/self/clear_refs resets VmHWM (peak RSS) to the current RSS. Read from /proc
    because psutil can neither reset nor read that high-water mark; False where the kernel refuses (then the
    peak is sampled)."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return _read_status_bytes("VmHWM") is not None
    except OSError:
        return False


def _read_status_bytes(key: str) -> int | None:
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024  # reported in kB
    except (OSError, ValueError, IndexError):
        return None
    return None


# --- out of memory ---------------------------------------------------------------------------------------------

_OOM_TEXT = ("out of memory", "can't allocate memory", "cannot allocate memory", "failed to allocate")


def is_oom_error(exc: BaseException | None) -> bool:
    """True for torch.OutOfMemoryError (CUDA), MemoryError, and RuntimeErrors whose message says the allocator
    ran out (CPU "can't allocate memory", cuBLAS/cuDNN "CUDA error: out of memory"), also when wrapped as cause."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
            return True
        if isinstance(exc, RuntimeError) and any(text in str(exc).lower() for text in _OOM_TEXT):
            return True
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return False


def device_allocated_bytes(device: torch.device) -> int | None:
    """Bytes the CUDA caching allocator has handed out on `device` once queued work is done; None off CUDA."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    return int(torch.cuda.memory_allocated(device))


def free_memory(device: torch.device | str) -> None:
    """Give back what a failed or finished reply (or an unloaded model) left: collect garbage (drops the cache and
    activations once the caller let go of them), then empty the CUDA caching allocator and reset its peak
    statistics, or on CPU return glibc's free heap pages to the OS (malloc_trim) so RSS really drops."""
    gc.collect()
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        with contextlib.suppress(RuntimeError):
            torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    elif device.type == "cpu":
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6").malloc_trim(0)


@dataclass
class OOMInjector:
    """A test hook the engine is handed explicitly: `injector.check("prefill")` at named points of a reply raises
    torch.OutOfMemoryError while armed for that point. The default object never fires."""

    armed: dict[str, int] = field(default_factory=dict)  # point -> how many more times to fire
    fired: list[str] = field(default_factory=list)

    def arm(self, point: str, times: int = 1) -> OOMInjector:
        self.armed[point] = self.armed.get(point, 0) + times
        return self

    def check(self, point: str) -> None:
        left = self.armed.get(point, 0)
        if left > 0:
            self.armed[point] = left - 1
            self.fired.append(point)
            raise torch.OutOfMemoryError(f"CUDA out of memory (injected at {point!r} by OOMInjector).")

    @contextlib.contextmanager
    def armed_for(self, point: str, times: int = 1) -> Iterator[OOMInjector]:
        """Arm within a block only: `with injector.armed_for("decode"): engine.reply(...)`."""
        self.arm(point, times)
        try:
            yield self
        finally:
            self.armed.pop(point, None)


OOM_POINTS = ("plan", "prefill", "decode")  # the points the engine is expected to check


def cached_free_bytes(device: torch.device) -> int:
    """CUDA: bytes the caching allocator holds free (reserved - allocated) right now; 0 elsewhere."""
    if device.type != "cuda":
        return 0
    return max(0, torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))


def unreturnable_free_bytes(device: torch.device) -> int:
    """CUDA: the free bytes the caching allocator still holds after giving back all it can (empty_cache): graph pools'
    free bytes and fragments of pages still in use; 0 elsewhere."""
    if device.type != "cuda":
        return 0
    torch.cuda.empty_cache()
    return cached_free_bytes(device)
