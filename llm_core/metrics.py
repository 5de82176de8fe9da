"""Per-reply statistics: what each reply cost, measured where it happens; plain data, exportable as JSON.

Clock: `time.perf_counter()`. A reply's clock starts when the engine receives the request (before templating and
tokenizing) and each token is stamped when the decode loop hands it to the streamer on the host.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from .security import escape_csv_cell


@dataclass
class ReplyStats:
    """Numbers for one reply. Byte fields are None where the device cannot report them."""

    reply_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    started_at: str = field(default_factory=lambda: datetime.now(UTC).isoformat(timespec="seconds"))
    # What produced the reply (tags for comparing and exporting).
    model: str = ""
    revision: str | None = None
    quantization: str = ""  # the weights' format as they ran (the CPU path runs nf4 and fp4 as int4)
    quantization_requested: str = ""  # the preset asked for, where the CPU path quantized the weights itself
    double_quant: bool = False
    compute_dtype: str = ""
    attention: str = ""
    kv_cache: str = "bf16"
    decode_path: str = ""
    device: str = ""
    versions: dict[str, str] = field(default_factory=dict)
    # What it cost.
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0  # prompt tokens whose KV came from the cache (not prefilled); in prompt_tokens
    new_tokens: int = 0  # generated token ids (not text chunks), EOS included if produced
    ttft_s: float | None = None  # request received -> first generated token on the host
    decode_tokens_per_s: float | None = None  # (new_tokens - 1) / decode_s
    decode_s: float | None = None  # first generated token on the host -> last one (TTFT excluded)
    end_to_end_s: float | None = None  # request received -> reply finished
    peak_vram_allocated_bytes: int | None = None  # CUDA: max allocated during this reply (peak reset at start)
    peak_vram_reserved_bytes: int | None = None  # CUDA: max reserved by the caching allocator during this reply
    peak_rss_bytes: int | None = None  # CPU: peak resident set size of the process during this reply
    # Batched fast path: replies overlap, so the peak above is the batch's during this reply (reset before and read
    # after each decode step or prefill chunk), and this is how many rows were decoding at that peak.
    peak_batch_rows: int | None = None
    # The peak above is the process's: this much of it was held by the other loaded engines (Compare keeps them),
    # as measured when they were loaded.
    others_resident_bytes: int = 0
    kv_cache_bytes: int | None = None  # bytes held by the KV cache at the end of the reply
    predicted_peak_bytes: int | None = None  # memory model's peak allocated for prompt + max_new_tokens
    memory_budget_bytes: int | None = None  # what the memory guard planned this reply against
    context_fit_tokens: int | None = None  # context meter: prompt tokens that fit the budget with this reply
    weights_bytes: int | None = None
    decode_bandwidth_bytes_per_s: float | None = None  # weights_bytes x decode_tokens_per_s (KV reads excluded)
    grammar_mask_ms_per_token: float | None = None  # structured output: the JSON mask's mean time per token
    finish_reason: str = ""  # eos | length | stopped | error
    dropped_turns: int = 0
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.as_dict(), ensure_ascii=False)

    @classmethod
    def from_dict(cls, row: dict[str, Any]) -> ReplyStats:
        """The inverse of as_dict (keys it does not know are left out)."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in row.items() if k in names})

    @property
    def peak_memory_bytes(self) -> int | None:
        """The process's measured peak: CUDA max allocated, else the CPU's peak RSS."""
        return self.peak_vram_allocated_bytes if self.peak_vram_allocated_bytes is not None else self.peak_rss_bytes

    @property
    def own_peak_bytes(self) -> int | None:
        """This reply's peak memory, the one every view shows: the process peak less the other loaded engines'."""
        peak = self.peak_memory_bytes
        return None if peak is None else max(0, peak - self.others_resident_bytes)


def quantization_label(ran: str, requested: str = "") -> str:
    """The weights' format as it ran, with the preset asked for where the CPU path quantized them itself."""
    return f"{requested} -> {ran} on CPU" if requested and requested != ran else ran


def configuration_label(stats: ReplyStats) -> str:
    """What produced a reply, in the words every view uses: model · quantization (as asked -> as it ran) · attention,
    e.g. "embedded · nf4 -> int4 on CPU · sdpa"."""
    model = stats.model or "?"
    model = "embedded" if model.endswith("(embedded)") else model
    if stats.quantization == "remote":
        return f"{model} · remote"
    ran = "nf4-nodq" if stats.quantization == "nf4" and not stats.double_quant else (stats.quantization or "?")
    parts = [model, quantization_label(ran, stats.quantization_requested), stats.attention or "?"]
    if stats.kv_cache not in ("", "bf16"):
        parts.append(f"{stats.kv_cache} KV")
    return " · ".join(parts)


class TokenClock:
    """Stamps generated tokens as they reach the host; thread-safe (the worker writes, the UI thread reads)."""

    def __init__(self, start_s: float | None = None) -> None:
        self.start_s = time.perf_counter() if start_s is None else start_s
        self._lock = threading.Lock()
        self._first_s: float | None = None
        self._last_s: float | None = None
        self._count = 0
        self.token_ids: list[int] = []

    def on_tokens(self, ids: list[int], times: list[float] | None = None) -> None:
        """Stamp `ids` as arrived now, or at `times` (one per id: when the scheduler delivered them)."""
        now = time.perf_counter()
        first, last = (times[0], times[-1]) if times else (now, now)
        with self._lock:
            if self._first_s is None:
                self._first_s = first
            self._last_s = last
            self._count += len(ids)
            self.token_ids.extend(ids)

    def snapshot(self) -> dict[str, Any]:
        """new_tokens, ttft_s, decode_s and decode_tokens_per_s so far (ReplyStats field names)."""
        with self._lock:
            count, first, last = self._count, self._first_s, self._last_s
        ttft = None if first is None else first - self.start_s
        decode_s = None if first is None or last is None else last - first
        rate = (count - 1) / decode_s if decode_s and count > 1 else None
        return {"new_tokens": count, "ttft_s": ttft, "decode_s": decode_s, "decode_tokens_per_s": rate}


def format_mib(n: int | float | None) -> str:
    """Bytes in MiB with one decimal: how every view writes a reply's peak memory (tables and panels alike)."""
    return "n/a" if n is None else f"{n / 2**20:,.1f} MiB"


def format_bytes(n: int | float | None) -> str:
    if n is None:
        return "n/a"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{int(n)} B"


def export_json(stats: list[ReplyStats], path: str | os.PathLike[str]) -> Path:
    out = Path(path)
    out.write_text(json.dumps([s.as_dict() for s in stats], indent=2, ensure_ascii=False), encoding="utf-8")
    return out


def flat_row(stats: ReplyStats | dict[str, Any]) -> dict[str, Any]:
    """One CSV/table row: nested fields flattened (versions -> "torch 2.13.0; ...", notes joined)."""
    row = dict(stats.as_dict() if isinstance(stats, ReplyStats) else stats)
    versions = row.pop("versions", {}) or {}
    row["versions"] = "; ".join(f"{k} {v}" for k, v in versions.items()) if isinstance(versions, dict) else str(
        versions)
    notes = row.get("notes") or []
    row["notes"] = " ".join(str(n) for n in notes) if isinstance(notes, (list, tuple)) else str(notes)
    return row


def export_csv(stats: list[ReplyStats] | list[dict[str, Any]], path: str | os.PathLike[str]) -> Path:
    import csv

    out = Path(path)
    rows = [{k: escape_csv_cell(v) for k, v in flat_row(s).items()} for s in stats]  # no cell runs as a formula
    columns = [f.name for f in dataclasses.fields(ReplyStats)]
    with out.open("w", newline="", encoding="utf-8") as fh:
        writer = csv.DictWriter(fh, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    return out


def read_csv(path: str | os.PathLike[str]) -> list[dict[str, str]]:
    import csv

    with Path(path).open(newline="", encoding="utf-8") as fh:
        return list(csv.DictReader(fh))
