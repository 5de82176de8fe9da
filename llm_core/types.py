"""What a load produces (LoadedModel) and how it went (LoadReport): imported by every layer, importing none above it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from .config import ModelSettings
from .metrics import quantization_label
from .models import ModelSource


@dataclass(frozen=True)
class LoadReport:
    """What was loaded and how; shown in the model panel and attached to every exported stat."""

    model: str
    origin: str  # embedded | local | hub
    revision: str | None
    quantization: str
    double_quant: bool
    compute_dtype: str
    attention: str
    device: str
    device_name: str
    offloaded: bool  # some layers on CPU/disk through max_memory
    weights_bytes: int  # model.get_memory_footprint(): parameters + buffers as stored
    load_s: float
    context_length: int
    versions: dict[str, str]
    notes: tuple[str, ...] = ()
    quantized_linear_layers: int = 0  # bitsandbytes layers, or the linears the CPU path quantized itself
    quantization_requested: str = ""  # the preset asked for, where the CPU path quantized the weights itself
    decode_path: str = "plain"  # set by the engine after warm-up
    decode_path_reason: str = ""
    warmup_s: float = 0.0
    memory_plan: str = ""  # set by the engine after warm-up: budget, KV cache, prefill chunks
    startup_notes: tuple[str, ...] = ()  # set by the engine after warm-up: what start-up re-sized, chose or fell back

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def quantization_label(self) -> str:
        return quantization_label(self.quantization, self.quantization_requested)

    def _quantized_layers_text(self) -> str:
        if self.quantization_requested:  # the CPU path's own int4/int8 linears, fused per layer
            return f"{self.quantized_linear_layers} ({self.quantization}, quantized by the CPU path at load)"
        if self.quantization == "none":
            return "none (unquantized weights)"
        return f"{self.quantized_linear_layers} (bitsandbytes)"

    def as_markdown(self) -> str:
        rows = [
            ("Model", self.model),
            ("Source", self.origin + (f" @ {self.revision}" if self.revision else "")),
            ("Quantization", self.quantization_label + (" + double quant" if self.double_quant else "")),
            ("Compute dtype", self.compute_dtype),
            ("Attention", self.attention),
            ("Device", f"{self.device} ({self.device_name})" + (", CPU offload" if self.offloaded else "")),
            ("Weights memory", f"{self.weights_bytes / 2**20:,.1f} MiB"),
            ("Quantized linear layers", self._quantized_layers_text()),
            ("Context length", f"{self.context_length:,} tokens"),
            ("Load time", f"{self.load_s:.1f} s (warm-up {self.warmup_s:.1f} s)"),
            ("Decode path", self.decode_path + (f" ({self.decode_path_reason})" if self.decode_path_reason else "")),
            *([("Memory", self.memory_plan)] if self.memory_plan else []),
            ("Versions", ", ".join(f"{k} {v}" for k, v in self.versions.items())),
        ]
        text = "| | |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in rows)
        if self.notes:
            text += "\n\n" + "\n".join(f"- {n}" for n in self.notes)
        if self.startup_notes:
            text += "\n\n**Start-up**\n\n" + "\n".join(f"- {n}" for n in self.startup_notes)
        return text


@dataclass
class LoadedModel:
    """A model ready to generate: held by the engine for the life of the process."""

    model: Any  # transformers PreTrainedModel
    tokenizer: Any
    settings: ModelSettings
    device: torch.device
    compute_dtype: torch.dtype
    report: LoadReport
    source: ModelSource
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def context_length(self) -> int:
        return self.report.context_length

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """The ids that end a reply: the generation config's (one or several), else the tokenizer's."""
        eos = getattr(self.model.generation_config, "eos_token_id", None)
        if eos is None:
            eos = getattr(self.tokenizer, "eos_token_id", None)
        if eos is None:
            return frozenset()
        return frozenset(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]))
